/*
 * model.c — builds an fl_model from a checkpoint: resolves the Hugging Face
 * tensor names of each architecture, checks shapes, converts/quantizes
 * through the checkpoint loader and hands each weight to the backend.
 */
#include "runtime/model/model.h"

#include "runtime/load/quant.h"
#include "runtime/model/rope.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct loader {
    const fl_ckpt *ck;
    fl_model *m;
    fl_load_quant quant;
} loader;

/* Keeps a host tensor alive for the model's lifetime (the CPU backend
 * aliases it) and uploads it. */
static fl_status keep_and_upload(loader *ld, fl_tensor *host, fl_tensor *dev) {
    return fl_model_keep_weight(ld->m, host, dev);
}

fl_status fl_model_keep_weight(fl_model *m, fl_tensor *host, fl_tensor *dev) {
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
    if (host->dtype == FL_DTYPE_F8_E4M3 && host->scales) m->weight_bytes += (size_t)rows * 4;
    return FL_OK;
}

static fl_status check_div(const char *what, int n, int parts, const char *by) {
    if (parts < 1 || n % parts)
        return FL_ERR(FL_ERR_INVALID_ARG, "%d %s are not divisible by %s %d", n, what, by, parts);
    return FL_OK;
}

fl_status fl_model_dims_init(const fl_model_config *c, const fl_shard *sh_in, fl_model_dims *d) {
    fl_shard sh = *sh_in;
    if (sh.tp_size < 1) sh.tp_size = 1;
    if (sh.ep_size < 1) sh.ep_size = 1;
    if (sh.ex_size < 1) sh.ex_size = 1;
    const int tp = sh.tp_size, r = sh.tp_rank;
    memset(d, 0, sizeof *d);
    FL_TRY(check_div("attention heads", c->n_heads, tp, "tp"));
    d->n_heads = c->n_heads / tp;
    d->q_head_lo = r * d->n_heads;
    if (c->n_kv_heads % tp == 0) {
        d->n_kv_heads = c->n_kv_heads / tp;
        d->kv_head_lo = r * d->n_kv_heads;
    } else if (tp % c->n_kv_heads == 0) {
        /* more ranks than KV heads: each rank keeps the one its queries use */
        d->n_kv_heads = 1;
        d->kv_head_lo = d->q_head_lo / (c->n_heads / c->n_kv_heads);
    } else {
        return FL_ERR(FL_ERR_INVALID_ARG, "%d KV heads neither divide nor are divisible by tp %d",
                      c->n_kv_heads, tp);
    }
    FL_TRY(check_div("dense MLP columns (intermediate_size)", c->intermediate_size, tp, "tp"));
    d->inter = c->intermediate_size / tp;
    d->inter_lo = r * d->inter;
    if (c->shared_expert_intermediate_size) {
        FL_TRY(check_div("shared-expert columns", c->shared_expert_intermediate_size, tp, "tp"));
        d->shared_inter = c->shared_expert_intermediate_size / tp;
        d->shared_inter_lo = r * d->shared_inter;
    }
    if (c->n_experts) {
        FL_TRY(check_div("experts", c->n_experts, sh.ep_size, "ep"));
        d->n_experts = c->n_experts / sh.ep_size;
        d->expert_lo = sh.ep_rank * d->n_experts;
        int mi = c->arch == FL_ARCH_MIXTRAL ? c->intermediate_size : c->moe_intermediate_size;
        FL_TRY(check_div("expert columns", mi, sh.ex_size, "world / ep ="));
        d->moe_inter = mi / sh.ex_size;
        d->moe_inter_lo = sh.ex_rank * d->moe_inter;
    } else if (sh.ep_size > 1) {
        return FL_ERR(FL_ERR_INVALID_ARG, "ep %d given for a dense model", sh.ep_size);
    }
    /* lm_head rows: as even as possible (vocabularies are often prime-ish) */
    int base = c->vocab_size / tp, extra = c->vocab_size % tp;
    d->vocab = base + (r < extra);
    d->vocab_lo = r * base + (r < extra ? r : extra);
    return FL_OK;
}

