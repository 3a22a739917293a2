/*
 * test_gptq.c — GPTQ checkpoints (runtime/load/quant.h, checkpoint.c):
 *  - the tests/golden/llama_gptq* fixtures, quantized and packed by
 *    GPTQModel (tests/golden/make_gptq_golden.py): the loaded values equal,
 *    bit for bit, the (q - z) * s that GPTQModel's own dequantization gives
 *    in f32, whole and cut into tensor-parallel blocks; contiguous groups
 *    load as W4, act-order as F32;
 *  - a hand-packed format "gptq" zero-point word whose writer's -0x11111111
 *    borrowed across nibbles, and g_idx checks;
 *  - config.json fields that are refused, each named in the message.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "loader/fixture_util.h"
#include "runtime/load/checkpoint.h"
#include "runtime/load/mapfile.h"
#include "runtime/load/quant.h"
#include "runtime/load/safetensors.h"

static void test_gptq_fixtures(void **state) {
    (void)state;
    static const struct {
        const char *dir;
        bool sym, act, v1;
        int group;
    } fx[] = {{"llama_gptq", true, false, true, 32},
              {"llama_gptq_act", false, true, true, 32},
              {"llama_gptq_chan", false, false, false, 0}};
    for (size_t f = 0; f < sizeof fx / sizeof fx[0]; f++) {
        char path[512];
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s", fx[f].dir);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(path, &ck), FL_OK);
        fl_model_config cfg;
        ASSERT_STATUS(fl_ckpt_model_config(ck, &cfg), FL_OK);
        assert_int_equal(cfg.quant, FL_QUANT_GPTQ);
        assert_int_equal(cfg.quant_group_size, fx[f].group);
        assert_int_equal(cfg.quant_symmetric, fx[f].sym);
        assert_int_equal(cfg.quant_act_order, fx[f].act);
        assert_int_equal(cfg.quant_zeros_minus_one, fx[f].v1);
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s/dequant.safetensors", fx[f].dir);
        fl_mapfile ref;
        fl_ckpt_tensor *rts = NULL;
        size_t nref = 0;
        ASSERT_STATUS(fl_mapfile_open(path, &ref), FL_OK);
        ASSERT_STATUS(fl_safetensors_parse(ref.path, ref.data, ref.size, &rts, &nref), FL_OK);
        assert_int_equal(nref, 2);
        for (size_t i = 0; i < nref; i++) {
            const int64_t out = rts[i].shape[0], in = rts[i].shape[1];
            /* column-parallel row blocks, and row-parallel column blocks that
             * start on a group boundary */
            const fl_ckpt_slice blocks[3] = {{0, out, 0, in}, {out / 2, out / 2, 0, in}, {0, out, 32, in - 32}};
            for (int b = 0; b < 3; b++) {
                for (int q = 0; q < 2; q++) { /* the same whether or not float weights are to be quantized */
                    fl_tensor w;
                    ASSERT_STATUS(fl_ckpt_load_linear_part(ck, rts[i].name, out, in, &blocks[b],
                                                           q ? FL_LOAD_W4 : FL_LOAD_AS_STORED, &w), FL_OK);
                    assert_int_equal(w.dtype, fx[f].act ? FL_DTYPE_F32 : FL_DTYPE_W4);
                    if (!fx[f].act) assert_int_equal(w.group, fx[f].group ? fx[f].group : blocks[b].n_cols);
                    fx_assert_block_equal(&w, rts[i].data, in, blocks[b].row_lo, blocks[b].col_lo);
                    fl_tensor_free(&w);
                }
            }
            /* a cut inside a group: refused for W4 groups, fine elsewhere */
            const fl_ckpt_slice mid = {0, out, 16, in - 16};
            fl_tensor w;
            fl_status st = fl_ckpt_load_linear_part(ck, rts[i].name, out, in, &mid, FL_LOAD_AS_STORED, &w);
            if (fx[f].group && !fx[f].act) {
                ASSERT_STATUS(st, FL_ERR_UNSUPPORTED);
                ASSERT_MSG_HAS("not whole groups");
            } else {
                ASSERT_STATUS(st, FL_OK);
                fx_assert_block_equal(&w, rts[i].data, in, 0, 16);
                fl_tensor_free(&w);
            }
        }
        fl_safetensors_tensors_free(rts, nref);
        fl_mapfile_close(&ref);
        fl_ckpt_free(ck);
    }
}

/* A linear [8, 32], group 32, asymmetric, format "gptq": every qweight word
 * 0xFEDCBA98 holds q = 8..15 for inputs 8j..8j+7; the zero points of
 * columns 0..7 are 0..7, i.e. the v2 word 0x76543210, written as
 * 0x76543210 - 0x11111111 = 0x654320FF (nibbles 0 and 1 borrowed: a
 * per-nibble +1 would read column 1's zero as 0). Scales 0.5 (F32).
 * Variants: 0 as described; 1 the same with format "gptq_v2" and the word
 * 0x76543210; 2 a permuted g_idx over two groups of 16 (loads as F32);
 * 3 a g_idx entry outside the groups. */
