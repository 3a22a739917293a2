/*
 * cuda_layer.cu — the CUDA backend's decode_layer (kernels/backend.h): the
 * plain layer (kernels/layer.c) with this backend's fusions where they take
 * the weights and pay (cuda_fused.h):
 *  - the stacked q|k|v GEMV rotates q and k and stores K/V in its epilogue
 *    (fl_cuda_matmul_rope_kv);
 *  - gate|up and SiLU in one pass (fl_cuda_gate_up_silu);
 *  - a residual add + RMSNorm deferred into the GEMVs around it
 *    (fl_rms_defer): the o GEMV adds into x and leaves h unnormalized for
 *    gate|up, the down GEMV for the next layer's q|k|v, which scale by
 *    1 / rms in their epilogues; between two calls h is then in that form
 *    (FL_LAYER_H_BACKEND), its partials' layout in fl_cuda.layer_rd_slots.
 * Each choice depends only on the weights and the token count, so a step
 * captured as a CUDA graph replays it. Deferred norms need the whole layer
 * on this rank (no reduction between a GEMV and its add) and no skipped
 * stages.
 */
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/layer.h"

/* Whether L's q|k|v is one fl_cuda_matmul_rope_kv at n tokens. */
static bool qkv_fused(fl_backend *b, const fl_layer_desc *L, int n) {
    return L->wqkv && !L->q_norm &&
           n <= fl_cuda_matmul_rope_kv_max_n(b, L->wqkv, L->head_dim, L->rot_dim, L->rope_interleaved);
}

/* Whether the add + norm after the GEMV w can be deferred at this step. */
static bool defer_from(fl_backend *b, const fl_layer_step *s, const fl_tensor *w) {
    return !s->reduce && !s->skip && s->ws && s->n <= FL_RMS_DEFER_MAX_N &&
           s->n <= fl_cuda_matmul_add_rms_max_n(b, w);
}

extern "C" fl_status fl_cuda_decode_layer(fl_backend *b, const fl_layer_desc *L, const fl_layer_desc *next,
                                          const fl_tensor *next_norm, const fl_layer_step *s, int *h_state) {
    fl_cuda *c = cuda_impl(b);
    const int n = s->n, H = s->hidden, hd = L->head_dim;
    const int qd = L->n_heads * hd, kvd = L->n_kv_heads * hd;
    const unsigned skip = s->skip;
    const fl_tensor *g = L->gate_up ? L->gate_up : L->gate, *u = L->gate_up ? NULL : L->up;
    if (*h_state == FL_LAYER_H_NONE) FL_TRY(fl_cuda_rmsnorm(b, s->x, L->attn_norm, L->eps, n, H, s->h));
    fl_rms_defer rd = {(float *)s->ws, c->layer_rd_slots, L->eps};
    const bool in_deferred = *h_state == FL_LAYER_H_BACKEND;
    int q_stride = qd;
    if (in_deferred && ((skip & FL_SKIP_QKV) || !qkv_fused(b, L, n)))
        return FL_ERR(FL_ERR_INVALID_ARG, "decode_layer: a deferred norm into a q|k|v projection it does not fuse");
    if (skip & FL_SKIP_QKV) {
    } else if (qkv_fused(b, L, n)) { /* all three in one launch: the GEMV's epilogue rotates and stores */
        q_stride = qd + 2 * kvd;
        FL_TRY(fl_cuda_matmul_rope_kv(b, s->h, n, L->wqkv, L->bqkv, s->q, L->n_heads, L->n_kv_heads, hd, s->cos,
                                      s->sin, s->slots, L->k_cache, L->v_cache, in_deferred ? &rd : NULL));
    } else {
        FL_TRY(fl_layer_qkv(b, L, s, &q_stride));
    }
    if (!(skip & FL_SKIP_ATTN))
        FL_TRY(fl_cuda_attention(b, s->q, q_stride, s->meta, L->n_heads, L->n_kv_heads, hd, L->attn_scale,
                                 L->k_cache, L->v_cache, s->attn));
    const bool glu = L->down && !(skip & FL_SKIP_GATE_UP) && n <= fl_cuda_gate_up_silu_max_n(b, g, u);
    const bool mlp_defer = glu && defer_from(b, s, L->wo) && fl_cuda_rms_defer_pays(b, FL_RMS_DEFER_GATE_UP, g, u, n, 0);
    if (mlp_defer) { /* x += o, h = x * mlp_norm unnormalized: gate|up scales */
        rd = (fl_rms_defer){(float *)s->ws, 0, L->eps};
        FL_TRY(fl_cuda_matmul_add_rms(b, s->attn, n, L->wo, L->bo, s->x, L->mlp_norm, s->h, &rd));
    } else {
        if (!(skip & FL_SKIP_O)) FL_TRY(fl_cuda_matmul(b, s->attn, n, L->wo, L->bo, s->o));
        FL_TRY(fl_layer_reduce(s, s->o));
        if (!(skip & FL_SKIP_NORM_MLP)) FL_TRY(fl_cuda_add_rmsnorm(b, s->x, s->o, L->mlp_norm, L->eps, n, H, s->h));
    }
    *h_state = FL_LAYER_H_NORMED;
    if (!L->down) return FL_OK; /* the caller's MoE block reads h */
    if (glu)
        FL_TRY(fl_cuda_gate_up_silu(b, s->h, n, g, u, s->act, mlp_defer ? &rd : NULL));
    else if (!(skip & FL_SKIP_GATE_UP))
        FL_TRY(fl_layer_gate_up(b, L, s, s->h));
    const bool next_defer = next && !(skip & FL_SKIP_NORM_ATTN) && qkv_fused(b, next, n) &&
                            defer_from(b, s, L->down) &&
                            fl_cuda_rms_defer_pays(b, FL_RMS_DEFER_QKV, next->wqkv, NULL, n, next->head_dim);
    if (next_defer) { /* into the next layer's q|k|v */
        rd = (fl_rms_defer){(float *)s->ws, 0, next->eps};
        FL_TRY(fl_cuda_matmul_add_rms(b, s->act, n, L->down, NULL, s->x, next_norm, s->h, &rd));
        c->layer_rd_slots = rd.slots;
        *h_state = FL_LAYER_H_BACKEND;
        return FL_OK;
    }
    if (!(skip & FL_SKIP_DOWN)) FL_TRY(fl_cuda_matmul(b, s->act, n, L->down, NULL, s->o));
    FL_TRY(fl_layer_reduce(s, s->o));
    if (!(skip & FL_SKIP_NORM_ATTN)) FL_TRY(fl_cuda_add_rmsnorm(b, s->x, s->o, next_norm, L->eps, n, H, s->h));
    return FL_OK;
}
