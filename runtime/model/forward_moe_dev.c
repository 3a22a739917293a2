/*
 * forward_moe_dev.c — the routed experts of a MoE layer with the routing
 * kept on the device (dp = 1: every rank holds every token).
 *
 * Why. The host-routed path (forward_moe.c, local_experts) downloads the
 * router's top-k every MoE layer to sort the (token, expert) pairs and
 * launch one MLP per active expert: a host sync per layer, so a decode step
 * cannot be a CUDA graph and the GPU idles while the host sorts (measured:
 * Mixtral w4 batch 1 at 29 % of the copy ceiling, Qwen3-30B-A3B at 4 %).
 * Here the same work is a fixed sequence of launches whose sizes depend only
 * on the row count:
 *   router matmul -> moe_topk (ids, weights) -> moe_group (pairs by local
 *   expert) -> moe_gate_up_silu over the pairs (gate|up and SiLU; the
 *   backend fuses what it can) -> moe_matmul down -> moe_combine into
 *   moe_acc (written, not added: no memset first).
 * Each moe_matmul reads only the experts that have pairs (CUDA: its blocks
 * walk the active experts' items), so the bytes read are the active
 * experts' as before, and decode steps of MoE models can be recorded as
 * graphs (forward_graph.c).
 *
 * Same numbers as the host path: every pair's row of each matmul is the row
 * the gathered-batch matmul gives (rows are independent), and moe_combine
 * adds a token's experts in ascending expert order, rounding after each add
 * as the one-expert-at-a-time scatter_add_rows does; on the CPU backend the
 * two paths are bitwise equal (tests/test_moe_dev.sh checks it).
 *
 * Used when the backend has these ops, every MoE layer's experts are of
 * a dtype and layout its moe_matmul runs (checked once at init with n = 0),
 * and the step has at most max_n rows
 * (FL_MOE_DEVICE_MAX_N, default 64: decode batches; prefill's long rows go
 * through the host path, whose per-expert GEMMs are compute bound anyway).
 * FL_MOE_DEVICE=0 turns it off. The dp > 1 all-to-all keeps the host path
 * (its counts travel between ranks).
 *
 * Each MoE layer groups into its own list, so after the step every layer's
 * per-expert offsets are still there: fl_forward_moe_dev_collect counts the
 * distinct experts each layer read (bench's bytes) without a sync inside
 * the step, graph replays included.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "runtime/model/forward_impl.h"

/* One MoE layer's expert tables: n_local fl_tensor descriptors each, in
 * backend memory (the backend's moe_matmul reads the weight pointers from
 * them on the device). gate_up when fused at load, else gate and up. */
typedef struct moe_tables {
    fl_tensor *gate, *up, *gate_up, *down;
} moe_tables;

struct fl_moe_dev {
    int max_n;           /* rows per step at most */
    int n_layers;
    moe_tables *tab;     /* [n_layers]; zeroed for dense layers */
    void *gu;            /* [max_n k, 2 inter]: gate|up rows, or gate rows then up rows */
    void *act;           /* [max_n k, inter] */
    void *out;           /* [max_n k, hidden] */
    int32_t *list;       /* [n_layers][list_stride] (moe_group): a list per layer, so each
                            layer's grouping is still there when the step has run */
    size_t list_stride;  /* n_local + 1 + max_n k */
    int32_t *h_list;     /* the lists on the host (counting the experts read; NULL until then) */
    bool pending;        /* this step ran the layers here: its lists are to be counted */
};

/* Rows of a device-routed step at most: decode batches (the launches are
 * sized by the rows; moe_combine takes up to 65535). */
enum { MAX_ROWS = 4096 };

/* Uploads the descriptors of one weight of every local expert (at byte
 * stride `stride` from w0) as a table in backend memory. */
static fl_status upload_table(fl_backend *be, const fl_mlp_weights *experts, size_t off, int n_local,
                              fl_tensor **out) {
    fl_tensor *h = malloc((size_t)n_local * sizeof *h);
    if (!h) return FL_ERR(FL_ERR_OOM, "out of memory for a MoE expert table");
    for (int j = 0; j < n_local; j++) h[j] = *(const fl_tensor *)((const char *)&experts[j] + off);
    fl_status st = be->ops->alloc(be, (size_t)n_local * sizeof *h, (void **)out);
    if (st == FL_OK) st = be->ops->upload(be, *out, h, (size_t)n_local * sizeof *h);
    free(h);
    return st;
}

/* Whether the backend's moe_matmul runs every local expert weight at `off`
 * of layer w (same shape and dtype as the first, a layout it supports). */
