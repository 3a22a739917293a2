/*
 * test_fp8.c — FP8 (float8_e4m3fn) checkpoints and the tensor-parallel
 * block reads of every quantized format (runtime/load/quant.h,
 * checkpoint.c):
 *  - all 256 e4m3fn codes decode to torch's float32 values (NaN codes NaN);
 *  - the tests/golden FP8 fixtures (tests/golden/make_fp8_golden.py), dense
 *    llama and Qwen2-MoE (experts, shared expert): the loaded F32 values
 *    equal e4m3 * scale as torch rounds it, bit for bit, whole and in blocks
 *    that cut scale tiles; --quantize w4 gives W4 (or refuses a width that
 *    is not a multiple of 32);
 *  - a hand-made [200, 136] weight with 128 x 128 tiles (partial ones at
 *    both edges): values, bytes read, NaN codes and bad scales refused
 *    naming the tensor, scale grids of the wrong shape, F8 weights without
 *    an FP8 quantization_config, and refused config fields;
 *  - AWQ, compressed-tensors, GPTQ and FP8 blocks read only their own
 *    bytes: the two halves of a linear read what the whole does (plus what
 *    both need: GPTQ's g_idx, FP8 scales over a cut), each block equals the
 *    same block cut from the whole weight bit for bit, and a model loaded
 *    as tp rank 0 and 1 of 2 reads the tp 1 bytes plus only the tensors
 *    every rank keeps whole; an FP8 MoE model's ep ranks read only their
 *    own experts.
 */
#define _GNU_SOURCE
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kernels/backend.h"
#include "loader/fixture_util.h"
#include "runtime/load/checkpoint.h"
#include "runtime/load/mapfile.h"
#include "runtime/load/quant.h"
#include "runtime/load/safetensors.h"
#include "runtime/model/model.h"

/* torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(), as bits */
static const uint32_t E4M3_F32[256] = {
    0x00000000, 0x3b000000, 0x3b800000, 0x3bc00000, 0x3c000000, 0x3c200000, 0x3c400000, 0x3c600000,
    0x3c800000, 0x3c900000, 0x3ca00000, 0x3cb00000, 0x3cc00000, 0x3cd00000, 0x3ce00000, 0x3cf00000,
    0x3d000000, 0x3d100000, 0x3d200000, 0x3d300000, 0x3d400000, 0x3d500000, 0x3d600000, 0x3d700000,
    0x3d800000, 0x3d900000, 0x3da00000, 0x3db00000, 0x3dc00000, 0x3dd00000, 0x3de00000, 0x3df00000,
    0x3e000000, 0x3e100000, 0x3e200000, 0x3e300000, 0x3e400000, 0x3e500000, 0x3e600000, 0x3e700000,
    0x3e800000, 0x3e900000, 0x3ea00000, 0x3eb00000, 0x3ec00000, 0x3ed00000, 0x3ee00000, 0x3ef00000,
    0x3f000000, 0x3f100000, 0x3f200000, 0x3f300000, 0x3f400000, 0x3f500000, 0x3f600000, 0x3f700000,
    0x3f800000, 0x3f900000, 0x3fa00000, 0x3fb00000, 0x3fc00000, 0x3fd00000, 0x3fe00000, 0x3ff00000,
    0x40000000, 0x40100000, 0x40200000, 0x40300000, 0x40400000, 0x40500000, 0x40600000, 0x40700000,
    0x40800000, 0x40900000, 0x40a00000, 0x40b00000, 0x40c00000, 0x40d00000, 0x40e00000, 0x40f00000,
    0x41000000, 0x41100000, 0x41200000, 0x41300000, 0x41400000, 0x41500000, 0x41600000, 0x41700000,
    0x41800000, 0x41900000, 0x41a00000, 0x41b00000, 0x41c00000, 0x41d00000, 0x41e00000, 0x41f00000,
    0x42000000, 0x42100000, 0x42200000, 0x42300000, 0x42400000, 0x42500000, 0x42600000, 0x42700000,
    0x42800000, 0x42900000, 0x42a00000, 0x42b00000, 0x42c00000, 0x42d00000, 0x42e00000, 0x42f00000,
    0x43000000, 0x43100000, 0x43200000, 0x43300000, 0x43400000, 0x43500000, 0x43600000, 0x43700000,
    0x43800000, 0x43900000, 0x43a00000, 0x43b00000, 0x43c00000, 0x43d00000, 0x43e00000, 0x7ff00000,
    0x80000000, 0xbb000000, 0xbb800000, 0xbbc00000, 0xbc000000, 0xbc200000, 0xbc400000, 0xbc600000,
    0xbc800000, 0xbc900000, 0xbca00000, 0xbcb00000, 0xbcc00000, 0xbcd00000, 0xbce00000, 0xbcf00000,
    0xbd000000, 0xbd100000, 0xbd200000, 0xbd300000, 0xbd400000, 0xbd500000, 0xbd600000, 0xbd700000,
    0xbd800000, 0xbd900000, 0xbda00000, 0xbdb00000, 0xbdc00000, 0xbdd00000, 0xbde00000, 0xbdf00000,
    0xbe000000, 0xbe100000, 0xbe200000, 0xbe300000, 0xbe400000, 0xbe500000, 0xbe600000, 0xbe700000,
    0xbe800000, 0xbe900000, 0xbea00000, 0xbeb00000, 0xbec00000, 0xbed00000, 0xbee00000, 0xbef00000,
    0xbf000000, 0xbf100000, 0xbf200000, 0xbf300000, 0xbf400000, 0xbf500000, 0xbf600000, 0xbf700000,
    0xbf800000, 0xbf900000, 0xbfa00000, 0xbfb00000, 0xbfc00000, 0xbfd00000, 0xbfe00000, 0xbff00000,
    0xc0000000, 0xc0100000, 0xc0200000, 0xc0300000, 0xc0400000, 0xc0500000, 0xc0600000, 0xc0700000,
    0xc0800000, 0xc0900000, 0xc0a00000, 0xc0b00000, 0xc0c00000, 0xc0d00000, 0xc0e00000, 0xc0f00000,
    0xc1000000, 0xc1100000, 0xc1200000, 0xc1300000, 0xc1400000, 0xc1500000, 0xc1600000, 0xc1700000,
    0xc1800000, 0xc1900000, 0xc1a00000, 0xc1b00000, 0xc1c00000, 0xc1d00000, 0xc1e00000, 0xc1f00000,
    0xc2000000, 0xc2100000, 0xc2200000, 0xc2300000, 0xc2400000, 0xc2500000, 0xc2600000, 0xc2700000,
    0xc2800000, 0xc2900000, 0xc2a00000, 0xc2b00000, 0xc2c00000, 0xc2d00000, 0xc2e00000, 0xc2f00000,
    0xc3000000, 0xc3100000, 0xc3200000, 0xc3300000, 0xc3400000, 0xc3500000, 0xc3600000, 0xc3700000,
    0xc3800000, 0xc3900000, 0xc3a00000, 0xc3b00000, 0xc3c00000, 0xc3d00000, 0xc3e00000, 0xfff00000,
};

