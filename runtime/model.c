/*
 * model.c — builds an fl_model from a checkpoint: resolves the Hugging Face
 * tensor names of each architecture, checks shapes, converts/quantizes
 * through the checkpoint loader and hands each weight to the backend.
 */
#include "runtime/model.h"

#include "runtime/rope.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct loader {
    const fl_ckpt *ck;
    fl_model *m;
    fl_load_quant quant;
} loader;

/* Keeps a host tensor alive for the model's lifetime (the CPU backend
 * aliases it) and uploads it. */
static fl_status keep_and_upload(loader *ld, fl_tensor *host, fl_tensor *dev) {
    fl_model *m = ld->m;
    if (m->n_host_owned == m->cap_host_owned) {
        size_t cap = m->cap_host_owned ? 2 * m->cap_host_owned : 64;
        fl_tensor *p = realloc(m->host_owned, cap * sizeof *p);
        if (!p) {
            fl_tensor_free(host);
            return FL_ERR(FL_ERR_OOM, "out of memory loading weights");
        }
        m->host_owned = p;
        m->cap_host_owned = cap;
    }
    m->host_owned[m->n_host_owned++] = *host;
    FL_TRY(m->be->ops->upload_weight(m->be, host, dev));
    int64_t rows = host->ndim == 2 ? host->shape[0] : 1;
    int64_t cols = host->shape[host->ndim - 1];
    m->weight_bytes += (size_t)rows * fl_dtype_row_bytes(host->dtype, cols);
    if (host->dtype == FL_DTYPE_W4) m->weight_bytes += (size_t)(rows * (cols / host->group)) * 8;
    return FL_OK;
}

static fl_status load_linear(loader *ld, const char *prefix, int64_t out, int64_t in, bool quantize,
                             fl_tensor *dev) {
    fl_tensor host;
    memset(&host, 0, sizeof host);
    FL_TRY(fl_ckpt_load_linear(ld->ck, prefix, out, in, quantize ? ld->quant : FL_LOAD_AS_STORED,
                               &host));
    return keep_and_upload(ld, &host, dev);
}

static fl_status load_vec(loader *ld, const char *name, int64_t n, fl_tensor *dev) {
    fl_tensor host;
    memset(&host, 0, sizeof host);
    FL_TRY(fl_ckpt_load_tensor(ld->ck, name, 1, &n, &host));
    return keep_and_upload(ld, &host, dev);
}

static fl_status load_mlp(loader *ld, const char *gate, const char *up, const char *down,
                          int64_t hidden, int64_t inter, fl_mlp_weights *w) {
    FL_TRY(load_linear(ld, gate, inter, hidden, true, &w->gate));
    FL_TRY(load_linear(ld, up, inter, hidden, true, &w->up));
    FL_TRY(load_linear(ld, down, hidden, inter, true, &w->down));
    return FL_OK;
}

#define NAME(buf, ...) snprintf((buf), sizeof(buf), __VA_ARGS__)

