/*
 * test_awq_calib.c — the AWQ calibrator's math (launcher/awq_calib.c):
 * AutoAWQ's group quantization on hand-checked values, the GEMM packing read
 * back by flotilla's AutoAWQ loader (fl_quant_awq_to_w4) to the same values,
 * the compressed-tensors packing read back by its loader (f32, f16 and bf16
 * scales; an output count that leaves a zero-point word part empty),
 * the scale search (a planted large-activation channel gets the largest
 * scale and a lower error than plain quantization; equal channels keep
 * s = 1), the clipping search (never a larger error, never a wider range)
 * and the matmul against a plain loop, on awkward shapes; the matmuls and
 * the scale search through a backend (the CPU's) give the host path's bits.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "launcher/awq_calib.h"
#include "runtime/load/quant.h"

static uint64_t rng_state = 88172645463325252ull;
static float frand(void) { /* uniform in [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static void quant_group_by_hand(void **state) {
    (void)state;
    float v[4] = {-1.0f, 0.0f, 0.5f, 2.0f};
    uint8_t codes[4], z;
    float s;
    fl_awq_quant_group(v, 4, FL_DTYPE_F32, 1, codes, &s, &z);
    /* s = 3 / 15, z = -round(-1 / 0.2) = 5; 0.5 / 0.2 = 2.5 rounds to even 2 */
    assert_float_equal(s, 0.2f, 1e-7);
    assert_int_equal(z, 5);
    const uint8_t want[4] = {0, 5, 7, 15};
    assert_memory_equal(codes, want, 4);
    assert_float_equal(v[0], -1.0f, 1e-6);
    assert_float_equal(v[2], 0.4f, 1e-6);
    assert_float_equal(v[3], 2.0f, 1e-6);
    float c[3] = {0.0f, 0.0f, 0.0f}; /* an all-zero group (padding): scale floor 1e-5 / 15, zeros kept */
    fl_awq_quant_group(c, 3, FL_DTYPE_F32, 1, NULL, &s, &z);
    assert_float_equal(s, 1e-5f / 15.0f, 1e-12);
    assert_int_equal(z, 0);
    assert_float_equal(c[1], 0.0f, 0);
}

static void pack_reads_back(void **state) {
    (void)state;
    const int64_t out = 24, in = 96;
    const int group = 32, ng = (int)(in / group);
    float *w = malloc((size_t)(out * in) * sizeof *w);
    uint32_t *qw = malloc((size_t)(in * out / 8) * 4), *qz = malloc((size_t)(ng * out / 8) * 4);
    uint16_t *sc = malloc((size_t)(ng * out) * 2);
    assert_non_null(w);
    assert_non_null(qw);
    assert_non_null(qz);
    assert_non_null(sc);
    for (int64_t i = 0; i < out * in; i++) w[i] = frand() * (1.0f + (float)(i % 7)) + 0.3f;
    assert_int_equal(fl_awq_pack_gemm(w, out, in, group, qw, qz, sc), FL_OK);
    fl_tensor t;
    assert_int_equal(fl_quant_awq_to_w4("test", qw, qz, sc, FL_DTYPE_F16, out, in, group, &t), FL_OK);
    float row[96], ref[32];
    for (int64_t o = 0; o < out; o++) {
        fl_tensor_row_f32(&t, o, row);
        for (int g = 0; g < ng; g++) {
            memcpy(ref, w + o * in + g * group, sizeof ref);
            fl_awq_quant_group(ref, group, FL_DTYPE_F16, 1, NULL, NULL, NULL);
            for (int c = 0; c < group; c++) assert_float_equal(row[g * group + c], ref[c], 1e-5f * 8.0f);
        }
    }
    fl_tensor_free(&t);
    free(w);
    free(qw);
    free(qz);
    free(sc);
}

/* compressed-tensors packing, read back by flotilla's compressed-tensors
 * loader, for each scale rounding and storage: 21 outputs leave the last
 * zero-point word part empty (its unused nibbles must stay 0). */
