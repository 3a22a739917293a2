/*
 * quantize_layer.c — the f32 host forward of one dense decoder layer
 * (quantize_layer.h), written as transformers' LlamaDecoderLayer /
 * Qwen2DecoderLayer compute it: RMSNorm, q|k|v (+ bias), RoPE, causal
 * grouped-query attention, o_proj, residual, RMSNorm, SwiGLU MLP, residual.
 */
#include "launcher/quantize_layer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/pool.h"
#include "launcher/awq_calib.h"
#include "runtime/model/rope.h"

const char *const FL_QLAYER_NAMES[FL_QLIN_COUNT] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj",
};

static fl_status load_vector(const fl_ckpt *ck, const char *name, int64_t n, float **out) {
    fl_tensor t;
    const int64_t expect[1] = {n};
    FL_TRY(fl_ckpt_load_tensor(ck, name, 1, expect, &t));
    fl_status st = FL_OK;
    *out = malloc((size_t)n * sizeof **out);
    if (!*out) st = FL_ERR(FL_ERR_OOM, "out of memory reading %s", name);
    else {
        fl_tensor row = t;
        row.ndim = 2;
        row.shape[0] = 1;
        row.shape[1] = n;
        fl_tensor_row_f32(&row, 0, *out);
    }
    fl_tensor_free(&t);
    return st;
}

static fl_status load_matrix(const fl_ckpt *ck, const char *prefix, int64_t out, int64_t in, float **w) {
    fl_tensor t;
    FL_TRY(fl_ckpt_load_linear(ck, prefix, out, in, FL_LOAD_AS_STORED, &t));
    fl_status st = FL_OK;
    *w = malloc((size_t)(out * in) * sizeof **w);
    if (!*w) st = FL_ERR(FL_ERR_OOM, "out of memory reading %s", prefix);
    else
        for (int64_t r = 0; r < out; r++) fl_tensor_row_f32(&t, r, *w + r * in);
    fl_tensor_free(&t);
    return st;
}

fl_status fl_qlayer_load(const fl_ckpt *ck, const fl_model_config *cfg, int l, fl_qlayer *L) {
    memset(L, 0, sizeof *L);
    const int64_t d = cfg->hidden_size, qd = (int64_t)cfg->n_heads * cfg->head_dim,
                  kvd = (int64_t)cfg->n_kv_heads * cfg->head_dim, ff = cfg->intermediate_size;
    const int64_t outs[FL_QLIN_COUNT] = {qd, kvd, kvd, d, ff, ff, d}, ins[FL_QLIN_COUNT] = {d, d, d, qd, d, d, ff};
    char name[256];
    fl_status st = FL_OK;
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    FL_TRY_GOTO(load_vector(ck, name, d, &L->in_norm), st, fail);
    snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
    FL_TRY_GOTO(load_vector(ck, name, d, &L->post_norm), st, fail);
    for (int k = 0; k < FL_QLIN_COUNT; k++) {
        L->out[k] = outs[k];
        L->in[k] = ins[k];
        snprintf(name, sizeof name, "model.layers.%d.%s", l, FL_QLAYER_NAMES[k]);
        FL_TRY_GOTO(load_matrix(ck, name, outs[k], ins[k], &L->w[k]), st, fail);
    }
    if (cfg->attention_bias)
        for (int k = 0; k < 3; k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s.bias", l, FL_QLAYER_NAMES[k]);
            FL_TRY_GOTO(load_vector(ck, name, outs[k], &L->bias[k]), st, fail);
        }
    return FL_OK;
fail:
    fl_qlayer_free(L);
    return st;
}

void fl_qlayer_free(fl_qlayer *L) {
    if (!L) return;
    free(L->in_norm);
    free(L->post_norm);
    for (int k = 0; k < FL_QLIN_COUNT; k++) free(L->w[k]);
    for (int k = 0; k < 3; k++) free(L->bias[k]);
    memset(L, 0, sizeof *L);
}

fl_status fl_qlayer_capture_alloc(const fl_model_config *cfg, int64_t n, fl_qlayer_capture *c) {
    memset(c, 0, sizeof *c);
    const size_t d = (size_t)cfg->hidden_size, qd = (size_t)cfg->n_heads * (size_t)cfg->head_dim;
    c->qkv = malloc((size_t)n * d * sizeof(float));
    c->o = malloc((size_t)n * qd * sizeof(float));
    c->gu = malloc((size_t)n * d * sizeof(float));
    c->down = malloc((size_t)n * (size_t)cfg->intermediate_size * sizeof(float));
    if (c->qkv && c->o && c->gu && c->down) return FL_OK;
    fl_qlayer_capture_free(c);
    return FL_ERR(FL_ERR_OOM, "out of memory for the calibration activations of %lld tokens", (long long)n);
}

