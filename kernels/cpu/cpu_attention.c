/*
 * cpu_attention.c — paged causal attention over the KV cache, CPU reference.
 *
 * One code path for prefill and decode: every query row attends to the
 * cached positions 0..its own position, reading K/V through the sequence's
 * block table. Softmax is computed online (running max and sum, as in
 * flash attention), so no score buffer of context length is needed. Over
 * an f32 (or bf16) cache a task is a (row, KV head): the group's query heads share
 * each K/V row read, a block of positions at a time; decode rows at long
 * contexts with few such tasks are split over spans of positions, whose
 * partials (a buffer allocated per call) are merged after. A bf16 cache
 * (backend.h, kv_bf16) takes the same loops, each value widened as read.
 * An int8 or fp8 cache (backend.h, kv_int8_head_dim)
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
#include "kernels/pool.h"

#define MAX_HEAD_DIM 1024
#define ATTN_KB 64    /* positions a block (f32 or bf16 cache) */
#define AG_HEADS 16   /* query heads a task holds running sums for, at most */
#define AG_ACC 4096   /* floats of those sums (heads x head_dim), at most */

typedef struct attn_job {
    const void *q, *k_cache, *v_cache;
    void *out;
    const fl_attn_meta *m;
    const float *code;
    int q_stride, n_heads, head_dim, group;
    int64_t kv_dim, rb, vals;
    float scale;
    bool i8, vec, bf16; /* bf16: 16-bit slots (backend.h, kv_bf16) */
    bool blocked;       /* head by head within blocks (backend.h, kv_block_size) */
} attn_job;

/* Query row `row`'s block table, and in *pos its position (the last
 * position it sees). */
static const int32_t *row_at(const fl_attn_meta *m, int row, int *pos) {
    int s = 0;
    while (m->q_start[s + 1] <= row) s++;
    const int n_q = m->q_start[s + 1] - m->q_start[s];
    *pos = m->ctx_len[s] - n_q + (row - m->q_start[s]);
    return m->block_tables + (int64_t)s * m->max_blocks;
}

/* int8 / fp8 records: (row, head) pairs [lo, hi), row-major (a pool task). */
static void attn_pairs(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const attn_job *jb = ctx;
    const fl_attn_meta *m = jb->m;
    const void *q = jb->q, *k_cache = jb->k_cache, *v_cache = jb->v_cache;
    void *out = jb->out;
    const float *code = jb->code;
    const int q_stride = jb->q_stride, n_heads = jb->n_heads, head_dim = jb->head_dim, group = jb->group;
    const int64_t rb = jb->rb, vals = jb->vals;
    const float scale = jb->scale;
    for (int64_t idx = lo; idx < hi; idx++) {
        const int row = (int)(idx / n_heads), h = (int)(idx % n_heads);
        int pos;
        const int32_t *bt = row_at(m, row, &pos);
        const float *qh = (const float *)q + (int64_t)row * q_stride + (int64_t)h * head_dim;
        const int64_t koff = (int64_t)(h / group) * head_dim;
        float acc[MAX_HEAD_DIM];
        for (int j = 0; j < head_dim; j++) acc[j] = 0;
        float mx = -FLT_MAX, l = 0;
        for (int t = 0; t <= pos; t++) {
            /* int8 / fp8 records, read as stored: the head's scale times the
             * dot with the codes' values (position by position: the order
             * the quantized caches' demo checks were measured with) */
            const int64_t slot = (int64_t)bt[t / m->block_size] * m->block_size + t % m->block_size;
            const uint8_t *kr = (const uint8_t *)k_cache + slot * rb, *vr = (const uint8_t *)v_cache + slot * rb;
            const uint8_t *kq = kr + koff, *vq = vr + koff;
            float sc = 0;
            for (int j = 0; j < head_dim; j++) sc += qh[j] * code[kq[j]];
            sc *= ((const float *)(kr + vals))[h / group];
            sc *= scale;
            const float vs = ((const float *)(vr + vals))[h / group];
            const float mnew = sc > mx ? sc : mx, corr = expf(mx - mnew), p = expf(sc - mnew);
            l = l * corr + p;
            const float pv = p * vs;
            for (int j = 0; j < head_dim; j++) acc[j] = acc[j] * corr + pv * code[vq[j]];
            mx = mnew;
        }
        float *o = (float *)out + ((int64_t)row * n_heads + h) * head_dim;
        /* no visible position (ctx_len 0, a padding row): zeros, as backend.h says */
        for (int j = 0; j < head_dim; j++) o[j] = l > 0 ? acc[j] / l : 0.0f;
    }
}

