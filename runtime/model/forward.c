/*
 * forward.c — the decoder forward pass, written once against the backend op
 * table (kernels/backend.h).
 *
 * Per layer: RMSNorm -> q/k/v projections (+bias) -> per-head q/k norm ->
 * RoPE -> K/V into the paged cache -> paged attention -> o_proj -> residual
 * add -> RMSNorm -> dense SiLU-gated MLP or MoE -> residual add. Then the
 * final norm and lm_head run only on the rows whose logits are wanted. A
 * layer's attention and dense MLP are kernels/layer.c's plain ops, or, at
 * decode steps, the backend's decode_layer, which owns whatever it fuses
 * (kernels/backend.h).
 * The layers run from fl_forward_body, which reads every per-step table
 * through a fl_step_dev of device pointers: fl_forward_run fills them from
 * the plan, and forward_graph.c points them at fixed buffers so a decode
 * step can be captured once per batch bucket and replayed as a CUDA graph.
 * DeepSeek-V2 replaces the attention block with MLA (mla_block: the cache
 * holds the compressed latent, see docs/engine.md). The MoE block and expert
 * routing live in forward_moe.c.
 */
#include "runtime/model/forward_impl.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "runtime/model/forward_graph.h"
#include "runtime/model/forward_skip.h"
#include "runtime/model/rope.h"


/* Sums a [n] activation buffer across the group (row-parallel layers).
 * MPI is synchronous. NCCL on the backend's stream (the default, see
 * fl_cli_backend_open) is simply enqueued behind the matmul that produced
 * buf; NCCL on its own stream needs the backend's stream drained first and
 * the reduction awaited, so the next op sees the sum. */
fl_status fl_forward_reduce(fl_forward *f, void *buf, size_t n) {
    if (!f->comm) return FL_OK;
    if (fl_comm_backend_of(f->comm) == FL_COMM_BACKEND_MPI || f->comm_inline)
        return fl_comm_all_reduce_sum(f->comm, buf, buf, n, f->comm_dt);
    FL_TRY(f->m->be->ops->sync(f->m->be));
    FL_TRY(fl_comm_all_reduce_sum(f->comm, buf, buf, n, f->comm_dt));
    return fl_comm_sync(f->comm);
}

/* Dense SiLU-gated MLP: out[n, hidden] = down(silu(gate(x)) * up(x)), the
 * plain ops (kernels/layer.c). */
fl_status fl_forward_mlp(fl_forward *f, const fl_mlp_weights *w, const void *x, int n, void *out) {
    fl_backend *be = f->m->be;
    const fl_layer_desc L = {.gate_up = w->gate_up.data ? &w->gate_up : NULL, .gate = &w->gate, .up = &w->up};
    const fl_layer_step s = {.n = n, .gate = f->gate, .up = f->up, .act = f->act};
    if (!(f->skip & FL_SKIP_GATE_UP)) FL_TRY(fl_layer_gate_up(be, &L, &s, x));
    if (f->skip & FL_SKIP_DOWN) return FL_OK;
    return be->ops->matmul(be, f->act, n, &w->down, NULL, out);
}

/* Buffers for features a model lacks still get one element, so every
 * pointer is valid and freeing stays uniform. */
static size_t nonzero(size_t n) { return n ? n : 4; }

static size_t plan_words_max(const fl_forward_limits *l) {
    return FL_PLAN_HEADER + 3 * (size_t)l->max_tokens + 2 * (size_t)l->max_seqs + 1 +
           (size_t)l->max_seqs * l->max_blocks + (size_t)l->max_logits + (size_t)l->max_seqs;
}

void fl_forward_config_default(fl_forward_config *c) {
    *c = (fl_forward_config){
        .cuda_graphs = fl_opt_default_bool(FL_OPT_CUDA_GRAPHS),
        .graph_ctx_buckets = fl_opt_default_bool(FL_OPT_GRAPH_CTX_BUCKETS),
        .step_timing = fl_opt_default_bool(FL_OPT_STEP_TIMING),
        .moe_overlap = (int)fl_opt_default_int(FL_OPT_MOE_OVERLAP),
        .moe_micro_batches = (int)fl_opt_default_int(FL_OPT_MOE_MICRO_BATCHES),
    };
}

/* Keep in step with fl_forward_init below: the planner's prediction is
 * checked against measured memory (tests/test_mem_plan_rss.c). */
