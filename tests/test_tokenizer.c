/*
 * test_tokenizer.c — the tokenizer against Hugging Face `tokenizers`.
 *
 * Fixtures (tests/tokenizer/, written by scripts/make_tok_fixtures.py):
 * small tokenizers configured like Llama-3, Qwen2, GPT-2 (add_prefix_space),
 * Llama-2 and Mistral, two more using the remaining supported components
 * (misc_bl: NFKC, Lowercase, every Split behavior, invert, Digits; misc_spm:
 * Metaspace split, unk without byte fallback, NFD, Strip, regex Replace), the real SmolLM2 vocabulary from its GGUF, a corpus of
 * awkward strings, and per tokenizer the ids HF produced with special tokens
 * parsed and with split_special_tokens (our parse_special=false), plus HF's
 * decode of those ids with and without skip_special_tokens. Every case must
 * match exactly; a summary table is printed. A second corpus
 * (added_corpus.json) writes added/special tokens into the text at the
 * start, middle and end, adjacent, with whitespace around them, inside words
 * and next to combining marks, for every tokenizer above and for three
 * `flags_*` tokenizers that carry one added token per lstrip / rstrip /
 * single_word / normalized / special combination.
 *
 * Malformed input: missing file, bad JSON, unsupported components, merges
 * naming unknown tokens, bad GGUF vocabularies, invalid UTF-8, invalid ids.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <utf8proc.h>

#include "runtime/tok/tokenizer.h"

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)sz + 1);
    if (buf && fread(buf, 1, (size_t)sz, f) != (size_t)sz) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[sz] = 0;
    if (n) *n = (size_t)sz;
    return buf;
}

static cJSON *load_json(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/%s", FL_TEST_DATA, name);
    char *s = slurp(path, NULL);
    if (!s) fprintf(stderr, "missing fixture %s\n", path);
    assert_non_null(s);
    cJSON *j = cJSON_Parse(s);
    free(s);
    assert_non_null(j);
    return j;
}

static bool ids_equal(const cJSON *want, const int32_t *got, size_t n) {
    if ((size_t)cJSON_GetArraySize(want) != n) return false;
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, want) {
        if ((int32_t)e->valuedouble != got[i++]) return false;
    }
    return true;
}

static int32_t *ids_of(const cJSON *arr, size_t *n) {
    *n = (size_t)cJSON_GetArraySize(arr);
    int32_t *v = malloc((*n + 1) * sizeof *v);
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) v[i++] = (int32_t)e->valuedouble;
    return v;
}

static void print_ids(const char *what, const int32_t *v, size_t n) {
    fprintf(stderr, "    %s:", what);
    for (size_t i = 0; i < n && i < 40; i++) fprintf(stderr, " %d", v[i]);
    fprintf(stderr, n > 40 ? " ...\n" : "\n");
}

typedef struct counts {
    int n, ids, plain, dec, dec_skip, dec_plain, roundtrip, roundtrip_hf;
} counts;

/* Compares tok against <name><suffix> for the texts in corpus_file; prints
 * one table row. */