/* Value j of a cached row: f32, or bf16 widened exactly. */
static inline float kv_at(const void *row, int j, bool bf16) {
    return bf16 ? fl_bf16_to_f32(((const uint16_t *)row)[j]) : ((const float *)row)[j];
}

/* f32 or bf16 cache: query heads [h0, h0 + gc) of KV head hk (one group or part
 * of it) of query row `row` over its positions [t_lo, t_hi]: the running
 * max mx, sum l and unnormalized value sums acc (gc x head_dim). The heads
 * go through the positions together, so each K/V row is read once for all
 * of them, in blocks of ATTN_KB positions: scores first, then one rescale
 * of a head's running sum a block and one exp a position (a position at a
 * time cost two exps and a rescale each, and a group re-read every row). */
static void attn_span(const attn_job *jb, int row, int hk, int h0, int gc, int t_lo, int t_hi, float *acc,
                      float *mx, float *l) {
    const fl_attn_meta *m = jb->m;
    const int head_dim = jb->head_dim;
    const int64_t kv_dim = jb->kv_dim, koff = (int64_t)hk * head_dim, eb = jb->bf16 ? 2 : 4,
                  n_kv = jb->n_heads / jb->group;
    const float scale = jb->scale;
    const bool vec = jb->vec, bf = jb->bf16;
    int pos;
    const int32_t *bt = row_at(m, row, &pos);
    const float *qr = (const float *)jb->q + (int64_t)row * jb->q_stride + (int64_t)h0 * head_dim;
    float corr[AG_HEADS], sc[AG_HEADS][ATTN_KB];
    for (int j = 0; j < gc * head_dim; j++) acc[j] = 0;
    for (int g = 0; g < gc; g++) mx[g] = -FLT_MAX, l[g] = 0;
    for (int t0 = t_lo; t0 <= t_hi; t0 += ATTN_KB) {
        const int nb = t_hi + 1 - t0 < ATTN_KB ? t_hi + 1 - t0 : ATTN_KB;
        const void *kts[ATTN_KB], *vts[ATTN_KB];
        /* the positions' rows, walking the block table (no division a position):
         * slot by slot, or head by head within blocks (backend.h, kv_block_size) */
        const int bs = m->block_size;
        const int64_t row_step = jb->blocked ? head_dim : kv_dim;
        int bi = t0 / bs, in = t0 % bs;
        for (int i = 0; i < nb; i++) {
            const int64_t blk = bt[bi];
            const int64_t off = jb->blocked ? (blk * n_kv + hk) * bs * head_dim : blk * bs * kv_dim + koff;
            kts[i] = (const char *)jb->k_cache + (off + in * row_step) * eb;
            vts[i] = (const char *)jb->v_cache + (off + in * row_step) * eb;
            if (++in == bs) in = 0, bi++;
        }
        for (int g = 0; g < gc; g++) {
            const float *qh = qr + (int64_t)g * head_dim;
            if (vec && bf) {
                fl_cpu_vec_scores_bf16(qh, (const uint16_t *const *)kts, nb, head_dim, scale, sc[g]);
                continue;
            }
            if (vec) {
                fl_cpu_vec_scores(qh, (const float *const *)kts, nb, head_dim, scale, sc[g]);
                continue;
            }
            for (int i = 0; i < nb; i++) {
                float d = 0;
                for (int j = 0; j < head_dim; j++) d += qh[j] * kv_at(kts[i], j, bf);
                sc[g][i] = d * scale;
            }
        }
        for (int g = 0; g < gc; g++) {
            float bmax = -FLT_MAX;
            for (int i = 0; i < nb; i++) bmax = sc[g][i] > bmax ? sc[g][i] : bmax;
            const float mnew = bmax > mx[g] ? bmax : mx[g];
            corr[g] = expf(mx[g] - mnew);
            l[g] *= corr[g];
            mx[g] = mnew;
        }
        for (int g = 0; g < gc; g++) {
            float *a = acc + g * head_dim, *pg = sc[g]; /* scores become weights in place */
            if (vec) {
                l[g] += fl_cpu_vec_exp_sub(pg, nb, mx[g]);
                if (bf) fl_cpu_vec_acc_bf16(a, corr[g], pg, (const uint16_t *const *)vts, nb, head_dim);
                else fl_cpu_vec_acc(a, corr[g], pg, (const float *const *)vts, nb, head_dim);
                continue;
            }
            for (int i = 0; i < nb; i++) {
                pg[i] = expf(pg[i] - mx[g]);
                l[g] += pg[i];
            }
            for (int i = 0; i < nb; i++) {
                const float c = i == 0 ? corr[g] : 1.0f;
                for (int j = 0; j < head_dim; j++) a[j] = a[j] * c + pg[i] * kv_at(vts[i], j, bf);
            }
        }
    }
}

