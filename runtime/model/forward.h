/*
 * forward.h — one rank's forward pass over a step plan.
 *
 * fl_forward owns the activation workspace, sized once for the largest step
 * (max_tokens rows, max_seqs sequences, max_logits projected rows), so a
 * step allocates nothing. The same code runs on every backend: it calls the
 * backend's op table only.
 *
 * Threading: one fl_forward per rank, used from one thread.
 */
#ifndef FL_FORWARD_H
#define FL_FORWARD_H

#include "parallel/comm.h"
#include "runtime/engine/kv_cache.h"
#include "runtime/model/model.h"
#include "runtime/engine/plan.h"

typedef struct fl_forward fl_forward;

typedef struct fl_forward_limits {
    int max_tokens;   /* rows per step */
    int max_seqs;     /* sequences per step */
    int max_blocks;   /* block-table row length (max context / block size, rounded up) */
    int max_logits;   /* rows projected to logits per step */
} fl_forward_limits;

/* The forward's user-facing settings, carried by the engine config
 * (fl_engine_config.fwd); core/option_list.h declares their defaults and
 * the FL_ variables that override them. */
typedef struct fl_forward_config {
    bool cuda_graphs;       /* replay decode steps as graphs where safe (forward_graph.h) */
    bool graph_ctx_buckets; /* a graph per context-length bucket too (false: per batch bucket,
                               sized for the longest context) */
    bool step_timing;       /* time the phases of each decode step (a sync per phase) */
    int moe_overlap;        /* fl_moe_overlap (forward_moe.h): the dp > 1 MoE exchange's mode */
    int moe_micro_batches;  /* micro-batches of the split exchange, 2..8 (forward_moe.h) */
    bool count_experts;     /* count the experts the device-routed MoE layers read on a GPU too
                               (fl_forward_moe_expert_reads): one download after each decode
                               step's sync; bench sets it (default false) */
} fl_forward_config;

/* The registry's declared defaults (core/option_list.h); reads no
 * environment. */
void fl_forward_config_default(fl_forward_config *c);

/* What fl_forward_init allocates, computed without allocating (the memory
 * planner, runtime/engine/mem_plan.c): backend activation buffers, host
 * scratch, and the logits buffers (backend and host), in bytes, for a model
 * of config c sharded as d, activations of act_dtype. layer_ws: the
 * backend has decode_layer (its workspace); group: the size of the sharding group (1:
 * alone), device_gather: its collectives take device buffers (NCCL). */
typedef struct fl_forward_mem {
    size_t act, host, logits_dev, logits_host;
} fl_forward_mem;
void fl_forward_mem_size(const fl_model_config *c, const fl_model_dims *d, fl_dtype act_dtype,
                         const fl_forward_limits *lim, bool layer_ws, int group, bool device_gather,
                         fl_forward_mem *out);

/* comm: the group the model is sharded over (m->shard), or NULL for a
 * whole model. Its collectives must take the backend's memory: MPI on host
 * buffers for the CPU backend, NCCL on device buffers for CUDA. Every rank
 * of the group must run the same plans, in the same order. cfg NULL: the
 * defaults. */
fl_status fl_forward_init(fl_model *m, fl_kv_cache *kv, const fl_forward_limits *lim, fl_comm *comm,
                          const fl_forward_config *cfg, fl_forward **out);
void fl_forward_free(fl_forward *f);

/* Runs the plan: writes the step's K/V into the cache and computes the f32
 * logits of plan->logit_rows (each rank its vocabulary rows, gathered across
 * the group); when logits is non-NULL they are written to
 * logits[n_logits, vocab] (host memory). A greedy plan
 * (fl_step_plan_greedy) instead takes each row's argmax on the devices
 * (lowest id on ties, like the sampler) and, when ids is non-NULL, writes
 * the tokens to ids[n_logits]; logits is then left alone. So does a
 * sampled plan (FL_PLAN_SAMPLED, see fl_forward_set_sampling). Synchronous. */
fl_status fl_forward_run(fl_forward *f, const fl_step_plan *plan, float *logits, int32_t *ids);

/* Whether plans marked FL_PLAN_SAMPLED can run: the backend samples
 * (sample_rows, copy_2d) a whole vocabulary of max_logits rows, and this
 * rank could make the buffers for it (made at the first call; if the
 * device has no room, a warning and false from then on). Under tensor
 * parallelism the group's shards are gathered (collective) and the
 * group's rank 0, which sets the rows, samples. */
bool fl_forward_can_sample(fl_forward *f);
/* The next FL_PLAN_SAMPLED run's rows, on the rank that samples (the
 * others run the plan with ids NULL): rows[n] (n = the plan's n_logits,
 * the logit rows' order) and the history ids they point into, hist[n_hist];
 * host memory, the caller's until that run returns. Such a run writes the
 * tokens to ids[n] and fails as fl_sampler_sample would on NaN or all -inf
 * logits. */
void fl_forward_set_sampling(fl_forward *f, const fl_sample_row *rows, int n, const int32_t *hist,
                             size_t n_hist);

#endif /* FL_FORWARD_H */
