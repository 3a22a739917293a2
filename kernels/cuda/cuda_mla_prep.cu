/*
 * cuda_mla_prep.cu — DeepSeek-V2's MLA inputs after their projections in
 * one launch (mla_rope_norm_store; contract in kernels/backend.h, reference
 * kernels/cpu/cpu_ops.c): RoPE of every head's q_pe and of the shared k_pe,
 * kv_a_layernorm of the latent, and the store of the [latent | k_pe] record
 * into the cache.
 *
 * Why: runtime/model/forward.c's mla_block did these as rope, rope, a copy of the
 * latent out of each row (one cudaMemcpyAsync a token), rmsnorm, a copy
 * back, kv_store: six dependent launches at a batch-1 decode step (36 at
 * 16 tokens), each pure latency against a few KB of data. Here block (t, 0)
 * takes token t's record: its threads hold the latent's elements, sum their
 * squares (a block reduction), write the normed latent (rmsnorm_kernel's
 * w * (x * inv), bf16) and rotate k_pe (rope_kernel's arithmetic) in place
 * and into the cache slot; blocks (t, 1..) rotate q_pe, a warp a head. The
 * norm weight is loaded before the PDL wait. An int8 or e4m3 cache
 * (kernels/backend.h, kv_int8_head_dim) gets its records from kv_store
 * after the kernel (the quantization needs a group's absmax), which then
 * writes the rotated, normed record only in place.
 */
#include "kernels/cuda/cuda_common.cuh"

#define MP_THREADS 256
#define MP_PER 4 /* latent elements a thread at most: kv_lora_rank <= 1024 */

static __device__ __forceinline__ void mp_rot(bf16 *x, int i0, int i1, float c, float s) {
    const float a = bf2f(x[i0]), bb = bf2f(x[i1]);
    x[i0] = f2bf(a * c - bb * s);
    x[i1] = f2bf(bb * c + a * s);
}

static __global__ void __launch_bounds__(MP_THREADS)
    mla_prep_kernel(bf16 *q, int q_stride, bf16 *ckv, int n_heads, int nope, int rope, int kvl, const float *cos,
                    const float *sin, const void *nw, int nw32, float eps, const int32_t *slots, bf16 *kc, bf16 *vc) {
    if (FL_PDL_EARLY) pdl_trigger();
    const int t = blockIdx.x, half = rope >> 1, tid = threadIdx.x;
    float wv[MP_PER];
    if (blockIdx.y == 0) { /* the norm weight never depends on the previous kernel */
#pragma unroll
        for (int m = 0; m < MP_PER; m++) {
            const int j = tid + m * MP_THREADS;
            wv[m] = j < kvl ? vec_load(nw, nw32, j) : 0.0f;
        }
    }
    pdl_wait(); /* q and ckv come from the projections before */
    if (!FL_PDL_EARLY) pdl_trigger();
    const float *ct = cos + (int64_t)t * half, *st = sin + (int64_t)t * half;
    if (blockIdx.y > 0) { /* q_pe of head (y - 1) * warps + warp, interleaved pairs */
        const int h = (blockIdx.y - 1) * (MP_THREADS / 32) + (tid >> 5);
        if (h >= n_heads) return;
        bf16 *x = q + (int64_t)t * q_stride + (int64_t)h * (nope + rope) + nope;
        for (int p = tid & 31; p < half; p += 32) mp_rot(x, 2 * p, 2 * p + 1, ct[p], st[p]);
        return;
    }
    const int rec = kvl + rope, hr = rec >> 1;
    bf16 *row = ckv + (int64_t)t * rec;
    const int32_t slot = slots[t];
    bf16 *kco = slot >= 0 && kc ? kc + (int64_t)slot * hr : NULL, *vco = kco ? vc + (int64_t)slot * hr : NULL;
    /* element j of the record into the cache: K holds [0, rec / 2), V the rest */
    auto put = [&](int j, bf16 v) {
        if (kco) {
            if (j < hr) kco[j] = v;
            else vco[j - hr] = v;
        }
    };
    float xv[MP_PER], ss = 0.0f;
#pragma unroll
    for (int m = 0; m < MP_PER; m++) {
        const int j = tid + m * MP_THREADS;
        xv[m] = j < kvl ? bf2f(row[j]) : 0.0f;
        ss += xv[m] * xv[m];
    }
    __shared__ float red[MP_THREADS / 32];
    ss = warp_sum(ss);
    if ((tid & 31) == 0) red[tid >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < MP_THREADS / 32; i++) tot += red[i];
    const float inv = 1.0f / sqrtf(tot / (float)kvl + eps);
#pragma unroll
    for (int m = 0; m < MP_PER; m++) {
        const int j = tid + m * MP_THREADS;
        if (j < kvl) {
            const bf16 v = f2bf(wv[m] * (xv[m] * inv));
            row[j] = v;
            put(j, v);
        }
    }
    bf16 *kpe = row + kvl;
    for (int p = tid; p < half; p += MP_THREADS) { /* each thread owns its pair: no barrier needed */
        mp_rot(kpe, 2 * p, 2 * p + 1, ct[p], st[p]);
        put(kvl + 2 * p, kpe[2 * p]);
        put(kvl + 2 * p + 1, kpe[2 * p + 1]);
    }
}

extern "C" fl_status fl_cuda_mla_rope_norm_store(fl_backend *b, void *q, int q_stride, void *ckv, int n_tok,
                                                 int n_heads, int nope, int rope, int kvl, const float *cos,
                                                 const float *sin, const fl_tensor *kv_norm, float eps,
                                                 const int32_t *slots, void *k_cache, void *v_cache) {
    if (rope <= 0 || rope % 2 || kvl <= 0 || (kvl + rope) % 2 || nope < 0 || n_heads < 1)
        return FL_ERR(FL_ERR_INVALID_ARG, "mla_rope_norm_store: rope %d, kv_lora_rank %d, %d heads", rope, kvl,
                      n_heads);
    if (kvl > MP_PER * MP_THREADS)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda mla_rope_norm_store: kv_lora_rank %d (at most %d)", kvl,
                      MP_PER * MP_THREADS);
    FL_TRY(cuda_norm_weight_ok(kv_norm, kvl, "mla_rope_norm_store (kv_a_layernorm)"));
    if (n_tok <= 0) return FL_OK;
    const unsigned qblocks = (unsigned)((n_heads + MP_THREADS / 32 - 1) / (MP_THREADS / 32));
    const bool quant = b->kv_int8_head_dim > 0;
    FL_TRY(launch_pdl(mla_prep_kernel, dim3((unsigned)n_tok, 1 + qblocks), MP_THREADS, 0, cuda_impl(b)->stream,
                      (bf16 *)q, q_stride, (bf16 *)ckv, n_heads, nope, rope, kvl, cos, sin, kv_norm->data,
                      kv_norm->dtype == FL_DTYPE_F32 ? 1 : 0, eps, slots, quant ? NULL : (bf16 *)k_cache,
                      quant ? NULL : (bf16 *)v_cache));
    if (!quant) return FL_OK;
    const int rec = kvl + rope;
    return fl_cuda_kv_store(b, ckv, (const bf16 *)ckv + rec / 2, n_tok, rec / 2, rec, slots, k_cache, v_cache);
}