static fl_status load_layer(loader *ld, int l, fl_layer_weights *w) {
    const fl_model_config *c = &ld->m->cfg;
    const int64_t hidden = c->hidden_size, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim;
    char n1[256], n2[256], n3[256];
    NAME(n1, "model.layers.%d.input_layernorm.weight", l);
    FL_TRY(load_vec(ld, n1, hidden, &w->attn_norm));
    NAME(n1, "model.layers.%d.post_attention_layernorm.weight", l);
    FL_TRY(load_vec(ld, n1, hidden, &w->mlp_norm));
    NAME(n1, "model.layers.%d.self_attn.q_proj", l);
    FL_TRY(load_linear(ld, n1, qd, hidden, true, &w->wq));
    NAME(n1, "model.layers.%d.self_attn.k_proj", l);
    FL_TRY(load_linear(ld, n1, kvd, hidden, true, &w->wk));
    NAME(n1, "model.layers.%d.self_attn.v_proj", l);
    FL_TRY(load_linear(ld, n1, kvd, hidden, true, &w->wv));
    NAME(n1, "model.layers.%d.self_attn.o_proj", l);
    FL_TRY(load_linear(ld, n1, hidden, qd, true, &w->wo));
    if (c->attention_bias) {
        NAME(n1, "model.layers.%d.self_attn.q_proj.bias", l);
        FL_TRY(load_vec(ld, n1, qd, &w->bq));
        NAME(n1, "model.layers.%d.self_attn.k_proj.bias", l);
        FL_TRY(load_vec(ld, n1, kvd, &w->bk));
        NAME(n1, "model.layers.%d.self_attn.v_proj.bias", l);
        FL_TRY(load_vec(ld, n1, kvd, &w->bv));
    }
    NAME(n1, "model.layers.%d.self_attn.o_proj.bias", l);
    if (fl_ckpt_has(ld->ck, n1)) FL_TRY(load_vec(ld, n1, hidden, &w->bo));
    if (c->qk_norm) {
        NAME(n1, "model.layers.%d.self_attn.q_norm.weight", l);
        FL_TRY(load_vec(ld, n1, c->head_dim, &w->q_norm));
        NAME(n1, "model.layers.%d.self_attn.k_norm.weight", l);
        FL_TRY(load_vec(ld, n1, c->head_dim, &w->k_norm));
    }
    w->is_moe = fl_model_config_layer_is_moe(c, l);
    if (!w->is_moe) {
        NAME(n1, "model.layers.%d.mlp.gate_proj", l);
        NAME(n2, "model.layers.%d.mlp.up_proj", l);
        NAME(n3, "model.layers.%d.mlp.down_proj", l);
        return load_mlp(ld, n1, n2, n3, hidden, c->intermediate_size, &w->mlp);
    }
    const bool mixtral = c->arch == FL_ARCH_MIXTRAL;
    const int64_t inter = mixtral ? c->intermediate_size : c->moe_intermediate_size;
    w->experts = calloc((size_t)c->n_experts, sizeof *w->experts);
    if (!w->experts) return FL_ERR(FL_ERR_OOM, "out of memory loading experts");
    /* Router logits decide which experts run: kept in float, never quantized. */
    NAME(n1, mixtral ? "model.layers.%d.block_sparse_moe.gate" : "model.layers.%d.mlp.gate", l);
    FL_TRY(load_linear(ld, n1, c->n_experts, hidden, false, &w->router));
    for (int e = 0; e < c->n_experts; e++) {
        if (mixtral) {
            NAME(n1, "model.layers.%d.block_sparse_moe.experts.%d.w1", l, e);
            NAME(n2, "model.layers.%d.block_sparse_moe.experts.%d.w3", l, e);
            NAME(n3, "model.layers.%d.block_sparse_moe.experts.%d.w2", l, e);
        } else {
            NAME(n1, "model.layers.%d.mlp.experts.%d.gate_proj", l, e);
            NAME(n2, "model.layers.%d.mlp.experts.%d.up_proj", l, e);
            NAME(n3, "model.layers.%d.mlp.experts.%d.down_proj", l, e);
        }
        FL_TRY(load_mlp(ld, n1, n2, n3, hidden, inter, &w->experts[e]));
    }
    if (c->shared_expert_intermediate_size > 0) {
        w->has_shared = true;
        NAME(n1, "model.layers.%d.mlp.shared_expert.gate_proj", l);
        NAME(n2, "model.layers.%d.mlp.shared_expert.up_proj", l);
        NAME(n3, "model.layers.%d.mlp.shared_expert.down_proj", l);
        FL_TRY(load_mlp(ld, n1, n2, n3, hidden, c->shared_expert_intermediate_size, &w->shared));
        NAME(n1, "model.layers.%d.mlp.shared_expert_gate", l);
        FL_TRY(load_linear(ld, n1, 1, hidden, false, &w->shared_gate));
    }
    return FL_OK;
}