static counts check_against(const fl_tokenizer *tok, const char *name, const char *corpus_file,
                            const char *suffix, const char *label) {
    cJSON *corpus = load_json(corpus_file);
    char refname[128];
    snprintf(refname, sizeof refname, "%s%s", name, suffix);
    cJSON *ref = load_json(refname);
    const cJSON *cases = cJSON_GetObjectItem(ref, "cases");
    assert_int_equal(cJSON_GetArraySize(cases), cJSON_GetArraySize(corpus));
    assert_int_equal(fl_tokenizer_n_vocab(tok), cJSON_GetObjectItem(ref, "n_vocab")->valueint);
    assert_int_equal(fl_tokenizer_add_bos(tok), cJSON_IsTrue(cJSON_GetObjectItem(ref, "add_bos")));
    counts c = {0};
    for (int i = 0; i < cJSON_GetArraySize(corpus); i++) {
        const char *text = cJSON_GetArrayItem(corpus, i)->valuestring;
        const cJSON *cs = cJSON_GetArrayItem(cases, i);
        size_t len = strlen(text);
        c.n++;
        for (int ps = 1; ps >= 0; ps--) {
            int32_t *ids = NULL;
            size_t n = 0;
            fl_status st = fl_tokenizer_encode(tok, text, len, ps, &ids, &n);
            if (st != FL_OK) fprintf(stderr, "encode error: %s\n", fl_error_msg());
            assert_int_equal(st, FL_OK);
            const cJSON *want = cJSON_GetObjectItem(cs, ps ? "ids" : "ids_plain");
            if (ids_equal(want, ids, n)) {
                if (ps) c.ids++;
                else c.plain++;
            } else {
                size_t wn;
                int32_t *w = ids_of(want, &wn);
                fprintf(stderr, "  [%s] case %d parse_special=%d MISMATCH for \"%.60s\"\n", name, i, ps, text);
                print_ids("want", w, wn);
                print_ids("got ", ids, n);
                free(w);
            }
            free(ids);
        }
        struct { const char *ids_key, *dec_key; bool skip; int *counter; } dcs[] = {
            {"ids", "decode", false, &c.dec},
            {"ids", "decode_skip", true, &c.dec_skip},
            {"ids_plain", "decode_plain", false, &c.dec_plain},
        };
        for (int d = 0; d < 3; d++) {
            size_t n;
            int32_t *ids = ids_of(cJSON_GetObjectItem(cs, dcs[d].ids_key), &n);
            char *out = NULL;
            assert_int_equal(fl_tokenizer_decode(tok, ids, n, dcs[d].skip, &out), FL_OK);
            const char *want = cJSON_GetObjectItem(cs, dcs[d].dec_key)->valuestring;
            if (strcmp(out, want) == 0) {
                (*dcs[d].counter)++;
            } else {
                fprintf(stderr, "  [%s] case %d %s MISMATCH\n    want \"%.80s\"\n    got  \"%.80s\"\n", name, i,
                        dcs[d].dec_key, want, out);
            }
            if (d == 0 && strcmp(want, text) == 0) {
                c.roundtrip_hf++;
                if (strcmp(out, text) == 0) c.roundtrip++;
            }
            free(out);
            free(ids);
        }
    }
    fprintf(stderr,
            "| %-24s | ids %2d/%d | ids(parse_special=0) %2d/%d | decode %2d/%d | decode(skip) %2d/%d | "
            "decode(plain) %2d/%d | round-trip %2d/%d (HF round-trips %d) |\n",
            label, c.ids, c.n, c.plain, c.n, c.dec, c.n, c.dec_skip, c.n, c.dec_plain, c.n, c.roundtrip,
            c.roundtrip_hf, c.roundtrip_hf);
    cJSON_Delete(ref);
    cJSON_Delete(corpus);
    return c;
}

static counts check_against_ref(const fl_tokenizer *tok, const char *name, const char *label) {
    return check_against(tok, name, "corpus.json", ".ref.json", label);
}

/* The added-token corpus (special tokens at the start, middle, end, adjacent,
 * with whitespace around them, inside words, next to combining marks). */
static counts check_added(const fl_tokenizer *tok, const char *name, const char *label) {
    char l[96];
    snprintf(l, sizeof l, "%s +added", label);
    return check_against(tok, name, "added_corpus.json", ".added.ref.json", l);
}

static void assert_all(counts c) {
    assert_int_equal(c.ids, c.n);
    assert_int_equal(c.plain, c.n);
    assert_int_equal(c.dec, c.n);
    assert_int_equal(c.dec_skip, c.n);
    assert_int_equal(c.dec_plain, c.n);
    assert_int_equal(c.roundtrip, c.roundtrip_hf);
}

static fl_tokenizer *load_fixture(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/%s.tokenizer.json", FL_TEST_DATA, name);
    fl_tokenizer *tok = NULL;
    fl_status st = fl_tokenizer_load_json(path, &tok);
    if (st != FL_OK) fprintf(stderr, "load %s: %s\n", path, fl_error_msg());
    assert_int_equal(st, FL_OK);
    return tok;
}

static void json_case(const char *name) {
    fl_tokenizer *tok = load_fixture(name);
    assert_all(check_against_ref(tok, name, name));
    assert_all(check_added(tok, name, name));
    fl_tokenizer_free(tok);
}

static void added_case(const char *name) {
    fl_tokenizer *tok = load_fixture(name);
    assert_all(check_added(tok, name, name));
    fl_tokenizer_free(tok);
}

static void test_llama3(void **s) { (void)s; json_case("llama3"); }
static void test_qwen2(void **s) { (void)s; json_case("qwen2"); }
static void test_gpt2(void **s) { (void)s; json_case("gpt2"); }
static void test_llama2(void **s) { (void)s; json_case("llama2"); }
static void test_mistral(void **s) { (void)s; json_case("mistral"); }
static void test_misc_bytelevel(void **s) { (void)s; json_case("misc_bl"); }
static void test_misc_spm(void **s) { (void)s; json_case("misc_spm"); }
/* One added token per lstrip / rstrip / single_word / normalized / special
 * combination, on bases without a normalizer, with NFC, and with Llama-2's
 * Prepend + Replace (normalized tokens are matched as "▁content"). */
