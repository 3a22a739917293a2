/*
 * test_cuda_sample.c — sample_rows on CUDA against the CPU op (which is
 * core/sampler.c's fl_sampler_sample_u, itself checked against HF's
 * processors in test_sampler.c): the same token and status for every row,
 * draw for draw.
 *
 * Rows of every kind side by side in one call: greedy, greedy with a
 * penalty, plain temperature, top-k (1, 50, more than the candidates),
 * top-p (with and without top-k), min-p, penalties above and below 1 over
 * a history with repeats, the T -> 0 limit with planted ties, logits
 * rounded to a few values (long runs of ties at every cut), a NaN row and
 * an all -inf row; widths 111, 500, 32001 and the real vocabularies 128256
 * and 151936, 19 rows, three draws each. CUDA's two top-p routes (the top
 * 16384 candidates sorted in shared memory when they hold the nucleus, else
 * a full sort of the row) are both taken, under the rule's blocks a row
 * (a cluster of 1-8) and each size forced, down to slices of 2 ids and an
 * empty one. Also times calls at batch 1 and 16 on 128256, the rule's
 * blocks a row and one (printed, not asserted).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "tests/test_gpu.h"
#include "kernels/cpu/cpu_ops.h"

enum { NROWS = 19, NKINDS = 16, HIST = 64 };

/* Row i's parameters: kind i % NKINDS. */
static fl_sample_row row_kind(int kind) {
    fl_sample_row r = {.temperature = 1.0f, .top_p = 1.0f, .min_p = 0.0f, .penalty = 1.0f};
    switch (kind) {
    case 0: r.temperature = 0.0f; break;
    case 1: r.temperature = 0.0f, r.penalty = 1.5f; break;
    case 2: break;
    case 3: r.temperature = 0.7f, r.top_k = 50; break;
    case 4: r.top_k = 1; break;
    case 5: r.top_k = 1 << 30; break;
    case 6: r.top_p = 0.9f; break;
    case 7: r.temperature = 1.3f, r.top_k = 100, r.top_p = 0.5f; break;
    case 8: r.min_p = 0.1f; break;
    case 9: r.temperature = 0.8f, r.top_p = 0.95f, r.penalty = 1.3f; break;
    case 10: r.temperature = 1.1f, r.top_k = 20, r.min_p = 0.02f, r.penalty = 0.8f; break;
    case 11: r.temperature = 1e-38f, r.top_p = 0.6f; break; /* m / T overflows */
    case 12: r.temperature = 0.5f, r.top_p = 0.3f; break;   /* on a row of few values */
    case 13: r.temperature = 2.0f, r.top_k = 3, r.top_p = 0.99f; break;
    /* peaked: the nucleus is among the top 16384 of many survivors (CUDA's
     * shared-memory sort); the rows above with a flat nucleus take its
     * full sort */
    case 14: r.temperature = 0.3f, r.top_p = 0.9f; break;
    default: r.temperature = 0.25f, r.top_k = 5000, r.top_p = 0.8f; break;
    }
    return r;
}

static double urand(void) { return (frand() + 1.0) * 0.5 * (1.0 - 1e-9); }

