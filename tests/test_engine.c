/*
 * test_engine.c — the engine's batching must not change results: logits of
 * a prompt are the same whether it is prefilled in one step or in chunks,
 * and greedy continuations are the same whether requests run alone or
 * batched together under a cache small enough to force preemption, and
 * whether greedy tokens are picked where the logits are (argmax_rows) or by
 * the host sampler over downloaded logits; and sampled continuations
 * (every filter, the penalty, mixed in one batch) are the same whether the
 * backend samples them (sample_rows) or the host does.
 * Uses the small transformers-written Llama in tests/loader/tiny_llama.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "runtime/engine/engine.h"

#define MODEL FL_TEST_DATA "/loader/tiny_llama"

typedef struct fixture {
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
} fixture;

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    assert_int_equal(fl_ckpt_open(MODEL, &f->ck), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&f->be), FL_OK);
    assert_int_equal(fl_model_load(f->ck, f->be, NULL, &f->m), FL_OK);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    fl_model_free(f->m);
    fl_backend_free(f->be);
    fl_ckpt_free(f->ck);
    free(f);
    return 0;
}

static bool g_pick_on_device = true;
static bool g_sample_on_device = true;
static const fl_sampling_params *g_sp; /* [NREQ] per request, NULL: greedy */

static fl_engine *engine(fixture *f, int blocks, int bs, int seqs, int budget) {
    fl_engine_config c;
    fl_engine_config_default(&c);
    c.greedy_on_device = g_pick_on_device;
    c.sample_on_device = g_sample_on_device;
    c.n_blocks = blocks;
    c.block_size = bs;
    c.max_num_seqs = seqs;
    c.max_num_batched_tokens = budget;
    fl_engine *e = NULL;
    assert_int_equal(fl_engine_init(f->m, &c, &e), FL_OK);
    return e;
}

static void test_chunked_prefill_same_logits(void **state) {
    fixture *f = *state;
    const int V = f->m->cfg.vocab_size, T = 23;
    int32_t ids[23];
    for (int i = 0; i < T; i++) ids[i] = (i * 7 + 3) % V;
    float *a = malloc(sizeof(float) * T * V), *b = malloc(sizeof(float) * T * V);
    /* one engine at a time: a backend holds one cache (kv_cache.h) */
    fl_engine *e1 = engine(f, 8, 16, 4, 64);
    assert_int_equal(fl_engine_prompt_logits(e1, ids, T, a), FL_OK);
    fl_engine_free(e1);
    fl_engine *e2 = engine(f, 16, 3, 4, 5);
    assert_int_equal(fl_engine_prompt_logits(e2, ids, T, b), FL_OK);
    fl_engine_free(e2);
    for (int i = 0; i < T * V; i++) assert_true(fabsf(a[i] - b[i]) <= 1e-5f * (1 + fabsf(a[i])));
    free(a);
    free(b);
}

enum { NREQ = 7, NEW = 9 };
static int n_gen_total;

/* Runs the requests through e to completion; returns generated tokens. */
static void generate(fl_engine *e, int n, const int *which, int32_t out[][NEW], const int V) {
    fl_gen g[NREQ];
    for (int i = 0; i < n; i++) {
        int r = which[i], len = 3 + 5 * r;
        int32_t p[64];
        for (int j = 0; j < len; j++) p[j] = (r * 13 + j * 5 + 1) % V;
        assert_int_equal(fl_gen_init(&g[i], r, p, len, g_sp ? &g_sp[r] : NULL, NEW), FL_OK);
        assert_int_equal(fl_engine_add(e, &g[i]), FL_OK);
    }
    int finished = 0;
    while (fl_engine_has_work(e)) {
        fl_gen **up;
        int nu;
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
        for (int k = 0; k < nu; k++) finished += up[k]->finish != FL_FINISH_NONE;
    }
    assert_int_equal(finished, n);
    for (int i = 0; i < n; i++) {
        /* tiny_llama's EOS may stop a request early: compare what exists */
        assert_true(g[i].finish == FL_FINISH_LENGTH || g[i].finish == FL_FINISH_STOP);
        n_gen_total += fl_gen_n_generated(&g[i]);
        memset(out[which[i]], -1, sizeof out[0]);
        memcpy(out[which[i]], g[i].seq.tokens + g[i].seq.n_prompt,
               sizeof(int32_t) * (size_t)fl_gen_n_generated(&g[i]));
        fl_gen_free(&g[i]);
    }
}

static void test_batching_preserves_greedy(void **state) {
    fixture *f = *state;
    const int V = f->m->cfg.vocab_size;
    int32_t alone[NREQ][NEW], batched[NREQ][NEW];
    for (int r = 0; r < NREQ; r++) {
        fl_engine *e = engine(f, 16, 4, 1, 64);
        int which = r;
        generate(e, 1, &which, alone, V);
        fl_engine_free(e);
    }
    /* 3 sequences per step, 6-token budget (chunked prefill), and 12 blocks
     * of 4 tokens for 7 requests of up to 42 tokens: preemption happens. */
    fl_engine *e = engine(f, 12, 4, 3, 6);
    int all[NREQ] = {0, 1, 2, 3, 4, 5, 6};
    generate(e, NREQ, all, batched, V);
    fl_engine_stats st;
    fl_engine_get_stats(e, &st);
    assert_true(st.preemptions > 0);
    fl_engine_free(e);
    assert_memory_equal(alone, batched, sizeof alone);
    /* most requests must run to their length, or the comparison is weak */
    assert_true(n_gen_total > 2 * NREQ * NEW * 3 / 4);
}

