/*
 * forward_moe.c — the Mixture-of-Experts block of the forward pass.
 *
 * Generic path for every backend: the router's top-k is brought to the host
 * (softmax top-k for Mixtral/Qwen, DeepSeek's greedy or group-limited
 * routing with its scaling), the routed (token, expert) pairs are sorted by
 * expert, and each of this rank's active experts runs one MLP over exactly
 * its tokens (gather -> MLP -> weighted scatter-add). Only active experts'
 * weights are read. A backend with a fused grouped GEMM can replace this
 * without touching the rest of the pass.
 *
 * Two exchange modes (docs/parallel.md, "Layout" and "Data parallelism"):
 *  - dp = 1: every rank holds every token and a 1/world share of the expert
 *    weights (its ep range, its column slice); partial sums meet in the
 *    block's one all-reduce over the tp group (= the world).
 *  - dp > 1 (f->a2a): replicas hold different tokens, so only the routed
 *    tokens move. Each ep group holds whole experts (n_experts / ep per
 *    rank, all columns). A replica's tp ranks hold the same tokens, so each
 *    dispatches only its 1/tp row slice (fl_moe_row_slice): router top-k on
 *    the slice, counts per destination ep rank exchanged, the rows and their
 *    expert ids sent with all_to_all_v, the local experts run on the received
 *    rows, the results sent back and combined with the router weights into
 *    the slice's rows of moe_acc (zero elsewhere). The block's all-reduce over
 *    the tp group then assembles the slices (and sums the tp-split shared
 *    expert), so no token is counted twice. The activations travel as two
 *    micro-batches (the rows for each rank's first and second half of its
 *    experts): on CUDA with NCCL on its own stream, B's rows travel while
 *    A's experts run and A's results return while B's run, ordered by
 *    events (backend stream_wait) instead of host syncs; on the CPU (MPI)
 *    the same schedule runs in order. moe_overlap (forward_moe.h)
 *    switches it; docs/parallel.md, "MoE overlap". A replica without tokens
 *    still joins every MoE layer's exchange (fl_forward_moe_idle).
 */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/model/forward_graph.h"
#include "runtime/model/forward_impl.h"
#include "runtime/model/forward_moe.h"
#include "runtime/model/moe_dispatch.h"

fl_moe_route fl_forward_moe_route(const fl_model_config *c) {
    fl_moe_route r = {1, 1, false, 1.0f};
    if (c->arch == FL_ARCH_DEEPSEEK_V2) {
        /* DeepseekV2TopkRouter: softmax, group_limited_greedy keeps the
         * topk_group groups with the largest max-p, top-k of what is left;
         * weights renormalized (norm_topk_prob and k > 1) or scaled by
         * routed_scaling_factor */
        if (c->topk_method == FL_TOPK_GROUP_LIMITED && c->n_group > 1) {
            r.n_group = c->n_group;
            r.topk_group = c->topk_group;
        }
        r.renorm = c->norm_topk_prob && c->n_experts_per_tok > 1;
        r.scale = r.renorm ? 1.0f : c->routed_scaling_factor;
    } else {
        r.renorm = c->arch == FL_ARCH_MIXTRAL || c->norm_topk_prob;
    }
    return r;
}

/* Element offset into an activation buffer. */
static void *act_at(const fl_backend *be, void *buf, size_t elems) {
    return (char *)buf + fl_backend_act_bytes(be, elems);
}

/* Router top-k for the m rows of src: ids and weights [m, K] into
 * f->h_moe_ids / f->h_moe_w (host). */
static fl_status route(fl_forward *f, const fl_layer_weights *w, const void *src, int m) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok;
    const fl_moe_route r = fl_forward_moe_route(c);
    FL_TRY(be->ops->matmul(be, src, m, &w->router, NULL, f->router));
    FL_TRY(be->ops->moe_topk(be, f->router, m, E, K, &r, f->d_moe_ids, f->d_moe_w));
    FL_TRY(be->ops->download(be, f->h_moe_ids, f->d_moe_ids, (size_t)m * K * 4));
    return be->ops->download(be, f->h_moe_w, f->d_moe_w, (size_t)m * K * 4);
}

/* dp = 1: this rank's experts (its column slice) over all n rows, added
 * into f->moe_acc (zeroed by the caller). */
