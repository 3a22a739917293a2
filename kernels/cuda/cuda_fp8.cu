/*
 * cuda_fp8.cu — FP8 linears (kernels/backend.h, "FP8 linears"): upload
 * and matmul. A matmul quantizes the step's bf16 activations to e4m3 with a
 * scale a token (one kernel), then either the decode GEMV
 * (cuda_gemv_fp8.cu, 1..8 tokens on Hopper; fl_cuda_fp8_gemv_takes) or one
 * cuBLASLt e4m3 x e4m3 -> bf16 GEMM that applies the weights' row scales
 * and the tokens' scales as outer vectors
 * (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F), accumulating in f32 without
 * fast accumulation (FL_CUDA_TUNE=fp8_fast_accum=1 turns it on: prefill
 * +10 %, error bounded by test_matmul_fp8_fast_accum, docs/cuda.md). bench/bench_fp8.cu
 * measured the layouts this picks.
 *
 * cuBLASLt's plan for a shape (descriptors and the heuristic's algorithm)
 * is made once and kept: a decode step runs the same few shapes hundreds
 * of times, and the heuristic query costs host time every call.
 */
#include <cublasLt.h>
#include <float.h>
#include <pthread.h>

#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_workspace.h"

/* Outer-vector scales came with cuBLAS 12.9; older toolkits hold FP8 linears
 * as bf16 (fl_cuda_fp8_takes). */
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
#define FL_FP8_LT 1
#else
#define FL_FP8_LT 0
#endif

/* One token a block: the row's absmax, then codes = x * (1 / s), s =
 * absmax / 448, rounded to nearest even and saturated (the contract's IEEE
 * reciprocal and product, as the CPU backend computes them), into q
 * [n, in]. F16: the FP8 GEMV's form (cuda_gemv_fp8.cu): each code's value
 * as f16 (exact), so the GEMV converts only the weights, in groups of 4
 * columns with the n tokens' groups side by side (q [in / 4][n][4]), so a
 * warp's 8-byte loads of 8 tokens x 4 groups are 1-2 cache lines instead
 * of 8. A PDL launch: the previous kernel writes x, and may still read q
 * (the previous FP8 matmul's GEMV), so nothing is touched before the wait. */