static void test_flags_plain(void **s) { (void)s; added_case("flags_plain"); }
static void test_flags_nfc(void **s) { (void)s; added_case("flags_nfc"); }
static void test_flags_spm(void **s) { (void)s; added_case("flags_spm"); }

/* single_word: HF (Rust regex \w) decides what a word character is; the
 * fixture lists the code points it counts, asked of HF one by one. Checked
 * on both sides of "[SW]": every code point below U+3000 (most scripts and
 * marks), both sides of every range boundary, and every 97th code point
 * above; code points utf8proc's Unicode version leaves unassigned are
 * skipped (their properties are unknown here). */
static bool sw_matches(const fl_tokenizer *tok, int32_t sw, int32_t cp, int side) {
    char buf[16];
    size_t cl = (size_t)utf8proc_encode_char(cp, (utf8proc_uint8_t *)(side ? buf + 4 : buf));
    memcpy(side ? buf : buf + cl, "[SW]", 4);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(fl_tokenizer_encode(tok, buf, cl + 4, true, &ids, &n), FL_OK);
    bool matched = false;
    for (size_t i = 0; i < n; i++) matched |= ids[i] == sw;
    free(ids);
    return matched;
}

static void test_single_word_chars(void **st) {
    (void)st;
    fl_tokenizer *tok = load_fixture("flags_plain");
    cJSON *wc = load_json("word_chars.json");
    const cJSON *ranges = cJSON_GetObjectItem(wc, "ranges");
    int32_t sw = fl_tokenizer_token_id(tok, "[SW]");
    assert_true(sw >= 0);
    int nr = cJSON_GetArraySize(ranges), r = 0, bad = 0, checked = 0;
    int32_t *rg = malloc(2 * (size_t)nr * sizeof *rg + 1);
    assert_non_null(rg);
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < 2; k++) rg[2 * i + k] = cJSON_GetArrayItem(cJSON_GetArrayItem(ranges, i), k)->valueint;
    for (int32_t cp = 0; cp < 0x110000; cp++) {
        while (r < nr && rg[2 * r + 1] < cp) r++;
        int32_t lo = r < nr ? rg[2 * r] : 0x110000, hi = r < nr ? rg[2 * r + 1] : 0x110000;
        bool word = lo <= cp;
        bool edge = cp == lo - 1 || cp == lo || cp == hi || (r > 0 && cp == rg[2 * r - 1] + 1);
        if (!(cp < 0x3000 || edge || cp % 97 == 0)) continue;
        if ((cp >= 0xD800 && cp <= 0xDFFF) || utf8proc_category(cp) == UTF8PROC_CATEGORY_CN) continue;
        for (int side = 0; side < 2; side++) {
            checked++;
            if (sw_matches(tok, sw, cp, side) == word && bad++ < 10)
                fprintf(stderr, "  single_word: U+%04X %s a word character for HF\n", (unsigned)cp,
                        word ? "is" : "is not");
        }
    }
    fprintf(stderr, "| single_word characters | %d/%d code point sides agree with HF |\n", checked - bad, checked);
    assert_true(checked > 20000);
    assert_int_equal(bad, 0);
    free(rg);
    cJSON_Delete(wc);
    fl_tokenizer_free(tok);
}

