/*
 * test_gguf_deepseek.c — DeepSeek-V2 ("deepseek2") GGUF files.
 *
 * tests/gguf/deepseek/ holds the golden DeepSeek-V2 fixtures converted by
 * llama.cpp's own convert_hf_to_gguf.py (tests/gguf/make_deepseek_fixtures.py):
 * MLA keys key_length_mla / value_length_mla and kv_b_proj split per head
 * into attn_k_b (transposed) / attn_v_b. Checked here:
 *  - deepseek_v2.gguf (F32): the config equals config.json's in every MLA and
 *    routing field, every HF tensor (kv_b_proj joined back) has the same
 *    bytes, and the CPU forward matches transformers' float64 logits to
 *    1e-4 relative at every prompt position, the bar of test_gguf_moe.c;
 *  - deepseek_v2.q8_0.gguf (the converter's Q8_0: attn_k_b, rows of 16,
 *    stays F16, so kv_b_proj is joined in F32) and deepseek_v2_lite.f16.gguf
 *    (attn_q, no q_lora; YaRN): every tensor, decoded, is the HF one to
 *    within its format's rounding, and the logits are within that rounding's
 *    effect (4e-2 for Q8_0, 5e-3 for F16) at every position but at most
 *    one: these tiny random models have routing near-ties, where the
 *    rounding flips an expert choice and that position's logits move by up
 *    to 21 % (the same files' weights decoded into F32 files reproduce that
 *    exactly: it is the rounding, not the reader). GGUF keeps YaRN's mscale_all_dim only
 *    (yarn_log_multiplier), so lite's reference is the HF folder with mscale
 *    set to mscale_all_dim, run by flotilla;
 *  - deepseek_v2.kv_b.q8_0.gguf: the layout of converters before the split
 *    (attn_kv_b whole, key_length / value_length per head, no *_mla keys),
 *    checked the same way;
 *  - malformed metadata and tensors: errors naming the file and the key or
 *    tensor.
 */
#define _GNU_SOURCE
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
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/test_util.h"

#include "runtime/engine/engine.h"

#define GOLDEN FL_TEST_DATA "/golden/"
#define DSDIR FL_TEST_DATA "/gguf/deepseek/"

static void check_config(const fl_model_config *g, const fl_model_config *h) {
    assert_int_equal(g->arch, FL_ARCH_DEEPSEEK_V2);
    assert_int_equal(g->arch, h->arch);
    assert_int_equal(g->vocab_size, h->vocab_size);
    assert_int_equal(g->hidden_size, h->hidden_size);
    assert_int_equal(g->n_layers, h->n_layers);
    assert_int_equal(g->n_heads, h->n_heads);
    assert_int_equal(g->n_kv_heads, h->n_kv_heads);
    assert_int_equal(g->head_dim, h->head_dim);
    assert_int_equal(g->intermediate_size, h->intermediate_size);
    assert_int_equal(g->mla.q_lora_rank, h->mla.q_lora_rank);
    assert_int_equal(g->mla.kv_lora_rank, h->mla.kv_lora_rank);
    assert_int_equal(g->mla.qk_nope_head_dim, h->mla.qk_nope_head_dim);
    assert_int_equal(g->mla.qk_rope_head_dim, h->mla.qk_rope_head_dim);
    assert_int_equal(g->mla.v_head_dim, h->mla.v_head_dim);
    assert_int_equal(g->n_experts, h->n_experts);
    assert_int_equal(g->n_experts_per_tok, h->n_experts_per_tok);
    assert_int_equal(g->moe_intermediate_size, h->moe_intermediate_size);
    assert_int_equal(g->n_shared_experts, h->n_shared_experts);
    assert_int_equal(g->shared_expert_intermediate_size, h->shared_expert_intermediate_size);
    assert_int_equal(g->first_k_dense_replace, h->first_k_dense_replace);
    assert_float_equal(g->routed_scaling_factor, h->routed_scaling_factor, 1e-6);
    assert_int_equal(g->norm_topk_prob, h->norm_topk_prob);
    assert_int_equal(g->topk_method, h->topk_method);
    assert_int_equal(g->n_group, h->n_group);
    assert_int_equal(g->topk_group, h->topk_group);
    assert_int_equal(g->attention_bias, h->attention_bias);
    assert_int_equal(g->tie_word_embeddings, h->tie_word_embeddings);
    assert_int_equal(g->rope.kind, h->rope.kind);
    assert_float_equal(g->rope.theta, h->rope.theta, 1e-3);
    assert_float_equal(g->rope.factor, h->rope.factor, 1e-6);
    assert_float_equal(g->rope.mscale_all_dim, h->rope.mscale_all_dim, 1e-6);
    assert_float_equal(g->rms_norm_eps, h->rms_norm_eps, 1e-12);
    assert_int_equal(g->bos_token_id, h->bos_token_id);
    for (int l = 0; l < h->n_layers; l++)
        assert_int_equal(fl_model_config_layer_is_moe(g, l), fl_model_config_layer_is_moe(h, l));
}

