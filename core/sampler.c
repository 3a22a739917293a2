/*
 * sampler.c — HF-compatible token sampling (see sampler.h for the processor
 * order and its source) and the xoshiro256** generator behind it.
 *
 * Why the candidate-list design: with a 150k vocabulary a full sort per token
 * per sequence would dominate the host side of a decode step. Every filter
 * here shrinks a list of (score, id) candidates instead: top-k by a 3-way
 * quickselect (O(n), robust to the many equal scores that masked logits
 * produce), top-p by sorting only the tokens above a probability threshold
 * that already hold top_p of the mass, min-p by a threshold that does not
 * depend on the normalisation (p_i >= min_p * p_max  <=>  exp(s_i - s_max) >= min_p).
 * Probabilities are accumulated in double; scores are kept in float like HF.
 */
#include "core/sampler.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct cand {
    float s;    /* processed score (logit after penalty / temperature) */
    int32_t id; /* token id */
} cand;

void fl_sampling_params_default(fl_sampling_params *p) {
    if (!p) return;
    p->temperature = 0.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->min_p = 0.0f;
    p->repetition_penalty = 1.0f;
    p->seed = 0;
}

fl_status fl_sampling_params_validate(const fl_sampling_params *p) {
    if (!p) return FL_ERR(FL_ERR_INVALID_ARG, "sampling parameters are NULL");
    /* Written so that NaN fails every check. */
    if (!(p->temperature >= 0.0f) || isinf(p->temperature))
        return FL_ERR(FL_ERR_INVALID_ARG, "temperature must be a finite number >= 0 (got %g)",
                      (double)p->temperature);
    if (p->top_k < 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "top_k must be >= 0 (0 = off; got %d)", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return FL_ERR(FL_ERR_INVALID_ARG, "top_p must be in (0, 1] (1 = off; got %g)",
                      (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return FL_ERR(FL_ERR_INVALID_ARG, "min_p must be in [0, 1] (0 = off; got %g)",
                      (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f) || isinf(p->repetition_penalty))
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "repetition_penalty must be a finite number > 0 (1 = off; got %g)",
                      (double)p->repetition_penalty);
    return FL_OK;
}

/* ---- rng ------------------------------------------------------------------ */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void fl_rng_seed(fl_rng *r, uint64_t seed) {
    if (!r) return;
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
    /* splitmix64 never yields four zero words in a row, but keep the
     * invariant explicit: the all-zero state is xoshiro's only fixed point. */
    if ((r->s[0] | r->s[1] | r->s[2] | r->s[3]) == 0) r->s[0] = 1;
}

uint64_t fl_rng_next(fl_rng *r) {
    uint64_t *s = r->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double fl_rng_uniform(fl_rng *r) { return (double)(fl_rng_next(r) >> 11) * 0x1.0p-53; }

/* ---- sampler -------------------------------------------------------------- */

size_t fl_sampler_workspace_size(int n_vocab) {
    if (n_vocab <= 0) return 0;
    return (size_t)n_vocab * (sizeof(float) + 2 * sizeof(cand));
}

/* The largest logit and whether any is NaN, in one pass the compiler
 * vectorizes: eight independent lanes (compare + select, no branch), then
 * a short second pass for the first id holding the maximum, so ties go to
 * the lowest id like torch.argmax. On a 128k vocabulary this is several
 * times faster than a branchy scalar scan, and the engine samples every
 * sequence on rank 0's host at every step. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
static float max_and_nan(const float *x, size_t n, int *has_nan) {
    /* GCC vector extensions (no intrinsics): 8 lanes of compare + select */
    typedef float v8f __attribute__((vector_size(32)));
    typedef int32_t v8i __attribute__((vector_size(32)));
    v8f lm = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    v8i ln = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, x + i, sizeof v);
        ln |= v != v;
        const v8i gt = v > lm;
        lm = (v8f)(((v8i)v & gt) | ((v8i)lm & ~gt));
    }
    float m = -INFINITY;
    int nan = 0;
    for (int k = 0; k < 8; k++) {
        nan |= ln[k] != 0;
        m = lm[k] > m ? lm[k] : m;
    }
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    *has_nan = nan;
    return m;
}

/* The lowest i with x[i] == m (m is in x), eight at a time. */
static size_t first_index_of(const float *x, size_t n, float m) {
    typedef float v8f __attribute__((vector_size(32)));
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8f mv = {m, m, m, m, m, m, m, m};
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, x + i, sizeof v);
        const v8i eq = v == mv;
        if (eq[0] | eq[1] | eq[2] | eq[3] | eq[4] | eq[5] | eq[6] | eq[7]) break;
    }
    while (x[i] != m) i++;
    return i;
}