/* --quantize fp8 is applied here, not by the checkpoint loader: a float
 * linear as loaded becomes an FP8 linear, rows scaled one by one by the
 * whole row's largest magnitude, so a rank's row block, a column block
 * (o_proj, down under tp: the full rows are read for their maxima) or a
 * stacked q|k|v gets the codes of the whole weight (the activations'
 * scales under tp are each rank's slice's: kernels/backend.h). Weights the
 * checkpoint already quantized (W4) stay as they are. */
static fl_status load_part(loader *ld, const char *prefix, int64_t out, int64_t in, const fl_ckpt_slice *sl,
                           bool quantize, fl_tensor *host) {
    memset(host, 0, sizeof *host);
    const bool fp8 = quantize && ld->quant == FL_LOAD_FP8;
    FL_TRY(fl_ckpt_load_linear_part(ld->ck, prefix, out, in, sl,
                                    quantize && !fp8 ? ld->quant : FL_LOAD_AS_STORED, host));
    if (!fp8 || !fl_quant_fp8_source(host->dtype)) return FL_OK;
    fl_status st = FL_OK;
    float *absmax = NULL;
    if (sl && (sl->col_lo != 0 || sl->n_cols != in)) {
        const fl_ckpt_slice rows = {sl->row_lo, sl->n_rows, 0, in};
        fl_tensor whole;
        memset(&whole, 0, sizeof whole);
        absmax = malloc((size_t)sl->n_rows * sizeof(float) + 4);
        if (!absmax) st = FL_ERR(FL_ERR_OOM, "out of memory quantizing %s", prefix);
        if (st == FL_OK) st = fl_ckpt_load_linear_part(ld->ck, prefix, out, in, &rows, FL_LOAD_AS_STORED, &whole);
        if (st == FL_OK) st = fl_quant_row_absmax(prefix, &whole, absmax);
        fl_tensor_free(&whole);
    }
    fl_tensor q;
    memset(&q, 0, sizeof q);
    if (st == FL_OK) st = fl_quant_to_fp8(prefix, host, absmax, &q);
    free(absmax);
    fl_tensor_free(host);
    *host = q;
    return st;
}

static fl_status load_linear_part(loader *ld, const char *prefix, int64_t out, int64_t in,
                                  bool quantize, const fl_ckpt_slice *sl, fl_tensor *dev) {
    fl_tensor host;
    FL_TRY(load_part(ld, prefix, out, in, sl, quantize, &host));
    return keep_and_upload(ld, &host, dev);
}

/* This rank's rows [lo, lo + n) of a [out, in] weight, on the host (for
 * fl_model_keep_fused). */
static fl_status load_rows_host(loader *ld, const char *prefix, int64_t out, int64_t in, int64_t lo,
                                int64_t n, fl_tensor *host) {
    fl_ckpt_slice sl = {lo, n, 0, in};
    return load_part(ld, prefix, out, in, &sl, true, host);
}

static fl_status load_linear(loader *ld, const char *prefix, int64_t out, int64_t in, bool quantize,
                             fl_tensor *dev) {
    return load_linear_part(ld, prefix, out, in, quantize, NULL, dev);
}

/* Column-parallel: this rank's rows [lo, lo + n) of a [out, in] weight. */
static fl_status load_rows(loader *ld, const char *prefix, int64_t out, int64_t in, int64_t lo,
                           int64_t n, fl_tensor *dev) {
    fl_ckpt_slice sl = {lo, n, 0, in};
    return load_linear_part(ld, prefix, out, in, true, &sl, dev);
}

/* Row-parallel: this rank's columns [lo, lo + n). */
static fl_status load_cols(loader *ld, const char *prefix, int64_t out, int64_t in, int64_t lo,
                           int64_t n, fl_tensor *dev) {
    fl_ckpt_slice sl = {0, out, lo, n};
    return load_linear_part(ld, prefix, out, in, true, &sl, dev);
}