void fl_forward_mem_size(const fl_model_config *c, const fl_model_dims *d, fl_dtype act_dtype,
                         const fl_forward_limits *lim, bool layer_ws, int group, bool device_gather,
                         fl_forward_mem *out) {
    const size_t es = act_dtype == FL_DTYPE_F32 ? 4 : 2;
    const size_t T = (size_t)lim->max_tokens, H = (size_t)c->hidden_size;
    const bool mla = c->arch == FL_ARCH_DEEPSEEK_V2;
    const fl_mla_config *a = &c->mla;
    const size_t kvd = (size_t)d->n_kv_heads * c->head_dim, rot = (size_t)fl_rope_dim(c);
    size_t qd = (size_t)d->n_heads * c->head_dim;
    if (mla) {
        size_t qk = (size_t)d->n_heads * (a->qk_nope_head_dim + a->qk_rope_head_dim),
               vd = (size_t)d->n_heads * a->v_head_dim;
        qd = qk > vd ? qk : vd;
    }
    size_t inter = (size_t)d->inter;
    if ((size_t)d->moe_inter > inter) inter = (size_t)d->moe_inter;
    if ((size_t)d->shared_inter > inter) inter = (size_t)d->shared_inter;
    const size_t topk = c->n_experts ? (size_t)c->n_experts_per_tok : 0;
    size_t act = 0, raw = 0;
#define A(n) (act += es * nonzero(n))
#define R(n) (raw += nonzero(n))
    A(T * H);
    if (layer_ws) R(FL_DECODE_LAYER_WS_BYTES);
    A(T * H);
    A(T * (mla ? qd : qd + 2 * kvd));
    A(T * kvd);
    A(T * kvd);
    A(T * qd);
    A(T * H);
    A(T * 2 * inter);
    A(T * inter);
    A(T * inter);
    A((size_t)lim->max_logits * H);
    A(mla ? T * (size_t)(a->kv_lora_rank + a->qk_rope_head_dim) : 0);
    A(mla ? T * (size_t)a->q_lora_rank : 0);
    A(mla ? T * (size_t)a->kv_lora_rank : 0);
    size_t logits_dev = es * nonzero((size_t)lim->max_logits * d->vocab);
    if (group > 1 && device_gather) logits_dev += es * nonzero((size_t)lim->max_logits * c->vocab_size);
    size_t host = 0;
    if (c->n_experts) {
        A(T * c->n_experts);
        A(T * H);
        A(T * H);
        A(T * H);
        A(T);
        for (int i = 0; i < 4; i++) R(T * topk * 4);
        host += 4 * T * topk * 4 + ((size_t)c->n_experts + 1) * sizeof(int);
    }
    R(plan_words_max(lim) * 4);
    R(T * (rot / 2) * 4);
    R(T * (rot / 2) * 4);
#undef A
#undef R
    host += 2 * (T * (rot / 2) * 4 + 4);
    /* the greedy picks (forward_pick.c): (value, id) pairs of every rank */
    const size_t pairs = (size_t)lim->max_logits * 2;
    raw += pairs * sizeof(float) + (group > 1 && device_gather ? pairs * group * sizeof(float) : 0);
    host += pairs * ((size_t)group + 1) * sizeof(float);
    out->act = act + raw;
    out->host = host;
    out->logits_dev = logits_dev;
    out->logits_host = (size_t)lim->max_logits * d->vocab * sizeof(float) + 4 +
                       (size_t)lim->max_logits * c->vocab_size * sizeof(float) + 4;
}