static void swap_cand(cand *a, cand *b) {
    cand t = *a;
    *a = *b;
    *b = t;
}

/* Value of the k-th largest score (k >= 1, k <= n) of b[0..n); reorders b.
 * 3-way partition so runs of equal scores (masked logits) cost O(n). */
static float kth_largest(cand *b, size_t n, size_t k) {
    size_t lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        float x = b[lo].s, y = b[mid].s, z = b[hi].s;
        float pivot = (x < y) ? ((y < z) ? y : (x < z ? z : x)) : ((x < z) ? x : (y < z ? z : y));
        size_t lt = lo, i = lo, gt = hi;
        /* [lo,lt) > pivot, [lt,i) == pivot, (gt,hi] < pivot */
        while (i <= gt) {
            if (b[i].s > pivot) {
                swap_cand(&b[lt++], &b[i++]);
            } else if (b[i].s < pivot) {
                swap_cand(&b[i], &b[gt]);
                if (gt == 0) break;
                gt--;
            } else {
                i++;
            }
        }
        if (target < lt) hi = lt - 1;
        else if (target > gt) lo = gt + 1;
        else return pivot;
    }
    return b[lo].s;
}

/* Ascending id: orders a block of equal weights the way the top-p cut
 * walks it, so the cut is deterministic. */
static int cmp_id(const void *pa, const void *pb) {
    const cand *a = pa, *b = pb;
    return (a->id > b->id) - (a->id < b->id);
}

/* Top-p over c[0..n) holding weights (c[i].s = exp(score - max), so the top
 * weight is 1) whose sum is z. HF sorts ascending and drops tokens whose
 * cumulative probability is <= 1 - top_p; in descending order (weight desc,
 * id asc among equals) that keeps a token iff the mass strictly above it is
 * < top_p. Found by a weighted 3-way quickselect, O(n) expected, instead of
 * a sort: a flat distribution can keep tens of thousands of tokens. Moves the
 * survivors to c[0..kept) (in no particular order) and returns kept. */
static size_t apply_top_p(cand *c, size_t n, double z, double top_p) {
    const double target = top_p * z;
    double above = 0.0; /* mass of the tokens already kept, all in c[0..lo) */
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        float x = c[lo].s, y = c[mid].s, w = c[hi - 1].s;
        float pivot = (x < y) ? ((y < w) ? y : (x < w ? w : x)) : ((x < w) ? x : (y < w ? w : y));
        /* [lo,lt) > pivot, [lt,i) == pivot, [gt,hi) < pivot */
        size_t lt = lo, i = lo, gt = hi;
        while (i < gt) {
            if (c[i].s > pivot) swap_cand(&c[lt++], &c[i++]);
            else if (c[i].s < pivot) swap_cand(&c[i], &c[--gt]);
            else i++;
        }
        double heavier = 0.0;
        for (size_t j = lo; j < lt; j++) heavier += c[j].s;
        if (lt > lo && above + heavier >= target) {
            hi = lt; /* the cut lies among the heavier tokens */
            continue;
        }
        above += heavier;
        size_t neq = gt - lt, take = 0;
        while (take < neq && above < target) {
            above += pivot;
            take++;
        }
        if (take < neq) {
            /* The cut falls inside a run of equal weights: keep the lowest ids. */
            qsort(c + lt, neq, sizeof(cand), cmp_id);
            return lt + take;
        }
        if (above >= target) return gt;
        lo = gt; /* everything so far is kept; continue among the lighter ones */
    }
    return lo;
}

fl_status fl_sampler_sample(const fl_sampling_params *p, const float *logits, int n_vocab,
                            const int32_t *history, size_t n_history, fl_rng *rng,
                            void *workspace, int32_t *out_token) {
    FL_TRY(fl_sampling_params_validate(p));
    const int sampling = p->temperature > 0.0f;
    if (sampling && !rng)
        return FL_ERR(FL_ERR_INVALID_ARG, "fl_sampler_sample: rng is required when temperature > 0");
    return fl_sampler_sample_u(p, logits, n_vocab, history, n_history, sampling ? fl_rng_uniform(rng) : 0.0,
                               workspace, out_token);
}

