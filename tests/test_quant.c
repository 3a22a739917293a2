/*
 * test_quant.c — conversions into W4:
 *  - AutoAWQ GEMM: the fixture in tests/loader/awq was packed in Python
 *    exactly as AutoAWQ's WQLinear_GEMM.from_linear does; the repacked W4
 *    must dequantize to the Python-computed (q - z) * s bit for bit; plus a
 *    hand-packed word that pins the nibble order;
 *  - RTN: error within half a quantization step per group;
 *  - GGUF Q4_0 / Q4_1 -> W4 and Q8_0 -> F32 through fl_ckpt_load_linear on
 *    a checkpoint assembled in memory: exact.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>

#include "loader/fixture_util.h"
#include "runtime/load/checkpoint.h"
#include "runtime/load/checkpoint_impl.h"
#include "runtime/load/mapfile.h"
#include "runtime/load/quant.h"
#include "runtime/load/safetensors.h"

static void assert_rows_equal(const fl_tensor *a, const fl_tensor *b) {
    assert_int_equal(a->shape[0], b->shape[0]);
    assert_int_equal(a->shape[1], b->shape[1]);
    int64_t cols = a->shape[1];
    float *ra = malloc(cols * sizeof(float)), *rb = malloc(cols * sizeof(float));
    for (int64_t r = 0; r < a->shape[0]; r++) {
        fl_tensor_row_f32(a, r, ra);
        fl_tensor_row_f32(b, r, rb);
        for (int64_t c = 0; c < cols; c++)
            if (ra[c] != rb[c]) fail_msg("row %lld col %lld: %.9g != %.9g", (long long)r, (long long)c, ra[c], rb[c]);
    }
    free(ra);
    free(rb);
}

/* ---- compressed-tensors pack-quantized ----------------------------------- */

/* The tests/golden/llama_ct* fixtures (tests/golden/make_ct_golden.py, packed
 * by the compressed-tensors package): W4 values equal the exact
 * (q - zp) * scale the generator kept in dequant.safetensors, whole and cut
 * into the blocks tensor parallelism loads (rows halved, columns halved). */
static void test_ct_fixtures(void **state) {
    (void)state;
    static const struct { const char *dir; bool sym; int group; } fx[] = {
        {"llama_ct", true, 32}, {"llama_ct_asym", false, 32}, {"llama_ct_channel", true, 0}};
    for (size_t f = 0; f < sizeof fx / sizeof fx[0]; f++) {
        char path[512];
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s", fx[f].dir);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(path, &ck), FL_OK);
        fl_model_config cfg;
        ASSERT_STATUS(fl_ckpt_model_config(ck, &cfg), FL_OK);
        assert_int_equal(cfg.quant, FL_QUANT_CT_PACK);
        assert_int_equal(cfg.quant_group_size, fx[f].group);
        assert_int_equal(cfg.quant_symmetric, fx[f].sym);
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s/dequant.safetensors", fx[f].dir);
        fl_mapfile ref;
        fl_ckpt_tensor *rts = NULL;
        size_t nref = 0;
        ASSERT_STATUS(fl_mapfile_open(path, &ref), FL_OK);
        ASSERT_STATUS(fl_safetensors_parse(ref.path, ref.data, ref.size, &rts, &nref), FL_OK);
        assert_int_equal(nref, 2);
        for (size_t i = 0; i < nref; i++) {
            const int64_t out = rts[i].shape[0], in = rts[i].shape[1];
            /* row-parallel blocks start on a group boundary */
            const fl_ckpt_slice blocks[3] = {{0, out, 0, in}, {out / 2, out / 2, 0, in}, {0, out, 32, in - 32}};
            for (int b = 0; b < 3; b++) {
                fl_tensor w;
                ASSERT_STATUS(fl_ckpt_load_linear_part(ck, rts[i].name, out, in, &blocks[b], FL_LOAD_W4, &w), FL_OK);
                assert_int_equal(w.dtype, FL_DTYPE_W4);
                assert_int_equal(w.group, fx[f].group ? fx[f].group : blocks[b].n_cols);
                fx_assert_block_equal(&w, rts[i].data, in, blocks[b].row_lo, blocks[b].col_lo);
                fl_tensor_free(&w);
            }
            if (fx[f].group) { /* a cut inside a group is refused */
                const fl_ckpt_slice mid = {0, out, 16, in - 16};
                fl_tensor w;
                ASSERT_STATUS(fl_ckpt_load_linear_part(ck, rts[i].name, out, in, &mid, FL_LOAD_W4, &w),
                              FL_ERR_UNSUPPORTED);
                ASSERT_MSG_HAS("not whole groups");
            }
        }
        fl_safetensors_tensors_free(rts, nref);
        fl_mapfile_close(&ref);
        fl_ckpt_free(ck);
    }
}