static float table_value(uint8_t code) {
    float f;
    memcpy(&f, &E4M3_F32[code], 4);
    return f;
}

static void test_decode_all_codes(void **state) {
    (void)state;
    for (int c = 0; c < 256; c++) {
        const float got = fl_f8e4m3_to_f32((uint8_t)c);
        if ((c & 0x7f) == 0x7f) {
            if (!isnan(got)) fail_msg("code 0x%02x: %g, want NaN", c, got);
            continue;
        }
        const float want = table_value((uint8_t)c);
        if (memcmp(&got, &want, 4) != 0) fail_msg("code 0x%02x: %.9g != %.9g", c, got, want);
    }
    /* the edges by value: smallest subnormal, largest subnormal, smallest normal, max */
    assert_true(fl_f8e4m3_to_f32(0x01) == ldexpf(1, -9));
    assert_true(fl_f8e4m3_to_f32(0x07) == 7 * ldexpf(1, -9));
    assert_true(fl_f8e4m3_to_f32(0x08) == ldexpf(1, -6));
    assert_true(fl_f8e4m3_to_f32(0x7e) == 448.0f && fl_f8e4m3_to_f32(0xfe) == -448.0f);
    assert_true(signbit(fl_f8e4m3_to_f32(0x80)) && fl_f8e4m3_to_f32(0x80) == 0.0f);
}

