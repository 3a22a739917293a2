/*
 * test_cuda_moe.c — the device-routed expert ops on CUDA (moe_group,
 * moe_matmul, moe_combine; kernels/cuda/cuda_moe.cu and the routed mode of
 * the W4 GEMV in cuda_gemv.cu) against the CPU ops (kernels/cpu/cpu_moe.c).
 *
 * Cases: Mixtral-like routing (8 experts, top 2) and Qwen3-like (128
 * experts, top 8), 1, 5, 19 and 64 tokens (64: four chunks of 16 pairs an
 * expert at most), all experts local or a slice of them (an ep rank:
 * e_lo > 0, pairs of other ranks' experts skipped), x per token (gate/up)
 * and per pair (down), packed W4 (groups 64 and 128) and bf16 experts.
 * moe_group must equal the CPU list exactly; moe_matmul rows of routed pairs
 * within 2e-2 (W4: the tensor-core GEMV's bf16 products) or 1e-2 (bf16) of
 * the CPU per row, and rows of pairs not routed here still hold their
 * poison (NaN) afterwards; moe_combine within 2e-2 (the GPU rounds to bf16
 * after each of a token's k adds, the CPU sums in f32). A graph records group +
 * matmul + combine once and replays it with new routing (ids changed
 * between replays): each replay must match the CPU for its own routing.
 * moe_combine_add_rmsnorm against the ops it fuses (combine_norm_check).
 * Skips cleanly without a GPU.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_gpu.h"
#include "kernels/cpu/cpu_ops.h"
#include "runtime/load/quant.h"

#ifndef FL_HAVE_CUDA /* a build without the CUDA backend: every case skips before these run */
static void fl_cuda_w4_gemv_tune(int kernel, int t, int nw, int r, int pf, int xpf) {
    (void)kernel, (void)t, (void)nw, (void)r, (void)pf, (void)xpf;
}
static void fl_cuda_w4_gemv_last(int cfg[5]) { cfg[0] = 0; }
#endif

static void combine_norm_check(int n, int k, int e_lo, int n_local, int d, const int32_t *ids, const int32_t *d_ids,
                               const float *d_w, const float *w, const float *src, const void *dsrc, int shared,
                               const char *what);

/* The routed W4 GEMV's two kernels: the register ring (tune kernel 1) and
 * the bulk-copy kernel (3; cfg[0] < 0 when it ran). */
static const char *const kern_name[2] = {"ring", "bulk"};
static void kern_force(int kern) { fl_cuda_w4_gemv_tune(kern ? 3 : 1, 0, 0, 0, -1, -1); }
/* after a W4 launch forced to kernel kern: that kernel ran (the bulk one
 * needs sm_90: on older GPUs the ring stands in) */
static void kern_check(int kern, const char *what) {
    int cfg[5];
    fl_cuda_w4_gemv_last(cfg);
    static int bulk = -1; /* the bulk W4 kernel runs here (rope_kv_offered: it needs that kernel) */
    if (bulk < 0) bulk = rope_kv_offered();
    if (kern && cfg[0] >= 0 && bulk) fail_msg("%s: the bulk kernel did not run", what);
    if (!kern && cfg[0] < 0) fail_msg("%s: the ring kernel did not run", what);
}

/* Random top-k routing: distinct experts per token. */
static void rand_ids(int n, int k, int E, int32_t *ids, float *w) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < k; j++) {
            int e, dup;
            do {
                e = (int)((frand() + 1.0f) * 0.5f * E) % E;
                dup = 0;
                for (int t = 0; t < j; t++) dup |= ids[i * k + t] == e;
            } while (dup);
            ids[i * k + j] = e;
            w[i * k + j] = 0.1f + 0.4f * fabsf(frand());
        }
}

typedef struct experts {
    int n_local;
    fl_tensor *host, *dev; /* [n_local] */
    fl_tensor *d_table;    /* device copy of dev */
    float **wf;            /* bf16 experts: the f32 data behind host */
} experts;