/* A 1-D tensor, or its elements [lo, lo + n) (n < 0: all of it). */
static fl_status load_vec_part_host(loader *ld, const char *name, int64_t total, int64_t lo, int64_t n,
                                    fl_tensor *out) {
    fl_tensor host;
    memset(&host, 0, sizeof host);
    FL_TRY(fl_ckpt_load_tensor(ld->ck, name, 1, &total, &host));
    if (n >= 0 && !(lo == 0 && n == total)) {
        float *all = malloc((size_t)total * sizeof(float)), *part = malloc((size_t)n * sizeof(float) + 4);
        fl_tensor row = host;
        row.ndim = 2;
        row.shape[0] = 1;
        row.shape[1] = total;
        if (all && part) {
            fl_tensor_row_f32(&row, 0, all);
            memcpy(part, all + lo, (size_t)n * sizeof(float));
        }
        free(all);
        fl_tensor_free(&host);
        if (!part || !all) {
            free(part);
            return FL_ERR(FL_ERR_OOM, "out of memory slicing %s", name);
        }
        memset(&host, 0, sizeof host);
        host.dtype = FL_DTYPE_F32;
        host.ndim = 1;
        host.shape[0] = n;
        host.data = part;
        host.owned = 1;
    }
    *out = host;
    return FL_OK;
}

static fl_status load_vec_part(loader *ld, const char *name, int64_t total, int64_t lo, int64_t n,
                               fl_tensor *dev) {
    fl_tensor host;
    FL_TRY(load_vec_part_host(ld, name, total, lo, n, &host));
    return keep_and_upload(ld, &host, dev);
}

static fl_status load_vec(loader *ld, const char *name, int64_t n, fl_tensor *dev) {
    return load_vec_part(ld, name, n, 0, -1, dev);
}

/* SiLU-gated MLP with inner size `inter`, this rank's columns [lo, lo + n). */
static fl_status load_mlp(loader *ld, const char *gate, const char *up, const char *down,
                          int64_t hidden, int64_t inter, int64_t lo, int64_t n, fl_mlp_weights *w) {
    fl_tensor h[2];
    FL_TRY(load_rows_host(ld, gate, inter, hidden, lo, n, &h[0]));
    fl_status st = load_rows_host(ld, up, inter, hidden, lo, n, &h[1]);
    if (st != FL_OK) {
        fl_tensor_free(&h[0]);
        return st;
    }
    fl_tensor *const devs[2] = {&w->gate, &w->up};
    FL_TRY(fl_model_keep_fused(ld->m, h, 2, fl_model_fuse_wanted(true, h[0].dtype, 2 * h[0].shape[0]), &w->gate_up, devs));
    FL_TRY(load_cols(ld, down, hidden, inter, lo, n, &w->down));
    return FL_OK;
}

#define NAME(buf, ...) snprintf((buf), sizeof(buf), __VA_ARGS__)

void fl_model_router_name(const fl_model_config *c, int layer, char out[128]) {
    snprintf(out, 128, c->arch == FL_ARCH_MIXTRAL ? "model.layers.%d.block_sparse_moe.gate" : "model.layers.%d.mlp.gate",
             layer);
}

void fl_model_mlp_names(const fl_model_config *c, int layer, int expert, fl_mlp_names *o) {
    if (expert == FL_MLP_DENSE) {
        NAME(o->gate, "model.layers.%d.mlp.gate_proj", layer);
        NAME(o->up, "model.layers.%d.mlp.up_proj", layer);
        NAME(o->down, "model.layers.%d.mlp.down_proj", layer);
    } else if (expert == FL_MLP_SHARED) {
        const char *s = c->arch == FL_ARCH_DEEPSEEK_V2 ? "shared_experts" : "shared_expert";
        NAME(o->gate, "model.layers.%d.mlp.%s.gate_proj", layer, s);
        NAME(o->up, "model.layers.%d.mlp.%s.up_proj", layer, s);
        NAME(o->down, "model.layers.%d.mlp.%s.down_proj", layer, s);
    } else if (c->arch == FL_ARCH_MIXTRAL) {
        NAME(o->gate, "model.layers.%d.block_sparse_moe.experts.%d.w1", layer, expert);
        NAME(o->up, "model.layers.%d.block_sparse_moe.experts.%d.w3", layer, expert);
        NAME(o->down, "model.layers.%d.block_sparse_moe.experts.%d.w2", layer, expert);
    } else {
        NAME(o->gate, "model.layers.%d.mlp.experts.%d.gate_proj", layer, expert);
        NAME(o->up, "model.layers.%d.mlp.experts.%d.up_proj", layer, expert);
        NAME(o->down, "model.layers.%d.mlp.experts.%d.down_proj", layer, expert);
    }
}

