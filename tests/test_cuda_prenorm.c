/*
 * test_cuda_prenorm.c — the residual add + RMSNorm folded into the W4
 * GEMV's prologue (fl_prenorm, kernels/backend.h; cuda_gemv_bulk.cu's PN)
 * against add_rmsnorm then the op, bit for bit: gate_up_silu (gate and up
 * apart and stacked) and matmul_rope_kv (y, both caches), the residual sum
 * in x_out, with an F32 and a bf16 norm weight, at the shapes of
 * Llama-3-8B, Qwen2-7B (rows of 3584: the norm's threads run past the row),
 * DeepSeek-V2-Lite's expert width and tiny ones; token counts the fold
 * takes (1..8) and ones it hands to the separate norm (9, 16), which must
 * give the same bits too. The unfused ops are checked against the CPU in
 * test_cuda_ops; equality here carries that over. Outputs and x_out are
 * poisoned first. Without a GPU every test skips.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_gpu.h"

#ifdef FL_HAVE_CUDA
long fl_cuda_prenorm_folds(void);  /* cuda_gemv.cu */
void fl_cuda_set_prenorm(int mask); /* cuda_ops.cu: 3 both kinds, 0 none, -1 FL_PRENORM */
#define FOLDS() fl_cuda_prenorm_folds()
#else
#define FOLDS() 0L
#endif

/* The norm's inputs for n rows of d: the residual x, the added y, the
 * weight (F32 as upload_weight makes it, or bf16) on the device. */
typedef struct {
    int n, d;
    void *x, *y;
    fl_tensor w_host, w;
    float *wv;
    bool wbf16;
} norm_in;

static void norm_in_make(norm_in *t, int n, int d, bool wbf16) {
    t->n = n, t->d = d, t->wbf16 = wbf16;
    float *x = rand_bf16((size_t)n * d, 3.0f), *y = rand_bf16((size_t)n * d, 3.0f);
    t->wv = rand_bf16((size_t)d, 1.0f);
    t->w_host = (fl_tensor){.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {d}, .data = t->wv};
    OK(g_be->ops->upload_weight(g_be, &t->w_host, &t->w));
    if (wbf16) { /* the kernels take both; upload_weight makes F32 ones */
        g_be->ops->free_weight(g_be, &t->w);
        t->w = t->w_host;
        t->w.dtype = FL_DTYPE_BF16;
        t->w.data = dev_act(t->wv, (size_t)d);
    }
    t->x = dev_act(x, (size_t)n * d);
    t->y = dev_act(y, (size_t)n * d);
    free(x);
    free(y);
}

static void norm_in_free(norm_in *t) {
    if (t->wbf16) dev_free(t->w.data);
    else g_be->ops->free_weight(g_be, &t->w);
    dev_free(t->x);
    dev_free(t->y);
    free(t->wv);
}

/* The unfused reference's first step: xs = x + y (a copy of x, in place),
 * h = the normed rows. */
static void norm_ref(const norm_in *t, void **xs, void **h) {
    const size_t m = (size_t)t->n * t->d;
    *xs = dev_poison(m);
    *h = dev_poison(m);
    OK(g_be->ops->copy(g_be, *xs, t->x, fl_backend_act_bytes(g_be, m)));
    OK(g_be->ops->add_rmsnorm(g_be, *xs, t->y, &t->w, 1e-5f, t->n, t->d, *h));
}

static void expect_same(const void *a, const void *b, size_t m, const char *what, const char *name) {
    float *ga = get_act(a, m), *gb = get_act(b, m);
    if (memcmp(ga, gb, sizeof(float) * m)) {
        size_t i = 0;
        while (i < m && !memcmp(&ga[i], &gb[i], sizeof(float))) i++;
        fail_msg("%s: %s differs from add_rmsnorm then the op (element %zu: %g vs %g)", name, what, i,
                 (double)ga[i], (double)gb[i]);
    }
    free(ga);
    free(gb);
}