static void test_fp8_fixtures(void **state) {
    (void)state;
    static const struct {
        const char *dir;
        fl_fp8_scaling scaling;
        bool inv;
        int block;
    } fx[] = {{"llama_ct_fp8", FL_FP8_CHANNEL, false, 0},
              {"llama_ct_fp8_tensor", FL_FP8_TENSOR, false, 0},
              {"llama_fp8_tensor", FL_FP8_TENSOR, true, 0},
              {"llama_fp8_block", FL_FP8_BLOCK, true, 128},
              {"qwen2_moe_ct_fp8", FL_FP8_CHANNEL, false, 0},
              {"qwen2_moe_fp8_block", FL_FP8_BLOCK, true, 8}};
    for (size_t f = 0; f < sizeof fx / sizeof fx[0]; f++) {
        char path[512];
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s", fx[f].dir);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(path, &ck), FL_OK);
        fl_model_config cfg;
        ASSERT_STATUS(fl_ckpt_model_config(ck, &cfg), FL_OK);
        assert_int_equal(cfg.quant, FL_QUANT_FP8);
        assert_int_equal(cfg.quant_fp8, fx[f].scaling);
        assert_int_equal(cfg.quant_scale_inv, fx[f].inv);
        assert_int_equal(cfg.quant_block[0], fx[f].block);
        assert_int_equal(cfg.quant_block[1], fx[f].block);
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s/dequant.safetensors", fx[f].dir);
        fl_mapfile ref;
        fl_ckpt_tensor *rts = NULL;
        size_t nref = 0;
        ASSERT_STATUS(fl_mapfile_open(path, &ref), FL_OK);
        ASSERT_STATUS(fl_safetensors_parse(ref.path, ref.data, ref.size, &rts, &nref), FL_OK);
        assert_true(nref >= 2); /* two linears, four in the MoE fixtures */
        for (size_t i = 0; i < nref; i++) {
            const int64_t out = rts[i].shape[0], in = rts[i].shape[1];
            /* whole, halves, and a block cutting tiles and channels anywhere */
            const int64_t c0 = in > 80 ? 37 : in / 4 + 1, nc = in > 80 ? in / 2 - 30 : in / 2;
            const fl_ckpt_slice blocks[4] = {
                {0, out, 0, in}, {out / 2, out / 2, 0, in}, {0, out, in / 2, in / 2}, {3, out / 2 + 5, c0, nc}};
            for (int b = 0; b < 4; b++) {
                fl_tensor w;
                ASSERT_STATUS(fl_ckpt_load_linear_part(ck, rts[i].name, out, in, &blocks[b], FL_LOAD_AS_STORED, &w),
                              FL_OK);
                assert_int_equal(w.dtype, FL_DTYPE_F32);
                assert_int_equal(w.shape[0], blocks[b].n_rows);
                assert_int_equal(w.shape[1], blocks[b].n_cols);
                fx_assert_block_equal(&w, rts[i].data, in, blocks[b].row_lo, blocks[b].col_lo);
                fl_tensor_free(&w);
            }
            /* --quantize w4: the dequantized values, quantized as any float weight */
            fl_tensor w4, f32, rtn;
            if (in % 32) { /* the MoE fixtures' 40-wide expert down_proj */
                ASSERT_STATUS(fl_ckpt_load_linear(ck, rts[i].name, out, in, FL_LOAD_W4, &w4), FL_ERR_UNSUPPORTED);
                ASSERT_MSG_HAS("not a multiple of 32: cannot quantize to W4");
                continue;
            }
            ASSERT_STATUS(fl_ckpt_load_linear(ck, rts[i].name, out, in, FL_LOAD_W4, &w4), FL_OK);
            assert_int_equal(w4.dtype, FL_DTYPE_W4);
            ASSERT_STATUS(fl_ckpt_load_linear(ck, rts[i].name, out, in, FL_LOAD_AS_STORED, &f32), FL_OK);
            ASSERT_STATUS(fl_quant_rtn_to_w4("ref", &f32, w4.group, &rtn), FL_OK);
            assert_memory_equal(w4.data, rtn.data, (size_t)out * (size_t)in / 2);
            assert_memory_equal(w4.scales, rtn.scales, (size_t)out * (size_t)(in / w4.group) * sizeof(float));
            fl_tensor_free(&w4);
            fl_tensor_free(&f32);
            fl_tensor_free(&rtn);
        }
        fl_safetensors_tensors_free(rts, nref);
        fl_mapfile_close(&ref);
        fl_ckpt_free(ck);
    }
}

enum { HO = 200, HI = 136 }; /* 2 x 2 tiles of 128: the last row and column tiles partial */

/* Writes a folder with one FP8 linear "l" [HO, HI]: codes (r * 7 + c * 3) % 256
 * with NaN codes replaced by 0x7e, unless nan_at >= 0 puts 0x7f there; tile
 * scales 2^(i - 3) * (1 + j / 4) as F32 [2, 2] named scale_name, or of
 * shape `shape`. */
