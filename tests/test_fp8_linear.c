/*
 * test_fp8_linear.c — FP8 linears (--quantize fp8) on the host: the
 * weights' quantization (runtime/load/quant.h, fl_quant_to_fp8) and the CPU
 * backend's W8A8 matmul against this file's own float64 reading of the
 * contract in kernels/backend.h (tokens quantized to e4m3 with absmax / 448,
 * products of codes, both scales applied after the sum). The CUDA matmul is
 * held to the CPU one by test_cuda_ops; whole models to transformers by
 * test_golden (llama, fp8_logits.f64).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "runtime/load/quant.h"

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static float urand(void) { /* uniform in [-1, 1) */
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rng >> 40) * (1.0 / 16777216.0)) * 2 - 1;
}

/* Rows of a [rows, cols] F32 weight: row 0 all zero, row 1 one large value,
 * the rest random with a row-dependent magnitude (subnormal codes included). */
static float *weights(int rows, int cols) {
    float *w = malloc(sizeof(float) * (size_t)rows * cols);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            w[r * cols + c] = r == 0 ? 0.0f : r == 1 ? (c == 3 ? -7.5f : 0.01f * urand()) : urand() * (float)r * 0.1f;
    return w;
}

static void test_quantize_rows(void **state) {
    (void)state;
    const int rows = 9, cols = 80;
    float *w = weights(rows, cols);
    const fl_tensor src = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {rows, cols}, .data = w};
    fl_tensor q;
    assert_int_equal(fl_quant_to_fp8("t", &src, NULL, &q), FL_OK);
    assert_int_equal(q.dtype, FL_DTYPE_F8_E4M3);
    assert_true(q.shape[0] == rows && q.shape[1] == cols && q.scales && !q.bias && q.owned);
    /* an all-zero row: scale 1, codes 0 */
    assert_true(q.scales[0] == 1.0f);
    for (int c = 0; c < cols; c++) assert_int_equal(((uint8_t *)q.data)[c], 0);
    /* the row's largest magnitude is code +-448 (0x7e, 0xfe) */
    assert_true(q.scales[1] == 7.5f / 448.0f);
    assert_int_equal(((uint8_t *)q.data)[cols + 3], 0xfe);
    float *row = malloc(sizeof(float) * cols);
    for (int r = 1; r < rows; r++) {
        fl_tensor_row_f32(&q, r, row);
        for (int c = 0; c < cols; c++) {
            /* e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value for
             * normals (from 2^-6 x scale), 2^-10 x scale below */
            const double x = w[r * cols + c], e = fabs(row[c] - x);
            const double bound = fabs(x) >= ldexp(q.scales[r], -6) ? ldexp(fabs(x), -4) : ldexp(q.scales[r], -10);
            if (e > bound * (1 + 1e-6)) fail_msg("row %d col %d: %g -> %g (bound %g)", r, c, x, row[c], bound);
        }
    }
    free(row);
    fl_tensor_free(&q);
    /* a weight that is not finite is named */
    w[2 * cols + 5] = NAN;
    assert_int_equal(fl_quant_to_fp8("model.layers.0.mlp.up_proj", &src, NULL, &q), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "model.layers.0.mlp.up_proj"));
    assert_non_null(strstr(fl_error_msg(), "[2, 5]"));
    assert_null(q.data);
    fl_error_clear();
    free(w);
}

/* A column block quantized with its whole rows' maxima (tensor
 * parallelism's row-parallel linears) has the whole weight's codes and
 * scales; fl_quant_row_absmax gives those maxima. */
