/*
 * test_cuda_prefetch.c — the backend op prefetch_weight (kernels/backend.h;
 * CUDA: kernels/cuda/cuda_prefetch.cu), a hint that brings the first part of
 * a W4 GEMV's weights into L2 from a side stream.
 *
 * A hint must never change a result and must never break the stream it
 * forks from, so the checks are:
 *  - the GEMVs it serves (matmul, matmul_add_rms's shapes, gate_up_silu
 *    stacked and apart) give the same bits with the prefetch enqueued
 *    before them as without, eagerly and replayed from a captured graph;
 *  - a recording that holds prefetches (and one that holds nothing else)
 *    ends, instantiates and replays: the side stream is joined back;
 *  - what it does not serve (bf16 weights, row-major W4, prefill sizes,
 *    n = 0) is skipped with FL_OK;
 *  - the CPU backend has no such op (checked everywhere, so CI asserts
 *    something without a GPU).
 * main sets FL_L2_PF=100,100 (everything the GEMVs read first: the whole
 * weight) before the backend reads it.
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

static void test_cpu_has_none(void **state) {
    (void)state;
    fl_backend *cpu = NULL;
    OK(fl_backend_cpu_init(&cpu));
    assert_null(cpu->ops->prefetch_weight);
    fl_backend_free(cpu);
}

/* y = op(x) with or without a prefetch of its weights first, eager or
 * from a graph recorded around both; returns y on the host. */
typedef struct pf_case {
    const fl_tensor *w, *up; /* device weights; up: gate_up_silu apart */
    int op, n, in, out;      /* FL_PREFETCH_*; out: y's columns */
} pf_case;

static float *run_case(const pf_case *c, const void *x, void *y, bool prefetch, bool graph) {
    void *ex = NULL;
    poison_act(y, (size_t)c->n * c->out);
    if (graph) OK(g_be->ops->graph_begin(g_be));
    if (prefetch) OK(g_be->ops->prefetch_weight(g_be, c->w, c->up, c->op, c->n));
    if (c->op == FL_PREFETCH_GATE_UP) OK(g_be->ops->gate_up_silu(g_be, x, c->n, c->w, c->up, y, NULL));
    else OK(g_be->ops->matmul(g_be, x, c->n, c->w, NULL, y));
    if (graph) {
        OK(g_be->ops->graph_end(g_be, true, &ex));
        assert_non_null(ex);
        OK(g_be->ops->graph_launch(g_be, ex));
        OK(g_be->ops->graph_launch(g_be, ex)); /* a replay after a replay: the fork and join again */
    }
    float *h = get_act(y, (size_t)c->n * c->out);
    if (ex) g_be->ops->graph_free(g_be, ex);
    return h;
}

static void check_case(const pf_case *c, const char *what) {
    float *xh = rand_bf16((size_t)c->n * c->in, 1.0f);
    void *x = dev_act(xh, (size_t)c->n * c->in), *y = dev_alloc((size_t)c->n * c->out * 2);
    float *ref = run_case(c, x, y, false, false);
    for (int graph = 0; graph < 2; graph++) {
        float *got = run_case(c, x, y, true, graph);
        for (size_t i = 0; i < (size_t)c->n * c->out; i++)
            if (memcmp(&got[i], &ref[i], sizeof(float)))
                fail_msg("%s n=%d (%s): y[%zu] = %g with the prefetch, %g without", what, c->n,
                         graph ? "graph" : "eager", i, got[i], ref[i]);
        free(got);
    }
    printf("  %-40s n=%2d: same bits with the prefetch, eager and graph\n", what, c->n);
    free(ref);
    free(xh);
    dev_free(x);
    dev_free(y);
}

static void upload_w4(int rows, int in, fl_tensor *d) {
    fl_tensor w;
    make_w4(rows, in, 128, &w);
    OK(g_be->ops->upload_weight(g_be, &w, d));
    fl_tensor_free(&w);
}

/* The shapes of a Llama-3-8B layer's o projection and gate|up (stacked and
 * apart), and awkward ones (an odd tile count, rows the bulk kernel's
 * slices do not divide evenly), at 1, 3 and 16 tokens. */
