/*
 * forward_graph.c — decode steps captured once per batch bucket and replayed
 * (see forward_graph.h for why and where), and the FL_STEP_TIMING phase
 * timer that measured where a step's time goes.
 *
 * One device buffer holds a bucket's step tables, laid out for that bucket
 * size B (all buckets share the buffer: one step runs at a time, and the
 * upload that refreshes it is ordered on the stream after the previous
 * replay):
 *   tokens[B] slots[B] q_start[B+1] ctx_len[B] block_tables[B, max_blocks]
 *   cos[B, half] sin[B, half] (f32 bit patterns)
 * The graph of bucket (B, C) is recorded with pointers into that layout and
 * with launch sizes that depend on B, C and the forward's limits only:
 * attention is told max_q_len = 1 and max_ctx_len = C, and reads each
 * sequence's real context length from ctx_len; the block table stride is
 * the limit's max_blocks. So a replay computes exactly what an eager step
 * with the same tables computes. C, the context bucket, is the smallest of
 * 128, 256, 512, ... (then the limit) that holds every sequence of the
 * step: attention sizes its work by max_ctx_len (the context splits, which
 * kernel), and with C = the limit a short context under a long limit ran
 * the split kernel over mostly empty splits (Llama-3-8B's 8192: 32 calls a
 * step). graph_ctx_buckets off (FL_GRAPH_CTX_BUCKETS=0) keeps C = the limit.
 *
 * The first step of a bucket runs eagerly through the same tables, then the
 * same op sequence is recorded (not run) into the bucket's graph: one-time
 * set-up inside the ops (kernel attributes, occupancy queries, cuBLAS
 * heuristics) happens outside the capture.
 */
#include "runtime/model/forward_graph.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/pool.h"
#include "runtime/model/rope.h"

#define MAX_BUCKETS 16
#define MAX_CTX_BUCKETS 24 /* 128 << 23 positions: past any limit */
#define CTX_BUCKET0 128

typedef struct fl_fwd_graph {
    bool allowed;           /* model, backend and limits allow graphs */
    bool on;                /* allowed and switched on */
    bool timing;            /* cfg.step_timing (--step-timing, FL_STEP_TIMING=1) */
    bool emulate;           /* replay = re-run the body (tests; see fl_forward_graph_emulate) */
    int cap;                /* largest bucket */
    int n_buckets;
    int bucket[MAX_BUCKETS];
    bool ctx_buckets;       /* cfg.graph_ctx_buckets (default on) */
    int n_ctx;              /* context buckets (0: not made yet, at the first step: its block size) */
    int ctx_bucket[MAX_CTX_BUCKETS];
    void *exec[MAX_BUCKETS][MAX_CTX_BUCKETS];   /* instantiated graphs (emulation: a non-NULL marker) */
    fl_step_dev sd[MAX_BUCKETS];                /* what each bucket's graphs were recorded with */
    fl_attn_meta meta[MAX_BUCKETS][MAX_CTX_BUCKETS];
    int half;               /* rot_dim / 2 */
    int max_blocks;         /* block-table stride (the forward's limit) */
    int32_t *h_tab;         /* host staging of the tables, sized for cap */
    bool h_tab_pinned;      /* h_tab from the backend's host_alloc (else malloc) */
    int32_t *d_tab;         /* device tables */
    uint16_t *h_logits;     /* page-locked bf16 staging [max_logits, vocab], or NULL */
    fl_forward_graph_stats st;
} fl_fwd_graph;

static fl_forward_graph_stats g_totals;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Word offsets of the tables for bucket size B. */
typedef struct tab_layout {
    size_t tokens, slots, q_start, ctx_len, bt, cos, sin, words;
} tab_layout;

static tab_layout layout_for(const fl_fwd_graph *g, int B) {
    tab_layout L;
    L.tokens = 0;
    L.slots = L.tokens + (size_t)B;
    L.q_start = L.slots + (size_t)B;
    L.ctx_len = L.q_start + (size_t)B + 1;
    L.bt = L.ctx_len + (size_t)B;
    L.cos = L.bt + (size_t)B * (size_t)g->max_blocks;
    L.sin = L.cos + (size_t)B * (size_t)g->half;
    L.words = L.sin + (size_t)B * (size_t)g->half;
    return L;
}

static void set_off(fl_fwd_graph *g, const char *why) {
    g->on = false;
    snprintf(g->st.why_off, sizeof g->st.why_off, "%s", why);
}