/* The layers as the backend's decode_layer and kernels/layer.c see them. */
static fl_status layer_descs(fl_forward *f) {
    const fl_model *m = f->m;
    const fl_model_config *c = &m->cfg;
    f->layers = calloc((size_t)c->n_layers, sizeof *f->layers);
    if (!f->layers) return FL_ERR(FL_ERR_OOM, "out of memory");
#define T(t) ((t).data ? &(t) : NULL)
    for (int l = 0; l < c->n_layers; l++) {
        const fl_layer_weights *w = &m->layers[l];
        f->layers[l] = (fl_layer_desc){
            .attn_norm = &w->attn_norm, .mlp_norm = &w->mlp_norm,
            .wqkv = T(w->wqkv), .bqkv = c->attention_bias ? T(w->bqkv) : NULL,
            .wq = &w->wq, .wk = &w->wk, .wv = &w->wv,
            .bq = c->attention_bias ? T(w->bq) : NULL, .bk = c->attention_bias ? T(w->bk) : NULL,
            .bv = c->attention_bias ? T(w->bv) : NULL,
            .q_norm = c->qk_norm ? &w->q_norm : NULL, .k_norm = c->qk_norm ? &w->k_norm : NULL,
            .wo = &w->wo, .bo = T(w->bo),
            .gate_up = w->is_moe ? NULL : T(w->mlp.gate_up), .gate = w->is_moe ? NULL : &w->mlp.gate,
            .up = w->is_moe ? NULL : &w->mlp.up,
            .down = w->is_moe ? NULL : &w->mlp.down,
            .k_cache = f->kv->k[l], .v_cache = f->kv->v[l],
            .n_heads = m->dims.n_heads, .n_kv_heads = m->dims.n_kv_heads, .head_dim = c->head_dim,
            .rot_dim = f->rot_dim, .rope_interleaved = c->rope.interleaved,
            .eps = c->rms_norm_eps, .attn_scale = f->attn_scale,
        };
    }
#undef T
    return FL_OK;
}

