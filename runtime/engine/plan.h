/*
 * plan.h — the step plan: everything every rank needs to run one engine
 * step, decided by rank 0's scheduler (docs/engine.md, "Data path of one step").
 *
 * The plan is one flat int32 array, so broadcasting it is a single
 * MPI_Bcast of fl_step_plan_words() words; the named fields are views into
 * it. Layout: header[FL_PLAN_HEADER], then tokens, positions, slots
 * (n_tokens each), q_start (n_seqs + 1), ctx_len (n_seqs), block_tables
 * (n_seqs * max_blocks), logit_rows (n_logits), rope_len (n_seqs), then the
 * KV swap lists: swap_out (n_swap_out pairs) and swap_in (n_swap_in pairs),
 * then the disk tier's lists (kv_disk.h): persist (n_persist entries of
 * FL_PLAN_PERSIST_WORDS) and disk_in (n_disk_in entries of
 * FL_PLAN_DISK_IN_WORDS). Everything before the swap lists is what the
 * forward reads on the device (fl_step_plan_forward_words).
 */
#ifndef FL_PLAN_H
#define FL_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#define FL_PLAN_HEADER 12
/* A persist entry: block id, hash (low, high word), parent hash (low, high),
 * then the block's block_size token ids. A disk-in entry: block id, hash. */
#define FL_PLAN_PERSIST_WORDS(block_size) (5 + (size_t)(block_size))
#define FL_PLAN_DISK_IN_WORDS 3

typedef struct fl_step_plan {
    int32_t *buf;          /* owns the words */
    size_t cap;            /* words allocated */
    int n_tokens;          /* query rows this step */
    int n_seqs;
    int max_blocks;        /* block-table row length */
    int n_logits;          /* rows whose logits rank 0 needs */
    int block_size;
    int32_t *tokens;       /* [n_tokens] token ids */
    int32_t *positions;    /* [n_tokens] absolute positions */
    int32_t *slots;        /* [n_tokens] KV cache slot of each token */
    int32_t *q_start;      /* [n_seqs + 1] */
    int32_t *ctx_len;      /* [n_seqs] tokens in cache after this step */
    int32_t *block_tables; /* [n_seqs, max_blocks] */
    int32_t *logit_rows;   /* [n_logits] rows (into the step's tokens) to project */
    int32_t *rope_len;     /* [n_seqs] sequence length that dynamic-NTK RoPE scales for:
                              the whole prompt during a chunked prefill (as transformers
                              sees it in one forward), else ctx_len */
    /* KV blocks every rank moves before the step's forward, swap-outs first
     * (runtime/engine/kv_swap.h): a device block freed by a swap-out may be
     * a swap-in's destination or a new block of the same step. */
    int n_swap_out, n_swap_in;
    int32_t *swap_out;     /* [n_swap_out, 2] (device block, host block) */
    int32_t *swap_in;      /* [n_swap_in, 2] (host block, device block) */
    /* The disk tier (kv_disk.h): blocks every rank writes to its files
     * before the swaps (their K/V were computed by earlier steps), and
     * blocks every rank reads from its files after the swaps. */
    int n_persist, n_disk_in;
    int32_t *persist;      /* [n_persist, FL_PLAN_PERSIST_WORDS(block_size)] */
    int32_t *disk_in;      /* [n_disk_in, FL_PLAN_DISK_IN_WORDS] */
} fl_step_plan;

/* 64-bit values (block hashes) in two plan words, low word first. */
static inline void fl_plan_put_u64(int32_t *w, uint64_t v) {
    w[0] = (int32_t)(uint32_t)v;
    w[1] = (int32_t)(uint32_t)(v >> 32);
}
static inline uint64_t fl_plan_get_u64(const int32_t *w) {
    return (uint64_t)(uint32_t)w[0] | (uint64_t)(uint32_t)w[1] << 32;
}

/* Header words: 0 magic, 1 n_tokens, 2 n_seqs, 3 max_blocks, 4 n_logits,
 * 5 block_size, 6 the engine's command, 7 the output, 8 n_swap_out,
 * 9 n_swap_in, 10 n_persist, 11 n_disk_in.
 * Header word 7: the step's output, set by rank 0 after filling the plan;
 * it travels with the plan.
 *  FL_PLAN_LOGITS:  the logits of the logit rows;
 *  FL_PLAN_GREEDY:  each logit row's argmax token only (every sampled
 *                   sequence of the step decodes greedily without a
 *                   repetition penalty);
 *  FL_PLAN_SAMPLED: each logit row's token sampled where the logits are
 *                   (fl_forward_set_sampling gave the rows' parameters on
 *                   each replica's rank that samples; with dp > 1 they
 *                   travel after each plan, engine.c share_plans_dp). */
enum { FL_PLAN_LOGITS = 0, FL_PLAN_GREEDY = 1, FL_PLAN_SAMPLED = 2 };
static inline int fl_step_plan_output(const fl_step_plan *p) { return p->buf[7]; }
static inline void fl_step_plan_set_output(fl_step_plan *p, int out) { p->buf[7] = out; }
static inline int fl_step_plan_greedy(const fl_step_plan *p) { return p->buf[7] == FL_PLAN_GREEDY; }
/* Tokens rather than logits come back (greedy or sampled). */
static inline int fl_step_plan_picks(const fl_step_plan *p) { return p->buf[7] != FL_PLAN_LOGITS; }

/* Sizes the plan for the given counts (grows buf as needed) and sets the
 * views; contents are left for the caller to fill. */
fl_status fl_step_plan_resize(fl_step_plan *p, int n_tokens, int n_seqs, int max_blocks,
                              int n_logits, int block_size);
/* Sizes the swap lists (after fl_step_plan_resize, which leaves them
 * empty), keeping the rest of the plan; contents are the caller's. */
fl_status fl_step_plan_set_swaps(fl_step_plan *p, int n_swap_out, int n_swap_in);
/* Sizes the disk lists (after fl_step_plan_set_swaps), keeping the rest
 * of the plan; contents are the caller's. */
fl_status fl_step_plan_set_disk(fl_step_plan *p, int n_persist, int n_disk_in);
/* Words of the serialized plan (header included). */
size_t fl_step_plan_words(const fl_step_plan *p);
/* Its leading words that the forward needs: all but the swap lists. */
size_t fl_step_plan_forward_words(const fl_step_plan *p);
/* Rebuilds the views after buf[0..FL_PLAN_HEADER) was received; checks the
 * counts are sane (FL_ERR_INTERNAL otherwise) and grows buf, copying the
 * header. The caller then receives the remaining words into buf. */
fl_status fl_step_plan_from_header(fl_step_plan *p, const int32_t *header);
/* Checks internal consistency (row counts, positions, slots in range) —
 * used by tests and in debug runs. n_slots: cache capacity in tokens. */
fl_status fl_step_plan_validate(const fl_step_plan *p, int64_t n_slots);
void fl_step_plan_free(fl_step_plan *p);

#endif /* FL_PLAN_H */
