/*
 * cuda_common.cuh — internals shared by the CUDA backend's .cu files: the
 * backend's private state, the CUDA / cuBLAS checking macros, bf16 helpers
 * and the C-linkage launchers each op family exports to cuda_backend.cu.
 *
 * Nothing here is public API: the rest of flotilla sees the CUDA backend
 * only through kernels/backend.h (fl_backend_cuda_init and the op table).
 *
 * Device-side conventions (see cuda_backend.cu for why):
 *  - activations are bf16, all arithmetic is f32;
 *  - upload_weight turns 1-D weights (norm scales, biases) into F32 device
 *    vectors and 2-D float weights into BF16 device matrices; ops accept
 *    either dtype for vectors and tables;
 *  - W4 weights come in two device layouts, chosen by w4_packed(rows, cols,
 *    group) alone (so upload and matmul agree without a flag):
 *    * packed (rows % 16 == 0, cols % 64 == 0, group a power of two >= 64,
 *      i.e. every real model's linear layer): the tensor-core GEMV's
 *      layout, see "W4 packed layout" in cuda_matmul.cu. Codes are 512-byte
 *      units, one per (16-row tile, 64-column block), tile-major; lane l's
 *      16 bytes of a unit are exactly its mma A fragments for the 4 k-steps.
 *      fl_tensor.scales holds uint2 [tiles][groups][8]: {scale, bias} as
 *      __half2 of rows 16 T + g and 16 T + g + 8.
 *    * otherwise row-major codes (uint8 [rows, cols/2], element 2j in the
 *      low nibble of byte j) and one __half2 {scale, bias} per (row, group).
 *    fl_tensor.bias is NULL in both.
 */
#ifndef FL_CUDA_COMMON_CUH
#define FL_CUDA_COMMON_CUH

#include <stdlib.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_fused.h"
#include "kernels/cuda/cuda_test_hooks.h"
#include "kernels/cuda/cuda_tune.h"

/* The backend's private state (fl_backend.impl). */
typedef struct fl_cuda {
    int device;
    cudaStream_t stream;   /* every op is enqueued here */
    cublasHandle_t cublas; /* bound to `stream` */
    int n_sm;
    size_t smem_optin;     /* max dynamic shared memory per block (bytes) */
    void *cublas_ws;       /* cuBLAS workspace, set explicitly so GEMMs can be captured */
    size_t cublas_ws_bytes;
    void *w4_deq;          /* bf16 scratch for one packed W4 weight dequantized (large batches,
                              cuda_matmul.cu), grown at upload_weight to the largest */
    size_t w4_deq_elems;
    int w4_deq_min_n;      /* batches from this size take that path (default 128; w4_dequant_min_n) */
    float *w4g_ws;         /* the W4 GEMM's split-k partial tiles (cuda_w4_gemm.cu), made at the first
                              packed upload */
    int *w4g_cnt;          /* its arrival counters (in the same allocation), one an output tile, zero
                              between launches */
    int layer_rd_slots;    /* the partial sums a decode_layer call left for the next one (its
                              FL_LAYER_H_BACKEND output: cuda_layer.cu) */
} fl_cuda;

static inline fl_cuda *cuda_impl(fl_backend *b) { return (fl_cuda *)b->impl; }

/* --- checking macros ---------------------------------------------------------
 * Record the failing statement, file and line once (FL_ERR_CUDA or
 * FL_ERR_CUBLAS) and return / jump. The GOTO forms store the status for a
 * function with one cleanup path. */
#define FL_CUDA_CHECK(call)                                                                   \
    do {                                                                                      \
        cudaError_t fl_ce_ = (call);                                                          \
        if (fl_ce_ != cudaSuccess) {                                                          \
            (void)cudaGetLastError(); /* reported here: not again by the next launch check */ \
            return fl_error_set(FL_ERR_CUDA, __FILE__, __LINE__, "%s failed: %s (%s)", #call, \
                                cudaGetErrorString(fl_ce_), cudaGetErrorName(fl_ce_));       \
        }                                                                                     \
    } while (0)

#define FL_CUDA_CHECK_GOTO(call, st, label)                                                 \
    do {                                                                                    \
        cudaError_t fl_ce_ = (call);                                                        \
        if (fl_ce_ != cudaSuccess) {                                                        \
            (void)cudaGetLastError();                                                       \
            (st) = fl_error_set(FL_ERR_CUDA, __FILE__, __LINE__, "%s failed: %s (%s)", #call, \
                                cudaGetErrorString(fl_ce_), cudaGetErrorName(fl_ce_));     \
            goto label;                                                                     \
        }                                                                                   \
    } while (0)

