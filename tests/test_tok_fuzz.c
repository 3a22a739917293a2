/*
 * test_tok_fuzz.c — the tokenizer never crashes on hostile input: mutated
 * tokenizer.json files (byte flips, truncations, spliced JSON fragments),
 * random bytes to encode, random ids to decode. Every call must return a
 * status; loads that succeed must still encode and decode. Deterministic
 * (fixed seed) so a failure reproduces; run it under FL_SANITIZE=ON for the
 * memory checks. FL_TOK_FUZZ_ITERS (default 300) sets the iterations.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "runtime/tok/tokenizer.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    *n = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)sz + 1);
    if (fread(buf, 1, (size_t)sz, f) != (size_t)sz) sz = 0;
    fclose(f);
    buf[sz] = 0;
    *n = (size_t)sz;
    return buf;
}

static int iters(void) {
    const char *e = getenv("FL_TOK_FUZZ_ITERS");
    return e ? atoi(e) : 300;
}

/* Exercises a tokenizer that loaded: random text and ids. */
static void poke(const fl_tokenizer *tok) {
    char text[256];
    for (int k = 0; k < 8; k++) {
        size_t n = rnd() % sizeof text;
        for (size_t i = 0; i < n; i++) {
            uint32_t r = rnd() % 4;
            text[i] = r == 0 ? (char)(rnd() & 0xff) : r == 1 ? " \n\t<|>'s"[rnd() % 8] : (char)('a' + rnd() % 26);
        }
        int32_t *ids = NULL;
        size_t m = 0;
        fl_status st = fl_tokenizer_encode(tok, text, n, rnd() & 1, &ids, &m);
        assert_true(st == FL_OK || st == FL_ERR_INVALID_ARG);
        if (st == FL_OK) {
            char *out = NULL;
            assert_int_equal(fl_tokenizer_decode(tok, ids, m, rnd() & 1, &out), FL_OK);
            free(out);
        }
        free(ids);
    }
    int32_t rid[16];
    for (int i = 0; i < 16; i++) rid[i] = (int32_t)(rnd() % (uint32_t)(fl_tokenizer_n_vocab(tok) + 8)) - 4;
    char *out = NULL;
    fl_status st = fl_tokenizer_decode(tok, rid, 16, false, &out);
    assert_true(st == FL_OK || st == FL_ERR_INVALID_ARG);
    free(out);
}

static void fuzz_file(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/%s.tokenizer.json", FL_TEST_DATA, name);
    size_t n = 0;
    char *orig = slurp(path, &n);
    assert_non_null(orig);
    static const char *frags[] = {"null", "{}", "[]", "\"\"", "-1", "1e300", "{\"type\":\"Sequence\"}",
                                  "\"\\ud800\"", "\"<0x\"", "true", "\"Regex\"", "\"(\"", "{\"String\":\"\"}"};
    char tmp[] = "/tmp/fl_tok_fuzz_XXXXXX";
    int fd = mkstemp(tmp);
    assert_true(fd >= 0);
    close(fd);
    int loaded = 0, failed = 0;
    for (int it = 0; it < iters(); it++) {
        char *m = malloc(n + 64);
        memcpy(m, orig, n);
        size_t mn = n;
        int kind = (int)(rnd() % 3);
        if (kind == 0) {
            for (int k = 0; k < 1 + (int)(rnd() % 4); k++) m[rnd() % mn] = (char)(rnd() & 0xff);
        } else if (kind == 1) {
            mn = rnd() % mn;
        } else {
            /* replace a value after a random ':' with a fragment */
            size_t at = rnd() % mn;
            while (at < mn && m[at] != ':') at++;
            if (at < mn) {
                const char *f = frags[rnd() % (sizeof frags / sizeof *frags)];
                size_t fl = strlen(f), end = at + 1;
                while (end < mn && m[end] != ',' && m[end] != '}' && m[end] != ']') end++;
                if (end - at - 1 >= fl) {
                    memcpy(m + at + 1, f, fl);
                    memmove(m + at + 1 + fl, m + end, mn - end);
                    mn = at + 1 + fl + (mn - end);
                }
            }
        }
        FILE *f = fopen(tmp, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(m, 1, mn, f), mn);
        fclose(f);
        free(m);
        fl_tokenizer *tok = NULL;
        fl_status st = fl_tokenizer_load_json(tmp, &tok);
        if (st == FL_OK) {
            loaded++;
            poke(tok);
            fl_tokenizer_free(tok);
        } else {
            failed++;
            assert_null(tok);
            assert_true(st == FL_ERR_FORMAT || st == FL_ERR_UNSUPPORTED || st == FL_ERR_IO);
            assert_true(strlen(fl_error_msg()) > 0);
        }
    }
    unlink(tmp);
    fprintf(stderr, "%s: %d mutated files loaded, %d rejected with a status\n", name, loaded, failed);
    assert_true(failed > 0);
    free(orig);
}

static void test_fuzz_llama3(void **s) { (void)s; fuzz_file("llama3"); }
static void test_fuzz_llama2(void **s) { (void)s; fuzz_file("llama2"); }
static void test_fuzz_misc(void **s) { (void)s; fuzz_file("misc_bl"); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fuzz_llama3),
        cmocka_unit_test(test_fuzz_llama2),
        cmocka_unit_test(test_fuzz_misc),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
