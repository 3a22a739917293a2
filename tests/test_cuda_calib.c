/*
 * test_cuda_calib.c — `flotilla quantize --backend cuda`: the calibrator's
 * matmuls (launcher/awq_calib.c) on the CUDA backend against the host's f32
 * path, with inputs exact in bf16 so the differences are the GPU's
 * summation and its bf16 outputs (half an ulp: 2^-8 of a value), blocks of
 * odd lengths and a bias (added to the bf16 product and rounded again: two
 * half ulps of the larger of product and sum); and the scale search on the
 * GPU still finds a planted large-activation channel (largest scale, lower
 * error than plain quantization). Skips without a GPU.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "test_gpu.h"
#include "launcher/awq_calib.h"

static void matmul_blocks_on_gpu(void **state) {
    (void)state;
    NEED_GPU();
    const int64_t in = 256, out = 200;
    const int len[4] = {1, 9, 0, 300};
    const int64_t n = 1 + 9 + 300;
    float *x = rand_bf16((size_t)(n * in), 1.0f), *w = rand_bf16((size_t)(out * in), 0.5f);
    float *bias = rand_bf16((size_t)out, 1.0f);
    float *y0 = malloc((size_t)(n * out) * 4), *y1 = malloc((size_t)(n * out) * 4);
    assert_non_null(y0);
    assert_non_null(y1);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        const float *b = with_bias ? bias : NULL;
        OK(fl_awq_matmul_blocks(NULL, x, len, 4, w, out, in, b, y0));
        OK(fl_awq_matmul_blocks(g_be, x, len, 4, w, out, in, b, y1));
        double worst = 0;
        for (int64_t t = 0; t < n; t++) {
            double big = 0, d = 0;
            for (int64_t o = 0; o < out; o++) {
                big = fmax(big, fmax(fabs(y0[t * out + o]), fabs(y0[t * out + o] - (b ? b[o] : 0.0f))));
                d = fmax(d, fabs((double)y1[t * out + o] - y0[t * out + o]));
            }
            worst = fmax(worst, d / big);
        }
        printf("  matmul blocks on the GPU%s: worst row error %.2e of the row's largest\n", b ? " +bias" : "", worst);
        /* 2% over the rounding bound for the f32 sums' differing order */
        assert_true(worst < (b ? 2 : 1) * 1.02 / 256);
    }
    free(x);
    free(w);
    free(bias);
    free(y0);
    free(y1);
}

static void scale_search_on_gpu(void **state) {
    (void)state;
    NEED_GPU();
    const int64_t n = 200, in = 64, out = 40;
    float *x = malloc((size_t)(n * in) * 4), *w = malloc((size_t)(out * in) * 4), s[64];
    assert_non_null(x);
    assert_non_null(w);
    /* unit |x| but channel 3 (x 40), whose weight column is 40 times smaller */
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < in; c++) x[t * in + c] = (frand() < 0 ? -1.0f : 1.0f) * (c == 3 ? 40.0f : 1.0f);
    for (int64_t o = 0; o < out; o++)
        for (int64_t c = 0; c < in; c++) w[o * in + c] = frand() / (c == 3 ? 40.0f : 1.0f);
    const fl_awq_linear lin[2] = {{w, 24}, {w + 24 * in, 16}};
    fl_awq_search r;
    OK(fl_awq_search_scale(g_be, x, n, NULL, in, lin, 2, 32, 20, s, &r));
    printf("  scale search on the GPU: alpha %.2f, error %.3g of plain quantization's\n", r.alpha, r.err / r.err_plain);
    assert_true(r.alpha > 0.0f && r.alpha < 1.0f);
    assert_true(r.err < 0.9 * r.err_plain);
    for (int c = 0; c < in; c++)
        if (c != 3) assert_true(s[3] > s[c]);
    free(x);
    free(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(matmul_blocks_on_gpu),
        cmocka_unit_test(scale_search_on_gpu),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
