/*
 * test_safetensors.c — the safetensors parser and Hugging Face folder
 * checkpoints: a real transformers-written model, sharded folders written
 * here, and one malformed-input case per validation rule (each asserts the
 * status and that the message names the file and tensor/key).
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "loader/fixture_util.h"
#include "runtime/load/checkpoint.h"
#include "runtime/load/checkpoint_impl.h"
#include "runtime/load/mapfile.h"
#include "runtime/load/safetensors.h"

#define TINY FL_TEST_DATA "/loader/tiny_llama"

/* ---- a real checkpoint --------------------------------------------------- */

static void test_tiny_llama_matches_reference(void **state) {
    (void)state;
    fl_ckpt *ck = NULL;
    ASSERT_STATUS(fl_ckpt_open(TINY, &ck), FL_OK);
    assert_string_equal(fl_ckpt_format(ck), "safetensors");
    assert_string_equal(fl_ckpt_path(ck), TINY);
    assert_int_equal(fl_ckpt_count(ck), 12);
    for (size_t i = 1; i < fl_ckpt_count(ck); i++)
        assert_true(strcmp(fl_ckpt_at(ck, i - 1)->name, fl_ckpt_at(ck, i)->name) < 0);
    assert_null(fl_ckpt_at(ck, 12));

    fl_model_config cfg;
    ASSERT_STATUS(fl_ckpt_model_config(ck, &cfg), FL_OK);
    assert_int_equal(cfg.arch, FL_ARCH_LLAMA);
    assert_int_equal(cfg.hidden_size, 32);
    assert_int_equal(cfg.n_kv_heads, 2);

    /* Every tensor equals the f32 reference written by the generator. */
    fl_mapfile ref;
    fl_ckpt_tensor *rts = NULL;
    size_t nref = 0;
    ASSERT_STATUS(fl_mapfile_open(FL_TEST_DATA "/loader/tiny_llama_ref.safetensors", &ref), FL_OK);
    ASSERT_STATUS(fl_safetensors_parse(ref.path, ref.data, ref.size, &rts, &nref), FL_OK);
    assert_int_equal(nref, 12);
    for (size_t i = 0; i < nref; i++) {
        const fl_ckpt_tensor *t;
        ASSERT_STATUS(fl_ckpt_get(ck, rts[i].name, &t), FL_OK);
        assert_int_equal(t->dtype, FL_DTYPE_BF16);
        assert_int_equal(rts[i].dtype, FL_DTYPE_F32);
        assert_int_equal(t->ndim, rts[i].ndim);
        for (int d = 0; d < t->ndim; d++) assert_int_equal(t->shape[d], rts[i].shape[d]);
        fl_tensor a, b;
        ASSERT_STATUS(fl_ckpt_load_tensor(ck, t->name, t->ndim, t->shape, &a), FL_OK);
        assert_int_equal(a.owned, 0);
        assert_ptr_equal(a.data, t->data);
        b = (fl_tensor){.dtype = FL_DTYPE_F32, .ndim = rts[i].ndim, .data = (void *)rts[i].data};
        memcpy(b.shape, rts[i].shape, sizeof b.shape);
        int64_t cols = t->shape[t->ndim - 1], rows = fl_tensor_numel(&a) / cols;
        float *ra = malloc(cols * sizeof(float)), *rb = malloc(cols * sizeof(float));
        for (int64_t r = 0; r < rows; r++) {
            fl_tensor_row_f32(&a, r, ra);
            fl_tensor_row_f32(&b, r, rb);
            assert_memory_equal(ra, rb, cols * sizeof(float));
        }
        free(ra);
        free(rb);
        fl_tensor_free(&a);
    }
    fl_safetensors_tensors_free(rts, nref);
    fl_mapfile_close(&ref);

    /* Linear weights alias the mapping as stored. */
    fl_tensor w;
    const fl_ckpt_tensor *t;
    ASSERT_STATUS(fl_ckpt_get(ck, "model.layers.0.self_attn.k_proj.weight", &t), FL_OK);
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "model.layers.0.self_attn.k_proj", 16, 32, FL_LOAD_AS_STORED, &w), FL_OK);
    assert_int_equal(w.dtype, FL_DTYPE_BF16);
    assert_int_equal(w.owned, 0);
    assert_ptr_equal(w.data, t->data);
    fl_tensor_free(&w);

    /* The list form of chat_template: "default" is taken. */
    assert_non_null(fl_ckpt_chat_template(ck));
    assert_string_equal(fl_ckpt_chat_template(ck),
                        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}");
    fl_ckpt_free(ck);
}

