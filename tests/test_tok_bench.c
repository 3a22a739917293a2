/*
 * test_tok_bench.c — encode throughput on ~10 MB of text, and that nothing
 * is quadratic: the text (the test corpus repeated: many scripts, code,
 * whitespace runs, emoji) goes through each tokenizer in one call and must
 * decode back to itself (for tokenizers that round-trip: byte-level ones
 * without a prefix space). Prints MB/s per tokenizer.
 *
 * FL_TOK_BENCH_MB (default 10) sets the size; FL_TOK_BENCH_JSON=path adds
 * one more tokenizer.json (e.g. a real 150k-token vocabulary) to the table.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "runtime/tok/tokenizer.h"

static char *g_text;
static size_t g_len;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int setup(void **state) {
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/corpus.json", FL_TEST_DATA);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    cJSON *c = cJSON_Parse(buf);
    if (!c) return -1;
    const char *env = getenv("FL_TOK_BENCH_MB");
    size_t target = (size_t)((env ? atof(env) : 10.0) * 1e6);
    g_text = malloc(target + 4096);
    g_len = 0;
    unsigned r = 12345;
    int m = cJSON_GetArraySize(c);
    while (g_len < target) {
        r = r * 1103515245u + 12345u;
        const char *s = cJSON_GetArrayItem(c, (int)((r >> 16) % (unsigned)m))->valuestring;
        size_t l = strlen(s);
        if (l + 1 > 4096) continue;
        memcpy(g_text + g_len, s, l);
        g_len += l;
        g_text[g_len++] = '\n';
    }
    g_text[g_len] = 0;
    cJSON_Delete(c);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    free(g_text);
    return 0;
}

static void bench(fl_tokenizer *tok, const char *name, bool roundtrip) {
    int32_t *ids = NULL;
    size_t n = 0;
    double t0 = now();
    fl_status st = fl_tokenizer_encode(tok, g_text, g_len, false, &ids, &n);
    double t1 = now();
    if (st != FL_OK) fprintf(stderr, "%s\n", fl_error_msg());
    assert_int_equal(st, FL_OK);
    assert_true(n > g_len / 16);
    char *out = NULL;
    double t2 = now();
    assert_int_equal(fl_tokenizer_decode(tok, ids, n, false, &out), FL_OK);
    double t3 = now();
    if (roundtrip) {
        assert_int_equal(strlen(out), g_len);
        assert_memory_equal(out, g_text, g_len);
    }
    fprintf(stderr, "| %-8s | %.1f MB | %zu tokens | encode %.2f s = %.1f MB/s | decode %.1f MB/s |\n", name,
            (double)g_len / 1e6, n, t1 - t0, (double)g_len / 1e6 / (t1 - t0), (double)g_len / 1e6 / (t3 - t2));
    free(out);
    free(ids);
}

static fl_tokenizer *load(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/%s.tokenizer.json", FL_TEST_DATA, name);
    fl_tokenizer *tok = NULL;
    assert_int_equal(fl_tokenizer_load_json(path, &tok), FL_OK);
    return tok;
}

static void test_bench_json(void **state) {
    (void)state;
    const struct { const char *name; bool rt; } t[] = {
        {"llama3", true}, {"qwen2", false}, {"gpt2", false}, {"llama2", false}, {"mistral", false},
    };
    for (size_t i = 0; i < sizeof t / sizeof *t; i++) {
        fl_tokenizer *tok = load(t[i].name);
        bench(tok, t[i].name, t[i].rt);
        fl_tokenizer_free(tok);
    }
    const char *extra = getenv("FL_TOK_BENCH_JSON");
    if (extra && extra[0]) {
        fl_tokenizer *tok = NULL;
        double t0 = now();
        fl_status st = fl_tokenizer_load_json(extra, &tok);
        if (st != FL_OK) fprintf(stderr, "%s\n", fl_error_msg());
        assert_int_equal(st, FL_OK);
        fprintf(stderr, "%s: %d tokens, loaded in %.3f s\n", extra, fl_tokenizer_n_vocab(tok), now() - t0);
        bench(tok, "extra", false);
        fl_tokenizer_free(tok);
    }
}

static void test_bench_smollm2(void **state) {
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/smollm2.vocab.json", FL_TEST_DATA);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)sz + 1);
    assert_int_equal(fread(buf, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    buf[sz] = 0;
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    assert_non_null(j);
    const cJSON *toks = cJSON_GetObjectItem(j, "tokens"), *types = cJSON_GetObjectItem(j, "token_types");
    const cJSON *merges = cJSON_GetObjectItem(j, "merges");
    int n = cJSON_GetArraySize(toks), nm = cJSON_GetArraySize(merges);
    const char **tv = calloc((size_t)n, sizeof *tv);
    int32_t *ty = calloc((size_t)n, sizeof *ty);
    const char **mv = calloc((size_t)nm, sizeof *mv);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, toks) tv[i++] = e->valuestring;
    i = 0;
    cJSON_ArrayForEach(e, types) ty[i++] = e->valueint;
    i = 0;
    cJSON_ArrayForEach(e, merges) mv[i++] = e->valuestring;
    fl_tokenizer_spec spec = {.kind = FL_TOK_BYTE_BPE, .pre = "smollm", .n_vocab = n, .tokens = tv,
                              .token_types = ty, .n_merges = nm, .merges = mv,
                              .bos_id = 1, .eos_id = 2, .unk_id = 0, .pad_id = 2};
    fl_tokenizer *tok = NULL;
    double t0 = now();
    assert_int_equal(fl_tokenizer_init_from_vocab(&spec, &tok), FL_OK);
    fprintf(stderr, "smollm2 vocabulary (49152 tokens, 48900 merges) built in %.3f s\n", now() - t0);
    bench(tok, "smollm2", true);
    fl_tokenizer_free(tok);
    free(tv);
    free(ty);
    free(mv);
    cJSON_Delete(j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_smollm2),
        cmocka_unit_test(test_bench_json),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