static void experts_make(experts *x, int n_local, int rows, int in, int group /* 0: bf16 */) {
    x->n_local = n_local;
    x->host = calloc((size_t)n_local, sizeof *x->host);
    x->dev = calloc((size_t)n_local, sizeof *x->dev);
    x->wf = calloc((size_t)n_local, sizeof *x->wf);
    for (int j = 0; j < n_local; j++) {
        if (group) {
            make_w4(rows, in, group, &x->host[j]);
        } else {
            x->wf[j] = rand_bf16((size_t)rows * in, 0.05f);
            fl_tensor t = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {rows, in}, .data = x->wf[j]};
            x->host[j] = t;
        }
        OK(g_be->ops->upload_weight(g_be, &x->host[j], &x->dev[j]));
    }
    x->d_table = dev_raw(x->dev, (size_t)n_local * sizeof *x->dev);
}

static void experts_free(experts *x) {
    for (int j = 0; j < x->n_local; j++) {
        g_be->ops->free_weight(g_be, &x->dev[j]);
        if (x->wf[j]) free(x->wf[j]);
        else fl_tensor_free(&x->host[j]);
    }
    dev_free(x->d_table);
    free(x->host);
    free(x->dev);
    free(x->wf);
}

/* One routed matmul + combine case against the CPU. */
static void run_case(int E, int k, int n, int e_lo, int n_local, int rows, int in, int group, int x_per_pair) {
    char what[160];
    snprintf(what, sizeof what, "E%d top%d n=%d experts %d..%d %s%d [%d,%d] x per %s", E, k, n, e_lo,
             e_lo + n_local - 1, group ? "w4 g" : "bf16", group, rows, in, x_per_pair ? "pair" : "token");
    const int P = n * k;
    int32_t *ids = malloc(sizeof(int32_t) * P);
    float *w = malloc(sizeof(float) * P);
    rand_ids(n, k, E, ids, w);
    experts ex;
    experts_make(&ex, n_local, rows, in, group);
    const int xr = x_per_pair ? P : n;
    float *x = rand_bf16((size_t)xr * in, 1.0f);
    /* CPU reference */
    const size_t L = (size_t)n_local + 1 + P;
    int32_t *list = malloc(sizeof(int32_t) * L), *got_list = malloc(sizeof(int32_t) * L);
    OK(fl_cpu_moe_group(NULL, ids, n, k, e_lo, n_local, list));
    float *ref = malloc(sizeof(float) * (size_t)P * rows);
    for (size_t i = 0; i < (size_t)P * rows; i++) ref[i] = NAN;
    OK(fl_cpu_moe_matmul(NULL, x, x_per_pair, n, k, list, n_local, ex.host, &ex.host[0], ref));
    /* GPU */
    int32_t *d_ids = dev_raw(ids, sizeof(int32_t) * P), *d_list = dev_alloc(sizeof(int32_t) * L);
    void *dx = dev_act(x, (size_t)xr * in);
    OK(g_be->ops->moe_group(g_be, d_ids, n, k, e_lo, n_local, d_list));
    OK(g_be->ops->download(g_be, got_list, d_list, sizeof(int32_t) * L));
    for (size_t i = 0; i < (size_t)n_local + 1 + list[n_local]; i++)
        if (got_list[i] != list[i]) fail_msg("%s: moe_group word %zu is %d, CPU %d", what, i, got_list[i], list[i]);
    for (int kern = 0; kern < (group ? 2 : 1); kern++) { /* W4: both routed kernels */
        char kw[200];
        snprintf(kw, sizeof kw, "%s%s%s", what, group ? " " : "", group ? kern_name[kern] : "");
        if (group) kern_force(kern);
        void *dy = dev_poison((size_t)P * rows);
        OK(g_be->ops->moe_matmul(g_be, dx, x_per_pair, n, k, d_list, n_local, ex.d_table, &ex.dev[0], dy));
        if (group) kern_check(kern, kw);
        float *got = get_act(dy, (size_t)P * rows);
        /* routed rows against the CPU; the others must still be NaN */
        int n_routed = 0;
        double worst = 0;
        for (int p = 0; p < P; p++) {
            const bool routed = ids[p] >= e_lo && ids[p] < e_lo + n_local;
            if (!routed) {
                for (int r = 0; r < rows; r++)
                    if (!isnan(got[(size_t)p * rows + r])) fail_msg("%s: pair %d (not routed here) was written", kw, p);
                continue;
            }
            n_routed++;
            const double e = row_err(got + (size_t)p * rows, ref + (size_t)p * rows, 1, (size_t)rows, kw);
            worst = e > worst ? e : worst;
        }
        const double tol = group ? 2e-2 : 1e-2;
        printf("  %-75s %3d pairs here, max row rel err %.2e\n", kw, n_routed, worst);
        if (!(worst <= tol)) fail_msg("%s: error %.3e > %.0e", kw, worst, tol);
        free(got);
        dev_free(dy);
    }
    fl_cuda_w4_gemv_tune(0, 0, 0, 0, -1, -1);

    /* combine: acc (n rows of `rows`, poisoned: it is overwritten) = routed rows of src (the CPU's output) */
    float *acc = rand_bf16((size_t)n * rows, 1.0f), *src = malloc(sizeof(float) * (size_t)P * rows); /* acc: overwritten */
    for (size_t i = 0; i < (size_t)P * rows; i++) src[i] = isnan(ref[i]) ? 0.0f : bf16_round(ref[i]);
    void *dacc = dev_poison((size_t)n * rows), *dsrc = dev_act(src, (size_t)P * rows);
    float *d_w = dev_raw(w, sizeof(float) * P);
    OK(fl_cpu_moe_combine(NULL, acc, src, ids, w, n, k, e_lo, n_local, rows));
    OK(g_be->ops->moe_combine(g_be, dacc, dsrc, d_ids, d_w, n, k, e_lo, n_local, rows));
    float *gacc = get_act(dacc, (size_t)n * rows);
    char cw[200];
    snprintf(cw, sizeof cw, "combine %s", what);
    expect_close(gacc, acc, (size_t)n, (size_t)rows, 2e-2, cw); /* k bf16 roundings against f32 */
    for (int shared = 0; shared < 2; shared++)
        combine_norm_check(n, k, e_lo, n_local, rows, ids, d_ids, d_w, w, src, dsrc, shared, what);

    free(gacc);
    free(acc);
    free(src);
    dev_free(dacc);
    dev_free(dsrc);
    dev_free(d_w);
    dev_free(d_ids);
    dev_free(d_list);
    dev_free(dx);
    free(list);
    free(got_list);
    free(ref);
    free(x);
    free(ids);
    free(w);
    experts_free(&ex);
}