static void test_special_tokens_api(void **s) {
    (void)s;
    fl_tokenizer *tok = load_fixture("llama3");
    int32_t bot = fl_tokenizer_token_id(tok, "<|begin_of_text|>");
    assert_true(bot >= 0);
    assert_int_equal(fl_tokenizer_bos(tok), bot);
    assert_true(fl_tokenizer_add_bos(tok));
    assert_true(fl_tokenizer_is_special(tok, bot));
    assert_string_equal(fl_tokenizer_token_str(tok, bot), "<|begin_of_text|>");
    assert_int_equal(fl_tokenizer_eos(tok), fl_tokenizer_token_id(tok, "<|end_of_text|>"));
    assert_null(fl_tokenizer_token_str(tok, -1));
    assert_null(fl_tokenizer_token_str(tok, fl_tokenizer_n_vocab(tok)));
    assert_int_equal(fl_tokenizer_token_id(tok, "no such token at all"), -1);
    /* encode never adds BOS */
    int32_t *ids;
    size_t n;
    assert_int_equal(fl_tokenizer_encode(tok, "hi", 2, true, &ids, &n), FL_OK);
    assert_true(n > 0 && ids[0] != bot);
    free(ids);
    /* empty text: valid empty array */
    assert_int_equal(fl_tokenizer_encode(tok, "", 0, true, &ids, &n), FL_OK);
    assert_int_equal(n, 0);
    free(ids);
    /* byte-level decode reassembles UTF-8 split across tokens, and a lone
     * partial character decodes to U+FFFD like HF */
    const char *emoji = "\xf0\x9f\xa4\x96"; /* robot face */
    assert_int_equal(fl_tokenizer_encode(tok, emoji, 4, true, &ids, &n), FL_OK);
    assert_true(n >= 2);
    char *out;
    assert_int_equal(fl_tokenizer_decode(tok, ids, n, false, &out), FL_OK);
    assert_string_equal(out, emoji);
    free(out);
    assert_int_equal(fl_tokenizer_decode(tok, ids, 1, false, &out), FL_OK);
    assert_string_equal(out, "\xef\xbf\xbd");
    free(out);
    free(ids);
    /* skip_special drops the special token */
    int32_t two[2] = {bot, fl_tokenizer_token_id(tok, "hi") >= 0 ? fl_tokenizer_token_id(tok, "hi") : 0};
    char *a, *b;
    assert_int_equal(fl_tokenizer_decode(tok, two, 2, true, &a), FL_OK);
    assert_int_equal(fl_tokenizer_decode(tok, two + 1, 1, false, &b), FL_OK);
    assert_string_equal(a, b);
    free(a);
    free(b);
    fl_tokenizer_free(tok);
    fl_tokenizer_free(NULL);
}

/* ---- concurrency: a built tokenizer is shared read-only ------------------ */

typedef struct thr_arg {
    const fl_tokenizer *tok;
    const cJSON *corpus, *cases;
    int bad;
} thr_arg;

static void *thr_main(void *p) {
    thr_arg *a = p;
    for (int rep = 0; rep < 10; rep++) {
        for (int i = 0; i < cJSON_GetArraySize(a->corpus); i++) {
            const char *text = cJSON_GetArrayItem(a->corpus, i)->valuestring;
            int32_t *ids = NULL;
            size_t n = 0;
            if (fl_tokenizer_encode(a->tok, text, strlen(text), true, &ids, &n) != FL_OK ||
                !ids_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(a->cases, i), "ids"), ids, n))
                a->bad++;
            char *out = NULL;
            if (fl_tokenizer_decode(a->tok, ids, n, false, &out) != FL_OK) a->bad++;
            free(out);
            free(ids);
        }
    }
    return NULL;
}

static void test_concurrent(void **st) {
    (void)st;
    fl_tokenizer *tok = load_fixture("qwen2");
    cJSON *corpus = load_json("corpus.json"), *ref = load_json("qwen2.ref.json");
    thr_arg args[4];
    pthread_t th[4];
    for (int t = 0; t < 4; t++) {
        args[t] = (thr_arg){tok, corpus, cJSON_GetObjectItem(ref, "cases"), 0};
        assert_int_equal(pthread_create(&th[t], NULL, thr_main, &args[t]), 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(args[t].bad, 0);
    }
    cJSON_Delete(ref);
    cJSON_Delete(corpus);
    fl_tokenizer_free(tok);
}

/* ---- GGUF-style vocabularies ------------------------------------------- */

typedef struct spec_store {
    fl_tokenizer_spec spec;
    const char **tokens;
    int32_t *types;
    float *scores;
    const char **merges;
    cJSON *root;
} spec_store;

static void spec_free(spec_store *s) {
    free(s->tokens);
    free(s->types);
    free(s->scores);
    free(s->merges);
    cJSON_Delete(s->root);
}

static void spec_from_smollm2(spec_store *s) {
    memset(s, 0, sizeof *s);
    s->root = load_json("smollm2.vocab.json");
    const cJSON *toks = cJSON_GetObjectItem(s->root, "tokens"), *types = cJSON_GetObjectItem(s->root, "token_types");
    const cJSON *merges = cJSON_GetObjectItem(s->root, "merges");
    int n = cJSON_GetArraySize(toks), nm = cJSON_GetArraySize(merges);
    s->tokens = calloc((size_t)n, sizeof *s->tokens);
    s->types = calloc((size_t)n, sizeof *s->types);
    s->merges = calloc((size_t)nm, sizeof *s->merges);
    assert_int_equal(cJSON_GetArraySize(types), n);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, toks) s->tokens[i++] = e->valuestring; /* (GetArrayItem is O(i)) */
    i = 0;
    cJSON_ArrayForEach(e, types) s->types[i++] = e->valueint;
    i = 0;
    cJSON_ArrayForEach(e, merges) s->merges[i++] = e->valuestring;
    assert_string_equal(cJSON_GetObjectItem(s->root, "model")->valuestring, "gpt2");
    s->spec = (fl_tokenizer_spec){
        .kind = FL_TOK_BYTE_BPE,
        .pre = cJSON_GetObjectItem(s->root, "pre")->valuestring,
        .n_vocab = n, .tokens = s->tokens, .token_types = s->types,
        .n_merges = nm, .merges = s->merges,
        .bos_id = cJSON_GetObjectItem(s->root, "bos_id")->valueint,
        .eos_id = cJSON_GetObjectItem(s->root, "eos_id")->valueint,
        .unk_id = cJSON_GetObjectItem(s->root, "unk_id")->valueint,
        .pad_id = cJSON_GetObjectItem(s->root, "pad_id")->valueint,
        .add_bos = cJSON_IsTrue(cJSON_GetObjectItem(s->root, "add_bos")),
    };
}