static bool weight_ok(fl_backend *be, const fl_layer_weights *w, size_t off, int n_local) {
    const fl_tensor *w0 = (const fl_tensor *)((const char *)&w->experts[0] + off);
    if (!w0->data) return false;
    for (int j = 1; j < n_local; j++) {
        const fl_tensor *t = (const fl_tensor *)((const char *)&w->experts[j] + off);
        if (t->dtype != w0->dtype || t->shape[0] != w0->shape[0] || t->shape[1] != w0->shape[1] ||
            t->group != w0->group)
            return false;
    }
    if (be->ops->moe_matmul(be, NULL, 0, 0, 1, NULL, n_local, NULL, w0, NULL) != FL_OK) {
        fl_error_clear(); /* a probe: this layout stays on the host path */
        return false;
    }
    return true;
}

void fl_forward_moe_dev_free(fl_forward *f) {
    if (!f || !f->moe_dev) return;
    struct fl_moe_dev *d = f->moe_dev;
    fl_backend *be = f->m->be;
    for (int l = 0; l < d->n_layers && d->tab; l++) {
        fl_tensor *t[] = {d->tab[l].gate, d->tab[l].up, d->tab[l].gate_up, d->tab[l].down};
        for (int i = 0; i < 4; i++)
            if (t[i]) be->ops->free(be, t[i]);
    }
    void *bufs[] = {d->gu, d->act, d->out, d->list};
    for (int i = 0; i < 4; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    free(d->tab);
    free(d->h_list);
    free(d);
    f->moe_dev = NULL;
}

fl_status fl_forward_moe_dev_init(fl_forward *f) {
    fl_status st = FL_OK;
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int n_local = f->m->dims.n_experts, K = c->n_experts_per_tok, H = c->hidden_size;
    const int inter = f->m->dims.moe_inter;
    if (!c->n_experts || n_local <= 0) return FL_OK;
    if (!be->ops->moe_group || !be->ops->moe_matmul || !be->ops->moe_gate_up_silu || !be->ops->moe_combine)
        return FL_OK;
    if (!fl_opt_bool(FL_OPT_MOE_DEVICE)) return FL_OK;
    const long max_rows = fl_opt_int(FL_OPT_MOE_DEVICE_MAX_N);
    if (max_rows < 0 || max_rows > MAX_ROWS)
        return FL_ERR(FL_ERR_INVALID_ARG, "FL_MOE_DEVICE_MAX_N=%ld: expected a row count from 0 to %d",
                      max_rows, MAX_ROWS);
    int max_n = (int)max_rows;
    /* what every backend's ops take (kernels/cuda/cuda_moe.cu: top-k up to
     * 64, up to 8192 local experts); larger models stay on the host path */
    if (K > 64 || n_local > 8192) return FL_OK;
    if (max_n > f->lim.max_tokens) max_n = f->lim.max_tokens;
    if (max_n == 0) return FL_OK;
    const size_t o_gate = offsetof(fl_mlp_weights, gate), o_up = offsetof(fl_mlp_weights, up),
                 o_gu = offsetof(fl_mlp_weights, gate_up), o_down = offsetof(fl_mlp_weights, down);
    for (int l = 0; l < c->n_layers; l++) {
        const fl_layer_weights *w = &f->m->layers[l];
        if (!w->is_moe) continue;
        const bool fused = w->experts[0].gate_up.data != NULL;
        if (!weight_ok(be, w, o_down, n_local)) return FL_OK;
        if (fused ? !weight_ok(be, w, o_gu, n_local)
                  : !weight_ok(be, w, o_gate, n_local) || !weight_ok(be, w, o_up, n_local))
            return FL_OK;
    }
    struct fl_moe_dev *d = calloc(1, sizeof *d);
    if (!d) return FL_ERR(FL_ERR_OOM, "out of memory for the device MoE routing");
    f->moe_dev = d;
    d->max_n = max_n;
    d->n_layers = c->n_layers;
    d->tab = calloc((size_t)c->n_layers, sizeof *d->tab);
    FL_CHECK_ALLOC(d->tab, st, fail);
    for (int l = 0; l < c->n_layers; l++) {
        const fl_layer_weights *w = &f->m->layers[l];
        if (!w->is_moe) continue;
        moe_tables *t = &d->tab[l];
        if (w->experts[0].gate_up.data) {
            FL_TRY_GOTO(upload_table(be, w->experts, o_gu, n_local, &t->gate_up), st, fail);
        } else {
            FL_TRY_GOTO(upload_table(be, w->experts, o_gate, n_local, &t->gate), st, fail);
            FL_TRY_GOTO(upload_table(be, w->experts, o_up, n_local, &t->up), st, fail);
        }
        FL_TRY_GOTO(upload_table(be, w->experts, o_down, n_local, &t->down), st, fail);
    }
    const size_t P = (size_t)max_n * K;
    FL_TRY_GOTO(be->ops->alloc(be, fl_backend_act_bytes(be, P * 2 * inter), &d->gu), st, fail);
    FL_TRY_GOTO(be->ops->alloc(be, fl_backend_act_bytes(be, P * inter), &d->act), st, fail);
    FL_TRY_GOTO(be->ops->alloc(be, fl_backend_act_bytes(be, P * H), &d->out), st, fail);
    d->list_stride = (size_t)n_local + 1 + P;
    FL_TRY_GOTO(be->ops->alloc(be, (size_t)c->n_layers * d->list_stride * sizeof(int32_t), (void **)&d->list), st,
                fail);
    /* rows of pairs routed to other ranks are never written, but silu_mul
     * runs over them: start them at zero rather than whatever was there */
    FL_TRY_GOTO(be->ops->memset0(be, d->gu, fl_backend_act_bytes(be, P * 2 * inter)), st, fail);
    return FL_OK;
fail:
    fl_forward_moe_dev_free(f);
    return st;
}

bool fl_forward_moe_dev_covers(const fl_forward *f, int n) {
    return f->moe_dev && !f->a2a && n <= f->moe_dev->max_n;
}

int fl_forward_moe_dev_max_n(const fl_forward *f) { return f->moe_dev ? f->moe_dev->max_n : 0; }

fl_status fl_forward_moe_dev_experts(fl_forward *f, const fl_layer_weights *w, int n, bool combine) {
    struct fl_moe_dev *d = f->moe_dev;
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok, H = c->hidden_size;
    const int e_lo = f->m->dims.expert_lo, n_local = f->m->dims.n_experts;
    const fl_moe_route r = fl_forward_moe_route(c);
    const int layer = (int)(w - f->m->layers);
    const moe_tables *t = &d->tab[layer];
    int32_t *list = d->list + (size_t)layer * d->list_stride;
    FL_TRY(be->ops->matmul(be, f->h, n, &w->router, NULL, f->router));
    FL_TRY(be->ops->moe_topk(be, f->router, n, E, K, &r, f->d_moe_ids, f->d_moe_w));
    FL_TRY(be->ops->moe_group(be, f->d_moe_ids, n, K, e_lo, n_local, list));
    d->pending = true;
    FL_TRY(be->ops->moe_gate_up_silu(be, f->h, n, K, list, n_local, t->gate_up ? t->gate_up : t->gate, t->up,
                                     t->gate_up ? &w->experts[0].gate_up : &w->experts[0].gate,
                                     t->gate_up ? NULL : &w->experts[0].up, d->gu, d->act));
    FL_TRY(be->ops->moe_matmul(be, d->act, 1, n, K, list, n_local, t->down, &w->experts[0].down, d->out));
    if (!combine) return FL_OK;
    return be->ops->moe_combine(be, f->moe_acc, d->out, f->d_moe_ids, f->d_moe_w, n, K, e_lo, n_local, H);
}

fl_status fl_forward_moe_dev_combine_norm(fl_forward *f, int n, const void *extra, const fl_tensor *norm) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    return be->ops->moe_combine_add_rmsnorm(be, f->moe_acc, f->moe_dev->out, f->d_moe_ids, f->d_moe_w, n,
                                            c->n_experts_per_tok, f->m->dims.expert_lo, f->m->dims.n_experts,
                                            c->hidden_size, extra, f->x, norm, c->rms_norm_eps, f->h);
}

