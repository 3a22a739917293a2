/*
 * sampler.h — picks the next token from one sequence's logits.
 *
 * The semantics follow Hugging Face transformers' generate() (checked against
 * transformers 5.24, generation/utils.py _get_logits_processor and
 * generation/logits_process.py) so that a flotilla job and an HF reference run
 * with the same parameters draw from the same distribution:
 *
 *   1. repetition penalty  (RepetitionPenaltyLogitsProcessor; a "processor",
 *                           so it also applies to greedy decoding)
 *   2. temperature         (TemperatureLogitsWarper: logits / T)
 *   3. top-k               (TopKLogitsWarper: keep every token whose score is
 *                           >= the k-th largest score; ties at the boundary
 *                           are kept)
 *   4. top-p               (TopPLogitsWarper: in descending order keep a token
 *                           while the probability mass strictly above it is
 *                           < top_p; the top token is always kept)
 *   5. min-p               (MinPLogitsWarper: drop tokens whose probability is
 *                           < min_p * max probability; the top token is kept)
 *   then softmax over the survivors and an inverse-CDF draw with the rng.
 * Steps 2-5 are HF's "warpers", appended only when do_sample, in exactly this
 * order after the processors. Temperature 0 means greedy: argmax after the
 * repetition penalty, the lowest token id winning ties (torch.argmax).
 *
 * Cost: one O(n_vocab) pass for the argmax/NaN check (greedy stops there),
 * one that applies the temperature and keeps only tokens within e^-60 of the
 * top (the rest cannot matter to a double-precision draw), then work on
 * those candidates only: top-k by a 3-way quickselect (partial selection, no
 * sort), top-p by a weighted quickselect (O(candidates) expected, no sort),
 * min-p by a threshold. Measured on a 152k vocabulary (one core of the dev
 * machine): greedy ~0.3 ms, sampling 1.5-4 ms per row depending on the
 * filters. No allocation: the caller passes a workspace of
 * fl_sampler_workspace_size(n_vocab) bytes (one per thread).
 *
 * Threading: re-entrant; each concurrent caller needs its own rng and
 * workspace.
 */
#ifndef FL_SAMPLER_H
#define FL_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_sampling_params {
    float temperature;        /* 0 = greedy; >= 0 */
    int top_k;                /* 0 = off; >= 0 */
    float top_p;              /* 1 = off; in (0, 1] */
    float min_p;              /* 0 = off; in [0, 1] */
    float repetition_penalty; /* 1 = off; > 0. HF semantics: logit > 0 ? logit / p
                                 : logit * p, applied once to every distinct token id
                                 in the history (prompt + generated) */
    uint64_t seed;            /* seeds the per-sequence rng (fl_rng_seed) */
} fl_sampling_params;

/* Greedy, every filter off, seed 0. */
void fl_sampling_params_default(fl_sampling_params *p);

/* Checks ranges; FL_ERR_INVALID_ARG naming the parameter and its value. */
fl_status fl_sampling_params_validate(const fl_sampling_params *p);

/* xoshiro256** (Blackman & Vigna), state seeded from a 64-bit seed through
 * splitmix64 so that nearby seeds give unrelated streams. */
typedef struct fl_rng {
    uint64_t s[4];
} fl_rng;

void fl_rng_seed(fl_rng *r, uint64_t seed);
uint64_t fl_rng_next(fl_rng *r);
/* Uniform double in [0, 1) with 53 random bits. */
double fl_rng_uniform(fl_rng *r);

/* HF's repetition penalty of one logit: divided when positive, multiplied
 * otherwise. */
static inline float fl_sampler_penalize(float logit, float penalty) {
    return logit > 0.0f ? logit / penalty : logit * penalty;
}

/* Bytes of workspace fl_sampler_sample needs for this vocabulary size
 * (20 bytes per token; 3 MB for a 150k vocabulary). */
size_t fl_sampler_workspace_size(int n_vocab);

/* Picks one token id from logits[n_vocab] (not modified).
 * history[n_history]: token ids seen so far (prompt + generated) for the
 *   repetition penalty; may be NULL when n_history is 0. Ids outside
 *   [0, n_vocab) are rejected.
 * rng: advanced by exactly one draw when sampling (not used, may be NULL,
 *   when temperature is 0).
 * workspace: caller-owned, fl_sampler_workspace_size(n_vocab) bytes, any
 *   alignment of malloc.
 * Returns FL_ERR_INVALID_ARG for bad parameters (naming the parameter), NaN
 * logits, or logits that are all -inf. */
fl_status fl_sampler_sample(const fl_sampling_params *p, const float *logits, int n_vocab,
                            const int32_t *history, size_t n_history, fl_rng *rng,
                            void *workspace, int32_t *out_token);

/* fl_sampler_sample with the draw given: u in [0, 1) is what the rng's one
 * draw would have been (fl_rng_uniform), not used when temperature is 0.
 * The survivors of the filters are walked in id order for the draw, so the
 * result is a function of the logits, the parameters and u alone; the
 * backends' sample_rows (kernels/backend.h) compute the same function where
 * the logits are. */
fl_status fl_sampler_sample_u(const fl_sampling_params *p, const float *logits, int n_vocab,
                              const int32_t *history, size_t n_history, double u, void *workspace,
                              int32_t *out_token);


/* ---- OpenAI-style options (applied by the engine on the host) ------------- */

/* OpenAI's presence and frequency penalties on logits[n_vocab], in place:
 * every token id t that occurs c > 0 times in generated[n] (the completion so
 * far, not the prompt) loses presence + frequency * c. seen: caller scratch
 * of n_vocab bytes, all zero on entry and left all zero. FL_ERR_INVALID_ARG
 * for an id outside [0, n_vocab). */
fl_status fl_sampler_penalize_counts(float *logits, int n_vocab, const int32_t *generated,
                                     size_t n, float presence, float frequency, uint8_t *seen);

/* Sets logits[ids[i]] to -inf for each id in [0, n_vocab) (vLLM's min_tokens:
 * EOS cannot be drawn before the minimum length); others are skipped. */
void fl_sampler_mask_ids(float *logits, int n_vocab, const int32_t *ids, int n_ids);

#define FL_SAMPLER_MAX_TOP_LOGPROBS 20

/* Log-probabilities of logits[n_vocab] (log-softmax, accumulated in double):
 * *chosen_lp = that of token `chosen`, and the n_top (0..20) most likely ids
 * with theirs in top_ids/top_lps, most likely first, ties to the lower id.
 * FL_ERR_INVALID_ARG for NaN logits, all -inf, or a bad chosen/n_top. */
fl_status fl_sampler_logprobs(const float *logits, int n_vocab, int32_t chosen, int n_top,
                              float *chosen_lp, int32_t *top_ids, float *top_lps);

#ifdef __cplusplus
}
#endif
#endif /* FL_SAMPLER_H */
