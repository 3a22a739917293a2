/*
 * test_tensor.c — dtype sizes, half-float conversions (exhaustive round
 * trips, rounding ties, cross-checked against the compiler's _Float16) and
 * fl_tensor_row_f32 for every dtype on hand-built data whose values are
 * worked out by hand from the ggml / W4 layouts.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/tensor.h"

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_dtype_sizes(void **state) {
    (void)state;
    assert_string_equal(fl_dtype_name(FL_DTYPE_BF16), "BF16");
    assert_string_equal(fl_dtype_name(FL_DTYPE_Q4_1), "Q4_1");
    assert_string_equal(fl_dtype_name(FL_DTYPE_COUNT), "UNKNOWN");
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_F32, 10), 40);
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_F16, 10), 20);
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_BF16, 10), 20);
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_I32, 3), 12);
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_W4, 64), 32);
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_Q8_0, 64), 68);
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_Q4_0, 64), 36);
    assert_int_equal(fl_dtype_row_bytes(FL_DTYPE_Q4_1, 64), 40);

    fl_tensor t = {.ndim = 3, .shape = {2, 3, 5}};
    assert_int_equal(fl_tensor_numel(&t), 30);
    t.ndim = 0;
    assert_int_equal(fl_tensor_numel(&t), 1);
    fl_tensor_free(NULL);
    fl_tensor o = {.dtype = FL_DTYPE_W4, .ndim = 2, .data = malloc(4), .scales = malloc(4), .bias = malloc(4),
                   .owned = 1};
    fl_tensor_free(&o);
    assert_null(o.data);
    assert_int_equal(o.ndim, 0);
    /* not owned: free only forgets */
    float x = 1;
    fl_tensor a = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {1}, .data = &x, .owned = 0};
    fl_tensor_free(&a);
    assert_null(a.data);
}

static void test_bf16(void **state) {
    (void)state;
    assert_int_equal(fl_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(fl_f32_to_bf16(-2.0f), 0xc000);
    /* ties to even */
    assert_int_equal(fl_f32_to_bf16(from_bits(0x3f808000u)), 0x3f80);
    assert_int_equal(fl_f32_to_bf16(from_bits(0x3f818000u)), 0x3f82);
    assert_int_equal(fl_f32_to_bf16(from_bits(0x3f808001u)), 0x3f81);
    assert_int_equal(fl_f32_to_bf16(from_bits(0x3f807fffu)), 0x3f80);
    /* overflow rounds to inf; NaN stays NaN */
    assert_int_equal(fl_f32_to_bf16(from_bits(0x7f7fffffu)), 0x7f80);
    assert_true(isnan(fl_bf16_to_f32(fl_f32_to_bf16(NAN))));
    assert_true(isnan(fl_bf16_to_f32(fl_f32_to_bf16(from_bits(0x7f800001u))))); /* low-bit NaN */
    /* every bf16 survives the round trip */
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = fl_bf16_to_f32((uint16_t)h);
        assert_int_equal(bits(f), h << 16);
        if (!isnan(f)) assert_int_equal(fl_f32_to_bf16(f), h);
    }
}

