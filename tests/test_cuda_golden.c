/*
 * test_cuda_golden.c — the whole engine on the CUDA backend against the
 * Hugging Face float64 reference logits of tests/golden/<name>/ (the
 * fixtures test_golden.c checks on the CPU at 1e-4, and the GPTQ,
 * compressed-tensors and FP8 fixtures, dense and MoE, that test_gptq.c,
 * test_quant.c and test_fp8.c check there).
 *
 * Tolerance: per prompt position, max |ours - ref| / max |ref| <= 5e-2.
 * On CUDA the residual stream, K/V cache and every activation are bf16
 * (8 significant bits, 2^-9 relative rounding per value) and 2-D weights are
 * rounded to bf16 at upload, so each of the ~3 layers of these tiny models
 * adds a few 2^-9 relative errors that do not cancel; measured errors are
 * printed so the margin can be read from the log. Greedy continuations are
 * printed, not asserted, beyond the first token: a near-tie between two
 * tokens may legitimately flip under bf16 rounding, and a flip changes the
 * rest of the continuation. The first token is asserted when the
 * reference's top-2 margin exceeds twice the measured logit error.
 *
 * Positions a bf16 run may legitimately get wrong are listed in golden.json
 * as bf16_exempt_positions (tests/golden/check_bf16.py, from the reference
 * model itself): where transformers in bf16 is itself more than 5e-2 off,
 * or where a routing margin is below 2^-7 of the largest router logit, so
 * that bf16 activations can send the token to another expert (a change far
 * larger than rounding). The DeepSeek fixtures have such positions (their
 * routers were not selected for margins); measured on the H200 the
 * positions over the bound were exactly exempt ones (deepseek_v2: 3 and 11,
 * router margins 1.4e-3 and 4.7e-3; deepseek_v2_lite: 6, where transformers
 * in bf16 is 6.7e-2 off, and 25, margin 1.3e-3). Every other position keeps
 * the bound, the median of all must stay under TOL / 2, and the exempt
 * positions over the bound are printed.
 *
 * Two more checks exercise the W4 kernels at model scale: the same
 * checkpoint quantized at load (FL_LOAD_W4) on the CPU and on CUDA must give
 * the same logits to 5e-2, with prefill chunks of 7 tokens (one GEMV launch
 * per matmul) and of the whole 13-token prompt (two). The tiled GEMM is
 * covered op by op in test_cuda_ops (111 tokens). FP8 linears
 * (--quantize fp8) get the same CPU-vs-CUDA check.
 *
 * Skips cleanly (cmocka skip()) when no GPU is usable.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_gpu.h"
#include "tests/test_util.h"

#include "runtime/engine/engine.h"

#define GOLDEN FL_TEST_DATA "/golden/"
#define TOL 5e-2


/* Prompt logits of `prompt` from the checkpoint in `dir` on backend `be`;
 * when greedy != NULL also generates n_greedy tokens into it. */
static float *engine_logits(const char *dir, fl_backend *be, fl_load_quant quant, int chunk,
                            const int32_t *prompt, int T, int V, int32_t *greedy, int n_greedy) {
    fl_ckpt *ck;
    fl_model *m;
    if (fl_ckpt_open(dir, &ck) != FL_OK) fail_msg("%s: %s", dir, fl_error_msg());
    fl_model_load_opts lo = {.quant = quant};
    if (fl_model_load(ck, be, &lo, &m) != FL_OK) fail_msg("%s: %s", dir, fl_error_msg());
    assert_int_equal(m->cfg.vocab_size, V);
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 64 << 20;
    ec.max_num_batched_tokens = chunk;
    ec.max_model_len = T + n_greedy + 1;
    fl_engine *e;
    if (fl_engine_init(m, &ec, &e) != FL_OK) fail_msg("%s: %s", dir, fl_error_msg());
    float *got = malloc(sizeof(float) * (size_t)T * V);
    if (fl_engine_prompt_logits(e, prompt, T, got) != FL_OK) fail_msg("%s: %s", dir, fl_error_msg());
    if (greedy) {
        fl_gen gen;
        assert_int_equal(fl_gen_init(&gen, 0, prompt, T, NULL, n_greedy), FL_OK);
        assert_int_equal(fl_engine_add(e, &gen), FL_OK);
        while (fl_engine_has_work(e)) {
            fl_gen **up;
            int nu;
            if (fl_engine_step(e, &up, &nu) != FL_OK) fail_msg("%s: %s", dir, fl_error_msg());
        }
        int ng = fl_gen_n_generated(&gen);
        for (int i = 0; i < n_greedy; i++) greedy[i] = i < ng ? gen.seq.tokens[T + i] : -1;
        fl_gen_free(&gen);
    }
    fl_engine_free(e);
    fl_model_free(m);
    fl_ckpt_free(ck);
    return got;
}

/* Worst per-position max |got - ref| / max |ref| (each position's into
 * pos_err[T] when given); NaN fails. */