fl_status fl_model_load(const fl_ckpt *ck, fl_backend *be, const fl_model_load_opts *opts,
                        fl_model **out) {
    fl_status st = FL_OK;
    *out = NULL;
    fl_model *m = calloc(1, sizeof *m);
    if (!m) return FL_ERR(FL_ERR_OOM, "out of memory");
    m->be = be;
    loader ld = {.ck = ck, .m = m, .quant = opts ? opts->quant : FL_LOAD_AS_STORED};
    FL_TRY_GOTO(fl_ckpt_model_config(ck, &m->cfg), st, fail);
    const fl_model_config *c = &m->cfg;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    FL_CHECK_ALLOC(m->layers, st, fail);

    const int64_t emb_shape[2] = {c->vocab_size, c->hidden_size};
    fl_tensor host;
    memset(&host, 0, sizeof host);
    FL_TRY_GOTO(fl_ckpt_load_tensor(ck, "model.embed_tokens.weight", 2, emb_shape, &host), st, fail);
    FL_TRY_GOTO(keep_and_upload(&ld, &host, &m->embed), st, fail);
    FL_TRY_GOTO(load_vec(&ld, "model.norm.weight", c->hidden_size, &m->final_norm), st, fail);
    /* Tied models reuse the embedding matrix; GGUF files may still store it
     * quantized, which load_linear turns into W4 for the matmul. */
    const char *head = (c->tie_word_embeddings || !fl_ckpt_has(ck, "lm_head.weight"))
                           ? "model.embed_tokens" : "lm_head";
    FL_TRY_GOTO(load_linear(&ld, head, c->vocab_size, c->hidden_size, false, &m->lm_head), st, fail);
    for (int l = 0; l < c->n_layers; l++) FL_TRY_GOTO(load_layer(&ld, l, &m->layers[l]), st, fail);
    if (fl_ckpt_has(ck, "rope_freqs.weight")) {
        /* llama.cpp stores Llama-3 RoPE scaling as per-frequency divisors */
        int64_t half = fl_rope_dim(c) / 2;
        fl_tensor rf;
        memset(&rf, 0, sizeof rf);
        FL_TRY_GOTO(fl_ckpt_load_tensor(ck, "rope_freqs.weight", 1, &half, &rf), st, fail);
        m->rope_freq_factors = malloc((size_t)half * sizeof(float));
        if (m->rope_freq_factors) fl_tensor_row_f32(&rf, 0, m->rope_freq_factors);
        fl_tensor_free(&rf);
        FL_CHECK_ALLOC(m->rope_freq_factors, st, fail);
    }
    *out = m;
    return FL_OK;
fail:
    fl_model_free(m);
    return st;
}

static void free_mlp(fl_backend *be, fl_mlp_weights *w) {
    be->ops->free_weight(be, &w->gate);
    be->ops->free_weight(be, &w->up);
    be->ops->free_weight(be, &w->down);
}

void fl_model_free(fl_model *m) {
    if (!m) return;
    fl_backend *be = m->be;
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            fl_layer_weights *w = &m->layers[l];
            fl_tensor *ts[] = {&w->attn_norm, &w->wq, &w->wk, &w->wv, &w->wo, &w->bq, &w->bk,
                               &w->bv, &w->bo, &w->q_norm, &w->k_norm, &w->mlp_norm, &w->router,
                               &w->shared_gate};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) be->ops->free_weight(be, ts[i]);
            free_mlp(be, &w->mlp);
            free_mlp(be, &w->shared);
            if (w->experts)
                for (int e = 0; e < m->cfg.n_experts; e++) free_mlp(be, &w->experts[e]);
            free(w->experts);
        }
        free(m->layers);
    }
    be->ops->free_weight(be, &m->embed);
    be->ops->free_weight(be, &m->final_norm);
    be->ops->free_weight(be, &m->lm_head);
    for (size_t i = 0; i < m->n_host_owned; i++) fl_tensor_free(&m->host_owned[i]);
    free(m->rope_freq_factors);
    free(m->host_owned);
    free(m);
}

int64_t fl_model_n_params(const fl_model *m) {
    int64_t n = 0;
    for (size_t i = 0; i < m->n_host_owned; i++) n += fl_tensor_numel(&m->host_owned[i]);
    return n;
}