#define FL_CUBLAS_CHECK(call)                                                              \
    do {                                                                                   \
        cublasStatus_t fl_cb_ = (call);                                                    \
        if (fl_cb_ != CUBLAS_STATUS_SUCCESS)                                               \
            return fl_error_set(FL_ERR_CUBLAS, __FILE__, __LINE__, "%s failed: %s", #call, \
                                cublasGetStatusString(fl_cb_));                            \
    } while (0)

#define FL_CUBLAS_CHECK_GOTO(call, st, label)                                              \
    do {                                                                                   \
        cublasStatus_t fl_cb_ = (call);                                                    \
        if (fl_cb_ != CUBLAS_STATUS_SUCCESS) {                                             \
            (st) = fl_error_set(FL_ERR_CUBLAS, __FILE__, __LINE__, "%s failed: %s", #call, \
                                cublasGetStatusString(fl_cb_));                            \
            goto label;                                                                    \
        }                                                                                  \
    } while (0)

/* After a <<<>>> launch: a bad configuration shows up in cudaGetLastError.
 * The check macros clear the last-error state when they report a failed
 * call, so a launch check never re-reports an earlier, already reported
 * error as its own. */
#define FL_CUDA_LAUNCH_CHECK(name) FL_CUDA_CHECK(cudaGetLastError())

/* --- device helpers ------------------------------------------------------- */
typedef __nv_bfloat16 bf16;

static __device__ __forceinline__ float bf2f(bf16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ bf16 f2bf(float v) { return __float2bfloat16_rn(v); }

/* A float device vector (norm weight, bias) of dtype F32 or BF16. */
static __device__ __forceinline__ float vec_load(const void *p, int f32, int64_t i) {
    return f32 ? ((const float *)p)[i] : bf2f(((const bf16 *)p)[i]);
}

/* 8 bf16 in one 16-byte word (element 2i in the low half of word i) <-> f32. */
static __device__ __forceinline__ void bf16x8_unpack(const uint4 &u, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}
static __device__ __forceinline__ uint4 bf16x8_pack(const float (&f)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) { /* one cvt.rn.bf16x2.f32 a pair, the same rounding as f2bf */
        const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        w[i] = *(const uint32_t *)&h;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}
/* 16 int8 codes (element i in byte i % 4 of word i / 4) times sc, in f32,
 * the same values as (float)(int8_t)code * sc: each code, biased to
 * unsigned, becomes the low mantissa byte of 2^23 (one byte permute) and
 * 2^23 + 128 is subtracted, exactly. (float)(int8_t) is an I2F, a
 * quarter-rate conversion that bounded the int8 KV attention kernels. */
static __device__ __forceinline__ void i8x16_scaled(const uint4 &raw, float sc, float (&f)[2][8]) {
    const uint32_t w[4] = {raw.x ^ 0x80808080u, raw.y ^ 0x80808080u, raw.z ^ 0x80808080u, raw.w ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 16; i++)
        f[i / 8][i % 8] = (__uint_as_float(__byte_perm(w[i / 4], 0x4B000000u, 0x7540u | (i % 4))) - 8388736.0f) * sc;
}
/* 16 float8_e4m3fn codes (the same order) times sc, in f32: pairs through
 * the hardware e4m3x2 -> f16x2 conversion, exact, as every later step. */
static __device__ __forceinline__ void f8x16_scaled(const uint4 &raw, float sc, float (&f)[2][8]) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const __half2_raw hr =
            __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i / 2] >> (16 * (i % 2))), __NV_E4M3);
        const float2 v = __half22float2(__half2(hr));
        f[(2 * i) / 8][(2 * i) % 8] = v.x * sc;
        f[(2 * i + 1) / 8][(2 * i + 1) % 8] = v.y * sc;
    }
}
/* A quantized KV record's 16 codes (kernels/backend.h): int8, or e4m3 when
 * fp8 (kv_fp8_codes; uniform across a launch, so the branch never diverges). */
static __device__ __forceinline__ void kv16_scaled(const uint4 &raw, float sc, bool fp8, float (&f)[2][8]) {
    if (fp8) f8x16_scaled(raw, sc, f);
    else i8x16_scaled(raw, sc, f);
}
/* One code of a quantized KV record as f32 (the scale apart). */
static __device__ __forceinline__ float kv_code_f32(uint8_t c, bool fp8) {
    return fp8 ? __half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3))) : (float)(int8_t)c;
}
static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

