/*
 * test_bench_stats.c — the workload benchmark's pure parts
 * (launcher/bench_workload.h): percentiles by linear interpolation between
 * the closest ranks (numpy's default), the flags' defaults (the KV cache
 * left to be sized from memory) and bad values refused by name.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "launcher/bench_workload.h"

static void test_percentile(void **state) {
    (void)state;
    const double v[] = {1, 2, 3, 4};
    assert_float_equal(fl_bench_percentile(v, 4, 0), 1, 1e-12);
    assert_float_equal(fl_bench_percentile(v, 4, 50), 2.5, 1e-12);
    assert_float_equal(fl_bench_percentile(v, 4, 90), 3.7, 1e-12);
    assert_float_equal(fl_bench_percentile(v, 4, 99), 3.97, 1e-12);
    assert_float_equal(fl_bench_percentile(v, 4, 100), 4, 1e-12);
    assert_float_equal(fl_bench_percentile(v + 2, 1, 99), 3, 1e-12);
    assert_float_equal(fl_bench_percentile(NULL, 0, 50), 0, 0);
    /* 101 values 0..100: percentile p is p */
    double w[101];
    for (int i = 0; i <= 100; i++) w[i] = i;
    for (int p = 0; p <= 100; p += 7) assert_float_equal(fl_bench_percentile(w, 101, p), p, 1e-9);
}

static void test_defaults(void **state) {
    (void)state;
    fl_bench_workload_opts wo = {0};
    fl_cli_model_opts mo = {0};
    fl_bench_workload w;
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    assert_int_equal(fl_bench_workload_parse(&wo, &mo, &w, &ec), FL_OK);
    assert_int_equal(w.num_prompts, 200);
    assert_int_equal(w.input_len, 128);
    assert_int_equal(w.output_len, 128);
    assert_int_equal(w.dist, FL_BENCH_LEN_UNIFORM);
    assert_true(isinf(w.request_rate));
    assert_int_equal(w.max_concurrency, 0);
    /* the cache and the batch sized from memory */
    assert_int_equal(ec.n_blocks, 0);
    assert_int_equal(ec.max_num_seqs, 0);
    assert_int_equal(ec.kv_cache_bytes, 0);
    assert_true(ec.prefix_caching);
    assert_null(fl_bench_workload_flag_given(&wo, &mo));
}

static void test_flags(void **state) {
    (void)state;
    fl_bench_workload_opts wo = {.num_prompts = "24", .input_len = "64", .output_range = "0.25",
                                 .shared_prefix = "32", .request_rate = "2.5", .max_concurrency = "8"};
    fl_cli_model_opts mo = {.max_num_seqs = "16", .no_prefix_caching = "1", .kv_cache_mb = "4"};
    fl_bench_workload w;
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    assert_int_equal(fl_bench_workload_parse(&wo, &mo, &w, &ec), FL_OK);
    assert_int_equal(w.num_prompts, 24);
    assert_int_equal(w.input_len, 64);
    assert_float_equal(w.output_range, 0.25, 0);
    assert_int_equal(w.shared_prefix_len, 32);
    assert_float_equal(w.request_rate, 2.5, 0);
    assert_int_equal(w.max_concurrency, 8);
    assert_int_equal(ec.max_num_seqs, 16);
    assert_false(ec.prefix_caching);
    assert_int_equal(ec.kv_cache_bytes, 4 << 20);
    assert_string_equal(fl_bench_workload_flag_given(&wo, &mo), "num-prompts");
    wo = (fl_bench_workload_opts){.request_rate = "inf", .length_dist = "lognormal"};
    assert_int_equal(fl_bench_workload_parse(&wo, &mo, &w, &ec), FL_OK);
    assert_true(isinf(w.request_rate));
    assert_int_equal(w.dist, FL_BENCH_LEN_LOGNORMAL);
}

/* Each bad value: FL_ERR_INVALID_ARG and a message naming its flag. */
static void test_bad(void **state) {
    (void)state;
    const struct {
        fl_bench_workload_opts wo;
        fl_cli_model_opts mo;
        const char *flag;
    } cases[] = {
        {.wo = {.num_prompts = "0"}, .flag = "--num-prompts"},
        {.wo = {.input_len = "-3"}, .flag = "--input-len"},
        {.wo = {.output_len = "12x"}, .flag = "--output-len"},
        {.wo = {.input_range = "2"}, .flag = "--input-len-range"},
        {.wo = {.output_range = "-0.1"}, .flag = "--output-len-range"},
        {.wo = {.length_dist = "zipf"}, .flag = "--length-dist"},
        {.wo = {.length_dist = "lognormal", .output_range = "0.5"}, .flag = "--output-len-range"},
        {.wo = {.request_rate = "0"}, .flag = "--request-rate"},
        {.wo = {.shared_prefix = "-1"}, .flag = "--shared-prefix-len"},
        {.wo = {.max_concurrency = "0"}, .flag = "--max-concurrency"},
        {.mo = {.max_batched_tokens = "0"}, .flag = "--max-batched-tokens"},
        {.mo = {.kv_cache_dtype = "fp4"}, .flag = "fp4"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_bench_workload w;
        fl_engine_config ec;
        fl_engine_config_default(&ec);
        fl_error_clear();
        assert_int_equal(fl_bench_workload_parse(&cases[i].wo, &cases[i].mo, &w, &ec), FL_ERR_INVALID_ARG);
        if (!strstr(fl_error_msg(), cases[i].flag)) fail_msg("case %zu: '%s' does not name %s", i, fl_error_msg(),
                                                              cases[i].flag);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_percentile),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_flags),
        cmocka_unit_test(test_bad),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