/* moe_combine_add_rmsnorm (one launch: combine, the shared expert's add,
 * the residual add, the norm) against the CUDA ops it replaces, acc and
 * the residual bit for bit, the normed rows within 1e-2 (its squares are
 * summed in another order), and against the CPU reference (2e-2: k bf16
 * roundings against f32). shared: with an extra (shared expert) row. */
static void combine_norm_check(int n, int k, int e_lo, int n_local, int d, const int32_t *ids, const int32_t *d_ids,
                               const float *d_w, const float *w, const float *src, const void *dsrc, int shared,
                               const char *what) {
    const size_t nd = (size_t)n * d;
    float *x = rand_bf16(nd, 3.0f), *ex = rand_bf16(nd, 1.0f), *wv = rand_bf16((size_t)d, 1.0f);
    fl_tensor tw = {0};
    tw.dtype = FL_DTYPE_F32;
    tw.ndim = 1;
    tw.shape[0] = d;
    tw.data = wv;
    fl_tensor dw;
    OK(g_be->ops->upload_weight(g_be, &tw, &dw));
    float *acc = malloc(sizeof(float) * nd), *xr = malloc(sizeof(float) * nd), *out = malloc(sizeof(float) * nd);
    memcpy(xr, x, sizeof(float) * nd);
    OK(fl_cpu_moe_combine_add_rmsnorm(NULL, acc, src, ids, w, n, k, e_lo, n_local, d, shared ? ex : NULL, xr, &tw,
                                      1e-5f, out));
    void *dex = dev_act(ex, nd);
    void *dacc[2], *dx[2], *dout[2]; /* [0] the three CUDA ops, [1] the fused launch */
    for (int v = 0; v < 2; v++) {
        dacc[v] = dev_poison(nd), dx[v] = dev_act(x, nd), dout[v] = dev_poison(nd);
        if (v) {
            OK(g_be->ops->moe_combine_add_rmsnorm(g_be, dacc[v], dsrc, d_ids, d_w, n, k, e_lo, n_local, d,
                                                  shared ? dex : NULL, dx[v], &dw, 1e-5f, dout[v]));
        } else {
            OK(g_be->ops->moe_combine(g_be, dacc[v], dsrc, d_ids, d_w, n, k, e_lo, n_local, d));
            if (shared) OK(g_be->ops->add(g_be, dacc[v], dex, nd));
            OK(g_be->ops->add_rmsnorm(g_be, dx[v], dacc[v], &dw, 1e-5f, n, d, dout[v]));
        }
    }
    char cw[240];
    float *ga[2], *gx[2], *go[2];
    for (int v = 0; v < 2; v++) ga[v] = get_act(dacc[v], nd), gx[v] = get_act(dx[v], nd), go[v] = get_act(dout[v], nd);
    snprintf(cw, sizeof cw, "combine+norm %s%s", what, shared ? " +shared" : "");
    if (memcmp(ga[0], ga[1], sizeof(float) * nd)) fail_msg("%s: acc differs from moe_combine (+ add)", cw);
    if (memcmp(gx[0], gx[1], sizeof(float) * nd)) fail_msg("%s: the residual differs from add_rmsnorm's", cw);
    expect_close(go[1], go[0], (size_t)n, (size_t)d, 1e-2, cw);
    expect_close(go[1], out, (size_t)n, (size_t)d, 2e-2, cw);
    expect_close(gx[1], xr, (size_t)n, (size_t)d, 2e-2, cw);
    for (int v = 0; v < 2; v++) {
        free(ga[v]), free(gx[v]), free(go[v]);
        dev_free(dacc[v]), dev_free(dx[v]), dev_free(dout[v]);
    }
    dev_free(dex);
    g_be->ops->free_weight(g_be, &dw);
    free(acc), free(xr), free(out), free(x), free(ex), free(wv);
}

