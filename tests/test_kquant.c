/*
 * test_kquant.c — the GGUF super-block dequantizers (core/gguf_kquant.c)
 * against gguf-py's reference dequantization, bit for bit.
 *
 * tests/gguf/kquant/<TYPE>.blocks holds random blocks with edge-case scales
 * (zero, -0, negative, f16 subnormals, 65504) and <TYPE>.f32 what
 * gguf.quants.dequantize makes of them (tests/gguf/make_kquant_fixtures.py).
 * Every value must have the same f32 bits, decoded both as one run of blocks
 * and row by row through fl_tensor_row_f32.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/gguf_kquant.h"
#include "core/tensor.h"

static uint8_t *slurp(const char *name, const char *ext, size_t *n) {
    char path[512];
    snprintf(path, sizeof path, "%s/gguf/kquant/%s.%s", FL_TEST_DATA, name, ext);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open fixture %s", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)len);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return buf;
}

static void assert_bits_equal(const float *got, const float *want, int64_t n, const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], 4) != 0)
            fail_msg("%s: element %lld = %.9g, reference %.9g", what, (long long)i, (double)got[i], (double)want[i]);
}

static void check_type(fl_dtype dt) {
    const char *name = fl_dtype_name(dt);
    int64_t be;
    size_t bb, nblk, nref;
    assert_true(fl_kquant_block(dt, &be, &bb));
    uint8_t *blocks = slurp(name, "blocks", &nblk);
    float *ref = (float *)slurp(name, "f32", &nref);
    assert_int_equal(nblk % bb, 0);
    const int64_t nb = (int64_t)(nblk / bb), n = nb * be;
    assert_true(nb >= 2 && nb % 2 == 0);
    assert_int_equal(nref, (size_t)n * 4);
    assert_int_equal(fl_dtype_row_bytes(dt, be), bb);

    float *got = calloc((size_t)n, sizeof *got);
    assert_non_null(got);
    fl_kquant_row_f32(dt, blocks, n, got);
    assert_bits_equal(got, ref, n, name);

    /* the same blocks as a [2, n/2] tensor, decoded row by row */
    memset(got, 0, (size_t)n * sizeof *got);
    fl_tensor t = {.dtype = dt, .ndim = 2, .shape = {2, n / 2}, .data = blocks};
    fl_tensor_row_f32(&t, 0, got);
    fl_tensor_row_f32(&t, 1, got + n / 2);
    assert_bits_equal(got, ref, n, name);
    free(got);
    free(ref);
    free(blocks);
}

static void test_q2_k(void **s) { (void)s; check_type(FL_DTYPE_Q2_K); }
static void test_q3_k(void **s) { (void)s; check_type(FL_DTYPE_Q3_K); }
static void test_q4_k(void **s) { (void)s; check_type(FL_DTYPE_Q4_K); }
static void test_q5_k(void **s) { (void)s; check_type(FL_DTYPE_Q5_K); }
static void test_q6_k(void **s) { (void)s; check_type(FL_DTYPE_Q6_K); }
static void test_q8_k(void **s) { (void)s; check_type(FL_DTYPE_Q8_K); }
static void test_iq4_nl(void **s) { (void)s; check_type(FL_DTYPE_IQ4_NL); }
static void test_iq4_xs(void **s) { (void)s; check_type(FL_DTYPE_IQ4_XS); }

/* One hand-built Q4_K block pins the scale packing: sub-block 5 takes its
 * low 4 bits from byte 9 and its high 2 bits from the top of byte 1. */
static void test_q4_k_scale_packing(void **s) {
    (void)s;
    uint8_t sc[12] = {0};
    sc[1] = 0x80 | 0x05; /* sub-block 1 scale 5; top bits 10 -> sub-block 5 scale high bits */
    sc[5] = 0x40 | 0x07; /* sub-block 1 min 7; top bits 01 -> sub-block 5 min high bits */
    sc[9] = 0x3c;        /* sub-block 5: scale low 0xc, min low 0x3 */
    uint8_t v, m;
    fl_kquant_scale_min_k4(sc, 1, &v, &m);
    assert_int_equal(v, 5);
    assert_int_equal(m, 7);
    fl_kquant_scale_min_k4(sc, 5, &v, &m);
    assert_int_equal(v, 0x2c);
    assert_int_equal(m, 0x13);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_q2_k),    cmocka_unit_test(test_q3_k),   cmocka_unit_test(test_q4_k),
        cmocka_unit_test(test_q5_k),    cmocka_unit_test(test_q6_k),   cmocka_unit_test(test_q8_k),
        cmocka_unit_test(test_iq4_nl),  cmocka_unit_test(test_iq4_xs), cmocka_unit_test(test_q4_k_scale_packing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