template <bool F16>
static __global__ void fp8_quant_rows(const __nv_bfloat16 *__restrict__ x, int n, int in, void *__restrict__ q,
                                      float *__restrict__ scale) {
    pdl_enter();
    typedef typename std::conditional<F16, __half, __nv_fp8_e4m3>::type code_t;
    /* where column c of this token goes (F16: column group c / 4, token, c % 4) */
    code_t *qr = (code_t *)q + (size_t)blockIdx.x * (F16 ? 4 : in);
    auto at = [&](int c) -> code_t & { return F16 ? qr[((size_t)(c >> 2) * n << 2) + (c & 3)] : qr[c]; };
    if ((int)blockIdx.x >= n) { /* a padding token (cuBLASLt's sixteens; F16 grids have n blocks): zero codes */
        if (!F16) {
            for (int i = threadIdx.x; i < in; i += blockDim.x) qr[i] = code_t(0.0f);
            if (threadIdx.x == 0) scale[blockIdx.x] = 1.0f;
        }
        return;
    }
    const __nv_bfloat16 *r = x + (size_t)blockIdx.x * in;
    const bool vec = in % 8 == 0 && ((uintptr_t)x & 15) == 0; /* 16-byte loads of whole 8-element chunks */
    float m = 0.0f;
    if (vec) {
        for (int i = threadIdx.x * 8; i < in; i += blockDim.x * 8) {
            const uint4 u = *reinterpret_cast<const uint4 *>(r + i);
            const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
            for (int k = 0; k < 4; k++) {
                const float2 f = __bfloat1622float2(h[k]);
                m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
        }
    } else {
        for (int i = threadIdx.x; i < in; i += blockDim.x) m = fmaxf(m, fabsf(__bfloat162float(r[i])));
    }
    __shared__ float red[32];
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
    /* FLT_MIN keeps 1 / s finite for the tiniest rows (backend.h) */
    const float s = m > 0.0f ? fmaxf(__fdiv_rn(m, 448.0f), FLT_MIN) : 1.0f, inv = __frcp_rn(s);
    /* the code of v, as the form stores it */
    auto code = [&](float v) { return code_t(__nv_fp8_e4m3(__fmul_rn(v, inv))); };
    if (vec) {
        for (int i = threadIdx.x * 8; i < in; i += blockDim.x * 8) {
            const uint4 u = *reinterpret_cast<const uint4 *>(r + i);
            const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
            __align__(16) code_t o[8];
            for (int k = 0; k < 4; k++) {
                const float2 f = __bfloat1622float2(h[k]);
                o[2 * k] = code(f.x);
                o[2 * k + 1] = code(f.y);
            }
            if (F16) { /* two groups of 4 */
                *reinterpret_cast<uint2 *>(&at(i)) = *reinterpret_cast<const uint2 *>(o);
                *reinterpret_cast<uint2 *>(&at(i + 4)) = *reinterpret_cast<const uint2 *>(o + 4);
            } else {
                *reinterpret_cast<uint2 *>(qr + i) = *reinterpret_cast<const uint2 *>(o);
            }
        }
    } else {
        for (int i = threadIdx.x; i < in; i += blockDim.x) at(i) = code(__bfloat162float(r[i]));
    }
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
}

/* FP8 matmuls enqueued, GEMV or cuBLASLt (fl_cuda_fp8_gemm_launches) */
static long g_launches;
static pthread_mutex_t g_count_lock = PTHREAD_MUTEX_INITIALIZER;
static void count_launch(void) {
    pthread_mutex_lock(&g_count_lock);
    g_launches++;
    pthread_mutex_unlock(&g_count_lock);
}

#if FL_FP8_LT
/* --- cuBLASLt plans, one a (device, rows, in, tokens) ---------------------------
 * An open-addressed table that doubles at half full: a workload meets a few
 * shapes at hundreds of token counts, and each lookup must cost next to
 * nothing. */
typedef struct fp8_plan {
    int dev; /* an algorithm is the GPU's; backends on one GPU share plans */
    int rows, n, in;
    int fast; /* fast accumulation (fp8_fast_accum) */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
} fp8_plan;

static fp8_plan **g_plans;
static size_t g_cap, g_used;
static pthread_mutex_t g_plan_lock = PTHREAD_MUTEX_INITIALIZER;

/* cuBLAS documents a cublasHandle_t as usable for cuBLASLt by a cast: the
 * backend's handle, bound to its device and stream. */
static cublasLtHandle_t lt_handle(const fl_cuda *c) { return (cublasLtHandle_t)c->cublas; }

static size_t plan_hash(int dev, int rows, int n, int in, int fast) {
    uint64_t h = (uint64_t)(uint32_t)(2 * dev + 2 + fast) * 0x9e3779b97f4a7c15ull;
    h ^= ((uint64_t)(uint32_t)rows << 32 | (uint32_t)in) * 0xbf58476d1ce4e5b9ull;
    h ^= (uint64_t)(uint32_t)n * 0x94d049bb133111ebull;
    return (size_t)(h ^ (h >> 29));
}

static fp8_plan **plan_slot(int dev, int rows, int n, int in, int fast) {
    for (size_t i = plan_hash(dev, rows, n, in, fast) & (g_cap - 1);; i = (i + 1) & (g_cap - 1)) {
        fp8_plan *p = g_plans[i];
        if (!p || (p->dev == dev && p->rows == rows && p->n == n && p->in == in && p->fast == fast))
            return &g_plans[i];
    }
}

static fl_status plan_grow(void) {
    const size_t cap = g_cap ? 2 * g_cap : 256;
    fp8_plan **old = g_plans, **t = (fp8_plan **)calloc(cap, sizeof *t);
    if (!t) return FL_ERR(FL_ERR_OOM, "out of memory for FP8 GEMM plans");
    const size_t old_cap = g_cap;
    g_plans = t, g_cap = cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i]) *plan_slot(old[i]->dev, old[i]->rows, old[i]->n, old[i]->in, old[i]->fast) = old[i];
    free(old);
    return FL_OK;
}

/* pa, pb: the first call's scale vectors; cuBLASLt's heuristic refuses
 * outer-vector scaling (invalid value) until both pointers are set. */