/* f32 or bf16 cache: (row, KV head) pairs [lo, hi), row-major (a pool task). */
static void attn_groups(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const attn_job *jb = ctx;
    const int n_heads = jb->n_heads, head_dim = jb->head_dim, group = jb->group;
    const int n_kv = n_heads / group, gmax = AG_ACC / head_dim < AG_HEADS ? AG_ACC / head_dim : AG_HEADS;
    for (int64_t idx = lo; idx < hi; idx++) {
        const int row = (int)(idx / n_kv), hk = (int)(idx % n_kv);
        int pos;
        row_at(jb->m, row, &pos);
        for (int h0 = hk * group; h0 < (hk + 1) * group; h0 += gmax) {
            const int gc = (hk + 1) * group - h0 < gmax ? (hk + 1) * group - h0 : gmax;
            float acc[AG_ACC], mx[AG_HEADS], l[AG_HEADS];
            attn_span(jb, row, hk, h0, gc, 0, pos, acc, mx, l);
            for (int g = 0; g < gc; g++) {
                float *o = (float *)jb->out + ((int64_t)row * n_heads + h0 + g) * head_dim;
                /* no visible position (ctx_len 0, a padding row): zeros, as backend.h says */
                for (int j = 0; j < head_dim; j++) o[j] = l[g] > 0 ? acc[g * head_dim + j] / l[g] : 0.0f;
            }
        }
    }
}

/* Decode at long contexts: fewer (row, KV head) tasks than two a thread
 * leave cores idle (3 KV heads over 2 threads ran at 1.2x one), so each
 * row's positions are cut into spans of SPLIT_SPAN, every (row, KV head,
 * span) a task writing its partial max, sum and value sums, and a second
 * pass merges a row's spans (as flash decoding does on GPUs). */
#define SPLIT_SPAN 512
typedef struct split_job {
    const attn_job *jb;
    const int64_t *first; /* [n_rows + 1]: the row's first span */
    float *part;          /* per task: group x (head_dim + 2) floats */
} split_job;

static int64_t split_part_floats(const attn_job *jb) { return (int64_t)jb->group * (jb->head_dim + 2); }

/* (row, span, KV head) tasks [lo, hi): partials (a pool task). */
static void split_spans(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const split_job *sj = ctx;
    const attn_job *jb = sj->jb;
    const int n_kv = jb->n_heads / jb->group, group = jb->group;
    for (int64_t task = lo; task < hi; task++) {
        int row = 0;
        while (sj->first[row + 1] * n_kv <= task) row++;
        const int64_t k = task - sj->first[row] * n_kv; /* span-major within the row */
        const int hk = (int)(k % n_kv), span = (int)(k / n_kv);
        int pos;
        row_at(jb->m, row, &pos);
        const int t_lo = span * SPLIT_SPAN, t_hi = t_lo + SPLIT_SPAN - 1 < pos ? t_lo + SPLIT_SPAN - 1 : pos;
        float *pt = sj->part + task * split_part_floats(jb);
        attn_span(jb, row, hk, hk * group, group, t_lo, t_hi, pt + 2 * group, pt, pt + group);
    }
}

