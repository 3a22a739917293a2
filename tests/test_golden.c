/*
 * test_golden.c — the CPU engine against Hugging Face transformers.
 *
 * Each tests/golden/<name>/ fixture (made by tests/golden/make_golden.py)
 * holds a tiny random-weight model saved by transformers, the float64
 * reference logits of a prompt at every position, and the reference greedy
 * continuation. Pass: per position, max |ours - ref| / max |ref| <= 1e-4,
 * and identical greedy tokens.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_util.h"

#include "runtime/engine/engine.h"

#define GOLDEN FL_TEST_DATA "/golden/"

/* check_greedy: the float fixtures must reproduce the reference tokens; a
 * model quantized at load time (--quantize w4) is only close, not equal. */
static void run_fixture_opts(const char *name, fl_load_quant quant, double tol, bool check_greedy,
                             const char *logits_file);
static void run_fixture(const char *name, fl_load_quant quant, double tol) {
    run_fixture_opts(name, quant, tol, true, NULL);
}

/* logits_file: reference other than golden.json's (NULL = golden.json's). */
static void run_fixture_opts(const char *name, fl_load_quant quant, double tol, bool check_greedy,
                             const char *logits_file) {
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, name, logits_file, 0, &fx);
    const char *dir = fx.dir;
    const int T = fx.T, V = fx.V;
    int n_greedy = fx.n_greedy;
    const int32_t *prompt = fx.prompt, *greedy = fx.greedy;
    const double *ref = fx.ref;

    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    if (fl_ckpt_open(dir, &ck) != FL_OK) fail_msg("%s: %s", name, fl_error_msg());
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    fl_model_load_opts lo = {.quant = quant};
    if (fl_model_load(ck, be, &lo, &m) != FL_OK) fail_msg("%s: %s", name, fl_error_msg());
    assert_int_equal(m->cfg.vocab_size, V);
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 64 << 20;
    ec.max_num_batched_tokens = 7; /* chunked prefill on purpose */
    ec.max_model_len = T + n_greedy + 1; /* llama_dynamic runs past its max positions on purpose */
    fl_engine *e;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_OK);

    float *got = malloc(sizeof(float) * (size_t)T * V);
    assert_int_equal(fl_engine_prompt_logits(e, prompt, T, got), FL_OK);
    double worst = 0;
    for (int t = 0; t < T; t++) {
        double num = 0, den = 0;
        for (int v = 0; v < V; v++) {
            double d = fabs(got[t * V + v] - ref[t * V + v]);
            num = d > num ? d : num;
            den = fabs(ref[t * V + v]) > den ? fabs(ref[t * V + v]) : den;
        }
        worst = num / den > worst ? num / den : worst;
    }
    printf("  %-18s %s max rel err %.2e over %d positions\n", name,
           quant == FL_LOAD_W4 ? "(w4 RTN)" : quant == FL_LOAD_FP8 ? "(fp8)" : "", worst, T);
    if (!(worst <= tol)) fail_msg("%s: max relative logit error %.3e > %.1e", name, worst, tol);

    if (!check_greedy) n_greedy = 0;
    fl_gen gen;
    assert_int_equal(fl_gen_init(&gen, 0, prompt, T, NULL, n_greedy ? n_greedy : 1), FL_OK);
    assert_int_equal(fl_engine_add(e, &gen), FL_OK);
    while (fl_engine_has_work(e)) {
        fl_gen **up;
        int nu;
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
    }
    int ng = fl_gen_n_generated(&gen);
    for (int i = 0; i < n_greedy; i++) {
        /* an EOS produced by the reference ends our generation there too */
        if (i >= ng) fail_msg("%s: generation stopped after %d of %d tokens", name, ng, n_greedy);
        if (gen.seq.tokens[T + i] != greedy[i])
            fail_msg("%s: greedy token %d is %d, reference %d", name, i, gen.seq.tokens[T + i],
                     greedy[i]);
    }
    fl_gen_free(&gen);
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
    free(got);
    fl_test_golden_free(&fx);
}