/* Every request through one engine (3 sequences a step, a 6-token budget,
 * 12 blocks of 4: chunked prefill and preemption); ops, when given, is the
 * backend's table from after the engine's init to the end. Its stats. */
static fl_engine_stats run_all(fixture *f, int32_t out[][NEW], const fl_backend_ops *ops) {
    int all[NREQ] = {0, 1, 2, 3, 4, 5, 6};
    fl_engine *e = engine(f, 12, 4, 3, 6);
    const fl_backend_ops *saved = f->be->ops;
    if (ops) f->be->ops = ops;
    generate(e, NREQ, all, out, f->m->cfg.vocab_size);
    f->be->ops = saved;
    fl_engine_stats st;
    fl_engine_get_stats(e, &st);
    fl_engine_free(e);
    return st;
}

static void test_greedy_pick_matches_sampler(void **state) {
    fixture *f = *state;
    int32_t dev[NREQ][NEW], host[NREQ][NEW];
    for (int on = 0; on < 2; on++) {
        g_pick_on_device = on;
        const fl_engine_stats st = run_all(f, on ? dev : host, NULL);
        /* every step picks on the device when on, none when off */
        assert_int_equal(st.greedy_steps, on ? st.steps : 0);
        assert_true(st.steps > NEW);
    }
    g_pick_on_device = true;
    assert_memory_equal(dev, host, sizeof dev);
}

static fl_status no_alloc(fl_backend *b, size_t bytes, void **out) {
    (void)b;
    *out = NULL;
    return FL_ERR(FL_ERR_OOM, "test: no memory for %zu bytes", bytes);
}

/* Sampled requests of every kind in one batch, chunked prefill and
 * preemption included: the tokens the backend samples (the CPU op here;
 * test_cuda_sample checks CUDA's against it) are those of the host sampler
 * over downloaded logits, draw for draw. */
static void test_sample_on_device_matches_host(void **state) {
    fixture *f = *state;
    fl_sampling_params sp[NREQ];
    for (int r = 0; r < NREQ; r++) fl_sampling_params_default(&sp[r]), sp[r].seed = 100 + (uint64_t)r;
    sp[0].temperature = 0.8f, sp[0].top_k = 5;
    sp[1].temperature = 1.0f, sp[1].top_p = 0.9f;
    sp[2].temperature = 0.7f, sp[2].min_p = 0.05f, sp[2].repetition_penalty = 1.3f;
    sp[3].temperature = 1.5f;
    sp[4].repetition_penalty = 1.2f; /* greedy with a penalty: not a greedy step */
    sp[5].temperature = 1.2f, sp[5].top_k = 40, sp[5].top_p = 0.8f, sp[5].repetition_penalty = 0.9f;
    sp[6].temperature = 1e-38f;      /* m / T overflows: the T -> 0 limit */
    int32_t dev[NREQ][NEW], host[NREQ][NEW];
    g_sp = sp;
    for (int on = 0; on < 2; on++) {
        g_sample_on_device = on;
        const fl_engine_stats st = run_all(f, on ? dev : host, NULL);
        /* every step that samples goes to the backend when on, none when
         * off (the greedy steps are the prefill chunks that sample nothing) */
        assert_true(st.steps > NEW);
        if (on) {
            assert_true(st.sampled_steps > NEW);
            assert_int_equal(st.sampled_steps + st.greedy_steps, st.steps);
        } else {
            assert_int_equal(st.sampled_steps, 0);
        }
    }
    /* a backend without sample_rows: the engine keeps the logits route */
    fl_backend_ops ops = *f->be->ops;
    ops.sample_rows = NULL;
    int32_t none[NREQ][NEW];
    assert_int_equal(run_all(f, none, &ops).sampled_steps, 0);
    assert_memory_equal(none, host, sizeof none);
    /* no memory left for the sampling buffers when the first sampled step
     * asks: a warning, and the logits route */
    ops = *f->be->ops;
    ops.alloc = no_alloc;
    assert_int_equal(run_all(f, none, &ops).sampled_steps, 0);
    assert_memory_equal(none, host, sizeof none);
    g_sp = NULL;
    g_sample_on_device = true;
    assert_memory_equal(dev, host, sizeof dev);
    /* the draws were random: not every request repeats the greedy tokens */
    int32_t greedy[NREQ][NEW];
    run_all(f, greedy, NULL);
    int differ = 0;
    for (int r = 0; r < 4; r++) differ += memcmp(greedy[r], host[r], sizeof greedy[r]) != 0;
    assert_true(differ >= 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunked_prefill_same_logits),
        cmocka_unit_test(test_batching_preserves_greedy),
        cmocka_unit_test(test_greedy_pick_matches_sampler),
        cmocka_unit_test(test_sample_on_device_matches_host),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