void fl_qlayer_capture_free(fl_qlayer_capture *c) {
    if (!c) return;
    free(c->qkv);
    free(c->o);
    free(c->gu);
    free(c->down);
    memset(c, 0, sizeof *c);
}

typedef struct norm_job {
    const float *x, *w;
    float *out;
    int d;
    float eps;
} norm_job;

/* Rows [lo, hi) (a pool task). */
static void rmsnorm_rows(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const norm_job *j = ctx;
    const int d = j->d;
    for (int64_t t = lo; t < hi; t++) {
        double ss = 0;
        for (int i = 0; i < d; i++) ss += (double)j->x[t * d + i] * j->x[t * d + i];
        const float r = 1.0f / sqrtf((float)(ss / d) + j->eps);
        for (int i = 0; i < d; i++) j->out[t * d + i] = j->x[t * d + i] * r * j->w[i];
    }
}

fl_status fl_qlayer_rmsnorm(const float *x, const float *w, int64_t n, int d, float eps, float *out) {
    norm_job j = {.x = x, .w = w, .out = out, .d = d, .eps = eps};
    return fl_pool_for(n, 0, rmsnorm_rows, &j);
}

/* RoPE on every head of n rows (stride floats apart) of one block. */
static void rope(float *x, int n, int heads, int hd, int stride, const float *cs, const float *sn, int rot,
                 bool interleaved) {
    const int half = rot / 2;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < heads; h++) {
            float *v = x + (int64_t)t * stride + (int64_t)h * hd;
            for (int i = 0; i < half; i++) {
                const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
                const float c = cs[t * half + i], s = sn[t * half + i], x1 = v[a], x2 = v[b];
                v[a] = x1 * c - x2 * s;
                v[b] = x2 * c + x1 * s;
            }
        }
}

typedef struct att_job {
    const float *q, *k, *v;
    float *out, *rows; /* rows: [threads, n] score scratch */
    int n, H, KV, hd;
    float scale;
} att_job;

/* (head, token) pairs [lo, hi), head-major (a pool task). */
static void attention_pairs(void *ctx, int64_t lo, int64_t hi, int thread) {
    const att_job *j = ctx;
    const float *q = j->q, *k = j->k, *v = j->v;
    const int n = j->n, H = j->H, KV = j->KV, hd = j->hd;
    const float scale = j->scale;
    float *row = j->rows + (int64_t)thread * n;
    for (int64_t ht = lo; ht < hi; ht++) {
        const int h = (int)(ht / n), t = (int)(ht % n), kh = h / (H / KV);
        const float *qv = q + (int64_t)t * H * hd + (int64_t)h * hd;
        float mx = -INFINITY;
        for (int s = 0; s <= t; s++) {
            const float *kv = k + (int64_t)s * KV * hd + (int64_t)kh * hd;
            float dot = 0;
            for (int i = 0; i < hd; i++) dot += qv[i] * kv[i];
            row[s] = dot * scale;
            mx = fmaxf(mx, row[s]);
        }
        double sum = 0;
        for (int s = 0; s <= t; s++) {
            row[s] = expf(row[s] - mx);
            sum += row[s];
        }
        float *o = j->out + (int64_t)t * H * hd + (int64_t)h * hd;
        memset(o, 0, (size_t)hd * sizeof *o);
        for (int s = 0; s <= t; s++) {
            const float p = (float)(row[s] / sum);
            const float *vv = v + (int64_t)s * KV * hd + (int64_t)kh * hd;
            for (int i = 0; i < hd; i++) o[i] += p * vv[i];
        }
    }
}

/* Causal attention of one block of n tokens: out[n, H * hd]. */
static fl_status attention(const float *q, const float *k, const float *v, int n, int H, int KV, int hd,
                           float *out) {
    float *rows = malloc((size_t)fl_pool_threads() * (size_t)n * sizeof *rows);
    if (!rows) return FL_ERR(FL_ERR_OOM, "out of memory in the calibration attention");
    att_job j = {.q = q, .k = k, .v = v, .out = out, .rows = rows, .n = n, .H = H, .KV = KV, .hd = hd,
                 .scale = 1.0f / sqrtf((float)hd)};
    fl_status st = fl_pool_for((int64_t)H * n, 8, attention_pairs, &j);
    free(rows);
    return st;
}