/* DeepSeek-V2 multi-head latent attention. Under tensor parallelism the
 * query heads (q_proj / q_b_proj rows, kv_b_proj rows, o_proj columns) are
 * split; the low-rank down-projections, their norms and so the cached latent
 * are replicated on every rank. */
static fl_status load_mla(loader *ld, int l, fl_layer_weights *w) {
    const fl_model_config *c = &ld->m->cfg;
    const fl_mla_config *a = &c->mla;
    const fl_model_dims *d = &ld->m->dims;
    const int64_t hidden = c->hidden_size, qk = a->qk_nope_head_dim + a->qk_rope_head_dim,
                  kvb = a->qk_nope_head_dim + a->v_head_dim, H = c->n_heads, h_lo = d->q_head_lo,
                  h_n = d->n_heads, rec = a->kv_lora_rank + a->qk_rope_head_dim;
    char n1[256];
    if (a->q_lora_rank > 0) {
        NAME(n1, "model.layers.%d.self_attn.q_a_proj", l);
        FL_TRY(load_linear(ld, n1, a->q_lora_rank, hidden, true, &w->wq_a));
        if (c->attention_bias) {
            NAME(n1, "model.layers.%d.self_attn.q_a_proj.bias", l);
            FL_TRY(load_vec(ld, n1, a->q_lora_rank, &w->bq_a));
        }
        NAME(n1, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
        FL_TRY(load_vec(ld, n1, a->q_lora_rank, &w->q_a_norm));
        NAME(n1, "model.layers.%d.self_attn.q_b_proj", l);
        FL_TRY(load_rows(ld, n1, H * qk, a->q_lora_rank, h_lo * qk, h_n * qk, &w->wq_b));
    } else {
        NAME(n1, "model.layers.%d.self_attn.q_proj", l);
        FL_TRY(load_rows(ld, n1, H * qk, hidden, h_lo * qk, h_n * qk, &w->wq));
    }
    NAME(n1, "model.layers.%d.self_attn.kv_a_proj_with_mqa", l);
    FL_TRY(load_linear(ld, n1, rec, hidden, true, &w->wkv_a));
    if (c->attention_bias) {
        NAME(n1, "model.layers.%d.self_attn.kv_a_proj_with_mqa.bias", l);
        FL_TRY(load_vec(ld, n1, rec, &w->bkv_a));
    }
    NAME(n1, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
    FL_TRY(load_vec(ld, n1, a->kv_lora_rank, &w->kv_a_norm));
    NAME(n1, "model.layers.%d.self_attn.kv_b_proj", l);
    FL_TRY(load_rows(ld, n1, H * kvb, a->kv_lora_rank, h_lo * kvb, h_n * kvb, &w->wkv_b));
    NAME(n1, "model.layers.%d.self_attn.o_proj", l);
    FL_TRY(load_cols(ld, n1, hidden, H * a->v_head_dim, h_lo * a->v_head_dim, h_n * a->v_head_dim, &w->wo));
    NAME(n1, "model.layers.%d.self_attn.o_proj.bias", l);
    if (fl_ckpt_has(ld->ck, n1) && ld->m->shard.tp_rank == 0) FL_TRY(load_vec(ld, n1, hidden, &w->bo));
    return FL_OK;
}

static fl_status load_layer(loader *ld, int l, fl_layer_weights *w) {
    const fl_model_config *c = &ld->m->cfg;
    const fl_model_dims *d = &ld->m->dims;
    const int64_t hidden = c->hidden_size, hd = c->head_dim, qd = (int64_t)c->n_heads * hd,
                  kvd = (int64_t)c->n_kv_heads * hd;
    const int64_t q_lo = d->q_head_lo * hd, q_n = d->n_heads * hd;
    const int64_t kv_lo = d->kv_head_lo * hd, kv_n = d->n_kv_heads * hd;
    char n1[256];
    NAME(n1, "model.layers.%d.input_layernorm.weight", l);
    FL_TRY(load_vec(ld, n1, hidden, &w->attn_norm));
    NAME(n1, "model.layers.%d.post_attention_layernorm.weight", l);
    FL_TRY(load_vec(ld, n1, hidden, &w->mlp_norm));
    if (c->arch == FL_ARCH_DEEPSEEK_V2) {
        FL_TRY(load_mla(ld, l, w));
    } else {
    /* q, k, v (and their biases) stacked into one matmul where they allow */
    {
        static const char *proj[3] = {"q_proj", "k_proj", "v_proj"};
        const int64_t tot[3] = {qd, kvd, kvd}, lo[3] = {q_lo, kv_lo, kv_lo}, cnt[3] = {q_n, kv_n, kv_n};
        fl_tensor h[3];
        memset(h, 0, sizeof h);
        fl_status st = FL_OK;
        for (int i = 0; i < 3 && st == FL_OK; i++) {
            NAME(n1, "model.layers.%d.self_attn.%s", l, proj[i]);
            st = load_rows_host(ld, n1, tot[i], hidden, lo[i], cnt[i], &h[i]);
        }
        if (st != FL_OK) {
            for (int i = 0; i < 3; i++) fl_tensor_free(&h[i]);
            return st;
        }
        fl_tensor *const wd[3] = {&w->wq, &w->wk, &w->wv}, *const bd[3] = {&w->bq, &w->bk, &w->bv};
        FL_TRY(fl_model_keep_fused(ld->m, h, 3, (!c->qk_norm || fl_model_qknorm_fused(ld->m->be)) && fl_model_fuse_wanted(false, h[0].dtype, 0), &w->wqkv, wd));
        if (c->attention_bias) {
            for (int i = 0; i < 3 && st == FL_OK; i++) {
                NAME(n1, "model.layers.%d.self_attn.%s.bias", l, proj[i]);
                st = load_vec_part_host(ld, n1, tot[i], lo[i], cnt[i], &h[i]);
            }
            if (st != FL_OK) {
                for (int i = 0; i < 3; i++) fl_tensor_free(&h[i]);
                return st;
            }
            /* the biases go with the weights: stacked exactly when they are */
            FL_TRY(fl_model_keep_fused(ld->m, h, 3, w->wqkv.data != NULL, &w->bqkv, bd));
        }
    }
    NAME(n1, "model.layers.%d.self_attn.o_proj", l);
    FL_TRY(load_cols(ld, n1, hidden, qd, q_lo, q_n, &w->wo));
    /* A row-parallel layer's bias is added once, by the first TP rank, before the reduction. */
    NAME(n1, "model.layers.%d.self_attn.o_proj.bias", l);
    if (fl_ckpt_has(ld->ck, n1) && ld->m->shard.tp_rank == 0) FL_TRY(load_vec(ld, n1, hidden, &w->bo));
    if (c->qk_norm) {
        NAME(n1, "model.layers.%d.self_attn.q_norm.weight", l);
        FL_TRY(load_vec(ld, n1, c->head_dim, &w->q_norm));
        NAME(n1, "model.layers.%d.self_attn.k_norm.weight", l);
        FL_TRY(load_vec(ld, n1, c->head_dim, &w->k_norm));
    }
    } /* not MLA */
    w->is_moe = fl_model_config_layer_is_moe(c, l);
    if (!w->is_moe) {
        fl_mlp_names mn;
        fl_model_mlp_names(c, l, FL_MLP_DENSE, &mn);
        return load_mlp(ld, mn.gate, mn.up, mn.down, hidden, c->intermediate_size, d->inter_lo, d->inter, &w->mlp);
    }
    const int64_t inter = c->arch == FL_ARCH_MIXTRAL ? c->intermediate_size : c->moe_intermediate_size;
    w->experts = calloc((size_t)d->n_experts, sizeof *w->experts);
    if (!w->experts) return FL_ERR(FL_ERR_OOM, "out of memory loading experts");
    /* Router logits decide which experts run: kept in float, never quantized. */
    fl_model_router_name(c, l, n1);
    FL_TRY(load_linear(ld, n1, c->n_experts, hidden, false, &w->router));
    fl_mlp_names mn;
    for (int le = 0; le < d->n_experts; le++) {
        fl_model_mlp_names(c, l, d->expert_lo + le, &mn);
        FL_TRY(load_mlp(ld, mn.gate, mn.up, mn.down, hidden, inter, d->moe_inter_lo, d->moe_inter,
                        &w->experts[le]));
    }
    if (c->shared_expert_intermediate_size > 0) {
        /* DeepSeek: n_shared_experts fused into one MLP, no gate; Qwen2-MoE: one, gated */
        w->has_shared = true;
        fl_model_mlp_names(c, l, FL_MLP_SHARED, &mn);
        FL_TRY(load_mlp(ld, mn.gate, mn.up, mn.down, hidden, c->shared_expert_intermediate_size,
                        d->shared_inter_lo, d->shared_inter, &w->shared));
    }
    if (c->shared_expert_intermediate_size > 0 && c->arch != FL_ARCH_DEEPSEEK_V2) {
        NAME(n1, "model.layers.%d.mlp.shared_expert_gate", l);
        FL_TRY(load_linear(ld, n1, 1, hidden, false, &w->shared_gate));
    }
    return FL_OK;
}

fl_status fl_model_fp8_supported(const fl_model_config *c, fl_load_quant q) {
    if (q != FL_LOAD_FP8) return FL_OK;
    bool moe = false;
    for (int l = 0; l < c->n_layers; l++) moe = moe || fl_model_config_layer_is_moe(c, l);
    if (moe || c->arch == FL_ARCH_DEEPSEEK_V2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "--quantize fp8 covers dense models (attention and MLP linears); %s "
                      "has %s, which have no FP8 path yet (use --quantize w4 or none)", fl_arch_name(c->arch),
                      c->arch == FL_ARCH_DEEPSEEK_V2 ? "MLA projections" : "MoE experts");
    return FL_OK;
}

fl_status fl_model_load(const fl_ckpt *ck, fl_backend *be, const fl_model_load_opts *opts,
                        fl_model **out) {
    fl_status st = FL_OK;
    *out = NULL;
    fl_model *m = calloc(1, sizeof *m);
    if (!m) return FL_ERR(FL_ERR_OOM, "out of memory");
    m->be = be;
    m->mem_before_load = fl_model_mem_in_use(be);
    loader ld = {.ck = ck, .m = m, .quant = opts ? opts->quant : FL_LOAD_AS_STORED};
    m->ck = ck;
    m->quant = ld.quant;
    FL_TRY_GOTO(fl_ckpt_model_config(ck, &m->cfg), st, fail);
    const fl_model_config *c = &m->cfg;
    if (opts) m->shard = opts->shard;
    if (m->shard.tp_size < 1) m->shard.tp_size = 1;
    if (m->shard.ep_size < 1) m->shard.ep_size = 1;
    if (m->shard.ex_size < 1) m->shard.ex_size = 1;
    FL_TRY_GOTO(fl_model_dims_init(c, &m->shard, &m->dims), st, fail);
    FL_TRY_GOTO(fl_model_fp8_supported(c, ld.quant), st, fail);
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
    {
        /* vocab-parallel lm_head: this rank's rows */
        fl_ckpt_slice sl = {m->dims.vocab_lo, m->dims.vocab, 0, c->hidden_size};
        FL_TRY_GOTO(load_linear_part(&ld, head, c->vocab_size, c->hidden_size, false, &sl, &m->lm_head),
                    st, fail);
    }
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
    m->mem_after_load = fl_model_mem_in_use(be);
    *out = m;
    return FL_OK;
fail:
    fl_model_free(m);
    return st;
}

size_t fl_model_mem_in_use(fl_backend *be) {
    if (be && be->ops->mem_info) {
        size_t free_b = 0, total = 0;
        if (be->ops->mem_info(be, &free_b, &total) != FL_OK) return 0;
        return total - free_b;
    }
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long long size = 0, res = 0;
    int n = fscanf(f, "%llu %llu", &size, &res);
    fclose(f);
    return n == 2 ? (size_t)res * (size_t)sysconf(_SC_PAGESIZE) : 0;
}

static void free_mlp(fl_backend *be, fl_mlp_weights *w) {
    be->ops->free_weight(be, &w->gate);
    be->ops->free_weight(be, &w->up);
    be->ops->free_weight(be, &w->gate_up);
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
                               &w->shared_gate, &w->wq_a, &w->q_a_norm, &w->wq_b, &w->bq_a,
                               &w->wkv_a, &w->bkv_a, &w->kv_a_norm, &w->wkv_b, &w->wqkv, &w->bqkv};
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) be->ops->free_weight(be, ts[i]);
            free_mlp(be, &w->mlp);
            free_mlp(be, &w->shared);
            if (w->experts)
                for (int e = 0; e < m->dims.n_experts; e++) free_mlp(be, &w->experts[e]);
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