static void test_results_unchanged(void **state) {
    (void)state;
    NEED_GPU();
    assert_non_null(g_be->ops->prefetch_weight);
    fl_tensor o, g, u, st, odd;
    upload_w4(4096, 4096, &o);
    upload_w4(14336 / 4, 4096, &g); /* a quarter of Llama's MLP keeps the test short */
    upload_w4(14336 / 4, 4096, &u);
    {
        fl_tensor gh, uh, sh;
        make_w4(1792, 1536, 128, &gh);
        make_w4(1792, 1536, 128, &uh);
        stack_w4(&gh, &uh, &sh);
        OK(g_be->ops->upload_weight(g_be, &sh, &st));
        fl_tensor_free(&gh);
        fl_tensor_free(&uh);
        fl_tensor_free(&sh);
    }
    upload_w4(16 * 37, 64 * 7 * 2, &odd);
    const int ns[] = {1, 3, 16};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        const int n = ns[i];
        const pf_case cs[] = {
            {&o, NULL, FL_PREFETCH_MATMUL, n, 4096, 4096},
            {&g, &u, FL_PREFETCH_GATE_UP, n, 4096, 14336 / 4},
            {&st, NULL, FL_PREFETCH_GATE_UP, n, 1536, 1792},
            {&odd, NULL, FL_PREFETCH_MATMUL, n, 64 * 7 * 2, 16 * 37},
        };
        const char *names[] = {"o 4096 x 4096", "gate|up apart 3584 x 4096", "gate|up stacked 1792 x 1536",
                               "592 x 896"};
        for (size_t k = 0; k < sizeof cs / sizeof cs[0]; k++) check_case(&cs[k], names[k]);
    }
    g_be->ops->free_weight(g_be, &o);
    g_be->ops->free_weight(g_be, &g);
    g_be->ops->free_weight(g_be, &u);
    g_be->ops->free_weight(g_be, &st);
    g_be->ops->free_weight(g_be, &odd);
}

/* A recording of prefetches alone, and of many (one a layer, as the forward
 * makes them) between other work: each ends, instantiates and replays. */
static void test_graph_joins(void **state) {
    (void)state;
    NEED_GPU();
    fl_tensor w;
    upload_w4(4096, 4096, &w);
    void *ex = NULL;
    OK(g_be->ops->graph_begin(g_be));
    OK(g_be->ops->prefetch_weight(g_be, &w, NULL, FL_PREFETCH_MATMUL, 1));
    OK(g_be->ops->graph_end(g_be, true, &ex));
    assert_non_null(ex);
    OK(g_be->ops->graph_launch(g_be, ex));
    OK(g_be->ops->sync(g_be));
    g_be->ops->graph_free(g_be, ex);

    float *xh = rand_bf16(4096, 1.0f);
    void *x = dev_act(xh, 4096), *y = dev_alloc(4096 * 2);
    OK(g_be->ops->graph_begin(g_be));
    for (int l = 0; l < 32; l++) {
        OK(g_be->ops->prefetch_weight(g_be, &w, NULL, FL_PREFETCH_MATMUL, 1));
        OK(g_be->ops->matmul(g_be, l % 2 ? y : x, 1, &w, NULL, l % 2 ? x : y));
    }
    OK(g_be->ops->graph_end(g_be, true, &ex));
    for (int r = 0; r < 3; r++) OK(g_be->ops->graph_launch(g_be, ex));
    OK(g_be->ops->sync(g_be));
    g_be->ops->graph_free(g_be, ex);
    /* a discarded recording (an op failed inside it) still ends cleanly,
     * and the stream records again afterwards */
    OK(g_be->ops->graph_begin(g_be));
    OK(g_be->ops->prefetch_weight(g_be, &w, NULL, FL_PREFETCH_MATMUL, 1));
    OK(g_be->ops->graph_end(g_be, false, &ex));
    assert_null(ex);
    OK(g_be->ops->matmul(g_be, x, 1, &w, NULL, y));
    OK(g_be->ops->sync(g_be));
    free(xh);
    dev_free(x);
    dev_free(y);
    g_be->ops->free_weight(g_be, &w);
}

/* What the op has nothing for: skipped, FL_OK, nothing enqueued that fails. */
static void test_skips(void **state) {
    (void)state;
    NEED_GPU();
    fl_tensor bf, rm, w;
    float *v = rand_bf16(256 * 512, 0.05f);
    fl_tensor h = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {256, 512}, .data = v};
    OK(g_be->ops->upload_weight(g_be, &h, &bf)); /* bf16 on the device */
    free(v);
    fl_tensor r;
    make_w4(24, 96, 32, &r); /* group 32, 24 rows: the row-major W4 layout */
    OK(g_be->ops->upload_weight(g_be, &r, &rm));
    fl_tensor_free(&r);
    upload_w4(512, 512, &w);
    OK(g_be->ops->prefetch_weight(g_be, &bf, NULL, FL_PREFETCH_MATMUL, 1));
    OK(g_be->ops->prefetch_weight(g_be, &rm, NULL, FL_PREFETCH_MATMUL, 1));
    OK(g_be->ops->prefetch_weight(g_be, &w, NULL, FL_PREFETCH_MATMUL, 0));
    OK(g_be->ops->prefetch_weight(g_be, &w, NULL, FL_PREFETCH_MATMUL, 2048));
    OK(g_be->ops->prefetch_weight(g_be, &w, NULL, 0, 1)); /* no such op: nothing to read */
    OK(g_be->ops->sync(g_be));
    g_be->ops->free_weight(g_be, &bf);
    g_be->ops->free_weight(g_be, &rm);
    g_be->ops->free_weight(g_be, &w);
}

int main(void) {
    setenv("FL_L2_PF", "100,100", 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_has_none),
        cmocka_unit_test(test_results_unchanged),
        cmocka_unit_test(test_graph_joins),
        cmocka_unit_test(test_skips),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