static fl_status plan_make(fl_cuda *c, fp8_plan *p, const void *pa, const void *pb) {
    const int rows = p->rows, n = p->n, in = p->in;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    FL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer, sizeof outer));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer, sizeof outer));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa));
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb));
    const int8_t fast = (int8_t)p->fast;
    FL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    /* column-major: y^T [rows, n] = W^T stored [in, rows] (op T) times x^T [in, n] */
    FL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_8F_E4M3, in, rows, in));
    FL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_8F_E4M3, in, n, in));
    FL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_16BF, rows, n, rows));
    cublasLtMatmulPreference_t pref;
    FL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = c->cublas_ws_bytes;
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                            sizeof ws);
    /* the heuristic assumes 256-byte-aligned matrices unless told; callers'
     * activations (and the tail's scratch) are only 16-byte aligned */
    static const cublasLtMatmulPreferenceAttributes_t align[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    const uint32_t sixteen = 16;
    for (int i = 0; i < 4 && s == CUBLAS_STATUS_SUCCESS; i++)
        s = cublasLtMatmulPreferenceSetAttribute(pref, align[i], &sixteen, sizeof sixteen);
    cublasLtMatmulHeuristicResult_t h;
    int found = 0;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(lt_handle(c), p->desc, p->la, p->lb, p->lc, p->lc, pref, 1, &h, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: cuBLASLt offers no FP8 GEMM for [%d, %d] x %d tokens "
                      "(status %d)", rows, in, n, (int)s);
    p->algo = h.algo;
    return FL_OK;
}

static void plan_free(fp8_plan *p) {
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    free(p);
}

/* The plan for a shape, made at its first call; g_plan_lock held. */
static fl_status plan_get(fl_cuda *c, int rows, int n, int in, const void *pa, const void *pb,
                          const fp8_plan **out) {
    const int fast = fl_cuda_tune(FL_CUDA_TUNE_FP8_FAST_ACCUM) > 0;
    if (g_cap) {
        fp8_plan *p = *plan_slot(c->device, rows, n, in, fast);
        if (p) {
            *out = p;
            return FL_OK;
        }
    }
    if (2 * (g_used + 1) > g_cap) FL_TRY(plan_grow());
    fp8_plan *p = (fp8_plan *)calloc(1, sizeof *p);
    if (!p) return FL_ERR(FL_ERR_OOM, "out of memory for an FP8 GEMM plan");
    p->dev = c->device, p->rows = rows, p->n = n, p->in = in, p->fast = fast;
    const fl_status st = plan_make(c, p, pa, pb);
    if (st != FL_OK) {
        plan_free(p);
        return st;
    }
    *plan_slot(c->device, rows, n, in, fast) = p;
    g_used++;
    *out = p;
    return FL_OK;
}

#endif /* FL_FP8_LT */

extern "C" long fl_cuda_fp8_gemm_launches(void) {
    pthread_mutex_lock(&g_count_lock);
    const long n = g_launches;
    pthread_mutex_unlock(&g_count_lock);
    return n;
}

extern "C" bool fl_cuda_fp8_takes(const fl_tensor *host) {
    /* cuBLASLt's FP8 GEMMs want both dimensions in multiples of 16 */
    return FL_FP8_LT && host->dtype == FL_DTYPE_F8_E4M3 && host->ndim == 2 && host->scales && host->shape[0] % 16 == 0 &&
           host->shape[1] % 16 == 0 && host->shape[0] <= INT32_MAX && host->shape[1] <= INT32_MAX;
}

extern "C" fl_status fl_cuda_fp8_upload(fl_backend *b, const fl_tensor *host, fl_tensor *dev) {
    fl_cuda *c = cuda_impl(b);
    const size_t rows = (size_t)host->shape[0], cols = (size_t)host->shape[1];
    void *d = NULL, *s = NULL;
    fl_status st = FL_OK;
    FL_TRY_GOTO(b->ops->alloc(b, rows * cols, &d), st, fail);
    FL_TRY_GOTO(b->ops->alloc(b, rows * sizeof(float), &s), st, fail);
    FL_CUDA_CHECK_GOTO(cudaMemcpyAsync(d, host->data, rows * cols, cudaMemcpyHostToDevice, c->stream), st, fail);
    FL_CUDA_CHECK_GOTO(cudaMemcpyAsync(s, host->scales, rows * sizeof(float), cudaMemcpyHostToDevice, c->stream), st,
                       fail);
    FL_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), st, fail);
    *dev = *host;
    dev->data = d;
    dev->scales = (float *)s;
    dev->bias = NULL;
    dev->owned = 0;
    return FL_OK;
fail:
    if (d) b->ops->free(b, d);
    if (s) b->ops->free(b, s);
    return st;
}

