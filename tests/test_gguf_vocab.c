/*
 * test_gguf_vocab.c — GGUF vocabularies of real model families against the
 * token ids Hugging Face `tokenizers` gave.
 *
 * llama.cpp ships models/ggml-vocab-<family>.gguf (a model's vocabulary, no
 * tensors) with .gguf.inp (test strings, each followed by
 * "\n__ggml_vocab_test__\n") and .gguf.out (per string one line of " <id>"
 * from HF's tokenizer.encode(text, add_special_tokens=False), which matches
 * special tokens written in the text: our parse_special=true).
 * scripts/llama-cpp-src.sh vocab fetches them from the pinned llama.cpp that
 * the llama-cpp-python sdist vendors into .deps/ggml-vocab-py0.3.9; without
 * them the test skips, or fails under FL_CI=1 (scripts/test.sh fetches them).
 *
 * Every ggml-vocab-*.gguf and .gguf.inp there must be listed in FAMILIES
 * below (so a new llama.cpp brings new families to light): each string of a
 * supported family must encode to HF's ids and, where the family
 * round-trips, decode back to itself; a refused family must fail with
 * FL_ERR_UNSUPPORTED and a message naming the file and what is not
 * supported. A family with test strings but no vocabulary borrows another
 * family's file with its own tokenizer.ggml.pre written in. A table of the
 * results is printed.
 */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "runtime/load/checkpoint_impl.h"
#include "runtime/load/gguf.h"
#include "runtime/tok/tokenizer.h"

#define VOCAB_DIR FL_TEST_DATA "/../.deps/ggml-vocab-py0.3.9"
#define SEP "\n__ggml_vocab_test__\n"

/* PASS: HF's ids; LOADS: builds (and round-trips its test strings, if any),
 * its ids unknown here; REFUSED: FL_ERR_UNSUPPORTED */
typedef enum { EXPECT_PASS, EXPECT_LOADS, EXPECT_REFUSED } expect;

typedef struct family {
    const char *name;  /* ggml-vocab-<name>.gguf */
    const char *borrow; /* no .gguf of its own: this family's file with tokenizer.ggml.pre = name */
    expect want;
    bool roundtrip;    /* decode(encode(s)) == s for every test string (else for ASCII ones) */
    const char *why;   /* refused or not round-tripping: the reason */
    const char *result; /* filled in by the test */
} family;

/* DeepSeek's vocabularies hold non-ASCII letters ("ü") as user-defined
 * added tokens in plain UTF-8; HF's ByteLevel decoder (and ours, which
 * follows it) reads their characters as the bytes they stand for, so text
 * with them does not come back; ASCII text must. (test_added_decode checks
 * the decodes against HF's.) */
#define NOT_ROUNDTRIP_DS "decode round-trips ASCII strings only (added tokens like \"ü\" decode as HF's ByteLevel does)"

