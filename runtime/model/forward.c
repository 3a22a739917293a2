/*
 * forward.c — the decoder forward pass, written once against the backend op
 * table (kernels/backend.h).
 *
 * Per layer: RMSNorm -> q/k/v projections (+bias) -> per-head q/k norm ->
 * RoPE -> K/V into the paged cache -> paged attention -> o_proj -> residual
 * add -> RMSNorm -> dense SiLU-gated MLP or MoE -> residual add. Then the
 * final norm and lm_head run only on the rows whose logits are wanted.
 * RoPE of q and k and the K/V store are one op (rope_kv_store; on a backend
 * that can, one with the q|k|v projection too: matmul_rope_kv), and each
 * residual add is fused with the norm that follows it (add_rmsnorm:
 * the attention output with the MLP norm, a dense MLP's output with the next
 * layer's attention norm or the final norm).
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

/* Whether the backend's fused gate|up + SiLU serves this MLP at n tokens
 * (and so can take a deferred norm before it). */
bool fl_forward_mlp_fused(const fl_forward *f, const fl_mlp_weights *w, int n) {
    fl_backend *be = f->m->be;
    const fl_tensor *g = w->gate_up.data ? &w->gate_up : &w->gate, *u = w->gate_up.data ? NULL : &w->up;
    return !(f->skip & FL_SKIP_GATE_UP) && be->ops->gate_up_silu && n <= be->ops->gate_up_silu_max_n(be, g, u);
}

/* Dense SiLU-gated MLP: out[n, hidden] = down(silu(gate(x)) * up(x)). */
fl_status fl_forward_mlp(fl_forward *f, const fl_mlp_weights *w, const void *x, int n, void *out) {
    return fl_forward_mlp_rd(f, w, NULL, NULL, (void *)x, n, out);
}

fl_status fl_forward_mlp_rd(fl_forward *f, const fl_mlp_weights *w, const fl_rms_defer *rd_in,
                            const fl_rms_out *ro, void *x, int n, void *out) {
    fl_backend *be = f->m->be;
    const fl_tensor *g = w->gate_up.data ? &w->gate_up : &w->gate, *u = w->gate_up.data ? NULL : &w->up;
    const bool glu = fl_forward_mlp_fused(f, w, n);
    if (rd_in && !glu)
        return FL_ERR(FL_ERR_INVALID_ARG, "forward: a deferred norm for an MLP whose gate|up is not fused");
    if (f->skip & FL_SKIP_GATE_UP) {
    } else if (glu) { /* one pass, no gate/up buffers */
        FL_TRY(be->ops->gate_up_silu(be, x, n, g, u, f->act, rd_in));
    } else if (w->gate_up.data) { /* one matmul: gate and up side by side in each row of f->gate */
        const int inter = (int)w->gate_up.shape[0] / 2;
        FL_TRY(be->ops->matmul(be, x, n, &w->gate_up, NULL, f->gate));
        FL_TRY(be->ops->silu_mul(be, f->gate, (char *)f->gate + fl_backend_act_bytes(be, (size_t)inter), n, inter,
                                 2 * inter, f->act));
    } else {
        const int inter = (int)w->gate.shape[0];
        FL_TRY(be->ops->matmul(be, x, n, &w->gate, NULL, f->gate));
        FL_TRY(be->ops->matmul(be, x, n, &w->up, NULL, f->up));
        FL_TRY(be->ops->silu_mul(be, f->gate, f->up, n, inter, inter, f->act));
    }
    if (f->skip & FL_SKIP_DOWN) return FL_OK;
    if (ro) return be->ops->matmul_add_rms(be, f->act, n, &w->down, NULL, ro->resid, ro->norm_w, f->h, ro->rd);
    return be->ops->matmul(be, f->act, n, &w->down, NULL, out);
}

