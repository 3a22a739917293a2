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
 * Two exchange modes (DESIGN.md, "Parallel layout"):
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
 *    expert), so no token is counted twice. a2a_rows does
 *    dispatch -> experts -> combine for one row range, so a two-micro-batch
 *    schedule can later overlap one half's exchange with the other half's
 *    expert matmuls; here it runs in order. A replica without tokens still
 *    joins every MoE layer's exchange (fl_forward_moe_idle).
 */
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/forward_impl.h"
#include "runtime/forward_moe.h"
#include "runtime/moe_dispatch.h"

/* DeepSeek-V2 routing on the host, as DeepseekV2TopkRouter: p = softmax of
 * the router logits (f32); group_limited_greedy keeps the topk_group groups
 * with the largest max-p (others' p set to 0); top-k of p (ties: lower id);
 * weights p * routed_scaling_factor, or p renormalized to sum 1 when
 * norm_topk_prob and k > 1 (DeepSeek's modeling code; see model_config.c). */
static fl_status deepseek_route(const fl_model_config *c, const float *logits, int n, int32_t *ids,
                                float *weights) {
    const int E = c->n_experts, K = c->n_experts_per_tok, G = c->n_group > 0 ? c->n_group : 1;
    const int per = E / G;
    if (E > 1024 || E % G || K > E)
        return FL_ERR(FL_ERR_INTERNAL, "deepseek routing: %d experts, %d groups, top-%d", E, G, K);
    float p[1024], gs[1024];
    for (int i = 0; i < n; i++) {
        const float *l = logits + (int64_t)i * E;
        float mx = -FLT_MAX;
        for (int e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        float sum = 0;
        for (int e = 0; e < E; e++) sum += p[e] = expf(l[e] - mx);
        for (int e = 0; e < E; e++) p[e] /= sum;
        if (c->topk_method == FL_TOPK_GROUP_LIMITED && c->topk_group < G) {
            for (int g = 0; g < G; g++) {
                gs[g] = -1;
                for (int e = g * per; e < (g + 1) * per; e++) gs[g] = p[e] > gs[g] ? p[e] : gs[g];
            }
            bool keep[1024] = {false};
            for (int j = 0; j < c->topk_group; j++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
                keep[best] = true;
            }
            for (int e = 0; e < E; e++)
                if (!keep[e / per]) p[e] = 0;
        }
        float wsum = 0;
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (p[e] >= 0 && (best < 0 || p[e] > p[best])) best = e;
            ids[(int64_t)i * K + j] = best;
            weights[(int64_t)i * K + j] = p[best];
            wsum += p[best];
            p[best] = -1; /* taken */
        }
        const bool renorm = c->norm_topk_prob && K > 1;
        for (int j = 0; j < K; j++)
            weights[(int64_t)i * K + j] =
                renorm ? weights[(int64_t)i * K + j] / (wsum + 1e-20f)
                       : weights[(int64_t)i * K + j] * c->routed_scaling_factor;
    }
    return FL_OK;
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
    const bool renorm = c->arch == FL_ARCH_MIXTRAL || c->norm_topk_prob;
    FL_TRY(be->ops->matmul(be, src, m, &w->router, NULL, f->router));
    if (c->arch == FL_ARCH_DEEPSEEK_V2) {
        FL_TRY(be->ops->download_act(be, f->h_router, f->router, (size_t)m * E));
        return deepseek_route(c, f->h_router, m, f->h_moe_ids, f->h_moe_w);
    }
    FL_TRY(be->ops->moe_topk(be, f->router, m, E, K, renorm, f->d_moe_ids, f->d_moe_w));
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

/* One micro-batch's exchange: its rows of the slice, its plan, counts and
 * buffers (each micro-batch has its own, so one's can travel while the
 * other's are computed on). */
typedef struct mb_state {
    int lo, m;                      /* rows [lo, lo + m) of f->h */
    size_t n_send, n_recv;          /* routed rows sent / received */
    size_t max_send, max_recv;      /* what the buffers hold (rows) */
    void *send, *recv, *res, *back; /* activations [max_send, H], [max_recv, H] x 2, [max_send, H] */
    int32_t *d_slot_row, *d_order, *d_ids_send, *d_ids_recv;
    float *d_slot_w;
    int32_t *slot_row, *slot_expert, *recv_expert, *order, *expert_start, *expert_end;
    float *slot_w;
    size_t *cnt;                    /* [8][P]: rows sent/received and their displacements,
                                       then the same in elements */
} mb_state;

typedef struct fl_moe_a2a fl_moe_a2a;
struct fl_moe_a2a {
    fl_comm *ep;
    int P;                 /* ep group size */
    bool host_ids;         /* MPI: expert ids travel in host arrays */
    int mode;              /* fl_moe_overlap */
    int n_mb;              /* micro-batches per layer: 1 (off) or 2 */
    bool events;           /* NCCL on its own stream and a backend with stream_wait: the
                              micro-batches are ordered by events, not host syncs */
    void *comm_stream;     /* the ep communicator's stream (events mode) */
    float *d_ones, *ones;  /* [max_recv] unit weights of the experts' scatter into res */
    mb_state mb[2];
};

static fl_moe_exchange_stats g_moe_totals;

void fl_forward_moe_totals(fl_moe_exchange_stats *out) { *out = g_moe_totals; }

void fl_forward_moe_totals_reset(void) {
    g_moe_totals.layers = g_moe_totals.timed_layers = 0;
    g_moe_totals.act_s = g_moe_totals.ctrl_s = 0;
}

const char *fl_moe_overlap_name(int mode) {
    switch (mode) {
    case FL_MOE_OVERLAP_OFF: return "off";
    case FL_MOE_OVERLAP_ON: return "on";
    case FL_MOE_OVERLAP_SERIAL: return "serial";
    default: return "?";
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* FL_MOE_OVERLAP (forward_moe.h): 0, 1 (default) or 2. */
static fl_status overlap_mode_from_env(int *mode) {
    const char *e = getenv("FL_MOE_OVERLAP");
    *mode = FL_MOE_OVERLAP_ON;
    if (!e || !*e) return FL_OK;
    if (!strcmp(e, "0") || !strcmp(e, "off")) *mode = FL_MOE_OVERLAP_OFF;
    else if (!strcmp(e, "1") || !strcmp(e, "on")) *mode = FL_MOE_OVERLAP_ON;
    else if (!strcmp(e, "2") || !strcmp(e, "serial")) *mode = FL_MOE_OVERLAP_SERIAL;
    else
        return FL_ERR(FL_ERR_INVALID_ARG, "FL_MOE_OVERLAP must be 0 (off), 1 (on) or 2 (serial), "
                      "got '%s'", e);
    return FL_OK;
}

static fl_status mb_alloc(fl_backend *be, mb_state *u, size_t max_send, size_t max_recv, int H,
                          int n_local, int E, bool host_ids) {
    fl_status st = FL_OK;
    const size_t Hs = (size_t)H;
    u->max_send = max_send;
    u->max_recv = max_recv;
    /* max_send >= K >= 1: no zero-sized buffers */
#define ACT(ptr, n) FL_TRY_GOTO(be->ops->alloc(be, fl_backend_act_bytes(be, n), &(ptr)), st, fail)
#define RAW(ptr, n) FL_TRY_GOTO(be->ops->alloc(be, (size_t)(n) * 4, (void **)&(ptr)), st, fail)
    ACT(u->send, max_send * Hs);
    ACT(u->back, max_send * Hs);
    ACT(u->recv, max_recv * Hs);
    ACT(u->res, max_recv * Hs);
    RAW(u->d_slot_row, max_send);
    RAW(u->d_slot_w, max_send);
    RAW(u->d_order, max_recv);
    if (!host_ids) {
        RAW(u->d_ids_send, max_send);
        RAW(u->d_ids_recv, max_recv);
    }
#undef ACT
#undef RAW
    u->slot_row = malloc(max_send * sizeof(int32_t) + 4);
    u->slot_expert = malloc(max_send * sizeof(int32_t) + 4);
    u->slot_w = malloc(max_send * sizeof(float) + 4);
    u->recv_expert = malloc(max_recv * sizeof(int32_t) + 4);
    u->order = malloc(max_recv * sizeof(int32_t) + 4);
    u->expert_start = malloc(((size_t)n_local + 1) * sizeof(int32_t));
    u->expert_end = malloc(((size_t)E + 1) * sizeof(int32_t));
    FL_CHECK_ALLOC(u->slot_row, st, fail);
    FL_CHECK_ALLOC(u->slot_expert, st, fail);
    FL_CHECK_ALLOC(u->slot_w, st, fail);
    FL_CHECK_ALLOC(u->recv_expert, st, fail);
    FL_CHECK_ALLOC(u->order, st, fail);
    FL_CHECK_ALLOC(u->expert_start, st, fail);
    FL_CHECK_ALLOC(u->expert_end, st, fail);
fail:
    return st; /* the caller frees a partly built state */
}

static void mb_free(fl_backend *be, mb_state *u) {
    void *dev[] = {u->send, u->recv, u->res, u->back, u->d_slot_row, u->d_order, u->d_ids_send,
                   u->d_ids_recv, u->d_slot_w};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) be->ops->free(be, dev[i]);
    free(u->slot_row);
    free(u->slot_expert);
    free(u->slot_w);
    free(u->recv_expert);
    free(u->order);
    free(u->expert_start);
    free(u->expert_end);
    free(u->cnt);
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
     * one micro-batch on any rank means one on all, since the number of
     * exchanges per layer must match. A bad value fails every rank alike. */
    int mode = FL_MOE_OVERLAP_ON;
    fl_status env_st = overlap_mode_from_env(&mode);
    bool all_ok = true;
    FL_TRY(fl_comm_agree(ep, env_st == FL_OK, &all_ok));
    if (env_st != FL_OK) return env_st;
    if (!all_ok) return FL_ERR(FL_ERR_INVALID_ARG, "FL_MOE_OVERLAP is invalid on another rank");
    bool all_split = true;
    FL_TRY(fl_comm_agree(ep, mode != FL_MOE_OVERLAP_OFF, &all_split));
    if (!all_split) mode = FL_MOE_OVERLAP_OFF;

    fl_moe_a2a *a = calloc(1, sizeof *a);
    if (!a) return FL_ERR(FL_ERR_OOM, "out of memory");
    f->a2a = a;
    a->ep = ep;
    a->P = P;
    a->host_ids = fl_comm_backend_of(ep) == FL_COMM_BACKEND_MPI;
    a->mode = mode;
    a->n_mb = mode == FL_MOE_OVERLAP_OFF ? 1 : 2;
    /* Events only help when the exchange runs beside the compute: NCCL on a
     * stream of its own (an ep communicator put on the compute stream is
     * ordered with it already, and MPI blocks). */
    a->comm_stream = fl_comm_stream(ep);
    a->events = mode == FL_MOE_OVERLAP_ON && !a->host_ids && be->ops->stream_wait && a->comm_stream;
    const int tp = f->comm ? fl_comm_size(f->comm) : 1;
    /* a tp rank dispatches at most ceil(max_tokens / tp) rows, each to K
     * experts; micro-batch A takes ceil of half of them, B the rest */
    const size_t rows = (size_t)((f->lim.max_tokens + tp - 1) / tp);
    for (int i = 0; i < a->n_mb; i++) {
        const size_t r = a->n_mb == 1 ? rows : i == 0 ? (rows + 1) / 2 : (rows / 2 ? rows / 2 : 1);
        mb_state *u = &a->mb[i];
        u->cnt = calloc(8 * (size_t)P, sizeof *u->cnt);
        FL_CHECK_ALLOC(u->cnt, st, fail);
        FL_TRY_GOTO(mb_alloc(be, u, r * K, r * K * P, H, d->n_experts, E, a->host_ids), st, fail);
    }
    const size_t max_recv = a->mb[0].max_recv;
    FL_TRY_GOTO(be->ops->alloc(be, max_recv * 4, (void **)&a->d_ones), st, fail);
    a->ones = malloc(max_recv * sizeof(float) + 4);
    FL_CHECK_ALLOC(a->ones, st, fail);
    for (size_t i = 0; i < max_recv; i++) a->ones[i] = 1.0f;
    FL_TRY_GOTO(be->ops->upload(be, a->d_ones, a->ones, max_recv * sizeof(float)), st, fail);
    g_moe_totals.enabled = true;
    g_moe_totals.mode = a->mode;
    g_moe_totals.events = a->events;
    return FL_OK;
fail:
    fl_forward_moe_free(f);
    return st;
}

void fl_forward_moe_free(fl_forward *f) {
    if (!f || !f->a2a) return;
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    for (int i = 0; i < 2; i++) mb_free(be, &a->mb[i]);
    if (a->d_ones) be->ops->free(be, a->d_ones);
    free(a->ones);
    free(a);
    f->a2a = NULL;
}

/* The all_to_all_v of micro-batch u's activation rows (counts in rows,
 * scaled to elements; `back`: the results, along the reverse counts).
 * Events mode: only enqueued on the ep stream; the caller fences it against
 * the compute queue both ways (comm_waits_compute / compute_waits_comm). In
 * order (MPI, or NCCL without events): the compute queue is drained, the
 * exchange awaited, and the time of exchange + wait added to the totals. */
static fl_status a2a_act(fl_forward *f, mb_state *u, bool back) {
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    const int P = a->P;
    const size_t H = (size_t)f->m->cfg.hidden_size;
    const size_t *sc = u->cnt, *rc = u->cnt + 2 * P;
    size_t *esc = u->cnt + 4 * P, *esd = u->cnt + 5 * P, *erc = u->cnt + 6 * P, *erd = u->cnt + 7 * P;
    for (int p = 0; p < P; p++) {
        esc[p] = (back ? rc[p] : sc[p]) * H;
        erc[p] = (back ? sc[p] : rc[p]) * H;
    }
    fl_moe_displs(esc, P, esd);
    fl_moe_displs(erc, P, erd);
    const void *send = back ? u->res : u->send;
    void *recv = back ? u->back : u->recv;
    if (a->events) return fl_comm_all_to_all_v(a->ep, send, esc, esd, recv, erc, erd, f->comm_dt);
    if (!a->host_ids) FL_TRY(be->ops->sync(be));
    const double t0 = now_s();
    FL_TRY(fl_comm_all_to_all_v(a->ep, send, esc, esd, recv, erc, erd, f->comm_dt));
    if (!a->host_ids) FL_TRY(fl_comm_sync(a->ep));
    g_moe_totals.act_s += now_s() - t0;
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

/* Host side of one micro-batch: router top-k and the send plan. */
static fl_status mb_plan(fl_forward *f, const fl_layer_weights *w, mb_state *u) {
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok, H = c->hidden_size, P = a->P;
    u->n_send = (size_t)u->m * K;
    if (u->n_send > u->max_send)
        return FL_ERR(FL_ERR_INTERNAL, "moe dispatch: %zu routed rows exceed the %zu sized for",
                      u->n_send, u->max_send);
    if (u->m > 0) FL_TRY(route(f, w, act_at(be, f->h, (size_t)u->lo * H), u->m));
    return fl_moe_dispatch_plan(u->m, K, f->h_moe_ids, f->h_moe_w, E, P, u->slot_row, u->slot_expert,
                                u->slot_w, u->cnt, u->cnt + P, u->expert_end);
}

/* What each rank sends here, for every micro-batch, in one exchange: a
 * micro-batch's count per rank fits 32 bits (checked), so two travel in one
 * size_t. */
static fl_status exchange_counts(fl_forward *f) {
    fl_moe_a2a *a = f->a2a;
    const int P = a->P;
    mb_state *A = &a->mb[0], *B = &a->mb[1];
    if (a->n_mb == 1) return fl_comm_exchange_counts(a->ep, A->cnt, A->cnt + 2 * P);
    size_t *pack = A->cnt + 4 * P, *unpack = A->cnt + 6 * P; /* element counts: free until a2a_act */
    for (int p = 0; p < P; p++) {
        if (A->cnt[p] > UINT32_MAX || B->cnt[p] > UINT32_MAX)
            return FL_ERR(FL_ERR_INTERNAL, "moe dispatch: %zu + %zu rows to ep rank %d exceed 2^32",
                          A->cnt[p], B->cnt[p], p);
        pack[p] = A->cnt[p] | (B->cnt[p] << 32);
    }
    FL_TRY(fl_comm_exchange_counts(a->ep, pack, unpack));
    for (int p = 0; p < P; p++) {
        A->cnt[2 * P + p] = unpack[p] & UINT32_MAX;
        B->cnt[2 * P + p] = unpack[p] >> 32;
    }
    return FL_OK;
}

/* This rank's experts over the rows micro-batch u received, results in
 * receive order into u->res (enqueued; the rows must have arrived). */
static fl_status mb_experts(fl_forward *f, const fl_layer_weights *w, mb_state *u) {
    fl_backend *be = f->m->be;
    const int H = f->m->cfg.hidden_size, n_local = f->m->dims.n_experts, T = f->lim.max_tokens;
    if (!u->n_recv) return FL_OK;
    for (int j = 0; j < n_local; j++) {
        /* an expert can receive more rows than one step's buffers hold: chunks of T */
        for (int at = u->expert_start[j]; at < u->expert_start[j + 1]; at += T) {
            int cnt = u->expert_start[j + 1] - at < T ? u->expert_start[j + 1] - at : T;
            FL_TRY(be->ops->gather_rows(be, u->recv, u->d_order + at, cnt, H, f->moe_in));
            FL_TRY(fl_forward_mlp(f, &w->experts[j], f->moe_in, cnt, f->moe_out));
            FL_TRY(be->ops->scatter_add_rows(be, u->res, f->moe_out, u->d_order + at,
                                             f->a2a->d_ones + at, cnt, H));
        }
    }
    return FL_OK;
}

/* The weighted combine of micro-batch u's returned rows into its rows of
 * f->moe_acc, one expert at a time (a token appears once per expert). */
static fl_status mb_combine(fl_forward *f, mb_state *u) {
    fl_backend *be = f->m->be;
    const int E = f->m->cfg.n_experts, H = f->m->cfg.hidden_size;
    void *acc = act_at(be, f->moe_acc, (size_t)u->lo * H);
    for (int e = 0; e < E && u->n_send; e++) {
        int s0 = e ? u->expert_end[e - 1] : 0, ne = u->expert_end[e] - s0;
        if (ne == 0) continue;
        FL_TRY(be->ops->scatter_add_rows(be, acc, act_at(be, u->back, (size_t)s0 * H),
                                         u->d_slot_row + s0, u->d_slot_w + s0, ne, H));
    }
    return FL_OK;
}

/* Dispatch -> local experts -> combine for rows [lo, lo + m) of f->h; the
 * weighted expert outputs are added into the same rows of f->moe_acc. Every
 * rank of the ep group calls it once per MoE layer (m may be 0), and runs
 * the same collectives whatever its m.
 *
 * With two micro-batches A and B (docs/parallel.md, "MoE overlap") the
 * host-side parts of both come first (route, plan, one count exchange, the
 * expert ids), then
 *      ep stream:  send A | send B    | back A    | back B
 *      compute:           | experts A | experts B | combine A, combine B
 * ordered by events (a2a_act / compute_waits_comm), so B's rows travel while
 * A's experts run and A's results travel back while B's run. Without events
 * (MPI, or FL_MOE_OVERLAP=2) the same calls run in program order. */
static fl_status a2a_rows(fl_forward *f, const fl_layer_weights *w, int lo, int m) {
    fl_moe_a2a *a = f->a2a;
    fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    const int H = c->hidden_size, P = a->P;
    const int e_lo = f->m->dims.expert_lo, n_local = f->m->dims.n_experts;
    const int nb = a->n_mb;
    mb_state *mb = a->mb;
    /* split: A the first ceil(m / 2) rows, B the rest (m = 1: B is empty) */
    mb[0].lo = lo;
    mb[0].m = nb == 1 ? m : (m + 1) / 2;
    if (nb == 2) {
        mb[1].lo = lo + mb[0].m;
        mb[1].m = m - mb[0].m;
    }
    for (int i = 0; i < nb; i++) FL_TRY(mb_plan(f, w, &mb[i]));
    double t0 = now_s();
    FL_TRY(exchange_counts(f));
    g_moe_totals.ctrl_s += now_s() - t0;
    for (int i = 0; i < nb; i++) {
        mb_state *u = &mb[i];
        u->n_recv = fl_moe_displs(u->cnt + 2 * P, P, u->cnt + 3 * P);
        if (u->n_recv > u->max_recv)
            return FL_ERR(FL_ERR_INTERNAL, "moe dispatch: %zu rows received exceed the %zu sized for",
                          u->n_recv, u->max_recv);
        if (u->n_send) {
            FL_TRY(be->ops->upload(be, u->d_slot_row, u->slot_row, u->n_send * 4));
            FL_TRY(be->ops->upload(be, u->d_slot_w, u->slot_w, u->n_send * 4));
            FL_TRY(be->ops->gather_rows(be, act_at(be, f->h, (size_t)u->lo * H), u->d_slot_row,
                                        (int)u->n_send, H, u->send));
        }
    }
    /* the expert id of every row travels with it */
    if (a->host_ids) {
        t0 = now_s();
        for (int i = 0; i < nb; i++)
            FL_TRY(fl_comm_all_to_all_v(a->ep, mb[i].slot_expert, mb[i].cnt, mb[i].cnt + P,
                                        mb[i].recv_expert, mb[i].cnt + 2 * P, mb[i].cnt + 3 * P,
                                        FL_COMM_I32));
    } else {
        for (int i = 0; i < nb; i++)
            if (mb[i].n_send) FL_TRY(be->ops->upload(be, mb[i].d_ids_send, mb[i].slot_expert, mb[i].n_send * 4));
        FL_TRY(be->ops->sync(be));
        t0 = now_s();
        for (int i = 0; i < nb; i++)
            FL_TRY(fl_comm_all_to_all_v(a->ep, mb[i].d_ids_send, mb[i].cnt, mb[i].cnt + P,
                                        mb[i].d_ids_recv, mb[i].cnt + 2 * P, mb[i].cnt + 3 * P,
                                        FL_COMM_I32));
        FL_TRY(fl_comm_sync(a->ep));
        for (int i = 0; i < nb; i++)
            if (mb[i].n_recv)
                FL_TRY(be->ops->download(be, mb[i].recv_expert, mb[i].d_ids_recv, mb[i].n_recv * 4));
    }
    g_moe_totals.ctrl_s += now_s() - t0;
    /* what each received row is: grouped by local expert */
    for (int i = 0; i < nb; i++) {
        mb_state *u = &mb[i];
        FL_TRY(fl_moe_dispatch_local((int)u->n_recv, u->recv_expert, e_lo, n_local, u->order,
                                     u->expert_start));
        if (u->n_recv) {
            FL_TRY(be->ops->upload(be, u->d_order, u->order, u->n_recv * 4));
            FL_TRY(be->ops->memset0(be, u->res, fl_backend_act_bytes(be, u->n_recv * H)));
        }
    }
    /* The pipeline. Each fence orders against everything enqueued on the
     * other stream so far, so the calls' host order is what places them:
     * compute queue  [A arrived] experts A [B arrived] experts B [back] combine
     * ep stream      send A, send B [experts A done] back A [experts B done] back B */
    FL_TRY(comm_waits_compute(f)); /* the send buffers were filled on the compute queue */
    FL_TRY(a2a_act(f, &mb[0], false));
    FL_TRY(compute_waits_comm(f));
    FL_TRY(mb_experts(f, w, &mb[0]));
    if (nb == 2) {
        FL_TRY(a2a_act(f, &mb[1], false)); /* travels while A's experts run */
        FL_TRY(compute_waits_comm(f));     /* on the compute queue after A's experts */
    }
    FL_TRY(comm_waits_compute(f));         /* A's results are ready */
    FL_TRY(a2a_act(f, &mb[0], true));
    if (nb == 2) {
        FL_TRY(mb_experts(f, w, &mb[1]));  /* while A's results travel back */
        FL_TRY(comm_waits_compute(f));
        FL_TRY(a2a_act(f, &mb[1], true));
    }
    FL_TRY(compute_waits_comm(f));
    for (int i = 0; i < nb; i++) FL_TRY(mb_combine(f, &mb[i]));
    g_moe_totals.layers++;
    if (!a->events) g_moe_totals.timed_layers++;
    return FL_OK;
}

fl_status fl_forward_moe_idle(fl_forward *f) {
    if (!f->a2a) return FL_OK;
    for (int l = 0; l < f->m->cfg.n_layers; l++)
        if (f->m->layers[l].is_moe) FL_TRY(a2a_rows(f, &f->m->layers[l], 0, 0));
    return f->m->be->ops->sync(f->m->be);
}

/* Routed experts (+ shared expert) for n rows of normed input f->h; the
 * result is added into the residual f->x. */
fl_status fl_forward_moe(fl_forward *f, const fl_layer_weights *w, int n) {
    fl_backend *be = f->m->be;
    const int H = f->m->cfg.hidden_size;
    FL_TRY(be->ops->memset0(be, f->moe_acc, fl_backend_act_bytes(be, (size_t)n * H)));
    if (f->a2a) {
        int lo, m;
        fl_moe_row_slice(n, f->comm ? fl_comm_size(f->comm) : 1, f->comm ? fl_comm_rank(f->comm) : 0,
                         &lo, &m);
        FL_TRY(a2a_rows(f, w, lo, m));
    } else {
        FL_TRY(local_experts(f, w, n));
    }
    if (w->has_shared) {
        FL_TRY(fl_forward_mlp(f, &w->shared, f->h, n, f->moe_out));
        if (w->shared_gate.data) { /* Qwen2-MoE gates its shared expert; DeepSeek does not */
            FL_TRY(be->ops->matmul(be, f->h, n, &w->shared_gate, NULL, f->sgate));
            FL_TRY(be->ops->sigmoid_scale_rows(be, f->moe_out, f->sgate, n, H));
        }
        FL_TRY(be->ops->add(be, f->moe_acc, f->moe_out, (size_t)n * H));
    }
    FL_TRY(fl_forward_reduce(f, f->moe_acc, (size_t)n * H));
    return be->ops->add(be, f->x, f->moe_acc, (size_t)n * H);
}