static family FAMILIES[] = {
    {"aquila", NULL, EXPECT_LOADS, true, "no test strings", NULL},
    {"baichuan", NULL, EXPECT_LOADS, true, "no test strings", NULL},
    {"bert-bge", NULL, EXPECT_REFUSED, false, "WordPiece (tokenizer.ggml.model bert)", NULL},
    {"command-r", NULL, EXPECT_PASS, true, NULL, NULL},
    {"deepseek-coder", NULL, EXPECT_PASS, false, NOT_ROUNDTRIP_DS, NULL},
    {"deepseek-llm", NULL, EXPECT_PASS, false, NOT_ROUNDTRIP_DS, NULL},
    {"falcon", NULL, EXPECT_PASS, true, NULL, NULL},
    {"gpt-2", NULL, EXPECT_PASS, true, NULL, NULL},
    {"gpt-neox", NULL, EXPECT_LOADS, true, "no test strings", NULL},
    {"llama-bpe", NULL, EXPECT_PASS, true, NULL, NULL},
    {"llama-spm", NULL, EXPECT_PASS, true, NULL, NULL},
    {"mpt", NULL, EXPECT_PASS, true, NULL, NULL},
    {"phi-3", NULL, EXPECT_PASS, true, NULL, NULL},
    {"qwen2", NULL, EXPECT_PASS, true, NULL, NULL},
    {"refact", NULL, EXPECT_PASS, true, NULL, NULL},
    {"starcoder", NULL, EXPECT_PASS, true, NULL, NULL},
    /* HF gives the same ids for the Qwen2 and DeepSeek-R1-Distill-Qwen vocabularies */
    {"deepseek-r1-qwen", "qwen2", EXPECT_PASS, true, "qwen2's vocabulary, deepseek-r1-qwen's pre and ids", NULL},
    /* neither vocabulary nor ids here: its pipeline builds and round-trips
     * deepseek-llm's test strings on deepseek-llm's vocabulary */
    {"deepseek-v3", "deepseek-llm", EXPECT_LOADS, false, "no test strings of its own; " NOT_ROUNDTRIP_DS, NULL},
    /* test strings but no vocabulary here, and a pre-tokenizer we do not have */
    {"chameleon", "gpt-2", EXPECT_REFUSED, false, "pre-tokenizer not implemented", NULL},
    {"gpt-4o", "gpt-2", EXPECT_REFUSED, false, "pre-tokenizer not implemented", NULL},
    {"llama4", "gpt-2", EXPECT_REFUSED, false, "pre-tokenizer not implemented", NULL},
    {"pixtral", "gpt-2", EXPECT_REFUSED, false, "pre-tokenizer not implemented (llama.cpp maps it to llama3's)", NULL},
    /* test strings but no vocabulary: the pre-tokenizer is gpt2's */
    {"roberta-bpe", "gpt-2", EXPECT_LOADS, true, "gpt2's pipeline on gpt-2's vocabulary", NULL},
};
#define N_FAMILIES (sizeof FAMILIES / sizeof *FAMILIES)

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = sz >= 0 ? malloc((size_t)sz + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)sz, f) != (size_t)sz) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[sz] = 0;
    if (n) *n = buf ? (size_t)sz : 0;
    return buf;
}

static void quote(const char *s, size_t n, char *out, size_t cap) {
    size_t k = 0;
    for (size_t i = 0; i < n && k + 5 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') k += (size_t)snprintf(out + k, cap - k, "\\n");
        else if (c == '\t') k += (size_t)snprintf(out + k, cap - k, "\\t");
        else out[k++] = (char)c;
    }
    out[k < cap ? k : cap - 1] = 0;
}

/* Writes src to dst with tokenizer.ggml.pre set to pre (the file has no
 * tensor data to realign: vocabulary files carry metadata only). */
static void write_with_pre(const char *src, const char *pre, const char *dst) {
    size_t n;
    char *buf = slurp(src, &n);
    if (!buf) fail_msg("cannot read %s", src);
    static const char key[] = "\x12\0\0\0\0\0\0\0tokenizer.ggml.pre\x08\0\0\0";
    size_t kl = sizeof key - 1, at = 0;
    while (at + kl + 8 <= n && memcmp(buf + at, key, kl) != 0) at++;
    if (at + kl + 8 > n) fail_msg("%s has no string tokenizer.ggml.pre", src);
    uint64_t old;
    memcpy(&old, buf + at + kl, 8);
    size_t tail = at + kl + 8 + (size_t)old;
    assert_true(tail <= n);
    uint64_t len = strlen(pre);
    FILE *f = fopen(dst, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, at + kl, f), at + kl);
    assert_int_equal(fwrite(&len, 1, 8, f), 8);
    assert_int_equal(fwrite(pre, 1, len, f), len);
    assert_int_equal(fwrite(buf + tail, 1, n - tail, f), n - tail);
    assert_int_equal(fclose(f), 0);
    free(buf);
}

/* Encodes every .inp string and compares with its .out line; returns the
 * number of strings. */
static char g_why[N_FAMILIES][1024];