static fl_status local_experts(fl_forward *f, const fl_layer_weights *w, int n) {
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok, H = c->hidden_size;
    const int e_lo = f->m->dims.expert_lo, n_local = f->m->dims.n_experts;
    FL_TRY(route(f, w, f->h, n));
    /* Counting sort of (token, expert) pairs by expert. */
    int *cnt = f->h_counts;
    memset(cnt, 0, ((size_t)E + 1) * sizeof(int));
    for (int i = 0; i < n * K; i++) {
        int e = f->h_moe_ids[i];
        if (e < 0 || e >= E) return FL_ERR(FL_ERR_INTERNAL, "router picked expert %d of %d", e, E);
        cnt[e + 1]++;
    }
    for (int e = 0; e < E; e++) cnt[e + 1] += cnt[e];
    for (int i = 0; i < n * K; i++) {
        int e = f->h_moe_ids[i], at = cnt[e]++;
        f->h_moe_idx[at] = i / K;
        f->h_moe_wsorted[at] = f->h_moe_w[i];
    }
    /* cnt[e] is now the end of expert e's range; its start is cnt[e-1]. */
    FL_TRY(be->ops->upload(be, f->d_moe_idx, f->h_moe_idx, (size_t)n * K * 4));
    FL_TRY(be->ops->upload(be, f->d_moe_wsorted, f->h_moe_wsorted, (size_t)n * K * 4));
    /* This rank runs its own experts only; the reduction adds the rest. */
    int distinct = 0;
    for (int e = e_lo; e < e_lo + n_local; e++)
        distinct += cnt[e] > (e ? cnt[e - 1] : 0);
    fl_forward_moe_count_experts(f, distinct);
    for (int e = e_lo; e < e_lo + n_local; e++) {
        int lo = e ? cnt[e - 1] : 0, ne = cnt[e] - lo;
        if (ne == 0) continue;
        FL_TRY(be->ops->gather_rows(be, f->h, f->d_moe_idx + lo, ne, H, f->moe_in));
        FL_TRY(fl_forward_mlp(f, &w->experts[e - e_lo], f->moe_in, ne, f->moe_out));
        FL_TRY(be->ops->scatter_add_rows(be, f->moe_acc, f->moe_out, f->d_moe_idx + lo,
                                         f->d_moe_wsorted + lo, ne, H));
    }
    return FL_OK;
}

/* ---- dp > 1: the all-to-all exchange ----------------------------------- */

/* The exchange of one MoE layer runs whole (moe_overlap off) or as n
 * micro-batches (moe_micro_batches, default 2): with two, A is the routed
 * rows for the first half of each ep rank's experts and B those for the
 * rest (n: consecutive ranges of local experts). The sender's slots are
 * sorted by expert (moe_dispatch.h), so each destination's part is A's rows
 * then B's, and the micro-batches are windows of the same send,
 * receive, result and return buffers at the same offsets as the whole
 * exchange: every expert sees exactly the rows, in the same order, it sees
 * without the split, the combine is unchanged, and the results are bitwise
 * those of one exchange on every backend. Splitting by expert rather than by
 * token also reads each expert's weights once per layer, as without the
 * split (a token split would run every active expert twice). */
enum { MAX_PARTS = FL_MOE_MICRO_BATCHES_MAX }; /* moe_micro_batches at most */

typedef struct fl_moe_a2a fl_moe_a2a;
struct fl_moe_a2a {
    fl_comm *ep;
    int P;                      /* ep group size */
    bool host_ids;              /* MPI: expert ids travel in host arrays */
    int mode;                   /* fl_moe_overlap, as agreed by the group */
    int n_moe_layers;           /* exchanges per step (alternate mode's period) */
    long calls;                 /* exchanges so far: the same count on every ep rank */
    int n_parts;                /* micro-batches when split (moe_micro_batches, <= n_local) */
    int jb[MAX_PARTS + 1];      /* micro-batch k: local experts [jb[k], jb[k + 1]) of each rank */
    int *part_of;               /* [n_local]: the micro-batch of each local expert */
    size_t *soff, *roff;        /* [(MAX_PARTS + 1) * P]: micro-batch k's rows for rank p start
                                   soff[k * P + p] rows into p's part sent (roff: received) */
    bool can_events;            /* NCCL on its own stream and a backend with stream_wait */
    /* this layer's exchange (a2a_rows sets them from mode) */
    int n_mb;                   /* exchanges each way: 1 (off) or n_parts */
    bool events;                /* the micro-batches are ordered by events, not host syncs */
    void *comm_stream;          /* the ep communicator's stream (events mode) */
    size_t max_send, max_recv;  /* rows */
    void *send, *recv, *res, *back; /* activations: [max_send, H], [max_recv, H] x 2, [max_send, H] */
    int32_t *d_slot_row, *d_order, *d_ids_send, *d_ids_recv;
    float *d_slot_w, *d_ones;
    int32_t *slot_row, *slot_expert, *recv_expert, *order, *expert_start, *expert_end;
    float *slot_w, *ones;
    size_t *cnt;                /* [8][P]: rows sent/received and their displacements, then
                                   the same in elements for one call */
};

