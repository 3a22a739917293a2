/*
 * test_moe_dispatch.c — the bookkeeping of the MoE all-to-all exchange
 * (runtime/model/moe_dispatch.h) as pure functions: send counts, displacements and
 * the slot permutation on uneven routings with ranks that get nothing, the
 * receiver's grouping by local expert, a full simulated exchange over 4 ranks
 * that must reproduce the single-rank weighted combine exactly, the tp row
 * slices, and refusals of malformed input (expert ids out of range, an
 * expert this rank does not own, sizes that do not divide).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "runtime/model/moe_dispatch.h"

static void test_displs(void **state) {
    (void)state;
    size_t c[5] = {3, 0, 0, 7, 1}, d[5];
    assert_int_equal(fl_moe_displs(c, 5, d), 11);
    size_t want[5] = {0, 3, 3, 3, 10};
    assert_memory_equal(d, want, sizeof want);
    assert_int_equal(fl_moe_displs(c, 0, d), 0);
}

/* 8 experts over ep 4 (2 each); 5 tokens, top-2; rank 2 (experts 4, 5) gets
 * nothing, rank 3 gets most. */
static void test_plan_uneven(void **state) {
    (void)state;
    const int32_t ids[10] = {7, 0, 6, 7, 1, 6, 7, 0, 1, 6};
    const float w[10] = {.1f, .2f, .3f, .4f, .5f, .6f, .7f, .8f, .9f, 1.f};
    int32_t row[10], ex[10], scratch[9];
    float sw[10];
    size_t cnt[4], dsp[4];
    assert_int_equal(fl_moe_dispatch_plan(5, 2, ids, w, 8, 4, row, ex, sw, cnt, dsp, scratch), FL_OK);
    size_t want_cnt[4] = {4, 0, 0, 6}, want_dsp[4] = {0, 4, 4, 4};
    assert_memory_equal(cnt, want_cnt, sizeof want_cnt);
    assert_memory_equal(dsp, want_dsp, sizeof want_dsp);
    /* sorted by expert, stable in (token, k) order */
    const int32_t want_ex[10] = {0, 0, 1, 1, 6, 6, 6, 7, 7, 7};
    const int32_t want_row[10] = {0, 3, 2, 4, 1, 2, 4, 0, 1, 3};
    const float want_w[10] = {.2f, .8f, .5f, .9f, .3f, .6f, 1.f, .1f, .4f, .7f};
    assert_memory_equal(ex, want_ex, sizeof want_ex);
    assert_memory_equal(row, want_row, sizeof want_row);
    assert_memory_equal(sw, want_w, sizeof want_w);
    /* expert ends: 0:2 1:4 2..5:4 6:7 7:10 */
    const int32_t want_end[8] = {2, 4, 4, 4, 4, 4, 7, 10};
    assert_memory_equal(scratch, want_end, sizeof want_end);
    /* NULL weights: slot_w untouched */
    float untouched[10];
    memset(untouched, 0x7f, sizeof untouched);
    assert_int_equal(fl_moe_dispatch_plan(5, 2, ids, NULL, 8, 4, row, ex, untouched, cnt, dsp, scratch),
                     FL_OK);
    assert_memory_equal(row, want_row, sizeof want_row);
    for (int i = 0; i < 10; i++) assert_int_equal(((uint32_t *)untouched)[i], 0x7f7f7f7fu);
}

static void test_plan_empty(void **state) {
    (void)state;
    int32_t scratch[5];
    size_t cnt[2] = {9, 9}, dsp[2] = {9, 9};
    assert_int_equal(fl_moe_dispatch_plan(0, 2, NULL, NULL, 4, 2, NULL, NULL, NULL, cnt, dsp, scratch),
                     FL_OK);
    assert_int_equal(cnt[0], 0);
    assert_int_equal(cnt[1], 0);
    assert_int_equal(dsp[1], 0);
}