static void test_gptq_hand_packed(void **state) {
    (void)state;
    for (int v = 0; v < 4; v++) {
        char *dir = fx_mkdtemp();
        const int group = v >= 2 ? 16 : 32, ng = 32 / group;
        char cfg[1024];
        snprintf(cfg, sizeof cfg,
                 "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 16, \"hidden_size\": 32, "
                 "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"intermediate_size\": 8, "
                 "\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, \"group_size\": %d, "
                 "\"sym\": false, \"desc_act\": %s, \"checkpoint_format\": \"%s\"}}",
                 group, v >= 2 ? "true" : "false", v == 1 ? "gptq_v2" : "gptq");
        fx_write_text(fx_path(dir, "config.json"), cfg);
        uint8_t data[4 * 8 * 4 + 2 * 4 + 2 * 8 * 4 + 32 * 4];
        size_t off = 0;
        for (int i = 0; i < 32; i++, off += 4) memcpy(data + off, &(uint32_t){0xFEDCBA98u}, 4);
        const size_t zoff = off;
        for (int g = 0; g < ng; g++, off += 4) memcpy(data + off, &(uint32_t){v == 1 ? 0x76543210u : 0x654320FFu}, 4);
        const size_t soff = off;
        for (int i = 0; i < 8 * ng; i++, off += 4) memcpy(data + off, &(float){i < 8 ? 0.5f : 0.25f}, 4);
        const size_t goff = off;
        int32_t gidx[32];
        for (int i = 0; i < 32; i++) gidx[i] = v >= 2 ? (i * 7 + 3) % 32 / 16 : 0; /* two groups, interleaved */
        if (v == 3) gidx[5] = 2;
        memcpy(data + off, gidx, sizeof gidx);
        off += sizeof gidx;
        char hdr[1024];
        snprintf(hdr, sizeof hdr,
                 "{\"l.qweight\": {\"dtype\": \"I32\", \"shape\": [4, 8], \"data_offsets\": [0, %zu]}, "
                 "\"l.qzeros\": {\"dtype\": \"I32\", \"shape\": [%d, 1], \"data_offsets\": [%zu, %zu]}, "
                 "\"l.scales\": {\"dtype\": \"F32\", \"shape\": [%d, 8], \"data_offsets\": [%zu, %zu]}, "
                 "\"l.g_idx\": {\"dtype\": \"I32\", \"shape\": [32], \"data_offsets\": [%zu, %zu]}}",
                 zoff, ng, zoff, soff, ng, soff, goff, goff, off);
        fx_write_st(fx_path(dir, "model.safetensors"), hdr, data, off);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
        fl_tensor w;
        if (v == 3) {
            ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", 8, 32, FL_LOAD_AS_STORED, &w), FL_ERR_FORMAT);
            ASSERT_MSG_HAS("g_idx[5] = 2 is not a group");
        } else {
            ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", 8, 32, FL_LOAD_AS_STORED, &w), FL_OK);
            assert_int_equal(w.dtype, v == 2 ? FL_DTYPE_F32 : FL_DTYPE_W4);
            float row[32];
            for (int o = 0; o < 8; o++) {
                fl_tensor_row_f32(&w, o, row);
                for (int c = 0; c < 32; c++) {
                    const float s = gidx[c] ? 0.25f : 0.5f;
                    if (row[c] != (float)(8 + c % 8 - o) * s)
                        fail_msg("variant %d row %d col %d: %g != %g", v, o, c, row[c], (float)(8 + c % 8 - o) * s);
                }
            }
            fl_tensor_free(&w);
        }
        fl_ckpt_free(ck);
        fx_rmtree(dir);
    }
}

/* Bit widths, layouts and options flotilla does not read are refused with
 * the config field named. */
static void test_gptq_refused(void **state) {
    (void)state;
    char *dir = fx_mkdtemp();
    static const struct { const char *q, *want; } bad[] = {
        {"\"bits\": 8, \"group_size\": 128", "quantization_config.bits = 8"},
        {"\"bits\": 3, \"group_size\": 128", "quantization_config.bits = 3"},
        {"\"group_size\": 128", "\"quantization_config.bits\" is missing"},
        {"\"bits\": 4, \"group_size\": 0", "quantization_config.group_size = 0"},
        {"\"bits\": 4, \"checkpoint_format\": \"marlin\"", "quantization_config.checkpoint_format \"marlin\""},
        {"\"bits\": 4, \"format\": \"gptq_p\"", "quantization_config.format \"gptq_p\""},
        {"\"bits\": 4, \"checkpoint_format\": \"gptq\", \"format\": \"gptq_v2\"", "contradicts"},
        {"\"bits\": 4, \"is_marlin_format\": true", "is_marlin_format"},
        {"\"bits\": 4, \"pack_dtype\": \"int16\"", "pack_dtype int16"},
        {"\"bits\": 4, \"dynamic\": {\"-:.*down\": {}}", "quantization_config.dynamic"},
        {"\"bits\": 4, \"sym\": 1", "\"quantization_config.sym\" must be true or false"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char cfg[1024];
        snprintf(cfg, sizeof cfg,
                 "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
                 "\"num_attention_heads\": 4, \"num_hidden_layers\": 1, \"vocab_size\": 256, "
                 "\"quantization_config\": {\"quant_method\": \"gptq\", %s}}",
                 bad[i].q);
        const char *p = fx_path(dir, "config.json");
        fx_write_text(p, cfg);
        fl_model_config c;
        assert_int_not_equal(fl_model_config_from_json(p, &c), FL_OK);
        ASSERT_MSG_HAS(bad[i].want);
    }
    fx_rmtree(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gptq_fixtures),
        cmocka_unit_test(test_gptq_hand_packed),
        cmocka_unit_test(test_gptq_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