static inline unsigned cdiv_u(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }

/* One RoPE rotation of the pair (a, b) by angle (c, s), rounded to bf16:
 * r0 = a c - b s, r1 = b c + a s, each product and sum rounded once (no FMA
 * contraction), so the two kernels that rotate q|k (rope_kv_store_kernel
 * and the q|k|v GEMV's rope epilogue, cuda_gemv_bulk.cu) give the same bits
 * whatever the compiler contracts in each. */
static __device__ __forceinline__ void rope_pair(float a, float b, float c, float s, bf16 &r0, bf16 &r1) {
    r0 = f2bf(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    r1 = f2bf(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

/* --- programmatic dependent launch (PDL) ---------------------------------
 * Why: a decode step is a chain of short kernels, and each boundary costs a
 * launch plus the next kernel's ramp (~1-3 us against GEMVs of ~10 us). A
 * kernel launched with launch_pdl may start while its predecessor still
 * runs; pdl_enter() at its top lets its own successor launch and waits
 * until the predecessor has completed (and its writes are visible) before
 * touching memory (in that order by default: FL_PDL_EARLY below), so the
 * successor's launch and weight prefetch (the W4 GEMV requests weights
 * before its wait) overlap this kernel. Every kernel
 * launched with launch_pdl must call pdl_enter() before any global access.
 * The pdl override (cuda_tune.h) at 0 turns the attribute off (every
 * launch then waits as usual). */
/* FL_PDL_EARLY (default 1; build with -DFL_PDL_EARLY=0 for the other
 * order): let the successor launch before waiting rather than after, which
 * measured faster end to end on the dense and Mixtral presets and within
 * noise on the others. Safe either way: a
 * successor's griddepcontrol.wait returns only once this grid has completed,
 * and this grid completes only after its own wait, so the order is kept
 * transitively; and a successor launches only when every block of this
 * grid has started, so waiting blocks can never starve it of SMs. Early,
 * the W4 GEMV after a short kernel starts requesting weights while the GEMV
 * before that one is still streaming, so HBM stays busy across the
 * boundary. */
#ifndef FL_PDL_EARLY
#define FL_PDL_EARLY 1
#endif
static __device__ __forceinline__ void pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
static __device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void pdl_enter(void) {
    if (FL_PDL_EARLY) pdl_trigger();
    pdl_wait();
    if (!FL_PDL_EARLY) pdl_trigger();
}

/* A norm weight the kernels take (vec_load / norm_load_w): an F32 or BF16
 * device vector of d elements; op names the caller in the error. */
static inline fl_status cuda_norm_weight_ok(const fl_tensor *w, int64_t d, const char *op) {
    if (w->dtype != FL_DTYPE_F32 && w->dtype != FL_DTYPE_BF16)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda %s: weight dtype %s (expected an F32/BF16 device vector)", op,
                      fl_dtype_name(w->dtype));
    if (fl_tensor_numel(w) != d)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: weight has %lld elements, rows have %lld", op,
                      (long long)fl_tensor_numel(w), (long long)d);
    return FL_OK;
}

/* An on/off override of cuda_tune.h (default on: -1 or 1; 0 turns the
 * default path off, the A/B). */
static inline bool cuda_tune_on(fl_cuda_tune_id id) { return fl_cuda_tune_values[id] != 0; }

/* Programmatic dependent launch, unless the pdl override is 0. */
static inline int fl_cuda_pdl_on(void) { return fl_cuda_tune_values[FL_CUDA_TUNE_PDL] != 0; }

/* A launch with programmatic dependent launch (unless the pdl override is 0) and,
 * for cx > 0, blocks in clusters of cx along x (distributed shared memory;
 * sm_90). */
template <typename... K, typename... A>
static fl_status launch_pdl_cluster(void (*kern)(K...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, int cx,
                                    A... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    int na = 0;
    if (cx > 0) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = (unsigned)cx, attr[na].val.clusterDim.y = 1, attr[na].val.clusterDim.z = 1;
        na++;
    }
    if (fl_cuda_pdl_on()) {
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = na;
    FL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, args...));
    return FL_OK;
}

