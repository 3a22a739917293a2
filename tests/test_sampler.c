/*
 * test_sampler.c — the sampler against an independent, naive re-implementation
 * of HF's processor chain (full sorts, double precision, written the way
 * transformers' logits_process.py reads), plus greedy, repetition penalty,
 * determinism and parameter validation.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/sampler.h"

/* ---- naive reference ------------------------------------------------------ */

static int cmp_double_asc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    double v;
    int id;
} vi;

static int cmp_vi_asc(const void *a, const void *b) {
    const vi *x = a, *y = b;
    if (x->v != y->v) return (x->v > y->v) - (x->v < y->v);
    return (x->id < y->id) - (x->id > y->id); /* higher id first among ties */
}

static void softmax(const double *s, int n, double *p) {
    double m = -INFINITY, z = 0;
    for (int i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    for (int i = 0; i < n; i++) z += (p[i] = (s[i] == -INFINITY) ? 0.0 : exp(s[i] - m));
    for (int i = 0; i < n; i++) p[i] /= z;
}

/* Expected probabilities of each token under HF semantics. */
static void reference_probs(const fl_sampling_params *sp, const float *logits, int n,
                            const int32_t *hist, size_t nh, double *prob) {
    double *s = malloc(sizeof(double) * n), *tmp = malloc(sizeof(double) * n);
    vi *sorted = malloc(sizeof(vi) * n);
    for (int i = 0; i < n; i++) s[i] = logits[i];
    for (size_t j = 0; j < nh; j++) {
        double l = logits[hist[j]];
        s[hist[j]] = l > 0 ? l / sp->repetition_penalty : l * sp->repetition_penalty;
    }
    for (int i = 0; i < n; i++) s[i] /= sp->temperature;
    if (sp->top_k > 0 && sp->top_k < n) {
        memcpy(tmp, s, sizeof(double) * n);
        qsort(tmp, n, sizeof(double), cmp_double_asc);
        double kth = tmp[n - sp->top_k];
        for (int i = 0; i < n; i++)
            if (s[i] < kth) s[i] = -INFINITY;
    }
    if (sp->top_p < 1.0f) {
        softmax(s, n, tmp);
        for (int i = 0; i < n; i++) sorted[i] = (vi){tmp[i], i};
        qsort(sorted, n, sizeof(vi), cmp_vi_asc);
        double cum = 0;
        for (int r = 0; r < n; r++) {
            cum += sorted[r].v;
            if (cum <= 1.0 - sp->top_p && r != n - 1) s[sorted[r].id] = -INFINITY;
        }
    }
    if (sp->min_p > 0.0f) {
        softmax(s, n, tmp);
        double mx = 0;
        for (int i = 0; i < n; i++) mx = tmp[i] > mx ? tmp[i] : mx;
        for (int i = 0; i < n; i++)
            if (tmp[i] < sp->min_p * mx) s[i] = -INFINITY;
    }
    softmax(s, n, prob);
    free(s);
    free(tmp);
    free(sorted);
}

/* ---- helpers -------------------------------------------------------------- */

static int32_t sample_one(const fl_sampling_params *sp, const float *logits, int n,
                          const int32_t *hist, size_t nh, fl_rng *rng) {
    void *ws = malloc(fl_sampler_workspace_size(n));
    int32_t tok = -1;
    fl_status st = fl_sampler_sample(sp, logits, n, hist, nh, rng, ws, &tok);
    if (st != FL_OK) fail_msg("sample failed: %s", fl_error_msg());
    free(ws);
    return tok;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static void fill_random(float *x, int n, uint64_t seed, float scale) {
    fl_rng r;
    fl_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) x[i] = (float)((fl_rng_uniform(&r) * 2.0 - 1.0) * scale);
}

static void expect_invalid(const fl_sampling_params *sp, const float *logits, int n,
                           const int32_t *hist, size_t nh, const char *word);

/* ---- tests ---------------------------------------------------------------- */

static void test_greedy(void **state) {
    (void)state;
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    const float l1[] = {0.1f, 3.0f, -2.0f, 2.9f};
    assert_int_equal(sample_one(&sp, l1, 4, NULL, 0, NULL), 1);
    const float l2[] = {-1.0f, 5.0f, 5.0f, 1.0f}; /* tie: lowest id */
    assert_int_equal(sample_one(&sp, l2, 4, NULL, 0, NULL), 1);
    const float l3[] = {-INFINITY, -INFINITY, -3.0f};
    assert_int_equal(sample_one(&sp, l3, 3, NULL, 0, NULL), 2);
    float big[1000];
    for (uint64_t seed = 1; seed < 20; seed++) {
        fill_random(big, 1000, seed, 10.0f);
        assert_int_equal(sample_one(&sp, big, 1000, NULL, 0, NULL), argmax(big, 1000));
    }
}

/* The greedy scan runs eight lanes at a time plus a scalar tail: ties in
 * different lanes and blocks, the maximum in the tail, every logit -inf,
 * signed zeros, and a NaN in either part (named by its id). */
static void test_greedy_long_vocab(void **state) {
    (void)state;
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    enum { N = 1003 };
    float x[N];
    fill_random(x, N, 7, 10.0f);
    x[517] = x[45] = x[900] = 50.0f; /* three-way tie: the lowest id wins */
    assert_int_equal(sample_one(&sp, x, N, NULL, 0, NULL), 45);
    x[1001] = 60.0f; /* in the scalar tail */
    assert_int_equal(sample_one(&sp, x, N, NULL, 0, NULL), 1001);
    for (int i = 0; i < N; i++) x[i] = -INFINITY;
    assert_int_equal(sample_one(&sp, x, N, NULL, 0, NULL), 0);
    x[9] = -0.0f, x[3] = 0.0f, x[700] = -0.0f; /* 0 == -0: the first of them */
    assert_int_equal(sample_one(&sp, x, N, NULL, 0, NULL), 3);
    x[700] = NAN;
    expect_invalid(&sp, x, N, NULL, 0, "token id 700");
    x[700] = 0.0f, x[1002] = NAN;
    expect_invalid(&sp, x, N, NULL, 0, "token id 1002");
}

static void test_low_temperature_is_greedy(void **state) {
    (void)state;
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    sp.temperature = 1e-4f;
    fl_rng rng;
    fl_rng_seed(&rng, 123);
    float x[500];
    for (uint64_t seed = 1; seed < 50; seed++) {
        fill_random(x, 500, seed, 8.0f);
        assert_int_equal(sample_one(&sp, x, 500, NULL, 0, &rng), argmax(x, 500));
    }
    sp.temperature = 1e-30f; /* scores overflow to +inf: still the argmax */
    fill_random(x, 500, 99, 8.0f);
    assert_int_equal(sample_one(&sp, x, 500, NULL, 0, &rng), argmax(x, 500));
}

static void test_top_k_1_is_greedy(void **state) {
    (void)state;
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    sp.temperature = 1.0f;
    sp.top_k = 1;
    fl_rng rng;
    fl_rng_seed(&rng, 5);
    float x[2000];
    for (uint64_t seed = 1; seed < 40; seed++) {
        fill_random(x, 2000, seed, 2.0f);
        assert_int_equal(sample_one(&sp, x, 2000, NULL, 0, &rng), argmax(x, 2000));
    }
}

typedef struct {
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    float rep;
} combo;

static void check_distribution(const combo *c, const float *logits, int n, const int32_t *hist,
                               size_t nh) {
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    sp.temperature = c->temperature;
    sp.top_k = c->top_k;
    sp.top_p = c->top_p;
    sp.min_p = c->min_p;
    sp.repetition_penalty = c->rep;
    double expect[16], count[16] = {0};
    reference_probs(&sp, logits, n, hist, nh, expect);
    fl_rng rng;
    fl_rng_seed(&rng, 42);
    void *ws = malloc(fl_sampler_workspace_size(n));
    const int N = 20000;
    for (int i = 0; i < N; i++) {
        int32_t t = -1;
        assert_int_equal(fl_sampler_sample(&sp, logits, n, hist, nh, &rng, ws, &t), FL_OK);
        assert_true(t >= 0 && t < n);
        count[t] += 1;
    }
    free(ws);
    for (int i = 0; i < n; i++) {
        double f = count[i] / N;
        /* 5 standard deviations of a binomial proportion, plus slack. */
        double tol = 5.0 * sqrt(expect[i] * (1 - expect[i]) / N) + 1e-3;
        if (expect[i] == 0.0 && count[i] != 0)
            fail_msg("T=%g k=%d p=%g minp=%g rep=%g: token %d has p=0 but was drawn %g times",
                     (double)c->temperature, c->top_k, (double)c->top_p, (double)c->min_p,
                     (double)c->rep, i, count[i]);
        if (fabs(f - expect[i]) > tol)
            fail_msg("T=%g k=%d p=%g minp=%g rep=%g: token %d freq %.4f expected %.4f",
                     (double)c->temperature, c->top_k, (double)c->top_p, (double)c->min_p,
                     (double)c->rep, i, f, expect[i]);
    }
}

static void test_distributions(void **state) {
    (void)state;
    const float logits[5] = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f};
    const int32_t hist[] = {1, 3, 1};
    const combo combos[] = {
        {1.0f, 0, 1.0f, 0.0f, 1.0f},   {0.7f, 0, 1.0f, 0.0f, 1.0f},
        {1.5f, 0, 1.0f, 0.0f, 1.0f},   {1.0f, 3, 1.0f, 0.0f, 1.0f},
        {1.3f, 2, 1.0f, 0.0f, 1.0f},   {1.0f, 0, 0.8f, 0.0f, 1.0f},
        {1.0f, 0, 0.5f, 0.0f, 1.0f},   {0.8f, 0, 0.9f, 0.0f, 1.0f},
        {1.0f, 0, 1.0f, 0.3f, 1.0f},   {2.0f, 0, 1.0f, 0.1f, 1.0f},
        {1.0f, 4, 0.9f, 0.0f, 1.0f},   {1.2f, 4, 0.95f, 0.2f, 1.0f},
        {1.0f, 3, 0.7f, 0.5f, 1.0f},   {1.0f, 0, 1.0f, 0.0f, 1.3f},
        {0.9f, 4, 0.9f, 0.05f, 1.5f},
    };
    for (size_t i = 0; i < sizeof combos / sizeof combos[0]; i++)
        check_distribution(&combos[i], logits, 5, combos[i].rep != 1.0f ? hist : NULL,
                           combos[i].rep != 1.0f ? 3 : 0);
    /* Ties at the top-k boundary are kept, as in HF. */
    const float tied[5] = {2.0f, 1.0f, 1.0f, 0.0f, 1.0f};
    const combo k2 = {1.0f, 2, 1.0f, 0.0f, 1.0f};
    check_distribution(&k2, tied, 5, NULL, 0);
}

