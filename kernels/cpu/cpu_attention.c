/*
 * cpu_attention.c — paged causal attention over the KV cache, CPU reference.
 *
 * One code path for prefill and decode: every query row attends to the
 * cached positions 0..its own position, reading K/V through the sequence's
 * block table. Softmax is computed online (running max and sum, as in
 * flash attention), so no score buffer of context length is needed and the
 * op allocates nothing.
 */
#include <float.h>
#include <math.h>

#include "kernels/cpu/cpu_ops.h"

#define MAX_HEAD_DIM 1024

fl_status fl_cpu_attention(fl_backend *b, const void *q, int q_stride, const fl_attn_meta *m,
                           int n_heads, int n_kv_heads, int head_dim, float scale,
                           const void *k_cache, const void *v_cache, void *out) {
    (void)b;
    if (head_dim > MAX_HEAD_DIM || n_kv_heads <= 0 || n_heads % n_kv_heads)
        return FL_ERR(FL_ERR_INVALID_ARG, "attention: heads %d / kv heads %d / head_dim %d",
                      n_heads, n_kv_heads, head_dim);
    const int group = n_heads / n_kv_heads;
    const int64_t kv_dim = (int64_t)n_kv_heads * head_dim;
    const float *kc = k_cache, *vc = v_cache;
    const int n_rows = m->q_start[m->n_seqs];
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int row = 0; row < n_rows; row++) {
        for (int h = 0; h < n_heads; h++) {
            int s = 0;
            while (m->q_start[s + 1] <= row) s++;
            const int n_q = m->q_start[s + 1] - m->q_start[s];
            const int pos = m->ctx_len[s] - n_q + (row - m->q_start[s]);
            const int32_t *bt = m->block_tables + (int64_t)s * m->max_blocks;
            const float *qh = (const float *)q + (int64_t)row * q_stride + (int64_t)h * head_dim;
            const int64_t koff = (int64_t)(h / group) * head_dim;
            float acc[MAX_HEAD_DIM];
            for (int j = 0; j < head_dim; j++) acc[j] = 0;
            float mx = -FLT_MAX, l = 0;
            for (int t = 0; t <= pos; t++) {
                const int64_t slot = (int64_t)bt[t / m->block_size] * m->block_size + t % m->block_size;
                const float *kt = kc + slot * kv_dim + koff;
                const float *vt = vc + slot * kv_dim + koff;
                float sc = 0;
                for (int j = 0; j < head_dim; j++) sc += qh[j] * kt[j];
                sc *= scale;
                float mnew = sc > mx ? sc : mx;
                float corr = expf(mx - mnew), p = expf(sc - mnew);
                l = l * corr + p;
                for (int j = 0; j < head_dim; j++) acc[j] = acc[j] * corr + p * vt[j];
                mx = mnew;
            }
            float *o = (float *)out + ((int64_t)row * n_heads + h) * head_dim;
            for (int j = 0; j < head_dim; j++) o[j] = acc[j] / l;
        }
    }
    return FL_OK;
}
