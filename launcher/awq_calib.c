/*
 * awq_calib.c — AWQ's quantization, scale search and clipping search
 * (awq_calib.h), following AutoAWQ's quantizer (pseudo_quantize_tensor,
 * _compute_best_scale with duo scaling off, _compute_best_clip) so that a
 * checkpoint made here is what AutoAWQ would make from the same features.
 */
#include "launcher/awq_calib.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/tensor.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/pool.h"

/* Tokens per fl_cpu_matmul call: a block of x stays in cache while every
 * weight row passes over it. */
enum { MM_TOKENS = 64 };

fl_status fl_awq_matmul(const float *x, int64_t n, const float *w, int64_t out, int64_t in, const float *bias,
                        float *y) {
    fl_tensor wt = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {out, in}, .data = (void *)w};
    fl_tensor bt = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {out}, .data = (void *)bias};
    for (int64_t t = 0; t < n; t += MM_TOKENS) {
        const int nb = (int)(n - t < MM_TOKENS ? n - t : MM_TOKENS);
        FL_TRY(fl_cpu_matmul(NULL, x + t * in, nb, &wt, bias ? &bt : NULL, y + t * out));
    }
    return FL_OK;
}

void fl_awq_quant_group(float *v, int n, fl_dtype scale_dt, int deq, uint8_t *codes, float *scale,
                        uint8_t *zero) {
    float mn = v[0], mx = v[0];
    for (int i = 1; i < n; i++) {
        mn = fminf(mn, v[i]);
        mx = fmaxf(mx, v[i]);
    }
    float s = fmaxf(mx - mn, 1e-5f) / 15.0f;
    if (scale_dt == FL_DTYPE_F16) s = fl_f16_to_f32(fl_f32_to_f16(s));
    else if (scale_dt == FL_DTYPE_BF16) s = fl_bf16_to_f32(fl_f32_to_bf16(s));
    float z = fminf(fmaxf(-rintf(mn / s), 0.0f), 15.0f); /* rintf: torch.round is half-to-even */
    for (int i = 0; i < n; i++) {
        float q = fminf(fmaxf(rintf(v[i] / s) + z, 0.0f), 15.0f);
        if (codes) codes[i] = (uint8_t)q;
        if (deq) v[i] = (q - z) * s;
    }
    if (scale) *scale = s;
    if (zero) *zero = (uint8_t)z;
}

typedef struct fq_job {
    float *w;
    int group;
} fq_job;

/* Groups [lo, hi) (a pool task). */
static void fake_quant_groups(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const fq_job *j = ctx;
    for (int64_t g = lo; g < hi; g++)
        fl_awq_quant_group(j->w + g * j->group, j->group, FL_DTYPE_F32, 1, NULL, NULL, NULL);
}

fl_status fl_awq_fake_quant(float *w, int64_t rows, int64_t cols, int group) {
    fq_job j = {.w = w, .group = group};
    return fl_pool_for(rows * (cols / group), 0, fake_quant_groups, &j);
}

/* On a backend: the weight (and bias) uploaded once, a block's tokens
 * through one matmul each. */
static fl_status be_matmul_blocks(fl_backend *be, const float *x, const int *blk_len, int n_blk, const float *w,
                                  int64_t out, int64_t in, const float *bias, float *y) {
    int most = 0;
    for (int b = 0; b < n_blk; b++) most = blk_len[b] > most ? blk_len[b] : most;
    if (most == 0) return FL_OK;
    fl_tensor wt = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {out, in}, .data = (void *)w};
    fl_tensor bt = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {out}, .data = (void *)bias};
    fl_tensor dw = {0}, db = {0};
    void *dx = NULL, *dy = NULL;
    fl_status st = be->ops->upload_weight(be, &wt, &dw);
    bool have_w = st == FL_OK, have_b = false;
    if (st == FL_OK && bias) have_b = (st = be->ops->upload_weight(be, &bt, &db)) == FL_OK;
    if (st == FL_OK) st = be->ops->alloc(be, fl_backend_act_bytes(be, (size_t)most * (size_t)in), &dx);
    if (st == FL_OK) st = be->ops->alloc(be, fl_backend_act_bytes(be, (size_t)most * (size_t)out), &dy);
    for (int b = 0, t0 = 0; b < n_blk && st == FL_OK; t0 += blk_len[b], b++) {
        const int len = blk_len[b];
        if (len == 0) continue;
        st = be->ops->upload_act(be, dx, x + (int64_t)t0 * in, (size_t)len * (size_t)in);
        if (st == FL_OK) st = be->ops->matmul(be, dx, len, &dw, have_b ? &db : NULL, dy);
        if (st == FL_OK) st = be->ops->download_act(be, y + (int64_t)t0 * out, dy, (size_t)len * (size_t)out);
    }
    if (dx) be->ops->free(be, dx);
    if (dy) be->ops->free(be, dy);
    if (have_b) be->ops->free_weight(be, &db);
    if (have_w) be->ops->free_weight(be, &dw);
    return st;
}