static void test_f16(void **state) {
    (void)state;
    assert_int_equal(fl_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(fl_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(fl_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(fl_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(fl_f32_to_f16(65520.0f), 0x7c00); /* tie rounds up to even = inf */
    assert_int_equal(fl_f32_to_f16(1e10f), 0x7c00);
    assert_int_equal(fl_f32_to_f16(-INFINITY), 0xfc00);
    assert_int_equal(fl_f32_to_f16(0x1p-24f), 0x0001);            /* smallest subnormal */
    assert_int_equal(fl_f32_to_f16(0x1p-25f), 0x0000);            /* tie to even: 0 */
    assert_int_equal(fl_f32_to_f16(0x1.8p-25f), 0x0001);
    assert_int_equal(fl_f32_to_f16(0x3p-24f / 2), 0x0002);        /* 1.5 ulp tie -> 2 */
    assert_int_equal(fl_f32_to_f16(0x1.ff8p-15f), 0x03ff);        /* largest subnormal */
    assert_int_equal(fl_f32_to_f16(0x1.ffap-15f), 0x03ff);
    assert_int_equal(fl_f32_to_f16(0x1.ffcp-15f), 0x0400);        /* tie: up into the normals (even) */
    assert_int_equal(fl_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);     /* tie to even */
    assert_int_equal(fl_f32_to_f16(1.0f + 0x3p-11f), 0x3c02);
    assert_int_equal(fl_f32_to_f16(-0.0f), 0x8000);
    assert_true(isnan(fl_f16_to_f32(fl_f32_to_f16(NAN))));
    assert_true(fl_f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(fl_f16_to_f32(0x7c00) == INFINITY);
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = fl_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            assert_true(((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff));
            continue;
        }
        assert_int_equal(fl_f32_to_f16(f), h);
    }
#ifdef __FLT16_MAX__
    /* the compiler's conversion is IEEE round-to-nearest-even */
    srand(7);
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = ((uint32_t)rand() << 16) ^ (uint32_t)rand();
        float f = from_bits(u);
        if (isnan(f)) continue;
        _Float16 ref = (_Float16)f;
        uint16_t rb;
        memcpy(&rb, &ref, 2);
        if (fl_f32_to_f16(f) != rb) fail_msg("f32 %a (0x%08x): got 0x%04x want 0x%04x", f, u, fl_f32_to_f16(f), rb);
        assert_true(fl_f16_to_f32(rb) == (float)ref);
    }
#endif
}

static void test_row_float_kinds(void **state) {
    (void)state;
    float out[3];
    float f32[6] = {1, 2, 3, 4, 5, 6};
    fl_tensor t = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .data = f32};
    fl_tensor_row_f32(&t, 1, out);
    assert_true(out[0] == 4 && out[1] == 5 && out[2] == 6);

    uint16_t h[6] = {0x3c00, 0xc000, 0x3800, 0x0001, 0x7bff, 0x8000}; /* 1 -2 .5 2^-24 65504 -0 */
    t.dtype = FL_DTYPE_F16;
    t.data = h;
    fl_tensor_row_f32(&t, 0, out);
    assert_true(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.5f);
    fl_tensor_row_f32(&t, 1, out);
    assert_true(out[0] == 0x1p-24f && out[1] == 65504.0f && out[2] == 0.0f && signbit(out[2]));

    uint16_t b[6] = {0x3f80, 0xc000, 0x3f00, 0x4049, 0x0000, 0xbf80}; /* 1 -2 .5 3.140625 0 -1 */
    t.dtype = FL_DTYPE_BF16;
    t.data = b;
    fl_tensor_row_f32(&t, 1, out);
    assert_true(out[0] == 3.140625f && out[1] == 0.0f && out[2] == -1.0f);

    int32_t i32[6] = {0, 0, 0, -7, 123456, 2};
    t.dtype = FL_DTYPE_I32;
    t.data = i32;
    fl_tensor_row_f32(&t, 1, out);
    assert_true(out[0] == -7.0f && out[1] == 123456.0f && out[2] == 2.0f);

    /* unaligned data (safetensors data may start at any byte) */
    uint8_t raw[1 + 24];
    memcpy(raw + 1, f32, 24);
    t = (fl_tensor){.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .data = raw + 1};
    fl_tensor_row_f32(&t, 1, out);
    assert_true(out[0] == 4 && out[2] == 6);

    /* 1-D tensors are one row */
    t = (fl_tensor){.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {3}, .data = f32};
    fl_tensor_row_f32(&t, 0, out);
    assert_true(out[0] == 1 && out[2] == 3);
}

/* Every finite code decodes and encodes back to itself; halfway between two
 * neighbours goes to the even mantissa, just off halfway to the nearer;
 * past 448 saturates; NaN stays NaN. */
static void test_f8e4m3_encode(void **state) {
    (void)state;
    for (int c = 0; c < 0x7f; c++) {
        const float v = fl_f8e4m3_to_f32((uint8_t)c);
        assert_int_equal(fl_f32_to_f8e4m3(v), c);
        if (c) assert_int_equal(fl_f32_to_f8e4m3(-v), c | 0x80);
        if (c + 1 < 0x7f) {
            const float w = fl_f8e4m3_to_f32((uint8_t)(c + 1)), mid = (v + w) / 2; /* exact in f32 */
            assert_int_equal(fl_f32_to_f8e4m3(mid), (c & 1) ? c + 1 : c);
            assert_int_equal(fl_f32_to_f8e4m3(nextafterf(mid, 0)), c);
            assert_int_equal(fl_f32_to_f8e4m3(nextafterf(mid, 1e9f)), c + 1);
        }
    }
    assert_int_equal(fl_f32_to_f8e4m3(448.0f), 0x7e);
    assert_int_equal(fl_f32_to_f8e4m3(470.0f), 0x7e);
    assert_int_equal(fl_f32_to_f8e4m3(-1e30f), 0xfe);
    assert_int_equal(fl_f32_to_f8e4m3(INFINITY), 0x7e);
    assert_int_equal(fl_f32_to_f8e4m3(0x1p-11f), 0x00); /* a quarter of the smallest subnormal */
    assert_int_equal(fl_f32_to_f8e4m3(0x1.8p-10f), 0x01); /* above half of it */
    assert_int_equal(fl_f32_to_f8e4m3(NAN) & 0x7f, 0x7f);
}

static void test_row_w4(void **state) {
    (void)state;
    /* [2, 64], group 32: row 1 group 0 scale 0.5 bias -1, group 1 scale 2 bias 3 */
    uint8_t codes[2 * 32];
    for (int i = 0; i < 64; i++) codes[i] = (uint8_t)((i % 16) | ((15 - i % 16) << 4));
    float scales[4] = {1, 1, 0.5f, 2}, bias[4] = {0, 0, -1, 3};
    fl_tensor t = {.dtype = FL_DTYPE_W4, .ndim = 2, .shape = {2, 64}, .data = codes,
                   .scales = scales, .bias = bias, .group = 32};
    float out[64];
    fl_tensor_row_f32(&t, 1, out);
    for (int c = 0; c < 64; c++) {
        uint8_t byte = codes[32 + c / 2];
        int code = (c % 2) ? byte >> 4 : byte & 15; /* element 2j low nibble, 2j+1 high */
        float want = c < 32 ? code * 0.5f - 1 : code * 2.0f + 3;
        assert_true(out[c] == want);
    }
    /* spot values: byte 32 = 0x f0 -> c=0 code 0, c=1 code 15 */
    assert_true(out[0] == -1.0f && out[1] == 6.5f);
}

static void test_row_ggml_blocks(void **state) {
    (void)state;
    float out[64];
    /* Q8_0: two rows of one block each; d = 0.5 (f16 0x3800) */
    uint8_t q8[2][34];
    for (int r = 0; r < 2; r++) {
        uint16_t d = r ? 0x3800 : 0x4000; /* 0.5, 2 */
        memcpy(q8[r], &d, 2);
        for (int j = 0; j < 32; j++) q8[r][2 + j] = (uint8_t)(int8_t)(j - 16 + r);
    }
    fl_tensor t = {.dtype = FL_DTYPE_Q8_0, .ndim = 2, .shape = {2, 32}, .data = q8};
    fl_tensor_row_f32(&t, 1, out);
    for (int j = 0; j < 32; j++) assert_true(out[j] == 0.5f * (float)(j - 15));
    fl_tensor_row_f32(&t, 0, out);
    assert_true(out[0] == -32.0f && out[31] == 30.0f);

    /* Q4_0: one row, two blocks. qs[j] low nibble = element j, high nibble =
     * element j+16; value d * (q - 8). */
    uint8_t q40[2][18];
    for (int b = 0; b < 2; b++) {
        uint16_t d = b ? 0xbc00 : 0x3c00; /* -1, 1 */
        memcpy(q40[b], &d, 2);
        for (int j = 0; j < 16; j++) q40[b][2 + j] = (uint8_t)(j | ((15 - j) << 4));
    }
    t = (fl_tensor){.dtype = FL_DTYPE_Q4_0, .ndim = 2, .shape = {1, 64}, .data = q40};
    fl_tensor_row_f32(&t, 0, out);
    for (int j = 0; j < 16; j++) {
        assert_true(out[j] == (float)(j - 8));
        assert_true(out[j + 16] == (float)(15 - j - 8));
        assert_true(out[32 + j] == -(float)(j - 8));
        assert_true(out[48 + j] == -(float)(15 - j - 8));
    }

    /* Q4_1: d = 0.25, m = -3; value d * q + m */
    uint8_t q41[20];
    uint16_t d = 0x3400, m = 0xc200;
    memcpy(q41, &d, 2);
    memcpy(q41 + 2, &m, 2);
    for (int j = 0; j < 16; j++) q41[4 + j] = (uint8_t)((j / 2) | (j << 4));
    t = (fl_tensor){.dtype = FL_DTYPE_Q4_1, .ndim = 2, .shape = {1, 32}, .data = q41};
    fl_tensor_row_f32(&t, 0, out);
    for (int j = 0; j < 16; j++) {
        assert_true(out[j] == 0.25f * (float)(j / 2) - 3.0f);
        assert_true(out[j + 16] == 0.25f * (float)j - 3.0f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_sizes),     cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_f16),             cmocka_unit_test(test_row_float_kinds),
        cmocka_unit_test(test_f8e4m3_encode),   cmocka_unit_test(test_row_w4),          cmocka_unit_test(test_row_ggml_blocks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