template <typename... K, typename... A>
static fl_status launch_pdl(void (*kern)(K...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, A... args) {
    return launch_pdl_cluster(kern, grid, block, smem, st, 0, args...);
}

/* Whether a W4 weight [rows, cols] with this group uses the packed device
 * layout (see the top of this file). */
static inline bool w4_packed(int64_t rows, int64_t cols, int group) {
    return rows > 0 && rows % 16 == 0 && cols > 0 && cols % 64 == 0 && group >= 64 &&
           (group & (group - 1)) == 0 && cols % group == 0 && rows <= INT32_MAX && cols <= INT32_MAX;
}

/* --- C-linkage launchers (one per op; contracts in kernels/backend.h) --------
 * Each takes the backend (for its stream), checks its arguments and the
 * launch, and returns a status. */
#ifdef __cplusplus
extern "C" {
#endif
fl_status fl_cuda_embed(fl_backend *b, const fl_tensor *table, const int32_t *ids, int n, void *out);
fl_status fl_cuda_rmsnorm(fl_backend *b, const void *x, const fl_tensor *w, float eps, int n, int d,
                          void *out);
fl_status fl_cuda_matmul(fl_backend *b, const void *x, int n, const fl_tensor *w,
                         const fl_tensor *bias, void *y);
fl_status fl_cuda_rope(fl_backend *b, void *x, int n_tok, int n_heads, int head_dim, int stride,
                       const float *cos, const float *sin, int rot_dim, bool interleaved);
fl_status fl_cuda_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                                int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                                const float *cos, const float *sin, int rot_dim, bool interleaved,
                                const int32_t *slots, void *k_cache, void *v_cache);
/* The W4 tensor-core GEMM (cuda_w4_gemm.cu): packed layout, 16-byte x. */
bool fl_cuda_w4_gemm_takes(const void *x, int rows, int in, int group);
fl_status fl_cuda_w4_gemm(fl_backend *b, const bf16 *x, int n, int in, int rows, const fl_tensor *w, const void *bias,
                          int bias_f32, bf16 *y);
/* its split-k workspace and shared-memory opt-in, once (upload_weight) */
fl_status fl_cuda_w4_gemm_reserve(fl_backend *b);
fl_status fl_cuda_kv_store(fl_backend *b, const void *k, const void *v, int n_tok, int kv_dim,
                           int stride, const int32_t *slots, void *k_cache, void *v_cache);
fl_status fl_cuda_attention(fl_backend *b, const void *q, int q_stride, const fl_attn_meta *m,
                            int n_heads, int n_kv_heads, int head_dim, float scale,
                            const void *k_cache, const void *v_cache, void *out);
fl_status fl_cuda_moe_gate_up_silu(fl_backend *b, const void *x, int n, int k, const int32_t *list, int n_local,
                                   const fl_tensor *gate_table, const fl_tensor *up_table, const fl_tensor *gate0,
                                   const fl_tensor *up0, void *gu, void *out);
fl_status fl_cuda_silu_mul(fl_backend *b, const void *gate, const void *up, int n, int d, int stride,
                           void *out);
fl_status fl_cuda_add(fl_backend *b, void *x, const void *y, size_t n);
fl_status fl_cuda_add_rmsnorm(fl_backend *b, void *x, const void *y, const fl_tensor *w, float eps,
                              int n, int d, void *out);
/* add_rmsnorm out of place: x_out = x + y, out = rmsnorm(x_out) * w, as
 * add_rmsnorm gives (x_out may equal x; out aliases none of them). */
fl_status fl_cuda_add_rmsnorm_to(fl_backend *b, const void *x, const void *y, void *x_out, const fl_tensor *w,
                                 float eps, int n, int d, void *out);
/* fl_cuda_rms_defer_apply: cuda_test_hooks.h. */
fl_status fl_cuda_moe_topk(fl_backend *b, const void *logits, int n, int n_experts, int k,
                           const fl_moe_route *r, int32_t *ids, float *weights);
fl_status fl_cuda_gather_rows(fl_backend *b, const void *src, const int32_t *idx, int n_idx, int d,
                              void *dst);
fl_status fl_cuda_scatter_add_rows(fl_backend *b, void *dst, const void *src, const int32_t *idx,
                                   const float *scale, int n_idx, int d);
fl_status fl_cuda_sigmoid_scale_rows(fl_backend *b, void *x, const void *g, int n, int d);
fl_status fl_cuda_argmax_rows(fl_backend *b, const void *x, int n, int d, int offset, float *out);
fl_status fl_cuda_copy_2d(fl_backend *b, void *dst, int dst_stride, const void *src, int src_stride, int n,
                          int w);
size_t fl_cuda_sample_rows_ws(fl_backend *b, int n, int d);
fl_status fl_cuda_sample_rows(fl_backend *b, const void *x, int n, int d, const fl_sample_row *rows,
                              const int32_t *hist, bool any_top_p, void *ws, int32_t *out);
/* bf16 matmuls of up to 64 rows and 16 tokens (cuda_gemv_rows.cu; which it
 * takes: fl_cuda_gemv_rows_takes, cuda_test_hooks.h). */
fl_status fl_cuda_gemv_rows(fl_backend *b, const void *x, int n, const fl_tensor *w, const fl_tensor *bias, void *y);
fl_status fl_cuda_moe_group(fl_backend *b, const int32_t *ids, int n, int k, int e_lo, int n_local,
                            int32_t *list);
fl_status fl_cuda_moe_matmul(fl_backend *b, const void *x, int x_per_pair, int n, int k, const int32_t *list,
                             int n_local, const fl_tensor *table, const fl_tensor *w0, void *out);
fl_status fl_cuda_moe_combine(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                              const float *weights, int n, int k, int e_lo, int n_local, int d);
fl_status fl_cuda_mla_rope_norm_store(fl_backend *b, void *q, int q_stride, void *ckv, int n_tok, int n_heads,
                                     int nope, int rope, int kvl, const float *cos, const float *sin,
                                     const fl_tensor *kv_norm, float eps, const int32_t *slots, void *k_cache,
                                     void *v_cache);
fl_status fl_cuda_qknorm_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                                      int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                                      const fl_tensor *q_norm, const fl_tensor *k_norm, float eps,
                                      const float *cos, const float *sin, int rot_dim, bool interleaved,
                                      const int32_t *slots, void *k_cache, void *v_cache);