fl_status fl_awq_matmul_blocks(fl_backend *be, const float *x, const int *blk_len, int n_blk, const float *w,
                               int64_t out, int64_t in, const float *bias, float *y) {
    if (be) return be_matmul_blocks(be, x, blk_len, n_blk, w, out, in, bias, y);
    for (int b = 0, t0 = 0; b < n_blk; t0 += blk_len[b], b++)
        FL_TRY(fl_awq_matmul(x + (int64_t)t0 * in, blk_len[b], w, out, in, bias, y + (int64_t)t0 * out));
    return FL_OK;
}

/* sh, or (NULL) the share of one rank holding one block of n tokens in *one. */
static fl_status share_or_one(const fl_qshare *sh, int64_t n, fl_qshare *one, const fl_qshare **out) {
    *out = sh;
    if (sh) return FL_OK;
    if (n > INT32_MAX) return FL_ERR(FL_ERR_INVALID_ARG, "%lld calibration tokens in one block", (long long)n);
    const int len = (int)n;
    FL_TRY(fl_qshare_init(NULL, &len, 1, one));
    *out = one;
    return FL_OK;
}

enum { MSE_CHUNK = 4096 };

typedef struct mse_job {
    const float *a, *b;
    double *part;
    size_t n;
} mse_job;

/* Chunks [lo, hi) of MSE_CHUNK values (a pool task). */
static void mse_chunks(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const mse_job *j = ctx;
    for (int64_t c = lo; c < hi; c++) {
        double s = 0;
        for (size_t i = (size_t)c * MSE_CHUNK; i < j->n && i < (size_t)(c + 1) * MSE_CHUNK; i++)
            s += ((double)j->a[i] - j->b[i]) * ((double)j->a[i] - j->b[i]);
        j->part[c] = s;
    }
}

/* Sum of squared differences, in fixed chunks so that the result (and so
 * the chosen alpha) does not depend on the number of threads. */
static fl_status sq_diff_sum(const float *a, const float *b, size_t n, double *out) {
    const size_t nc = (n + MSE_CHUNK - 1) / MSE_CHUNK;
    double *part = malloc((nc ? nc : 1) * sizeof *part), sum = 0;
    if (!part) return FL_ERR(FL_ERR_OOM, "out of memory in the AWQ scale search");
    mse_job j = {.a = a, .b = b, .part = part, .n = n};
    fl_status st = fl_pool_for((int64_t)nc, 0, mse_chunks, &j);
    for (size_t c = 0; c < nc; c++) sum += part[c];
    free(part);
    *out = sum;
    return st;
}

/* The scales of grid point alpha from the mean |x| per channel. */
static void grid_scales(const double *xmean, int64_t in, double alpha, float *s) {
    double smax = 0, smin = INFINITY;
    for (int64_t c = 0; c < in; c++) {
        double v = fmax(pow(xmean[c], alpha), 1e-4);
        s[c] = (float)v;
        smax = fmax(smax, v);
        smin = fmin(smin, v);
    }
    const float norm = (float)sqrt(smax * smin);
    for (int64_t c = 0; c < in; c++) {
        s[c] /= norm;
        if (!isfinite(s[c])) s[c] = 1.0f; /* as AutoAWQ: a scale that overflowed is left out */
    }
}