static void test_w4_mixtral_like(void **state) {
    (void)state;
    NEED_GPU();
    static const int ns[] = {1, 5, 19, 64};
    for (int i = 0; i < 4; i++) run_case(8, 2, ns[i], 0, 8, 512, 1024, 128, 0);
    run_case(8, 2, 5, 0, 8, 1024, 512, 128, 1);  /* down: x per pair */
    run_case(8, 2, 19, 4, 4, 512, 1024, 64, 0);  /* ep rank 1 of 2 */
    run_case(8, 2, 64, 4, 4, 512, 1024, 128, 1); /* and per pair */
}

static void test_w4_qwen3_like(void **state) {
    (void)state;
    NEED_GPU();
    run_case(128, 8, 1, 0, 128, 1536, 2048, 128, 0);  /* gate|up shape */
    run_case(128, 8, 1, 0, 128, 2048, 768, 128, 1);   /* down */
    run_case(128, 8, 19, 0, 128, 768, 2048, 128, 0);
    run_case(128, 8, 64, 32, 32, 2048, 768, 128, 1);  /* ep rank 1 of 4 */
}

/* moe_gate_up_silu on packed W4 experts (one routed pass for gate, up and
 * SiLU) against the CPU's moe_matmul (gate), moe_matmul (up), silu_mul,
 * with the experts' gate and up apart and stacked; rows of pairs routed
 * elsewhere stay NaN (the fused pass writes only its pairs). */