/* Probabilities computed by transformers 5.24 itself (LogitsProcessorList of
 * RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
 * TopPLogitsWarper, MinPLogitsWarper in generate()'s order, then softmax) for
 * logits {1, 2, 0.5, -1, 1.5} and history {1, 3, 1}; generated once with a
 * short Python snippet. Ties the naive reference above, and the sampler, to
 * HF's actual numbers. */
static void test_matches_transformers(void **state) {
    (void)state;
    static const struct {
        combo c;
        double p[5];
    } hf[] = {
        {{0.7f, 0, 1.0f, 0.0f, 1.3f}, {0.174587473, 0.376778215, 0.085467838, 0.006531991, 0.356634527}},
        {{1.0f, 3, 0.8f, 0.0f, 1.0f}, {0.0, 0.622459352, 0.0, 0.0, 0.377540678}},
        {{1.2f, 4, 0.95f, 0.2f, 1.5f}, {0.222403586, 0.293615609, 0.146617487, 0.0, 0.337363303}},
        {{0.9f, 0, 0.6f, 0.1f, 1.2f}, {0.0, 0.546164393, 0.0, 0.0, 0.453835577}},
        {{1.5f, 2, 1.0f, 0.0f, 2.0f}, {0.294497699, 0.294497699, 0.0, 0.0, 0.411004633}},
    };
    const float logits[5] = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f};
    const int32_t hist[] = {1, 3, 1};
    for (size_t i = 0; i < sizeof hf / sizeof hf[0]; i++) {
        fl_sampling_params sp;
        fl_sampling_params_default(&sp);
        sp.temperature = hf[i].c.temperature;
        sp.top_k = hf[i].c.top_k;
        sp.top_p = hf[i].c.top_p;
        sp.min_p = hf[i].c.min_p;
        sp.repetition_penalty = hf[i].c.rep;
        double ref[5];
        reference_probs(&sp, logits, 5, hist, 3, ref);
        for (int t = 0; t < 5; t++)
            if (fabs(ref[t] - hf[i].p[t]) > 1e-6)
                fail_msg("combo %zu token %d: naive reference %.9f vs transformers %.9f", i, t,
                         ref[t], hf[i].p[t]);
        check_distribution(&hf[i].c, logits, 5, hist, 3);
    }
}

