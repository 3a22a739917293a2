/*
 * model_reads.c — what one decode step of a loaded model reads from its
 * weights (model.h, fl_model_step_reads): every layer tensor once, the
 * routed experts in proportion to those a step uses, lm_head and the final
 * norm; the embedding is a lookup of a few rows and is left out.
 */
#include "runtime/model/model.h"

/* One tensor as the backend holds it: its rows of its dtype, plus a scale and
 * a bias per group for W4 (a scale a row for FP8); empty tensors (fused-away parts) count nothing. */
static void add_tensor(const fl_tensor *t, double w4_group_bytes, double weight, fl_model_step_reads *r) {
    if (!t || t->ndim < 1 || !t->data) return;
    const int64_t cols = t->shape[t->ndim - 1], rows = fl_tensor_numel(t) / (cols ? cols : 1);
    double b = (double)rows * (double)fl_dtype_row_bytes(t->dtype, cols);
    if (t->dtype == FL_DTYPE_W4 && t->group > 0) b += (double)rows * (double)(cols / t->group) * w4_group_bytes;
    if (t->dtype == FL_DTYPE_F8_E4M3 && t->scales) b += (double)rows * 4; /* an FP8 linear's f32 scales */
    r->bytes += weight * b;
    r->params += weight * (double)rows * (double)cols;
}

static void add_mlp(const fl_mlp_weights *w, double g, double weight, fl_model_step_reads *r) {
    add_tensor(&w->gate, g, weight, r);
    add_tensor(&w->up, g, weight, r);
    add_tensor(&w->gate_up, g, weight, r);
    add_tensor(&w->down, g, weight, r);
}

fl_status fl_model_step_reads_count(const fl_model *m, double w4_group_bytes, double active_experts,
                                    fl_model_step_reads *out) {
    if (!m || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_model_step_reads_count: NULL argument");
    fl_model_step_reads r = {0};
    const double g = w4_group_bytes;
    const int n_local = m->dims.n_experts;
    /* the routed experts: each local one weighs the share of them a step reads */
    const double ew = n_local > 0 ? (active_experts < n_local ? active_experts : n_local) / n_local : 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const fl_layer_weights *w = &m->layers[l];
        const fl_tensor *ts[] = {&w->attn_norm, &w->wq,      &w->wk,       &w->wv,        &w->wo,
                                 &w->bq,        &w->bk,      &w->bv,       &w->bo,        &w->wqkv,
                                 &w->bqkv,      &w->q_norm,  &w->k_norm,   &w->wq_a,      &w->q_a_norm,
                                 &w->wq_b,      &w->bq_a,    &w->wkv_a,    &w->bkv_a,     &w->kv_a_norm,
                                 &w->wkv_b,     &w->mlp_norm};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) add_tensor(ts[i], g, 1, &r);
        if (!w->is_moe) {
            add_mlp(&w->mlp, g, 1, &r);
            continue;
        }
        add_tensor(&w->router, g, 1, &r);
        if (w->experts)
            for (int e = 0; e < n_local; e++) add_mlp(&w->experts[e], g, ew, &r);
        if (w->has_shared) add_mlp(&w->shared, g, 1, &r);
        add_tensor(&w->shared_gate, g, 1, &r);
    }
    r.layer_params = r.params;
    add_tensor(&m->lm_head, g, 1, &r);
    add_tensor(&m->final_norm, g, 1, &r);
    *out = r;
    return FL_OK;
}