/* Whether the residual add + norm after the GEMV w (an o or down
 * projection) can be deferred into the GEMV after it at n tokens
 * (kernels/backend.h's fl_rms_defer): the whole model on this rank (no
 * reduction between the GEMV and the add), no timing skips; the consumer
 * asks rms_defer_pays too. */
static bool rms_defer_from(const fl_forward *f, const fl_tensor *w, int n) {
    fl_backend *be = f->m->be;
    return !f->comm && !f->skip && f->rms_ss && be->ops->matmul_add_rms && be->ops->rms_defer_pays &&
           n <= FL_RMS_DEFER_MAX_N && n <= be->ops->matmul_add_rms_max_n(be, w);
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
                         const fl_forward_limits *lim, bool rms_defer, int group, bool device_gather,
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
    if (rms_defer) R(sizeof(float) * FL_RMS_DEFER_MAX_N * FL_RMS_DEFER_SLOTS);
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
    if (be->ops->matmul_add_rms) RAW(f->rms_ss, sizeof(float) * FL_RMS_DEFER_MAX_N * FL_RMS_DEFER_SLOTS);
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
    void *dev[] = {f->x, f->rms_ss, f->h, f->q, f->k, f->v, f->attn, f->o, f->gate, f->up, f->act, f->router,
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

/* Whether layer l's q|k|v projection is one matmul_rope_kv at n tokens
 * (which can then take a deferred norm before it). */
static bool qkv_fused(const fl_forward *f, int l, int n) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const fl_layer_weights *w = &f->m->layers[l];
    return c->arch != FL_ARCH_DEEPSEEK_V2 && !(f->skip & FL_SKIP_QKV) && w->wqkv.data && !c->qk_norm &&
           be->ops->matmul_rope_kv &&
           n <= be->ops->matmul_rope_kv_max_n(be, &w->wqkv, c->head_dim, f->rot_dim, c->rope.interleaved);
}

/* q, k and v of layer l from the normed rows f->h (or, rd not NULL, the
 * unnormalized rows of a deferred norm: qkv_fused said yes), q and k
 * rotated, k and v stored into the cache; q stays in f->q, *q_stride
 * elements a token. */
static fl_status qkv_rope_store(fl_forward *f, int l, const fl_step_dev *sd, int *q_stride, const fl_rms_defer *rd) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const fl_layer_weights *w = &f->m->layers[l];
    const fl_model_dims *d = &f->m->dims;
    const int n = sd->n, hd = c->head_dim;
    const int qd = d->n_heads * hd, kvd = d->n_kv_heads * hd;
    const fl_tensor *bqkv = c->attention_bias ? &w->bqkv : NULL;
    void *k = f->k, *v = f->v;
    int kv_stride = kvd;
    *q_stride = qd;
    if (qkv_fused(f, l, n)) {
        /* all three in one launch (CUDA: the q|k|v GEMV's epilogue rotates) */
        *q_stride = qd + 2 * kvd;
        return be->ops->matmul_rope_kv(be, f->h, n, &w->wqkv, bqkv, f->q, d->n_heads, d->n_kv_heads, hd, sd->cos,
                                       sd->sin, sd->slots, f->kv->k[l], f->kv->v[l], rd);
    }
    if (rd) return FL_ERR(FL_ERR_INVALID_ARG, "forward: a deferred norm for a q|k|v projection that is not fused");
    if (w->wqkv.data) {
        /* one matmul; each row of f->q is [q | k | v] (with qk_norm only
         * when the norms are fused below: fl_model_qknorm_fused) */
        FL_TRY(be->ops->matmul(be, f->h, n, &w->wqkv, bqkv, f->q));
        k = act_at(be, f->q, (size_t)qd);
        v = act_at(be, f->q, (size_t)qd + kvd);
        *q_stride = kv_stride = qd + 2 * kvd;
    } else {
        FL_TRY(be->ops->matmul(be, f->h, n, &w->wq, c->attention_bias ? &w->bq : NULL, f->q));
        FL_TRY(be->ops->matmul(be, f->h, n, &w->wk, c->attention_bias ? &w->bk : NULL, f->k));
        FL_TRY(be->ops->matmul(be, f->h, n, &w->wv, c->attention_bias ? &w->bv : NULL, f->v));
    }
    if (c->qk_norm && fl_model_qknorm_fused(be))
        return be->ops->qknorm_rope_kv_store(be, f->q, k, v, n, d->n_heads, d->n_kv_heads, hd, *q_stride, kv_stride,
                                             &w->q_norm, &w->k_norm, c->rms_norm_eps, sd->cos, sd->sin, f->rot_dim,
                                             c->rope.interleaved, sd->slots, f->kv->k[l], f->kv->v[l]);
    if (c->qk_norm && w->wqkv.data)
        return FL_ERR(FL_ERR_INTERNAL, "forward: q|k|v stacked for a qk_norm model without the fused norms");
    if (c->qk_norm) {
        FL_TRY(be->ops->rmsnorm(be, f->q, &w->q_norm, c->rms_norm_eps, n * d->n_heads, hd, f->q));
        FL_TRY(be->ops->rmsnorm(be, f->k, &w->k_norm, c->rms_norm_eps, n * d->n_kv_heads, hd, f->k));
    }
    return be->ops->rope_kv_store(be, f->q, k, v, n, d->n_heads, d->n_kv_heads, hd, *q_stride, kv_stride,
                                  sd->cos, sd->sin, f->rot_dim, c->rope.interleaved, sd->slots, f->kv->k[l],
                                  f->kv->v[l]);
}