static void test_plan_malformed(void **state) {
    (void)state;
    int32_t row[4], ex[4], scratch[9];
    float sw[4];
    size_t cnt[4], dsp[4];
    const int32_t bad_hi[4] = {0, 8, 1, 2}, bad_lo[4] = {0, -1, 1, 2};
    assert_int_equal(fl_moe_dispatch_plan(2, 2, bad_hi, NULL, 8, 4, row, ex, sw, cnt, dsp, scratch),
                     FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "expert 8 of 8"));
    assert_int_equal(fl_moe_dispatch_plan(2, 2, bad_lo, NULL, 8, 4, row, ex, sw, cnt, dsp, scratch),
                     FL_ERR_INVALID_ARG);
    const int32_t ok[4] = {0, 1, 2, 3};
    assert_int_equal(fl_moe_dispatch_plan(2, 2, ok, NULL, 8, 3, row, ex, sw, cnt, dsp, scratch),
                     FL_ERR_INVALID_ARG); /* 8 experts do not divide over 3 */
    assert_non_null(strstr(fl_error_msg(), "ep 3"));
    assert_int_equal(fl_moe_dispatch_plan(-1, 2, ok, NULL, 8, 4, row, ex, sw, cnt, dsp, scratch),
                     FL_ERR_INVALID_ARG);
    assert_int_equal(fl_moe_dispatch_plan(2, 0, ok, NULL, 8, 4, row, ex, sw, cnt, dsp, scratch),
                     FL_ERR_INVALID_ARG);
}

static void test_local(void **state) {
    (void)state;
    /* rank holding experts 6, 7 received rows from two senders */
    const int32_t rx[7] = {7, 6, 6, 7, 7, 6, 7};
    int32_t order[7], start[3];
    assert_int_equal(fl_moe_dispatch_local(7, rx, 6, 2, order, start), FL_OK);
    const int32_t want_order[7] = {1, 2, 5, 0, 3, 4, 6}, want_start[3] = {0, 3, 7};
    assert_memory_equal(order, want_order, sizeof want_order);
    assert_memory_equal(start, want_start, sizeof want_start);
    /* nothing received: all ranges empty */
    assert_int_equal(fl_moe_dispatch_local(0, NULL, 6, 2, order, start), FL_OK);
    assert_int_equal(start[0], 0);
    assert_int_equal(start[2], 0);
    /* a row for an expert held elsewhere is refused, naming it */
    const int32_t wrong[2] = {6, 5};
    assert_int_equal(fl_moe_dispatch_local(2, wrong, 6, 2, order, start), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "expert 5"));
    assert_int_equal(fl_moe_dispatch_local(1, wrong, 6, 0, order, start), FL_ERR_INVALID_ARG);
}

/* Simulates the whole exchange over P ranks holding different tokens: the
 * combined output of every token must equal the single-rank computation
 * (expert e maps x to x * (e + 1) + e, a stand-in for the MLP) bit for bit,
 * since the slots come back in ascending expert order. */