/* The same model as transformers shards it: same tensors, same bytes. */
static void test_transformers_sharded(void **state) {
    (void)state;
    fl_ckpt *one = NULL, *sh = NULL;
    ASSERT_STATUS(fl_ckpt_open(TINY, &one), FL_OK);
    ASSERT_STATUS(fl_ckpt_open(TINY "_sharded", &sh), FL_OK);
    assert_int_equal(fl_ckpt_count(sh), fl_ckpt_count(one));
    int seen[3] = {0};
    for (size_t i = 0; i < fl_ckpt_count(one); i++) {
        const fl_ckpt_tensor *a = fl_ckpt_at(one, i), *b = fl_ckpt_at(sh, i);
        assert_string_equal(a->name, b->name);
        assert_int_equal(a->dtype, b->dtype);
        assert_int_equal(a->nbytes, b->nbytes);
        assert_memory_equal(a->data, b->data, a->nbytes);
        for (int k = 0; k < 3; k++) {
            char shard[64];
            snprintf(shard, sizeof shard, "model-%05d-of-00003.safetensors", k + 1);
            if (strstr(b->file, shard)) seen[k]++;
        }
    }
    assert_true(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);
    assert_int_equal(seen[0] + seen[1] + seen[2], (int)fl_ckpt_count(sh));
    fl_ckpt_free(one);
    fl_ckpt_free(sh);
}

static void test_missing_tensor_and_wrong_shape(void **state) {
    (void)state;
    fl_ckpt *ck = NULL;
    fl_tensor w;
    ASSERT_STATUS(fl_ckpt_open(TINY, &ck), FL_OK);
    const fl_ckpt_tensor *t = (const fl_ckpt_tensor *)1;
    ASSERT_STATUS(fl_ckpt_get(ck, "model.layers.7.mlp.up_proj.weight", &t), FL_ERR_NOT_FOUND);
    assert_null(t);
    ASSERT_MSG_HAS("model.layers.7.mlp.up_proj.weight");
    ASSERT_MSG_HAS(TINY);
    assert_false(fl_ckpt_has(ck, "model.layers.7.mlp.up_proj.weight"));
    assert_true(fl_ckpt_has(ck, "model.norm.weight"));

    ASSERT_STATUS(fl_ckpt_load_linear(ck, "model.layers.0.mlp.down_proj", 64, 32, FL_LOAD_AS_STORED, &w),
                  FL_ERR_FORMAT);
    ASSERT_MSG_HAS("model.layers.0.mlp.down_proj.weight");
    ASSERT_MSG_HAS("[32, 64]"); /* stored */
    ASSERT_MSG_HAS("[64, 32]"); /* expected */
    ASSERT_MSG_HAS("model.safetensors");

    int64_t e1[1] = {33};
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "model.norm.weight", 1, e1, &w), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("model.norm.weight");
    ASSERT_MSG_HAS("[32]");
    ASSERT_MSG_HAS("[33]");
    int64_t e2[2] = {-1, 32};
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "model.norm.weight", 2, e2, &w), FL_ERR_FORMAT);
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "model.embed_tokens.weight", 2, e2, &w), FL_OK);
    assert_int_equal(w.shape[0], 64);
    fl_tensor_free(&w);
    fl_ckpt_free(ck);

    ASSERT_STATUS(fl_ckpt_open(FL_TEST_DATA "/loader/does_not_exist", &ck), FL_ERR_NOT_FOUND);
    ASSERT_MSG_HAS("does_not_exist");
    assert_null(ck);
    ASSERT_STATUS(fl_ckpt_open(FL_TEST_DATA "/loader/tiny_llama/config.json", &ck), FL_ERR_INVALID_ARG);
    ASSERT_MSG_HAS("config.json");
    fl_ckpt_free(NULL);
}

/* ---- parser unit tests on hand-written files ----------------------------- */

/* Parses a header + data written to a temp file; returns the status. */
static fl_status parse_one(const char *header, const void *data, size_t n, fl_ckpt_tensor **ts, size_t *nt,
                           char **dir_out) {
    char *dir = fx_mkdtemp();
    const char *p = fx_path(dir, "t.safetensors");
    fx_write_st(p, header, data, n);
    fl_mapfile m;
    fl_status st = fl_mapfile_open(p, &m);
    if (st == FL_OK) {
        static char keep[1024];
        snprintf(keep, sizeof keep, "%s", p);
        st = fl_safetensors_parse(keep, m.data, m.size, ts, nt);
        /* tests only look at metadata after this, never data pointers */
        fl_mapfile_close(&m);
    }
    *dir_out = dir;
    return st;
}