fl_status fl_cuda_moe_combine_add_rmsnorm(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                                          const float *weights, int n, int k, int e_lo, int n_local, int d,
                                          const void *extra, void *x, const fl_tensor *w, float eps, void *out);
/* Repacks row-major W4 codes (src, device, uint8 [rows, cols/2]) into the
 * packed layout (dst, device, same size); w4_packed(rows, cols, ...) must hold. */
fl_status fl_cuda_w4_repack(fl_backend *b, const void *src, void *dst, int rows, int cols);
/* Grows the W4 dequantization scratch for a packed [rows, cols] weight
 * (called at upload_weight, never inside a capture). */
fl_status fl_cuda_w4_deq_reserve(fl_backend *b, int64_t rows, int64_t cols);
/* The bf16 decode GEMV (cuda_gemv_bf16.cu), where fl_cuda_bf16_gemv_takes
 * (cuda_test_hooks.h) says it takes the matmul. */
fl_status fl_cuda_bf16_gemv(fl_backend *b, const void *x, int n, const fl_tensor *w, const fl_tensor *bias,
                            void *y);
/* Its gated-MLP form: out = silu(x gate^T) * (x up^T) in one launch where
 * the plain GEMV takes the stacked gate|up (up NULL: gate is stacked); rd
 * (NULL: none) a deferred norm scaled in its epilogue. */
int fl_cuda_bf16_gate_up_silu_max_n(fl_backend *b, const fl_tensor *gate, const fl_tensor *up);
fl_status fl_cuda_bf16_gate_up_silu(fl_backend *b, const void *x, int n, const fl_tensor *gate, const fl_tensor *up,
                                    void *out, const fl_rms_defer *rd);
/* y[n, rows] += bias[rows] (bias F32 or BF16 device vector); used after cuBLAS. */
fl_status fl_cuda_add_bias(fl_backend *b, void *y, int n, int rows, const fl_tensor *bias);
/* FP8 linears (cuda_fp8.cu): whether upload keeps one as FP8 (else it is
 * expanded to bf16), its upload, and its matmul. */
bool fl_cuda_fp8_takes(const fl_tensor *host);
fl_status fl_cuda_fp8_upload(fl_backend *b, const fl_tensor *host, fl_tensor *dev);
fl_status fl_cuda_fp8_matmul(fl_backend *b, const void *x, int n, const fl_tensor *w, const fl_tensor *bias, void *y);
/* Its decode GEMV (cuda_gemv_fp8.cu), where fl_cuda_fp8_gemv_takes
 * (cuda_test_hooks.h) says it takes the matmul: y[n, rows] from the tokens'
 * e4m3 codes as f16 values in column groups, xh [in / 4][n][4] (device,
 * 8-byte aligned), and their scales sx [n], which fl_cuda_fp8_matmul's
 * quantization wrote before it on the stream. */
fl_status fl_cuda_fp8_gemv(fl_backend *b, const void *xh, const float *sx, int n, const fl_tensor *w,
                           const fl_tensor *bias, void *y);
#ifdef __cplusplus
}
#endif

#endif /* FL_CUDA_COMMON_CUH */