/* gate_up_silu with the prenorm vs add_rmsnorm then gate_up_silu. */
static void run_gate_up(int d, int in, int group, int n, bool wbf16, bool must_fold) {
    fl_tensor g, u, st, dg, du, ds;
    make_w4(d, in, group, &g);
    make_w4(d, in, group, &u);
    stack_w4(&g, &u, &st);
    OK(g_be->ops->upload_weight(g_be, &g, &dg));
    OK(g_be->ops->upload_weight(g_be, &u, &du));
    OK(g_be->ops->upload_weight(g_be, &st, &ds));
    assert_true(g_be->ops->gate_up_silu_max_n(g_be, &dg, &du) >= n);
    norm_in t;
    norm_in_make(&t, n, in, wbf16);
    for (int stacked = 0; stacked < 2; stacked++) {
        const fl_tensor *wg = stacked ? &ds : &dg, *wu = stacked ? NULL : &du;
        char name[160];
        snprintf(name, sizeof name, "gate_up_silu%s d=%d in=%d g%d n=%d, %s norm weight", stacked ? " stacked" : "",
                 d, in, group, n, wbf16 ? "bf16" : "f32");
        void *xs, *h, *ref = dev_poison((size_t)n * d);
        norm_ref(&t, &xs, &h);
        OK(g_be->ops->gate_up_silu(g_be, h, n, wg, wu, ref, NULL));
        void *xo = dev_poison((size_t)n * in), *scratch = dev_poison((size_t)n * in);
        void *out = dev_poison((size_t)n * d);
        const fl_prenorm pn = {t.x, t.y, xo, &t.w, 1e-5f};
        const long f0 = FOLDS();
        OK(g_be->ops->gate_up_silu(g_be, scratch, n, wg, wu, out, &pn));
        const bool folded = FOLDS() > f0;
        printf("  %s: %s\n", name, folded ? "folded" : "separate norm");
        if (must_fold && !folded) fail_msg("%s: the norm was not folded into the GEMV", name);
        expect_same(out, ref, (size_t)n * d, "out", name);
        expect_same(xo, xs, (size_t)n * in, "x_out", name);
        void *dev[] = {xs, h, ref, xo, scratch, out};
        for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) dev_free(dev[i]);
    }
    norm_in_free(&t);
    g_be->ops->free_weight(g_be, &dg);
    g_be->ops->free_weight(g_be, &du);
    g_be->ops->free_weight(g_be, &ds);
    fl_tensor_free(&g);
    fl_tensor_free(&u);
    fl_tensor_free(&st);
}

/* matmul_rope_kv with the prenorm vs add_rmsnorm then matmul_rope_kv: y,
 * both caches (one padding token, slot -1, when n > 2). */
static void run_rope_kv(int nh, int nkv, int hd, int in, int group, int n, bool bias, bool wbf16, bool must_fold) {
    const int qd = nh * hd, kvd = nkv * hd, rows = qd + 2 * kvd, half = hd / 2, n_slots = 2 * n + 3;
    fl_tensor w, dw, db;
    make_w4(rows, in, group, &w);
    float *bv = rand_bf16((size_t)rows, 0.5f);
    float *kc = rand_bf16((size_t)n_slots * kvd, 1.0f), *vc = rand_bf16((size_t)n_slots * kvd, 1.0f);
    float *cs, *sn;
    int32_t *slots;
    rope_step_tables(n, half, &cs, &sn, &slots);
    fl_tensor tb = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {rows}, .data = bv};
    OK(g_be->ops->upload_weight(g_be, &w, &dw));
    OK(g_be->ops->upload_weight(g_be, &tb, &db));
    if (g_be->ops->matmul_rope_kv_max_n(g_be, &dw, hd, hd, false) < n)
        fail_msg("matmul_rope_kv not offered for %d tokens", n);
    void *dc = dev_raw(cs, sizeof(float) * n * half), *dsn = dev_raw(sn, sizeof(float) * n * half);
    void *dsl = dev_raw(slots, sizeof(int32_t) * n);
    norm_in t;
    norm_in_make(&t, n, in, wbf16);
    char name[160];
    snprintf(name, sizeof name, "matmul_rope_kv %d/%d heads hd %d in %d g%d n %d%s, %s norm weight", nh, nkv, hd, in,
             group, n, bias ? " +bias" : "", wbf16 ? "bf16" : "f32");
    const size_t m = (size_t)n * rows, cm = (size_t)n_slots * kvd;
    void *xs, *h;
    norm_ref(&t, &xs, &h);
    void *y0 = dev_poison(m), *k0 = dev_act(kc, cm), *v0 = dev_act(vc, cm);
    OK(g_be->ops->matmul_rope_kv(g_be, h, n, &dw, bias ? &db : NULL, y0, nh, nkv, hd, dc, dsn, dsl, k0, v0, NULL));
    void *y1 = dev_poison(m), *k1 = dev_act(kc, cm), *v1 = dev_act(vc, cm);
    void *xo = dev_poison((size_t)n * in), *scratch = dev_poison((size_t)n * in);
    const fl_prenorm pn = {t.x, t.y, xo, &t.w, 1e-5f};
    const long f0 = FOLDS();
    OK(g_be->ops->matmul_rope_kv(g_be, scratch, n, &dw, bias ? &db : NULL, y1, nh, nkv, hd, dc, dsn, dsl, k1, v1,
                                 &pn));
    const bool folded = FOLDS() > f0;
    printf("  %s: %s\n", name, folded ? "folded" : "separate norm");
    if (must_fold && !folded) fail_msg("%s: the norm was not folded into the GEMV", name);
    expect_same(y1, y0, m, "y", name);
    expect_same(k1, k0, cm, "k cache", name);
    expect_same(v1, v0, cm, "v cache", name);
    expect_same(xo, xs, (size_t)n * in, "x_out", name);
    void *dev[] = {xs, h, y0, k0, v0, y1, k1, v1, xo, scratch, dc, dsn, dsl};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) dev_free(dev[i]);
    norm_in_free(&t);
    g_be->ops->free_weight(g_be, &dw);
    g_be->ops->free_weight(g_be, &db);
    fl_tensor_free(&w);
    void *host[] = {bv, kc, vc, cs, sn, slots};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
}

