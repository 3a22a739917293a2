/*
 * test_gguf_kquant.c — GGUF files with K-quant / IQ4 weights, end to end.
 *
 * tests/gguf/kquant_model/ holds a tiny llama written four times (all Q4_K,
 * all Q5_K, all Q6_K, and a mix of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
 * IQ4_NL, IQ4_XS) by tests/gguf/make_kquant_model.py. For each file:
 *  - every quantized tensor reports its ggml kind and shape; linears load as
 *    W4 group 32 (Q4_K) or f32 (the rest), embeddings as f32, and their first
 *    and last rows equal gguf-py's dequantization bit for bit;
 *  - the CPU forward's logits match a float64 forward over the same
 *    dequantized weights (<= 1e-4 relative, the bar of the float golden
 *    fixtures), so loading adds no error beyond the quantization itself;
 *  - their distance to the float64 logits of the unquantized weights is
 *    printed: what the quantization costs on this model.
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

#define DIR FL_TEST_DATA "/gguf/kquant_model/"

static double max_rel_err(const float *got, const double *ref, int T, int V) {
    double worst = 0;
    for (int t = 0; t < T; t++) {
        double num = 0, den = 0;
        for (int v = 0; v < V; v++) {
            num = fmax(num, fabs(got[t * V + v] - ref[t * V + v]));
            den = fmax(den, fabs(ref[t * V + v]));
        }
        worst = fmax(worst, num / den);
    }
    return worst;
}

/* The linear prefix of an HF weight name ("...q_proj.weight" -> "...q_proj"). */
static void prefix_of(const char *name, char *out, size_t n) {
    snprintf(out, n, "%s", name);
    char *dot = strrchr(out, '.');
    if (dot) *dot = 0;
}

static void check_tensors(const fl_ckpt *ck, const char *model, const cJSON *tensors, const float *rows) {
    size_t at = 0;
    for (int i = 0; i < cJSON_GetArraySize(tensors); i++) {
        const cJSON *jt = cJSON_GetArrayItem(tensors, i);
        const char *name = cJSON_GetObjectItem(jt, "name")->valuestring;
        const char *kind = cJSON_GetObjectItem(jt, "dtype")->valuestring;
        const cJSON *js = cJSON_GetObjectItem(jt, "shape");
        int64_t shape[2] = {(int64_t)cJSON_GetArrayItem(js, 0)->valuedouble,
                            (int64_t)cJSON_GetArrayItem(js, 1)->valuedouble};
        const fl_ckpt_tensor *t;
        if (fl_ckpt_get(ck, name, &t) != FL_OK) fail_msg("%s: %s", model, fl_error_msg());
        assert_string_equal(fl_dtype_name(t->dtype), kind);
        assert_int_equal(t->ndim, 2);
        assert_int_equal(t->shape[0], shape[0]);
        assert_int_equal(t->shape[1], shape[1]);

        fl_tensor w;
        const bool embed = strcmp(name, "model.embed_tokens.weight") == 0;
        if (embed) {
            assert_int_equal(fl_ckpt_load_tensor(ck, name, 2, shape, &w), FL_OK);
            assert_int_equal(w.dtype, FL_DTYPE_F32);
        } else {
            char prefix[256];
            prefix_of(name, prefix, sizeof prefix);
            if (fl_ckpt_load_linear(ck, prefix, shape[0], shape[1], FL_LOAD_AS_STORED, &w) != FL_OK)
                fail_msg("%s: %s", name, fl_error_msg());
            if (t->dtype == FL_DTYPE_Q4_K) {
                assert_int_equal(w.dtype, FL_DTYPE_W4);
                assert_int_equal(w.group, 32);
            } else {
                assert_int_equal(w.dtype, FL_DTYPE_F32);
            }
        }
        float *got = malloc((size_t)shape[1] * sizeof *got);
        for (int k = 0; k < 2; k++) {
            fl_tensor_row_f32(&w, k ? shape[0] - 1 : 0, got);
            for (int64_t c = 0; c < shape[1]; c++)
                if (memcmp(&got[c], &rows[at + c], 4) != 0)
                    fail_msg("%s: %s (%s) row %s col %lld = %.9g, gguf-py %.9g", model, name, kind, k ? "last" : "0",
                             (long long)c, (double)got[c], (double)rows[at + c]);
            at += (size_t)shape[1];
        }
        free(got);
        fl_tensor_free(&w);
    }
}