static int check_strings(family *fam, char *why, const fl_tokenizer *tok, const char *inp, const char *outp,
                         bool compare_ids) {
    size_t ni, no;
    char *in = slurp(inp, &ni), *out = slurp(outp, &no);
    if (!in || !out) fail_msg("%s: cannot read %s or %s", fam->name, inp, outp);
    size_t seplen = strlen(SEP);
    char *p = in, *o = out;
    int count = 0;
    while ((size_t)(p - in) < ni) {
        char *end = strstr(p, SEP);
        if (!end) fail_msg("%s: %s does not end with the separator", fam->name, inp);
        size_t len = (size_t)(end - p);
        char *eol = strchr(o, '\n');
        if (!eol) fail_msg("%s: %s has fewer lines than %s has strings", fam->name, outp, inp);
        *eol = 0;
        int32_t want[4096];
        size_t nw = 0;
        for (char *q = o; *q;) {
            char *nx;
            long v = strtol(q, &nx, 10);
            if (nx == q) fail_msg("%s: bad id in %s line %d: %s", fam->name, outp, count + 1, o);
            assert_true(nw < sizeof want / sizeof *want);
            want[nw++] = (int32_t)v;
            q = nx;
        }
        int32_t *ids = NULL;
        size_t n = 0;
        char shown[512];
        quote(p, len, shown, sizeof shown);
        if (fl_tokenizer_encode(tok, p, len, true, &ids, &n) != FL_OK)
            fail_msg("%s: encode \"%s\": %s", fam->name, shown, fl_error_msg());
        bool same = !compare_ids || n == nw;
        for (size_t k = 0; compare_ids && same && k < n; k++) same = ids[k] == want[k];
        if (!same) {
            char got[2048];
            size_t g = 0;
            for (size_t k = 0; k < n && g + 16 < sizeof got; k++)
                g += (size_t)snprintf(got + g, sizeof got - g, " %d", (int)ids[k]);
            got[g] = 0;
            snprintf(why, 1024, "string %d \"%.200s\"\n    want%.300s\n    got %.300s", count + 1, shown, o, got);
            free(ids);
            free(in);
            free(out);
            return -1;
        }
        bool ascii = true;
        for (size_t k = 0; k < len; k++) ascii = ascii && (unsigned char)p[k] < 0x80;
        if (fam->roundtrip || ascii) {
            char *text = NULL;
            if (fl_tokenizer_decode(tok, ids, n, false, &text) != FL_OK)
                fail_msg("%s: decode of string %d: %s", fam->name, count + 1, fl_error_msg());
            if (strlen(text) != len || memcmp(text, p, len) != 0) {
                char back[512];
                quote(text, strlen(text), back, sizeof back);
                snprintf(why, 1024, "string %d \"%.200s\" decodes to \"%.200s\"", count + 1, shown, back);
                free(text);
                free(ids);
                free(in);
                free(out);
                return -1;
            }
            free(text);
        }
        free(ids);
        count++;
        p = end + seplen;
        o = eol + 1;
    }
    if ((size_t)(o - out) != no) fail_msg("%s: %s has more lines than %s has strings", fam->name, outp, inp);
    free(in);
    free(out);
    return count;
}

static void check_family(family *fam) {
    char path[1024], inp[1100], outp[1100];
    snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", VOCAB_DIR, fam->name);
    snprintf(inp, sizeof inp, "%s.inp", path);
    snprintf(outp, sizeof outp, "%s.out", path);
    char tmp[] = "/tmp/test_gguf_vocab_XXXXXX";
    if (fam->borrow && access(inp, R_OK) != 0) {
        snprintf(inp, sizeof inp, "%s/ggml-vocab-%s.gguf.inp", VOCAB_DIR, fam->borrow);
        snprintf(outp, sizeof outp, "%s/ggml-vocab-%s.gguf.out", VOCAB_DIR, fam->borrow);
    }
    if (fam->borrow) {
        char src[1024];
        snprintf(src, sizeof src, "%s/ggml-vocab-%s.gguf", VOCAB_DIR, fam->borrow);
        int fd = mkstemp(tmp);
        assert_true(fd >= 0);
        close(fd);
        write_with_pre(src, fam->name, tmp);
        snprintf(path, sizeof path, "%s", tmp);
    }
    if (access(path, R_OK) != 0) fail_msg("%s: %s is missing", fam->name, path);
    fl_ckpt *ck = NULL;
    if (fl_gguf_open_vocab(path, &ck) != FL_OK) fail_msg("open %s: %s", path, fl_error_msg());
    fl_tokenizer *tok = NULL;
    fl_status st = fl_gguf_tokenizer(ck, &tok);
    if (fam->want == EXPECT_REFUSED) {
        if (st == FL_OK) fail_msg("%s: expected to be refused (%s), but it loads", fam->name, fam->why);
        assert_int_equal(st, FL_ERR_UNSUPPORTED);
        const char *msg = fl_error_msg();
        if (!strstr(msg, "not supported") || !strstr(msg, path) || (fam->borrow && !strstr(msg, fam->name)))
            fail_msg("%s: the refusal does not say what and where: %s", fam->name, msg);
        fam->result = "refused";
        fl_ckpt_free(ck);
        return;
    }
    if (st != FL_OK) fail_msg("%s: %s", fam->name, fl_error_msg());
    static char results[N_FAMILIES][64];
    family *row = fam;
    char *res = results[row - FAMILIES];
    if (access(inp, R_OK) == 0) {
        bool ids = fam->want == EXPECT_PASS;
        int n = check_strings(fam, g_why[row - FAMILIES], tok, inp, outp, ids);
        if (n < 0) snprintf(res, 64, "FAIL");
        else snprintf(res, 64, "%s (%d strings%s)", ids ? "pass" : "loads", n, fam->roundtrip ? ", round-trip" : "");
    } else {
        if (fam->want == EXPECT_PASS) fail_msg("%s: %s is missing", fam->name, inp);
        snprintf(res, 64, "loads");
    }
    fam->result = res;
    fl_tokenizer_free(tok);
    fl_ckpt_free(ck);
    if (fam->borrow) unlink(tmp);
}