/* Folding is off by default (FL_PRENORM): the tests turn both kinds on. */
static int prenorm_on(void **state) {
    (void)state;
#ifdef FL_HAVE_CUDA
    fl_cuda_set_prenorm(3);
#endif
    return 0;
}

static void test_gate_up_prenorm(void **state) {
    (void)state;
    NEED_GPU();
    const bool bulk = rope_kv_offered(); /* the fold lives in the bulk kernel */
    if (!bulk) printf("  the bulk kernel does not run here (sm_90): every case takes the separate norm\n");
    static const int ns[] = {1, 2, 4, 8, 9, 16};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) /* Llama-3-8B: folded up to 1 token (shared memory) */
        run_gate_up(14336, 4096, 128, ns[i], i % 2, bulk && ns[i] == 1);
    run_gate_up(18944, 3584, 128, 1, false, false); /* Qwen2-7B: two waves, so the rule keeps the ring */
    run_gate_up(1408, 2048, 128, 3, true, bulk);    /* DeepSeek-V2-Lite's expert width */
    run_gate_up(48, 192, 64, 5, false, bulk);       /* tiny, group 64 */
    run_gate_up(1024, 2048, 256, 2, false, bulk);   /* group 256 */
}

static void test_rope_kv_prenorm(void **state) {
    (void)state;
    NEED_GPU();
    const bool bulk = rope_kv_offered(); /* the fold lives in the bulk kernel */
    if (!bulk) printf("  matmul_rope_kv is not offered here (sm_90): nothing to fold into\n");
    if (!bulk) skip();
    static const int ns[] = {1, 3, 8, 9, 16};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        run_rope_kv(32, 8, 128, 4096, 128, ns[i], false, i % 2, ns[i] <= 3); /* Llama-3-8B: folded up to 4 */
        run_rope_kv(28, 4, 128, 3584, 128, ns[i], true, !(i % 2), false);    /* Qwen2-7B, q|k|v bias */
    }
    run_rope_kv(8, 2, 64, 512, 64, 3, false, false, true); /* head_dim 64, group 64 */
    run_rope_kv(16, 16, 64, 2048, 128, 2, false, true, true); /* no GQA */
#ifdef FL_HAVE_CUDA
    fl_cuda_set_prenorm(0); /* FL_PRENORM=0's path: the separate norm, the same bits */
    run_rope_kv(32, 8, 128, 4096, 128, 1, false, false, false);
    run_gate_up(14336, 4096, 128, 1, false, false);
    fl_cuda_set_prenorm(3);
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_gate_up_prenorm, prenorm_on),
        cmocka_unit_test_setup(test_rope_kv_prenorm, prenorm_on),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