/* Why decode steps of f cannot be graphs (NULL: they can). need_ops: the
 * backend must be able to capture (false for emulation). */
static const char *why_not(const fl_forward *f, bool need_ops) {
    const fl_backend *be = f->m->be;
    const fl_model_config *c = &f->m->cfg;
    bool moe = false;
    for (int l = 0; l < c->n_layers; l++) moe = moe || f->m->layers[l].is_moe;
    if (need_ops && (!be->ops->graph_begin || !be->ops->graph_end || !be->ops->graph_launch))
        return "the backend cannot capture graphs";
    /* NCCL on the compute stream is captured like any kernel (every rank
     * captures and replays the same steps); MPI, or NCCL with host syncs
     * around it, cannot be. */
    if (f->comm && !f->comm_inline)
        return "sharded model whose collectives synchronize the host inside a step";
    if (moe && !f->moe_dev) return "MoE routing copies the top-k to the host inside a step";
    if (f->a2a) return "the MoE all-to-all exchanges its counts through the host";
    if (f->graph->cap < 1 || f->lim.max_blocks < 1) return "forward limits leave no decode bucket";
    return NULL;
}

/* Buckets and the table buffers (host staging and device), sized for cap. */
static fl_status alloc_tables(fl_forward *f) {
    fl_fwd_graph *g = f->graph;
    fl_backend *be = f->m->be;
    g->n_buckets = 0;
    for (int b = 1; g->n_buckets < MAX_BUCKETS; b *= 2) {
        g->bucket[g->n_buckets++] = b < g->cap ? b : g->cap;
        if (b >= g->cap) break;
    }
    const tab_layout L = layout_for(g, g->cap);
    /* page-locked where the backend has it: the one upload before every
     * replay is then a plain DMA, not a copy through a staging buffer */
    if (be->ops->host_alloc && be->ops->host_free &&
        be->ops->host_alloc(be, L.words * sizeof(int32_t), (void **)&g->h_tab) == FL_OK) {
        g->h_tab_pinned = true;
    } else {
        fl_error_clear();
        g->h_tab = malloc(L.words * sizeof(int32_t));
    }
    if (!g->h_tab) return FL_ERR(FL_ERR_OOM, "out of memory for the decode-graph tables");
    return be->ops->alloc(be, L.words * sizeof(int32_t), (void **)&g->d_tab);
}

fl_status fl_forward_graph_init(fl_forward *f) {
    fl_backend *be = f->m->be;
    fl_status st = FL_OK;
    fl_fwd_graph *g = calloc(1, sizeof *g);
    if (!g) return FL_ERR(FL_ERR_OOM, "out of memory for the forward's graph state");
    f->graph = g;
    g->timing = f->cfg.step_timing;
    const bool wanted = f->cfg.cuda_graphs;
    g->ctx_buckets = f->cfg.graph_ctx_buckets;
    g->half = f->rot_dim / 2;
    g->max_blocks = f->lim.max_blocks;
    if (!f->comm && be->act_dtype == FL_DTYPE_BF16 && be->ops->host_alloc && be->ops->host_free) {
        const size_t bytes = (size_t)f->lim.max_logits * (size_t)f->m->dims.vocab * sizeof(uint16_t);
        if (be->ops->host_alloc(be, bytes, (void **)&g->h_logits) != FL_OK) {
            g->h_logits = NULL; /* not fatal: download_act still works, only slower */
            fl_error_clear();
        }
    }
    int cap = f->lim.max_seqs;
    if (f->lim.max_tokens < cap) cap = f->lim.max_tokens;
    if (f->lim.max_logits < cap) cap = f->lim.max_logits;
    /* MoE: a graph's rows must all take the device-routed path */
    if (f->moe_dev && fl_forward_moe_dev_max_n(f) < cap) cap = fl_forward_moe_dev_max_n(f);
    g->cap = cap;
    const char *why = why_not(f, true);
    if (!why && !wanted) why = "turned off (--cuda-graphs off or FL_CUDA_GRAPHS=0)";
    /* Sharded: every rank of the group must replay or run eagerly alike (a
     * graph reduces the padded bucket, an eager step only its rows), so one
     * rank's settings (cuda_graphs, NCCL's own stream) decide for all; every
     * rank of the group asks, whatever its own answer. */
    if (f->comm) {
        bool all_ok = true;
        FL_TRY_GOTO(fl_comm_agree(f->comm, why == NULL, &all_ok), st, fail);
        if (!why && !all_ok) why = "graphs are off on another rank of the group";
        /* and the same buckets (the MoE row limit, FL_MOE_DEVICE_MAX_N, is
         * each rank's own): a step of the group replays on all or none */
        FL_TRY_GOTO(fl_comm_agree_min(f->comm, g->cap, &g->cap), st, fail);
    }
    g->allowed = !why;
    if (why) {
        set_off(g, why);
        return FL_OK;
    }
    FL_TRY_GOTO(alloc_tables(f), st, fail);
    g->on = true;
    g->st.enabled = g->on;
    if (g->on) g_totals.enabled = true;
    return FL_OK;
fail:
    fl_forward_graph_free(f);
    return st;
}