/* Large vocabulary: the quickselect and threshold paths must pick exactly
 * the reference's candidate set. */
static void test_large_vocab_candidate_sets(void **state) {
    (void)state;
    const int n = 150000;
    float *x = malloc(sizeof(float) * n);
    double *expect = malloc(sizeof(double) * n);
    fill_random(x, n, 7, 6.0f);
    for (int i = 0; i < n; i += 97) x[i] = -INFINITY; /* masked tokens */
    const combo combos[] = {
        {1.0f, 50, 1.0f, 0.0f, 1.0f},
        {1.0f, 0, 0.9f, 0.0f, 1.0f},
        {0.5f, 0, 0.95f, 0.0f, 1.0f},
        {1.0f, 0, 1.0f, 0.2f, 1.0f},
        {0.7f, 1000, 0.8f, 0.01f, 1.0f},
    };
    void *ws = malloc(fl_sampler_workspace_size(n));
    fl_rng rng;
    fl_rng_seed(&rng, 11);
    for (size_t c = 0; c < sizeof combos / sizeof combos[0]; c++) {
        fl_sampling_params sp;
        fl_sampling_params_default(&sp);
        sp.temperature = combos[c].temperature;
        sp.top_k = combos[c].top_k;
        sp.top_p = combos[c].top_p;
        sp.min_p = combos[c].min_p;
        reference_probs(&sp, x, n, NULL, 0, expect);
        size_t support = 0;
        for (int i = 0; i < n; i++) support += expect[i] > 0;
        assert_true(support > 1);
        for (int s = 0; s < 300; s++) {
            int32_t t = -1;
            assert_int_equal(fl_sampler_sample(&sp, x, n, NULL, 0, &rng, ws, &t), FL_OK);
            assert_true(t >= 0 && t < n);
            if (!(expect[t] > 0))
                fail_msg("combo %zu: drew token %d outside the reference support (%zu tokens)",
                         c, t, support);
        }
    }
    free(ws);
    free(expect);
    free(x);
}

