/*
 * test_model_fuse.c — q|k|v and gate|up stacked at load (runtime/model/model_fuse.c):
 * the stacked weight holds the parts' rows in order (f32, W4 with its group
 * scales, biases of different lengths), parts that cannot follow one another
 * stay separate, and a model loaded fused gives the same logits as the same
 * checkpoint loaded with FL_FUSE=0 (tiny_llama, f32 and quantized to W4 at
 * load), with the fused fields actually in use; by default W4 stacks q|k|v,
 * and gate|up only up to 8192 rows (model_fuse.c says why).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/option.h"
#include "runtime/engine/engine.h"
#include "runtime/load/quant.h"

#define MODEL FL_TEST_DATA "/loader/tiny_llama"

static fl_tensor f32_mat(int64_t rows, int64_t cols, float base) {
    fl_tensor t = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {rows, cols}, .owned = 1};
    float *d = malloc(sizeof(float) * (size_t)(rows * cols));
    for (int64_t i = 0; i < rows * cols; i++) d[i] = base + (float)i;
    t.data = d;
    return t;
}

static void test_stacking(void **state) {
    (void)state;
    fl_backend *be;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    fl_model *m = calloc(1, sizeof *m);
    m->be = be;
    /* f32 matrices of one width: rows in order */
    fl_tensor p[3] = {f32_mat(4, 8, 0), f32_mat(2, 8, 1000), f32_mat(2, 8, 2000)}, fused, a, b, c;
    memset(&fused, 0, sizeof fused);
    memset(&a, 0, sizeof a);
    fl_tensor *const devs[3] = {&a, &b, &c};
    assert_int_equal(fl_model_keep_fused(m, p, 3, true, &fused, devs), FL_OK);
    assert_non_null(fused.data);
    assert_null(a.data);
    assert_int_equal(fused.shape[0], 8);
    assert_int_equal(fused.shape[1], 8);
    const float *fd = fused.data;
    assert_true(fd[0] == 0 && fd[31] == 31 && fd[32] == 1000 && fd[47] == 1015 && fd[48] == 2000);
    /* vectors of different lengths: concatenated */
    fl_tensor v[2] = {f32_mat(1, 3, 5), f32_mat(1, 2, 9)}, vf;
    v[0].ndim = v[1].ndim = 1;
    v[0].shape[0] = 3;
    v[1].shape[0] = 2;
    memset(&vf, 0, sizeof vf);
    assert_int_equal(fl_model_keep_fused(m, v, 2, true, &vf, devs), FL_OK);
    assert_int_equal(vf.shape[0], 5);
    assert_true(((float *)vf.data)[3] == 9 && ((float *)vf.data)[4] == 10);
    /* W4: codes and group scales follow the rows */
    fl_tensor w[2];
    assert_int_equal(fl_quant_w4_alloc(16, 256, 128, &w[0]), FL_OK);
    assert_int_equal(fl_quant_w4_alloc(16, 256, 128, &w[1]), FL_OK);
    for (int i = 0; i < 2; i++) {
        memset(w[i].data, 0x11 * (i + 1), 16 * 128);
        for (int g = 0; g < 32; g++) w[i].scales[g] = (float)(i * 100 + g), w[i].bias[g] = -(float)g;
    }
    fl_tensor wf;
    memset(&wf, 0, sizeof wf);
    assert_int_equal(fl_model_keep_fused(m, w, 2, true, &wf, devs), FL_OK);
    assert_int_equal(wf.dtype, FL_DTYPE_W4);
    assert_int_equal(wf.shape[0], 32);
    assert_int_equal(((uint8_t *)wf.data)[16 * 128 - 1], 0x11);
    assert_int_equal(((uint8_t *)wf.data)[16 * 128], 0x22);
    assert_true(wf.scales[32] == 100 && wf.scales[63] == 131 && wf.bias[33] == -1);
    /* different widths, or not allowed: each part on its own */
    fl_tensor q[2] = {f32_mat(2, 8, 0), f32_mat(2, 4, 0)}, none;
    memset(&none, 0, sizeof none);
    assert_int_equal(fl_model_keep_fused(m, q, 2, true, &none, devs), FL_OK);
    assert_null(none.data);
    assert_non_null(a.data);
    assert_int_equal(b.shape[1], 4);
    fl_tensor r[2] = {f32_mat(2, 8, 0), f32_mat(2, 8, 0)};
    assert_int_equal(fl_model_keep_fused(m, r, 2, false, &none, devs), FL_OK);
    assert_null(none.data);
    for (size_t i = 0; i < m->n_host_owned; i++) fl_tensor_free(&m->host_owned[i]);
    free(m->host_owned);
    free(m);
    fl_backend_free(be);
}

/* Prompt logits of tiny_llama loaded with quant q and FL_FUSE=mode (NULL:
 * the default policy), set through the registry. */