static void free_graphs(fl_forward *f) {
    fl_fwd_graph *g = f->graph;
    fl_backend *be = f->m->be;
    for (int i = 0; i < g->n_buckets; i++)
        for (int j = 0; j < MAX_CTX_BUCKETS; j++) {
            if (g->exec[i][j] && !g->emulate && be->ops->graph_free) be->ops->graph_free(be, g->exec[i][j]);
            g->exec[i][j] = NULL;
        }
}

fl_status fl_forward_graph_emulate(fl_forward *f) {
    fl_fwd_graph *g = f->graph;
    if (!g) return FL_ERR(FL_ERR_INVALID_ARG, "fl_forward_graph_emulate: forward has no graph state");
    if (!g->allowed) {
        const char *why = why_not(f, false);
        if (why) {
            set_off(g, why);
            return FL_OK;
        }
        FL_TRY(alloc_tables(f));
        g->allowed = true;
    }
    free_graphs(f);
    g->emulate = true;
    g->on = true;
    g->st.why_off[0] = 0;
    g->st.enabled = true;
    return FL_OK;
}

void fl_forward_graph_free(fl_forward *f) {
    if (!f || !f->graph) return;
    fl_fwd_graph *g = f->graph;
    free_graphs(f);
    if (g->d_tab) f->m->be->ops->free(f->m->be, g->d_tab);
    if (g->h_logits) f->m->be->ops->host_free(f->m->be, g->h_logits);
    if (g->h_tab_pinned) f->m->be->ops->host_free(f->m->be, g->h_tab);
    else free(g->h_tab);
    free(g);
    f->graph = NULL;
}

void fl_forward_graph_enable(fl_forward *f, bool on) {
    fl_fwd_graph *g = f->graph;
    if (!g) return;
    if (!on) {
        free_graphs(f);
        if (g->on) set_off(g, "switched off");
        g->on = false;
    } else if (g->allowed) {
        g->on = true;
        g->st.why_off[0] = 0;
        g_totals.enabled = true;
    }
    g->st.enabled = g->on;
}

void fl_forward_graph_forbid(fl_forward *f, const char *why) {
    fl_fwd_graph *g = f->graph;
    if (!g) return;
    free_graphs(f);
    set_off(g, why);
    g->allowed = false;
    g->st.enabled = false;
    /* the process totals (bench's report, one forward per process) say so too */
    g_totals.enabled = false;
    snprintf(g_totals.why_off, sizeof g_totals.why_off, "%s", why);
}

void fl_forward_graph_get_stats(const fl_forward *f, fl_forward_graph_stats *out) {
    memset(out, 0, sizeof *out);
    if (f && f->graph) *out = f->graph->st;
}

void fl_forward_graph_totals(fl_forward_graph_stats *out) { *out = g_totals; }

/* Every sequence one query row, every row's logits wanted in row order: the
 * shape the graphs are captured for. */
static bool is_decode(const fl_step_plan *p) {
    if (p->n_tokens != p->n_seqs || p->n_logits != p->n_seqs) return false;
    for (int i = 0; i < p->n_logits; i++)
        if (p->logit_rows[i] != i) return false;
    return true;
}

/* Fills the host tables of bucket B from plan p (padding rows: token 0,
 * slot -1, context 0, identity rotation). */