static char *hand_folder(const char *qcfg, const char *scale_name, const char *shape, int nan_at, float bad_scale,
                         uint8_t *codes, float *scales) {
    char *dir = fx_mkdtemp();
    char cfg[1024];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 16, \"hidden_size\": 136, "
             "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"intermediate_size\": 200%s%s}",
             qcfg ? ", \"quantization_config\": " : "", qcfg ? qcfg : "");
    fx_write_text(fx_path(dir, "config.json"), cfg);
    static uint8_t data[HO * HI + 16];
    for (int r = 0; r < HO; r++)
        for (int c = 0; c < HI; c++) {
            uint8_t b = (uint8_t)((r * 7 + c * 3) % 256);
            if ((b & 0x7f) == 0x7f) b = 0x7e;
            data[r * HI + c] = b;
        }
    if (nan_at >= 0) data[nan_at] = 0xff;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            const float s = ldexpf(1.0f + (float)j / 4, i - 3);
            memcpy(data + HO * HI + 4 * (2 * i + j), &s, 4);
            if (scales) scales[2 * i + j] = s;
        }
    if (bad_scale != 0) memcpy(data + HO * HI + 4, &bad_scale, 4);
    if (codes) memcpy(codes, data, HO * HI);
    char hdr[512];
    snprintf(hdr, sizeof hdr,
             "{\"l.weight\": {\"dtype\": \"F8_E4M3\", \"shape\": [%d, %d], \"data_offsets\": [0, %d]}, "
             "\"l.%s\": {\"dtype\": \"F32\", \"shape\": %s, \"data_offsets\": [%d, %d]}}",
             HO, HI, HO * HI, scale_name, shape, HO * HI, HO * HI + 16);
    fx_write_st(fx_path(dir, "model.safetensors"), hdr, data, sizeof data);
    return dir;
}

static const char *const BLOCK_CFG = "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}";