/* y^T [rows, n] = W x^T for n (a multiple of 16) quantized tokens. */
#if !FL_FP8_LT
static fl_status fp8_gemm(fl_cuda *, const fl_tensor *, int, const __nv_fp8_e4m3 *, const float *, void *) {
    return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: FP8 GEMMs need cuBLAS 12.9 or newer");
}
#else
static fl_status fp8_gemm(fl_cuda *c, const fl_tensor *w, int n, const __nv_fp8_e4m3 *xq, const float *sx, void *y) {
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    const void *pa = w->scales, *pb = sx;
    /* a plan's descriptor is shared by every call of its shape and the scale
     * pointers change with the weight: set, and the launch enqueued, under
     * the plans' lock */
    pthread_mutex_lock(&g_plan_lock);
    const fp8_plan *p = NULL;
    const fl_status pst = plan_get(c, rows, n, in, pa, pb, &p);
    if (pst != FL_OK) {
        pthread_mutex_unlock(&g_plan_lock);
        return pst;
    }
    cublasLtMatmulDesc_t d = p->desc;
    cublasStatus_t s = cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb);
    const float one = 1.0f, zero = 0.0f;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmul(lt_handle(c), d, &one, w->data, p->la, xq, p->lb, &zero, y, p->lc, y, p->lc, &p->algo,
                           c->cublas_ws, c->cublas_ws_bytes, c->stream);
    pthread_mutex_unlock(&g_plan_lock);
    if (s == CUBLAS_STATUS_SUCCESS) count_launch();
    if (s != CUBLAS_STATUS_SUCCESS)
        return fl_error_set(FL_ERR_CUBLAS, __FILE__, __LINE__, "cublasLtMatmul (FP8 [%d, %d] x %d tokens) failed: %s",
                            rows, in, n, cublasGetStatusString(s));
    return FL_OK;
}

#endif

extern "C" fl_status fl_cuda_fp8_matmul(fl_backend *b, const void *x, int n, const fl_tensor *w,
                                        const fl_tensor *bias, void *y) {
    fl_cuda *c = cuda_impl(b);
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    float *ws;
    /* decode-sized batches: the GEMV (cuda_gemv_fp8.cu) streams the weights
     * near the copy ceiling where cuBLASLt does not; its x is the codes'
     * f16 values in column groups, then the scales (16-byte aligned:
     * in % 16 == 0) */
    if (fl_cuda_fp8_gemv_takes(b, n, w)) {
        const size_t xb = (size_t)n * in * sizeof(__half);
        FL_TRY(fl_cuda_workspace_get(b, FL_CUDA_WS_SLOT_FP8, xb + (size_t)n * sizeof(float), "fp8 matmul", &ws));
        float *sx = (float *)((char *)ws + xb);
        FL_TRY(launch_pdl(fp8_quant_rows<true>, dim3((unsigned)n), dim3(256), 0, c->stream, (const bf16 *)x, n, in,
                          (void *)ws, sx));
        FL_TRY(fl_cuda_fp8_gemv(b, ws, sx, n, w, bias, y));
        count_launch();
        return FL_OK;
    }
    /* Token counts go to cuBLASLt in multiples of 16 (its FP8 kernels' tile
     * granularity; one plan a sixteen, not a token). The whole sixteens go straight into y;
     * the last n % 16 tokens, padded with zero codes, into a [rows, 16]
     * scratch whose first columns (contiguous: y^T is column-major) are
     * copied out. */
    const int n_main = n / 16 * 16, n_tail = n - n_main, n16 = n_main + (n_tail ? 16 : 0);
    /* the codes, the scales and the tail's output, each 256-byte aligned */
    const size_t code_bytes = ((size_t)n16 * in + 255) / 256 * 256, scale_bytes = ((size_t)n16 * 4 + 255) / 256 * 256;
    const size_t tail_bytes = n_tail ? (size_t)16 * rows * sizeof(__nv_bfloat16) : 0;
    FL_TRY(fl_cuda_workspace_get(b, FL_CUDA_WS_SLOT_FP8, code_bytes + scale_bytes + tail_bytes, "fp8 matmul", &ws));
    __nv_fp8_e4m3 *xq = (__nv_fp8_e4m3 *)ws;
    float *sx = (float *)((char *)ws + code_bytes);
    __nv_bfloat16 *ytail = (__nv_bfloat16 *)((char *)ws + code_bytes + scale_bytes);
    FL_TRY(launch_pdl(fp8_quant_rows<false>, dim3((unsigned)n16), dim3(256), 0, c->stream, (const bf16 *)x, n, in,
                      (void *)xq, sx));
    if (n_main) FL_TRY(fp8_gemm(c, w, n_main, xq, sx, y));
    if (n_tail) {
        FL_TRY(fp8_gemm(c, w, 16, xq + (size_t)n_main * in, sx + n_main, ytail));
        FL_CUDA_CHECK(cudaMemcpyAsync((__nv_bfloat16 *)y + (size_t)n_main * rows, ytail,
                                      (size_t)n_tail * rows * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice,
                                      c->stream));
    }
    if (bias) return fl_cuda_add_bias(b, y, n, rows, bias);
    return FL_OK;
}