static void test_parse_all_dtypes(void **state) {
    (void)state;
    uint8_t data[64] = {0};
    float one = 1.0f;
    memcpy(data, &one, 4);
    const char *hdr =
        "{\"__metadata__\": {\"format\": \"pt\"},"
        " \"a\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 16]},"
        " \"b\": {\"dtype\": \"F16\", \"shape\": [4], \"data_offsets\": [16, 24]},"
        " \"c\": {\"dtype\": \"BF16\", \"shape\": [1, 2, 2], \"data_offsets\": [24, 32]},"
        " \"d\": {\"dtype\": \"I32\", \"shape\": [], \"data_offsets\": [32, 36]},"
        " \"e\": {\"dtype\": \"F32\", \"shape\": [0, 5], \"data_offsets\": [36, 36]}}   ";
    fl_ckpt_tensor *ts = NULL;
    size_t n = 0;
    char *dir;
    ASSERT_STATUS(parse_one(hdr, data, 36, &ts, &n, &dir), FL_OK);
    assert_int_equal(n, 5);
    assert_string_equal(ts[0].name, "a");
    assert_int_equal(ts[0].dtype, FL_DTYPE_F32);
    assert_int_equal(ts[0].ndim, 2);
    assert_int_equal(ts[0].nbytes, 16);
    assert_int_equal(ts[1].dtype, FL_DTYPE_F16);
    assert_int_equal(ts[2].dtype, FL_DTYPE_BF16);
    assert_int_equal(ts[2].ndim, 3);
    assert_int_equal(ts[3].dtype, FL_DTYPE_I32);
    assert_int_equal(ts[3].ndim, 0);
    assert_int_equal(ts[4].nbytes, 0);
    assert_true(strstr(ts[0].file, "t.safetensors") != NULL);
    fl_safetensors_tensors_free(ts, n);
    fx_rmtree(dir);
}

struct bad_case {
    const char *what;
    const char *header;
    size_t data_bytes;
    fl_status want;
    const char *needle; /* besides the file name */
};

static void test_malformed_headers(void **state) {
    (void)state;
    static const struct bad_case cases[] = {
        {"bad header JSON", "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]", 8,
         FL_ERR_FORMAT, "not valid JSON"},
        {"offsets out of range", "{\"w\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 8,
         FL_ERR_FORMAT, "\"w\""},
        {"begin after end", "{\"w\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [8, 4]}}", 8,
         FL_ERR_FORMAT, "\"w\""},
        {"offsets inconsistent with shape",
         "{\"w\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 8, FL_ERR_FORMAT, "\"w\""},
        {"unknown dtype", "{\"w\": {\"dtype\": \"F8_E5M2\", \"shape\": [8], \"data_offsets\": [0, 8]}}", 8,
         FL_ERR_UNSUPPORTED, "F8_E4M3"},
        {"negative dim", "{\"w\": {\"dtype\": \"F32\", \"shape\": [-2], \"data_offsets\": [0, 8]}}", 8,
         FL_ERR_FORMAT, "shape"},
        {"fractional offset", "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8.5]}}", 8,
         FL_ERR_FORMAT, "data_offsets"},
        {"missing dtype", "{\"w\": {\"shape\": [2], \"data_offsets\": [0, 8]}}", 8, FL_ERR_FORMAT, "dtype"},
        {"too many dims", "{\"w\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,2], \"data_offsets\": [0, 8]}}", 8,
         FL_ERR_UNSUPPORTED, "\"w\""},
        {"huge shape", "{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 8]}}",
         8, FL_ERR_FORMAT, "\"w\""},
        {"header not an object", "[1, 2]", 0, FL_ERR_FORMAT, "not an object"},
        {"trailing garbage", "{} x", 0, FL_ERR_FORMAT, "trailing"},
    };
    uint8_t data[16] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_ckpt_tensor *ts = (fl_ckpt_tensor *)1;
        size_t n = 99;
        char *dir;
        fl_error_clear();
        fl_status st = parse_one(cases[i].header, data, cases[i].data_bytes, &ts, &n, &dir);
        if (st != cases[i].want)
            fail_msg("%s: got %s, want %s (%s)", cases[i].what, fl_status_str(st), fl_status_str(cases[i].want),
                     fl_error_msg());
        assert_null(ts);
        assert_int_equal(n, 0);
        ASSERT_MSG_HAS("t.safetensors");
        ASSERT_MSG_HAS(cases[i].needle);
        fx_rmtree(dir);
    }
}