void fl_forward_moe_dev_replayed(fl_forward *f) {
    if (f->moe_dev) f->moe_dev->pending = true;
}

fl_status fl_forward_moe_dev_collect(fl_forward *f) {
    struct fl_moe_dev *d = f->moe_dev;
    if (!d || !d->pending) return FL_OK;
    d->pending = false;
    if (!f->moe_count) return FL_OK;
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int n_local = f->m->dims.n_experts;
    /* Backend memory is host memory on the CPU backend: the lists are read
     * in place for nothing. Elsewhere only when asked (count_experts): one
     * download of every layer's list after the step's sync (asked on the
     * CPU, the same download, a copy there). */
    const bool in_place = !strcmp(be->name, "cpu") && !f->cfg.count_experts;
    if (!in_place && !f->cfg.count_experts) {
        for (int l = 0; l < c->n_layers; l++)
            if (f->m->layers[l].is_moe) fl_forward_moe_count_experts(f, -1);
        return FL_OK;
    }
    const size_t words = (size_t)c->n_layers * d->list_stride;
    const int32_t *lists = d->list;
    if (!in_place) {
        if (!d->h_list) d->h_list = malloc(words * sizeof(int32_t));
        if (!d->h_list) return FL_ERR(FL_ERR_OOM, "out of memory for the MoE expert counts");
        FL_TRY(be->ops->download(be, d->h_list, d->list, words * sizeof(int32_t)));
        lists = d->h_list;
    }
    for (int l = 0; l < c->n_layers; l++) {
        if (!f->m->layers[l].is_moe) continue;
        const int32_t *start = lists + (size_t)l * d->list_stride; /* where local expert j's pairs begin */
        int distinct = 0;
        for (int j = 0; j < n_local; j++) distinct += start[j + 1] > start[j];
        fl_forward_moe_count_experts(f, distinct);
    }
    return FL_OK;
}
