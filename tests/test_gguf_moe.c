/*
 * test_gguf_moe.c — qwen2moe / qwen3moe / Mixtral (llama with experts) GGUF files.
 *
 * tests/gguf/moe/<name>.gguf are the golden MoE fixtures
 * (tests/golden/qwen2_moe, qwen3_moe, mixtral) converted the way llama.cpp does
 * (tests/gguf/make_moe_fixtures.py: stacked 3-D expert tensors, 1-D shared
 * expert gate). The model config read from GGUF metadata must equal the one
 * read from config.json in every MoE field, the split expert views must hold
 * the same bytes as the HF per-expert tensors, and the CPU forward must
 * match transformers' float64 logits to 1e-4 relative, the bar of the HF
 * fixtures in test_golden.c.
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
#include <unistd.h>

#include <cmocka.h>

#include "tests/test_util.h"

#include "runtime/engine/engine.h"

#define GOLDEN FL_TEST_DATA "/golden/"

static void check_config(const fl_model_config *g, const fl_model_config *h) {
    assert_int_equal(g->arch, h->arch);
    assert_int_equal(g->n_layers, h->n_layers);
    assert_int_equal(g->head_dim, h->head_dim);
    assert_int_equal(g->n_kv_heads, h->n_kv_heads);
    assert_int_equal(g->n_experts, h->n_experts);
    assert_int_equal(g->n_experts_per_tok, h->n_experts_per_tok);
    assert_int_equal(g->moe_intermediate_size, h->moe_intermediate_size);
    assert_int_equal(g->shared_expert_intermediate_size, h->shared_expert_intermediate_size);
    assert_int_equal(g->norm_topk_prob, h->norm_topk_prob);
    assert_int_equal(g->attention_bias, h->attention_bias);
    assert_int_equal(g->qk_norm, h->qk_norm);
    assert_int_equal(g->tie_word_embeddings, h->tie_word_embeddings);
    /* llama.cpp permutes a llama-architecture file's q/k rows (Mixtral) */
    assert_int_equal(g->rope.interleaved, h->arch == FL_ARCH_MIXTRAL);
    for (int l = 0; l < h->n_layers; l++)
        assert_int_equal(fl_model_config_layer_is_moe(g, l), fl_model_config_layer_is_moe(h, l));
}

/* Every HF tensor has a GGUF counterpart of the same shape and bytes (but
 * Mixtral's q/k, whose rows llama.cpp permutes). */
static void check_tensors(const fl_ckpt *gg, const fl_ckpt *hf) {
    for (size_t i = 0; i < fl_ckpt_count(hf); i++) {
        const fl_ckpt_tensor *h = fl_ckpt_at(hf, i), *g;
        if (fl_ckpt_get(gg, h->name, &g) != FL_OK) fail_msg("%s", fl_error_msg());
        assert_int_equal(g->dtype, h->dtype);
        assert_int_equal(g->ndim, h->ndim);
        for (int d = 0; d < h->ndim; d++) assert_int_equal(g->shape[d], h->shape[d]);
        assert_int_equal(g->nbytes, h->nbytes);
        if (strstr(h->name, "q_proj") || strstr(h->name, "k_proj")) continue;
        assert_memory_equal(g->data, h->data, h->nbytes);
    }
    assert_int_equal(fl_ckpt_count(gg), fl_ckpt_count(hf));
}