static double worst_err(const float *got, const double *ref, int T, int V, const char *name, double *pos_err) {
    double worst = 0;
    for (int t = 0; t < T; t++) {
        double num = 0, den = 0;
        for (int v = 0; v < V; v++) {
            if (isnan(got[t * V + v])) fail_msg("%s: NaN logit at position %d token %d", name, t, v);
            double d = fabs(got[t * V + v] - ref[t * V + v]);
            num = d > num ? d : num;
            den = fabs(ref[t * V + v]) > den ? fabs(ref[t * V + v]) : den;
        }
        worst = num / den > worst ? num / den : worst;
        if (pos_err) pos_err[t] = num / den;
    }
    return worst;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void run_fixture(const char *name, int chunk) {
    NEED_GPU();
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, name, NULL, 0, &fx);
    const char *dir = fx.dir;
    const int T = fx.T, V = fx.V, n_greedy = fx.n_greedy;
    const int32_t *prompt = fx.prompt, *greedy = fx.greedy;
    const double *ref = fx.ref;

    int32_t *ours = malloc(sizeof(int32_t) * (size_t)n_greedy);
    float *got = engine_logits(dir, g_be, FL_LOAD_AS_STORED, chunk, prompt, T, V, ours, n_greedy);
    double *pos_err = malloc(sizeof(double) * (size_t)T);
    const double worst = worst_err(got, ref, T, V, name, pos_err);
    const cJSON *ex = cJSON_GetObjectItem(fx.json, "bf16_exempt_positions");
    int over = 0, over_exempt = 0, worst_kept_at = -1;
    double worst_kept = 0;
    for (int t = 0; t < T; t++) {
        bool exempt = false;
        const cJSON *it;
        cJSON_ArrayForEach(it, ex) exempt |= cJSON_IsNumber(it) && it->valueint == t;
        if (!exempt && pos_err[t] > worst_kept) worst_kept = pos_err[t], worst_kept_at = t;
        if (!(pos_err[t] <= TOL)) {
            over++;
            over_exempt += exempt;
            printf("  %-18s position %d: rel err %.2e%s\n", name, t, pos_err[t],
                   exempt ? " (bf16-exempt: routing near-tie or transformers' own bf16 error)" : "");
        }
    }
    qsort(pos_err, (size_t)T, sizeof(double), cmp_double);
    const double median = pos_err[T / 2];
    free(pos_err);
    int same = 0;
    while (same < n_greedy && ours[same] == greedy[same]) same++;
    /* the first greedy token is the argmax at the last prompt position: a
     * disagreement there is a near-tie when the reference's top-2 margin is
     * within our measured error */
    const double *last = ref + (size_t)(T - 1) * V;
    double top1 = -1e300, top2 = -1e300, mx = 0;
    for (int v = 0; v < V; v++) {
        if (last[v] > top1) {
            top2 = top1;
            top1 = last[v];
        } else if (last[v] > top2) {
            top2 = last[v];
        }
        mx = fabs(last[v]) > mx ? fabs(last[v]) : mx;
    }
    printf("  %-18s chunk %2d: max rel err %.2e over %d positions; greedy agrees for %d/%d tokens "
           "(ref top-2 margin at the last position %.2e of max)\n",
           name, chunk, worst, T, same, n_greedy, (top1 - top2) / mx);
    if (same == 0 && (top1 - top2) / mx > 2 * worst)
        fail_msg("%s: first greedy token %d differs from the reference %d although the reference "
                 "margin %.2e exceeds twice the logit error", name, ours[0], greedy[0], (top1 - top2) / mx);
    if (cJSON_GetArraySize(ex) > 0) {
        printf("  %-18s %d bf16-exempt positions (%d of them over %.0e); the others at most %.2e, median of all "
               "%.2e\n", name, cJSON_GetArraySize(ex), over_exempt, TOL, worst_kept, median);
        if (!(median <= TOL / 2)) fail_msg("%s: median relative logit error %.3e > %.1e", name, median, TOL / 2);
    }
    if (over > over_exempt)
        fail_msg("%s: position %d: relative logit error %.3e > %.1e (%d positions over)", name, worst_kept_at,
                 worst_kept, TOL, over - over_exempt);
    free(ours);
    free(got);
    fl_test_golden_free(&fx);
}

/* FP8's bound against the CPU. Both backends quantize every matmul's input
 * to e4m3, but from different activations (bf16 on CUDA, f32 on the CPU):
 * an element within bf16's rounding (2^-9) of an e4m3 rounding midpoint
 * takes the neighbouring code, one e4m3 step (2^-4) away, for about 2^-9 /
 * 2^-4 = 1/32 of the elements. That noise has 2^-13 / 2^-18 = 32 times the
 * power of the bf16 rounding noise alone, about 5.7 times its amplitude;
 * the W4 check on llama (bf16 noise only) measures 1.3-1.5e-2, which puts
 * FP8 near 8e-2 (measured on an H100: 1.07e-1 at 7-token chunks); the bound
 * is 1.5e-1.
 * The FP8 kernels themselves are held to 1e-2 op by op on identical inputs
 * (test_cuda_ops). */
#define TOL_FP8 1.5e-1