static void test_smollm2_gguf_vocab(void **st) {
    (void)st;
    spec_store s;
    spec_from_smollm2(&s);
    assert_string_equal(s.spec.pre, "smollm");
    fl_tokenizer *tok = NULL;
    fl_status rc = fl_tokenizer_init_from_vocab(&s.spec, &tok);
    if (rc != FL_OK) fprintf(stderr, "%s\n", fl_error_msg());
    assert_int_equal(rc, FL_OK);
    assert_int_equal(fl_tokenizer_bos(tok), 1);
    assert_int_equal(fl_tokenizer_eos(tok), 2);
    assert_false(fl_tokenizer_add_bos(tok));
    assert_true(fl_tokenizer_is_special(tok, 2));
    assert_false(fl_tokenizer_is_special(tok, 100));
    assert_int_equal(fl_tokenizer_token_id(tok, "<|im_start|>"), 1);
    assert_all(check_against_ref(tok, "smollm2", "smollm2 (GGUF vocab)"));
    assert_all(check_added(tok, "smollm2", "smollm2 (GGUF vocab)"));
    fl_tokenizer_free(tok);
    spec_free(&s);
}

/* The same real SmolLM2 vocabulary through the tokenizer.json path: the test
 * writes the tokenizer.json transformers makes from the GGUF (with the real
 * SmolLM2 pre-tokenizer, Digits + ByteLevel), merges in the "a b" string
 * form, 17 special added tokens. */
static void test_smollm2_json(void **st) {
    (void)st;
    spec_store s;
    spec_from_smollm2(&s);
    cJSON *root = cJSON_CreateObject(), *added = cJSON_AddArrayToObject(root, "added_tokens");
    for (int i = 0; i < s.spec.n_vocab; i++) {
        if (s.types[i] != 3) continue;
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", i);
        cJSON_AddStringToObject(a, "content", s.tokens[i]);
        cJSON_AddBoolToObject(a, "special", 1);
        cJSON_AddBoolToObject(a, "normalized", 0);
        cJSON_AddItemToArray(added, a);
    }
    cJSON_AddNullToObject(root, "normalizer");
    cJSON *pre = cJSON_Parse("{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\",\"individual_digits\":true},"
                             "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":true}]}");
    cJSON_AddItemToObject(root, "pre_tokenizer", pre);
    cJSON_AddItemToObject(root, "post_processor", cJSON_Parse("{\"type\":\"ByteLevel\"}"));
    cJSON_AddItemToObject(root, "decoder", cJSON_Parse("{\"type\":\"ByteLevel\",\"add_prefix_space\":true}"));
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int i = 0; i < s.spec.n_vocab; i++) cJSON_AddNumberToObject(vocab, s.tokens[i], i);
    cJSON *merges = cJSON_AddArrayToObject(model, "merges");
    for (int i = 0; i < s.spec.n_merges; i++) cJSON_AddItemToArray(merges, cJSON_CreateString(s.merges[i]));
    char *text = cJSON_PrintUnformatted(root);
    char path[] = "/tmp/fl_tok_smollm2_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    free(text);
    cJSON_Delete(root);
    fl_tokenizer *tok = NULL;
    fl_status rc = fl_tokenizer_load_json(path, &tok);
    unlink(path);
    if (rc != FL_OK) fprintf(stderr, "%s\n", fl_error_msg());
    assert_int_equal(rc, FL_OK);
    assert_false(fl_tokenizer_add_bos(tok));
    assert_int_equal(fl_tokenizer_eos(tok), 0); /* "<|endoftext|>" by name: no tokenizer_config.json */
    assert_all(check_against_ref(tok, "smollm2", "smollm2 (tokenizer.json)"));
    assert_all(check_added(tok, "smollm2", "smollm2 (tokenizer.json)"));
    fl_tokenizer_free(tok);
    spec_free(&s);
}