static bool have_files(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/ggml-vocab-gpt-2.gguf", VOCAB_DIR);
    if (access(path, R_OK) == 0) return true;
    const char *ci = getenv("FL_CI");
    if (ci && !strcmp(ci, "1")) fail_msg("FL_CI=1 and the llama.cpp vocabularies are not in %s "
                                         "(scripts/llama-cpp-src.sh vocab)", VOCAB_DIR);
    print_message("SKIP: no llama.cpp vocabularies in %s (run scripts/llama-cpp-src.sh vocab)\n", VOCAB_DIR);
    return false;
}

/* Every file of the folder is a listed family, and every family has its file. */
static void test_all_listed(void **state) {
    (void)state;
    if (!have_files()) skip();
    DIR *d = opendir(VOCAB_DIR);
    assert_non_null(d);
    struct dirent *e;
    int seen = 0;
    while ((e = readdir(d))) {
        const char *n = e->d_name;
        size_t l = strlen(n);
        if (strncmp(n, "ggml-vocab-", 11) == 0 && l > 20 && strcmp(n + l - 9, ".gguf.inp") == 0) {
            /* test strings: of a listed family, with or without its vocabulary */
            bool any = false;
            for (size_t i = 0; i < N_FAMILIES; i++)
                any = any || (strlen(FAMILIES[i].name) == l - 20 && !strncmp(FAMILIES[i].name, n + 11, l - 20));
            if (!any) fail_msg("%s: family not listed in FAMILIES of test_gguf_vocab.c", n);
            continue;
        }
        if (strncmp(n, "ggml-vocab-", 11) != 0 || l < 16 || strcmp(n + l - 5, ".gguf") != 0) continue;
        bool listed = false;
        for (size_t i = 0; i < N_FAMILIES; i++)
            if (!FAMILIES[i].borrow && strlen(FAMILIES[i].name) == l - 16 && !strncmp(FAMILIES[i].name, n + 11, l - 16))
                listed = true;
        if (!listed) fail_msg("%s is not listed in FAMILIES of test_gguf_vocab.c", n);
        seen++;
    }
    closedir(d);
    int own = 0;
    for (size_t i = 0; i < N_FAMILIES; i++) own += !FAMILIES[i].borrow;
    assert_int_equal(seen, own);
}

static void test_families(void **state) {
    (void)state;
    if (!have_files()) skip();
    for (size_t i = 0; i < N_FAMILIES; i++) check_family(&FAMILIES[i]);
    int failed = 0;
    print_message("%-16s %s\n", "family", "result");
    for (size_t i = 0; i < N_FAMILIES; i++) {
        print_message("%-16s %s%s%s\n", FAMILIES[i].name, FAMILIES[i].result, FAMILIES[i].why ? " — " : "",
                      FAMILIES[i].why ? FAMILIES[i].why : "");
        if (g_why[i][0]) {
            print_message("    %s\n", g_why[i]);
            failed++;
        }
    }
    if (failed) fail_msg("%d families do not match Hugging Face's ids", failed);
}

