/*
 * test_gpu.h — what the CUDA test programs share (included once per
 * program): the CUDA backend opened once (g_be, NULL when no GPU is usable,
 * with the reason in g_why: CI has no GPU and every GPU test skips cleanly),
 * the skip, a status check that names the failing call, random bf16-exact
 * inputs, device buffer helpers (poisoned outputs, downloads) and the
 * per-row relative error check (static inline: a program uses some).
 */
#ifndef FL_TEST_GPU_H
#define FL_TEST_GPU_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_fused.h"
#include "kernels/cuda/cuda_tune.h"
#ifdef FL_HAVE_CUDA
#include "kernels/cuda/cuda_test_hooks.h"
#endif
#include "runtime/load/quant.h"
#include "runtime/load/synth.h"
#include "core/status.h"
#include "core/tensor.h"

static fl_backend *g_be;
static char g_why[512];

/* FP8 GEMMs the CUDA backend has enqueued (0 without it: the GPU tests
 * skip before they compare). */
static inline long gpu_fp8_gemm_launches(void) {
#ifdef FL_HAVE_CUDA
    return fl_cuda_fp8_gemm_launches();
#else
    return 0;
#endif
}

/* Sets a tuning override of the CUDA backend (kernels/cuda/cuda_tune.h; -1:
 * the built-in choice). Without the CUDA backend there is nothing to tune:
 * every GPU test skips before its results matter. */
static inline void gpu_tune(fl_cuda_tune_id id, long value) {
#ifdef FL_HAVE_CUDA
    fl_cuda_tune_set(id, value);
#else
    (void)id;
    (void)value;
#endif
}

/* The CUDA backend's fused ops (kernels/cuda/cuda_fused.h), which its
 * decode_layer composes; the tests call them directly. Without the CUDA
 * backend they do not exist: every GPU test skips before calling these. */
#ifdef FL_HAVE_CUDA
#define FL_GPU_FUSED(call, none) return call
#else
#define FL_GPU_FUSED(call, none) return none
#endif
static inline int gpu_matmul_add_rms_max_n(fl_backend *b, const fl_tensor *w) {
    FL_GPU_FUSED(fl_cuda_matmul_add_rms_max_n(b, w), 0);
}
static inline bool gpu_rms_defer_pays(fl_backend *b, int op, const fl_tensor *w, const fl_tensor *up, int n,
                                      int head_dim) {
    FL_GPU_FUSED(fl_cuda_rms_defer_pays(b, op, w, up, n, head_dim), false);
}
static inline fl_status gpu_matmul_add_rms(fl_backend *b, const void *x, int n, const fl_tensor *w,
                                           const fl_tensor *bias, void *resid, const fl_tensor *norm_w, void *h,
                                           fl_rms_defer *rd) {
    FL_GPU_FUSED(fl_cuda_matmul_add_rms(b, x, n, w, bias, resid, norm_w, h, rd), FL_ERR_UNSUPPORTED);
}
static inline int gpu_gate_up_silu_max_n(fl_backend *b, const fl_tensor *gate, const fl_tensor *up) {
    FL_GPU_FUSED(fl_cuda_gate_up_silu_max_n(b, gate, up), 0);
}
static inline fl_status gpu_gate_up_silu(fl_backend *b, const void *x, int n, const fl_tensor *gate,
                                         const fl_tensor *up, void *out, const fl_rms_defer *rd) {
    FL_GPU_FUSED(fl_cuda_gate_up_silu(b, x, n, gate, up, out, rd), FL_ERR_UNSUPPORTED);
}
static inline int gpu_matmul_rope_kv_max_n(fl_backend *b, const fl_tensor *w, int head_dim, int rot_dim,
                                           bool interleaved) {
    FL_GPU_FUSED(fl_cuda_matmul_rope_kv_max_n(b, w, head_dim, rot_dim, interleaved), 0);
}
static inline fl_status gpu_matmul_rope_kv(fl_backend *b, const void *x, int n, const fl_tensor *w,
                                           const fl_tensor *bias, void *y, int n_heads, int n_kv_heads,
                                           int head_dim, const float *cos, const float *sin, const int32_t *slots,
                                           void *k_cache, void *v_cache, const fl_rms_defer *rd) {
    FL_GPU_FUSED(fl_cuda_matmul_rope_kv(b, x, n, w, bias, y, n_heads, n_kv_heads, head_dim, cos, sin, slots, k_cache,
                                        v_cache, rd),
                 FL_ERR_UNSUPPORTED);
}
#undef FL_GPU_FUSED