/* (row, KV head) pairs [lo, hi): a row's spans merged (a pool task). */
static void split_merge(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const split_job *sj = ctx;
    const attn_job *jb = sj->jb;
    const int n_kv = jb->n_heads / jb->group, group = jb->group, head_dim = jb->head_dim;
    const int64_t pf = split_part_floats(jb);
    for (int64_t idx = lo; idx < hi; idx++) {
        const int row = (int)(idx / n_kv), hk = (int)(idx % n_kv);
        const int64_t spans = sj->first[row + 1] - sj->first[row];
        for (int g = 0; g < group; g++) {
            float M = -FLT_MAX, L = 0;
            for (int64_t sp = 0; sp < spans; sp++) {
                const float *pt = sj->part + ((sj->first[row] + sp) * n_kv + hk) * pf;
                M = pt[g] > M ? pt[g] : M;
            }
            float *o = (float *)jb->out + ((int64_t)row * jb->n_heads + hk * group + g) * head_dim;
            for (int j = 0; j < head_dim; j++) o[j] = 0;
            for (int64_t sp = 0; sp < spans; sp++) {
                const float *pt = sj->part + ((sj->first[row] + sp) * n_kv + hk) * pf;
                const float w = expf(pt[g] - M);
                L += pt[group + g] * w;
                for (int j = 0; j < head_dim; j++) o[j] += w * pt[2 * group + g * head_dim + j];
            }
            for (int j = 0; j < head_dim; j++) o[j] = L > 0 ? o[j] / L : 0.0f;
        }
    }
}

/* Runs the split path when it pays and fits (vector kernels, a whole group
 * a task, fewer tasks than two a thread, a context over two spans) and
 * returns true with its status in *st; false: run attn_groups instead. */
static bool attn_split(const attn_job *jb, int n_rows, fl_status *st) {
    const int n_kv = jb->n_heads / jb->group, threads = fl_pool_threads();
    if (!jb->vec || threads < 2 || (int64_t)n_rows * n_kv >= 2 * threads || jb->group > AG_HEADS ||
        (int64_t)jb->group * jb->head_dim > AG_ACC)
        return false;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(n_rows + 1));
    if (!first) return false;
    first[0] = 0;
    bool long_ctx = false;
    for (int r = 0; r < n_rows; r++) {
        int pos;
        row_at(jb->m, r, &pos);
        const int64_t spans = pos < 0 ? 1 : pos / SPLIT_SPAN + 1;
        long_ctx |= spans > 2;
        first[r + 1] = first[r] + spans;
    }
    float *part = long_ctx ? malloc(sizeof(float) * (size_t)(first[n_rows] * n_kv * split_part_floats(jb))) : NULL;
    if (!part) { /* short contexts, or no memory: the unsplit loop needs none */
        free(first);
        return false;
    }
    split_job sj = {.jb = jb, .first = first, .part = part};
    *st = fl_pool_for(first[n_rows] * n_kv, 1, split_spans, &sj);
    if (*st == FL_OK) *st = fl_pool_for((int64_t)n_rows * n_kv, 1, split_merge, &sj);
    free(part);
    free(first);
    return true;
}

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
    const int n_rows = m->q_start[m->n_seqs];
    /* f32 and bf16 caches only: int8 / fp8 records keep the plain loops, whose order
     * the fp8 demo test's near-tie greedy tokens were measured with */
    const bool vec = fl_cpu_isa_has_avx2(fl_cpu_backend_isa(b));
    attn_job jb = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out, .m = m, .code = code,
                   .q_stride = q_stride, .n_heads = n_heads, .head_dim = head_dim, .group = group,
                   .kv_dim = kv_dim, .rb = rb, .vals = vals, .scale = scale, .i8 = i8, .vec = vec,
                   .bf16 = !i8 && b && b->kv_bf16, .blocked = !i8 && b && b->kv_block_size > 0};
    if (jb.blocked && (b->kv_block_size != m->block_size || b->kv_head_dim != head_dim))
        return FL_ERR(FL_ERR_INVALID_ARG, "attention: a cache of %d-slot blocks of %d-value heads, read as %d / %d",
                      b->kv_block_size, b->kv_head_dim, m->block_size, head_dim);
    /* one (row, head) or (row, KV head) at a time: rows see different context lengths */
    if (i8) return fl_pool_for((int64_t)n_rows * n_heads, 1, attn_pairs, &jb);
    fl_status st = FL_OK;
    if (attn_split(&jb, n_rows, &st)) return st;
    return fl_pool_for((int64_t)n_rows * n_kv_heads, 1, attn_groups, &jb);
}