/* Every HF tensor has a GGUF counterpart of the same shape and bytes. */
static void check_tensors(const fl_ckpt *gg, const fl_ckpt *hf) {
    for (size_t i = 0; i < fl_ckpt_count(hf); i++) {
        const fl_ckpt_tensor *h = fl_ckpt_at(hf, i), *g;
        if (fl_ckpt_get(gg, h->name, &g) != FL_OK) fail_msg("%s", fl_error_msg());
        assert_int_equal(g->dtype, h->dtype);
        assert_int_equal(g->ndim, h->ndim);
        for (int d = 0; d < h->ndim; d++) assert_int_equal(g->shape[d], h->shape[d]);
        assert_int_equal(g->nbytes, h->nbytes);
        assert_memory_equal(g->data, h->data, h->nbytes);
    }
    assert_int_equal(fl_ckpt_count(gg), fl_ckpt_count(hf));
}

/* Every HF tensor's GGUF counterpart has its shape and, decoded row by row,
 * its values to within 1/127 of the row's largest magnitude: a Q8_0 block
 * rounds to half a step of amax/127, F16 much closer; a misplaced row or a
 * wrong transpose is off by the values themselves. */
static void check_close(const fl_ckpt *gg, const fl_ckpt *hf) {
    for (size_t i = 0; i < fl_ckpt_count(hf); i++) {
        const fl_ckpt_tensor *h = fl_ckpt_at(hf, i), *g;
        if (fl_ckpt_get(gg, h->name, &g) != FL_OK) fail_msg("%s", fl_error_msg());
        assert_int_equal(h->dtype, FL_DTYPE_F32);
        assert_int_equal(g->ndim, h->ndim);
        for (int d = 0; d < h->ndim; d++) assert_int_equal(g->shape[d], h->shape[d]);
        const int64_t cols = h->shape[h->ndim - 1], rows = h->ndim == 1 ? 1 : h->shape[0];
        const fl_tensor t = {.dtype = g->dtype, .ndim = 2, .shape = {rows, cols}, .data = (void *)g->data};
        float *row = malloc(sizeof(float) * (size_t)cols);
        for (int64_t r = 0; r < rows; r++) {
            const float *want = (const float *)h->data + r * cols;
            fl_tensor_row_f32(&t, r, row);
            float amax = 0, err = 0;
            for (int64_t c = 0; c < cols; c++) {
                amax = fmaxf(amax, fabsf(want[c]));
                err = fmaxf(err, fabsf(row[c] - want[c]));
            }
            if (!(err <= amax / 127.0f))
                fail_msg("%s (%s) row %lld: error %g, row max %g", h->name, fl_dtype_name(g->dtype), (long long)r,
                         err, amax);
        }
        free(row);
    }
    assert_int_equal(fl_ckpt_count(gg), fl_ckpt_count(hf));
}

/* Prompt logits [T, V] of the checkpoint at `path` on the CPU backend. */
static float *logits(const char *path, const int32_t *prompt, int T, int V) {
    fl_ckpt *ck;
    if (fl_ckpt_open(path, &ck) != FL_OK) fail_msg("%s", fl_error_msg());
    fl_model_config cfg;
    assert_int_equal(fl_ckpt_model_config(ck, &cfg), FL_OK);
    assert_int_equal(fl_ckpt_validate(ck, &cfg, NULL), FL_OK);
    fl_backend *be;
    fl_model *m;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    fl_model_load_opts lo = {.quant = FL_LOAD_AS_STORED};
    if (fl_model_load(ck, be, &lo, &m) != FL_OK) fail_msg("%s: %s", path, fl_error_msg());
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 16 << 20;
    ec.max_model_len = T + 1;
    fl_engine *e;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_OK);
    float *got = malloc(sizeof(float) * (size_t)T * V);
    assert_int_equal(fl_engine_prompt_logits(e, prompt, T, got), FL_OK);
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
    return got;
}