/* Attention of layer l on the normed rows f->h (or a deferred norm's, rd:
 * see qkv_rope_store); leaves the (reduced) output projection in f->o for
 * the caller's fused residual add, or, ro not NULL, adds it into the
 * residual itself as the producer of the MLP's deferred norm. */
static fl_status attention_block(fl_forward *f, int l, const fl_step_dev *sd, const fl_attn_meta *meta,
                                 const fl_rms_defer *rd, const fl_rms_out *ro) {
    if (f->m->cfg.arch == FL_ARCH_DEEPSEEK_V2) return mla_block(f, l, sd, meta);
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const fl_layer_weights *w = &f->m->layers[l];
    const fl_model_dims *d = &f->m->dims;
    int q_stride = d->n_heads * c->head_dim;
    if (!(f->skip & FL_SKIP_QKV)) FL_TRY(qkv_rope_store(f, l, sd, &q_stride, rd));
    if (!(f->skip & FL_SKIP_ATTN))
        FL_TRY(be->ops->attention(be, f->q, q_stride, meta, d->n_heads, d->n_kv_heads, c->head_dim, f->attn_scale,
                                  f->kv->k[l], f->kv->v[l], f->attn));
    const fl_tensor *bo = w->bo.data ? &w->bo : NULL;
    if (ro) return be->ops->matmul_add_rms(be, f->attn, sd->n, &w->wo, bo, ro->resid, ro->norm_w, f->h, ro->rd);
    if (!(f->skip & FL_SKIP_O)) FL_TRY(be->ops->matmul(be, f->attn, sd->n, &w->wo, bo, f->o));
    return fl_forward_reduce(f, f->o, (size_t)sd->n * c->hidden_size);
}

/* The residual stream lives in f->x. Each add + norm is add_rmsnorm, or,
 * where the GEMVs on both sides can (rms_defer_from, and a fused consumer:
 * the dense gate|up after o, the next layer's q|k|v after down), a deferred
 * norm: the GEMV before it adds into f->x and writes f->h unnormalized with
 * the partials in f->rms_ss, the one after it scales. The choice is the
 * same every step of a batch size, so a captured graph replays it. */
