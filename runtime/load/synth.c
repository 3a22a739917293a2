/*
 * synth.c — synthetic random-weight models of real shapes (see synth.h).
 */
#include "runtime/load/synth.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/pool.h"
#include "runtime/load/quant.h"

/* Each preset's shapes, over the common defaults fl_synth_preset sets. */
static void llama_3_8b(fl_model_config *c) {
    c->arch = FL_ARCH_LLAMA;
    c->n_layers = 32, c->hidden_size = 4096, c->n_heads = 32, c->n_kv_heads = 8;
    c->intermediate_size = 14336, c->vocab_size = 128256, c->rope.theta = 500000;
}

static void qwen2_7b(fl_model_config *c) {
    c->arch = FL_ARCH_QWEN2;
    c->n_layers = 28, c->hidden_size = 3584, c->n_heads = 28, c->n_kv_heads = 4;
    c->intermediate_size = 18944, c->vocab_size = 152064, c->rope.theta = 1000000;
    c->attention_bias = true;
    c->rms_norm_eps = 1e-6f;
}

static void mixtral_8x7b(fl_model_config *c) {
    c->arch = FL_ARCH_MIXTRAL;
    c->n_layers = 32, c->hidden_size = 4096, c->n_heads = 32, c->n_kv_heads = 8;
    c->intermediate_size = 14336, c->vocab_size = 32000, c->rope.theta = 1000000;
    c->n_experts = 8, c->n_experts_per_tok = 2, c->norm_topk_prob = true;
}

static void qwen3_30b_a3b(fl_model_config *c) {
    c->arch = FL_ARCH_QWEN3_MOE;
    c->n_layers = 48, c->hidden_size = 2048, c->n_heads = 32, c->n_kv_heads = 4;
    c->head_dim = 128, c->intermediate_size = 6144, c->vocab_size = 151936;
    c->rope.theta = 1000000, c->qk_norm = true, c->rms_norm_eps = 1e-6f;
    c->n_experts = 128, c->n_experts_per_tok = 8, c->moe_intermediate_size = 768;
    c->norm_topk_prob = true;
}

/* small shapes for tests and CPU smoke runs (every size divides by 4 ranks) */
static void tiny_shapes(fl_model_config *c, bool moe) {
    c->arch = moe ? FL_ARCH_MIXTRAL : FL_ARCH_LLAMA;
    c->n_layers = 2, c->hidden_size = 256, c->n_heads = 8, c->n_kv_heads = 4;
    c->intermediate_size = 512, c->vocab_size = 1000, c->rope.theta = 10000;
    if (moe) c->n_experts = 4, c->n_experts_per_tok = 2, c->norm_topk_prob = true;
}
static void tiny(fl_model_config *c) { tiny_shapes(c, false); }
static void tiny_moe(fl_model_config *c) { tiny_shapes(c, true); }

/* DeepSeek-V2-Lite's config.json (MLA, 64 routed + 2 shared experts, layer
 * 0 dense); tiny-mla: the same structure at test sizes */
static void deepseek_shapes(fl_model_config *c, bool tiny) {
    c->arch = FL_ARCH_DEEPSEEK_V2;
    c->n_layers = tiny ? 2 : 27, c->hidden_size = tiny ? 256 : 2048, c->n_heads = tiny ? 8 : 16;
    c->intermediate_size = tiny ? 512 : 10944, c->vocab_size = tiny ? 1000 : 102400;
    c->rope.theta = 10000, c->rms_norm_eps = 1e-6f;
    c->mla = (fl_mla_config){.q_lora_rank = 0, .kv_lora_rank = tiny ? 64 : 512,
                             .qk_nope_head_dim = tiny ? 32 : 128, .qk_rope_head_dim = tiny ? 16 : 64,
                             .v_head_dim = tiny ? 32 : 128};
    c->n_kv_heads = 1; /* the cache holds one latent record per token (model_config.h) */
    c->head_dim = (c->mla.kv_lora_rank + c->mla.qk_rope_head_dim) / 2;
    c->n_experts = tiny ? 8 : 64, c->n_experts_per_tok = tiny ? 2 : 6;
    c->moe_intermediate_size = tiny ? 128 : 1408, c->n_shared_experts = 2;
    c->shared_expert_intermediate_size = c->moe_intermediate_size * c->n_shared_experts;
    c->first_k_dense_replace = 1, c->moe_layer_freq = 1, c->routed_scaling_factor = 1.0f;
    c->topk_method = FL_TOPK_GREEDY, c->n_group = 1, c->topk_group = 1;
}
static void deepseek_v2_lite(fl_model_config *c) { deepseek_shapes(c, false); }
static void tiny_mla(fl_model_config *c) { deepseek_shapes(c, true); }