static void run_case(int d, int n, int rep, bool all_kinds) {
    float *x = rand_bf16((size_t)n * d, 8.0f);
    fl_sample_row rows[NROWS];
    int32_t hist[NROWS * HIST];
    bool any_top_p = false;
    for (int i = 0; i < n; i++) {
        float *r = x + (size_t)i * d;
        const int kind = all_kinds ? (i + rep) % NKINDS : (i % 2 ? 2 : 8);
        rows[i] = row_kind(kind);
        rows[i].u = urand();
        rows[i].hist_lo = i * HIST, rows[i].hist_n = HIST;
        /* a history with repeats that includes the row's largest logits */
        int top = 0;
        for (int j = 1; j < d; j++) top = r[j] > r[top] ? j : top;
        for (int k = 0; k < HIST; k++) hist[i * HIST + k] = k % 7 == 0 ? top : (int)((frand() + 1.0f) * 0.5f * (d - 1));
        if (kind == 11) /* the maximum at three places */
            r[d / 3] = r[d / 2] = r[top] = 9.0f;
        if (kind == 12)
            for (int j = 0; j < d; j++) r[j] = roundf(r[j] / 3.0f);
        any_top_p |= rows[i].top_p < 1.0f;
    }
    if (all_kinds && n > 5) {
        x[(size_t)3 * d + d / 2] = NAN;
        for (int j = 0; j < d; j++) x[(size_t)5 * d + j] = -INFINITY;
        rows[5].temperature = 1.0f; /* all -inf and sampling: status 2 */
    }
    int32_t ref[2 * NROWS], got[2 * NROWS];
    void *hws = malloc(fl_cpu_sample_rows_ws(NULL, n, d));
    assert_non_null(hws);
    OK(fl_cpu_sample_rows(NULL, x, n, d, rows, hist, any_top_p, hws, ref));
    const size_t wsb = g_be->ops->sample_rows_ws(g_be, n, d);
    assert_true(wsb > 0);
    void *dx = dev_act(x, (size_t)n * d), *drows = dev_raw(rows, sizeof rows), *dh = dev_raw(hist, sizeof hist);
    void *dws = dev_alloc(wsb), *dout = dev_alloc(sizeof got);
    int32_t poison[2 * NROWS];
    for (int i = 0; i < 2 * NROWS; i++) poison[i] = -7;
    OK(g_be->ops->upload(g_be, dout, poison, sizeof poison));
    OK(g_be->ops->sample_rows(g_be, dx, n, d, drows, dh, any_top_p, dws, dout));
    OK(g_be->ops->download(g_be, got, dout, sizeof got));
    for (int i = 0; i < n; i++)
        if (got[2 * i] != ref[2 * i] || got[2 * i + 1] != ref[2 * i + 1])
            fail_msg("sample_rows d=%d rep %d row %d (T %g k %d p %g min_p %g pen %g u %.17g): (%d, %d), cpu (%d, %d)",
                     d, rep, i, (double)rows[i].temperature, rows[i].top_k, (double)rows[i].top_p,
                     (double)rows[i].min_p, (double)rows[i].penalty, rows[i].u, got[2 * i], got[2 * i + 1],
                     ref[2 * i], ref[2 * i + 1]);
    dev_free(dx);
    dev_free(drows);
    dev_free(dh);
    dev_free(dws);
    dev_free(dout);
    free(hws);
    free(x);
}

/* A run of equal weights with different scores: 20000 positive logits
 * below 2^-22 (10000 distinct values, two ids each) all have the weight
 * expf(-10) next to a logit of 10. The top-p cut falls inside the run
 * (top_p 0.7: at ~7400, top_p 0.95: at ~17900), which reaches past the top
 * 16384 candidates that CUDA's fast path sorts; the host keeps the run's
 * lowest ids, so such rows must take the full sort. */
static void test_sample_rows_weight_ties(void **state) {
    (void)state;
    NEED_GPU();
    const int d = 24000;
    float *x = malloc(sizeof(float) * d);
    assert_non_null(x);
    x[0] = 10.0f;
    for (int j = 1; j < d; j++) /* increasing with id */
        x[j] = j <= 20000 ? fl_bf16_to_f32((uint16_t)(0x3480 - 10000 + (j - 1) / 2)) : -100.0f;
    static const double us[] = {0.1, 0.5, 0.95, 0.99};
    for (int k = 0; k < 16; k++) {
        gpu_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER, k < 8 ? 0 : 8); /* the rule: 4 blocks a row */
        fl_sample_row row = row_kind(6);
        row.top_p = k % 8 < 4 ? 0.7f : 0.95f, row.u = us[k % 4];
        int32_t ref[2], got[2];
        void *hws = malloc(fl_cpu_sample_rows_ws(NULL, 1, d));
        OK(fl_cpu_sample_rows(NULL, x, 1, d, &row, NULL, true, hws, ref));
        void *dx = dev_act(x, d), *dr = dev_raw(&row, sizeof row), *dws = dev_alloc(g_be->ops->sample_rows_ws(g_be, 1, d));
        void *dout = dev_alloc(sizeof got);
        OK(g_be->ops->sample_rows(g_be, dx, 1, d, dr, NULL, true, dws, dout));
        OK(g_be->ops->download(g_be, got, dout, sizeof got));
        if (got[0] != ref[0] || got[1] != ref[1])
            fail_msg("weight ties, top_p %g u %g: (%d, %d), cpu (%d, %d)", (double)row.top_p, us[k % 4], got[0],
                     got[1], ref[0], ref[1]);
        dev_free(dx);
        dev_free(dr);
        dev_free(dws);
        dev_free(dout);
        free(hws);
    }
    gpu_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER, 0);
    free(x);
}