static void test_fp8_hand_tiles(void **state) {
    (void)state;
    static uint8_t codes[HO * HI];
    float scales[4];
    char *dir = hand_folder(BLOCK_CFG, "weight_scale_inv", "[2, 2]", -1, 0, codes, scales);
    fl_ckpt *ck = NULL;
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    /* whole, and tp-style blocks that cut tiles: rows 100.., columns 68.. */
    const fl_ckpt_slice blocks[3] = {{0, HO, 0, HI}, {100, 100, 0, HI}, {0, HO, 68, 68}};
    for (int b = 0; b < 3; b++) {
        fl_tensor w;
        const size_t before = fl_ckpt_bytes_read(ck);
        ASSERT_STATUS(fl_ckpt_load_linear_part(ck, "l", HO, HI, &blocks[b], FL_LOAD_AS_STORED, &w), FL_OK);
        /* its own codes and the tiles under them, nothing else */
        const int tr = (int)((blocks[b].row_lo + blocks[b].n_rows - 1) / 128 - blocks[b].row_lo / 128 + 1);
        const int tc = (int)((blocks[b].col_lo + blocks[b].n_cols - 1) / 128 - blocks[b].col_lo / 128 + 1);
        assert_int_equal(fl_ckpt_bytes_read(ck) - before,
                         (size_t)(blocks[b].n_rows * blocks[b].n_cols) + (size_t)(tr * tc) * 4);
        float row[HI];
        for (int64_t r = 0; r < w.shape[0]; r++) {
            fl_tensor_row_f32(&w, r, row);
            for (int64_t c = 0; c < w.shape[1]; c++) {
                const int64_t gr = blocks[b].row_lo + r, gc = blocks[b].col_lo + c;
                const float want = table_value(codes[gr * HI + gc]) * scales[(gr / 128) * 2 + gc / 128];
                if (row[c] != want)
                    fail_msg("block %d [%lld, %lld]: %g != %g", b, (long long)gr, (long long)gc, row[c], want);
            }
        }
        fl_tensor_free(&w);
    }
    /* a cut through a tile always dequantizes (each side scaled by the same
     * tile); --quantize w4 then needs whole groups of 32 columns a side */
    fl_tensor w;
    ASSERT_STATUS(fl_ckpt_load_linear_part(ck, "l", HO, HI, &blocks[2], FL_LOAD_W4, &w), FL_ERR_UNSUPPORTED);
    ASSERT_MSG_HAS("tensor \"l.weight\" block has 68 columns, not a multiple of 32: cannot quantize to W4");
    const fl_ckpt_slice w4ok = {0, HO, 40, 96}; /* columns 40..135, across the tile edge at 128: 3 groups */
    ASSERT_STATUS(fl_ckpt_load_linear_part(ck, "l", HO, HI, &w4ok, FL_LOAD_W4, &w), FL_OK);
    assert_int_equal(w.dtype, FL_DTYPE_W4);
    fl_tensor_free(&w);
    fl_ckpt_free(ck);
    fx_rmtree(dir);

    /* a NaN code, a NaN scale: refused naming the tensor and where */
    dir = hand_folder(BLOCK_CFG, "weight_scale_inv", "[2, 2]", 130 * HI + 5, 0, NULL, NULL);
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", HO, HI, FL_LOAD_AS_STORED, &w), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("l.weight: FP8 weight [130, 5] is NaN (code 0xff)");
    const fl_ckpt_slice top = {0, 100, 0, HI}; /* a block without it loads */
    ASSERT_STATUS(fl_ckpt_load_linear_part(ck, "l", HO, HI, &top, FL_LOAD_AS_STORED, &w), FL_OK);
    fl_tensor_free(&w);
    fl_ckpt_free(ck);
    fx_rmtree(dir);
    dir = hand_folder(BLOCK_CFG, "weight_scale_inv", "[2, 2]", -1, NAN, NULL, NULL);
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", HO, HI, FL_LOAD_AS_STORED, &w), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("l.weight: FP8 weight scale [0, 1] is nan");
    fl_ckpt_free(ck);
    fx_rmtree(dir);

    /* scale grids that do not match the config's scaling */
    static const struct { const char *qcfg, *name, *shape, *msg; } bad[] = {
        {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 64]}", "weight_scale_inv", "[2, 2]",
         "has shape [2, 2] but FP8 scales per block of [200, 136] need [2, 3]"},
        {"{\"quant_method\": \"fp8\"}", "weight_scale_inv", "[2, 2]", "per tensor of [200, 136] need [1, 1]"},
        {BLOCK_CFG, "weight_scale", "[2, 2]", "tensor \"l.weight_scale_inv\" not found"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        dir = hand_folder(bad[i].qcfg, bad[i].name, bad[i].shape, -1, 0, NULL, NULL);
        ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
        assert_int_not_equal(fl_ckpt_load_linear(ck, "l", HO, HI, FL_LOAD_AS_STORED, &w), FL_OK);
        ASSERT_MSG_HAS(bad[i].msg);
        fl_ckpt_free(ck);
        fx_rmtree(dir);
    }
    /* F8 weights in a checkpoint that does not say how they are scaled */
    dir = hand_folder(NULL, "weight_scale_inv", "[2, 2]", -1, 0, NULL, NULL);
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", HO, HI, FL_LOAD_AS_STORED, &w), FL_ERR_FORMAT);
    ASSERT_MSG_HAS("is F8_E4M3 but config.json has no FP8 quantization_config");
    int64_t shape[2] = {HO, HI};
    ASSERT_STATUS(fl_ckpt_load_tensor(ck, "l.weight", 2, shape, &w), FL_ERR_UNSUPPORTED);
    ASSERT_MSG_HAS("FP8 is supported for linear weights only");
    fl_ckpt_free(ck);
    fx_rmtree(dir);
}

/* quantization_config fields flotilla does not read are refused, named. */
static void test_fp8_config_refused(void **state) {
    (void)state;
    static const struct { const char *qcfg, *msg; } bad[] = {
        {"{\"quant_method\": \"fp8\", \"scale_fmt\": \"ue8m0\"}", "scale_fmt ue8m0 is not supported"},
        {"{\"quant_method\": \"fp8\", \"expert_dtype\": \"fp4\"}", "expert_dtype fp4 is not supported"},
        {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128]}",
         "\"quantization_config.weight_block_size\" must be [rows, cols]"},
        {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 0]}",
         "weight_block_size\"[1] must be a positive integer"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", \"config_groups\": {\"g\": "
         "{\"weights\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"group\", \"group_size\": 128}}}}",
         "strategy group is not supported for FP8 (supported: tensor, channel, block)"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"naive-quantized\", \"config_groups\": {\"g\": "
         "{\"weights\": {\"num_bits\": 8, \"type\": \"int\", \"strategy\": \"channel\"}}}}",
         "only static 8-bit float weights are supported in this format (num_bits 8, type int)"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", \"config_groups\": {\"g\": "
         "{\"weights\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"block\"}}}}",
         "block_structure\" must be [rows, cols]"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *dir = hand_folder(bad[i].qcfg, "weight_scale_inv", "[2, 2]", -1, 0, NULL, NULL);
        fl_ckpt *ck = NULL;
        assert_int_not_equal(fl_ckpt_open(dir, &ck), FL_OK);
        ASSERT_MSG_HAS(bad[i].msg);
        ASSERT_MSG_HAS("config.json");
        fx_rmtree(dir);
    }
    /* compressed-tensors FP8_BLOCK: block_structure read */
    char *dir = hand_folder("{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", "
                            "\"config_groups\": {\"g\": {\"weights\": {\"num_bits\": 8, \"type\": \"float\", "
                            "\"strategy\": \"block\", \"block_structure\": [128, 128]}, \"input_activations\": "
                            "{\"num_bits\": 8, \"type\": \"float\", \"dynamic\": true, \"strategy\": \"group\", "
                            "\"group_size\": 128}}}}", "weight_scale", "[2, 2]", -1, 0, NULL, NULL);
    fl_ckpt *ck = NULL;
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    fl_model_config cfg;
    ASSERT_STATUS(fl_ckpt_model_config(ck, &cfg), FL_OK);
    assert_int_equal(cfg.quant_fp8, FL_FP8_BLOCK);
    assert_false(cfg.quant_scale_inv);
    fl_tensor w;
    ASSERT_STATUS(fl_ckpt_load_linear(ck, "l", HO, HI, FL_LOAD_AS_STORED, &w), FL_OK);
    fl_tensor_free(&w);
    fl_ckpt_free(ck);
    fx_rmtree(dir);
}

