/*
 * cpu_attention.c — paged causal attention over the KV cache, CPU reference.
 *
 * One code path for prefill and decode: every query row attends to the
 * cached positions 0..its own position, reading K/V through the sequence's
 * block table. Softmax is computed online (running max and sum, as in
 * flash attention), so no score buffer of context length is needed and the
 * op allocates nothing. An int8 or fp8 cache (backend.h, kv_int8_head_dim)
 * is read as stored: each key's dot product is the head's scale times the
 * dot with the codes' values, and each value is added as p * scale * codes,
 * so no dequantized copy is made. The MLA op (DeepSeek-V2) below shares that loop; it
 * allocates a small per-thread workspace and an f32 copy of kv_b_proj.
 */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_vec.h"

#define MAX_HEAD_DIM 1024

fl_status fl_cpu_attention(fl_backend *b, const void *q, int q_stride, const fl_attn_meta *m,
                           int n_heads, int n_kv_heads, int head_dim, float scale,
                           const void *k_cache, const void *v_cache, void *out) {
    if (head_dim > MAX_HEAD_DIM || n_kv_heads <= 0 || n_heads % n_kv_heads)
        return FL_ERR(FL_ERR_INVALID_ARG, "attention: heads %d / kv heads %d / head_dim %d",
                      n_heads, n_kv_heads, head_dim);
    const int group = n_heads / n_kv_heads;
    const int64_t kv_dim = (int64_t)n_kv_heads * head_dim;
    const bool i8 = b && b->kv_int8_head_dim > 0; /* the reference tests call it without a backend */
    if (i8 && b->kv_int8_head_dim != head_dim)
        return FL_ERR(FL_ERR_INVALID_ARG, "attention: int8 KV records of %d-value heads, head_dim %d",
                      b->kv_int8_head_dim, head_dim);
    const int64_t rb = i8 ? (int64_t)fl_kv_int8_record_bytes(kv_dim, head_dim) : 0, vals = (kv_dim + 3) & ~3;
    const float *const code = i8 ? fl_cpu_kv_code_table(b->kv_fp8_codes) : NULL;
    const float *kc = k_cache, *vc = v_cache;
    const int n_rows = m->q_start[m->n_seqs];
    /* f32 caches only: int8 / fp8 records keep the plain loops, whose order
     * the fp8 demo test's near-tie greedy tokens were measured with */
    const bool vec = fl_cpu_backend_isa(b) == FL_CPU_ISA_AVX2;
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
                float sc = 0, vs = 1;
                const float *vt = NULL;
                const uint8_t *vq = NULL;
                if (i8) {
                    /* records read as stored: the head's scale times the dot with the codes' values */
                    const uint8_t *kr = (const uint8_t *)k_cache + slot * rb, *vr = (const uint8_t *)v_cache + slot * rb;
                    const uint8_t *kq = kr + koff;
                    for (int j = 0; j < head_dim; j++) sc += qh[j] * code[kq[j]];
                    sc *= ((const float *)(kr + vals))[h / group];
                    vq = vr + koff;
                    vs = ((const float *)(vr + vals))[h / group];
                } else {
                    const float *kt = kc + slot * kv_dim + koff;
                    vt = vc + slot * kv_dim + koff;
                    if (vec)
                        sc = fl_cpu_vec_dot(qh, kt, head_dim);
                    else
                        for (int j = 0; j < head_dim; j++) sc += qh[j] * kt[j];
                }
                sc *= scale;
                float mnew = sc > mx ? sc : mx;
                float corr = expf(mx - mnew), p = expf(sc - mnew);
                l = l * corr + p;
                if (vec && !i8) {
                    fl_cpu_vec_scale_add(acc, corr, p, vt, head_dim);
                } else if (i8) {
                    const float pv = p * vs;
                    for (int j = 0; j < head_dim; j++) acc[j] = acc[j] * corr + pv * code[vq[j]];
                } else {
                    for (int j = 0; j < head_dim; j++) acc[j] = acc[j] * corr + p * vt[j];
                }
                mx = mnew;
            }
            float *o = (float *)out + ((int64_t)row * n_heads + h) * head_dim;
            /* no visible position (ctx_len 0, a padding row): zeros, as backend.h says */
            for (int j = 0; j < head_dim; j++) o[j] = l > 0 ? acc[j] / l : 0.0f;
        }
    }
    return FL_OK;
}

/* MLA (DeepSeek-V2), "absorbed" form: instead of expanding every cached
 * latent into per-head keys and values (what transformers does), each query
 * head is mapped into latent space once, q_lat = W_uk,h^T q_nope, so that
 * q_nope . (W_uk,h c_t) = q_lat . c_t, and the values are summed in latent
 * space and expanded once at the end: sum_t p_t W_uv,h c_t = W_uv,h sum_t
 * p_t c_t. Same result up to f32 rounding, and the cache stays compressed.
 * kv_b_proj is expanded to f32 once per call (any weight dtype). */
