/*
 * scheduler.h — rank 0's continuous-batching scheduler over the paged KV
 * cache.
 *
 * Each step it (1) continues the running sequences — one decode token each,
 * or the next chunk of an unfinished prefill — and (2) admits waiting
 * sequences while max_num_seqs, the max_num_batched_tokens budget and free
 * KV blocks allow, prefilling long prompts in chunks. When a running
 * sequence needs a block and none is free, the most recently admitted
 * sequence is preempted and goes back to the front of the queue, in one of
 * two ways (docs/engine.md, "Preemption"):
 *  - swap: its private blocks (one reference: its own) are copied to the
 *    host pool (kv_swap.h) and freed; blocks it shares with other sequences
 *    stay on the device, referenced by it. On resumption fresh blocks take
 *    the copies back (or a prefix-cached copy still on the device is taken
 *    instead) and it goes on where it stopped;
 *  - recompute (vLLM's): its blocks are freed and it is prefilled again.
 * Swap is chosen when the pool has room for its private blocks and the cost
 * model fl_sched_swap_pays says copying them out and back is cheaper than
 * recomputing their tokens. The step plan carries the moves (swap-outs,
 * then swap-ins) that every rank makes before the step's forward. Host
 * blocks freed by a swap-in are reused from the next step on, so no step
 * writes a host block that the same step reads.
 *
 * Prefix caching (cfg.prefix_caching): when a sequence is admitted, its
 * leading full blocks are looked up in the block index (kv_cache.h) chain by
 * chain; the blocks found join its block table and are not computed again,
 * but the last token is always computed so that its logits exist (at most
 * n_tokens - 1 tokens, in whole blocks, come from the cache). Every full
 * block a step computes is published as soon as the step is planned, so a
 * sequence admitted later in the same step already shares it: the forward
 * writes each layer's K/V of all rows before any row attends. Sequences
 * only ever write positions past their shared blocks.
 *
 * The disk tier (disk != NULL, kv_disk.h): a block the device index misses
 * at admission, which the disk index has, gets a fresh block, is published
 * and listed in the step's disk-in list (its K/V are read before the
 * forward, after the swap-ins). Each newly published block that is not on
 * disk yet goes into the next step's persist list, once its K/V exist; a
 * block reallocated before that is dropped from the list.
 *
 * The scheduler decides and writes the step plan; it never touches model
 * memory. Sequences are owned by the caller; the scheduler holds pointers.
 */
#ifndef FL_SCHEDULER_H
#define FL_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "runtime/engine/kv_cache.h"
#include "runtime/engine/kv_disk.h"
#include "runtime/engine/plan.h"

typedef enum fl_seq_state {
    FL_SEQ_NEW = 0,
    FL_SEQ_WAITING,
    FL_SEQ_RUNNING,
    FL_SEQ_FINISHED,
} fl_seq_state;

typedef struct fl_seq {
    int64_t id;            /* caller's handle */
    int32_t *tokens;       /* [n_tokens] prompt then generated ids (malloc'd, seq owns) */
    int n_tokens, cap;
    int n_prompt;
    int n_computed;        /* tokens whose K/V are in the cache */
    int32_t *blocks;       /* [n_blocks] block table */
    int n_blocks, blocks_cap;
    fl_seq_state state;
    int n_preempted;       /* times it was preempted (stats) */
    int n_cached;          /* prompt tokens found in the prefix cache at first admission */
    uint64_t *hashes;      /* [n_hashes] identities of its first full blocks (prefix caching) */
    int n_hashes, hashes_cap;
    int n_published;       /* leading blocks already looked up or published */
    int32_t *host_blocks;  /* [blocks_cap] while swapped out: the host pool block of each entry
                              whose blocks[i] is -1 (moved there) */
    int n_swapped;         /* entries now in the host pool (0: not swapped out) */
    int n_swaps;           /* times it was preempted by swap (stats) */
    /* filled by schedule() for the current step */
    int step_rows;         /* rows this step */
    bool step_sample;      /* its last row's logits are sampled this step */
} fl_seq;

/* Initializes a sequence with a copy of the prompt. */
fl_status fl_seq_init(fl_seq *s, int64_t id, const int32_t *prompt, int n_prompt);
fl_status fl_seq_append(fl_seq *s, int32_t token);
void fl_seq_free(fl_seq *s);

typedef struct fl_sched_config {
    int block_size;             /* tokens per KV block (default 16) */
    int n_blocks;               /* blocks in the cache */
    int max_num_seqs;           /* sequences per step */
    int max_num_batched_tokens; /* rows per step (prefill chunk budget) */
    int max_model_len;          /* prompt + generated tokens per sequence */
    bool prefix_caching;        /* share full blocks of equal prefixes (kv_cache.h) */
    uint64_t prefix_seed;       /* the cache fingerprint (fl_kv_fingerprint) */
    int n_host_blocks;          /* blocks of the host swap pool (0: preempt by recompute only) */
    double block_copy_seconds;  /* one block moved one way, every layer (fl_kv_swap_measure) */
} fl_sched_config;