static void run_model(const char *model) {
    char path[512];
    snprintf(path, sizeof path, DIR "%s.json", model);
    char *js = fl_test_slurp(path, NULL);
    cJSON *j = cJSON_Parse(js);
    assert_non_null(j);
    int T;
    int32_t *prompt = fl_test_int_array(cJSON_GetObjectItem(j, "prompt"), &T);
    const int V = (int)cJSON_GetObjectItem(j, "vocab_size")->valuedouble;
    const double quant_err = cJSON_GetObjectItem(j, "quant_vs_float_rel_err")->valuedouble;
    size_t n;
    snprintf(path, sizeof path, DIR "%s.rows.f32", model);
    float *rows = (float *)fl_test_slurp(path, NULL);
    snprintf(path, sizeof path, DIR "%s.logits.f64", model);
    double *ref = (double *)fl_test_slurp(path, &n);
    assert_int_equal(n, (size_t)T * V * 8);
    double *ref_float = (double *)fl_test_slurp(DIR "float.logits.f64", &n);
    assert_int_equal(n, (size_t)T * V * 8);

    fl_ckpt *ck;
    snprintf(path, sizeof path, DIR "%s.gguf", model);
    if (fl_ckpt_open(path, &ck) != FL_OK) fail_msg("%s: %s", model, fl_error_msg());
    check_tensors(ck, model, cJSON_GetObjectItem(j, "tensors"), rows);

    fl_backend *be;
    fl_model *m;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    fl_model_load_opts lo = {.quant = FL_LOAD_AS_STORED};
    if (fl_model_load(ck, be, &lo, &m) != FL_OK) fail_msg("%s: %s", model, fl_error_msg());
    assert_int_equal(m->cfg.vocab_size, V);
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 16 << 20;
    ec.max_model_len = T + 1;
    fl_engine *e;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_OK);
    float *got = malloc(sizeof(float) * (size_t)T * V);
    assert_int_equal(fl_engine_prompt_logits(e, prompt, T, got), FL_OK);
    const double err = max_rel_err(got, ref, T, V), err_float = max_rel_err(got, ref_float, T, V);
    printf("  %-12s vs dequantized f64 %.2e; vs float f64 %.3e (quantization alone %.3e)\n", model, err, err_float,
           quant_err);
    if (!(err <= 1e-4)) fail_msg("%s: max relative logit error %.3e > 1e-4 against the dequantized model", model, err);
    assert_true(fabs(err_float - quant_err) <= 1e-3 * quant_err + 1e-4);

    free(got);
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
    free(ref_float);
    free(ref);
    free(rows);
    free(prompt);
    cJSON_Delete(j);
    free(js);
}

static void test_q4_k(void **s) { (void)s; run_model("llama_q4_k"); }
static void test_q5_k(void **s) { (void)s; run_model("llama_q5_k"); }
static void test_q6_k(void **s) { (void)s; run_model("llama_q6_k"); }
static void test_mixed(void **s) { (void)s; run_model("llama_mixed"); }

/* Row blocks of a K-quant linear are whole rows of the whole weight; a
 * column cut inside a 256-element super-block is refused, naming the block. */
static void test_slices(void **s) {
    (void)s;
    fl_ckpt *ck;
    assert_int_equal(fl_ckpt_open(DIR "llama_mixed.gguf", &ck), FL_OK);
    static const char *const pre[] = {"model.layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj",
                                      "model.layers.0.self_attn.q_proj"}; /* Q4_K, Q6_K, Q2_K */
    for (int i = 0; i < 3; i++) {
        fl_tensor whole, part;
        assert_int_equal(fl_ckpt_load_linear(ck, pre[i], 256, 256, FL_LOAD_AS_STORED, &whole), FL_OK);
        fl_ckpt_slice sl = {.row_lo = 37, .n_rows = 100, .col_lo = 0, .n_cols = 256};
        assert_int_equal(fl_ckpt_load_linear_part(ck, pre[i], 256, 256, &sl, FL_LOAD_AS_STORED, &part), FL_OK);
        assert_int_equal(part.dtype, whole.dtype);
        float a[256], b[256];
        for (int r = 0; r < 100; r++) {
            fl_tensor_row_f32(&whole, 37 + r, a);
            fl_tensor_row_f32(&part, r, b);
            assert_memory_equal(a, b, sizeof a);
        }
        fl_tensor_free(&part);
        fl_tensor_free(&whole);
        fl_ckpt_slice bad = {.row_lo = 0, .n_rows = 256, .col_lo = 128, .n_cols = 128};
        assert_int_equal(fl_ckpt_load_linear_part(ck, pre[i], 256, 256, &bad, FL_LOAD_AS_STORED, &part),
                         FL_ERR_UNSUPPORTED);
        assert_non_null(strstr(fl_error_msg(), "256 columns"));
    }
    /* --quantize w4 turns the f32-decoded kinds into W4 too */
    fl_tensor w;
    assert_int_equal(fl_ckpt_load_linear(ck, "model.layers.0.mlp.down_proj", 256, 256, FL_LOAD_W4, &w), FL_OK);
    assert_int_equal(w.dtype, FL_DTYPE_W4);
    fl_tensor_free(&w);
    fl_ckpt_free(ck);
}

int main(void) {
    fl_test_cpu_reference_kernels(); /* float64 references at 1e-4 and finer */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_q4_k),  cmocka_unit_test(test_q5_k), cmocka_unit_test(test_q6_k),
        cmocka_unit_test(test_mixed), cmocka_unit_test(test_slices),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