fl_status fl_cpu_mla_attention(fl_backend *b, const void *q, const fl_attn_meta *m, int n_heads, int nope,
                               int rope, int v_dim, int kv_lora, float scale, const fl_tensor *wkv_b,
                               const void *k_cache, const void *v_cache, void *out) {
    const int rec = kv_lora + rope, half = rec / 2, qk = nope + rope, kvb = nope + v_dim;
    /* int8 records: each half record is kv_int8_head_dim-value groups, a
     * scale each (backend.h; the engine's group: fl_kv_int8_group) */
    const int grp = b ? b->kv_int8_head_dim : 0;
    const bool i8 = grp > 0;
    if (i8 && half % grp)
        return FL_ERR(FL_ERR_INVALID_ARG, "mla_attention: int8 KV scales of %d values do not tile records of %d",
                      grp, half);
    const size_t rb = i8 ? fl_kv_int8_record_bytes(half, grp) : 0, vals = ((size_t)half + 3) & ~(size_t)3;
    const float *const code = i8 ? fl_cpu_kv_code_table(b->kv_fp8_codes) : NULL;
    if (n_heads <= 0 || nope < 0 || rope < 0 || v_dim <= 0 || kv_lora <= 0 || rec % 2 || kv_lora > 4096 ||
        rope > 1024 || v_dim > MAX_HEAD_DIM)
        return FL_ERR(FL_ERR_INVALID_ARG, "mla_attention: heads %d, nope %d, rope %d, v %d, kv_lora %d", n_heads,
                      nope, rope, v_dim, kv_lora);
    if (wkv_b->ndim != 2 || wkv_b->shape[0] != (int64_t)n_heads * kvb || wkv_b->shape[1] != kv_lora)
        return FL_ERR(FL_ERR_INVALID_ARG, "mla_attention: kv_b_proj is [%lld, %lld], expected [%d, %d]",
                      (long long)wkv_b->shape[0], (long long)(wkv_b->ndim == 2 ? wkv_b->shape[1] : 0),
                      n_heads * kvb, kv_lora);
    float *wf = malloc(sizeof(float) * (size_t)n_heads * kvb * kv_lora);
    if (!wf) return FL_ERR(FL_ERR_OOM, "out of memory in mla_attention");
    for (int64_t r = 0; r < (int64_t)n_heads * kvb; r++) fl_tensor_row_f32(wkv_b, r, wf + r * kv_lora);
    const float *kc = k_cache, *vc = v_cache;
    const int n_rows = m->q_start[m->n_seqs];
    int oom = 0;
#pragma omp parallel
    {
        /* q_lat [kv_lora] | acc [kv_lora] | one cached record [rec] */
        float *ws = malloc(sizeof(float) * (size_t)(2 * kv_lora + rec));
        if (!ws) {
#pragma omp atomic write
            oom = 1;
        } else {
            float *q_lat = ws, *acc = ws + kv_lora, *r = ws + 2 * kv_lora;
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int row = 0; row < n_rows; row++) {
                for (int h = 0; h < n_heads; h++) {
                    int s = 0;
                    while (m->q_start[s + 1] <= row) s++;
                    const int n_q = m->q_start[s + 1] - m->q_start[s];
                    const int pos = m->ctx_len[s] - n_q + (row - m->q_start[s]);
                    const int32_t *bt = m->block_tables + (int64_t)s * m->max_blocks;
                    const float *qh = (const float *)q + ((int64_t)row * n_heads + h) * qk;
                    const float *wh = wf + (int64_t)h * kvb * kv_lora;
                    for (int j = 0; j < kv_lora; j++) q_lat[j] = 0, acc[j] = 0;
                    for (int i = 0; i < nope; i++) {
                        const float qi = qh[i], *wr = wh + (int64_t)i * kv_lora;
                        for (int j = 0; j < kv_lora; j++) q_lat[j] += qi * wr[j];
                    }
                    float mx = -FLT_MAX, l = 0;
                    for (int t = 0; t <= pos; t++) {
                        const int64_t slot = (int64_t)bt[t / m->block_size] * m->block_size + t % m->block_size;
                        if (i8) {
                            const uint8_t *kr = (const uint8_t *)k_cache + slot * rb;
                            const uint8_t *vr = (const uint8_t *)v_cache + slot * rb;
                            const float *ks = (const float *)(kr + vals), *vs = (const float *)(vr + vals);
                            for (int j = 0; j < half; j++) {
                                r[j] = code[kr[j]] * ks[j / grp];
                                r[half + j] = code[vr[j]] * vs[j / grp];
                            }
                        } else {
                            for (int j = 0; j < half; j++)
                                r[j] = kc[slot * half + j], r[half + j] = vc[slot * half + j];
                        }
                        float sc = 0;
                        for (int j = 0; j < kv_lora; j++) sc += q_lat[j] * r[j];
                        for (int j = 0; j < rope; j++) sc += qh[nope + j] * r[kv_lora + j];
                        sc *= scale;
                        float mnew = sc > mx ? sc : mx;
                        float corr = expf(mx - mnew), p = expf(sc - mnew);
                        l = l * corr + p;
                        for (int j = 0; j < kv_lora; j++) acc[j] = acc[j] * corr + p * r[j];
                        mx = mnew;
                    }
                    float *o = (float *)out + ((int64_t)row * n_heads + h) * v_dim;
                    for (int i = 0; i < v_dim; i++) {
                        const float *wr = wh + (int64_t)(nope + i) * kv_lora;
                        float sum = 0;
                        for (int j = 0; j < kv_lora; j++) sum += wr[j] * acc[j];
                        o[i] = l > 0 ? sum / l : 0; /* no position seen (padding row): zeros, as backend.h says */
                    }
                }
            }
            free(ws);
        }
    }
    free(wf);
    if (oom) return FL_ERR(FL_ERR_OOM, "out of memory in mla_attention");
    return FL_OK;
}