/* The ids of DeepSeek's added tokens ("ü", "[PAD...]", "<｜fim▁hole｜>", bos /
 * eos), alone, inside words and next to special tokens, decode as HF
 * `tokenizers` decodes them (tests/tokenizer/gguf_decode.ref.json, made by
 * scripts/make_gguf_decode_ref.py on tokenizer.json files rebuilt from these
 * GGUFs): a token whose characters are all byte-level characters becomes
 * those bytes, so "ü" alone is byte FC and reads as U+FFFD; one with other
 * characters stays as written. (llama.cpp copies user-defined tokens
 * unchanged instead.) */
static void test_added_decode(void **state) {
    (void)state;
    if (!have_files()) skip();
    size_t n;
    char *text = slurp(FL_TEST_DATA "/tokenizer/gguf_decode.ref.json", &n);
    assert_non_null(text);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    const cJSON *fams = cJSON_GetObjectItemCaseSensitive(root, "families"), *fam;
    int checked = 0, replaced = 0;
    cJSON_ArrayForEach(fam, fams) {
        char path[1024];
        snprintf(path, sizeof path, "%s/ggml-vocab-%s.gguf", VOCAB_DIR, fam->string);
        fl_ckpt *ck = NULL;
        fl_tokenizer *tok = NULL;
        if (fl_gguf_open_vocab(path, &ck) != FL_OK || fl_gguf_tokenizer(ck, &tok) != FL_OK)
            fail_msg("%s: %s", path, fl_error_msg());
        const cJSON *c;
        cJSON_ArrayForEach(c, fam) {
            const cJSON *ids = cJSON_GetObjectItemCaseSensitive(c, "ids");
            const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, "text");
            const bool skip = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "skip_special"));
            assert_true(cJSON_IsArray(ids) && cJSON_IsString(want));
            int32_t v[64];
            size_t nv = 0;
            const cJSON *id;
            cJSON_ArrayForEach(id, ids) {
                assert_true(nv < 64);
                v[nv++] = (int32_t)id->valueint;
            }
            char *got = NULL;
            if (fl_tokenizer_decode(tok, v, nv, skip, &got) != FL_OK)
                fail_msg("%s: decode: %s", fam->string, fl_error_msg());
            if (strcmp(got, want->valuestring) != 0)
                fail_msg("%s: ids [%d ... %d] (%zu, skip_special %d) decode to \"%s\", HF: \"%s\"", fam->string,
                         (int)v[0], (int)v[nv - 1], nv, skip, got, want->valuestring);
            replaced += strstr(got, "\xef\xbf\xbd") != NULL;
            free(got);
            checked++;
        }
        fl_tokenizer_free(tok);
        fl_ckpt_free(ck);
    }
    cJSON_Delete(root);
    print_message("%d decodes of added-token ids equal HF's (%d with U+FFFD)\n", checked, replaced);
    assert_true(checked >= 100 && replaced > 0);
}

/* fl_gguf_open_vocab's bad input: no arguments, a missing file, not a GGUF. */
static void test_open_vocab_errors(void **state) {
    (void)state;
    fl_ckpt *ck = (fl_ckpt *)1;
    assert_int_equal(fl_gguf_open_vocab(NULL, &ck), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_gguf_open_vocab("x.gguf", NULL), FL_ERR_INVALID_ARG);
    const char *missing = "/nonexistent/ggml-vocab-none.gguf";
    assert_int_not_equal(fl_gguf_open_vocab(missing, &ck), FL_OK);
    assert_null(ck);
    assert_non_null(strstr(fl_error_msg(), missing));
    char tmp[] = "/tmp/test_gguf_vocab_XXXXXX";
    int fd = mkstemp(tmp);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "GGUF\3\0\0\0", 8), 8);
    close(fd);
    assert_int_equal(fl_gguf_open_vocab(tmp, &ck), FL_ERR_FORMAT);
    assert_null(ck);
    assert_non_null(strstr(fl_error_msg(), tmp));
    unlink(tmp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_vocab_errors),
        cmocka_unit_test(test_all_listed),
        cmocka_unit_test(test_families),
        cmocka_unit_test(test_added_decode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