/* CUDA against the CPU on the same load-time quantization (W4 or FP8). */
static void run_quant_vs_cpu(const char *name, fl_load_quant quant, int chunk) {
    const char *qn = quant == FL_LOAD_FP8 ? "FP8" : "W4";
    const double tol = quant == FL_LOAD_FP8 ? TOL_FP8 : TOL;
    NEED_GPU();
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, name, NULL, 1, &fx); /* the reference is the CPU run */
    const char *dir = fx.dir;
    const int T = fx.T, V = fx.V;
    const int32_t *prompt = fx.prompt;
    fl_backend *cpu;
    assert_int_equal(fl_backend_cpu_init(&cpu), FL_OK);
    float *ref32 = engine_logits(dir, cpu, quant, chunk, prompt, T, V, NULL, 0);
    const long fp8_before = gpu_fp8_gemm_launches();
    float *got = engine_logits(dir, g_be, quant, chunk, prompt, T, V, NULL, 0);
    /* every linear of the fixture is a multiple of 16: no bf16 fallback */
    if (quant == FL_LOAD_FP8 && gpu_fp8_gemm_launches() == fp8_before)
        fail_msg("%s FP8: no FP8 GEMM ran on CUDA", name);
    double *ref = malloc(sizeof(double) * (size_t)T * V);
    for (size_t i = 0; i < (size_t)T * V; i++) ref[i] = ref32[i];
    const double worst = worst_err(got, ref, T, V, name, NULL);
    printf("  %-18s %s cuda vs cpu, chunk %2d: max rel err %.2e over %d positions\n", name, qn, chunk, worst, T);
    if (!(worst <= tol)) fail_msg("%s %s: max relative logit error %.3e > %.1e", name, qn, worst, tol);
    fl_backend_free(cpu);
    free(ref32);
    free(got);
    free(ref);
    fl_test_golden_free(&fx);
}

#define GOLDEN_TEST(name) \
    static void test_##name(void **state) { (void)state; run_fixture(#name, 7); }
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
GOLDEN_TEST(llama_ct_fp8)     /* FP8 dequantized at load, uploaded as bf16 */
GOLDEN_TEST(llama_fp8_block)
GOLDEN_TEST(llama_ct_fp8_tensor)
GOLDEN_TEST(llama_fp8_tensor)
GOLDEN_TEST(qwen2_moe_ct_fp8) /* FP8 experts (compressed-tensors channel scales) */
GOLDEN_TEST(qwen2_moe_fp8_block)
GOLDEN_TEST(llama_gptq)       /* GPTQ and compressed-tensors W4A16: repacked to the W4 kernels' layout */
GOLDEN_TEST(llama_gptq_act)
GOLDEN_TEST(llama_gptq_chan)
GOLDEN_TEST(llama_ct)
GOLDEN_TEST(llama_ct_asym)
GOLDEN_TEST(llama_ct_channel)
GOLDEN_TEST(deepseek_v2)      /* MLA: kernels/cuda/cuda_mla.cu */
GOLDEN_TEST(deepseek_v2_lite)

static void test_llama_awq_whole_prompt(void **state) { (void)state; run_fixture("llama_awq", 64); }
/* llama: hidden 96 and MLP 160 are multiples of the W4 group (32) */
static void test_w4_gemv(void **state) { (void)state; run_quant_vs_cpu("llama", FL_LOAD_W4, 7); }
static void test_w4_gemm(void **state) { (void)state; run_quant_vs_cpu("llama", FL_LOAD_W4, 64); }
/* FP8 linears (cuBLASLt; 7-token chunks: one partial sixteen, the whole
 * prompt: 13 tokens) */
static void test_fp8(void **state) {
    (void)state;
    run_quant_vs_cpu("llama", FL_LOAD_FP8, 7);
    run_quant_vs_cpu("llama", FL_LOAD_FP8, 64);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama),         cmocka_unit_test(test_llama_tied_rope3),
        cmocka_unit_test(test_llama_linear),  cmocka_unit_test(test_llama_dynamic),
        cmocka_unit_test(test_llama_yarn),    cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_mixtral),       cmocka_unit_test(test_qwen2_moe),
        cmocka_unit_test(test_qwen3_moe),     cmocka_unit_test(test_llama_awq),
        cmocka_unit_test(test_llama_awq_whole_prompt),
        cmocka_unit_test(test_llama_ct_fp8),  cmocka_unit_test(test_llama_fp8_block),
        cmocka_unit_test(test_llama_ct_fp8_tensor), cmocka_unit_test(test_llama_fp8_tensor),
        cmocka_unit_test(test_qwen2_moe_ct_fp8), cmocka_unit_test(test_qwen2_moe_fp8_block),
        cmocka_unit_test(test_llama_gptq),    cmocka_unit_test(test_llama_gptq_act),
        cmocka_unit_test(test_llama_gptq_chan), cmocka_unit_test(test_llama_ct),
        cmocka_unit_test(test_llama_ct_asym), cmocka_unit_test(test_llama_ct_channel),
        cmocka_unit_test(test_w4_gemv),       cmocka_unit_test(test_w4_gemm),      cmocka_unit_test(test_fp8),
        cmocka_unit_test(test_deepseek_v2),   cmocka_unit_test(test_deepseek_v2_lite),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
