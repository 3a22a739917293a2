/*
 * engine.h — one rank's engine: model + paged KV cache + forward + (on the
 * scheduling rank) the scheduler and the sampler.
 *
 * Step loop (docs/engine.md): schedule -> plan -> forward -> sample -> append.
 * The engine finishes sequences on EOS and on length limits; callers
 * finish them on anything else (stop strings) with fl_engine_finish.
 *
 * Ownership: fl_gen objects belong to the caller, who keeps them alive
 * until they are finished; the engine only points to them.
 */
#ifndef FL_ENGINE_H
#define FL_ENGINE_H

#include <stdbool.h>
#include <stddef.h>

#include "runtime/model/forward.h"
#include "core/sampler.h"
#include "runtime/engine/scheduler.h"
#include "runtime/engine/mem_plan.h"
#include "runtime/engine/route.h"

typedef enum fl_finish_reason {
    FL_FINISH_NONE = 0,
    FL_FINISH_STOP,    /* EOS token or a stop string */
    FL_FINISH_LENGTH,  /* max_tokens or max_model_len reached */
    FL_FINISH_ERROR,   /* could not run (message in fl_gen.error) */
} fl_finish_reason;

const char *fl_finish_reason_str(fl_finish_reason r); /* "stop", "length", "error" */

typedef struct fl_gen {
    fl_seq seq;
    fl_sampling_params sp;
    fl_rng rng;
    int max_new_tokens;
    fl_finish_reason finish;
    char error[256];
    double t_added, t_first_token, t_finished; /* seconds, fl_engine_now() clock */
    int replica;            /* data-parallel replica serving it (set by fl_engine_add) */
    int n_routed;           /* dp > 1: its prompt blocks counted in the replica's route set */
    void *user;
    /* OpenAI / vLLM options, zero = off. Any of them but ignore_eos makes the
     * steps that sample this request bring its logits to rank 0 (no on-device
     * greedy pick or sampling), where they are applied. */
    float presence_penalty;  /* subtracted once from each token already generated */
    float frequency_penalty; /* subtracted per occurrence in the generated tokens */
    int min_tokens;          /* EOS ids are masked until this many tokens are generated */
    bool ignore_eos;         /* EOS does not finish the request */
    bool want_logprobs;      /* record lp[] for every generated token */
    int top_logprobs;        /* alternatives recorded per token, 0..FL_SAMPLER_MAX_TOP_LOGPROBS */
    struct fl_token_logprob *lp; /* [n_generated] when want_logprobs; freed by fl_gen_free */
    size_t lp_cap;
} fl_gen;

/* One generated token's log-probabilities, from the model's raw logits
 * (log-softmax before penalties, temperature and filters, as vLLM reports
 * them by default). */
typedef struct fl_token_logprob {
    float logprob;                                 /* the chosen token's */
    int n_top;
    int32_t top_ids[FL_SAMPLER_MAX_TOP_LOGPROBS];  /* most likely first */
    float top_lps[FL_SAMPLER_MAX_TOP_LOGPROBS];
} fl_token_logprob;

/* Copies the prompt; sp may be NULL (greedy). */
fl_status fl_gen_init(fl_gen *g, int64_t id, const int32_t *prompt, int n_prompt,
                      const fl_sampling_params *sp, int max_new_tokens);
void fl_gen_free(fl_gen *g);
static inline int fl_gen_n_generated(const fl_gen *g) { return g->seq.n_tokens - g->seq.n_prompt; }