fl_status fl_forward_init(fl_model *m, fl_kv_cache *kv, const fl_forward_limits *lim, fl_comm *comm,
                          const fl_forward_config *cfg, fl_forward **out) {
    fl_status st = FL_OK;
    fl_backend *be = m->be;
    const fl_model_config *c = &m->cfg;
    fl_forward *f = calloc(1, sizeof *f);
    if (!f) return FL_ERR(FL_ERR_OOM, "out of memory");
    f->m = m;
    f->kv = kv;
    f->lim = *lim;
    if (cfg)
        f->cfg = *cfg;
    else
        fl_forward_config_default(&f->cfg);
    f->smp_can = -1;
    f->comm = comm;
    f->comm_dt = be->act_dtype == FL_DTYPE_F32 ? FL_COMM_F32 : FL_COMM_BF16;
    f->comm_inline = comm && fl_comm_backend_of(comm) == FL_COMM_BACKEND_NCCL &&
                     fl_comm_stream(comm) == fl_backend_native_stream(be);
    f->rot_dim = fl_rope_dim(c);
    const size_t T = (size_t)lim->max_tokens, H = (size_t)c->hidden_size;
    const fl_model_dims *d = &m->dims;
    const bool mla = c->arch == FL_ARCH_DEEPSEEK_V2;
    const fl_mla_config *a = &c->mla;
    const size_t kvd = (size_t)d->n_kv_heads * c->head_dim;
    /* MLA: q rows are n_heads * (nope + rope), attention output rows n_heads * v */
    size_t qd = (size_t)d->n_heads * c->head_dim;
    if (mla) {
        size_t qk = (size_t)d->n_heads * (a->qk_nope_head_dim + a->qk_rope_head_dim),
               vd = (size_t)d->n_heads * a->v_head_dim;
        qd = qk > vd ? qk : vd;
    }
    f->attn_scale = 1.0f / sqrtf((float)c->head_dim);
    if (mla) {
        /* transformers' yarn_apply_mscale: any scaled RoPE with mscale_all_dim
         * multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 */
        double sc = 1.0 / sqrt((double)(a->qk_nope_head_dim + a->qk_rope_head_dim));
        if (c->rope.kind != FL_ROPE_DEFAULT && c->rope.mscale_all_dim != 0 && c->rope.factor > 1) {
            double ms = 0.1 * c->rope.mscale_all_dim * log(c->rope.factor) + 1.0;
            sc *= ms * ms;
        }
        f->attn_scale = (float)sc;
    }
    int inter = d->inter;
    if (d->moe_inter > inter) inter = d->moe_inter;
    if (d->shared_inter > inter) inter = d->shared_inter;
    f->inter_max = inter;
    const size_t topk = c->n_experts ? (size_t)c->n_experts_per_tok : 0;

#define ACT(ptr, n) FL_TRY_GOTO(be->ops->alloc(be, fl_backend_act_bytes(be, nonzero(n)), &(ptr)), st, fail)
#define RAW(ptr, n) FL_TRY_GOTO(be->ops->alloc(be, nonzero(n), (void **)&(ptr)), st, fail)
    ACT(f->x, T * H);
    if (be->ops->decode_layer) RAW(f->layer_ws, FL_DECODE_LAYER_WS_BYTES);
    ACT(f->h, T * H);
    /* q also takes the fused q|k|v rows (model_fuse.c) */
    ACT(f->q, T * (mla ? qd : qd + 2 * kvd));
    ACT(f->k, T * kvd);
    ACT(f->v, T * kvd);
    ACT(f->attn, T * qd);
    ACT(f->o, T * H);
    ACT(f->gate, T * 2 * (size_t)inter); /* fused gate|up rows */
    ACT(f->up, T * inter);
    ACT(f->act, T * inter);
    ACT(f->head_in, (size_t)lim->max_logits * H);
    ACT(f->ckv, mla ? T * (size_t)(a->kv_lora_rank + a->qk_rope_head_dim) : 0);
    ACT(f->qa, mla ? T * (size_t)a->q_lora_rank : 0);
    ACT(f->lat, mla ? T * (size_t)a->kv_lora_rank : 0);
    ACT(f->logits, (size_t)lim->max_logits * d->vocab);
    if (comm && fl_comm_backend_of(comm) != FL_COMM_BACKEND_MPI)
        ACT(f->d_logits_all, (size_t)lim->max_logits * c->vocab_size);
    if (c->n_experts) {
        ACT(f->router, T * c->n_experts);
        ACT(f->moe_in, T * H);
        ACT(f->moe_out, T * H);
        ACT(f->moe_acc, T * H);
        ACT(f->sgate, T);
        RAW(f->d_moe_ids, T * topk * 4);
        RAW(f->d_moe_idx, T * topk * 4);
        RAW(f->d_moe_w, T * topk * 4);
        RAW(f->d_moe_wsorted, T * topk * 4);
        f->h_moe_ids = malloc(T * topk * 4);
        f->h_moe_idx = malloc(T * topk * 4);
        f->h_moe_w = malloc(T * topk * 4);
        f->h_moe_wsorted = malloc(T * topk * 4);
        f->h_counts = malloc(((size_t)c->n_experts + 1) * sizeof(int));
        FL_CHECK_ALLOC(f->h_moe_ids, st, fail);
        FL_CHECK_ALLOC(f->h_moe_idx, st, fail);
        FL_CHECK_ALLOC(f->h_moe_w, st, fail);
        FL_CHECK_ALLOC(f->h_moe_wsorted, st, fail);
        FL_CHECK_ALLOC(f->h_counts, st, fail);
    }
    RAW(f->d_plan, plan_words_max(lim) * 4);
    RAW(f->d_cos, T * (f->rot_dim / 2) * 4);
    RAW(f->d_sin, T * (f->rot_dim / 2) * 4);
#undef ACT
#undef RAW
    f->h_logits_local = malloc((size_t)lim->max_logits * d->vocab * sizeof(float) + 4);
    f->h_logits_all = malloc((size_t)lim->max_logits * c->vocab_size * sizeof(float) + 4);
    f->gather_counts = calloc(comm ? (size_t)fl_comm_size(comm) : 1, sizeof(size_t));
    FL_CHECK_ALLOC(f->h_logits_local, st, fail);
    FL_CHECK_ALLOC(f->h_logits_all, st, fail);
    FL_CHECK_ALLOC(f->gather_counts, st, fail);
    f->h_cos = malloc(T * (f->rot_dim / 2) * 4 + 4);
    f->h_sin = malloc(T * (f->rot_dim / 2) * 4 + 4);
    FL_CHECK_ALLOC(f->h_cos, st, fail);
    FL_CHECK_ALLOC(f->h_sin, st, fail);
    FL_TRY_GOTO(fl_forward_skip_parse(fl_opt_str(FL_OPT_DIAG_SKIP), &f->skip), st, fail);
    FL_TRY_GOTO(layer_descs(f), st, fail);
    f->layer_op = be->ops->decode_layer && fl_opt_bool(FL_OPT_DECODE_LAYER);
    if (f->skip)
        fprintf(stderr, "flotilla: FL_DIAG_SKIP=%s: those ops are left out of every step; outputs are wrong "
                        "(timing only)\n", fl_opt_str(FL_OPT_DIAG_SKIP));
    FL_TRY_GOTO(fl_forward_pick_init(f), st, fail);
    FL_TRY_GOTO(fl_forward_moe_dev_init(f), st, fail); /* before the graphs: it decides MoE's */
    FL_TRY_GOTO(fl_forward_graph_init(f), st, fail);
    *out = f;
    return FL_OK;
fail:
    fl_forward_free(f);
    return st;
}