fl_status fl_forward_body(fl_forward *f, const fl_step_dev *sd, const fl_attn_meta *meta) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int n = sd->n, H = c->hidden_size;
    const float eps = c->rms_norm_eps;
    void *xr = f->x;
    bool h_ready = false;     /* f->h already holds this layer's normed input */
    bool final_ready = false; /* f->h already holds the final-normed rows */
    fl_rms_defer rd_attn = {f->rms_ss, 0, eps}, rd_mlp = {f->rms_ss, 0, eps};
    bool attn_deferred = false; /* f->h holds this layer's attention input unnormalized (rd_attn) */
    FL_TRY(be->ops->embed(be, &f->m->embed, sd->tokens, n, xr));
    for (int l = 0; l < c->n_layers; l++) {
        const fl_layer_weights *w = &f->m->layers[l];
        if (!h_ready && !attn_deferred) FL_TRY(be->ops->rmsnorm(be, xr, &w->attn_norm, eps, n, H, f->h));
        const bool norm_mlp = !(f->skip & FL_SKIP_NORM_MLP);
        const fl_tensor *gu = w->mlp.gate_up.data ? &w->mlp.gate_up : &w->mlp.gate;
        const bool mlp_defer = norm_mlp && !w->is_moe && c->arch != FL_ARCH_DEEPSEEK_V2 &&
                               fl_forward_mlp_fused(f, &w->mlp, n) && rms_defer_from(f, &w->wo, n) &&
                               be->ops->rms_defer_pays(be, FL_RMS_DEFER_GATE_UP, gu,
                                                       w->mlp.gate_up.data ? NULL : &w->mlp.up, n, 0);
        const fl_rms_out ro_mlp = {xr, &w->mlp_norm, &rd_mlp};
        FL_TRY(attention_block(f, l, sd, meta, attn_deferred ? &rd_attn : NULL, mlp_defer ? &ro_mlp : NULL));
        attn_deferred = false;
        if (norm_mlp && !mlp_defer) FL_TRY(be->ops->add_rmsnorm(be, xr, f->o, &w->mlp_norm, eps, n, H, f->h));
        const fl_tensor *next = l + 1 < c->n_layers ? &f->m->layers[l + 1].attn_norm : &f->m->final_norm;
        const bool next_defer = !(f->skip & FL_SKIP_NORM_ATTN) && l + 1 < c->n_layers && !w->is_moe &&
                                qkv_fused(f, l + 1, n) && rms_defer_from(f, &w->mlp.down, n) &&
                                be->ops->rms_defer_pays(be, FL_RMS_DEFER_QKV, &f->m->layers[l + 1].wqkv, NULL, n,
                                                        c->head_dim);
        const void *out = f->o;
        bool normed = false; /* the MoE layer did the add and the next norm itself */
        if (w->is_moe) {
            /* leaves the reduced sum in f->moe_acc, or adds and norms */
            FL_TRY(fl_forward_moe(f, w, n, (f->skip & FL_SKIP_NORM_ATTN) ? NULL : next, &normed));
            out = f->moe_acc;
        } else {
            const fl_rms_out ro_attn = {xr, next, &rd_attn};
            FL_TRY(fl_forward_mlp_rd(f, &w->mlp, mlp_defer ? &rd_mlp : NULL, next_defer ? &ro_attn : NULL, f->h,
                                     n, f->o));
            if (!next_defer) FL_TRY(fl_forward_reduce(f, f->o, (size_t)n * H));
        }
        if ((f->skip & FL_SKIP_NORM_ATTN) || normed) {
        } else if (next_defer) {
            attn_deferred = true; /* into the next layer's q|k|v */
        } else {
            FL_TRY(be->ops->add_rmsnorm(be, xr, out, next, eps, n, H, f->h));
        }
        h_ready = l + 1 < c->n_layers;
        final_ready = l + 1 == c->n_layers;
    }
    if (sd->n_logits == 0 || (f->skip & FL_SKIP_HEAD)) return FL_OK;
    if (!final_ready) FL_TRY(be->ops->rmsnorm(be, xr, &f->m->final_norm, eps, n, H, f->h));
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