static void test_truncated_and_bad_length(void **state) {
    (void)state;
    fl_ckpt_tensor *ts;
    size_t n;
    /* truncated: fewer than 8 bytes */
    static const uint8_t tiny[5] = {1, 0, 0, 0, 0};
    ASSERT_STATUS(fl_safetensors_parse("trunc.safetensors", tiny, sizeof tiny, &ts, &n), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("trunc.safetensors");
    ASSERT_MSG_HAS("truncated");
    /* header length larger than the file */
    uint8_t buf[8 + 2] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
    ASSERT_STATUS(fl_safetensors_parse("long.safetensors", buf, sizeof buf, &ts, &n), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("long.safetensors");
    ASSERT_MSG_HAS("header length 65535");
    /* u64 max must not wrap around */
    memset(buf, 0xff, 8);
    ASSERT_STATUS(fl_safetensors_parse("max.safetensors", buf, sizeof buf, &ts, &n), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("max.safetensors");
    /* a real file cut in the middle of its data: offsets now out of range */
    fl_mapfile m;
    ASSERT_STATUS(fl_mapfile_open(TINY "/model.safetensors", &m), FL_OK);
    ASSERT_STATUS(fl_safetensors_parse("cut.safetensors", m.data, m.size - 100, &ts, &n), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("cut.safetensors");
    ASSERT_MSG_HAS("out of range");
    /* ... and every prefix fails cleanly (never crashes, never succeeds) */
    for (size_t cut = 0; cut < m.size; cut += 97) {
        fl_status st = fl_safetensors_parse("cut.safetensors", m.data, cut, &ts, &n);
        assert_int_not_equal(st, FL_OK);
    }
    fl_mapfile_close(&m);
}

/* ---- folders: single file errors, sharded ------------------------------- */

static void test_folder_errors(void **state) {
    (void)state;
    char *dir = fx_mkdtemp();
    fl_ckpt *ck = NULL;
    /* no config.json */
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_NOT_FOUND);
    ASSERT_MSG_HAS("config.json");
    fx_write_text(fx_path(dir, "config.json"), FX_CONFIG);
    /* no weights */
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_NOT_FOUND);
    ASSERT_MSG_HAS("model.safetensors");
    ASSERT_MSG_HAS(dir);
    /* a malformed weights file fails open (names the file) */
    fx_write_st(fx_path(dir, "model.safetensors"),
                "{\"x\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 12]}}", "abcd", 4);
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("model.safetensors");
    ASSERT_MSG_HAS("\"x\"");
    assert_null(ck);
    /* valid, with the string form of chat_template and an F32 linear */
    float w[6] = {1, 2, 3, 4, 5, 6};
    fx_write_st(fx_path(dir, "model.safetensors"),
                "{\"p.weight\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]}}", w, sizeof w);
    fx_write_text(fx_path(dir, "tokenizer_config.json"), "{\"chat_template\": \"{{ bos_token }}hi\"}");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    assert_string_equal(fl_ckpt_chat_template(ck), "{{ bos_token }}hi");
    fl_tensor t;
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "p", 2, 3, FL_LOAD_AS_STORED, &t), FL_OK);
    float row[3];
    fl_tensor_row_f32(&t, 1, row);
    assert_true(row[0] == 4 && row[1] == 5 && row[2] == 6);
    fl_tensor_free(&t);
    /* 3 columns cannot be grouped into W4 */
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "p", 2, 3, FL_LOAD_W4, &t), FL_ERR_UNSUPPORTED);
    ASSERT_MSG_HAS("p.weight");
    fl_ckpt_free(ck);
    /* chat_template.jinja (transformers 5) wins over tokenizer_config.json */
    fx_write_text(fx_path(dir, "chat_template.jinja"), "JINJA {{ x }}\n");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    assert_string_equal(fl_ckpt_chat_template(ck), "JINJA {{ x }}\n");
    fl_ckpt_free(ck);
    remove(fx_path(dir, "chat_template.jinja"));
    /* no template at all */
    fx_write_text(fx_path(dir, "tokenizer_config.json"), "{\"bos_token\": \"<s>\"}");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    assert_null(fl_ckpt_chat_template(ck));
    fl_ckpt_free(ck);
    fx_rmtree(dir);
}

static void write_two_shards(const char *dir) {
    fx_write_text(fx_path(dir, "config.json"), FX_CONFIG);
    float a[4] = {1, 2, 3, 4};
    uint16_t b[2] = {0x3f80, 0xc000}; /* bf16 1, -2 */
    float c[2] = {7, 8};
    fx_write_st(fx_path(dir, "model-00001-of-00002.safetensors"),
                "{\"a.weight\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 16]},"
                " \"__metadata__\": {\"format\": \"pt\"}}",
                a, sizeof a);
    uint8_t d2[12];
    memcpy(d2, b, 4);
    memcpy(d2 + 4, c, 8);
    fx_write_st(fx_path(dir, "model-00002-of-00002.safetensors"),
                "{\"b.weight\": {\"dtype\": \"BF16\", \"shape\": [2], \"data_offsets\": [0, 4]},"
                " \"c.bias\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
                d2, sizeof d2);
}