void fl_forward_free(fl_forward *f) {
    if (!f) return;
    fl_forward_moe_free(f);
    fl_forward_moe_dev_free(f);
    fl_backend *be = f->m->be;
    fl_forward_graph_free(f);
    fl_forward_pick_free(f);
    void *dev[] = {f->x, f->layer_ws, f->h, f->q, f->k, f->v, f->attn, f->o, f->gate, f->up, f->act, f->router,
                   f->moe_in, f->moe_out, f->moe_acc, f->sgate, f->head_in, f->logits, f->d_plan,
                   f->d_cos, f->d_sin, f->d_logits_all, f->d_moe_ids, f->d_moe_idx, f->d_moe_w, f->d_moe_wsorted,
                   f->ckv, f->qa, f->lat};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->ops->free(be, dev[i]);
    free(f->h_cos);
    free(f->h_sin);
    free(f->h_moe_ids);
    free(f->h_moe_idx);
    free(f->h_moe_w);
    free(f->h_moe_wsorted);
    free(f->h_counts);
    free(f->h_logits_local);
    free(f->h_logits_all);
    free(f->gather_counts);
    free(f->layers);
    free(f);
}

/* Element offset into an activation buffer. */
static void *act_at(const fl_backend *be, void *buf, size_t elems) {
    return (char *)buf + fl_backend_act_bytes(be, elems);
}

/* Whether the MLA inputs' ropes, latent norm and cache store are the
 * backend's one mla_rope_norm_store (FL_MLA_PREP_FUSE=0: the separate ops,
 * the A/B). */
static bool mla_prep_fused(const fl_backend *be) {
    return fl_opt_bool(FL_OPT_MLA_PREP_FUSE) && be->ops->mla_rope_norm_store;
}

/* The same as separate ops: q_pe of every head (the last rope elements of
 * its qk slice) and the shared k_pe rotated, kv_a_layernorm on the latent
 * part of each [latent | k_pe] row (through f->lat: rmsnorm takes
 * contiguous rows), the records into the cache. */
static fl_status mla_prep_ops(fl_forward *f, int l, const fl_step_dev *sd, float eps) {
    fl_backend *be = f->m->be;
    const fl_mla_config *a = &f->m->cfg.mla;
    const int n = sd->n, nope = a->qk_nope_head_dim, rope = a->qk_rope_head_dim, qk = nope + rope, kvl = a->kv_lora_rank,
              rec = kvl + rope, nh = f->m->dims.n_heads;
    FL_TRY(be->ops->rope(be, act_at(be, f->q, nope), n, nh, qk, nh * qk, sd->cos, sd->sin, rope, true));
    FL_TRY(be->ops->rope(be, act_at(be, f->ckv, kvl), n, 1, rope, rec, sd->cos, sd->sin, rope, true));
    const size_t lat_bytes = fl_backend_act_bytes(be, (size_t)kvl);
    for (int t = 0; t < n; t++)
        FL_TRY(be->ops->copy(be, act_at(be, f->lat, (size_t)t * kvl), act_at(be, f->ckv, (size_t)t * rec), lat_bytes));
    FL_TRY(be->ops->rmsnorm(be, f->lat, &f->m->layers[l].kv_a_norm, eps, n, kvl, f->lat));
    for (int t = 0; t < n; t++)
        FL_TRY(be->ops->copy(be, act_at(be, f->ckv, (size_t)t * rec), act_at(be, f->lat, (size_t)t * kvl), lat_bytes));
    return be->ops->kv_store(be, f->ckv, act_at(be, f->ckv, (size_t)rec / 2), n, rec / 2, rec, sd->slots,
                             f->kv->k[l], f->kv->v[l]);
}

/* DeepSeek-V2 multi-head latent attention. The cache stores, per token, the
 * normed latent c and the rotated shared k_pe (one record of kv_lora + rope
 * elements, split over the K and V arrays: see model_config.h); the
 * mla_attention op expands it with kv_b_proj inside the attention, so no
 * per-head K/V is ever materialized or cached. RoPE is the interleaved
 * (complex) rotation transformers' apply_rotary_emb does. */