enum { P = 4, E = 8, K = 3, D = 2, MAXN = 6 };
static void test_simulated_exchange(void **state) {
    (void)state;
    const int n_of[P] = {5, 0, 6, 1}; /* rank 1 idles */
    int32_t ids[P][MAXN * K];
    float wts[P][MAXN * K], x[P][MAXN][D];
    unsigned seed = 12345;
    for (int r = 0; r < P; r++)
        for (int i = 0; i < n_of[r]; i++) {
            for (int d = 0; d < D; d++) x[r][i][d] = (float)((seed = seed * 1103515245u + 12345u) >> 16) / 65536.f;
            for (int j = 0; j < K; j++) {
                int e;
                do { /* distinct experts per token, skewed towards rank 3's */
                    e = (int)((seed = seed * 1103515245u + 12345u) >> 16) % (E + 4);
                    if (e >= E) e = 7 - (e - E) % 2;
                    bool dup = false;
                    for (int q = 0; q < j; q++) dup |= ids[r][i * K + q] == e;
                    if (!dup) break;
                } while (1);
                ids[r][i * K + j] = e;
                wts[r][i * K + j] = 0.1f * (float)(j + 1) + 0.01f * (float)i;
            }
        }
    int32_t row[P][MAXN * K], ex[P][MAXN * K], scratch[E + 1];
    float sw[P][MAXN * K];
    size_t sc[P][P], sd[P][P], rc[P][P], rd[P][P];
    for (int r = 0; r < P; r++)
        assert_int_equal(fl_moe_dispatch_plan(n_of[r], K, ids[r], wts[r], E, P, row[r], ex[r], sw[r],
                                              sc[r], sd[r], scratch), FL_OK);
    /* exchange counts: rc[dst][src] = sc[src][dst] */
    for (int s = 0; s < P; s++)
        for (int d = 0; d < P; d++) rc[d][s] = sc[s][d];
    float back[P][MAXN * K][D];
    for (int d = 0; d < P; d++) {
        size_t n_recv = fl_moe_displs(rc[d], P, rd[d]);
        int32_t rx[P * MAXN * K], order[P * MAXN * K], start[E / P + 1];
        float rows[P * MAXN * K][D], res[P * MAXN * K][D];
        for (int s = 0; s < P; s++)
            for (size_t i = 0; i < rc[d][s]; i++) {
                size_t from = sd[s][d] + i;
                rx[rd[d][s] + i] = ex[s][from];
                memcpy(rows[rd[d][s] + i], x[s][row[s][from]], sizeof rows[0]);
            }
        assert_int_equal(fl_moe_dispatch_local((int)n_recv, rx, d * (E / P), E / P, order, start), FL_OK);
        memset(res, 0, sizeof res);
        for (int j = 0; j < E / P; j++)
            for (int q = start[j]; q < start[j + 1]; q++) {
                int i = order[q], e = d * (E / P) + j;
                assert_int_equal(rx[i], e);
                for (int c = 0; c < D; c++) res[i][c] = rows[i][c] * (float)(e + 1) + (float)e;
            }
        /* results back along the reverse counts */
        for (int s = 0; s < P; s++)
            for (size_t i = 0; i < rc[d][s]; i++) memcpy(back[s][sd[s][d] + i], res[rd[d][s] + i], sizeof back[0][0]);
    }
    for (int r = 0; r < P; r++) {
        float got[MAXN][D] = {{0}}, want[MAXN][D] = {{0}};
        for (int q = 0; q < n_of[r] * K; q++)
            for (int c = 0; c < D; c++) got[row[r][q]][c] += sw[r][q] * back[r][q][c];
        for (int e = 0; e < E; e++) /* single rank: experts in ascending order */
            for (int i = 0; i < n_of[r]; i++)
                for (int j = 0; j < K; j++)
                    if (ids[r][i * K + j] == e)
                        for (int c = 0; c < D; c++)
                            want[i][c] += wts[r][i * K + j] * (x[r][i][c] * (float)(e + 1) + (float)e);
        assert_memory_equal(got, want, sizeof got);
    }
    assert_int_equal(sc[1][0] + sc[1][1] + sc[1][2] + sc[1][3], 0);
}

static void test_row_slice(void **state) {
    (void)state;
    int lo, cnt, next = 0;
    for (int t = 0; t < 4; t++) { /* 10 rows over 4: 3 3 2 2, contiguous */
        fl_moe_row_slice(10, 4, t, &lo, &cnt);
        assert_int_equal(lo, next);
        assert_int_equal(cnt, t < 2 ? 3 : 2);
        next = lo + cnt;
    }
    assert_int_equal(next, 10);
    fl_moe_row_slice(1, 2, 1, &lo, &cnt); /* fewer rows than ranks: an empty slice */
    assert_int_equal(cnt, 0);
    assert_int_equal(lo, 1);
    fl_moe_row_slice(0, 3, 2, &lo, &cnt);
    assert_int_equal(cnt, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_displs),
        cmocka_unit_test(test_plan_uneven),
        cmocka_unit_test(test_plan_empty),
        cmocka_unit_test(test_plan_malformed),
        cmocka_unit_test(test_local),
        cmocka_unit_test(test_simulated_exchange),
        cmocka_unit_test(test_row_slice),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