/* Per-block partials of the search: px [blocks, in] the sum of |x| per
 * channel; pe [blocks, n_grid, n_lins] the sum of squared output errors
 * per grid point and linear. */
fl_status fl_awq_search_scale(fl_backend *be, const float *x, int64_t n, const fl_qshare *sh, int64_t in,
                              const fl_awq_linear *lins, int n_lins, int group, int n_grid, float *scales,
                              fl_awq_search *res) {
    fl_qshare one;
    const fl_qshare *S;
    FL_TRY(share_or_one(sh, n, &one, &S));
    fl_status st = FL_OK;
    const int b0 = S->first[S->rank], nb = S->first[S->rank + 1] - b0, *len = S->len + b0;
    const int64_t n_all = S->tok0[S->n_blk];
    const size_t per_e = (size_t)n_grid * (size_t)n_lins;
    int64_t tot_out = 0, max_out = 0;
    for (int k = 0; k < n_lins; k++) {
        tot_out += lins[k].out;
        if (lins[k].out > max_out) max_out = lins[k].out;
    }
    double *px = calloc((size_t)nb * (size_t)in, sizeof *px), *pe = malloc((size_t)nb * per_e * sizeof *pe);
    double *all = malloc((size_t)S->n_blk * ((size_t)in > per_e ? (size_t)in : per_e) * sizeof *all);
    double *xmean = calloc((size_t)in, sizeof *xmean);
    float *s = malloc((size_t)in * sizeof *s), *xs = malloc((size_t)(n * in) * sizeof *xs);
    float *ws = malloc((size_t)(max_out * in) * sizeof *ws);
    float *ref = malloc((size_t)(n * tot_out) * sizeof *ref), *y = malloc((size_t)(n * max_out) * sizeof *y);
    FL_CHECK_ALLOC(px, st, done);
    FL_CHECK_ALLOC(pe, st, done);
    FL_CHECK_ALLOC(all, st, done);
    FL_CHECK_ALLOC(xmean, st, done);
    FL_CHECK_ALLOC(s, st, done);
    FL_CHECK_ALLOC(xs, st, done);
    FL_CHECK_ALLOC(ws, st, done);
    FL_CHECK_ALLOC(ref, st, done);
    FL_CHECK_ALLOC(y, st, done);
    for (int b = 0, t = 0; b < nb; b++)
        for (int e = t + len[b]; t < e; t++)
            for (int64_t c = 0; c < in; c++) px[b * in + c] += fabs((double)x[t * in + c]);
    /* the mean |x| first: every rank's grid scales come from it */
    FL_TRY_GOTO(fl_qshare_gather_blocks(S, px, (size_t)in, all), st, done);
    for (int b = 0; b < S->n_blk; b++)
        for (int64_t c = 0; c < in; c++) xmean[c] += all[b * in + c];
    for (int64_t c = 0; c < in; c++) xmean[c] /= (double)n_all;
    /* the float outputs, one block of n rows per linear */
    for (int k = 0, off = 0; k < n_lins; off += (int)lins[k].out, k++)
        FL_TRY_GOTO(fl_awq_matmul_blocks(be, x, len, nb, lins[k].w, lins[k].out, in, NULL, ref + (int64_t)off * n), st,
                    done);
    for (int g = 0; g < n_grid; g++) {
        grid_scales(xmean, in, (double)g / n_grid, s);
        for (int64_t t = 0; t < n; t++)
            for (int64_t c = 0; c < in; c++) xs[t * in + c] = x[t * in + c] / s[c];
        for (int k = 0, off = 0; k < n_lins; off += (int)lins[k].out, k++) {
            const int64_t o = lins[k].out;
            for (int64_t r = 0; r < o; r++)
                for (int64_t c = 0; c < in; c++) ws[r * in + c] = lins[k].w[r * in + c] * s[c];
            FL_TRY_GOTO(fl_awq_fake_quant(ws, o, in, group), st, done);
            FL_TRY_GOTO(fl_awq_matmul_blocks(be, xs, len, nb, ws, o, in, NULL, y), st, done);
            for (int b = 0, t = 0; b < nb; t += len[b], b++) {
                double *e = &pe[(size_t)b * per_e + (size_t)(g * n_lins + k)];
                FL_TRY_GOTO(sq_diff_sum(y + (int64_t)t * o, ref + (int64_t)off * n + (int64_t)t * o,
                                        (size_t)((int64_t)len[b] * o), e), st, done);
            }
        }
    }
    FL_TRY_GOTO(fl_qshare_gather_blocks(S, pe, per_e, all), st, done);
    res->err = INFINITY;
    res->alpha = 0;
    int best = 0;
    for (int g = 0; g < n_grid; g++) {
        double err = 0;
        for (int k = 0; k < n_lins; k++) {
            double sum = 0;
            for (int b = 0; b < S->n_blk; b++) sum += all[(size_t)b * per_e + (size_t)(g * n_lins + k)];
            err += sum / (double)(n_all * lins[k].out) * (double)lins[k].out;
        }
        err /= (double)tot_out;
        if (g == 0) res->err_plain = err;
        if (err < res->err) {
            res->err = err;
            res->alpha = (float)((double)g / n_grid);
            best = g;
        }
    }
    grid_scales(xmean, in, (double)best / n_grid, scales); /* not res->alpha: a float */
done:
    if (!sh) fl_qshare_free(&one);
    free(px);
    free(pe);
    free(all);
    free(xmean);
    free(s);
    free(xs);
    free(ws);
    free(ref);
    free(y);
    return st;
}