/* Column reordering (actorder group/weight) and activation quantization are
 * refused with the key named (a weight_g_idx tensor is refused at load). */
static void test_ct_refused(void **state) {
    (void)state;
    char *dir = fx_mkdtemp();
    static const char *const W = "\"type\": \"int\", \"symmetric\": true, \"group_size\": 32";
    static const struct { const char *weights, *group_extra, *want; } bad[] = {
        {"\"strategy\": \"group\", \"num_bits\": 4, \"actorder\": \"group\"", "", "actorder = group"},
        {"\"strategy\": \"group\", \"num_bits\": 4, \"actorder\": \"weight\"", "", "actorder = weight"},
        {"\"strategy\": \"group\", \"num_bits\": 4", ", \"input_activations\": {\"num_bits\": 8}",
         "quantizes activations"},
        {"\"strategy\": \"group\", \"num_bits\": 8", "", "only static 4-bit"},
        {"\"strategy\": \"tensor\", \"num_bits\": 4", "", "strategy tensor is not supported"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cfg[1024];
        snprintf(cfg, sizeof cfg,
                 "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
                 "\"num_attention_heads\": 4, \"num_hidden_layers\": 1, \"vocab_size\": 256, "
                 "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": "
                 "\"pack-quantized\", \"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"]%s, "
                 "\"weights\": {%s, %s}}}}}",
                 bad[i].group_extra, W, bad[i].weights);
        const char *p = fx_path(dir, "config.json");
        fx_write_text(p, cfg);
        fl_model_config c;
        assert_int_not_equal(fl_model_config_from_json(p, &c), FL_OK);
        ASSERT_MSG_HAS(bad[i].want);
    }
    fx_rmtree(dir);
}

/* A hand-packed linear [8, 32], group 32: every word 0xFEDCBA98 holds the
 * stored nibbles 8..15 for elements 0..7 (lowest nibble first), so the value
 * is (stored - zp) * 0.5 with zp 8 (symmetric) or, asymmetric, the zero
 * point word 0x76543210 giving row o the stored zero point o. A
 * weight_g_idx tensor next to a linear is refused. */
