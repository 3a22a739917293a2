/*
 * test_ppl_window.c — `flotilla perplexity`'s windows (launcher/perplexity.c)
 * over many (tokens, ctx, stride): windows run at most ctx tokens, every
 * scored target has its whole window before it, no target is scored twice,
 * overlapping windows score every token but the first, and disjoint ones
 * all but each window's first; and the NLL of a row against log-softmax.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "launcher/perplexity.h"

static void windows_cover_each_target_once(void **state) {
    (void)state;
    for (int n = 2; n <= 70; n++)
        for (int ctx = 2; ctx <= 20; ctx++)
            for (int stride = 1; stride <= ctx; stride++) {
                char *seen = calloc((size_t)n, 1);
                assert_non_null(seen);
                int scored = 0, windows = 0, last_end = 0;
                fl_ppl_window w;
                for (int k = 0; fl_ppl_window_at(n, ctx, stride, k, &w); k++) {
                    windows++;
                    assert_int_equal(w.begin, k * stride);
                    assert_true(w.end - w.begin >= 1 && w.end - w.begin <= ctx && w.end <= n);
                    assert_true(w.score_from >= w.begin + 1 && w.score_from <= w.end);
                    for (int t = w.score_from; t < w.end; t++) {
                        assert_int_equal(seen[t], 0);
                        seen[t] = 1;
                        scored++;
                    }
                    last_end = w.end;
                }
                assert_int_equal(last_end, n); /* the text is read to its end */
                assert_int_equal(seen[0], 0);
                if (stride < ctx) assert_int_equal(scored, n - 1);
                else assert_int_equal(scored, n - windows);
                free(seen);
            }
}

static void nll_is_minus_log_softmax(void **state) {
    (void)state;
    const float row[5] = {1.5f, -2.0f, 0.25f, 3.0f, -0.5f};
    double lse = 0;
    for (int i = 0; i < 5; i++) lse += exp(row[i]);
    lse = log(lse);
    for (int t = 0; t < 5; t++) assert_true(fabs(fl_ppl_nll(row, 5, t) - (lse - row[t])) < 1e-12);
    /* large logits do not overflow */
    const float big[3] = {1000.0f, 999.0f, 998.0f};
    assert_true(fabs(fl_ppl_nll(big, 3, 0) - log(1 + exp(-1.0) + exp(-2.0))) < 1e-12);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(windows_cover_each_target_once),
        cmocka_unit_test(nll_is_minus_log_softmax),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