static void fill_tables(fl_forward *f, const fl_step_plan *p, int B, const tab_layout *L) {
    fl_fwd_graph *g = f->graph;
    const fl_model_config *c = &f->m->cfg;
    int32_t *t = g->h_tab;
    const int n = p->n_seqs, half = g->half, mb = g->max_blocks;
    float *cosv = (float *)(t + L->cos), *sinv = (float *)(t + L->sin);
    for (int i = 0; i < B; i++) {
        const bool real = i < n;
        t[L->tokens + i] = real ? p->tokens[i] : 0;
        t[L->slots + i] = real ? p->slots[i] : -1;
        t[L->q_start + i] = i;
        t[L->ctx_len + i] = real ? p->ctx_len[i] : 0;
        int32_t *bt = t + L->bt + (size_t)i * mb;
        memset(bt, 0, (size_t)mb * sizeof *bt);
        if (real) {
            memcpy(bt, p->block_tables + (size_t)i * p->max_blocks, (size_t)p->max_blocks * sizeof *bt);
            fl_rope_fill(c, f->m->rope_freq_factors, p->rope_len[i], p->positions + i, 1,
                         cosv + (size_t)i * half, sinv + (size_t)i * half);
        } else {
            for (int j = 0; j < half; j++) {
                cosv[(size_t)i * half + j] = 1.0f;
                sinv[(size_t)i * half + j] = 0.0f;
            }
        }
    }
    t[L->q_start + B] = B;
}

fl_status fl_forward_graph_run(fl_forward *f, const fl_step_plan *p, fl_forward_timer *tm, bool *done) {
    fl_fwd_graph *g = f->graph;
    fl_backend *be = f->m->be;
    *done = false;
    if (!g || !is_decode(p)) return FL_OK;
    g->st.decode_steps++;
    g_totals.decode_steps++;
    if (!g->on || p->n_seqs > g->cap) return FL_OK;
    int bi = 0;
    while (g->bucket[bi] < p->n_seqs) bi++;
    const int B = g->bucket[bi];
    if (!g->n_ctx) { /* the limit in positions needs the cache's block size: the first step's */
        const int lim = g->max_blocks * p->block_size;
        for (int c = CTX_BUCKET0; g->ctx_buckets && c < lim && g->n_ctx < MAX_CTX_BUCKETS - 1; c *= 2)
            g->ctx_bucket[g->n_ctx++] = c;
        g->ctx_bucket[g->n_ctx++] = lim;
    }
    int maxc = 0;
    for (int i = 0; i < p->n_seqs; i++) maxc = p->ctx_len[i] > maxc ? p->ctx_len[i] : maxc;
    int ci = 0;
    while (ci < g->n_ctx - 1 && g->ctx_bucket[ci] < maxc) ci++;
    const tab_layout L = layout_for(g, B);
    fill_tables(f, p, B, &L);
    FL_TRY(be->ops->upload(be, g->d_tab, g->h_tab, L.words * sizeof(int32_t)));
    fl_forward_timer_mark(f, tm, FL_FWD_T_PREP);
    if (g->exec[bi][ci]) {
        if (g->emulate)
            FL_TRY(fl_forward_body(f, &g->sd[bi], &g->meta[bi][ci]));
        else
            FL_TRY(be->ops->graph_launch(be, g->exec[bi][ci]));
        fl_forward_moe_dev_replayed(f); /* its MoE layers grouped their experts on the device */
        g->st.replays++;
        g_totals.replays++;
        fl_forward_timer_mark(f, tm, FL_FWD_T_ENQUEUE);
        *done = true;
        return FL_OK;
    }
    const fl_attn_meta meta = {
        .n_seqs = B, .q_start = g->d_tab + L.q_start, .ctx_len = g->d_tab + L.ctx_len,
        .block_tables = g->d_tab + L.bt, .max_blocks = g->max_blocks, .block_size = p->block_size,
        .max_ctx_len = g->ctx_bucket[ci], .max_q_len = 1,
    };
    const fl_step_dev sd = {
        .n = B, .tokens = g->d_tab + L.tokens, .slots = g->d_tab + L.slots, .logit_rows = NULL,
        .n_logits = B, .cos = (const float *)(g->d_tab + L.cos), .sin = (const float *)(g->d_tab + L.sin),
    };
    /* This step runs eagerly; the same ops are then recorded for the next. */
    FL_TRY(fl_forward_body(f, &sd, &meta));
    fl_forward_timer_mark(f, tm, FL_FWD_T_ENQUEUE);
    *done = true;
    g->sd[bi] = sd;
    g->meta[bi][ci] = meta;
    if (g->emulate) {
        g->exec[bi][ci] = g; /* marker: replays re-run the body on sd/meta */
        g->st.captures++;
        g_totals.captures++;
        return FL_OK;
    }
    if (tm) tm->discard = true; /* a capture step is not timed (fl_forward_timer_stop) */
    fl_status st = be->ops->graph_begin(be);
    if (st == FL_OK) {
        st = fl_forward_body(f, &sd, &meta);
        void *ex = NULL;
        fl_status se = be->ops->graph_end(be, st == FL_OK, &ex);
        if (st == FL_OK) st = se;
        g->exec[bi][ci] = st == FL_OK ? ex : NULL;
    }
    if (f->comm) {
        /* one rank's failed capture turns graphs off on every rank */
        bool all_ok = true;
        const bool ok = st == FL_OK;
        FL_TRY(fl_comm_agree(f->comm, ok, &all_ok));
        if (ok && !all_ok) st = FL_ERR(FL_ERR_CUDA, "capture failed on another rank of the group");
    }
    if (st != FL_OK) {
        /* Not fatal: this step's results are already enqueued; later steps
         * run eagerly. The reason is kept for --verbose and the bench JSON. */
        char why[160];
        snprintf(why, sizeof why, "capture failed: %.140s", fl_error_msg());
        free_graphs(f);
        set_off(g, why);
        g->st.enabled = false;
        g->st.capture_failures++;
        g_totals.capture_failures++;
        snprintf(g_totals.why_off, sizeof g_totals.why_off, "%s", why);
        return FL_OK;
    }
    g->st.captures++;
    g_totals.captures++;
    return FL_OK;
}