/* The preemption cost model: swapping pays when moving n_blocks blocks out
 * and back in, 2 * n_blocks * block_copy_seconds, takes less time than
 * prefilling the n_tokens a recompute would compute again, n_tokens /
 * prefill_tok_per_s. Both rates are measured (the copy once at start-up, the
 * prefill rate as the best rows per second of any step so far); an
 * unmeasured prefill rate (0) counts as swapping paying. Short sequences
 * lose: each block's copies carry a fixed cost (2 per layer), while a few
 * tokens ride along in a step that runs anyway. */
bool fl_sched_swap_pays(int n_blocks, int n_tokens, double block_copy_seconds, double prefill_tok_per_s);

typedef struct fl_scheduler {
    fl_sched_config cfg;
    fl_kv_blocks blocks;
    fl_seq **waiting;    /* FIFO ring */
    int w_head, w_len, w_cap;
    fl_seq **running;    /* admission order */
    int n_running, r_cap;
    fl_seq **step;       /* sequences of the current step, in plan order */
    int n_step;
    int64_t n_preemptions;      /* every preemption, swapped or recomputed */
    int64_t n_swap_preemptions; /* ... of which by swap */
    int64_t blocks_swapped_out, blocks_swapped_in; /* blocks moved (one rank's shard each) */
    double prefill_tok_per_s;   /* the cost model's prefill rate; the engine measures it */
    /* the host pool's blocks: free ones, and those freed during this step
     * (free again from the next step) */
    int32_t *host_free, *host_pending;
    int n_host_free, n_host_pending;
    /* this step's moves (plan.h): (device, host) and (host, device) pairs */
    int32_t *swap_out, *swap_in;
    int n_swap_out, n_swap_in;
    /* prefix caching: prompt tokens of admitted sequences (first admission
     * only) and how many of them came from the cache */
    int64_t prompt_tokens, cached_prompt_tokens;
    /* the disk tier (kv_disk.h), or NULL: rank 0's index; blocks published
     * and not yet written (persist-list entries plus the block's generation,
     * FL_PLAN_PERSIST_WORDS + 1 words each): those of the previous step go
     * into this step's plan; this step's disk-ins (FL_PLAN_DISK_IN_WORDS
     * each); blocks read from disk (stats) */
    fl_kv_disk *disk;
    int32_t *persist_new, *persist_now, *disk_in;
    int n_persist_new, n_persist_now, n_disk_in;
    int cap_persist_new, cap_persist_now, cap_disk_in;
    int64_t disk_hit_blocks;
    /* block identity function (fl_kv_block_hash); tests replace it to
     * force hash collisions */
    uint64_t (*block_hash)(uint64_t seed, uint64_t parent, const int32_t *tokens, int n);
} fl_scheduler;

fl_status fl_scheduler_init(fl_scheduler *s, const fl_sched_config *cfg);
void fl_scheduler_free(fl_scheduler *s);

/* Queues a sequence. A prompt longer than max_model_len - 1, or one that
 * could never fit in the cache, is refused with FL_ERR_INVALID_ARG. */
fl_status fl_scheduler_add(fl_scheduler *s, fl_seq *seq);
/* With prefix caching: computes the identities of q's prompt blocks that a
 * cache could hold (all but the block of its last token) into q->hashes
 * and returns how many (0 without prefix caching or memory). */
int fl_scheduler_prompt_hashes(fl_scheduler *s, fl_seq *q);
/* How many of q's first n blocks (hashed) s's cache holds as a run from
 * the first, changing nothing. */
int fl_scheduler_cached_prefix(const fl_scheduler *s, const fl_seq *q, int n);
bool fl_scheduler_has_work(const fl_scheduler *s);

/* Decides the next step and writes it into plan. After it, s->step lists
 * the step's sequences (plan order), each with step_rows/step_sample set.
 * An empty plan (n_tokens == 0) means nothing can run. */
fl_status fl_scheduler_schedule(fl_scheduler *s, fl_step_plan *plan);

/* A plan of no rows that writes the blocks still waiting to be persisted
 * (the job's end: their K/V exist once the last step ran); *n_persist = how
 * many (0: nothing to run). */
fl_status fl_scheduler_flush_persist(fl_scheduler *s, fl_step_plan *plan, int *n_persist);

/* Marks the step's rows as computed (call after the forward ran). */
void fl_scheduler_step_done(fl_scheduler *s);

/* Removes a finished (or failed) sequence and frees its blocks (device
 * and host). */
void fl_scheduler_finish(fl_scheduler *s, fl_seq *seq);

#endif /* FL_SCHEDULER_H */