/* A GGUF "llama" (SentencePiece) vocabulary derived from the llama2 fixture:
 * scores = -(rank of the merge that creates the piece), the way SentencePiece
 * BPE scores order merges; types: <unk> 2, <s> </s> 3, <0xNN> 6, else 1. */
static void spec_from_llama2(spec_store *s) {
    memset(s, 0, sizeof *s);
    s->root = load_json("llama2.tokenizer.json");
    const cJSON *model = cJSON_GetObjectItem(s->root, "model");
    const cJSON *vocab = cJSON_GetObjectItem(model, "vocab"), *merges = cJSON_GetObjectItem(model, "merges");
    int n = cJSON_GetArraySize(vocab);
    s->tokens = calloc((size_t)n, sizeof *s->tokens);
    s->types = calloc((size_t)n, sizeof *s->types);
    s->scores = calloc((size_t)n, sizeof *s->scores);
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        int id = e->valueint;
        assert_true(id >= 0 && id < n);
        s->tokens[id] = e->string;
        s->types[id] = id == 0 ? 2 : id <= 2 ? 3 : (strlen(e->string) == 6 && strncmp(e->string, "<0x", 3) == 0) ? 6 : 1;
        s->scores[id] = 0.0f;
    }
    /* merged piece score; the vocab lookup is a linear search only here in the test */
    int rank = 0;
    cJSON_ArrayForEach(e, merges) {
        const char *a = cJSON_GetArrayItem(e, 0)->valuestring, *b = cJSON_GetArrayItem(e, 1)->valuestring;
        char cat[512];
        snprintf(cat, sizeof cat, "%s%s", a, b);
        const cJSON *idv = cJSON_GetObjectItemCaseSensitive(vocab, cat);
        assert_non_null(idv);
        if (s->scores[idv->valueint] == 0.0f) s->scores[idv->valueint] = -(float)(rank + 1);
        rank++;
    }
    s->spec = (fl_tokenizer_spec){
        .kind = FL_TOK_SPM_BPE, .pre = "default", .n_vocab = n, .tokens = s->tokens, .scores = s->scores,
        .token_types = s->types, .n_merges = 0, .merges = NULL,
        .bos_id = 1, .eos_id = 2, .unk_id = 0, .pad_id = -1, .add_bos = true,
    };
}

static void test_spm_gguf_vocab(void **st) {
    (void)st;
    spec_store s;
    spec_from_llama2(&s);
    fl_tokenizer *tok = NULL;
    fl_status rc = fl_tokenizer_init_from_vocab(&s.spec, &tok);
    if (rc != FL_OK) fprintf(stderr, "%s\n", fl_error_msg());
    assert_int_equal(rc, FL_OK);
    assert_true(fl_tokenizer_add_bos(tok));
    assert_int_equal(fl_tokenizer_bos(tok), 1);
    assert_all(check_against_ref(tok, "llama2", "llama2 (GGUF SPM vocab)"));
    assert_all(check_added(tok, "llama2", "llama2 (GGUF SPM vocab)"));
    fl_tokenizer_free(tok);
    spec_free(&s);
}

static void test_gguf_bad_specs(void **st) {
    (void)st;
    spec_store s;
    spec_from_smollm2(&s);
    fl_tokenizer *tok = NULL;
    fl_tokenizer_spec bad = s.spec;
    bad.pre = "no-such-pre";
    assert_int_equal(fl_tokenizer_init_from_vocab(&bad, &tok), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "no-such-pre"));
    assert_null(tok);
    bad = s.spec;
    bad.n_merges = 0;
    bad.merges = NULL;
    assert_int_equal(fl_tokenizer_init_from_vocab(&bad, &tok), FL_ERR_FORMAT);
    bad = s.spec;
    const char *m0 = s.merges[0];
    s.merges[0] = "nosuchtoken1 nosuchtoken2";
    assert_int_equal(fl_tokenizer_init_from_vocab(&bad, &tok), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "merges[0]"));
    s.merges[0] = "nospace";
    assert_int_equal(fl_tokenizer_init_from_vocab(&bad, &tok), FL_ERR_FORMAT);
    s.merges[0] = m0;
    bad = s.spec;
    bad.bos_id = bad.n_vocab + 5;
    assert_int_equal(fl_tokenizer_init_from_vocab(&bad, &tok), FL_ERR_FORMAT);
    bad = s.spec;
    bad.n_vocab = 0;
    assert_int_equal(fl_tokenizer_init_from_vocab(&bad, &tok), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_tokenizer_init_from_vocab(NULL, &tok), FL_ERR_INVALID_ARG);
    /* "default" / "llama-bpe" / "qwen2" names are known */
    const char *known[] = {"default", "gpt2", "llama-bpe", "llama3", "qwen2", "starcoder", NULL};
    for (int i = 0; known[i]; i++) {
        bad = s.spec;
        bad.pre = known[i];
        assert_int_equal(fl_tokenizer_init_from_vocab(&bad, &tok), FL_OK);
        fl_tokenizer_free(tok);
        tok = NULL;
    }
    spec_free(&s);
}