/* The presets: `flotilla bench --help` and the unknown-name error list them
 * from here. */
static const struct preset {
    const char *name, *about;
    void (*fill)(fl_model_config *c);
} presets[] = {
    {"llama-3-8b", "Llama-3-8B: 32 layers, hidden 4096, GQA 32/8 heads", llama_3_8b},
    {"qwen2-7b", "Qwen2-7B: 28 layers, hidden 3584, GQA 28/4 heads, q/k/v bias", qwen2_7b},
    {"mixtral-8x7b", "Mixtral-8x7B: 32 layers, 8 experts, top-2", mixtral_8x7b},
    {"qwen3-30b-a3b", "Qwen3-30B-A3B: 48 layers, 128 experts, top-8, q/k norms", qwen3_30b_a3b},
    {"deepseek-v2-lite", "DeepSeek-V2-Lite: 27 layers, MLA, 64 routed + 2 shared experts", deepseek_v2_lite},
    {"tiny", "a 2-layer Llama of test sizes (CPU smoke runs)", tiny},
    {"tiny-moe", "a 2-layer Mixtral of test sizes, 4 experts", tiny_moe},
    {"tiny-mla", "a 2-layer DeepSeek-V2 (MLA) of test sizes, 8 experts", tiny_mla},
};
enum { N_PRESETS = sizeof presets / sizeof presets[0] };

int fl_synth_preset_count(void) { return N_PRESETS; }
const char *fl_synth_preset_name(int i) { return i >= 0 && i < N_PRESETS ? presets[i].name : NULL; }
const char *fl_synth_preset_about(int i) { return i >= 0 && i < N_PRESETS ? presets[i].about : NULL; }

fl_status fl_synth_preset(const char *name, fl_model_config *c) {
    memset(c, 0, sizeof *c);
    c->rms_norm_eps = 1e-5f;
    c->rope.kind = FL_ROPE_DEFAULT;
    c->rope.partial_rotary_factor = 1;
    c->bos_token_id = -1;
    c->decoder_sparse_step = 1;
    const struct preset *p = NULL;
    for (int i = 0; i < N_PRESETS; i++)
        if (!strcmp(name, presets[i].name)) p = &presets[i];
    if (!p) {
        char known[512] = "";
        for (int i = 0; i < N_PRESETS; i++) {
            size_t len = strlen(known);
            snprintf(known + len, sizeof known - len, "%s%s", i ? ", " : "", presets[i].name);
        }
        return FL_ERR(FL_ERR_INVALID_ARG, "unknown preset '%s' (known: %s)", name, known);
    }
    p->fill(c);
    if (!c->head_dim) c->head_dim = c->hidden_size / c->n_heads;
    c->max_position_embeddings = 8192;
    return FL_OK;
}