static void test_sharded(void **state) {
    (void)state;
    char *dir = fx_mkdtemp();
    write_two_shards(dir);
    fx_write_text(fx_path(dir, "model.safetensors.index.json"),
                  "{\"metadata\": {\"total_size\": 28}, \"weight_map\": {"
                  "\"a.weight\": \"model-00001-of-00002.safetensors\","
                  "\"c.bias\": \"model-00002-of-00002.safetensors\","
                  "\"b.weight\": \"model-00002-of-00002.safetensors\"}}");
    fl_ckpt *ck = NULL;
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    assert_int_equal(fl_ckpt_count(ck), 3);
    const fl_ckpt_tensor *t;
    ASSERT_STATUS(fl_ckpt_get(ck, "b.weight", &t), FL_OK);
    assert_non_null(strstr(t->file, "model-00002-of-00002.safetensors"));
    fl_tensor x;
    int64_t e[1] = {2};
    float row[2];
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "b.weight", 1, e, &x), FL_OK);
    fl_tensor_row_f32(&x, 0, row);
    assert_true(row[0] == 1.0f && row[1] == -2.0f);
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "c.bias", 1, e, &x), FL_OK);
    fl_tensor_row_f32(&x, 0, row);
    assert_true(row[0] == 7.0f && row[1] == 8.0f);
    ASSERT_STATUS(fl_ckpt_get(ck, "a.weight", &t), FL_OK);
    assert_non_null(strstr(t->file, "model-00001-of-00002.safetensors"));
    fl_ckpt_free(ck);

    /* index naming a missing shard */
    fx_write_text(fx_path(dir, "model.safetensors.index.json"),
                  "{\"weight_map\": {\"a.weight\": \"model-00001-of-00002.safetensors\","
                  "\"z.weight\": \"model-00003-of-00003.safetensors\"}}");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_NOT_FOUND);
    ASSERT_MSG_HAS("model.safetensors.index.json");
    ASSERT_MSG_HAS("model-00003-of-00003.safetensors");
    ASSERT_MSG_HAS("z.weight");
    assert_null(ck);

    /* index listing a tensor in the wrong shard */
    fx_write_text(fx_path(dir, "model.safetensors.index.json"),
                  "{\"weight_map\": {\"a.weight\": \"model-00002-of-00002.safetensors\","
                  "\"b.weight\": \"model-00001-of-00002.safetensors\"}}");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("index.json");
    ASSERT_MSG_HAS("\"a.weight\"");

    /* index naming a tensor no shard holds */
    fx_write_text(fx_path(dir, "model.safetensors.index.json"),
                  "{\"weight_map\": {\"a.weight\": \"model-00001-of-00002.safetensors\","
                  "\"q.weight\": \"model-00001-of-00002.safetensors\"}}");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("\"q.weight\"");

    /* path escapes are refused */
    fx_write_text(fx_path(dir, "model.safetensors.index.json"),
                  "{\"weight_map\": {\"a.weight\": \"../etc/passwd\"}}");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("\"a.weight\"");

    /* bad index JSON */
    fx_write_text(fx_path(dir, "model.safetensors.index.json"), "{\"weight_map\": {\n\"a\": }");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("model.safetensors.index.json");
    ASSERT_MSG_HAS("line 2");

    /* the same tensor in two shards */
    float a[4] = {0};
    fx_write_st(fx_path(dir, "model-00002-of-00002.safetensors"),
                "{\"a.weight\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 16]}}", a, sizeof a);
    fx_write_text(fx_path(dir, "model.safetensors.index.json"),
                  "{\"weight_map\": {\"a.weight\": \"model-00001-of-00002.safetensors\","
                  "\"x\": \"model-00002-of-00002.safetensors\"}}");
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("\"a.weight\" appears twice");
    fx_rmtree(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_llama_matches_reference),
        cmocka_unit_test(test_transformers_sharded),
        cmocka_unit_test(test_missing_tensor_and_wrong_shape),
        cmocka_unit_test(test_parse_all_dtypes),
        cmocka_unit_test(test_malformed_headers),
        cmocka_unit_test(test_truncated_and_bad_length),
        cmocka_unit_test(test_folder_errors),
        cmocka_unit_test(test_sharded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