static void test_sample_rows_matches_cpu(void **state) {
    (void)state;
    NEED_GPU();
    static const int widths[] = {111, 500, 32001, 128256, 151936};
    for (int c = 0; c < 5; c++)
        for (int rep = 0; rep < 3; rep++) run_case(widths[c], NROWS, rep, true);
    /* no row with top-p (kinds 2 and 8): any_top_p = false skips the sort's check */
    run_case(32001, 7, 0, false);
    run_case(128256, 1, 1, false);
    /* 16 rows of 128256: the rule's 8 blocks a row (19 rows above: 4) */
    for (int rep = 0; rep < 3; rep++) run_case(128256, 16, rep, true);
    /* every cluster size forced, on widths that leave a block a short or an
     * empty slice (9 over 8 blocks: 2 a block, the last one empty) */
    static const int forced[] = {1, 2, 8};
    for (int f = 0; f < 3; f++) {
        gpu_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER, forced[f]);
        run_case(9, NROWS, f, true);
        run_case(111, NROWS, f, true);
        run_case(32001, NROWS, f, true);
        run_case(151936, 16, f, true);
    }
    gpu_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER, 0);
}

/* copy_2d: shards of odd widths laid out as rows, as the forward does
 * under tensor parallelism (3 shards of a 32001 vocabulary, 19 rows). */
static void test_copy_2d(void **state) {
    (void)state;
    NEED_GPU();
    const int n = 19, V = 32001, size = 3;
    float *src = rand_bf16((size_t)n * V, 4.0f), *ref = malloc((size_t)n * V * sizeof(float));
    assert_non_null(ref);
    void *ds = dev_act(src, (size_t)n * V), *dd = dev_poison((size_t)n * V);
    size_t off = 0;
    for (int r = 0; r < size; r++) {
        const int vr = V / size + (r < V % size), lo = r * (V / size) + (r < V % size ? r : V % size);
        OK(fl_cpu_copy_2d(NULL, ref + lo, V, src + off, vr, n, vr));
        OK(g_be->ops->copy_2d(g_be, (char *)dd + 2 * (size_t)lo, V, (const char *)ds + 2 * off, vr, n, vr));
        off += (size_t)n * vr;
    }
    float *got = get_act(dd, (size_t)n * V);
    assert_memory_equal(got, ref, (size_t)n * V * sizeof(float));
    free(got);
    free(ref);
    free(src);
    dev_free(ds);
    dev_free(dd);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* How long one call takes (top-k 50 + top-p 0.9, the usual serving setting,
 * temperature alone, and a flat nucleus that takes the full sort), n rows of
 * d, host-timed around a sync, median of 20; one_block: one block a row
 * forced instead of the rule's cluster. */
static void time_case(int d, int n, int kind, bool one_block) {
    static const char *what[3] = {"top-k 50 + top-p 0.9", "temperature only", "top-p 0.9 alone, flat (full sort)"};
    gpu_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER, one_block ? 1 : 0);
    const bool any_top_p = kind != 1;
    float *x = rand_bf16((size_t)n * d, 8.0f);
    fl_sample_row rows[16];
    for (int i = 0; i < n; i++) {
        rows[i] = row_kind(2);
        if (kind == 0) rows[i].top_k = 50;
        if (any_top_p) rows[i].top_p = 0.9f;
        rows[i].u = urand();
    }
    void *dx = dev_act(x, (size_t)n * d), *drows = dev_raw(rows, sizeof rows);
    void *dws = dev_alloc(g_be->ops->sample_rows_ws(g_be, n, d)), *dout = dev_alloc(2 * 16 * 4);
    double t[20];
    for (int k = 0; k < 22; k++) {
        OK(g_be->ops->sync(g_be));
        const double t0 = now_s();
        OK(g_be->ops->sample_rows(g_be, dx, n, d, drows, NULL, any_top_p, dws, dout));
        OK(g_be->ops->sync(g_be));
        if (k >= 2) t[k - 2] = now_s() - t0;
    }
    for (int a = 0; a < 20; a++) /* insertion sort: 20 values */
        for (int b = a; b > 0 && t[b] < t[b - 1]; b--) {
            const double s = t[b];
            t[b] = t[b - 1], t[b - 1] = s;
        }
    printf("sample_rows d=%d n=%d %s, %s: %.1f us (median of 20, host-timed)\n", d, n, what[kind],
           one_block ? "one block a row" : "blocks a row by the rule", t[10] * 1e6);
    dev_free(dx);
    dev_free(drows);
    dev_free(dws);
    dev_free(dout);
    free(x);
    gpu_tune(FL_CUDA_TUNE_SAMPLE_CLUSTER, 0);
}

static void test_sample_rows_time(void **state) {
    (void)state;
    NEED_GPU();
    for (int f = 0; f < 2; f++) /* the rule's blocks a row, then one block a row */
        for (int n = 1; n <= 16; n += 15)
            for (int kind = 0; kind < 3; kind++) time_case(128256, n, kind, f == 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sample_rows_matches_cpu),
        cmocka_unit_test(test_sample_rows_weight_ties),
        cmocka_unit_test(test_copy_2d),
        cmocka_unit_test(test_sample_rows_time),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