fl_status fl_qlayer_forward(fl_backend *be, const fl_model_config *cfg, const fl_qlayer *L, const float *h_in,
                            const int *blk_len, int n_blk, float *h_out, fl_qlayer_capture *c) {
    int64_t n = 0;
    int max_len = 0;
    for (int b = 0; b < n_blk; b++) {
        n += blk_len[b];
        if (blk_len[b] > max_len) max_len = blk_len[b];
    }
    const int d = cfg->hidden_size, H = cfg->n_heads, KV = cfg->n_kv_heads, hd = cfg->head_dim,
              ff = cfg->intermediate_size, rot = fl_rope_dim(cfg);
    const int64_t qd = (int64_t)H * hd, kvd = (int64_t)KV * hd;
    fl_status st = FL_OK;
    float *xn = malloc((size_t)(n * d) * sizeof(float)), *q = malloc((size_t)(n * qd) * sizeof(float));
    float *k = malloc((size_t)(n * kvd) * sizeof(float)), *v = malloc((size_t)(n * kvd) * sizeof(float));
    float *att = malloc((size_t)(n * qd) * sizeof(float)), *y = malloc((size_t)(n * d) * sizeof(float));
    float *g = malloc((size_t)(n * ff) * sizeof(float)), *u = malloc((size_t)(n * ff) * sizeof(float));
    float *cs = malloc((size_t)max_len * (size_t)(rot / 2 + 1) * sizeof(float));
    float *sn = malloc((size_t)max_len * (size_t)(rot / 2 + 1) * sizeof(float));
    int32_t *pos = malloc((size_t)max_len * sizeof *pos);
    FL_CHECK_ALLOC(xn, st, done);
    FL_CHECK_ALLOC(q, st, done);
    FL_CHECK_ALLOC(k, st, done);
    FL_CHECK_ALLOC(v, st, done);
    FL_CHECK_ALLOC(att, st, done);
    FL_CHECK_ALLOC(y, st, done);
    FL_CHECK_ALLOC(g, st, done);
    FL_CHECK_ALLOC(u, st, done);
    FL_CHECK_ALLOC(cs, st, done);
    FL_CHECK_ALLOC(sn, st, done);
    FL_CHECK_ALLOC(pos, st, done);
    FL_TRY_GOTO(fl_qlayer_rmsnorm(h_in, L->in_norm, n, d, cfg->rms_norm_eps, xn), st, done);
    if (c) memcpy(c->qkv, xn, (size_t)(n * d) * sizeof(float));
    FL_TRY_GOTO(fl_awq_matmul_blocks(be, xn, blk_len, n_blk, L->w[FL_QLIN_Q], qd, d, L->bias[0], q), st, done);
    FL_TRY_GOTO(fl_awq_matmul_blocks(be, xn, blk_len, n_blk, L->w[FL_QLIN_K], kvd, d, L->bias[1], k), st, done);
    FL_TRY_GOTO(fl_awq_matmul_blocks(be, xn, blk_len, n_blk, L->w[FL_QLIN_V], kvd, d, L->bias[2], v), st, done);
    for (int i = 0; i < max_len; i++) pos[i] = i;
    for (int b = 0, t0 = 0; b < n_blk; t0 += blk_len[b], b++) {
        const int len = blk_len[b];
        fl_rope_fill(cfg, NULL, len, pos, len, cs, sn);
        rope(q + (int64_t)t0 * qd, len, H, hd, (int)qd, cs, sn, rot, cfg->rope.interleaved);
        rope(k + (int64_t)t0 * kvd, len, KV, hd, (int)kvd, cs, sn, rot, cfg->rope.interleaved);
        FL_TRY_GOTO(attention(q + (int64_t)t0 * qd, k + (int64_t)t0 * kvd, v + (int64_t)t0 * kvd, len, H, KV, hd,
                              att + (int64_t)t0 * qd), st, done);
    }
    if (c) memcpy(c->o, att, (size_t)(n * qd) * sizeof(float));
    FL_TRY_GOTO(fl_awq_matmul_blocks(be, att, blk_len, n_blk, L->w[FL_QLIN_O], d, qd, NULL, y), st, done);
    for (int64_t i = 0; i < n * d; i++) h_out[i] = h_in[i] + y[i];
    FL_TRY_GOTO(fl_qlayer_rmsnorm(h_out, L->post_norm, n, d, cfg->rms_norm_eps, xn), st, done);
    if (c) memcpy(c->gu, xn, (size_t)(n * d) * sizeof(float));
    FL_TRY_GOTO(fl_awq_matmul_blocks(be, xn, blk_len, n_blk, L->w[FL_QLIN_GATE], ff, d, NULL, g), st, done);
    FL_TRY_GOTO(fl_awq_matmul_blocks(be, xn, blk_len, n_blk, L->w[FL_QLIN_UP], ff, d, NULL, u), st, done);
    for (int64_t i = 0; i < n * ff; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    if (c) memcpy(c->down, g, (size_t)(n * ff) * sizeof(float));
    FL_TRY_GOTO(fl_awq_matmul_blocks(be, g, blk_len, n_blk, L->w[FL_QLIN_DOWN], d, ff, NULL, y), st, done);
    for (int64_t i = 0; i < n * d; i++) h_out[i] += y[i];
done:
    free(xn);
    free(q);
    free(k);
    free(v);
    free(att);
    free(y);
    free(g);
    free(u);
    free(cs);
    free(sn);
    free(pos);
    return st;
}