/* Loads `prefix` [out, in] as block s; returns the bytes it read. */
static size_t load_counted(fl_ckpt *ck, const char *prefix, int64_t out, int64_t in, const fl_ckpt_slice *s,
                           fl_tensor *w) {
    const size_t before = fl_ckpt_bytes_read(ck);
    fl_status st = fl_ckpt_load_linear_part(ck, prefix, out, in, s, FL_LOAD_AS_STORED, w);
    if (st != FL_OK) fail_msg("%s: %s", prefix, fl_error_msg());
    return fl_ckpt_bytes_read(ck) - before;
}

/* The two halves of each quantized linear read what the whole one reads,
 * plus `shared` (what every block needs), and equal the whole one's cut. */
static void test_block_reads(void **state) {
    (void)state;
    static const struct {
        const char *dir, *linear;
        int64_t out, in, cut;             /* the column halves split at cut: whole groups */
        int64_t shared_rows, shared_cols; /* bytes both halves read */
    } fx[] = {
        {"llama_awq", "model.layers.1.mlp.down_proj", 96, 160, 64, 0, 0},
        {"llama_ct", "model.layers.0.self_attn.q_proj", 128, 96, 64, 0, 0},
        {"llama_ct_asym", "model.layers.0.mlp.gate_proj", 160, 96, 64, 0, 0},
        /* channel scales (bf16) over a column cut */
        {"llama_ct_channel", "model.layers.0.self_attn.o_proj", 96, 128, 64, 0, 96 * 2},
        /* g_idx I32 [in] for every block; act-order / channel: every group's f16 scales and zero words */
        {"llama_gptq", "model.layers.0.mlp.up_proj", 128, 64, 32, 64 * 4, 64 * 4},
        {"llama_gptq_act", "model.layers.1.mlp.down_proj", 64, 128, 64, 128 * 4, 128 * 4 + 4 * 64 * 2 + 4 * 64 / 2},
        {"llama_gptq_chan", "model.layers.0.self_attn.q_proj", 64, 64, 32, 64 * 4, 64 * 4 + 64 * 2 + 64 / 2},
        /* 2 x 1 tiles of 128: rows split on the tile edge, columns across both tiles */
        {"llama_fp8_block", "model.layers.0.mlp.gate_proj", 256, 128, 64, 0, 2 * 4},
        {"llama_ct_fp8", "model.layers.0.self_attn.q_proj", 128, 96, 48, 0, 128 * 2},
        /* an expert's rows split 20 + 20 inside the third row of 8 x 8 tiles (4 tiles of f32 both
         * read); its columns on a tile edge */
        {"qwen2_moe_fp8_block", "model.layers.0.mlp.experts.5.gate_proj", 40, 32, 16, 4 * 4, 0},
        /* an expert's down_proj split by columns: both halves read its 32 bf16 channel scales */
        {"qwen2_moe_ct_fp8", "model.layers.2.mlp.experts.3.down_proj", 32, 40, 20, 0, 32 * 2},
        {"qwen2_moe_ct_fp8", "model.layers.0.mlp.shared_expert.up_proj", 56, 32, 16, 0, 56 * 2},
    };
    for (size_t f = 0; f < sizeof fx / sizeof fx[0]; f++) {
        char path[512];
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s", fx[f].dir);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(path, &ck), FL_OK);
        const int64_t out = fx[f].out, in = fx[f].in;
        fl_tensor whole;
        const fl_ckpt_slice all = {0, out, 0, in};
        const size_t bw = load_counted(ck, fx[f].linear, out, in, &all, &whole);
        const int64_t cut = fx[f].cut;
        const fl_ckpt_slice halves[2][2] = {{{0, out / 2, 0, in}, {out / 2, out / 2, 0, in}},
                                            {{0, out, 0, cut}, {0, out, cut, in - cut}}};
        for (int k = 0; k < 2; k++) { /* rows (column-parallel), columns (row-parallel) */
            size_t sum = 0;
            for (int h = 0; h < 2; h++) {
                fl_tensor w;
                const size_t b = load_counted(ck, fx[f].linear, out, in, &halves[k][h], &w);
                assert_true(b < bw);
                sum += b;
                /* the block equals the whole weight's, bit for bit */
                float *a = malloc((size_t)in * sizeof(float)), *c = malloc((size_t)in * sizeof(float));
                for (int64_t r = 0; r < w.shape[0]; r++) {
                    fl_tensor_row_f32(&w, r, a);
                    fl_tensor_row_f32(&whole, halves[k][h].row_lo + r, c);
                    assert_memory_equal(a, c + halves[k][h].col_lo, (size_t)w.shape[1] * sizeof(float));
                }
                free(a);
                free(c);
                fl_tensor_free(&w);
            }
            const size_t shared = (size_t)(k ? fx[f].shared_cols : fx[f].shared_rows);
            if (sum != bw + shared)
                fail_msg("%s %s: the %s halves read %zu bytes, the whole %zu + shared %zu", fx[f].dir,
                         fx[f].linear, k ? "column" : "row", sum, bw, shared);
        }
        /* rows that start inside a word of 8 (compressed-tensors repacks its
         * zero points from there; the others read the whole tensor) */
        const fl_ckpt_slice odd = {5, out / 2 - 5, 0, in};
        fl_tensor w;
        load_counted(ck, fx[f].linear, out, in, &odd, &w);
        float *a = malloc((size_t)in * sizeof(float)), *c = malloc((size_t)in * sizeof(float));
        for (int64_t r = 0; r < w.shape[0]; r++) {
            fl_tensor_row_f32(&w, r, a);
            fl_tensor_row_f32(&whole, odd.row_lo + r, c);
            assert_memory_equal(a, c, (size_t)in * sizeof(float));
        }
        free(a);
        free(c);
        fl_tensor_free(&w);
        fl_tensor_free(&whole);
        fl_ckpt_free(ck);
    }
}