static fl_status mla_block(fl_forward *f, int l, const fl_step_dev *sd, const fl_attn_meta *meta) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const fl_mla_config *a = &c->mla;
    const fl_layer_weights *w = &f->m->layers[l];
    const fl_model_dims *d = &f->m->dims;
    const int n = sd->n, nope = a->qk_nope_head_dim, rope = a->qk_rope_head_dim,
              qk = nope + rope, kvl = a->kv_lora_rank;
    const float eps = 1e-6f; /* q_a_layernorm / kv_a_layernorm: DeepseekV2RMSNorm's default */
    if (a->q_lora_rank > 0) {
        FL_TRY(be->ops->matmul(be, f->h, n, &w->wq_a, w->bq_a.data ? &w->bq_a : NULL, f->qa));
        FL_TRY(be->ops->rmsnorm(be, f->qa, &w->q_a_norm, eps, n, a->q_lora_rank, f->qa));
        FL_TRY(be->ops->matmul(be, f->qa, n, &w->wq_b, NULL, f->q));
    } else {
        FL_TRY(be->ops->matmul(be, f->h, n, &w->wq, NULL, f->q));
    }
    FL_TRY(be->ops->matmul(be, f->h, n, &w->wkv_a, w->bkv_a.data ? &w->bkv_a : NULL, f->ckv));
    if (mla_prep_fused(be))
        FL_TRY(be->ops->mla_rope_norm_store(be, f->q, d->n_heads * qk, f->ckv, n, d->n_heads, nope, rope, kvl,
                                            sd->cos, sd->sin, &w->kv_a_norm, eps, sd->slots, f->kv->k[l],
                                            f->kv->v[l]));
    else
        FL_TRY(mla_prep_ops(f, l, sd, eps));
    FL_TRY(be->ops->mla_attention(be, f->q, meta, d->n_heads, nope, rope, a->v_head_dim, kvl, f->attn_scale,
                                  &w->wkv_b, f->kv->k[l], f->kv->v[l], f->attn));
    FL_TRY(be->ops->matmul(be, f->attn, n, &w->wo, w->bo.data ? &w->bo : NULL, f->o));
    return fl_forward_reduce(f, f->o, (size_t)n * c->hidden_size);
}

static fl_status reduce_cb(void *ctx, void *buf, size_t n) { return fl_forward_reduce(ctx, buf, n); }

/* The residual stream lives in f->x, each layer's normed input in f->h.
 * Decode steps run each attention layer as the backend's decode_layer
 * where it has one (it owns its fusions, and may leave h in its own form
 * for its next call); prompt rows and backends without it run the plain
 * ops (kernels/layer.c). MLA attention and MoE blocks are this file's and
 * forward_moe.c's. The choices depend only on the step's size, so a
 * captured graph replays them. */
fl_status fl_forward_body(fl_forward *f, const fl_step_dev *sd, const fl_attn_meta *meta) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int n = sd->n, H = c->hidden_size;
    const float eps = c->rms_norm_eps;
    const bool mla = c->arch == FL_ARCH_DEEPSEEK_V2;
    const bool op = f->layer_op && meta->max_q_len == 1 && !mla;
    const fl_layer_step s = {
        .n = n, .hidden = H, .skip = f->skip, .meta = meta, .cos = sd->cos, .sin = sd->sin, .slots = sd->slots,
        .x = f->x, .h = f->h, .q = f->q, .k = f->k, .v = f->v, .attn = f->attn, .o = f->o, .gate = f->gate,
        .up = f->up, .act = f->act, .ws = f->layer_ws, .reduce = f->comm ? reduce_cb : NULL, .reduce_ctx = f,
    };
    int hs = FL_LAYER_H_NONE; /* what f->h holds (kernels/backend.h) */
    FL_TRY(be->ops->embed(be, &f->m->embed, sd->tokens, n, f->x));
    for (int l = 0; l < c->n_layers; l++) {
        const fl_layer_weights *w = &f->m->layers[l];
        const fl_layer_desc *L = &f->layers[l];
        const fl_tensor *next_norm = l + 1 < c->n_layers ? &f->m->layers[l + 1].attn_norm : &f->m->final_norm;
        if (mla) {
            if (hs == FL_LAYER_H_NONE) FL_TRY(be->ops->rmsnorm(be, f->x, &w->attn_norm, eps, n, H, f->h));
            FL_TRY(mla_block(f, l, sd, meta));
            if (!(f->skip & FL_SKIP_NORM_MLP)) FL_TRY(be->ops->add_rmsnorm(be, f->x, f->o, &w->mlp_norm, eps, n, H, f->h));
            hs = FL_LAYER_H_NORMED;
            if (!w->is_moe) {
                FL_TRY(fl_forward_mlp(f, &w->mlp, f->h, n, f->o));
                FL_TRY(fl_forward_reduce(f, f->o, (size_t)n * H));
                if (!(f->skip & FL_SKIP_NORM_ATTN)) FL_TRY(be->ops->add_rmsnorm(be, f->x, f->o, next_norm, eps, n, H, f->h));
            }
        } else if (op) {
            const fl_layer_desc *next = l + 1 < c->n_layers ? &f->layers[l + 1] : NULL;
            FL_TRY(be->ops->decode_layer(be, L, next, next_norm, &s, &hs));
        } else {
            FL_TRY(fl_layer_plain(be, L, next_norm, &s, &hs));
        }
        if (w->is_moe) {
            /* leaves the reduced sum in f->moe_acc, or adds and norms */
            bool normed = false;
            FL_TRY(fl_forward_moe(f, w, n, (f->skip & FL_SKIP_NORM_ATTN) ? NULL : next_norm, &normed));
            if (!(f->skip & FL_SKIP_NORM_ATTN) && !normed)
                FL_TRY(be->ops->add_rmsnorm(be, f->x, f->moe_acc, next_norm, eps, n, H, f->h));
            hs = FL_LAYER_H_NORMED;
        }
    }
    if (sd->n_logits == 0 || (f->skip & FL_SKIP_HEAD)) return FL_OK;
    if (hs == FL_LAYER_H_BACKEND)
        return FL_ERR(FL_ERR_INTERNAL, "forward: the last layer left the final norm in the backend's form");
    const void *head_in = f->h;
    if (sd->logit_rows) {
        FL_TRY(be->ops->gather_rows(be, f->h, sd->logit_rows, sd->n_logits, H, f->head_in));
        head_in = f->head_in;
    }
    return be->ops->matmul(be, head_in, sd->n_logits, &f->m->lm_head, NULL, f->logits);
}