static void pack_ct_reads_back(void **state) {
    (void)state;
    const int64_t out = 21, in = 96, words = (out + 7) / 8;
    const int group = 32, ng = (int)(in / group);
    const fl_dtype rounds[3] = {FL_DTYPE_F16, FL_DTYPE_F16, FL_DTYPE_BF16};
    const fl_dtype stores[3] = {FL_DTYPE_F32, FL_DTYPE_F16, FL_DTYPE_BF16};
    float *w = malloc((size_t)(out * in) * sizeof *w), row[96], ref[32];
    uint32_t *pk = malloc((size_t)(out * in / 8) * 4), *zp = malloc((size_t)(words * ng) * 4);
    float *sc = malloc((size_t)(out * ng) * 4);
    assert_non_null(w);
    assert_non_null(pk);
    assert_non_null(zp);
    assert_non_null(sc);
    /* not frand(): the later tests' inputs stay those they were written for */
    for (int64_t i = 0; i < out * in; i++) w[i] = sinf(0.37f * (float)i) * (1.0f + (float)(i % 5)) - 0.2f;
    for (int v = 0; v < 3; v++) {
        assert_int_equal(fl_awq_pack_ct(w, out, in, group, rounds[v], stores[v], pk, zp, sc), FL_OK);
        for (int g = 0; g < ng; g++) assert_int_equal(zp[(words - 1) * ng + g] >> (4 * (out % 8)), 0);
        fl_tensor t;
        assert_int_equal(fl_quant_ct_pack_to_w4("test", pk, zp, sc, stores[v], out, in, group, &t), FL_OK);
        for (int64_t o = 0; o < out; o++) {
            fl_tensor_row_f32(&t, o, row);
            for (int g = 0; g < ng; g++) {
                memcpy(ref, w + o * in + g * group, sizeof ref);
                fl_awq_quant_group(ref, group, rounds[v], 1, NULL, NULL, NULL);
                for (int c = 0; c < group; c++) assert_float_equal(row[g * group + c], ref[c], 1e-5f * 8.0f);
            }
        }
        fl_tensor_free(&t);
    }
    free(w);
    free(pk);
    free(zp);
    free(sc);
}

static void matmul_matches_loop(void **state) {
    (void)state;
    const int64_t n = 111, out = 19, in = 37;
    float *x = malloc((size_t)(n * in) * 4), *w = malloc((size_t)(out * in) * 4), *y = malloc((size_t)(n * out) * 4);
    float b[19];
    assert_non_null(x);
    assert_non_null(w);
    assert_non_null(y);
    for (int64_t i = 0; i < n * in; i++) x[i] = frand();
    for (int64_t i = 0; i < out * in; i++) w[i] = frand();
    for (int i = 0; i < 19; i++) b[i] = frand();
    assert_int_equal(fl_awq_matmul(x, n, w, out, in, b, y), FL_OK);
    for (int64_t t = 0; t < n; t++)
        for (int64_t o = 0; o < out; o++) {
            double s = b[o];
            for (int64_t c = 0; c < in; c++) s += (double)x[t * in + c] * w[o * in + c];
            assert_float_equal(y[t * out + o], s, 1e-4);
        }
    free(x);
    free(w);
    free(y);
}

/* x [n, in] with unit |x| everywhere except channel `big` (x 40), w [out, in]
 * with that column 40 times smaller, so the float product is balanced. */
static void planted(float *x, float *w, int64_t n, int64_t in, int64_t out, int big, float k) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < in; c++) x[t * in + c] = (frand() < 0 ? -1.0f : 1.0f) * (c == big ? k : 1.0f);
    for (int64_t o = 0; o < out; o++)
        for (int64_t c = 0; c < in; c++) w[o * in + c] = frand() / (c == big ? k : 1.0f);
}

static void scale_search(void **state) {
    (void)state;
    const int64_t n = 200, in = 64, out = 40;
    float *x = malloc((size_t)(n * in) * 4), *w = malloc((size_t)(out * in) * 4), s[64];
    assert_non_null(x);
    assert_non_null(w);
    planted(x, w, n, in, out, 3, 40.0f);
    const fl_awq_linear lin[2] = {{w, 24}, {w + 24 * in, 16}};
    fl_awq_search r;
    assert_int_equal(fl_awq_search_scale(NULL, x, n, NULL, in, lin, 2, 32, 20, s, &r), FL_OK);
    assert_true(r.alpha > 0.0f && r.alpha < 1.0f);
    assert_true(r.err < 0.9 * r.err_plain);
    for (int c = 0; c < in; c++)
        if (c != 3) assert_true(s[3] > s[c]);
    /* every channel alike: the scales are all 1 whatever alpha, so alpha 0 stays */
    planted(x, w, n, in, out, -1, 1.0f);
    assert_int_equal(fl_awq_search_scale(NULL, x, n, NULL, in, lin, 2, 32, 20, s, &r), FL_OK);
    assert_float_equal(r.alpha, 0.0f, 0);
    assert_float_equal(r.err, r.err_plain, 0);
    for (int c = 0; c < in; c++) assert_float_equal(s[c], 1.0f, 1e-6);
    free(x);
    free(w);
}

/* The matmuls on a backend (here the CPU's; CUDA in test_cuda_calib.c):
 * blocks of 5, 64, 0 and 130 tokens with and without a bias, and the scale
 * search, equal to the host path bit for bit. */