/* Worst over positions of max |got - ref| / max |ref| (one row each);
 * *over counts the positions whose error exceeds tol. */
static double worst_rel(const float *got, const double *ref64, const float *ref32, int T, int V, double tol,
                        int *over) {
    double worst = 0;
    *over = 0;
    for (int t = 0; t < T; t++) {
        double num = 0, den = 0;
        for (int v = 0; v < V; v++) {
            double r = ref64 ? ref64[t * V + v] : ref32[t * V + v];
            assert_true(isfinite(got[t * V + v]));
            num = fmax(num, fabs(got[t * V + v] - r));
            den = fmax(den, fabs(r));
        }
        worst = fmax(worst, num / den);
        *over += num / den > tol;
    }
    return worst;
}

static void open_pair(const char *gguf, const char *dir, fl_ckpt **gg, fl_ckpt **hf, fl_model_config *gc,
                      fl_model_config *hc) {
    if (fl_ckpt_open(gguf, gg) != FL_OK) fail_msg("%s", fl_error_msg());
    if (fl_ckpt_open(dir, hf) != FL_OK) fail_msg("%s", fl_error_msg());
    assert_int_equal(fl_ckpt_model_config(*gg, gc), FL_OK);
    assert_int_equal(fl_ckpt_model_config(*hf, hc), FL_OK);
}

static void test_v2_f32(void **s) {
    (void)s;
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, "deepseek_v2", NULL, 0, &fx);
    fl_ckpt *gg, *hf;
    fl_model_config gc, hc;
    open_pair(DSDIR "deepseek_v2.gguf", fx.dir, &gg, &hf, &gc, &hc);
    check_config(&gc, &hc);
    assert_int_equal(gc.topk_method, FL_TOPK_GROUP_LIMITED); /* from expert_group_count / _used_count */
    check_tensors(gg, hf);
    fl_ckpt_free(hf);
    fl_ckpt_free(gg);

    float *got = logits(DSDIR "deepseek_v2.gguf", fx.prompt, fx.T, fx.V);
    int over;
    double w = worst_rel(got, fx.ref, NULL, fx.T, fx.V, 1e-4, &over);
    printf("  deepseek_v2 F32 GGUF max rel err %.2e over %d positions\n", w, fx.T);
    if (!(w <= 1e-4)) fail_msg("max relative logit error %.3e > 1e-4", w);
    free(got);
    fl_test_golden_free(&fx);
}

static void test_v2_q8_0(void **s) {
    (void)s;
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, "deepseek_v2", NULL, 0, &fx);
    fl_ckpt *gg, *hf;
    fl_model_config gc, hc;
    open_pair(DSDIR "deepseek_v2.q8_0.gguf", fx.dir, &gg, &hf, &gc, &hc);
    check_config(&gc, &hc);
    check_close(gg, hf);
    const fl_ckpt_tensor *g;
    assert_int_equal(fl_ckpt_get(gg, "model.layers.1.self_attn.kv_b_proj.weight", &g), FL_OK);
    assert_int_equal(g->dtype, FL_DTYPE_F32); /* F16 k_b + Q8_0 v_b */
    assert_int_equal(fl_ckpt_get(gg, "model.layers.1.mlp.experts.3.up_proj.weight", &g), FL_OK);
    assert_int_equal(g->dtype, FL_DTYPE_Q8_0);
    fl_ckpt_free(hf);
    fl_ckpt_free(gg);

    float *got = logits(DSDIR "deepseek_v2.q8_0.gguf", fx.prompt, fx.T, fx.V);
    int over;
    double w = worst_rel(got, fx.ref, NULL, fx.T, fx.V, 4e-2, &over);
    printf("  deepseek_v2 Q8_0 GGUF max rel err %.2e over %d positions, %d above 4e-2\n", w, fx.T, over);
    if (!(w <= 0.3) || over > 1) fail_msg("max relative logit error %.3e, %d positions above 4e-2", w, over);
    free(got);
    fl_test_golden_free(&fx);
}