static void run(const char *name) {
    fl_test_golden fx;
    fl_test_golden_load(GOLDEN, name, NULL, 0, &fx);
    char path[512];
    snprintf(path, sizeof path, FL_TEST_DATA "/gguf/moe/%s.gguf", name);
    fl_ckpt *ck, *hf;
    if (fl_ckpt_open(path, &ck) != FL_OK) fail_msg("%s: %s", name, fl_error_msg());
    assert_int_equal(fl_ckpt_open(fx.dir, &hf), FL_OK);
    fl_model_config gc, hc;
    assert_int_equal(fl_ckpt_model_config(ck, &gc), FL_OK);
    assert_int_equal(fl_ckpt_model_config(hf, &hc), FL_OK);
    check_config(&gc, &hc);
    check_tensors(ck, hf);
    assert_int_equal(fl_ckpt_validate(ck, &gc, NULL), FL_OK);

    fl_backend *be;
    fl_model *m;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    fl_model_load_opts lo = {.quant = FL_LOAD_AS_STORED};
    if (fl_model_load(ck, be, &lo, &m) != FL_OK) fail_msg("%s: %s", name, fl_error_msg());
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 16 << 20;
    ec.max_model_len = fx.T + 1;
    fl_engine *e;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_OK);
    const int T = fx.T, V = fx.V;
    float *got = malloc(sizeof(float) * (size_t)T * V);
    assert_int_equal(fl_engine_prompt_logits(e, fx.prompt, T, got), FL_OK);
    double worst = 0;
    for (int t = 0; t < T; t++) {
        double num = 0, den = 0;
        for (int v = 0; v < V; v++) {
            num = fmax(num, fabs(got[t * V + v] - fx.ref[t * V + v]));
            den = fmax(den, fabs(fx.ref[t * V + v]));
        }
        worst = fmax(worst, num / den);
    }
    printf("  %-10s GGUF max rel err %.2e over %d positions\n", name, worst, T);
    if (!(worst <= 1e-4)) fail_msg("%s: max relative logit error %.3e > 1e-4", name, worst);
    free(got);
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(hf);
    fl_ckpt_free(ck);
    fl_test_golden_free(&fx);
}

static void test_qwen2_moe(void **s) { (void)s; run("qwen2_moe"); }
static void test_qwen3_moe(void **s) { (void)s; run("qwen3_moe"); }
static void test_mixtral(void **s) { (void)s; run("mixtral"); }

/* Metadata that contradicts itself is refused naming the key: more experts
 * per token than experts, and a missing expert count. */
static void test_bad_metadata(void **s) {
    (void)s;
    size_t n;
    char *orig = fl_test_slurp(FL_TEST_DATA "/gguf/moe/qwen2_moe.gguf", &n);
    static const struct { const char *key, *rename; uint32_t value; const char *needle; } cases[] = {
        {"qwen2moe.expert_used_count", NULL, 99, "qwen2moe.expert_used_count"},
        {"qwen2moe.expert_count", "qwen2moe.expert_cXunt", 0, "qwen2moe.expert_count"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char *buf = malloc(n);
        memcpy(buf, orig, n);
        const size_t kl = strlen(cases[c].key);
        char *at = NULL;
        for (size_t i = 8; i + kl + 8 <= n && !at; i++) { /* a key: u64 length, then its bytes */
            uint64_t len;
            memcpy(&len, buf + i - 8, 8);
            if (len == kl && memcmp(buf + i, cases[c].key, kl) == 0) at = buf + i;
        }
        assert_non_null(at);
        if (cases[c].rename) memcpy(at, cases[c].rename, kl);
        else memcpy(at + kl + 4, &cases[c].value, 4); /* after the u32 value type */
        char path[] = "/tmp/fl_gguf_moe_XXXXXX.gguf";
        int fd = mkstemps(path, 5);
        assert_true(fd >= 0);
        FILE *f = fdopen(fd, "wb");
        assert_int_equal(fwrite(buf, 1, n, f), n);
        fclose(f);
        fl_ckpt *ck = NULL;
        fl_status st = fl_ckpt_open(path, &ck);
        if (st != FL_ERR_FORMAT) fail_msg("case %zu: status %s: %s", c, fl_status_str(st), fl_error_msg());
        assert_null(ck);
        if (!strstr(fl_error_msg(), cases[c].needle))
            fail_msg("message lacks '%s': %s", cases[c].needle, fl_error_msg());
        unlink(path);
        free(buf);
    }
    free(orig);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_qwen2_moe), cmocka_unit_test(test_qwen3_moe),
                                       cmocka_unit_test(test_mixtral), cmocka_unit_test(test_bad_metadata)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