static void backend_matches_host(void **state) {
    (void)state;
    const int64_t in = 96, out = 37;
    const int len[4] = {5, 64, 0, 130};
    const int64_t n = 5 + 64 + 130;
    float *x = malloc((size_t)(n * in) * 4), *w = malloc((size_t)(out * in) * 4), bias[37];
    float *y0 = malloc((size_t)(n * out) * 4), *y1 = malloc((size_t)(n * out) * 4);
    assert_non_null(x);
    assert_non_null(w);
    assert_non_null(y0);
    assert_non_null(y1);
    for (int64_t i = 0; i < n * in; i++) x[i] = frand();
    for (int64_t i = 0; i < out * in; i++) w[i] = frand();
    for (int i = 0; i < out; i++) bias[i] = frand();
    fl_backend *be = NULL;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        const float *b = with_bias ? bias : NULL;
        assert_int_equal(fl_awq_matmul_blocks(NULL, x, len, 4, w, out, in, b, y0), FL_OK);
        memset(y1, 0xff, (size_t)(n * out) * 4);
        assert_int_equal(fl_awq_matmul_blocks(be, x, len, 4, w, out, in, b, y1), FL_OK);
        assert_memory_equal(y0, y1, (size_t)(n * out) * 4);
    }
    float s0[64], s1[64], *xp = malloc((size_t)(200 * 64) * 4), *wp = malloc((size_t)(40 * 64) * 4);
    assert_non_null(xp);
    assert_non_null(wp);
    planted(xp, wp, 200, 64, 40, 3, 40.0f);
    const fl_awq_linear lin[2] = {{wp, 24}, {wp + 24 * 64, 16}};
    fl_awq_search r0, r1;
    assert_int_equal(fl_awq_search_scale(NULL, xp, 200, NULL, 64, lin, 2, 32, 20, s0, &r0), FL_OK);
    assert_int_equal(fl_awq_search_scale(be, xp, 200, NULL, 64, lin, 2, 32, 20, s1, &r1), FL_OK);
    assert_memory_equal(s0, s1, sizeof s0);
    assert_true(r0.alpha == r1.alpha && r0.err == r1.err && r0.err_plain == r1.err_plain);
    fl_backend_free(be);
    free(x);
    free(w);
    free(y0);
    free(y1);
    free(xp);
    free(wp);
}

/* Output MSE of fake-quantized w against the float weights w0. */
static double quant_err(const float *x, int64_t n, int64_t in, const float *w, const float *w0, int64_t out) {
    float *q = malloc((size_t)(out * in) * 4);
    double e = 0;
    assert_non_null(q);
    memcpy(q, w, (size_t)(out * in) * 4);
    fl_awq_fake_quant(q, out, in, 32);
    for (int64_t t = 0; t < n; t++)
        for (int64_t o = 0; o < out; o++) {
            double d = 0;
            for (int64_t c = 0; c < in; c++) d += (double)x[t * in + c] * (q[o * in + c] - w0[o * in + c]);
            e += d * d;
        }
    free(q);
    return e;
}

static void clip_search(void **state) {
    (void)state;
    const int64_t n = 300, in = 64, out = 8;
    float *x = malloc((size_t)(n * in) * 4), *w = malloc((size_t)(out * in) * 4), *w0 = malloc((size_t)(out * in) * 4);
    assert_non_null(x);
    assert_non_null(w);
    assert_non_null(w0);
    for (int64_t i = 0; i < n * in; i++) x[i] = frand();
    for (int64_t i = 0; i < out * in; i++) w[i] = frand() * 0.1f;
    w[5] = 3.0f; /* an outlier the range would be spent on; the clipping search trades it */
    w[3 * in + 40] = -2.5f;
    memcpy(w0, w, (size_t)(out * in) * 4);
    assert_int_equal(fl_awq_search_clip(x, n, NULL, in, w, out, 32, 20, 0.5f, 128), FL_OK);
    int changed = 0;
    for (int64_t i = 0; i < out * in; i++) {
        assert_true(fabsf(w[i]) <= fabsf(w0[i]) && w[i] * w0[i] >= 0);
        changed += w[i] != w0[i];
    }
    assert_true(quant_err(x, n, in, w, w0, out) <= quant_err(x, n, in, w0, w0, out));
    (void)changed;
    free(x);
    free(w);
    free(w0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(quant_group_by_hand), cmocka_unit_test(pack_reads_back), cmocka_unit_test(pack_ct_reads_back),
        cmocka_unit_test(matmul_matches_loop), cmocka_unit_test(scale_search),
        cmocka_unit_test(clip_search), cmocka_unit_test(backend_matches_host),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