typedef struct clip_job {
    const float *xt;  /* [nt, in] the sampled tokens */
    float *w;         /* [out, in] clipped in place */
    float *scratch;   /* per thread: org [nt] | q [group] */
    int64_t nt, in, ng, base; /* base: the first (row, group) pair of this rank */
    int group, n_grid, n_shrink;
} clip_job;

/* (row, group) pairs base + [lo, hi) (a pool task). */
static void clip_groups(void *ctx, int64_t lo, int64_t hi, int thread) {
    const clip_job *j = ctx;
    const float *xt = j->xt;
    float *w = j->w;
    const int64_t nt = j->nt, in = j->in, ng = j->ng;
    const int group = j->group, n_grid = j->n_grid, n_shrink = j->n_shrink;
    float *org = j->scratch + (int64_t)thread * (nt + group), *q = org + nt;
    for (int64_t rg = j->base + lo; rg < j->base + hi; rg++) {
        float *wg = w + (rg / ng) * in + (rg % ng) * group;
        const float *xg = xt + (rg % ng) * group;
        float amax = 0;
        for (int c = 0; c < group; c++) amax = fmaxf(amax, fabsf(wg[c]));
        for (int64_t t = 0; t < nt; t++) {
            float sum = 0;
            for (int c = 0; c < group; c++) sum += xg[t * in + c] * wg[c];
            org[t] = sum;
        }
        double best = INFINITY;
        float best_max = amax;
        for (int k = 0; k < n_shrink; k++) {
            const float mx = amax * (1.0f - (float)k / (float)n_grid);
            for (int c = 0; c < group; c++) q[c] = fminf(fmaxf(wg[c], -mx), mx);
            fl_awq_quant_group(q, group, FL_DTYPE_F32, 1, NULL, NULL, NULL);
            double err = 0;
            for (int64_t t = 0; t < nt; t++) {
                float sum = 0;
                for (int c = 0; c < group; c++) sum += xg[t * in + c] * q[c];
                const double d = (double)sum - org[t];
                err += d * d;
            }
            if (err < best) {
                best = err;
                best_max = mx;
            }
        }
        for (int c = 0; c < group; c++) wg[c] = fminf(fmaxf(wg[c], -best_max), best_max);
    }
}

/* The sampled tokens t * step (t < nt) of every rank, in order, into xt
 * [nt, in] on every rank. */