static void test_v2_kv_b_q8_0(void **s) {
    (void)s;
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, "deepseek_v2", NULL, 0, &fx);
    fl_ckpt *gg, *hf;
    fl_model_config gc, hc;
    open_pair(DSDIR "deepseek_v2.kv_b.q8_0.gguf", fx.dir, &gg, &hf, &gc, &hc);
    check_config(&gc, &hc);
    check_close(gg, hf);
    const fl_ckpt_tensor *g;
    assert_int_equal(fl_ckpt_get(gg, "model.layers.2.self_attn.kv_b_proj.weight", &g), FL_OK);
    assert_int_equal(g->dtype, FL_DTYPE_Q8_0); /* as stored: nothing joined */
    fl_ckpt_free(hf);
    fl_ckpt_free(gg);

    float *got = logits(DSDIR "deepseek_v2.kv_b.q8_0.gguf", fx.prompt, fx.T, fx.V);
    int over;
    double w = worst_rel(got, fx.ref, NULL, fx.T, fx.V, 4e-2, &over);
    printf("  deepseek_v2 Q8_0 (attn_kv_b) GGUF max rel err %.2e over %d positions, %d above 4e-2\n", w, fx.T,
           over);
    if (!(w <= 0.3) || over > 1) fail_msg("max relative logit error %.3e, %d positions above 4e-2", w, over);
    free(got);
    fl_test_golden_free(&fx);
}

/* A copy of the lite fixture whose rope_scaling.mscale is its mscale_all_dim,
 * which is all a GGUF file can say; model.safetensors is linked. */
static void lite_reference_dir(char *dir, size_t n) {
    snprintf(dir, n, "/tmp/fl_gguf_ds_XXXXXX");
    assert_non_null(mkdtemp(dir));
    char *text = fl_test_slurp(GOLDEN "deepseek_v2_lite/config.json", NULL);
    cJSON *j = cJSON_Parse(text);
    assert_non_null(j);
    cJSON *rs = cJSON_GetObjectItem(j, "rope_scaling");
    double all = cJSON_GetObjectItem(rs, "mscale_all_dim")->valuedouble;
    cJSON_SetNumberValue(cJSON_GetObjectItem(rs, "mscale"), all);
    char *out = cJSON_Print(j);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(out, f);
    fclose(f);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    char *real = realpath(GOLDEN "deepseek_v2_lite/model.safetensors", NULL);
    assert_non_null(real);
    assert_int_equal(symlink(real, path), 0);
    free(real);
    free(out);
    cJSON_Delete(j);
    free(text);
}

static void remove_dir(const char *dir) {
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

static void test_lite_f16(void **s) {
    (void)s;
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, "deepseek_v2_lite", NULL, 1, &fx);
    char dir[64];
    lite_reference_dir(dir, sizeof dir);
    fl_ckpt *gg, *hf;
    fl_model_config gc, hc;
    open_pair(DSDIR "deepseek_v2_lite.f16.gguf", dir, &gg, &hf, &gc, &hc);
    check_config(&gc, &hc);
    assert_int_equal(gc.mla.q_lora_rank, 0);
    assert_int_equal(gc.rope.kind, FL_ROPE_YARN);
    assert_int_equal(gc.rope.original_max_pos, hc.rope.original_max_pos);
    check_close(gg, hf);
    const fl_ckpt_tensor *g;
    assert_int_equal(fl_ckpt_get(gg, "model.layers.0.self_attn.q_proj.weight", &g), FL_OK);
    assert_int_equal(g->dtype, FL_DTYPE_F16);
    assert_int_equal(fl_ckpt_get(gg, "model.layers.0.self_attn.kv_b_proj.weight", &g), FL_OK);
    assert_int_equal(g->dtype, FL_DTYPE_F16); /* both halves F16: joined as stored */
    fl_ckpt_free(hf);
    fl_ckpt_free(gg);

    float *ref = logits(dir, fx.prompt, fx.T, fx.V);
    float *got = logits(DSDIR "deepseek_v2_lite.f16.gguf", fx.prompt, fx.T, fx.V);
    int over;
    double w = worst_rel(got, NULL, ref, fx.T, fx.V, 5e-3, &over);
    printf("  deepseek_v2_lite F16 GGUF max rel err %.2e over %d positions, %d above 5e-3\n", w, fx.T, over);
    if (!(w <= 0.3) || over > 1) fail_msg("max relative logit error %.3e, %d positions above 5e-3", w, over);
    free(got);
    free(ref);
    remove_dir(dir);
    fl_test_golden_free(&fx);
}