typedef struct fl_engine_config {
    int block_size;             /* default 16 */
    int n_blocks;               /* 0: derive from kv_cache_bytes */
    size_t kv_cache_bytes;      /* 0 (default): sized from memory (docs/engine.md, "Memory"):
                                   CUDA: gpu_memory_utilization of the device less what the
                                   weights and workspaces took; CPU: memory_budget less the
                                   same; either capped at max_model_len x max_num_seqs tokens,
                                   and the minimum over the ranks */
    double gpu_memory_utilization; /* default 0.90 */
    size_t memory_budget;       /* CPU: bytes; 0: fl_mem_cpu_default_budget() */
    fl_kv_dtype kv_dtype;       /* default AUTO: the backend's activation dtype */
    bool verbose;               /* log the memory plan next to what was measured (stderr) */
    int max_num_seqs;           /* 0 (default): what the cache holds (fl_mem_default_max_seqs) */
    int max_num_batched_tokens; /* 0 (default): fl_mem_default_batched_tokens (CUDA 8192, CPU 512) */
    int max_model_len;          /* 0: the model's max_position_embeddings, capped by the cache */
    const int32_t *extra_eos;   /* more stop ids (e.g. the tokenizer's EOS), may be NULL */
    int n_extra_eos;
    fl_comm *comm;              /* the group the model is sharded over, or NULL; rank 0 of it
                                   schedules and samples, the others follow (fl_engine_follow) */
    /* Data parallelism (dp > 1): world = tp x dp ranks, tp-fastest
     * (parallel/groups.h). comm is then this replica's tp group; world rank 0
     * schedules every replica and samples for every sequence. */
    int dp;                     /* replicas; 0 or 1: one */
    MPI_Comm world;             /* dp > 1: all ranks (host buffers: plans and logits travel
                                   over MPI on every backend); MPI_COMM_NULL otherwise */
    fl_comm *ep_comm;           /* dp > 1 with MoE layers: this rank's expert-parallel group,
                                   which runs the all-to-all token exchange (backend memory like
                                   comm); NULL otherwise */
    /* User-facing settings (flags, --config keys and FL_ variables of
     * core/option_list.h; fl_engine_config_default gives the declared
     * defaults and reads no environment). */
    bool greedy_on_device;      /* default true (--greedy-on-device off: false): a step whose
                                   sampled sequences all decode greedily without a repetition
                                   penalty takes each row's argmax where the logits are and brings
                                   only the token ids to rank 0 (runtime/model/forward_pick.c); the
                                   tokens are the same either way */
    bool sample_on_device;      /* default true (--sample-on-device off: false): any other
                                   step samples where the logits are when the backend samples
                                   (under tensor parallelism the vocabulary shards are gathered
                                   to the group's rank 0 first; with dp > 1 each replica's rows
                                   travel with its plan and come back as tokens); each sequence's rng
                                   gives the draw, so the tokens are those of the host sampler
                                   over the same logits */
    fl_forward_config fwd;      /* CUDA graphs, step timing, the MoE exchange (forward.h) */
    bool prefix_caching;        /* default true: full KV blocks of equal prompt prefixes are
                                   computed once and shared (scheduler.h, docs/engine.md "Prefix
                                   caching"); off for dynamic-NTK RoPE, whose K depend on the
                                   prompt's length */
    size_t swap_space_bytes;    /* default --swap-space (4 GiB): host memory per rank for the KV
                                   blocks of sequences preempted by swap (scheduler.h,
                                   docs/engine.md "Preemption"); 0: preempt by recompute only */
    const char *kv_offload_dir; /* --kv-offload-dir: the folder of the KV cache's disk tier
                                   (kv_disk.h, docs/engine.md "KV offload to disk"), or NULL
                                   (off); needs prefix caching and dp 1; borrowed during
                                   fl_engine_init only */
    const char *model_id;       /* the checkpoint's identity (its path) for the cache
                                   fingerprint, or NULL; borrowed during fl_engine_init only */
    /* Tests: called on rank 0 with each sampled row's logits when they reach
     * the host (steps that pick or sample on the devices have none), before
     * the token is sampled. NULL: none. */
    void (*on_logits)(void *ctx, const fl_gen *g, const float *logits, int vocab);
    void *on_logits_ctx;
} fl_engine_config;

/* The defaults: those above, and the registry's declared defaults for the
 * user-facing settings. Reads no environment. */
void fl_engine_config_default(fl_engine_config *c);
/* --swap-space's text: GiB, a decimal number from 0 (off) to 2^20. */
fl_status fl_engine_parse_swap_space(const char *text, double *gib);

typedef struct fl_engine fl_engine;

fl_status fl_engine_init(fl_model *m, const fl_engine_config *cfg, fl_engine **out);
/* The settings in force after init (derived sizes filled in). */
const fl_engine_config *fl_engine_config_of(const fl_engine *e);
void fl_engine_free(fl_engine *e);
int fl_engine_max_model_len(const fl_engine *e);

/* Queues a request. With dp > 1 it goes to the replica fl_engine_pick_replica
 * names. Prompts that can never run (too long) are refused
 * with FL_ERR_INVALID_ARG and a message; the caller reports them. */