/* ---- malformed input ---------------------------------------------------- */

static fl_status load_text(const char *json, fl_tokenizer **tok) {
    char path[] = "/tmp/fl_tok_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, json, strlen(json)), (ssize_t)strlen(json));
    close(fd);
    fl_status st = fl_tokenizer_load_json(path, tok);
    unlink(path);
    return st;
}

#define MINI_MODEL "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"ab\":2},\"merges\":[\"a b\"]}"

static void test_malformed(void **st) {
    (void)st;
    fl_tokenizer *tok = NULL;
    assert_int_equal(fl_tokenizer_load_json("/nonexistent/tokenizer.json", &tok), FL_ERR_IO);
    assert_non_null(strstr(fl_error_msg(), "/nonexistent/tokenizer.json"));
    assert_int_equal(load_text("{\"model\": {", &tok), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "fl_tok_test_"));
    assert_int_equal(load_text("[1,2,3]", &tok), FL_ERR_FORMAT);
    assert_int_equal(load_text("{}", &tok), FL_ERR_FORMAT);
    assert_int_equal(load_text("{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", &tok), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "WordPiece"));
    assert_int_equal(load_text("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a b\"]}}", &tok),
                     FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "merges[0]"));
    assert_int_equal(load_text("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[7]}}", &tok),
                     FL_ERR_FORMAT);
    assert_int_equal(load_text("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-3},\"merges\":[]}}", &tok), FL_ERR_FORMAT);
    assert_int_equal(load_text("{" MINI_MODEL ",\"normalizer\":{\"type\":\"BertNormalizer\"}}", &tok), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "BertNormalizer"));
    assert_int_equal(load_text("{" MINI_MODEL ",\"pre_tokenizer\":{\"type\":\"Whitespace\"}}", &tok), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "Whitespace"));
    assert_int_equal(load_text("{" MINI_MODEL ",\"decoder\":{\"type\":\"WordPiece\"}}", &tok), FL_ERR_UNSUPPORTED);
    assert_int_equal(load_text("{" MINI_MODEL ",\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},"
                               "\"behavior\":\"Isolated\"}}", &tok), FL_ERR_UNSUPPORTED);
    assert_int_equal(load_text("{" MINI_MODEL ",\"added_tokens\":[{\"id\":-1,\"content\":\"x\"}]}", &tok), FL_ERR_FORMAT);
    assert_int_equal(load_text("{" MINI_MODEL ",\"added_tokens\":[{\"id\":5,\"content\":\"\xff\"}]}", &tok), FL_ERR_FORMAT);
    assert_int_equal(load_text("{" MINI_MODEL ",\"normalizer\":{\"type\":\"Prepend\",\"prepend\":\"\xc3\"}}", &tok),
                     FL_ERR_FORMAT);
    assert_int_equal(load_text("{" MINI_MODEL ",\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"x\"},"
                               "\"behavior\":\"Sideways\"}}", &tok), FL_ERR_UNSUPPORTED);
    assert_int_equal(load_text("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":0},\"merges\":[]}}", &tok),
                     FL_ERR_FORMAT);
    assert_int_equal(load_text("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[],\"unk_token\":\"<unk>\"}}",
                               &tok), FL_ERR_FORMAT);
    assert_int_equal(load_text("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":99999999},\"merges\":[]}}", &tok),
                     FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "ids must be dense"));
    assert_null(tok);

    /* a minimal valid one: no decoder joins with spaces, like HF */
    assert_int_equal(load_text("{" MINI_MODEL "}", &tok), FL_OK);
    int32_t *ids;
    size_t n;
    assert_int_equal(fl_tokenizer_encode(tok, "abba", 4, true, &ids, &n), FL_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 1);
    assert_int_equal(ids[2], 0);
    char *out;
    assert_int_equal(fl_tokenizer_decode(tok, ids, n, false, &out), FL_OK);
    assert_string_equal(out, "ab b a");
    free(out);
    free(ids);
    /* invalid UTF-8 and invalid ids are errors, not crashes */
    assert_int_equal(fl_tokenizer_encode(tok, "a\xff", 2, true, &ids, &n), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_tokenizer_encode(tok, "\xed\xa0\x80", 3, true, &ids, &n), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_tokenizer_encode(tok, "\xe2\x82", 2, true, &ids, &n), FL_ERR_INVALID_ARG);
    int32_t badids[2] = {0, 99};
    assert_int_equal(fl_tokenizer_decode(tok, badids, 2, false, &out), FL_ERR_INVALID_ARG);
    badids[1] = -1;
    assert_int_equal(fl_tokenizer_decode(tok, badids, 2, false, &out), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_tokenizer_encode(NULL, "a", 1, true, &ids, &n), FL_ERR_INVALID_ARG);
    /* characters outside the vocabulary without unk are dropped, like HF */
    assert_int_equal(fl_tokenizer_encode(tok, "xa", 2, true, &ids, &n), FL_OK);
    assert_int_equal(n, 1);
    free(ids);
    fl_tokenizer_free(tok);
}