static void test_ct_hand_packed(void **state) {
    (void)state;
    for (int asym = 0; asym < 3; asym++) { /* 2: symmetric with a g_idx tensor */
        char *dir = fx_mkdtemp();
        char cfg[1024];
        snprintf(cfg, sizeof cfg,
                 "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 16, \"hidden_size\": 32, "
                 "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"intermediate_size\": 8, "
                 "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": "
                 "\"pack-quantized\", \"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], "
                 "\"weights\": {\"num_bits\": 4, \"type\": \"int\", \"symmetric\": %s, "
                 "\"strategy\": \"group\", \"group_size\": 32}}}}}",
                 asym == 1 ? "false" : "true");
        fx_write_text(fx_path(dir, "config.json"), cfg);
        uint8_t data[8 * 4 * 4 + 8 * 4 + 4 + 32 * 4];
        size_t off = 0;
        for (int i = 0; i < 32; i++, off += 4) memcpy(data + off, &(uint32_t){0xFEDCBA98u}, 4);
        for (int i = 0; i < 8; i++, off += 4) memcpy(data + off, &(float){0.5f}, 4);
        memcpy(data + off, &(uint32_t){0x76543210u}, 4);
        off += 4;
        for (int i = 0; i < 32; i++, off += 4) memcpy(data + off, &(int32_t){i}, 4);
        char hdr[1024];
        snprintf(hdr, sizeof hdr,
                 "{\"l.weight_packed\": {\"dtype\": \"I32\", \"shape\": [8, 4], \"data_offsets\": [0, 128]}, "
                 "\"l.weight_scale\": {\"dtype\": \"F32\", \"shape\": [8, 1], \"data_offsets\": [128, 160]}%s%s}",
                 asym == 1 ? ", \"l.weight_zero_point\": {\"dtype\": \"I32\", \"shape\": [1, 1], "
                             "\"data_offsets\": [160, 164]}" : "",
                 asym == 2 ? ", \"l.weight_g_idx\": {\"dtype\": \"I32\", \"shape\": [32], "
                             "\"data_offsets\": [164, 292]}" : "");
        fx_write_st(fx_path(dir, "model.safetensors"), hdr, data, sizeof data);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
        fl_tensor w;
        if (asym == 2) {
            ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", 8, 32, FL_LOAD_AS_STORED, &w), FL_ERR_UNSUPPORTED);
            ASSERT_MSG_HAS("l.weight_g_idx");
        } else {
            ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", 8, 32, FL_LOAD_AS_STORED, &w), FL_OK);
            float row[32];
            for (int o = 0; o < 8; o++) {
                fl_tensor_row_f32(&w, o, row);
                for (int c = 0; c < 32; c++) assert_true(row[c] == (float)(8 + c % 8 - (asym ? o : 8)) * 0.5f);
            }
            fl_tensor_free(&w);
        }
        fl_ckpt_free(ck);
        fx_rmtree(dir);
    }
}

/* ---- AWQ ----------------------------------------------------------------- */

static void test_awq_fixture(void **state) {
    (void)state;
    fl_ckpt *ck = NULL;
    ASSERT_STATUS(fl_ckpt_open(FL_TEST_DATA "/loader/awq", &ck), FL_OK);
    fl_model_config cfg;
    ASSERT_STATUS(fl_ckpt_model_config(ck, &cfg), FL_OK);
    assert_int_equal(cfg.quant, FL_QUANT_AWQ);
    assert_int_equal(cfg.quant_group_size, 64);

    fl_mapfile ref;
    fl_ckpt_tensor *rts = NULL;
    size_t nref = 0;
    ASSERT_STATUS(fl_mapfile_open(FL_TEST_DATA "/loader/awq_ref.safetensors", &ref), FL_OK);
    ASSERT_STATUS(fl_safetensors_parse(ref.path, ref.data, ref.size, &rts, &nref), FL_OK);
    assert_int_equal(nref, 3);
    int n_awq = 0;
    for (size_t i = 0; i < nref; i++) {
        fl_tensor expect = {.dtype = FL_DTYPE_F32, .ndim = 2, .data = (void *)rts[i].data};
        memcpy(expect.shape, rts[i].shape, sizeof expect.shape);
        for (int q = 0; q < 2; q++) { /* FL_LOAD_W4 must not re-quantize AWQ weights */
            fl_tensor w;
            ASSERT_STATUS(fl_ckpt_load_linear(ck, rts[i].name, rts[i].shape[0], rts[i].shape[1],
                                              q ? FL_LOAD_W4 : FL_LOAD_AS_STORED, &w),
                          FL_OK);
            if (strcmp(rts[i].name, "lm_head") == 0) { /* kept in float by AWQ */
                assert_int_equal(w.dtype, q ? FL_DTYPE_W4 : FL_DTYPE_F16);
                if (!q) assert_rows_equal(&w, &expect);
            } else {
                assert_int_equal(w.dtype, FL_DTYPE_W4);
                assert_int_equal(w.group, 64);
                assert_int_equal(w.owned, 1);
                assert_rows_equal(&w, &expect);
                n_awq++;
            }
            fl_tensor_free(&w);
        }
    }
    assert_int_equal(n_awq, 4);
    fl_safetensors_tensors_free(rts, nref);
    fl_mapfile_close(&ref);

    /* wrong expected shape: names the tensor and both shapes */
    fl_tensor w;
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "model.layers.0.mlp.down_proj", 192, 64, FL_LOAD_AS_STORED, &w),
                  FL_ERR_FORMAT);
    ASSERT_MSG_HAS("model.layers.0.mlp.down_proj.qweight");
    ASSERT_MSG_HAS("[192, 8]"); /* stored [in, out/8] */
    ASSERT_MSG_HAS("[64, 24]"); /* expected for out=192, in=64 */
    ASSERT_MSG_HAS("model.safetensors");
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "model.layers.0.mlp.gate_proj", 192, 64, FL_LOAD_AS_STORED, &w),
                  FL_ERR_NOT_FOUND);
    ASSERT_MSG_HAS("model.layers.0.mlp.gate_proj.weight");
    fl_ckpt_free(ck);
}