fl_status fl_sampler_sample_u(const fl_sampling_params *p, const float *logits, int n_vocab,
                              const int32_t *history, size_t n_history, double u, void *workspace,
                              int32_t *out_token) {
    FL_TRY(fl_sampling_params_validate(p));
    if (!(u >= 0.0 && u < 1.0))
        return FL_ERR(FL_ERR_INVALID_ARG, "fl_sampler_sample_u: the draw must be in [0, 1) (got %g)", u);
    if (!logits || !out_token || !workspace || n_vocab <= 0)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "fl_sampler_sample: logits, workspace and out_token are required and "
                      "n_vocab must be > 0 (n_vocab=%d)", n_vocab);
    if (n_history > 0 && !history)
        return FL_ERR(FL_ERR_INVALID_ARG, "fl_sampler_sample: history is NULL but n_history=%zu",
                      n_history);
    const int sampling = p->temperature > 0.0f;

    const size_t n = (size_t)n_vocab;
    float *pen = (float *)workspace; /* [n] penalised logits */
    cand *a = (cand *)(pen + n);     /* [n] candidates */
    cand *b = a + n;                 /* [n] scratch */

    for (size_t j = 0; j < n_history; j++)
        if (history[j] < 0 || history[j] >= n_vocab)
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "history[%zu] = %d is not a token id (vocabulary size %d)", j,
                          (int)history[j], n_vocab);
    const float *x = logits;
    if (p->repetition_penalty != 1.0f && n_history > 0) {
        memcpy(pen, logits, n * sizeof(float));
        /* Computed from the original logit, so ids repeated in the history
         * are penalised once, as HF's gather/scatter does. */
        for (size_t j = 0; j < n_history; j++)
            pen[history[j]] = fl_sampler_penalize(logits[history[j]], p->repetition_penalty);
        x = pen;
    }

    int has_nan = 0;
    const float m = max_and_nan(x, n, &has_nan);
    if (has_nan) {
        size_t i = 0;
        while (!isnan(x[i])) i++;
        return FL_ERR(FL_ERR_INVALID_ARG, "logits contain NaN at token id %zu", i);
    }
    const size_t best = first_index_of(x, n, m); /* the lowest id, like torch.argmax */
    if (!sampling) {
        *out_token = (int32_t)best;
        return FL_OK;
    }
    if (m == -INFINITY) return FL_ERR(FL_ERR_INVALID_ARG, "every logit is -inf: nothing to sample");

    /* Temperature (a division, as HF does), keeping only tokens within 60 of
     * the top scaled score: the others have relative probability < e^-60 =
     * 9e-27 and, even all 150k together, cannot move any probability by
     * anything a double-precision draw can see. For real LLM logits this
     * leaves hundreds or thousands of candidates instead of the vocabulary,
     * so the filters below run on a small list. */
    const float T = p->temperature;
    const float mt = m / T;
    size_t nc = 0;
    if (!isfinite(mt)) {
        /* Temperature so small that m / T overflowed: the T -> 0 limit,
         * uniform over the tokens tied at the maximum. */
        for (size_t i = 0; i < n; i++)
            if (x[i] == m) a[nc++] = (cand){0.0f, (int32_t)i};
    } else {
        const float cut = mt - 60.0f;
        for (size_t i = 0; i < n; i++) {
            float sv = x[i] / T;
            if (sv >= cut) a[nc++] = (cand){sv, (int32_t)i};
        }
    }

    cand *c = a;
    if (p->top_k > 0 && (size_t)p->top_k < nc) {
        memcpy(b, c, nc * sizeof(cand));
        float kth = kth_largest(b, nc, (size_t)p->top_k);
        size_t k = 0;
        for (size_t i = 0; i < nc; i++)
            if (c[i].s >= kth) c[k++] = c[i]; /* keeps id order; ties at kth kept (HF) */
        nc = k;
    }

    /* The top scaled score (mt, or 0 in the T -> 0 branch) is among the
     * candidates and survives top-k. */
    float top = c[0].s;
    for (size_t i = 1; i < nc; i++)
        if (c[i].s > top) top = c[i].s;
    /* From here on .s holds the unnormalised probability exp(s - max) in
     * (0, 1], the top token's being exactly 1; one exp per candidate. */
    double z = 0.0;
    for (size_t i = 0; i < nc; i++) {
        c[i].s = expf(c[i].s - top);
        z += c[i].s;
    }

    if (p->top_p < 1.0f) {
        /* The cut on a scratch copy, then the survivors taken from c in id
         * order: the kept set is every weight above the last kept one (tau)
         * and the lowest-id `ties` tokens of weight tau, so filtering c keeps
         * the draw below walking the tokens in id order whatever order the
         * quickselect left. kernels/cuda/cuda_sample.cu draws in the same
         * order, which makes the GPU's token the host's for the same draw. */
        memcpy(b, c, nc * sizeof(cand));
        const size_t kept = apply_top_p(b, nc, z, (double)p->top_p);
        float tau = b[0].s;
        for (size_t i = 1; i < kept; i++)
            if (b[i].s < tau) tau = b[i].s;
        size_t ties = 0;
        for (size_t i = 0; i < kept; i++) ties += b[i].s == tau;
        size_t k = 0;
        z = 0.0;
        for (size_t i = 0; i < nc; i++)
            if (c[i].s > tau || (c[i].s == tau && ties > 0 && ties--)) {
                c[k++] = c[i];
                z += c[i].s;
            }
        nc = k;
    }

    if (p->min_p > 0.0f) {
        /* p_i < min_p * p_max  <=>  w_i < min_p, whatever the normaliser. */
        size_t k = 0;
        z = 0.0;
        for (size_t i = 0; i < nc; i++)
            if (c[i].s >= p->min_p) {
                c[k++] = c[i];
                z += c[i].s;
            }
        nc = k; /* the max (weight 1) always survives */
    }

    const double uz = u * z;
    double acc = 0.0;
    for (size_t i = 0; i < nc; i++) {
        acc += c[i].s;
        if (uz < acc) {
            *out_token = c[i].id;
            return FL_OK;
        }
    }
    *out_token = c[nc - 1].id; /* rounding left u at the very top */
    return FL_OK;
}

