/*
 * cuda_qknorm.cu — Qwen3's per-head q and k RMSNorms, RoPE and the K/V
 * store in one launch (qknorm_rope_kv_store; contract in kernels/backend.h,
 * reference kernels/cpu/cpu_ops.c).
 *
 * Why: with the norms apart, a Qwen3 layer's attention input took five
 * launches after its q, k and v GEMVs (rmsnorm of q, of k, rope_kv_store),
 * each a dependent stage of pure latency at decode sizes under Nsight
 * Compute, and
 * the q|k|v weights could not be stacked, because the norms read q and k as
 * contiguous rows. Here a warp takes one head of one token (q heads, then k,
 * then v): it normalizes the head in place (rmsnorm_kernel's arithmetic,
 * w * (x * inv) rounded to bf16; the squares summed lane by lane then across
 * the warp), rotates it (rope_pair, as rope_kv_store_kernel) and, for k and
 * v, stores it into the token's cache slot. Rows are strided, so q, k and v
 * may be the slices of one fused q|k|v matmul's output. The norm weights
 * are loaded before the PDL wait.
 */
#include "kernels/cuda/cuda_common.cuh"

#define QKN_MAX_HD 256 /* head_dim at most (8 values a lane) */
#define QKN_WARPS 8

static __global__ void __launch_bounds__(QKN_WARPS * 32)
    qknorm_rope_kv_kernel(bf16 *q, bf16 *k, const bf16 *v, int n_heads, int n_kv, int hd, int q_stride, int kv_stride,
                          const void *qw, int qw32, const void *kw, int kw32, float eps, const float *cos,
                          const float *sin, int half, int interleaved, const int32_t *slots, bf16 *kc, bf16 *vc) {
    if (FL_PDL_EARLY) pdl_trigger();
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const int h = blockIdx.y * QKN_WARPS + (threadIdx.x >> 5); /* the warp's head: q, then k, then v */
    if (h >= n_heads + 2 * n_kv) {
        pdl_wait();
        if (!FL_PDL_EARLY) pdl_trigger();
        return;
    }
    const int kind = h < n_heads ? 0 : h < n_heads + n_kv ? 1 : 2, hh = h - (kind == 0 ? 0 : kind == 1 ? n_heads : n_heads + n_kv);
    constexpr int PER = QKN_MAX_HD / 32;
    float wv[PER];
    if (kind < 2) { /* the norm weight never depends on the previous kernel */
#pragma unroll
        for (int m = 0; m < PER; m++) {
            const int j = lane + 32 * m;
            wv[m] = j < hd ? (kind == 0 ? vec_load(qw, qw32, j) : vec_load(kw, kw32, j)) : 0.0f;
        }
    }
    pdl_wait(); /* q, k and v come from the previous kernel */
    if (!FL_PDL_EARLY) pdl_trigger();
    const int32_t slot = slots ? slots[t] : -1; /* NULL: no store (an int8 cache is stored after) */
    const int kv_dim = n_kv * hd;
    if (kind == 2) { /* v: into the cache as it is */
        if (slot < 0) return;
        const bf16 *src = v + (int64_t)t * kv_stride + (int64_t)hh * hd;
        bf16 *dst = vc + (int64_t)slot * kv_dim + (int64_t)hh * hd;
        for (int j = lane; j < hd; j += 32) dst[j] = src[j];
        return;
    }
    bf16 *x = (kind == 0 ? q + (int64_t)t * q_stride : k + (int64_t)t * kv_stride) + (int64_t)hh * hd;
    float xv[PER], ss = 0.0f;
#pragma unroll
    for (int m = 0; m < PER; m++) {
        const int j = lane + 32 * m;
        xv[m] = j < hd ? bf2f(x[j]) : 0.0f;
        ss += xv[m] * xv[m];
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll
    for (int m = 0; m < PER; m++) {
        const int j = lane + 32 * m;
        if (j < hd) x[j] = f2bf(wv[m] * (xv[m] * inv));
    }
    __syncwarp(); /* the normed head, written by the whole warp, is what the pairs read */
    bf16 *kco = kind == 1 && slot >= 0 ? kc + (int64_t)slot * kv_dim + (int64_t)hh * hd : NULL;
    const float *ct = cos + (int64_t)t * half, *st = sin + (int64_t)t * half;
    for (int p = lane; p < half; p += 32) {
        const int i0 = interleaved ? 2 * p : p, i1 = interleaved ? 2 * p + 1 : p + half;
        bf16 r0, r1;
        rope_pair(bf2f(x[i0]), bf2f(x[i1]), ct[p], st[p], r0, r1);
        x[i0] = r0;
        x[i1] = r1;
        if (kco) {
            kco[i0] = r0;
            kco[i1] = r1;
        }
    }
    if (kco) /* k dims past rot_dim as they are */
        for (int j = 2 * half + lane; j < hd; j += 32) kco[j] = x[j];
}

extern "C" fl_status fl_cuda_qknorm_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok,
                                                  int n_heads, int n_kv_heads, int head_dim, int q_stride,
                                                  int kv_stride, const fl_tensor *q_norm, const fl_tensor *k_norm,
                                                  float eps, const float *cos, const float *sin, int rot_dim,
                                                  bool interleaved, const int32_t *slots, void *k_cache,
                                                  void *v_cache) {
    if (rot_dim > head_dim || rot_dim % 2 || rot_dim < 0 || n_heads < 0 || n_kv_heads < 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "qknorm_rope_kv_store: rot_dim %d invalid for head_dim %d", rot_dim,
                      head_dim);
    FL_TRY(cuda_norm_weight_ok(q_norm, head_dim, "qknorm_rope_kv_store (q_norm)"));
    FL_TRY(cuda_norm_weight_ok(k_norm, head_dim, "qknorm_rope_kv_store (k_norm)"));
    if (head_dim > QKN_MAX_HD)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda qknorm_rope_kv_store: head_dim %d (at most %d)", head_dim, QKN_MAX_HD);
    if (n_tok <= 0 || n_kv_heads == 0) return FL_OK;
    const int heads = n_heads + 2 * n_kv_heads;
    const dim3 grid((unsigned)n_tok, (unsigned)((heads + QKN_WARPS - 1) / QKN_WARPS));
    const bool i8 = b->kv_int8_head_dim > 0; /* normed and rotated here, quantized into the records after */
    FL_TRY(launch_pdl(qknorm_rope_kv_kernel, grid, QKN_WARPS * 32, 0, cuda_impl(b)->stream, (bf16 *)q, (bf16 *)k,
                      (const bf16 *)v, n_heads, n_kv_heads, head_dim, q_stride, kv_stride, q_norm->data,
                      q_norm->dtype == FL_DTYPE_F32 ? 1 : 0, k_norm->data, k_norm->dtype == FL_DTYPE_F32 ? 1 : 0, eps,
                      cos, sin, rot_dim / 2, interleaved ? 1 : 0, i8 ? (const int32_t *)NULL : slots,
                      (bf16 *)k_cache, (bf16 *)v_cache));
    return i8 ? fl_cuda_kv_store(b, k, v, n_tok, n_kv_heads * head_dim, kv_stride, slots, k_cache, v_cache) : FL_OK;
}