static fl_status gather_samples(const fl_qshare *S, const float *x, int64_t in, int64_t step, float *xt) {
    const int R = S->ranks;
    size_t *counts = malloc((size_t)R * sizeof *counts);
    if (!counts) return FL_ERR(FL_ERR_OOM, "out of memory in the AWQ clipping search");
    for (int r = 0; r < R; r++) {
        const int64_t t0 = fl_qshare_tok_begin(S, r), t1 = t0 + fl_qshare_tokens(S, r);
        counts[r] = (size_t)(((t1 + step - 1) / step - (t0 + step - 1) / step) * in);
    }
    const int64_t t0 = fl_qshare_tok_begin(S, S->rank), first = (t0 + step - 1) / step;
    const int64_t mine = (int64_t)counts[S->rank] / in;
    float *send = S->comm ? malloc((size_t)(mine * in + 1) * sizeof *send) : xt;
    fl_status st = FL_OK;
    FL_CHECK_ALLOC(send, st, done);
    for (int64_t t = 0; t < mine; t++)
        memcpy(send + t * in, x + ((first + t) * step - t0) * in, (size_t)in * sizeof *send);
    if (S->comm) st = fl_comm_all_gather(S->comm, send, xt, counts, FL_COMM_F32);
done:
    if (send != xt) free(send);
    free(counts);
    return st;
}

fl_status fl_awq_search_clip(const float *x, int64_t n, const fl_qshare *sh, int64_t in, float *w, int64_t out,
                             int group, int n_grid, float max_shrink, int64_t max_tokens) {
    fl_qshare one;
    const fl_qshare *S;
    FL_TRY(share_or_one(sh, n, &one, &S));
    const int64_t n_all = S->tok0[S->n_blk];
    const int64_t step = n_all > max_tokens ? n_all / max_tokens : 1, nt = (n_all + step - 1) / step;
    const int64_t ng = in / group;
    const int n_shrink = (int)(n_grid * max_shrink);
    fl_status st = FL_OK;
    float *scratch = NULL, *xt = malloc((size_t)(nt * in) * sizeof *xt); /* the sampled tokens */
    FL_CHECK_ALLOC(xt, st, done);
    FL_TRY_GOTO(gather_samples(S, x, in, step, xt), st, done);
    const int threads = fl_pool_threads();
    scratch = malloc((size_t)threads * (size_t)(nt + group) * sizeof *scratch);
    FL_CHECK_ALLOC(scratch, st, done);
    int64_t lo, hi; /* this rank's rows */
    fl_qshare_split(S, S->rank, out, &lo, &hi);
    clip_job j = {.xt = xt, .w = w, .scratch = scratch, .nt = nt, .in = in, .ng = ng, .base = lo * ng,
                  .group = group, .n_grid = n_grid, .n_shrink = n_shrink};
    if (hi > lo) FL_TRY_GOTO(fl_pool_for((hi - lo) * ng, 4, clip_groups, &j), st, done);
    st = fl_qshare_gather_split(S, w, out, in);
done:
    if (!sh) fl_qshare_free(&one);
    free(scratch);
    free(xt);
    return st;
}

/* A packing task's scratch: one group's values, then its codes (NULL, and
 * oom set, when out of memory). */
static float *group_scratch(int group, atomic_int *oom) {
    float *v = malloc((size_t)group * (sizeof *v + 1));
    if (!v) atomic_store(oom, 1);
    return v;
}

static const int pack_order[8] = {0, 2, 4, 6, 1, 3, 5, 7}; /* AutoAWQ's AWQ_ORDER */

typedef struct pack_job {
    const float *w;
    uint32_t *qweight, *qzeros;
    uint16_t *scales;
    int64_t out, in, ng, words;
    int group;
    atomic_int oom;
} pack_job;

/* Word columns [lo, hi): no two threads share a word (a pool task). */
static void pack_words(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    pack_job *jb = ctx;
    const int64_t out = jb->out, in = jb->in, ng = jb->ng, words = jb->words;
    const int group = jb->group;
    float *v = group_scratch(group, &jb->oom);
    if (!v) return;
    uint8_t *codes = (uint8_t *)(v + group);
    for (int64_t j = lo; j < hi; j++)
        for (int k = 0; k < 8; k++) {
            const int64_t o = 8 * j + pack_order[k];
            for (int64_t g = 0; g < ng; g++) {
                float s;
                uint8_t z;
                memcpy(v, jb->w + o * in + g * group, (size_t)group * sizeof *v);
                fl_awq_quant_group(v, group, FL_DTYPE_F16, 0, codes, &s, &z);
                jb->scales[g * out + o] = fl_f32_to_f16(s);
                jb->qzeros[g * words + j] |= (uint32_t)z << (4 * k);
                for (int c = 0; c < group; c++)
                    jb->qweight[(g * group + c) * words + j] |= (uint32_t)codes[c] << (4 * k);
            }
        }
    free(v);
}