void fl_forward_vocab_shard(const fl_forward *f, int r, int *lo, int *n) {
    const int V = f->m->cfg.vocab_size, size = f->comm ? fl_comm_size(f->comm) : 1;
    const int base = V / size, extra = V % size;
    *n = base + (r < extra);
    *lo = r * base + (r < extra ? r : extra);
}

fl_status fl_forward_gather_shards(fl_forward *f, int rows) {
    fl_backend *be = f->m->be;
    const int Vl = f->m->dims.vocab, size = fl_comm_size(f->comm);
    for (int r = 0; r < size; r++) {
        int lo, vr;
        fl_forward_vocab_shard(f, r, &lo, &vr);
        f->gather_counts[r] = (size_t)rows * vr;
    }
    if (fl_comm_backend_of(f->comm) == FL_COMM_BACKEND_MPI) {
        FL_TRY(be->ops->download_act(be, f->h_logits_local, f->logits, (size_t)rows * Vl));
        return fl_comm_all_gather(f->comm, f->h_logits_local, f->h_logits_all, f->gather_counts, FL_COMM_F32);
    }
    /* NCCL: gather on the devices (a download after it waits for the
     * backend's stream, which holds the gather when the communicator shares
     * it) */
    if (!f->comm_inline) FL_TRY(be->ops->sync(be));
    FL_TRY(fl_comm_all_gather(f->comm, f->logits, f->d_logits_all, f->gather_counts, f->comm_dt));
    if (!f->comm_inline) FL_TRY(fl_comm_sync(f->comm));
    return FL_OK;
}

/* Each rank projected its vocabulary rows: gather [rank][row][its vocab]
 * blocks and lay them out as [row][vocab]. */
static fl_status gather_logits(fl_forward *f, int rows, float *logits) {
    fl_backend *be = f->m->be;
    const int V = f->m->cfg.vocab_size;
    if (!f->comm) {
        if (!logits) return be->ops->sync(be);
        return fl_forward_logits_download(f, rows, logits);
    }
    FL_TRY(fl_forward_gather_shards(f, rows));
    if (!logits) return FL_OK;
    if (fl_comm_backend_of(f->comm) != FL_COMM_BACKEND_MPI)
        FL_TRY(be->ops->download_act(be, f->h_logits_all, f->d_logits_all, (size_t)rows * V));
    fl_forward_shards_to_rows(f, rows, logits);
    return FL_OK;
}

void fl_forward_shards_to_rows(const fl_forward *f, int rows, float *dst) {
    const int V = f->m->cfg.vocab_size;
    size_t off = 0;
    for (int r = 0; r < fl_comm_size(f->comm); r++) {
        int v_lo, vr;
        fl_forward_vocab_shard(f, r, &v_lo, &vr);
        for (int i = 0; i < rows; i++)
            memcpy(dst + (size_t)i * V + v_lo, f->h_logits_all + off + (size_t)i * vr, (size_t)vr * sizeof(float));
        off += (size_t)rows * vr;
    }
}