static void test_column_block(void **state) {
    (void)state;
    const int rows = 9, cols = 80, lo = 32, nc = 32;
    float *w = weights(rows, cols), *blk = malloc(sizeof(float) * rows * nc), mx[9];
    for (int r = 0; r < rows; r++) memcpy(blk + r * nc, w + r * cols + lo, sizeof(float) * nc);
    const fl_tensor whole = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {rows, cols}, .data = w};
    const fl_tensor part = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {rows, nc}, .data = blk};
    fl_tensor qw, qb, own;
    assert_int_equal(fl_quant_row_absmax("w", &whole, mx), FL_OK);
    assert_int_equal(fl_quant_to_fp8("w", &whole, NULL, &qw), FL_OK);
    assert_int_equal(fl_quant_to_fp8("w", &part, mx, &qb), FL_OK);
    assert_int_equal(fl_quant_to_fp8("w", &part, NULL, &own), FL_OK);
    bool differs = false;
    for (int r = 0; r < rows; r++) {
        assert_true(qb.scales[r] == qw.scales[r]);
        assert_memory_equal((uint8_t *)qb.data + r * nc, (uint8_t *)qw.data + r * cols + lo, nc);
        differs = differs || own.scales[r] != qw.scales[r];
    }
    assert_true(differs); /* the block's own maxima would have scaled it otherwise */
    fl_tensor_free(&qw), fl_tensor_free(&qb), fl_tensor_free(&own);
    free(w), free(blk);
}

/* The contract in float64: e4m3 codes of x * (1 / sx) (f32 ops, as both
 * backends compute them), exact products, scales after the sum. */
static void reference(const float *x, int n, const fl_tensor *w, const float *bias, double *y) {
    const int out = (int)w->shape[0], in = (int)w->shape[1];
    for (int i = 0; i < n; i++) {
        float mx = 0.0f;
        for (int c = 0; c < in; c++) mx = fmaxf(mx, fabsf(x[i * in + c]));
        const float sx = mx > 0.0f ? fmaxf(mx / 448.0f, FLT_MIN) : 1.0f, inv = 1.0f / sx;
        for (int r = 0; r < out; r++) {
            double acc = 0;
            for (int c = 0; c < in; c++)
                acc += (double)fl_f8e4m3_to_f32(fl_f32_to_f8e4m3(x[i * in + c] * inv)) *
                       fl_f8e4m3_to_f32(((const uint8_t *)w->data)[(size_t)r * in + c]);
            y[i * out + r] = acc * sx * w->scales[r] + (bias ? bias[r] : 0.0);
        }
    }
}

static void test_cpu_matmul(void **state) {
    (void)state;
    const int out = 40, in = 96, n = 6;
    float *wf = weights(out, in);
    const fl_tensor src = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {out, in}, .data = wf};
    fl_tensor w;
    assert_int_equal(fl_quant_to_fp8("w", &src, NULL, &w), FL_OK);
    float *x = malloc(sizeof(float) * n * in), *b = malloc(sizeof(float) * out);
    for (int i = 0; i < n * in; i++) x[i] = urand() * (i % 7 == 0 ? 30.0f : 1.0f);
    for (int c = 0; c < in; c++) x[2 * in + c] = 0.0f; /* an all-zero token: scale 1, output the bias */
    for (int c = 0; c < in; c++) x[4 * in + c] = 1e-40f * urand(); /* subnormal: the scale stops at FLT_MIN */
    for (int r = 0; r < out; r++) b[r] = urand();
    const fl_tensor bias = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {out}, .data = b};
    float *y = malloc(sizeof(float) * n * out);
    double *ref = malloc(sizeof(double) * n * out);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        assert_int_equal(fl_cpu_matmul(NULL, x, n, &w, with_bias ? &bias : NULL, y), FL_OK);
        reference(x, n, &w, with_bias ? b : NULL, ref);
        for (int i = 0; i < n; i++) {
            double scale = 1e-30;
            for (int r = 0; r < out; r++) scale = fmax(scale, fabs(ref[i * out + r]));
            for (int r = 0; r < out; r++) {
                if (!isfinite(y[i * out + r])) fail_msg("token %d row %d: %g", i, r, y[i * out + r]);
                const double e = fabs(y[i * out + r] - ref[i * out + r]) / scale;
                if (e > 1e-6) fail_msg("token %d row %d: %g vs %g (%.2e)", i, r, y[i * out + r], ref[i * out + r], e);
            }
        }
    }
    /* FP8 codes without their scales are a file kind: refused */
    fl_tensor bare = w;
    bare.scales = NULL;
    assert_int_equal(fl_cpu_matmul(NULL, x, n, &bare, NULL, y), FL_ERR_UNSUPPORTED);
    fl_error_clear();
    fl_tensor_free(&w);
    free(wf), free(x), free(b), free(y), free(ref);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantize_rows),
        cmocka_unit_test(test_column_block),
        cmocka_unit_test(test_cpu_matmul),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
