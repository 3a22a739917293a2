/*
 * layer.c — the plain decoder layer (layer.h): RMSNorm -> q/k/v projections
 * (+bias) -> per-head q/k norm -> RoPE -> K/V into the paged cache -> paged
 * attention -> o_proj -> (reduce) -> residual add + RMSNorm -> SiLU-gated
 * MLP -> (reduce) -> residual add + the next norm. RoPE of q and k and the
 * K/V store are one op (rope_kv_store), and each residual add is fused with
 * the norm after it (add_rmsnorm): both are ops every backend has.
 */
#include "kernels/layer.h"

#include "core/option.h"

static void *act_at(const fl_backend *b, void *buf, size_t elems) {
    return (char *)buf + fl_backend_act_bytes(b, elems);
}

fl_status fl_layer_qkv(fl_backend *b, const fl_layer_desc *L, const fl_layer_step *s, int *q_stride) {
    const int n = s->n, hd = L->head_dim;
    const int qd = L->n_heads * hd, kvd = L->n_kv_heads * hd;
    void *k = s->k, *v = s->v;
    int kv_stride = kvd;
    *q_stride = qd;
    if (L->wqkv) {
        /* one matmul; each row of s->q is [q | k | v] (with q/k norms only
         * where the backend norms strided heads: qknorm_rope_kv_store) */
        FL_TRY(b->ops->matmul(b, s->h, n, L->wqkv, L->bqkv, s->q));
        k = act_at(b, s->q, (size_t)qd);
        v = act_at(b, s->q, (size_t)qd + kvd);
        *q_stride = kv_stride = qd + 2 * kvd;
    } else {
        FL_TRY(b->ops->matmul(b, s->h, n, L->wq, L->bq, s->q));
        FL_TRY(b->ops->matmul(b, s->h, n, L->wk, L->bk, s->k));
        FL_TRY(b->ops->matmul(b, s->h, n, L->wv, L->bv, s->v));
    }
    if (L->q_norm && fl_opt_bool(FL_OPT_QKNORM_FUSE) && b->ops->qknorm_rope_kv_store)
        return b->ops->qknorm_rope_kv_store(b, s->q, k, v, n, L->n_heads, L->n_kv_heads, hd, *q_stride, kv_stride,
                                            L->q_norm, L->k_norm, L->eps, s->cos, s->sin, L->rot_dim,
                                            L->rope_interleaved, s->slots, L->k_cache, L->v_cache);
    if (L->q_norm && L->wqkv)
        return FL_ERR(FL_ERR_INTERNAL, "layer: q|k|v stacked for a qk_norm model without the fused norms");
    if (L->q_norm) {
        FL_TRY(b->ops->rmsnorm(b, s->q, L->q_norm, L->eps, n * L->n_heads, hd, s->q));
        FL_TRY(b->ops->rmsnorm(b, s->k, L->k_norm, L->eps, n * L->n_kv_heads, hd, s->k));
    }
    return b->ops->rope_kv_store(b, s->q, k, v, n, L->n_heads, L->n_kv_heads, hd, *q_stride, kv_stride, s->cos,
                                 s->sin, L->rot_dim, L->rope_interleaved, s->slots, L->k_cache, L->v_cache);
}

fl_status fl_layer_gate_up(fl_backend *b, const fl_layer_desc *L, const fl_layer_step *s, const void *x) {
    const int n = s->n;
    if (L->gate_up) { /* one matmul: gate and up side by side in each row of s->gate */
        const int inter = (int)L->gate_up->shape[0] / 2;
        FL_TRY(b->ops->matmul(b, x, n, L->gate_up, NULL, s->gate));
        return b->ops->silu_mul(b, s->gate, act_at(b, s->gate, (size_t)inter), n, inter, 2 * inter, s->act);
    }
    const int inter = (int)L->gate->shape[0];
    FL_TRY(b->ops->matmul(b, x, n, L->gate, NULL, s->gate));
    FL_TRY(b->ops->matmul(b, x, n, L->up, NULL, s->up));
    return b->ops->silu_mul(b, s->gate, s->up, n, inter, inter, s->act);
}

fl_status fl_layer_moe_gate_up(fl_backend *b, const void *x, int n, int k, const int32_t *list, int n_local,
                               const fl_tensor *gate_table, const fl_tensor *up_table, const fl_tensor *gate0,
                               const fl_tensor *up0, void *gu, void *out) {
    const int P = n * k;
    if (!up_table) { /* gate and up side by side in each row of gu */
        const int inter = (int)gate0->shape[0] / 2;
        FL_TRY(b->ops->moe_matmul(b, x, 0, n, k, list, n_local, gate_table, gate0, gu));
        return b->ops->silu_mul(b, gu, act_at(b, gu, (size_t)inter), P, inter, 2 * inter, out);
    }
    const int inter = (int)gate0->shape[0];
    void *up = act_at(b, gu, (size_t)P * inter);
    FL_TRY(b->ops->moe_matmul(b, x, 0, n, k, list, n_local, gate_table, gate0, gu));
    FL_TRY(b->ops->moe_matmul(b, x, 0, n, k, list, n_local, up_table, up0, up));
    return b->ops->silu_mul(b, gu, up, P, inter, inter, out);
}

fl_status fl_layer_reduce(const fl_layer_step *s, void *buf) {
    return s->reduce ? s->reduce(s->reduce_ctx, buf, (size_t)s->n * s->hidden) : FL_OK;
}

fl_status fl_layer_plain(fl_backend *b, const fl_layer_desc *L, const fl_tensor *next_norm, const fl_layer_step *s,
                         int *h_state) {
    const int n = s->n, H = s->hidden;
    const unsigned skip = s->skip;
    if (*h_state == FL_LAYER_H_BACKEND)
        return FL_ERR(FL_ERR_INVALID_ARG, "layer: a backend's own form of the input for the plain sequence");
    if (*h_state == FL_LAYER_H_NONE) FL_TRY(b->ops->rmsnorm(b, s->x, L->attn_norm, L->eps, n, H, s->h));
    int q_stride = L->n_heads * L->head_dim;
    if (!(skip & FL_SKIP_QKV)) FL_TRY(fl_layer_qkv(b, L, s, &q_stride));
    if (!(skip & FL_SKIP_ATTN))
        FL_TRY(b->ops->attention(b, s->q, q_stride, s->meta, L->n_heads, L->n_kv_heads, L->head_dim, L->attn_scale,
                                 L->k_cache, L->v_cache, s->attn));
    if (!(skip & FL_SKIP_O)) FL_TRY(b->ops->matmul(b, s->attn, n, L->wo, L->bo, s->o));
    FL_TRY(fl_layer_reduce(s, s->o));
    if (!(skip & FL_SKIP_NORM_MLP)) FL_TRY(b->ops->add_rmsnorm(b, s->x, s->o, L->mlp_norm, L->eps, n, H, s->h));
    *h_state = FL_LAYER_H_NORMED;
    if (!L->down) return FL_OK; /* the caller's MoE block reads h */
    if (!(skip & FL_SKIP_GATE_UP)) FL_TRY(fl_layer_gate_up(b, L, s, s->h));
    if (!(skip & FL_SKIP_DOWN)) FL_TRY(b->ops->matmul(b, s->act, n, L->down, NULL, s->o));
    FL_TRY(fl_layer_reduce(s, s->o));
    if (!(skip & FL_SKIP_NORM_ATTN)) FL_TRY(b->ops->add_rmsnorm(b, s->x, s->o, next_norm, L->eps, n, H, s->h));
    return FL_OK;
}