static void test_repetition_penalty(void **state) {
    (void)state;
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    sp.repetition_penalty = 2.0f;
    /* positive logit divided: 3 -> 1.5 < 2.5 */
    const float a[] = {3.0f, 2.5f};
    const int32_t h0[] = {0};
    assert_int_equal(sample_one(&sp, a, 2, NULL, 0, NULL), 0);
    assert_int_equal(sample_one(&sp, a, 2, h0, 1, NULL), 1);
    /* negative logit multiplied: -1 -> -2 < -1.5 */
    const float b[] = {-1.0f, -1.5f};
    assert_int_equal(sample_one(&sp, b, 2, NULL, 0, NULL), 0);
    assert_int_equal(sample_one(&sp, b, 2, h0, 1, NULL), 1);
    /* a repeated id is penalised once: 4 -> 2 > 1.5 (three times would give 0.5) */
    const float c[] = {4.0f, 1.5f};
    const int32_t h000[] = {0, 0, 0};
    assert_int_equal(sample_one(&sp, c, 2, h000, 3, NULL), 0);
    /* penalty < 1 rewards: 1 -> 2 > 1.8 */
    sp.repetition_penalty = 0.5f;
    const float d[] = {1.0f, 1.8f};
    assert_int_equal(sample_one(&sp, d, 2, h0, 1, NULL), 0);
}

static void test_same_seed_same_sequence(void **state) {
    (void)state;
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    sp.temperature = 1.0f;
    sp.top_p = 0.95f;
    float x[3000];
    fill_random(x, 3000, 3, 3.0f);
    fl_rng r1, r2, r3;
    fl_rng_seed(&r1, 7);
    fl_rng_seed(&r2, 7);
    fl_rng_seed(&r3, 8);
    int differ = 0;
    for (int i = 0; i < 200; i++) {
        int32_t t1 = sample_one(&sp, x, 3000, NULL, 0, &r1);
        int32_t t2 = sample_one(&sp, x, 3000, NULL, 0, &r2);
        int32_t t3 = sample_one(&sp, x, 3000, NULL, 0, &r3);
        assert_int_equal(t1, t2);
        differ += t1 != t3;
    }
    assert_true(differ > 100);
}