typedef struct mla_job {
    const void *q, *k_cache, *v_cache;
    void *out;
    const fl_attn_meta *m;
    const float *code, *wf;
    float *ws; /* per thread: q_lat [kv_lora] | acc [kv_lora] | one cached record [rec] */
    int n_heads, nope, rope, v_dim, kv_lora, rec, half, qk, kvb, grp;
    size_t rb, vals;
    float scale;
    bool i8, bf16;
} mla_job;

/* (row, head) pairs [lo, hi), row-major (a pool task). */
static void mla_pairs(void *ctx, int64_t lo, int64_t hi, int thread) {
    const mla_job *jb = ctx;
    const fl_attn_meta *m = jb->m;
    const void *q = jb->q, *k_cache = jb->k_cache, *v_cache = jb->v_cache;
    void *out = jb->out;
    const float *code = jb->code, *wf = jb->wf, *kc = k_cache, *vc = v_cache;
    const int n_heads = jb->n_heads, nope = jb->nope, rope = jb->rope, v_dim = jb->v_dim, kv_lora = jb->kv_lora;
    const int half = jb->half, qk = jb->qk, kvb = jb->kvb, grp = jb->grp;
    const size_t rb = jb->rb, vals = jb->vals;
    const float scale = jb->scale;
    const bool i8 = jb->i8;
    float *ws = jb->ws + (size_t)thread * (size_t)(2 * kv_lora + jb->rec);
    float *q_lat = ws, *acc = ws + kv_lora, *r = ws + 2 * kv_lora;
    for (int64_t idx = lo; idx < hi; idx++) {
        const int row = (int)(idx / n_heads), h = (int)(idx % n_heads);
        int pos;
        const int32_t *bt = row_at(m, row, &pos);
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
            } else if (jb->bf16) {
                const uint16_t *kb = (const uint16_t *)k_cache + slot * half, *vb = (const uint16_t *)v_cache + slot * half;
                for (int j = 0; j < half; j++) r[j] = fl_bf16_to_f32(kb[j]), r[half + j] = fl_bf16_to_f32(vb[j]);
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
    const int n_rows = m->q_start[m->n_seqs];
    const int nt = fl_pool_threads();
    float *ws = malloc(sizeof(float) * (size_t)nt * (size_t)(2 * kv_lora + rec));
    if (!ws) {
        free(wf);
        return FL_ERR(FL_ERR_OOM, "out of memory in mla_attention");
    }
    mla_job jb = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out, .m = m, .code = code, .wf = wf,
                  .ws = ws, .n_heads = n_heads, .nope = nope, .rope = rope, .v_dim = v_dim, .kv_lora = kv_lora,
                  .rec = rec, .half = half, .qk = qk, .kvb = kvb, .grp = grp, .rb = rb, .vals = vals,
                  .scale = scale, .i8 = i8, .bf16 = !i8 && b && b->kv_bf16};
    /* one (row, head) at a time: rows see different context lengths */
    fl_status st = fl_pool_for((int64_t)n_rows * n_heads, 1, mla_pairs, &jb);
    free(ws);
    free(wf);
    return st;
}