fl_status fl_awq_pack_gemm(const float *w, int64_t out, int64_t in, int group, uint32_t *qweight, uint32_t *qzeros,
                           uint16_t *scales) {
    const int64_t ng = in / group, words = out / 8;
    memset(qweight, 0, (size_t)(in * words) * sizeof *qweight);
    memset(qzeros, 0, (size_t)(ng * words) * sizeof *qzeros);
    pack_job j = {.w = w, .qweight = qweight, .qzeros = qzeros, .scales = scales, .out = out, .in = in, .ng = ng,
                  .words = words, .group = group};
    FL_TRY(fl_pool_for(words, 0, pack_words, &j));
    return atomic_load(&j.oom) ? FL_ERR(FL_ERR_OOM, "out of memory packing a linear") : FL_OK;
}

typedef struct ct_job {
    const float *w;
    uint32_t *packed, *zeros;
    void *scales;
    int64_t out, in, ng;
    int group;
    fl_dtype round_dt, scale_dt;
    atomic_int oom;
} ct_job;

static void store_scale(void *scales, fl_dtype dt, size_t i, float s) {
    if (dt == FL_DTYPE_F32) ((float *)scales)[i] = s;
    else if (dt == FL_DTYPE_F16) ((uint16_t *)scales)[i] = fl_f32_to_f16(s);
    else ((uint16_t *)scales)[i] = fl_f32_to_bf16(s);
}

/* Runs of 8 output rows [lo, hi): a zero-point word holds 8 rows, so no
 * two threads share a word (a pool task). */
static void pack_ct_rows(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    ct_job *jb = ctx;
    const int64_t in = jb->in, ng = jb->ng;
    const int group = jb->group;
    float *v = group_scratch(group, &jb->oom);
    if (!v) return;
    uint8_t *codes = (uint8_t *)(v + group);
    for (int64_t j = lo; j < hi; j++)
        for (int64_t o = 8 * j; o < 8 * j + 8 && o < jb->out; o++)
            for (int64_t g = 0; g < ng; g++) {
                float s;
                uint8_t z;
                memcpy(v, jb->w + o * in + g * group, (size_t)group * sizeof *v);
                fl_awq_quant_group(v, group, jb->round_dt, 0, codes, &s, &z);
                store_scale(jb->scales, jb->scale_dt, (size_t)(o * ng + g), s);
                jb->zeros[j * ng + g] |= (uint32_t)z << (4 * (o % 8));
                for (int c = 0; c < group; c++) {
                    const int64_t i = g * group + c;
                    jb->packed[o * (in / 8) + i / 8] |= (uint32_t)codes[c] << (4 * (i % 8));
                }
            }
    free(v);
}

fl_status fl_awq_pack_ct(const float *w, int64_t out, int64_t in, int group, fl_dtype round_dt, fl_dtype scale_dt,
                         uint32_t *packed, uint32_t *zeros, void *scales) {
    const int64_t ng = in / group, octets = (out + 7) / 8;
    memset(packed, 0, (size_t)(out * (in / 8)) * sizeof *packed);
    memset(zeros, 0, (size_t)(octets * ng) * sizeof *zeros);
    ct_job j = {.w = w, .packed = packed, .zeros = zeros, .scales = scales, .out = out, .in = in, .ng = ng,
                .group = group, .round_dt = round_dt, .scale_dt = scale_dt};
    FL_TRY(fl_pool_for(octets, 0, pack_ct_rows, &j));
    return atomic_load(&j.oom) ? FL_ERR(FL_ERR_OOM, "out of memory packing a linear") : FL_OK;
}