#define GOLDEN_TEST(name) \
    static void test_##name(void **state) { (void)state; run_fixture(#name, FL_LOAD_AS_STORED, 1e-4); }
GOLDEN_TEST(llama)
GOLDEN_TEST(llama_tied_rope3)
GOLDEN_TEST(llama_linear)
GOLDEN_TEST(llama_dynamic)
GOLDEN_TEST(llama_yarn)
GOLDEN_TEST(qwen2)
GOLDEN_TEST(mixtral)
GOLDEN_TEST(qwen2_moe)
GOLDEN_TEST(qwen3_moe)
GOLDEN_TEST(llama_awq)
GOLDEN_TEST(llama_ct)
GOLDEN_TEST(llama_ct_asym)
GOLDEN_TEST(llama_ct_channel)
GOLDEN_TEST(llama_gptq)
GOLDEN_TEST(llama_gptq_act)
GOLDEN_TEST(llama_gptq_chan)
GOLDEN_TEST(llama_ct_fp8)
GOLDEN_TEST(llama_ct_fp8_tensor)
GOLDEN_TEST(llama_fp8_tensor)
GOLDEN_TEST(llama_fp8_block)
GOLDEN_TEST(qwen2_moe_ct_fp8)
GOLDEN_TEST(qwen2_moe_fp8_block)
GOLDEN_TEST(deepseek_v2)
GOLDEN_TEST(deepseek_v2_lite)

/* --quantize w4: round-to-nearest 4-bit (group 128/64/32, whichever divides) of the
 * float llama fixture, against transformers running the same RTN-dequantized
 * weights (tests/golden/make_rtn_golden.py). Greedy tokens are not checked:
 * the reference continuation is the float model's. */
static void test_llama_rtn_w4(void **state) {
    (void)state;
    run_fixture_opts("llama", FL_LOAD_W4, 1e-4, false, "rtn_w4_logits.f64");
}

/* --quantize fp8: e4m3 weights with a scale a row and activations with a
 * scale a token (kernels/backend.h) on the float llama fixture, against
 * transformers running the same W8A8 linears in float64
 * (tests/golden/make_fp8w8a8_golden.py). Greedy tokens are not checked: the
 * reference continuation is the float model's. */
static void test_llama_fp8(void **state) {
    (void)state;
    run_fixture_opts("llama", FL_LOAD_FP8, 1e-4, false, "fp8_logits.f64");
}

int main(void) {
    fl_test_cpu_reference_kernels(); /* float64 references at 1e-4 and finer */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama),         cmocka_unit_test(test_llama_fp8),         cmocka_unit_test(test_llama_tied_rope3),
        cmocka_unit_test(test_llama_linear),  cmocka_unit_test(test_llama_dynamic),
        cmocka_unit_test(test_llama_yarn),    cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_mixtral),       cmocka_unit_test(test_qwen2_moe),
        cmocka_unit_test(test_qwen3_moe),     cmocka_unit_test(test_llama_awq),
        cmocka_unit_test(test_llama_rtn_w4),  cmocka_unit_test(test_deepseek_v2),
        cmocka_unit_test(test_deepseek_v2_lite),
        cmocka_unit_test(test_llama_ct),      cmocka_unit_test(test_llama_ct_asym),
        cmocka_unit_test(test_llama_ct_channel), cmocka_unit_test(test_llama_gptq),
        cmocka_unit_test(test_llama_gptq_act), cmocka_unit_test(test_llama_gptq_chan),
        cmocka_unit_test(test_llama_ct_fp8),  cmocka_unit_test(test_llama_ct_fp8_tensor),
        cmocka_unit_test(test_llama_fp8_tensor), cmocka_unit_test(test_llama_fp8_block),
        cmocka_unit_test(test_qwen2_moe_ct_fp8), cmocka_unit_test(test_qwen2_moe_fp8_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
