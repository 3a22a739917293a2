/*
 * forward_graph.h — decode steps as replayed graphs (CUDA graphs through the
 * backend's graph_* ops), and the per-phase step timer behind
 * step_timing (--step-timing, FL_STEP_TIMING=1). Internal to the forward pass (forward.c,
 * forward_graph.c) except for the few fl_forward_graph_* calls that tests
 * and `flotilla bench` use to switch graphs and read what happened.
 *
 * Why: at batch 1 a Llama-3-8B decode step is ~500 small launches; the host
 * cannot enqueue them as fast as the GPU runs them. A decode step's shape is
 * fixed by its batch size and the longest context it must allow for, so one
 * graph per batch bucket (1, 2, 4, 8, 16, ... up to the forward's limits)
 * and context bucket (128, 256, 512, ... up to the limit: attention's work
 * is sized by it) is captured on the first step of that pair and replayed
 * afterwards, with everything that changes per step
 * (token ids, slots, context lengths, block tables, RoPE angles) in one
 * fixed device buffer refreshed by a single upload before the replay.
 * Padding rows of a bucket get slot -1 (kv_store skips them) and context 0
 * (attention outputs zeros); their logits are never downloaded.
 *
 * Where graphs are used: backends with graph ops (CUDA), no communicator
 * or NCCL on the compute stream, models whose MoE layers (if any) route on
 * the device (forward_moe_dev.c: the host-routed path copies
 * the top-k to the host inside the step; buckets then stop at its row
 * limit), no MoE all-to-all, and steps where every sequence has exactly one
 * query row and its logits wanted. Everything else runs eagerly through the same body.
 * Switch: fl_forward_config.cuda_graphs (--cuda-graphs, FL_CUDA_GRAPHS; read
 * at fl_forward_init), or fl_forward_graph_enable. A capture failure turns graphs off for that
 * forward (the step itself already ran eagerly) and is counted.
 */
#ifndef FL_FORWARD_GRAPH_H
#define FL_FORWARD_GRAPH_H

#include <stdbool.h>

#include "runtime/model/forward_impl.h"

/* Device pointers of one step's tables (see fl_forward_body). */
typedef struct fl_step_dev {
    int n;                     /* rows (tokens) of the step */
    const int32_t *tokens;     /* [n] */
    const int32_t *slots;      /* [n] KV slot per row, -1 = padding */
    const int32_t *logit_rows; /* [n_logits] rows to project, or NULL: rows 0..n_logits-1 */
    int n_logits;
    const float *cos, *sin;    /* [n, rot_dim / 2] */
} fl_step_dev;

/* Embedding, every layer and the logits of sd->n rows into f->logits
 * (enqueued only: no synchronization, no host reads, so it can be recorded). */
fl_status fl_forward_body(fl_forward *f, const fl_step_dev *sd, const fl_attn_meta *meta);

/* Phases of a timed decode step (step_timing; each includes a sync). */
enum {
    FL_FWD_T_PREP,    /* host tables (RoPE angles, plan) and their upload */
    FL_FWD_T_ENQUEUE, /* enqueueing the kernels (eager) or the graph launch */
    FL_FWD_T_GPU,     /* waiting for the GPU after the enqueue */
    FL_FWD_T_LOGITS,  /* logits download and conversion to f32 */
    FL_FWD_T_N
};

typedef struct fl_forward_timer {
    bool on;
    bool discard;          /* the step captured a graph: its phases are not a decode step's */
    double t_last;
    double t[FL_FWD_T_N];  /* this step's phases, added to the stats at stop */
} fl_forward_timer;

/* What the graph path did (per forward, or summed over the process). */
typedef struct fl_forward_graph_stats {
    bool enabled;          /* graphs on for this forward (totals: any) */
    long decode_steps;     /* decode-shaped steps seen */
    long replays;          /* steps run by replaying a graph */
    long captures;         /* graphs captured */
    long capture_failures; /* captures that failed (graphs then off) */
    long timed_steps;      /* decode steps timed (step_timing; not those that captured a graph) */
    double t[FL_FWD_T_N];  /* seconds per phase, summed over timed_steps */
    char why_off[160];     /* why graphs are off, when they are */
} fl_forward_graph_stats;

fl_status fl_forward_graph_init(fl_forward *f);
void fl_forward_graph_free(fl_forward *f);
/* Runs plan p as a graph replay (capturing first if its bucket has none)
 * when eligible; *done tells whether it ran. Leaves logits in f->logits. */
fl_status fl_forward_graph_run(fl_forward *f, const fl_step_plan *p, fl_forward_timer *tm, bool *done);
/* Turns graphs on or off for f (on only takes effect where they are safe);
 * turning them off frees the captured graphs. */
void fl_forward_graph_enable(fl_forward *f, bool on);
/* Turns graphs off for good for f (a feature enabled after init that a
 * graph cannot replay, e.g. the MoE all-to-all), with the reason in the
 * stats. */
void fl_forward_graph_forbid(fl_forward *f, const char *why);
/* For tests on backends without graph capture (the CPU backend in CI):
 * treats the backend as capable, "recording" a bucket's step as the tables
 * it ran with and "replaying" by running the same ops on the refreshed
 * tables, which is what a graph replay computes. Everything but the capture
 * itself (buckets, padding rows, fixed tables, replay bookkeeping) is then
 * exercised. No-op with the reason in the stats where graphs are unsafe
 * (MoE, MLA, sharded). */
fl_status fl_forward_graph_emulate(fl_forward *f);
void fl_forward_graph_get_stats(const fl_forward *f, fl_forward_graph_stats *out);
/* Sums over every forward of the process (for `flotilla bench`, whose
 * engine owns its forward); not thread-safe, like a forward. */
void fl_forward_graph_totals(fl_forward_graph_stats *out);

/* Downloads the f32 logits of rows 0..rows-1 of f->logits (a whole,
 * unsharded vocabulary) into host `logits` [rows, vocab]; synchronous.
 * bf16 backends with page-locked memory go through a staging buffer
 * allocated at init and convert on several threads when there are many
 * rows (16 x 128256 values took 3-4 ms through download_act's pageable copy
 * and one-thread conversion); others use download_act. */
fl_status fl_forward_logits_download(fl_forward *f, int rows, float *logits);

/* The step timer: start, mark the end of a phase, sync-and-mark before the
 * logits download, stop. No-ops unless step_timing is on and p is a decode
 * step (every sequence one row). */
void fl_forward_timer_start(fl_forward *f, const fl_step_plan *p, fl_forward_timer *tm);
void fl_forward_timer_mark(fl_forward *f, fl_forward_timer *tm, int phase);
fl_status fl_forward_timer_sync(fl_forward *f, fl_forward_timer *tm);
void fl_forward_timer_stop(fl_forward *f, fl_forward_timer *tm);

#endif /* FL_FORWARD_GRAPH_H */