/* ---- OpenAI-style options ------------------------------------------------- */

fl_status fl_sampler_penalize_counts(float *logits, int n_vocab, const int32_t *generated,
                                     size_t n, float presence, float frequency, uint8_t *seen) {
    if (n > 0 && (!logits || !generated || !seen))
        return FL_ERR(FL_ERR_INVALID_ARG, "fl_sampler_penalize_counts: NULL argument");
    for (size_t i = 0; i < n; i++)
        if (generated[i] < 0 || generated[i] >= n_vocab)
            return FL_ERR(FL_ERR_INVALID_ARG, "generated[%zu] = %d is not a token id (vocabulary "
                          "size %d)", i, (int)generated[i], n_vocab);
    /* frequency once per occurrence, presence at the first one: no counts
     * array, and the seen marks are cleared by a second pass over the ids */
    for (size_t i = 0; i < n; i++) {
        const int32_t t = generated[i];
        logits[t] -= frequency;
        if (!seen[t]) {
            seen[t] = 1;
            logits[t] -= presence;
        }
    }
    for (size_t i = 0; i < n; i++) seen[generated[i]] = 0;
    return FL_OK;
}

void fl_sampler_mask_ids(float *logits, int n_vocab, const int32_t *ids, int n_ids) {
    for (int i = 0; i < n_ids; i++)
        if (ids[i] >= 0 && ids[i] < n_vocab) logits[ids[i]] = -INFINITY;
}

fl_status fl_sampler_logprobs(const float *logits, int n_vocab, int32_t chosen, int n_top,
                              float *chosen_lp, int32_t *top_ids, float *top_lps) {
    if (!logits || n_vocab <= 0 || chosen < 0 || chosen >= n_vocab || n_top < 0 ||
        n_top > FL_SAMPLER_MAX_TOP_LOGPROBS || n_top > n_vocab || (n_top && (!top_ids || !top_lps)))
        return FL_ERR(FL_ERR_INVALID_ARG, "fl_sampler_logprobs: bad arguments (chosen %d, n_top %d, "
                      "vocabulary %d)", (int)chosen, n_top, n_vocab);
    int has_nan = 0;
    const float m = max_and_nan(logits, (size_t)n_vocab, &has_nan);
    if (has_nan) return FL_ERR(FL_ERR_INVALID_ARG, "logits contain NaN");
    if (m == -INFINITY) return FL_ERR(FL_ERR_INVALID_ARG, "every logit is -inf");
    double z = 0.0;
    for (int i = 0; i < n_vocab; i++) z += exp((double)logits[i] - m);
    const double lz = (double)m + log(z);
    if (chosen_lp) *chosen_lp = (float)((double)logits[chosen] - lz);
    /* insertion into a sorted list of at most 20: O(n_vocab * small) */
    int k = 0;
    for (int i = 0; n_top > 0 && i < n_vocab; i++) {
        const float x = logits[i];
        if (k == n_top && !(x > logits[top_ids[k - 1]])) continue;
        int j = k < n_top ? k++ : k - 1;
        while (j > 0 && x > logits[top_ids[j - 1]]) {
            top_ids[j] = top_ids[j - 1];
            j--;
        }
        top_ids[j] = i;
    }
    for (int j = 0; j < k; j++) top_lps[j] = (float)((double)logits[top_ids[j]] - lz);
    return FL_OK;
}