/* Bytes a model load reads as shard sh. */
static size_t shard_reads(const char *dir, fl_shard sh) {
    fl_ckpt *ck = NULL;
    ASSERT_STATUS(fl_ckpt_open(dir, &ck), FL_OK);
    fl_backend *be = NULL;
    ASSERT_STATUS(fl_backend_cpu_init(&be), FL_OK);
    fl_model_load_opts lo = {.shard = sh};
    fl_model *m = NULL;
    if (fl_model_load(ck, be, &lo, &m) != FL_OK)
        fail_msg("%s tp %d/%d ep %d/%d ex %d/%d: %s", dir, sh.tp_rank, sh.tp_size, sh.ep_rank, sh.ep_size,
                 sh.ex_rank, sh.ex_size, fl_error_msg());
    const size_t n = fl_ckpt_bytes_read(ck);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
    return n;
}

/* Bytes a model load reads as (tp_rank, tp_size). */
static size_t model_reads(const char *dir, int rank, int size) {
    return shard_reads(dir, (fl_shard){.tp_rank = rank, .tp_size = size, .ep_size = 1, .ex_size = 1});
}

/* The FP8 MoE fixtures on two ranks. ep 2 (tp 1, dp 2): each rank reads
 * exactly what one rank alone reads less the other rank's experts (weights
 * and scales). tp 2 with ep 1 (every expert's columns split, ex 2) and with
 * ep 2 (whole experts, ex 1): together the ranks read the one-rank bytes
 * plus, once more, what every rank keeps whole (embeddings, norms, routers,
 * the shared expert's gate) and at most the scales on both sides of a cut;
 * each rank well under what one rank reads alone. */