static void run_glu_case(int E, int k, int n, int e_lo, int n_local, int d, int in, int group) {
    const int P = n * k;
    int32_t *ids = malloc(sizeof(int32_t) * P);
    float *w = malloc(sizeof(float) * P);
    rand_ids(n, k, E, ids, w);
    experts eg, eu, es;
    experts_make(&eg, n_local, d, in, group);
    experts_make(&eu, n_local, d, in, group);
    es.n_local = n_local;
    es.host = calloc((size_t)n_local, sizeof *es.host);
    es.dev = calloc((size_t)n_local, sizeof *es.dev);
    es.wf = calloc((size_t)n_local, sizeof *es.wf);
    for (int j = 0; j < n_local; j++) {
        stack_w4(&eg.host[j], &eu.host[j], &es.host[j]);
        OK(g_be->ops->upload_weight(g_be, &es.host[j], &es.dev[j]));
    }
    es.d_table = dev_raw(es.dev, (size_t)n_local * sizeof *es.dev);
    float *x = rand_bf16((size_t)n * in, 1.0f);
    const size_t L = (size_t)n_local + 1 + P;
    int32_t *list = malloc(sizeof(int32_t) * L);
    OK(fl_cpu_moe_group(NULL, ids, n, k, e_lo, n_local, list));
    float *rg = malloc(sizeof(float) * (size_t)P * d), *ru = malloc(sizeof(float) * (size_t)P * d);
    float *ref = malloc(sizeof(float) * (size_t)P * d);
    for (size_t i = 0; i < (size_t)P * d; i++) rg[i] = ru[i] = 0.0f;
    OK(fl_cpu_moe_matmul(NULL, x, 0, n, k, list, n_local, eg.host, &eg.host[0], rg));
    OK(fl_cpu_moe_matmul(NULL, x, 0, n, k, list, n_local, eu.host, &eu.host[0], ru));
    OK(fl_cpu_silu_mul(NULL, rg, ru, P, d, d, ref));
    int32_t *d_ids = dev_raw(ids, sizeof(int32_t) * P), *d_list = dev_alloc(sizeof(int32_t) * L);
    void *dx = dev_act(x, (size_t)n * in);
    OK(g_be->ops->moe_group(g_be, d_ids, n, k, e_lo, n_local, d_list));
    for (int run = 0; run < 4; run++) { /* stacked or apart, on each routed kernel */
        const int stacked = run & 1, kern = run >> 1;
        char what[160];
        snprintf(what, sizeof what, "gate_up_silu%s E%d top%d n=%d experts %d..%d w4 g%d [%d,%d] %s",
                 stacked ? " stacked" : "", E, k, n, e_lo, e_lo + n_local - 1, group, d, in, kern_name[kern]);
        void *dy = dev_poison((size_t)P * d), *gu = dev_poison((size_t)P * 2 * d);
        kern_force(kern);
        OK(g_be->ops->moe_gate_up_silu(g_be, dx, n, k, d_list, n_local, stacked ? es.d_table : eg.d_table,
                                       stacked ? NULL : eu.d_table, stacked ? &es.dev[0] : &eg.dev[0],
                                       stacked ? NULL : &eu.dev[0], gu, dy));
        dev_free(gu);
        kern_check(kern, what);
        float *got = get_act(dy, (size_t)P * d);
        double worst = 0;
        for (int p = 0; p < P; p++) {
            if (!(ids[p] >= e_lo && ids[p] < e_lo + n_local)) {
                for (int r = 0; r < d; r++)
                    if (!isnan(got[(size_t)p * d + r])) fail_msg("%s: pair %d (not routed here) was written", what, p);
                continue;
            }
            const double e = row_err(got + (size_t)p * d, ref + (size_t)p * d, 1, (size_t)d, what);
            worst = e > worst ? e : worst;
        }
        printf("  %-70s max row rel err %.2e\n", what, worst);
        if (!(worst <= 2e-2)) fail_msg("%s: error %.3e > 2e-2", what, worst);
        free(got);
        dev_free(dy);
    }
    fl_cuda_w4_gemv_tune(0, 0, 0, 0, -1, -1);
    dev_free(dx);
    dev_free(d_ids);
    dev_free(d_list);
    free(x);
    free(list);
    free(rg);
    free(ru);
    free(ref);
    free(ids);
    free(w);
    experts_free(&eg);
    experts_free(&eu);
    experts_free(&es);
}

static void test_gate_up_silu(void **state) {
    (void)state;
    NEED_GPU();
    run_glu_case(8, 2, 1, 0, 8, 1024, 1024, 128);    /* Mixtral-like, one token */
    run_glu_case(8, 2, 19, 4, 4, 512, 1024, 64);     /* ep rank 1 of 2, group 64, 19 tokens */
    run_glu_case(128, 8, 1, 0, 128, 768, 2048, 128); /* Qwen3-like */
    run_glu_case(128, 8, 16, 32, 32, 768, 2048, 128);
    /* bf16 experts run the plain ops inside the op (fl_layer_moe_gate_up):
     * test_cuda_golden's MoE fixtures take that path */
}

static void test_bf16(void **state) {
    (void)state;
    NEED_GPU();
    run_case(8, 2, 1, 0, 8, 333, 512, 0, 0);
    run_case(8, 2, 19, 2, 4, 200, 256, 0, 1);
    run_case(64, 6, 64, 0, 64, 128, 64, 0, 0);
}