fl_status fl_engine_add(fl_engine *e, fl_gen *g);
bool fl_engine_has_work(const fl_engine *e);
/* The replica fl_engine_add gives q, of dp schedulers: the least
 * load(r) + q's tokens - FL_ROUTE_PREFIX_WEIGHT * (q's prompt tokens that
 * replica r holds in its prefix cache, or that a request placed there and
 * not yet finished shares with q: routed[r], NULL for none), ties to the
 * lowest index. load(r): the tokens of r's running and waiting sequences
 * (prompt + generated: the KV cache they hold or will hold). Without
 * prefix caching that is the least loaded replica. Computes q's prompt
 * block identities (fl_scheduler_prompt_hashes); changes nothing else. */
int fl_engine_pick_replica(fl_scheduler *sched, const fl_route_set *routed, int dp, fl_seq *q);
/* A shared prompt token counts as this many tokens of load: requests with
 * a common prefix gather on one replica while the replicas' loads differ by
 * less than this many times the prefix (docs/parallel.md). */
#define FL_ROUTE_PREFIX_WEIGHT 4

/* Runs one step. *updated lists the requests that received a token this
 * step (valid until the next call); those with finish != NONE are done
 * and no longer referenced by the engine. */
fl_status fl_engine_step(fl_engine *e, fl_gen ***updated, int *n_updated);

/* Finishes a request early (stop string, cancellation). */
void fl_engine_finish(fl_engine *e, fl_gen *g, fl_finish_reason r);

/* Runs one prompt through the model and writes logits for every position
 * into out[n, vocab] (chunked by max_num_batched_tokens). Uses and then
 * releases KV blocks; the engine must be idle. */
fl_status fl_engine_prompt_logits(fl_engine *e, const int32_t *ids, int n, float *out);

/* Rank 0 of a sharded engine (world rank 0 with dp > 1): has this rank the
 * scheduler? (true when not sharded). */
bool fl_engine_is_leader(const fl_engine *e);

/* Followers (ranks other than 0): receive step plans from rank 0 and run
 * them until rank 0 calls fl_engine_release_followers. */
fl_status fl_engine_follow(fl_engine *e);
/* Rank 0: tells the followers there is no more work (call once, at the end,
 * also after a failure that leaves the group intact). */
fl_status fl_engine_release_followers(fl_engine *e);

/* Monotonic seconds. */
double fl_engine_now(void);

/* Step statistics. */
typedef struct fl_engine_stats {
    int64_t steps, prefill_tokens, decode_tokens;
    int64_t preemptions;          /* sequences preempted for want of KV blocks, both ways */
    int64_t swap_preemptions;     /* ... of which swapped to the host pool (the rest: recomputed) */
    int64_t swap_out_bytes, swap_in_bytes; /* KV bytes moved to and from the host pools (all ranks) */
    int64_t greedy_steps;  /* steps whose tokens were picked on the devices (greedy_on_device) */
    int64_t peak_running;  /* most sequences running at once (every replica together) */
    int64_t sampled_steps; /* steps sampled on the device (sample_on_device) */
    int64_t prompt_tokens;        /* prompt tokens of admitted requests (each counted once) */
    int64_t cached_prompt_tokens; /* ... of which the prefix cache held the K/V */
    int64_t disk_hit_blocks, disk_hit_tokens; /* ... blocks (tokens) of those read from the disk tier */
    bool kv_disk;                 /* the disk tier (--kv-offload-dir) is on */
    int64_t kv_blocks;            /* KV blocks of every replica's cache */
    int64_t peak_kv_blocks_used;  /* most of them held by running sequences at once, measured
                                     after each step's scheduling (prefix-cached blocks that no
                                     sequence references are free to reuse, so not counted) */
    double forward_seconds;
    /* steps with prompt rows (prefill or recomputation) in any replica, and
     * their share of forward_seconds: the rest are decode-only steps */
    int64_t prefill_steps;
    double prefill_forward_seconds;
    /* now (every replica together): sequences running and waiting, and KV
     * blocks in use (referenced by a sequence) of kv_blocks */
    int64_t running, waiting, kv_blocks_used;
    /* the host swap pools' blocks (every replica's) and those holding
     * swapped-out blocks now (0 and 0: no pool) */
    int64_t swap_blocks, swap_blocks_used;
} fl_engine_stats;
void fl_engine_get_stats(const fl_engine *e, fl_engine_stats *s);
/* Zeroes the peak counters, so that a benchmark's next run on the same
 * engine reports its own peaks (the other counters are read as differences). */
void fl_engine_reset_peaks(fl_engine *e);

#endif /* FL_ENGINE_H */