#define NEED_GPU()                                                    \
    do {                                                              \
        if (!g_be) {                                                  \
            printf("  skipped (no GPU): %s\n", g_why);                \
            skip();                                                   \
        }                                                             \
    } while (0)

#define OK(call)                                                                               \
    do {                                                                                       \
        fl_status st_ = (call);                                                                \
        if (st_ != FL_OK) fail_msg("%s -> %s: %s", #call, fl_status_str(st_), fl_error_msg()); \
    } while (0)

/* FL_REQUIRE_GPU=1 (what a GPU run sets, scripts/gpu-check.sh): a CUDA
 * backend that does not start fails the whole program instead of letting
 * every test skip, so a GPU run without a usable GPU cannot read as green. */
static int gpu_group_setup(void **state) {
    (void)state;
    if (fl_backend_cuda_init(0, &g_be) != FL_OK) {
        snprintf(g_why, sizeof g_why, "%s", fl_error_msg());
        g_be = NULL;
        fl_error_clear();
        const char *req = getenv("FL_REQUIRE_GPU");
        if (req && !strcmp(req, "1")) {
            printf("FL_REQUIRE_GPU=1 but the CUDA backend did not start: %s\n", g_why);
            return -1;
        }
        printf("no usable GPU, GPU tests skip: %s\n", g_why);
    }
    return 0;
}

/* xorshift64 stream (a program may reseed g_rng), uniform in [-1, 1). */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static inline float frand(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static inline float bf16_round(float v) { return fl_bf16_to_f32(fl_f32_to_bf16(v)); }
/* n values exactly representable in bf16 (so CPU and GPU see the same inputs). */
static inline float *rand_bf16(size_t n, float amp) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(x);
    for (size_t i = 0; i < n; i++) x[i] = bf16_round(frand() * amp);
    return x;
}

/* A random permutation of 0..n-1 (Fisher-Yates on frand): scattered KV
 * block ids for the attention tests. */
static inline int32_t *rand_perm(int n) {
    int32_t *perm = malloc(sizeof(int32_t) * (n ? n : 1));
    assert_non_null(perm);
    for (int i = 0; i < n; i++) perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        const int j = (int)((frand() + 1.0f) * 0.5f * (i + 1)) % (i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    return perm;
}

static inline void *dev_alloc(size_t bytes) {
    void *p = NULL;
    OK(g_be->ops->alloc(g_be, bytes, &p));
    return p;
}
static inline void *dev_act(const float *h, size_t n) { /* f32 host -> bf16 activations */
    void *p = dev_alloc(n * 2);
    OK(g_be->ops->upload_act(g_be, p, h, n));
    return p;
}
static inline void *dev_raw(const void *h, size_t bytes) {
    void *p = dev_alloc(bytes);
    OK(g_be->ops->upload(g_be, p, h, bytes));
    return p;
}

static inline void *dev_poison(size_t n) { /* n bf16 NaNs */
    uint16_t *h = malloc(2 * (n ? n : 1));
    assert_non_null(h);
    for (size_t i = 0; i < n; i++) h[i] = 0x7FC0;
    void *p = dev_raw(h, 2 * n);
    free(h);
    return p;
}
static inline void poison_act(void *d, size_t n) { /* n bf16 NaNs into an existing buffer */
    uint16_t *h = malloc(2 * (n ? n : 1));
    assert_non_null(h);
    for (size_t i = 0; i < n; i++) h[i] = 0x7FC0;
    OK(g_be->ops->upload(g_be, d, h, 2 * n));
    OK(g_be->ops->sync(g_be));
    free(h);
}
static inline float *get_act(const void *d, size_t n) {
    float *h = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(h);
    OK(g_be->ops->download_act(g_be, h, d, n));
    return h;
}
static inline void dev_free(void *p) { g_be->ops->free(g_be, p); }

/* Worst per-row error max|got - ref| / max|ref|; NaN anywhere fails. */
static inline double row_err(const float *got, const float *ref, size_t rows, size_t cols, const char *what) {
    double worst = 0;
    for (size_t r = 0; r < rows; r++) {
        double num = 0, den = 0;
        for (size_t c = 0; c < cols; c++) {
            const float g = got[r * cols + c], e = ref[r * cols + c];
            if (isnan(g) || isinf(g))
                fail_msg("%s: row %zu col %zu is %f (reference %f)", what, r, c, g, e);
            double d = fabs((double)g - e);
            num = d > num ? d : num;
            den = fabs(e) > den ? fabs(e) : den;
        }
        double rel = num / (den > 0 ? den : 1);
        worst = rel > worst ? rel : worst;
    }
    return worst;
}
static inline void expect_close(const float *got, const float *ref, size_t rows, size_t cols, double tol,
                                const char *what) {
    double e = row_err(got, ref, rows, cols, what);
    printf("  %-44s max row rel err %.2e (tol %.0e)\n", what, e, tol);
    if (!(e <= tol)) fail_msg("%s: error %.3e > %.1e", what, e, tol);
}

/* Random W4 [out, in]: AWQ-like (bias = -zero * scale). */
static inline void make_w4(int out, int in, int group, fl_tensor *w) {
    OK(fl_quant_w4_alloc(out, in, group, w));
    uint8_t *codes = w->data;
    for (size_t i = 0; i < (size_t)out * in / 2; i++) codes[i] = (uint8_t)((frand() + 1.0f) * 128.0f);
    for (size_t g = 0; g < (size_t)out * (in / group); g++) {
        w->scales[g] = 0.002f + 0.01f * fabsf(frand());
        w->bias[g] = -floorf((frand() + 1.0f) * 8.0f) * w->scales[g];
    }
}

/* st = rows of g, then rows of u (the stacked gate|up weight the loader
 * makes; both [d, in], one group). */
static inline void stack_w4(const fl_tensor *g, const fl_tensor *u, fl_tensor *st) {
    const int64_t d = g->shape[0], in = g->shape[1];
    OK(fl_quant_w4_alloc((int)(2 * d), (int)in, g->group, st));
    const size_t cb = (size_t)d * in / 2, sg = (size_t)d * (in / g->group);
    memcpy(st->data, g->data, cb);
    memcpy((uint8_t *)st->data + cb, u->data, cb);
    memcpy(st->scales, g->scales, sizeof(float) * sg);
    memcpy(st->scales + sg, u->scales, sizeof(float) * sg);
    memcpy(st->bias, g->bias, sizeof(float) * sg);
    memcpy(st->bias + sg, u->bias, sizeof(float) * sg);
}

/* A decode step's rope tables and cache slots for matmul_rope_kv tests: cos
 * and sin [n, half] of random angles, n distinct slots of n_slots = 2 n + 3
 * (not in order; token 1 is padding, slot -1, when n > 2). Caller frees. */
static inline void rope_step_tables(int n, int half, float **cs, float **sn, int32_t **slots) {
    const int n_slots = 2 * n + 3;
    *cs = malloc(sizeof(float) * n * half), *sn = malloc(sizeof(float) * n * half);
    for (int i = 0; i < n * half; i++) {
        const float a = frand() * 3.14159f;
        (*cs)[i] = cosf(a);
        (*sn)[i] = sinf(a);
    }
    *slots = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) (*slots)[i] = n > 2 && i == 1 ? -1 : n_slots - 1 - 2 * i;
}

/* Whether matmul_rope_kv is offered for Llama's q|k|v shape: the bulk W4
 * kernel runs on this GPU (sm_90), with its rope epilogue and the deferred norm's scaling. */
static inline bool rope_kv_offered(void) {
#ifndef FL_HAVE_CUDA
    return false;
#else
    fl_tensor w, dw;
    make_w4(48 * 128, 4096, 128, &w);
    OK(g_be->ops->upload_weight(g_be, &w, &dw));
    const int m = gpu_matmul_rope_kv_max_n(g_be, &dw, 128, 128, false);
    g_be->ops->free_weight(g_be, &dw);
    fl_tensor_free(&w);
    return m > 0;
#endif
}

/* A small synthetic Llama whose W4 shapes the packed kernels take (hidden
 * 512, 8 heads of 64, 2 KV heads, MLP 1024, vocabulary 2048). */
static inline void synth_small_llama(int n_layers, fl_load_quant quant, uint64_t seed, fl_model **m) {
    fl_model_config cfg;
    OK(fl_synth_preset("llama-3-8b", &cfg));
    cfg.n_layers = n_layers, cfg.hidden_size = 512, cfg.n_heads = 8, cfg.n_kv_heads = 2, cfg.head_dim = 64;
    cfg.intermediate_size = 1024, cfg.vocab_size = 2048;
    OK(fl_synth_model(&cfg, NULL, g_be, quant, seed, m));
}

static int gpu_group_teardown(void **state) {
    (void)state;
    fl_backend_free(g_be);
    g_be = NULL;
    return 0;
}

#endif /* FL_TEST_GPU_H */