static fl_moe_exchange_stats g_moe_totals;

void fl_forward_moe_totals(fl_moe_exchange_stats *out) { *out = g_moe_totals; }

static fl_moe_expert_reads g_reads;

void fl_forward_moe_expert_reads(fl_moe_expert_reads *out) { *out = g_reads; }

void fl_forward_moe_count_experts(const fl_forward *f, int distinct) {
    if (!f->moe_count) return;
    g_reads.layers++;
    if (distinct >= 0) g_reads.counted++, g_reads.experts += distinct;
}

void fl_forward_moe_totals_reset(void) {
    memset(&g_reads, 0, sizeof g_reads);
    g_moe_totals.layers = g_moe_totals.timed_layers = 0;
    g_moe_totals.act_s = g_moe_totals.ctrl_s = g_moe_totals.act_bytes = 0;
}

const char *fl_moe_overlap_name(int mode) {
    switch (mode) {
    case FL_MOE_OVERLAP_OFF: return "off";
    case FL_MOE_OVERLAP_ON: return "on";
    case FL_MOE_OVERLAP_SERIAL: return "serial";
    case FL_MOE_OVERLAP_ALTERNATE: return "alternate";
    default: return "?";
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The forward's moe_overlap and moe_micro_batches (forward_moe.h), checked.
 * Off by default: on 2 H200s the overlap hid part of the exchange at batch
 * 64 but cost more of the step than that at batch 256 (Mixtral,
 * Qwen3-30B-A3B). */
static fl_status overlap_settings(const fl_forward *f, int *mode, int *parts) {
    *mode = f->cfg.moe_overlap;
    *parts = f->cfg.moe_micro_batches;
    if (*mode < FL_MOE_OVERLAP_OFF || *mode > FL_MOE_OVERLAP_ALTERNATE)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_overlap must be 0 (off), 1 (on), 2 (serial) or 3 "
                      "(alternate), got %d", *mode);
    if (*parts < 2 || *parts > MAX_PARTS)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_micro_batches must be 2 to %d, got %d", MAX_PARTS, *parts);
    return FL_OK;
}

fl_status fl_forward_moe_enable_a2a(fl_forward *f, fl_comm *ep) {
    fl_status st = FL_OK;
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const fl_model_dims *d = &f->m->dims;
    if (!c->n_experts || !ep) return FL_OK;
    const int P = fl_comm_size(ep), E = c->n_experts, K = c->n_experts_per_tok, H = c->hidden_size;
    if (f->m->shard.ex_size > 1 || d->moe_inter_lo != 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "the MoE all-to-all needs whole experts on each rank, but "
                      "expert columns are split %d ways", f->m->shard.ex_size);
    if (E % P || d->n_experts != E / P || d->expert_lo != fl_comm_rank(ep) * (E / P))
        return FL_ERR(FL_ERR_INVALID_ARG, "ep rank %d of %d should hold experts %d..%d of %d, but "
                      "holds %d from %d", fl_comm_rank(ep), P, fl_comm_rank(ep) * (E / P),
                      (fl_comm_rank(ep) + 1) * (E / P) - 1, E, d->n_experts, d->expert_lo);
    /* Every rank of the ep group asks (collective), whatever its own answer:
     * one exchange on any rank means one on all, since the number of
     * exchanges per layer must match. A bad value fails every rank alike. */
    int mode = FL_MOE_OVERLAP_ON, parts = 2;
    fl_status cfg_st = overlap_settings(f, &mode, &parts);
    bool all_ok = true;
    FL_TRY(fl_comm_agree(ep, cfg_st == FL_OK, &all_ok));
    if (cfg_st != FL_OK) return cfg_st;
    if (!all_ok) return FL_ERR(FL_ERR_INVALID_ARG, "moe_overlap or moe_micro_batches is invalid "
                               "on another rank of the expert-parallel group");
    /* the group's micro-batch count: the smallest asked for, and at most one
     * per local expert (the same on every rank: E / P) */
    int n_parts = 1;
    for (int k = 2; k <= MAX_PARTS; k++) {
        bool all_k = true;
        FL_TRY(fl_comm_agree(ep, parts >= k, &all_k));
        if (all_k) n_parts = k;
    }
    if (n_parts > d->n_experts) n_parts = d->n_experts;
    bool all_split = true, all_alt = true;
    FL_TRY(fl_comm_agree(ep, mode != FL_MOE_OVERLAP_OFF, &all_split));
    FL_TRY(fl_comm_agree(ep, mode == FL_MOE_OVERLAP_ALTERNATE, &all_alt));
    if (!all_split) mode = FL_MOE_OVERLAP_OFF;
    else if (mode == FL_MOE_OVERLAP_ALTERNATE && !all_alt) mode = FL_MOE_OVERLAP_ON;

    fl_moe_a2a *a = calloc(1, sizeof *a);
    if (!a) return FL_ERR(FL_ERR_OOM, "out of memory");
    f->a2a = a;
    /* the exchange's counts travel through the host: no device routing, no
     * graphs (every rank of the group enables it, so all agree) */
    fl_forward_moe_dev_free(f);
    fl_forward_graph_forbid(f, "the MoE all-to-all exchanges its counts through the host");
    a->ep = ep;
    a->P = P;
    a->host_ids = fl_comm_backend_of(ep) == FL_COMM_BACKEND_MPI;
    a->mode = mode;
    for (int l = 0; l < c->n_layers; l++) a->n_moe_layers += f->m->layers[l].is_moe;
    if (a->n_moe_layers < 1) a->n_moe_layers = 1;
    /* micro-batch k: local experts [jb[k], jb[k + 1]), as even as they divide;
     * with one local expert there is nothing to split (one exchange) */
    a->n_parts = n_parts;
    for (int k = 0; k <= n_parts; k++) a->jb[k] = (k * d->n_experts + n_parts - 1) / n_parts;
    /* Events only help when the exchange runs beside the compute: NCCL on a
     * stream of its own (an ep communicator put on the compute stream is
     * ordered with it already, and MPI blocks). */
    a->comm_stream = fl_comm_stream(ep);
    a->can_events = !a->host_ids && be->ops->stream_wait && a->comm_stream;
    const int tp = f->comm ? fl_comm_size(f->comm) : 1;
    /* a tp rank dispatches at most ceil(max_tokens / tp) rows, each to K experts */
    a->max_send = (size_t)((f->lim.max_tokens + tp - 1) / tp) * K;
    a->max_recv = a->max_send * P;
    const size_t Hs = (size_t)H;
    /* max_send >= K >= 1: no zero-sized buffers */
#define ACT(ptr, n) FL_TRY_GOTO(be->ops->alloc(be, fl_backend_act_bytes(be, n), &(ptr)), st, fail)
#define RAW(ptr, n) FL_TRY_GOTO(be->ops->alloc(be, (size_t)(n) * 4, (void **)&(ptr)), st, fail)
    ACT(a->send, a->max_send * Hs);
    ACT(a->back, a->max_send * Hs);
    ACT(a->recv, a->max_recv * Hs);
    ACT(a->res, a->max_recv * Hs);
    RAW(a->d_slot_row, a->max_send);
    RAW(a->d_slot_w, a->max_send);
    RAW(a->d_order, a->max_recv);
    RAW(a->d_ones, a->max_recv);
    if (!a->host_ids) {
        RAW(a->d_ids_send, a->max_send);
        RAW(a->d_ids_recv, a->max_recv);
    }
#undef ACT
#undef RAW
    a->slot_row = malloc(a->max_send * sizeof(int32_t) + 4);
    a->slot_expert = malloc(a->max_send * sizeof(int32_t) + 4);
    a->slot_w = malloc(a->max_send * sizeof(float) + 4);
    a->recv_expert = malloc(a->max_recv * sizeof(int32_t) + 4);
    a->order = malloc(a->max_recv * sizeof(int32_t) + 4);
    a->ones = malloc(a->max_recv * sizeof(float) + 4);
    a->expert_start = malloc(((size_t)d->n_experts + 1) * sizeof(int32_t));
    a->expert_end = malloc(((size_t)E + 1) * sizeof(int32_t));
    a->cnt = calloc(8 * (size_t)P, sizeof *a->cnt);
    a->soff = calloc((MAX_PARTS + 1) * (size_t)P, sizeof *a->soff);
    a->roff = calloc((MAX_PARTS + 1) * (size_t)P, sizeof *a->roff);
    a->part_of = malloc((size_t)d->n_experts * sizeof *a->part_of);
    FL_CHECK_ALLOC(a->slot_row, st, fail);
    FL_CHECK_ALLOC(a->slot_expert, st, fail);
    FL_CHECK_ALLOC(a->slot_w, st, fail);
    FL_CHECK_ALLOC(a->recv_expert, st, fail);
    FL_CHECK_ALLOC(a->order, st, fail);
    FL_CHECK_ALLOC(a->ones, st, fail);
    FL_CHECK_ALLOC(a->expert_start, st, fail);
    FL_CHECK_ALLOC(a->expert_end, st, fail);
    FL_CHECK_ALLOC(a->cnt, st, fail);
    FL_CHECK_ALLOC(a->soff, st, fail);
    FL_CHECK_ALLOC(a->roff, st, fail);
    FL_CHECK_ALLOC(a->part_of, st, fail);
    for (int k = 0; k < n_parts; k++)
        for (int j = a->jb[k]; j < a->jb[k + 1]; j++) a->part_of[j] = k;
    for (size_t i = 0; i < a->max_recv; i++) a->ones[i] = 1.0f;
    FL_TRY_GOTO(be->ops->upload(be, a->d_ones, a->ones, a->max_recv * sizeof(float)), st, fail);
    g_moe_totals.enabled = true;
    g_moe_totals.mode = a->mode;
    g_moe_totals.events = a->can_events && (mode == FL_MOE_OVERLAP_ON || mode == FL_MOE_OVERLAP_ALTERNATE);
    g_moe_totals.micro_batches = mode == FL_MOE_OVERLAP_OFF ? 1 : n_parts;
    return FL_OK;
fail:
    fl_forward_moe_free(f);
    return st;
}

void fl_forward_moe_free(fl_forward *f) {
    if (!f || !f->a2a) return;
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    void *dev[] = {a->send, a->recv, a->res, a->back, a->d_slot_row, a->d_order, a->d_ids_send,
                   a->d_ids_recv, a->d_slot_w, a->d_ones};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->ops->free(be, dev[i]);
    free(a->slot_row);
    free(a->slot_expert);
    free(a->slot_w);
    free(a->recv_expert);
    free(a->order);
    free(a->ones);
    free(a->expert_start);
    free(a->expert_end);
    free(a->cnt);
    free(a->soff);
    free(a->roff);
    free(a->part_of);
    free(a);
    f->a2a = NULL;
}

/* Rows [*off, *off + *n) of the whole exchange's part for rank p (count
 * rows at displ) that micro-batch `part` moves (-1: all of them); off_k:
 * soff or roff. */
static void part_window(const fl_moe_a2a *a, int part, int p, size_t count, size_t displ,
                        const size_t *off_k, size_t *n, size_t *off) {
    if (part < 0) {
        *n = count;
        *off = displ;
        return;
    }
    *n = off_k[(size_t)(part + 1) * a->P + p] - off_k[(size_t)part * a->P + p];
    *off = displ + off_k[(size_t)part * a->P + p];
}

/* The all_to_all_v of one micro-batch's activation rows (part: -1 the whole
 * exchange, else micro-batch `part`): send -> recv, or with `back` the expert results
 * res -> back along the reverse counts. Events mode: only enqueued on the
 * ep stream; the caller fences it against the compute queue both ways
 * (comm_waits_compute / compute_waits_comm). In order (MPI, or NCCL without
 * events): the compute queue is drained, the exchange awaited, and the time
 * of exchange + wait added to the totals. */
static fl_status a2a_act(fl_forward *f, int part, bool back) {
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    const int P = a->P;
    const size_t H = (size_t)f->m->cfg.hidden_size;
    const size_t *sc = a->cnt, *sd = a->cnt + P, *rc = a->cnt + 2 * P, *rd = a->cnt + 3 * P;
    size_t *esc = a->cnt + 4 * P, *esd = a->cnt + 5 * P, *erc = a->cnt + 6 * P, *erd = a->cnt + 7 * P;
    for (int p = 0; p < P; p++) {
        size_t sn, so, rn, ro;
        part_window(a, part, p, sc[p], sd[p], a->soff, &sn, &so);
        part_window(a, part, p, rc[p], rd[p], a->roff, &rn, &ro);
        /* back: the results go where the rows came from */
        esc[p] = (back ? rn : sn) * H;
        esd[p] = (back ? ro : so) * H;
        erc[p] = (back ? sn : rn) * H;
        erd[p] = (back ? so : ro) * H;
    }
    const void *send = back ? a->res : a->send;
    void *recv = back ? a->back : a->recv;
    if (a->events) return fl_comm_all_to_all_v(a->ep, send, esc, esd, recv, erc, erd, f->comm_dt);
    if (!a->host_ids) FL_TRY(be->ops->sync(be));
    const double t0 = now_s();
    FL_TRY(fl_comm_all_to_all_v(a->ep, send, esc, esd, recv, erc, erd, f->comm_dt));
    if (!a->host_ids) FL_TRY(fl_comm_sync(a->ep));
    g_moe_totals.act_s += now_s() - t0;
    for (int p = 0; p < P; p++)
        if (p != fl_comm_rank(a->ep)) g_moe_totals.act_bytes += (double)fl_backend_act_bytes(be, esc[p]);
    return FL_OK;
}

/* Events mode: compute work enqueued later waits for the ep stream's work
 * so far; in order: nothing to do (a2a_act waited). */
static fl_status compute_waits_comm(fl_forward *f) {
    fl_moe_a2a *a = f->a2a;
    if (!a->events) return FL_OK;
    return f->m->be->ops->stream_wait(f->m->be, NULL, a->comm_stream);
}

/* Events mode: exchanges enqueued later wait for the compute queue so far. */
static fl_status comm_waits_compute(fl_forward *f) {
    fl_moe_a2a *a = f->a2a;
    if (!a->events) return FL_OK;
    return f->m->be->ops->stream_wait(f->m->be, a->comm_stream, NULL);
}

/* Where each micro-batch's rows start in each rank's part, both ways. Sent:
 * the slots for ep rank p's local experts [jb[k], jb[k + 1]) follow each
 * other in p's part (slots sorted by expert). Received: the rows of rank p's
 * part grouped the same way by this rank's experts — checked, so a sender
 * breaking the order fails here rather than mixing rows between the
 * micro-batches. */
static fl_status split_counts(fl_forward *f) {
    fl_moe_a2a *a = f->a2a;
    const int P = a->P, per = f->m->cfg.n_experts / P, e_lo = f->m->dims.expert_lo, n = a->n_parts;
    const size_t *sc = a->cnt, *sd = a->cnt + P, *rc = a->cnt + 2 * P, *rd = a->cnt + 3 * P;
    for (int p = 0; p < P; p++) {
        for (int k = 0; k < n; k++) {
            const int e = p * per + a->jb[k]; /* first global expert of micro-batch k on rank p */
            a->soff[(size_t)k * P + p] = (e ? (size_t)a->expert_end[e - 1] : 0) - sd[p];
        }
        a->soff[(size_t)n * P + p] = sc[p];
        int k = 0;
        a->roff[p] = 0;
        for (size_t i = 0; i < rc[p]; i++) {
            const int pk = a->part_of[a->recv_expert[rd[p] + i] - e_lo]; /* ids checked by dispatch_local */
            if (pk < k)
                return FL_ERR(FL_ERR_INTERNAL, "moe dispatch: rows from ep rank %d are not sorted by "
                              "expert (expert %d after %d)", p, a->recv_expert[rd[p] + i],
                              a->recv_expert[rd[p] + i - 1]);
            while (k < pk) a->roff[(size_t)++k * P + p] = i;
        }
        while (k < n) a->roff[(size_t)++k * P + p] = rc[p];
    }
    return FL_OK;
}

/* This rank's local experts [j0, j1) over the rows received for them,
 * results in receive order into a->res (enqueued; the rows must have
 * arrived). */
static fl_status run_experts(fl_forward *f, const fl_layer_weights *w, int j0, int j1) {
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    const int H = f->m->cfg.hidden_size, T = f->lim.max_tokens;
    for (int j = j0; j < j1; j++) {
        /* an expert can receive more rows than one step's buffers hold: chunks of T */
        for (int at = a->expert_start[j]; at < a->expert_start[j + 1]; at += T) {
            int cnt = a->expert_start[j + 1] - at < T ? a->expert_start[j + 1] - at : T;
            FL_TRY(be->ops->gather_rows(be, a->recv, a->d_order + at, cnt, H, f->moe_in));
            FL_TRY(fl_forward_mlp(f, &w->experts[j], f->moe_in, cnt, f->moe_out));
            FL_TRY(be->ops->scatter_add_rows(be, a->res, f->moe_out, a->d_order + at, a->d_ones + at,
                                             cnt, H));
        }
    }
    return FL_OK;
}

/* Dispatch -> local experts -> combine for rows [lo, lo + m) of f->h; the
 * weighted expert outputs are added into the same rows of f->moe_acc. Every
 * rank of the ep group calls it once per MoE layer (m may be 0), and runs
 * the same collectives whatever its m.
 *
 * Host-side parts first (route, plan, count exchange, expert ids), then the
 * activations; with two micro-batches (docs/parallel.md, "MoE overlap"):
 *      ep stream:  send A | send B    | back A    | back B
 *      compute:           | experts A | experts B | combine
 * ordered by events, so B's rows travel while A's experts run and A's
 * results travel back while B's run. Without events (MPI, or
 * FL_MOE_OVERLAP=2) the same calls run in program order. */
static fl_status a2a_rows(fl_forward *f, const fl_layer_weights *w, int lo, int m) {
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok, H = c->hidden_size, P = a->P;
    const int e_lo = f->m->dims.expert_lo, n_local = f->m->dims.n_experts;
    size_t *sc = a->cnt, *sd = a->cnt + P, *rc = a->cnt + 2 * P, *rd = a->cnt + 3 * P;
    const size_t n_send = (size_t)m * K;
    /* this layer's mode: alternate turns with the step (every ep rank makes
     * the same calls, so the turns agree) */
    int mode = a->mode;
    if (mode == FL_MOE_OVERLAP_ALTERNATE)
        mode = (a->calls / a->n_moe_layers) % 2 ? FL_MOE_OVERLAP_ON : FL_MOE_OVERLAP_OFF;
    a->calls++;
    a->n_mb = mode == FL_MOE_OVERLAP_OFF ? 1 : a->n_parts;
    a->events = mode == FL_MOE_OVERLAP_ON && a->can_events;
    g_moe_totals.last_mode = mode;
    if (n_send > a->max_send)
        return FL_ERR(FL_ERR_INTERNAL, "moe dispatch: %zu routed rows exceed the %zu sized for",
                      n_send, a->max_send);
    void *src = act_at(be, f->h, (size_t)lo * H);
    if (m > 0) FL_TRY(route(f, w, src, m));
    FL_TRY(fl_moe_dispatch_plan(m, K, f->h_moe_ids, f->h_moe_w, E, P, a->slot_row, a->slot_expert,
                                a->slot_w, sc, sd, a->expert_end));
    double t0 = now_s();
    FL_TRY(fl_comm_exchange_counts(a->ep, sc, rc));
    g_moe_totals.ctrl_s += now_s() - t0;
    const size_t n_recv = fl_moe_displs(rc, P, rd);
    if (n_recv > a->max_recv)
        return FL_ERR(FL_ERR_INTERNAL, "moe dispatch: %zu rows received exceed the %zu sized for",
                      n_recv, a->max_recv);
    if (n_send) {
        FL_TRY(be->ops->upload(be, a->d_slot_row, a->slot_row, n_send * 4));
        FL_TRY(be->ops->upload(be, a->d_slot_w, a->slot_w, n_send * 4));
        FL_TRY(be->ops->gather_rows(be, src, a->d_slot_row, (int)n_send, H, a->send));
    }
    /* the expert id of every row travels with it */
    if (a->host_ids) {
        t0 = now_s();
        FL_TRY(fl_comm_all_to_all_v(a->ep, a->slot_expert, sc, sd, a->recv_expert, rc, rd, FL_COMM_I32));
    } else {
        if (n_send) FL_TRY(be->ops->upload(be, a->d_ids_send, a->slot_expert, n_send * 4));
        FL_TRY(be->ops->sync(be));
        t0 = now_s();
        FL_TRY(fl_comm_all_to_all_v(a->ep, a->d_ids_send, sc, sd, a->d_ids_recv, rc, rd, FL_COMM_I32));
        FL_TRY(fl_comm_sync(a->ep));
        if (n_recv) FL_TRY(be->ops->download(be, a->recv_expert, a->d_ids_recv, n_recv * 4));
    }
    g_moe_totals.ctrl_s += now_s() - t0;
    /* this rank's experts over what it received, results in receive order */
    FL_TRY(fl_moe_dispatch_local((int)n_recv, a->recv_expert, e_lo, n_local, a->order, a->expert_start));
    if (a->n_mb > 1) FL_TRY(split_counts(f));
    int distinct = 0; /* the local experts that received rows: run_experts reads those */
    for (int j = 0; j < n_local; j++) distinct += a->expert_start[j + 1] > a->expert_start[j];
    fl_forward_moe_count_experts(f, distinct);
    if (n_recv) {
        FL_TRY(be->ops->upload(be, a->d_order, a->order, n_recv * 4));
        FL_TRY(be->ops->memset0(be, a->res, fl_backend_act_bytes(be, n_recv * H)));
    }
    if (a->n_mb == 1) {
        FL_TRY(a2a_act(f, -1, false));
        FL_TRY(run_experts(f, w, 0, n_local));
        FL_TRY(a2a_act(f, -1, true));
    } else {
        /* Each fence orders against everything enqueued on the other stream
         * so far, so the calls' host order places them (two micro-batches):
         * compute   [A arrived] experts A [B arrived] experts B [back] combine
         * ep stream send A, send B [experts A done] back A [experts B done] back B
         * and with n: send k+1 is enqueued right after experts k, back k
         * after it; experts k+1 wait for what the ep stream held then. */
        const int n = a->n_mb;
        FL_TRY(comm_waits_compute(f)); /* the rows were gathered on the compute queue */
        FL_TRY(a2a_act(f, 0, false));
        FL_TRY(compute_waits_comm(f));
        for (int k = 0; k < n; k++) {
            FL_TRY(run_experts(f, w, a->jb[k], a->jb[k + 1]));
            if (k + 1 < n) {
                FL_TRY(a2a_act(f, k + 1, false)); /* travels while experts k run */
                FL_TRY(compute_waits_comm(f));    /* on the compute queue after experts k */
            }
            FL_TRY(comm_waits_compute(f));        /* experts k's results are ready */
            FL_TRY(a2a_act(f, k, true));          /* travel back while experts k + 1 run */
        }
        FL_TRY(compute_waits_comm(f));
    }
    g_moe_totals.layers++;
    if (!a->events) g_moe_totals.timed_layers++;
    /* the weighted combine, one expert at a time (a token appears once per
     * expert), in ascending expert order as on one rank */
    void *acc = act_at(be, f->moe_acc, (size_t)lo * H);
    for (int e = 0; e < E && n_send; e++) {
        int s0 = e ? a->expert_end[e - 1] : 0, ne = a->expert_end[e] - s0;
        if (ne == 0) continue;
        FL_TRY(be->ops->scatter_add_rows(be, acc, act_at(be, a->back, (size_t)s0 * H), a->d_slot_row + s0,
                                         a->d_slot_w + s0, ne, H));
    }
    return FL_OK;
}

fl_status fl_forward_moe_idle(fl_forward *f) {
    if (!f->a2a) return FL_OK;
    f->moe_count = true; /* the replica cannot tell the others' prefill from their decode: counted */
    for (int l = 0; l < f->m->cfg.n_layers; l++)
        if (f->m->layers[l].is_moe) FL_TRY(a2a_rows(f, &f->m->layers[l], 0, 0));
    return f->m->be->ops->sync(f->m->be);
}

/* Routed experts (+ shared expert) for n rows of normed input f->h; the
 * reduced result is left in f->moe_acc for the caller's fused residual add
 * and next norm (add_rmsnorm, as after a dense MLP), or, given next_norm on
 * the device path with nothing to reduce, the experts' combine, the shared
 * expert's add, the residual add and the norm are one op at the end. */
fl_status fl_forward_moe(fl_forward *f, const fl_layer_weights *w, int n, const fl_tensor *next_norm, bool *normed) {
    fl_backend *be = f->m->be;
    const int H = f->m->cfg.hidden_size;
    const bool dev = !f->a2a && fl_forward_moe_dev_covers(f, n);
    const bool fuse = dev && next_norm && !f->comm && be->ops->moe_combine_add_rmsnorm;
    *normed = false;
    /* the device path's combine writes every row; the others add into zeros */
    if (!dev) FL_TRY(be->ops->memset0(be, f->moe_acc, fl_backend_act_bytes(be, (size_t)n * H)));
    if (f->a2a) {
        int lo, m;
        fl_moe_row_slice(n, f->comm ? fl_comm_size(f->comm) : 1, f->comm ? fl_comm_rank(f->comm) : 0,
                         &lo, &m);
        FL_TRY(a2a_rows(f, w, lo, m));
    } else if (dev) {
        FL_TRY(fl_forward_moe_dev_experts(f, w, n, !fuse));
    } else {
        FL_TRY(local_experts(f, w, n));
    }
    if (w->has_shared) {
        FL_TRY(fl_forward_mlp(f, &w->shared, f->h, n, f->moe_out));
        if (w->shared_gate.data) { /* Qwen2-MoE gates its shared expert; DeepSeek does not */
            FL_TRY(be->ops->matmul(be, f->h, n, &w->shared_gate, NULL, f->sgate));
            FL_TRY(be->ops->sigmoid_scale_rows(be, f->moe_out, f->sgate, n, H));
        }
        if (!fuse) FL_TRY(be->ops->add(be, f->moe_acc, f->moe_out, (size_t)n * H));
    }
    if (fuse) {
        *normed = true;
        return fl_forward_moe_dev_combine_norm(f, n, w->has_shared ? f->moe_out : NULL, next_norm);
    }
    return fl_forward_reduce(f, f->moe_acc, (size_t)n * H);
}