static void test_awq_nibble_order(void **state) {
    (void)state;
    /* out = 8, in = 32, group 32: every qweight word holds value k in
     * nibble k, so output column FL_AWQ_ORDER[k] gets code k. Zeros word:
     * nibble k = 1 for all k except column 3's nibble (k = 5) = 2. */
    uint32_t qweight[32], qzeros[1];
    for (int i = 0; i < 32; i++) qweight[i] = 0x76543210u;
    qzeros[0] = 0x11111111u & ~(0xfu << 20);
    qzeros[0] |= 2u << 20;
    uint16_t scales[8];
    for (int c = 0; c < 8; c++) scales[c] = fl_f32_to_f16((float)(c + 1) * 0.5f);
    fl_tensor w;
    ASSERT_STATUS(fl_quant_awq_to_w4("t", qweight, qzeros, scales, FL_DTYPE_F16, 8, 32, 32, &w), FL_OK);
    static const int expect_code[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* vLLM's REVERSE_AWQ_PACK_ORDER */
    float row[32];
    for (int c = 0; c < 8; c++) {
        assert_int_equal(FL_AWQ_REVERSE_ORDER[c], expect_code[c]);
        assert_int_equal(FL_AWQ_ORDER[FL_AWQ_REVERSE_ORDER[c]], c);
        fl_tensor_row_f32(&w, c, row);
        float z = c == 3 ? 2.0f : 1.0f, s = (float)(c + 1) * 0.5f;
        for (int i = 0; i < 32; i++) assert_true(row[i] == ((float)expect_code[c] - z) * s);
        assert_true(w.scales[c] == s);
        assert_true(w.bias[c] == -z * s);
    }
    fl_tensor_free(&w);
    ASSERT_STATUS(fl_quant_awq_to_w4("bad", qweight, qzeros, scales, FL_DTYPE_F16, 12, 32, 32, &w), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("bad");
    assert_null(w.data);
}

/* ---- RTN ----------------------------------------------------------------- */

static float frand(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

static void check_rtn(const fl_tensor *src, int group) {
    fl_tensor w;
    ASSERT_STATUS(fl_quant_rtn_to_w4("src", src, group, &w), FL_OK);
    assert_int_equal(w.dtype, FL_DTYPE_W4);
    assert_int_equal(w.group, group);
    int64_t rows = src->shape[0], cols = src->shape[1], ng = cols / group;
    float *x = malloc(cols * sizeof(float)), *y = malloc(cols * sizeof(float));
    for (int64_t r = 0; r < rows; r++) {
        fl_tensor_row_f32(src, r, x);
        fl_tensor_row_f32(&w, r, y);
        for (int64_t g = 0; g < ng; g++) {
            float mn = INFINITY, mx = -INFINITY;
            for (int c = 0; c < group; c++) {
                mn = fminf(mn, x[g * group + c]);
                mx = fmaxf(mx, x[g * group + c]);
            }
            float scale = (mx - mn) / 15.0f;
            assert_true(w.scales[r * ng + g] == scale);
            assert_true(w.bias[r * ng + g] == mn);
            float tol = scale / 2 + 1e-6f * fmaxf(fabsf(mn), fabsf(mx));
            for (int c = 0; c < group; c++) {
                float err = fabsf(y[g * group + c] - x[g * group + c]);
                if (err > tol) fail_msg("row %lld group %lld: error %g > %g", (long long)r, (long long)g, err, tol);
            }
            if (mx == mn)
                for (int c = 0; c < group; c++) assert_true(y[g * group + c] == x[g * group + c]);
        }
    }
    free(x);
    free(y);
    fl_tensor_free(&w);
}

static void test_rtn(void **state) {
    (void)state;
    srand(3);
    enum { R = 7, C = 384 };
    float *a = malloc(R * C * sizeof(float));
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) a[r * C + c] = frand() * powf(10.0f, (float)(r - 3));
    for (int c = 0; c < C; c++) a[2 * C + c] = 0.25f;  /* constant row */
    a[4 * C + 17] = 1000.0f;                           /* outlier */
    fl_tensor t = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {R, C}, .data = a};
    check_rtn(&t, 128);
    check_rtn(&t, 64);
    check_rtn(&t, 32);
    uint16_t *b = malloc(R * C * sizeof(uint16_t));
    for (int i = 0; i < R * C; i++) b[i] = fl_f32_to_bf16(a[i]);
    fl_tensor tb = {.dtype = FL_DTYPE_BF16, .ndim = 2, .shape = {R, C}, .data = b};
    check_rtn(&tb, 128);
    fl_tensor w;
    ASSERT_STATUS(fl_quant_rtn_to_w4("odd", &t, 100, &w), FL_ERR_UNSUPPORTED);
    ASSERT_MSG_HAS("odd");
    free(a);
    free(b);

    /* through the loader: FL_LOAD_W4 on a bf16 checkpoint, cols 32 -> group 32 */
    fl_ckpt *ck;
    ASSERT_STATUS(fl_ckpt_open(FL_TEST_DATA "/loader/tiny_llama", &ck), FL_OK);
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "model.layers.0.mlp.up_proj", 64, 32, FL_LOAD_W4, &w), FL_OK);
    assert_int_equal(w.dtype, FL_DTYPE_W4);
    assert_int_equal(w.group, 32);
    fl_tensor_free(&w);
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "model.layers.0.mlp.down_proj", 32, 64, FL_LOAD_W4, &w), FL_OK);
    assert_int_equal(w.group, 64);
    fl_tensor src;
    int64_t e[2] = {32, 64};
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "model.layers.0.mlp.down_proj.weight", 2, e, &src), FL_OK);
    check_rtn(&src, 64);
    fl_tensor_free(&w);
    fl_tensor_free(&src);
    fl_ckpt_free(ck);
}