typedef struct rng { uint64_t s; } rng;
static inline uint64_t next(rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline float unif(rng *r) { return (float)((next(r) >> 40) * (1.0 / 16777216.0)) * 2 - 1; }

typedef struct fill_job {
    fl_tensor *h; /* W4 or FP8 rows, or */
    uint16_t *w;  /* bf16 rows [out, in] */
    int64_t in;
    float a;
    uint64_t base;
} fill_job;

/* Rows [lo, hi) of random W4 codes and group scales (a pool task). */
static void fill_w4_rows(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const fill_job *j = ctx;
    const int64_t in = j->in;
    const float a = j->a;
    for (int64_t row = lo; row < hi; row++) {
        rng rr = {j->base ^ (0x9e3779b97f4a7c15ull * (uint64_t)(row + 1))};
        uint8_t *codes = (uint8_t *)j->h->data + row * (in / 2);
        for (int64_t i = 0; i < in / 2; i += 8) {
            uint64_t v = next(&rr);
            memcpy(codes + i, &v, 8);
        }
        for (int64_t g = 0; g < in / 128; g++) {
            j->h->scales[row * (in / 128) + g] = 2 * a / 15 * (0.9f + 0.1f * unif(&rr));
            j->h->bias[row * (in / 128) + g] = -a;
        }
    }
}

/* Rows [lo, hi) of random FP8 rows: uniform in [-a, a], scale a / 448 (a
 * pool task). */
static void fill_fp8_rows(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const fill_job *j = ctx;
    for (int64_t row = lo; row < hi; row++) {
        rng rr = {j->base ^ (0x9e3779b97f4a7c15ull * (uint64_t)(row + 1))};
        uint8_t *q = (uint8_t *)j->h->data + row * j->in;
        for (int64_t i = 0; i < j->in; i++) q[i] = fl_f32_to_f8e4m3(448.0f * unif(&rr));
        j->h->scales[row] = j->a / 448.0f;
    }
}

/* Rows [lo, hi) of random bf16 values (a pool task). */
static void fill_bf16_rows(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const fill_job *j = ctx;
    for (int64_t row = lo; row < hi; row++) {
        rng rr = {j->base ^ (0x9e3779b97f4a7c15ull * (uint64_t)(row + 1))};
        for (int64_t i = 0; i < j->in; i++) j->w[row * j->in + i] = fl_f32_to_bf16(j->a * unif(&rr));
    }
}

/* A random [out, in] weight on the host, into *hp (owned). */
static fl_status random_linear_host(int64_t out, int64_t in, fl_load_quant q, rng *r, fl_tensor *hp) {
    fl_tensor h;
    memset(&h, 0, sizeof h);
    const float a = 1.0f / sqrtf((float)in);
    /* Rows are filled in parallel, each from its own stream (seeded by the
     * tensor's stream and the row), so a multi-GB model builds in seconds
     * and the values do not depend on the thread count. */
    const uint64_t base = next(r);
    if ((q == FL_LOAD_W4 && in % 128 == 0) || q == FL_LOAD_FP8) {
        if (q == FL_LOAD_W4) {
            FL_TRY(fl_quant_w4_alloc(out, in, 128, &h));
        } else {
            h = (fl_tensor){.dtype = FL_DTYPE_F8_E4M3, .ndim = 2, .shape = {out, in}, .owned = 1};
            h.data = malloc((size_t)(out * in) + 1);
            h.scales = malloc((size_t)out * sizeof(float) + 4);
            if (!h.data || !h.scales) {
                fl_tensor_free(&h);
                return FL_ERR(FL_ERR_OOM, "out of memory for a [%lld, %lld] weight", (long long)out, (long long)in);
            }
        }
        fill_job j = {.h = &h, .in = in, .a = a, .base = base};
        fl_status st = fl_pool_for(out, 0, q == FL_LOAD_W4 ? fill_w4_rows : fill_fp8_rows, &j);
        if (st != FL_OK) {
            fl_tensor_free(&h);
            return st;
        }
    } else {
        uint16_t *w = malloc((size_t)(out * in) * 2);
        if (!w) return FL_ERR(FL_ERR_OOM, "out of memory for a [%lld, %lld] weight", (long long)out,
                              (long long)in);
        fill_job j = {.w = w, .in = in, .a = a, .base = base};
        fl_status st = fl_pool_for(out, 0, fill_bf16_rows, &j);
        if (st != FL_OK) {
            free(w);
            return st;
        }
        h.dtype = FL_DTYPE_BF16;
        h.ndim = 2;
        h.shape[0] = out;
        h.shape[1] = in;
        h.data = w;
        h.owned = 1;
    }
    *hp = h;
    return FL_OK;
}

static fl_status random_linear(fl_model *m, int64_t out, int64_t in, fl_load_quant q, rng *r,
                               fl_tensor *dev) {
    fl_tensor h;
    FL_TRY(random_linear_host(out, in, q, r, &h));
    return fl_model_keep_weight(m, &h, dev);
}

/* Weights stacked as the checkpoint loader stacks them (model_fuse.c), so
 * a synthetic model runs the same matmuls as a real one. */
static fl_status random_fused(fl_model *m, int n, const int64_t *outs, int64_t in, fl_load_quant q, rng *r,
                              bool allow, fl_tensor *fused, fl_tensor *const *devs) {
    fl_tensor h[3];
    memset(h, 0, sizeof h);
    for (int i = 0; i < n; i++) {
        fl_status st = random_linear_host(outs[i], in, q, r, &h[i]);
        if (st != FL_OK) {
            for (int j = 0; j < i; j++) fl_tensor_free(&h[j]);
            return st;
        }
    }
    return fl_model_keep_fused(m, h, n, allow, fused, devs);
}

static fl_status random_vec(fl_model *m, int64_t n, float center, float spread, rng *r, fl_tensor *dev) {
    fl_tensor h;
    memset(&h, 0, sizeof h);
    float *v = malloc((size_t)n * sizeof(float));
    if (!v) return FL_ERR(FL_ERR_OOM, "out of memory");
    for (int64_t i = 0; i < n; i++) v[i] = center + spread * unif(r);
    h.dtype = FL_DTYPE_F32;
    h.ndim = 1;
    h.shape[0] = n;
    h.data = v;
    h.owned = 1;
    return fl_model_keep_weight(m, &h, dev);
}

static fl_status random_mlp(fl_model *m, int64_t H, int64_t I, fl_load_quant q, rng *r,
                            fl_mlp_weights *w) {
    const int64_t outs[2] = {I, I};
    fl_tensor *const devs[2] = {&w->gate, &w->up};
    FL_TRY(random_fused(m, 2, outs, H, q, r, fl_model_fuse_wanted(true, q == FL_LOAD_W4 ? FL_DTYPE_W4 : q == FL_LOAD_FP8 ? FL_DTYPE_F8_E4M3 : FL_DTYPE_BF16, 2 * I),
                        &w->gate_up, devs));
    return random_linear(m, H, I, q, r, &w->down);
}

fl_status fl_synth_model(const fl_model_config *cfg, const fl_shard *shard, fl_backend *be,
                         fl_load_quant q, uint64_t seed, fl_model **out) {
    fl_status st = FL_OK;
    fl_model *m = calloc(1, sizeof *m);
    if (!m) return FL_ERR(FL_ERR_OOM, "out of memory");
    m->cfg = *cfg;
    m->be = be;
    m->quant = q; /* the memory plan counts the weights as built */
    fl_status fst = fl_model_fp8_supported(cfg, q);
    if (fst != FL_OK) {
        free(m);
        return fst;
    }
    m->mem_before_load = fl_model_mem_in_use(be);
    m->shard = shard ? *shard : (fl_shard){.tp_size = 1, .ep_size = 1, .ex_size = 1};
    const fl_model_config *c = &m->cfg;
    const fl_model_dims *d = &m->dims;
    rng r = {seed};
    FL_TRY_GOTO(fl_model_dims_init(c, &m->shard, &m->dims), st, fail);
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    FL_CHECK_ALLOC(m->layers, st, fail);
    /* local sizes: this rank's heads, KV heads, MLP columns, lm_head rows */
    const int64_t H = c->hidden_size, hd = c->head_dim, qd = (int64_t)d->n_heads * hd,
                  kvd = (int64_t)d->n_kv_heads * hd;
    FL_TRY_GOTO(random_linear(m, c->vocab_size, H, FL_LOAD_AS_STORED, &r, &m->embed), st, fail);
    FL_TRY_GOTO(random_vec(m, H, 1, 0.1f, &r, &m->final_norm), st, fail);
    FL_TRY_GOTO(random_linear(m, d->vocab, H, FL_LOAD_AS_STORED, &r, &m->lm_head), st, fail);
    for (int l = 0; l < c->n_layers; l++) {
        fl_layer_weights *w = &m->layers[l];
        FL_TRY_GOTO(random_vec(m, H, 1, 0.1f, &r, &w->attn_norm), st, fail);
        FL_TRY_GOTO(random_vec(m, H, 1, 0.1f, &r, &w->mlp_norm), st, fail);
        if (c->arch == FL_ARCH_DEEPSEEK_V2) {
            /* MLA as the loader lays it out (model.c load_mla): this rank's
             * heads of q_proj, kv_b_proj and o_proj; the latent projection
             * and its norm whole */
            const fl_mla_config *a = &c->mla;
            const int64_t qk = a->qk_nope_head_dim + a->qk_rope_head_dim, kvb = a->qk_nope_head_dim + a->v_head_dim,
                          hn = d->n_heads, rec = a->kv_lora_rank + a->qk_rope_head_dim;
            FL_TRY_GOTO(random_linear(m, hn * qk, H, q, &r, &w->wq), st, fail);
            FL_TRY_GOTO(random_linear(m, rec, H, q, &r, &w->wkv_a), st, fail);
            FL_TRY_GOTO(random_vec(m, a->kv_lora_rank, 1, 0.1f, &r, &w->kv_a_norm), st, fail);
            FL_TRY_GOTO(random_linear(m, hn * kvb, a->kv_lora_rank, q, &r, &w->wkv_b), st, fail);
            FL_TRY_GOTO(random_linear(m, H, hn * a->v_head_dim, q, &r, &w->wo), st, fail);
            goto mlp;
        }
        const int64_t outs[3] = {qd, kvd, kvd};
        fl_tensor *const wd[3] = {&w->wq, &w->wk, &w->wv};
        FL_TRY_GOTO(random_fused(m, 3, outs, H, q, &r, (!c->qk_norm || fl_model_qknorm_fused(m->be)) && fl_model_fuse_wanted(false, q == FL_LOAD_W4 ? FL_DTYPE_W4 : q == FL_LOAD_FP8 ? FL_DTYPE_F8_E4M3 : FL_DTYPE_BF16, 0), &w->wqkv, wd),
                    st, fail);
        FL_TRY_GOTO(random_linear(m, H, qd, q, &r, &w->wo), st, fail);
        if (c->attention_bias) {
            /* one vector: the biases are only read through the matmuls */
            if (w->wqkv.data) {
                FL_TRY_GOTO(random_vec(m, qd + 2 * kvd, 0, 0.1f, &r, &w->bqkv), st, fail);
            } else {
                FL_TRY_GOTO(random_vec(m, qd, 0, 0.1f, &r, &w->bq), st, fail);
                FL_TRY_GOTO(random_vec(m, kvd, 0, 0.1f, &r, &w->bk), st, fail);
                FL_TRY_GOTO(random_vec(m, kvd, 0, 0.1f, &r, &w->bv), st, fail);
            }
        }
        if (c->qk_norm) {
            FL_TRY_GOTO(random_vec(m, hd, 1, 0.1f, &r, &w->q_norm), st, fail);
            FL_TRY_GOTO(random_vec(m, hd, 1, 0.1f, &r, &w->k_norm), st, fail);
        }
    mlp:
        w->is_moe = fl_model_config_layer_is_moe(c, l);
        if (!w->is_moe) {
            FL_TRY_GOTO(random_mlp(m, H, d->inter, q, &r, &w->mlp), st, fail);
            continue;
        }
        FL_TRY_GOTO(random_linear(m, c->n_experts, H, FL_LOAD_AS_STORED, &r, &w->router), st, fail);
        w->experts = calloc((size_t)d->n_experts, sizeof *w->experts);
        FL_CHECK_ALLOC(w->experts, st, fail);
        for (int e = 0; e < d->n_experts; e++)
            FL_TRY_GOTO(random_mlp(m, H, d->moe_inter, q, &r, &w->experts[e]), st, fail);
        if (c->shared_expert_intermediate_size > 0) { /* DeepSeek's shared experts: no gate */
            w->has_shared = true;
            FL_TRY_GOTO(random_mlp(m, H, d->shared_inter, q, &r, &w->shared), st, fail);
        }
    }
    m->mem_after_load = fl_model_mem_in_use(be);
    *out = m;
    return FL_OK;
fail:
    fl_model_free(m);
    return st;
}

/* Bytes of one [out, in] linear as fl_synth_model builds it: W4 (codes,
 * half a byte a weight, plus a bf16 scale and a bf16 bias per group of 128,
 * as the GPU keeps them) where quantized and in divides into groups, FP8
 * (a byte a weight and an f32 scale a row), else bf16. Stacked (fused) weights are their parts' rows, so the same bytes. */
static double linear_bytes(int64_t out, int64_t in, fl_load_quant q) {
    if (q == FL_LOAD_FP8) return (double)out * (double)in + (double)out * 4; /* e4m3 codes, an f32 scale a row */
    if (q == FL_LOAD_W4 && in % 128 == 0) return (double)out * (double)(in / 2) + (double)out * (double)(in / 128) * 4;
    return (double)out * (double)in * 2;
}

/* gate, up [I, H] and down [H, I] */
static double mlp_bytes(int64_t H, int64_t I, fl_load_quant q) { return 2 * linear_bytes(I, H, q) + linear_bytes(H, I, q); }

fl_status fl_synth_step_weight_bytes(const fl_model_config *c, const fl_shard *shard, fl_load_quant q,
                                     double active_experts, double *bytes) {
    const fl_shard one = {.tp_size = 1, .ep_size = 1, .ex_size = 1};
    fl_model_dims d;
    FL_TRY(fl_model_dims_init(c, shard ? shard : &one, &d));
    const int64_t H = c->hidden_size, hd = c->head_dim, qd = (int64_t)d.n_heads * hd,
                  kvd = (int64_t)d.n_kv_heads * hd;
    /* lm_head (this rank's rows, bf16 as stored) and the final norm (f32);
     * the embedding is a lookup of a few rows and the layers' norms are
     * left out (under 0.01 % of any preset) */
    double b = linear_bytes(d.vocab, H, FL_LOAD_AS_STORED) + (double)H * 4;
    for (int l = 0; l < c->n_layers; l++) {
        if (c->arch == FL_ARCH_DEEPSEEK_V2) { /* MLA: q, the latent projection, kv_b and o */
            const fl_mla_config *a = &c->mla;
            const int64_t qk = a->qk_nope_head_dim + a->qk_rope_head_dim, kvb = a->qk_nope_head_dim + a->v_head_dim,
                          hn = d.n_heads, rec = a->kv_lora_rank + a->qk_rope_head_dim;
            b += linear_bytes(hn * qk, H, q) + linear_bytes(rec, H, q) + linear_bytes(hn * kvb, a->kv_lora_rank, q) +
                 linear_bytes(H, hn * a->v_head_dim, q);
        } else {
            b += linear_bytes(qd, H, q) + 2 * linear_bytes(kvd, H, q) + linear_bytes(H, qd, q);
        }
        if (!fl_model_config_layer_is_moe(c, l)) {
            b += mlp_bytes(H, d.inter, q);
            continue;
        }
        b += linear_bytes(c->n_experts, H, FL_LOAD_AS_STORED); /* the router, replicated */
        if (d.n_experts) b += active_experts * mlp_bytes(H, d.moe_inter, q);
        if (c->shared_expert_intermediate_size > 0) b += mlp_bytes(H, d.shared_inter, q);
    }
    *bytes = b;
    return FL_OK;
}