static void test_rng(void **state) {
    (void)state;
    fl_rng r;
    fl_rng_seed(&r, 0);
    double sum = 0;
    for (int i = 0; i < 100000; i++) {
        double u = fl_rng_uniform(&r);
        assert_true(u >= 0.0 && u < 1.0);
        sum += u;
    }
    assert_true(fabs(sum / 100000 - 0.5) < 0.01);
    /* Reference values: xoshiro256** seeded by splitmix64(0), computed with
     * an independent Python transcription of the published algorithms. */
    fl_rng_seed(&r, 0);
    assert_true(fl_rng_next(&r) == 0x99ec5f36cb75f2b4ULL);
    assert_true(fl_rng_next(&r) == 0xbf6e1f784956452aULL);
    assert_true(fl_rng_next(&r) == 0x1a5f849d4933e6e0ULL);
    fl_rng a, b;
    fl_rng_seed(&a, 0);
    fl_rng_seed(&b, 1);
    assert_true(fl_rng_next(&a) != fl_rng_next(&b));
}

static void expect_invalid(const fl_sampling_params *sp, const float *logits, int n,
                           const int32_t *hist, size_t nh, const char *word) {
    fl_rng rng;
    fl_rng_seed(&rng, 1);
    void *ws = malloc(fl_sampler_workspace_size(n > 0 ? n : 1) + 64);
    int32_t t;
    fl_error_clear();
    assert_int_equal(fl_sampler_sample(sp, logits, n, hist, nh, &rng, ws, &t), FL_ERR_INVALID_ARG);
    if (!strstr(fl_error_msg(), word))
        fail_msg("message '%s' does not name '%s'", fl_error_msg(), word);
    free(ws);
}

static void test_bad_params(void **state) {
    (void)state;
    const float x[] = {1.0f, 2.0f, 3.0f};
    fl_sampling_params sp;
#define BAD(field, value, word)                    \
    do {                                           \
        fl_sampling_params_default(&sp);           \
        sp.temperature = 1.0f;                     \
        sp.field = value;                          \
        expect_invalid(&sp, x, 3, NULL, 0, word);  \
    } while (0)
    BAD(temperature, -0.5f, "temperature");
    BAD(temperature, NAN, "temperature");
    BAD(temperature, INFINITY, "temperature");
    BAD(top_k, -1, "top_k");
    BAD(top_p, 0.0f, "top_p");
    BAD(top_p, 1.5f, "top_p");
    BAD(top_p, NAN, "top_p");
    BAD(min_p, -0.1f, "min_p");
    BAD(min_p, 1.01f, "min_p");
    BAD(repetition_penalty, 0.0f, "repetition_penalty");
    BAD(repetition_penalty, -1.0f, "repetition_penalty");
#undef BAD
    fl_sampling_params_default(&sp);
    sp.repetition_penalty = 1.1f;
    const int32_t bad_hist[] = {0, 3};
    expect_invalid(&sp, x, 3, bad_hist, 2, "history[1]");
    const float nanl[] = {1.0f, NAN, 0.0f};
    expect_invalid(&sp, nanl, 3, NULL, 0, "NaN");
    sp.temperature = 1.0f;
    const float ninf[] = {-INFINITY, -INFINITY};
    expect_invalid(&sp, ninf, 2, NULL, 0, "-inf");
    expect_invalid(&sp, x, 0, NULL, 0, "n_vocab");
    assert_int_equal(fl_sampling_params_validate(NULL), FL_ERR_INVALID_ARG);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_greedy_long_vocab),
        cmocka_unit_test(test_low_temperature_is_greedy),
        cmocka_unit_test(test_top_k_1_is_greedy),
        cmocka_unit_test(test_distributions),
        cmocka_unit_test(test_matches_transformers),
        cmocka_unit_test(test_large_vocab_candidate_sets),
        cmocka_unit_test(test_repetition_penalty),
        cmocka_unit_test(test_same_seed_same_sequence),
        cmocka_unit_test(test_rng),
        cmocka_unit_test(test_bad_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