/* A GGUF key or tensor name in buf (a u64 length, then its bytes). */
static char *find_name(char *buf, size_t n, const char *name) {
    const size_t kl = strlen(name);
    for (size_t i = 8; i + kl + 8 <= n; i++) {
        uint64_t len;
        memcpy(&len, buf + i - 8, 8);
        if (len == kl && memcmp(buf + i, name, kl) == 0) return buf + i;
    }
    return NULL;
}

/* Broken copies of deepseek_v2.gguf are refused with the status and a
 * message naming the file and the key or tensor. */
static void test_bad_files(void **s) {
    (void)s;
    size_t n;
    char *orig = fl_test_slurp(DSDIR "deepseek_v2.gguf", &n);
    static const struct {
        const char *name, *rename; /* rename: same length; else the u32 value is set */
        uint32_t value;
        fl_status st;
        const char *needle;
    } cases[] = {
        {"deepseek2.attention.kv_lora_rank", "deepseek2.attention.kv_lora_rXnk", 0, FL_ERR_FORMAT,
         "lacks the required key 'deepseek2.attention.kv_lora_rank'"},
        {"deepseek2.rope.dimension_count", "deepseek2.rope.dimension_cXunt", 0, FL_ERR_FORMAT,
         "'deepseek2.rope.dimension_count'"},
        {"deepseek2.expert_feed_forward_length", "deepseek2.expert_feed_forward_lenXth", 0, FL_ERR_FORMAT,
         "'deepseek2.expert_feed_forward_length'"},
        {"deepseek2.expert_used_count", NULL, 99, FL_ERR_FORMAT, "'deepseek2.expert_used_count' = 99"},
        {"deepseek2.expert_gating_func", NULL, 2, FL_ERR_UNSUPPORTED, "'deepseek2.expert_gating_func' = 2"},
        {"deepseek2.expert_group_count", NULL, 3, FL_ERR_FORMAT, "expert_group_count 3"},
        /* without the _mla keys, key_length (kv_lora + rope) reads as nope + rope: the
         * split tensors then have the wrong shape */
        {"deepseek2.attention.key_length_mla", "deepseek2.attention.key_length_mXa", 0, FL_ERR_FORMAT,
         "'blk.0.attn_k_b.weight' has ne = [16, 32, 4], expected [32, 32, 4]"},
        {"blk.1.attn_v_b.weight", "blk.1.attn_v_X.weight", 0, FL_ERR_FORMAT, "lacks the tensor 'blk.1.attn_v_b.weight'"},
        {"blk.2.ffn_gate_inp.weight", "blk.2.ffn_gate_iXp.weight", 0, FL_ERR_FORMAT,
         "lacks the router 'blk.2.ffn_gate_inp.weight'"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char *buf = malloc(n);
        memcpy(buf, orig, n);
        char *at = find_name(buf, n, cases[c].name);
        assert_non_null(at);
        if (cases[c].rename) memcpy(at, cases[c].rename, strlen(cases[c].name));
        else memcpy(at + strlen(cases[c].name) + 4, &cases[c].value, 4); /* after the u32 value type */
        char path[] = "/tmp/fl_gguf_ds_XXXXXX.gguf";
        int fd = mkstemps(path, 5);
        assert_true(fd >= 0);
        FILE *f = fdopen(fd, "wb");
        assert_int_equal(fwrite(buf, 1, n, f), n);
        fclose(f);
        fl_ckpt *ck = NULL;
        fl_status st = fl_ckpt_open(path, &ck);
        if (st != cases[c].st) fail_msg("case %zu: status %s: %s", c, fl_status_str(st), fl_error_msg());
        assert_null(ck);
        if (!strstr(fl_error_msg(), cases[c].needle) || !strstr(fl_error_msg(), path))
            fail_msg("case %zu: message lacks '%s' or the path: %s", c, cases[c].needle, fl_error_msg());
        unlink(path);
        free(buf);
    }
    free(orig);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_v2_f32), cmocka_unit_test(test_v2_q8_0),
                                       cmocka_unit_test(test_v2_kv_b_q8_0),
                                       cmocka_unit_test(test_lite_f16), cmocka_unit_test(test_bad_files)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