/* Steps that compound (each rewriting the last one's output longer) are
 * refused in bounded time rather than run for minutes: two ByteLevel
 * pre-tokenizers at load, a normalizer or decoder chain past TOK_MAX_GROWTH
 * times its input when it runs. One compounding step is not: 8x is fine. */
#define REPL(from, to) "{\"type\":\"Replace\",\"pattern\":{\"String\":\"" from "\"},\"content\":\"" to "\"}"
#define X8 REPL("a", "aaaaaaaa")
static void test_compounding_chains(void **st) {
    (void)st;
    fl_tokenizer *tok = NULL;
    const char *bl = "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}";
    char json[1024];
    snprintf(json, sizeof json, "{" MINI_MODEL ",\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[%s,%s]}}",
             bl, bl);
    assert_int_equal(load_text(json, &tok), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "more than one ByteLevel"));
    assert_null(tok);

    int32_t *ids;
    size_t n;
    char *out;
    assert_int_equal(load_text("{" MINI_MODEL ",\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[" X8 "]}}", &tok),
                     FL_OK);
    assert_int_equal(fl_tokenizer_encode(tok, "ab", 2, true, &ids, &n), FL_OK);
    assert_int_equal(n, 8); /* "aaaaaaaab": seven a, then ab */
    free(ids);
    fl_tokenizer_free(tok);
    assert_int_equal(load_text("{" MINI_MODEL ",\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":["
                               X8 "," X8 "," X8 "," X8 "," X8 "," X8 "," X8 "," X8 "]}}", &tok), FL_OK);
    assert_int_equal(fl_tokenizer_encode(tok, "ab", 2, true, &ids, &n), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "normalizer"));
    fl_tokenizer_free(tok);

    assert_int_equal(load_text("{" MINI_MODEL ",\"decoder\":{\"type\":\"Sequence\",\"decoders\":["
                               X8 "," X8 "," X8 "," X8 "," X8 "," X8 "," X8 "," X8 "]}}", &tok), FL_OK);
    int32_t a = 0, b = 1;
    assert_int_equal(fl_tokenizer_decode(tok, &b, 1, false, &out), FL_OK);
    assert_string_equal(out, "b");
    free(out);
    assert_int_equal(fl_tokenizer_decode(tok, &a, 1, false, &out), FL_ERR_UNSUPPORTED);
    assert_non_null(strstr(fl_error_msg(), "decoder"));
    assert_null(out);
    fl_tokenizer_free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_llama2),
        cmocka_unit_test(test_mistral),
        cmocka_unit_test(test_misc_bytelevel),
        cmocka_unit_test(test_misc_spm),
        cmocka_unit_test(test_flags_plain),
        cmocka_unit_test(test_flags_nfc),
        cmocka_unit_test(test_flags_spm),
        cmocka_unit_test(test_single_word_chars),
        cmocka_unit_test(test_special_tokens_api),
        cmocka_unit_test(test_concurrent),
        cmocka_unit_test(test_smollm2_gguf_vocab),
        cmocka_unit_test(test_smollm2_json),
        cmocka_unit_test(test_spm_gguf_vocab),
        cmocka_unit_test(test_gguf_bad_specs),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_compounding_chains),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