static void test_moe_shard_reads(void **state) {
    (void)state;
    static const char *const dirs[] = {"qwen2_moe_ct_fp8", "qwen2_moe_fp8_block"};
    enum { N_EXPERTS = 8 };
    for (size_t f = 0; f < sizeof dirs / sizeof dirs[0]; f++) {
        char path[512];
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s", dirs[f]);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(path, &ck), FL_OK);
        size_t half[2] = {0, 0}, whole = 0, scales = 0;
        for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
            const fl_ckpt_tensor *t = fl_ckpt_at(ck, i);
            const char *e = strstr(t->name, ".experts.");
            if (e) half[atoi(e + 9) >= N_EXPERTS / 2] += t->nbytes;
            if (strstr(t->name, "embed_tokens") || strstr(t->name, "norm.") || strstr(t->name, "mlp.gate.") ||
                strstr(t->name, "shared_expert_gate."))
                whole += t->nbytes;
            if (strstr(t->name, ".weight_scale")) scales += t->nbytes;
        }
        fl_ckpt_free(ck);
        assert_true(half[0] > 0 && half[1] > 0);
        const size_t one = model_reads(path, 0, 1);
        for (int r = 0; r < 2; r++) { /* ep 2: its own experts, all else whole */
            const size_t got = shard_reads(path, (fl_shard){.tp_size = 1, .ep_rank = r, .ep_size = 2, .ex_size = 1});
            if (got != one - half[1 - r])
                fail_msg("%s ep rank %d of 2 read %zu bytes, want %zu - %zu", dirs[f], r, got, one, half[1 - r]);
        }
        for (int ep = 1; ep <= 2; ep++) {
            size_t r[2];
            for (int k = 0; k < 2; k++)
                r[k] = shard_reads(path, (fl_shard){.tp_rank = k, .tp_size = 2, .ep_rank = ep == 2 ? k : 0,
                                                    .ep_size = ep, .ex_rank = ep == 2 ? 0 : k, .ex_size = 3 - ep});
            printf("  %-20s tp 1 reads %zu bytes; tp 2 ep %d: %zu + %zu (whole %zu, scales %zu)\n", dirs[f], one,
                   ep, r[0], r[1], whole, scales);
            assert_true(r[0] + r[1] >= one + whole);
            assert_true(r[0] + r[1] <= one + whole + scales);
            assert_true(r[0] < one * 6 / 10 + whole && r[1] < one * 6 / 10 + whole);
        }
    }
}

/* A model at tp 2: the ranks together read the tp 1 bytes plus, once more,
 * the tensors every rank keeps whole (embeddings, norms, GPTQ g_idx) and
 * at most the scales (and zero points) both sides of a cut need: FP8 tiles
 * and channels, act-order GPTQ groups; each rank reads well under what one
 * rank reads alone. */
static void test_tp2_reads(void **state) {
    (void)state;
    static const char *const dirs[] = {"llama_gptq", "llama_gptq_act", "llama_gptq_chan", "llama_ct_channel",
                                       "llama_fp8_block", "llama_ct_fp8"};
    for (size_t f = 0; f < sizeof dirs / sizeof dirs[0]; f++) {
        char path[512];
        snprintf(path, sizeof path, FL_TEST_DATA "/golden/%s", dirs[f]);
        fl_ckpt *ck = NULL;
        ASSERT_STATUS(fl_ckpt_open(path, &ck), FL_OK);
        size_t whole = 0, scales = 0;
        for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
            const fl_ckpt_tensor *t = fl_ckpt_at(ck, i);
            if (strstr(t->name, "embed_tokens") || strstr(t->name, "norm.") || strstr(t->name, ".g_idx"))
                whole += t->nbytes;
            if (strstr(t->name, ".weight_scale") || strstr(t->name, ".scales") || strstr(t->name, ".qzeros"))
                scales += t->nbytes;
        }
        fl_ckpt_free(ck);
        const size_t one = model_reads(path, 0, 1), r0 = model_reads(path, 0, 2), r1 = model_reads(path, 1, 2);
        printf("  %-18s tp 1 reads %zu bytes; tp 2: %zu + %zu (shared %zu, scales %zu)\n", dirs[f], one, r0, r1,
               whole, scales);
        assert_true(r0 + r1 >= one + whole);
        assert_true(r0 + r1 <= one + whole + scales); /* an FP8 scale under a cut is read by both */
        assert_true(r0 < one * 6 / 10 + whole && r1 < one * 6 / 10 + whole);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_all_codes), cmocka_unit_test(test_fp8_fixtures),
        cmocka_unit_test(test_fp8_hand_tiles),   cmocka_unit_test(test_fp8_config_refused),
        cmocka_unit_test(test_block_reads),      cmocka_unit_test(test_tp2_reads),
        cmocka_unit_test(test_moe_shard_reads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