static float *logits(fl_backend *be, fl_load_quant q, const char *mode, int T, int *Vp) {
    if (mode) assert_int_equal(fl_opt_override(FL_OPT_FUSE, mode), FL_OK);
    const bool qkv = !mode || strcmp(mode, "0") != 0;
    /* default: tiny_llama's W4 gate|up stack (2 x 64 rows) is small enough */
    const bool gu = mode ? strcmp(mode, "all") == 0 : true;
    fl_ckpt *ck;
    fl_model *m;
    assert_int_equal(fl_ckpt_open(MODEL, &ck), FL_OK);
    fl_model_load_opts lo = {.quant = q};
    assert_int_equal(fl_model_load(ck, be, &lo, &m), FL_OK);
    assert_int_equal(fl_opt_override(FL_OPT_FUSE, NULL), FL_OK);
    /* the stacked weights are what runs */
    assert_true((m->layers[0].wqkv.data != NULL) == qkv);
    assert_true((m->layers[0].wq.data != NULL) == !qkv);
    assert_true((m->layers[0].mlp.gate_up.data != NULL) == gu);
    assert_true((m->layers[0].mlp.gate.data != NULL) == !gu);
    const int V = *Vp = m->cfg.vocab_size;
    fl_engine_config c;
    fl_engine_config_default(&c);
    c.kv_cache_bytes = 8 << 20;
    fl_engine *e;
    assert_int_equal(fl_engine_init(m, &c, &e), FL_OK);
    int32_t ids[16];
    for (int i = 0; i < T; i++) ids[i] = (i * 11 + 5) % V;
    float *out = malloc(sizeof(float) * (size_t)T * V);
    assert_int_equal(fl_engine_prompt_logits(e, ids, T, out), FL_OK);
    fl_engine_free(e);
    fl_model_free(m);
    fl_ckpt_free(ck);
    return out;
}

static void test_fused_model_same_logits(void **state) {
    (void)state;
    fl_backend *be;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    const int T = 13;
    for (int qi = 0; qi < 2; qi++) {
        const fl_load_quant q = qi ? FL_LOAD_W4 : FL_LOAD_AS_STORED;
        int V;
        float *a0 = logits(be, q, "0", T, &V);
        const char *modes[] = {"all", "qkv", NULL};
        for (int mi = 0; mi < 3; mi++) {
            float *a1 = logits(be, q, modes[mi], T, &V);
            double worst = 0;
            for (int i = 0; i < T * V; i++) {
                double d = fabs((double)a0[i] - a1[i]) / (1 + fabs((double)a0[i]));
                worst = d > worst ? d : worst;
            }
            assert_true(worst <= 1e-5);
            free(a1);
        }
        free(a0);
    }
    fl_backend_free(be);
}

/* The default policy's thresholds (FL_FUSE unset), and the other values,
 * names or indexes (off|auto|qkv|all). */
static void test_policy(void **state) {
    (void)state;
    assert_int_equal(fl_opt_override(FL_OPT_FUSE, NULL), FL_OK);
    assert_true(fl_model_fuse_wanted(false, FL_DTYPE_W4, 0));
    assert_true(fl_model_fuse_wanted(true, FL_DTYPE_BF16, 28672));
    assert_true(fl_model_fuse_wanted(true, FL_DTYPE_W4, 2 * 1408));  /* DeepSeek-V2-Lite experts */
    assert_true(fl_model_fuse_wanted(true, FL_DTYPE_W4, 8192));
    assert_false(fl_model_fuse_wanted(true, FL_DTYPE_W4, 8208));
    assert_false(fl_model_fuse_wanted(true, FL_DTYPE_W4, 28672)); /* Llama-3-8B, Mixtral */
    assert_int_equal(fl_opt_override(FL_OPT_FUSE, "qkv"), FL_OK);
    assert_false(fl_model_fuse_wanted(true, FL_DTYPE_BF16, 128));
    assert_true(fl_model_fuse_wanted(false, FL_DTYPE_BF16, 128));
    assert_int_equal(fl_opt_override(FL_OPT_FUSE, "all"), FL_OK);
    assert_true(fl_model_fuse_wanted(true, FL_DTYPE_W4, 28672));
    assert_int_equal(fl_opt_override(FL_OPT_FUSE, "0"), FL_OK); /* the index of off */
    assert_false(fl_model_fuse_wanted(false, FL_DTYPE_BF16, 128));
    assert_int_equal(fl_opt_override(FL_OPT_FUSE, "sometimes"), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "FL_FUSE"));
    assert_int_equal(fl_opt_override(FL_OPT_FUSE, NULL), FL_OK);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stacking),
        cmocka_unit_test(test_policy),
        cmocka_unit_test(test_fused_model_same_logits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