fl_status fl_forward_run(fl_forward *f, const fl_step_plan *p, float *logits, int32_t *ids) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int n = p->n_tokens;
    if (n > f->lim.max_tokens || p->n_seqs > f->lim.max_seqs || p->max_blocks > f->lim.max_blocks ||
        p->n_logits > f->lim.max_logits)
        return FL_ERR(FL_ERR_INTERNAL, "step plan (%d tokens, %d seqs, %d blocks, %d logits) exceeds "
                      "the forward limits", n, p->n_seqs, p->max_blocks, p->n_logits);
    if (n == 0) return fl_forward_moe_idle(f);
    f->moe_count = n == p->n_seqs; /* a decode step (one new token a sequence): its experts are counted */
    fl_forward_timer tm;
    fl_forward_timer_start(f, p, &tm);

    /* Decode steps of graph-safe models replay a captured graph. */
    bool done = false;
    FL_TRY(fl_forward_graph_run(f, p, &tm, &done));
    if (!done) {
        /* The plan's index arrays go to the device in one copy; views keep
         * the same offsets as on the host. */
        FL_TRY(be->ops->upload(be, f->d_plan, p->buf, fl_step_plan_forward_words(p) * 4));
#define DEV(field) (f->d_plan + (p->field - p->buf))
        fl_attn_meta meta = {
            .n_seqs = p->n_seqs, .q_start = DEV(q_start), .ctx_len = DEV(ctx_len),
            .block_tables = DEV(block_tables), .max_blocks = p->max_blocks,
            .block_size = p->block_size, .max_ctx_len = 0, .max_q_len = 0,
        };
        for (int s = 0; s < p->n_seqs; s++) {
            if (p->ctx_len[s] > meta.max_ctx_len) meta.max_ctx_len = p->ctx_len[s];
            if (p->q_start[s + 1] - p->q_start[s] > meta.max_q_len)
                meta.max_q_len = p->q_start[s + 1] - p->q_start[s];
        }

        /* RoPE angles per row; dynamic NTK depends on each sequence's length. */
        const int half = f->rot_dim / 2;
        for (int s = 0; s < p->n_seqs; s++) {
            int lo = p->q_start[s], cnt = p->q_start[s + 1] - lo;
            fl_rope_fill(c, f->m->rope_freq_factors, p->rope_len[s], p->positions + lo, cnt,
                         f->h_cos + (size_t)lo * half, f->h_sin + (size_t)lo * half);
        }
        FL_TRY(be->ops->upload(be, f->d_cos, f->h_cos, (size_t)n * half * 4));
        FL_TRY(be->ops->upload(be, f->d_sin, f->h_sin, (size_t)n * half * 4));
        fl_forward_timer_mark(f, &tm, FL_FWD_T_PREP);
        const fl_step_dev sd = {
            .n = n, .tokens = DEV(tokens), .slots = DEV(slots), .logit_rows = DEV(logit_rows),
            .n_logits = p->n_logits, .cos = f->d_cos, .sin = f->d_sin,
        };
#undef DEV
        FL_TRY(fl_forward_body(f, &sd, &meta));
        fl_forward_timer_mark(f, &tm, FL_FWD_T_ENQUEUE);
    }
    if (p->n_logits == 0) {
        FL_TRY(be->ops->sync(be));
        fl_forward_timer_mark(f, &tm, FL_FWD_T_GPU);
        fl_forward_timer_stop(f, &tm);
        return fl_forward_moe_dev_collect(f);
    }
    FL_TRY(fl_forward_timer_sync(f, &tm));
    if (fl_step_plan_output(p) == FL_PLAN_GREEDY)
        FL_TRY(fl_forward_pick_greedy(f, p->n_logits, ids));
    else if (fl_step_plan_output(p) == FL_PLAN_SAMPLED)
        FL_TRY(fl_forward_pick_sampled(f, p->n_logits, ids));
    else
        FL_TRY(gather_logits(f, p->n_logits, logits));
    fl_forward_timer_mark(f, &tm, FL_FWD_T_LOGITS);
    fl_forward_timer_stop(f, &tm);
    return fl_forward_moe_dev_collect(f);
}