typedef struct bf16_job {
    const uint16_t *src;
    float *dst;
} bf16_job;

/* bf16 bit patterns to f32: the top half of the float (a pool task). */
static void bf16_to_f32_range(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const bf16_job *j = ctx;
    for (int64_t i = lo; i < hi; i++) {
        const uint32_t u = (uint32_t)j->src[i] << 16;
        memcpy(&j->dst[i], &u, sizeof u);
    }
}

/* Many rows run on several threads (waking them costs more than 128k
 * values on one). */
static fl_status bf16_to_f32(const uint16_t *src, float *dst, size_t n) {
    bf16_job j = {.src = src, .dst = dst};
    if (n < ((size_t)1 << 19)) {
        bf16_to_f32_range(&j, 0, (int64_t)n, 0);
        return FL_OK;
    }
    return fl_pool_for((int64_t)n, 0, bf16_to_f32_range, &j);
}

fl_status fl_forward_logits_download(fl_forward *f, int rows, float *logits) {
    fl_backend *be = f->m->be;
    const size_t n = (size_t)rows * (size_t)f->m->dims.vocab;
    if (!f->graph || !f->graph->h_logits || rows > f->lim.max_logits)
        return be->ops->download_act(be, logits, f->logits, n);
    FL_TRY(be->ops->download(be, f->graph->h_logits, f->logits, n * sizeof(uint16_t)));
    return bf16_to_f32(f->graph->h_logits, logits, n);
}

/* --- step timer ------------------------------------------------------------------ */
void fl_forward_timer_start(fl_forward *f, const fl_step_plan *p, fl_forward_timer *tm) {
    tm->on = f->graph && f->graph->timing && p->n_tokens == p->n_seqs;
    tm->discard = false;
    for (int i = 0; i < FL_FWD_T_N; i++) tm->t[i] = 0;
    if (tm->on) tm->t_last = now_s();
}

void fl_forward_timer_mark(fl_forward *f, fl_forward_timer *tm, int phase) {
    (void)f;
    if (!tm || !tm->on || phase < 0 || phase >= FL_FWD_T_N) return;
    const double t = now_s();
    tm->t[phase] += t - tm->t_last;
    tm->t_last = t;
}

fl_status fl_forward_timer_sync(fl_forward *f, fl_forward_timer *tm) {
    if (!tm->on) return FL_OK;
    FL_TRY(f->m->be->ops->sync(f->m->be));
    fl_forward_timer_mark(f, tm, FL_FWD_T_GPU);
    return FL_OK;
}

/* A step that captured a graph ran eagerly and then recorded the same ops:
 * counting it would put the capture's milliseconds into the means of a
 * graph-replayed run (one of 31 steps doubled the enqueue mean). */
void fl_forward_timer_stop(fl_forward *f, fl_forward_timer *tm) {
    if (!tm->on) return;
    tm->on = false; /* once per step, whichever path stops it */
    if (tm->discard) return;
    for (int i = 0; i < FL_FWD_T_N; i++) {
        f->graph->st.t[i] += tm->t[i];
        g_totals.t[i] += tm->t[i];
    }
    f->graph->st.timed_steps++;
    g_totals.timed_steps++;
}
