/*
 * cuda_attention.cu — paged causal attention over the bf16 KV cache, one
 * kernel for prefill and decode (fl_attn_meta semantics exactly as
 * kernels/cpu/cpu_attention.c: query row i of sequence s sits at position
 * ctx_len[s] - n_q(s) + i and attends to cached positions 0..that position
 * through the block table).
 *
 * Layout of the work: blocks (head, sequence, z) take query rows
 * z, z + gridDim.z, ... of their sequence. Per row, the block's 8 warps
 * take every 8th group of 4 cached positions, each warp keeping its own
 * online-softmax state (running max, sum and a head_dim accumulator spread
 * over the lanes, up to 256 dims = 8 per lane); the warps' states are
 * merged in shared memory at the end. Within a warp the lanes split
 * head_dim, so K and V rows are read with coalesced loads. f32 math
 * throughout, expf (no fast math), so the result tracks the CPU reference
 * to bf16 resolution.
 *
 * Known gap: decode of one sequence uses n_heads blocks only; splitting the
 * context across blocks (flash-decoding, with a workspace from a size
 * query) is the next step for long contexts.
 */
#include <float.h>

#include "kernels/cuda/cuda_common.cuh"

#define ATT_WARPS 8
#define ATT_MAX_D 256
#define ATT_NJ (ATT_MAX_D / 32)
#define ATT_G 4 /* positions per warp step */

static __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_kernel(const bf16 *__restrict__ q, int q_stride, int n_seqs,
                     const int32_t *__restrict__ q_start, const int32_t *__restrict__ ctx_len,
                     const int32_t *__restrict__ block_tables, int max_blocks, int block_size,
                     int n_heads, int group, int head_dim, int64_t kv_dim, float scale,
                     const bf16 *__restrict__ kc, const bf16 *__restrict__ vc, bf16 *__restrict__ out) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][ATT_MAX_D];
    const int h = blockIdx.x, s = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q0 = q_start[s], n_q = q_start[s + 1] - q0;
    const int32_t *bt = block_tables + (int64_t)s * max_blocks;
    const int64_t koff = (int64_t)(h / group) * head_dim;
  for (int i = blockIdx.z; i < n_q; i += gridDim.z) {
    const int row = q0 + i, pos = ctx_len[s] - n_q + i;
    float qv[ATT_NJ], acc[ATT_NJ];
    const bf16 *qh = q + (int64_t)row * q_stride + (int64_t)h * head_dim;
#pragma unroll
    for (int j = 0; j < ATT_NJ; j++) {
        const int d = lane + 32 * j;
        qv[j] = d < head_dim ? bf2f(qh[d]) : 0.0f;
        acc[j] = 0.0f;
    }
    float mx = -FLT_MAX, l = 0.0f;
    /* Each warp takes groups of ATT_G consecutive positions; the loads and
     * dot products of a group are independent, so they overlap instead of
     * paying one memory latency per position. */
    for (int t0 = warp * ATT_G; t0 <= pos; t0 += ATT_WARPS * ATT_G) {
        float sc[ATT_G];
        const bf16 *vt[ATT_G];
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            const int t = t0 + g < pos ? t0 + g : pos; /* clamp: duplicates are masked below */
            const int64_t slot = (int64_t)bt[t / block_size] * block_size + t % block_size;
            const bf16 *kt = kc + slot * kv_dim + koff;
            vt[g] = vc + slot * kv_dim + koff;
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < ATT_NJ; j++) {
                const int d = lane + 32 * j;
                if (d < head_dim) part = fmaf(qv[j], bf2f(kt[d]), part);
            }
            sc[g] = part;
        }
        float mnew = mx;
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            sc[g] = t0 + g <= pos ? warp_sum(sc[g]) * scale : -INFINITY;
            mnew = fmaxf(mnew, sc[g]);
        }
        const float corr = expf(mx - mnew);
        float p[ATT_G];
        l *= corr;
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            p[g] = expf(sc[g] - mnew); /* 0 for masked positions */
            l += p[g];
        }
#pragma unroll
        for (int j = 0; j < ATT_NJ; j++) {
            const int d = lane + 32 * j;
            if (d < head_dim) {
                float a = acc[j] * corr;
#pragma unroll
                for (int g = 0; g < ATT_G; g++) a = fmaf(p[g], bf2f(vt[g][d]), a);
                acc[j] = a;
            }
        }
        mx = mnew;
    }
    if (lane == 0) {
        sm_m[warp] = mx;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ATT_NJ; j++) {
        const int d = lane + 32 * j;
        if (d < head_dim) sm_acc[warp][d] = acc[j];
    }
    __syncthreads();
    /* Merge: M = max m_w, L = sum l_w e^(m_w - M); a warp that saw no
     * position has l = 0 and m = -FLT_MAX, so it contributes exactly 0. */
    float M = -FLT_MAX;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.0f, f[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = sm_l[w] > 0.0f ? expf(sm_m[w] - M) : 0.0f;
        L += sm_l[w] * f[w];
    }
    bf16 *o = out + ((int64_t)row * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) v += sm_acc[w][d] * f[w];
        o[d] = f2bf(L > 0.0f ? v / L : 0.0f); /* no position seen (padding row): 0 */
    }
    __syncthreads(); /* shared state is reused by the next row */
  }
}

extern "C" fl_status fl_cuda_attention(fl_backend *b, const void *q, int q_stride, const fl_attn_meta *m,
                                       int n_heads, int n_kv_heads, int head_dim, float scale,
                                       const void *k_cache, const void *v_cache, void *out) {
    if (head_dim > ATT_MAX_D || head_dim <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads)
        return FL_ERR(head_dim > ATT_MAX_D ? FL_ERR_UNSUPPORTED : FL_ERR_INVALID_ARG,
                      "cuda attention: heads %d / kv heads %d / head_dim %d (head_dim at most %d)",
                      n_heads, n_kv_heads, head_dim, ATT_MAX_D);
    if (m->n_seqs <= 0 || m->block_size <= 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda attention: %d sequences, block size %d", m->n_seqs,
                      m->block_size);
    if (m->max_ctx_len <= 0) return FL_OK; /* no sequence has a token */
    if (m->n_seqs > 65535)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda attention: %d sequences in one call (at most 65535)",
                      m->n_seqs);
    /* Query rows live in device memory (q_start); the grid is sized from the
     * host-known max_q_len (or, when the caller leaves it 0, max_ctx_len,
     * which bounds every sequence's query count), so there is no host read
     * in the step: grid.z blocks stride over a sequence's rows and the
     * surplus ones exit at once. Decode passes max_q_len = 1: one block per
     * (head, sequence) instead of up to 64, most of which would only exit
     * (measured: that was ~25k empty blocks per layer at batch 16). */
    fl_cuda *c = cuda_impl(b);
    const int rows_hint = m->max_q_len > 0 ? m->max_q_len : m->max_ctx_len;
    const int z = rows_hint < 64 ? rows_hint : 64;
    dim3 grid((unsigned)n_heads, (unsigned)m->n_seqs, (unsigned)z);
    attention_kernel<<<grid, ATT_WARPS * 32, 0, c->stream>>>(
        (const bf16 *)q, q_stride, m->n_seqs, m->q_start, m->ctx_len, m->block_tables, m->max_blocks,
        m->block_size, n_heads, n_heads / n_kv_heads, head_dim, (int64_t)n_kv_heads * head_dim, scale,
        (const bf16 *)k_cache, (const bf16 *)v_cache, (bf16 *)out);
    FL_CUDA_LAUNCH_CHECK("attention_kernel");
    return FL_OK;
}