/* ---- GGUF blocks through a checkpoint assembled in memory ----------------- */

static void fill_blocks(uint8_t *p, size_t nblocks, size_t bsz, int with_min) {
    for (size_t b = 0; b < nblocks; b++) {
        uint8_t *blk = p + b * bsz;
        uint16_t d = fl_f32_to_f16(frand() * 0.1f), m = fl_f32_to_f16(frand());
        memcpy(blk, &d, 2);
        if (with_min) memcpy(blk + 2, &m, 2);
        for (size_t j = (with_min ? 4 : 2); j < bsz; j++) blk[j] = (uint8_t)rand();
    }
}

static void test_gguf_kinds(void **state) {
    (void)state;
    srand(5);
    enum { R = 5, C = 96, NB = R * C / 32 };
    uint8_t *q40 = malloc(NB * 18), *q41 = malloc(NB * 20), *q80 = malloc(NB * 34);
    fill_blocks(q40, NB, 18, 0);
    fill_blocks(q41, NB, 20, 1);
    fill_blocks(q80, NB, 34, 0);

    /* what gguf.c would build: sorted HF names pointing at block data */
    fl_ckpt *ck = calloc(1, sizeof *ck);
    ck->path = strdup("mem.gguf");
    ck->format = "gguf";
    ck->n_tensors = 4;
    ck->tensors = calloc(4, sizeof *ck->tensors);
    struct { const char *name; fl_dtype dt; void *data; int ndim; } spec[4] = {
        {"b.weight", FL_DTYPE_Q4_1, q41, 2},
        {"a.weight", FL_DTYPE_Q4_0, q40, 2},
        {"c.weight", FL_DTYPE_Q8_0, q80, 2},
        {"d.weight", FL_DTYPE_Q8_0, q80, 1},
    };
    for (int i = 0; i < 4; i++) {
        fl_ckpt_tensor *t = &ck->tensors[i];
        t->name = strdup(spec[i].name);
        t->dtype = spec[i].dt;
        t->ndim = spec[i].ndim;
        t->shape[0] = spec[i].ndim == 2 ? R : 32;
        t->shape[1] = spec[i].ndim == 2 ? C : 0;
        t->data = spec[i].data;
        t->file = "mem.gguf";
    }
    ASSERT_STATUS(fl_ckpt_index(ck), FL_OK);
    assert_string_equal(fl_ckpt_at(ck, 0)->name, "a.weight");

    const char *lin[3] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++) {
        const fl_ckpt_tensor *t;
        char name[16];
        snprintf(name, sizeof name, "%s.weight", lin[i]);
        ASSERT_STATUS(fl_ckpt_get(ck, name, &t), FL_OK);
        fl_tensor src = {.dtype = t->dtype, .ndim = 2, .shape = {R, C}, .data = (void *)t->data};
        fl_tensor w;
        ASSERT_STATUS(fl_ckpt_load_linear(ck, lin[i], R, C, FL_LOAD_AS_STORED, &w), FL_OK);
        /* Q4 kinds become W4 (owned); Q8_0 stays as stored, aliasing the file */
        assert_int_equal(w.owned, t->dtype == FL_DTYPE_Q8_0 ? 0 : 1);
        assert_int_equal(w.dtype, t->dtype == FL_DTYPE_Q8_0 ? FL_DTYPE_Q8_0 : FL_DTYPE_W4);
        if (w.dtype == FL_DTYPE_W4) assert_int_equal(w.group, 32);
        assert_rows_equal(&w, &src);
        fl_tensor_free(&w);
    }
    /* non-linear quantized tensors are dequantized to F32 */
    fl_tensor v;
    int64_t e1[1] = {32};
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "d.weight", 1, e1, &v), FL_OK);
    assert_int_equal(v.dtype, FL_DTYPE_F32);
    float row[32];
    fl_tensor src = {.dtype = FL_DTYPE_Q8_0, .ndim = 1, .shape = {32}, .data = q80};
    fl_tensor_row_f32(&src, 0, row);
    assert_memory_equal(v.data, row, sizeof row);
    fl_tensor_free(&v);

    /* a block tensor whose rows are not whole blocks is refused, not read */
    fl_ckpt_tensor *d = (fl_ckpt_tensor *)fl_ckpt_at(ck, 3);
    assert_string_equal(d->name, "d.weight");
    d->shape[0] = 33;
    int64_t any[1] = {-1};
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "d.weight", 1, any, &v), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("\"d.weight\"");
    ASSERT_MSG_HAS("33 columns");

    /* wrong dtype for the Q4 converter */
    fl_tensor w;
    ASSERT_STATUS(fl_quant_gguf_q4_to_w4("x", &src, &w), FL_ERR_INVALID_ARG);

    /* a duplicate name is refused by the index */
    free((char *)ck->tensors[3].name);
    ck->tensors[3].name = strdup("a.weight");
    ASSERT_STATUS(fl_ckpt_index(ck), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("\"a.weight\" appears twice");
    fl_ckpt_free(ck);
    free(q40);
    free(q41);
    free(q80);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_awq_fixture),
        cmocka_unit_test(test_ct_fixtures),
        cmocka_unit_test(test_ct_refused),
        cmocka_unit_test(test_ct_hand_packed),
        cmocka_unit_test(test_awq_nibble_order),
        cmocka_unit_test(test_rtn),
        cmocka_unit_test(test_gguf_kinds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