/* Unsupported layouts are refused by the probe, before any launch. */
static void test_probe(void **state) {
    (void)state;
    NEED_GPU();
    fl_tensor w4 = {.dtype = FL_DTYPE_W4, .ndim = 2, .shape = {100, 96}, .group = 32};
    assert_int_equal(g_be->ops->moe_matmul(g_be, NULL, 0, 0, 1, NULL, 1, NULL, &w4, NULL), FL_ERR_UNSUPPORTED);
    fl_error_clear();
    fl_tensor bf = {.dtype = FL_DTYPE_BF16, .ndim = 2, .shape = {64, 100}};
    assert_int_equal(g_be->ops->moe_matmul(g_be, NULL, 0, 0, 1, NULL, 1, NULL, &bf, NULL), FL_ERR_UNSUPPORTED);
    fl_error_clear();
    bf.shape[1] = 128;
    OK(g_be->ops->moe_matmul(g_be, NULL, 0, 0, 1, NULL, 1, NULL, &bf, NULL));
}

/* Graph: group + matmul + combine recorded once, replayed with new ids. */
static void test_graph_replay(void **state) {
    (void)state;
    NEED_GPU();
    if (!g_be->ops->graph_begin) skip();
    const int E = 16, k = 4, n = 8, rows = 256, in = 512, P = n * k;
    experts ex;
    experts_make(&ex, E, rows, in, 128);
    float *x = rand_bf16((size_t)n * in, 1.0f);
    int32_t *ids = malloc(sizeof(int32_t) * P), *list = malloc(sizeof(int32_t) * (E + 1 + P));
    float *w = malloc(sizeof(float) * P), *ys = malloc(sizeof(float) * (size_t)P * rows);
    float *acc = malloc(sizeof(float) * (size_t)n * rows);
    void *dx = dev_act(x, (size_t)n * in), *dy = dev_alloc((size_t)P * rows * 2), *dacc = dev_alloc((size_t)n * rows * 2);
    int32_t *d_ids = dev_alloc(sizeof(int32_t) * P), *d_list = dev_alloc(sizeof(int32_t) * (E + 1 + P));
    float *d_w = dev_alloc(sizeof(float) * P);
    void *graph = NULL;
    for (int rep = 0; rep < 4; rep++) {
        rand_ids(n, k, E, ids, w);
        OK(g_be->ops->upload(g_be, d_ids, ids, sizeof(int32_t) * P));
        OK(g_be->ops->upload(g_be, d_w, w, sizeof(float) * P));
        if (rep == 0) {
            OK(g_be->ops->graph_begin(g_be));
            OK(g_be->ops->moe_group(g_be, d_ids, n, k, 0, E, d_list));
            OK(g_be->ops->moe_matmul(g_be, dx, 0, n, k, d_list, E, ex.d_table, &ex.dev[0], dy));
            OK(g_be->ops->moe_combine(g_be, dacc, dy, d_ids, d_w, n, k, 0, E, rows));
            OK(g_be->ops->graph_end(g_be, true, &graph));
        }
        OK(g_be->ops->graph_launch(g_be, graph));
        OK(fl_cpu_moe_group(NULL, ids, n, k, 0, E, list));
        OK(fl_cpu_moe_matmul(NULL, x, 0, n, k, list, E, ex.host, &ex.host[0], ys));
        for (size_t i = 0; i < (size_t)P * rows; i++) ys[i] = bf16_round(ys[i]);
        OK(fl_cpu_moe_combine(NULL, acc, ys, ids, w, n, k, 0, E, rows));
        float *got = get_act(dacc, (size_t)n * rows);
        char what[64];
        snprintf(what, sizeof what, "graph replay %d (new routing)", rep);
        expect_close(got, acc, (size_t)n, (size_t)rows, 2e-2, what);
        free(got);
    }
    g_be->ops->graph_free(g_be, graph);
    dev_free(dx);
    dev_free(dy);
    dev_free(dacc);
    dev_free(d_ids);
    dev_free(d_list);
    dev_free(d_w);
    free(x);
    free(ids);
    free(list);
    free(w);
    free(ys);
    free(acc);
    experts_free(&ex);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_w4_mixtral_like), cmocka_unit_test(test_w4_qwen3_like),
        cmocka_unit_test(test_bf16),            cmocka_unit_test(test_probe),
        cmocka_unit_test(test_graph_replay),
        cmocka_unit_test(test_gate_up_silu),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
