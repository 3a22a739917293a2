/*
 * test_openai_sampling.c — the OpenAI / vLLM request options against
 * hand-computed values and a Hugging Face reference.
 *
 * Sampler math: presence and frequency penalties, the min_tokens EOS mask
 * and log-probabilities on small logit vectors worked out by hand. Engine:
 * min_tokens and ignore_eos on the tiny llama fixture (its greedy token made
 * an EOS id), and the logprobs the engine reports for greedy tokens equal
 * log-softmax of the fixture's float64 reference logits (transformers).
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_util.h"

#include "core/sampler.h"
#include "runtime/engine/engine.h"

#define GOLDEN FL_TEST_DATA "/golden/"

static void test_penalties(void **state) {
    (void)state;
    float x[6] = {1, 2, 3, 4, 5, -1};
    const int32_t gen[5] = {1, 3, 3, 3, 5};
    uint8_t seen[6] = {0};
    assert_int_equal(fl_sampler_penalize_counts(x, 6, gen, 5, 0.5f, 0.25f, seen), FL_OK);
    /* id 1 once: 2 - 0.5 - 0.25; id 3 three times: 4 - 0.5 - 3 * 0.25; id 5 once: -1 - 0.75 */
    const float want[6] = {1, 1.25f, 3, 2.75f, 5, -1.75f};
    for (int i = 0; i < 6; i++) assert_float_equal(x[i], want[i], 1e-6);
    for (int i = 0; i < 6; i++) assert_int_equal(seen[i], 0); /* left clean for the next row */
    /* negative penalties reward repetition (OpenAI allows [-2, 2]) */
    float y[3] = {0, 0, 0};
    const int32_t g2[3] = {2, 2, 0};
    assert_int_equal(fl_sampler_penalize_counts(y, 3, g2, 3, -1.0f, 0.0f, seen), FL_OK);
    assert_float_equal(y[0], 1, 1e-6);
    assert_float_equal(y[1], 0, 1e-6);
    assert_float_equal(y[2], 1, 1e-6);
    const int32_t bad_id[1] = {6};
    assert_int_equal(fl_sampler_penalize_counts(x, 6, bad_id, 1, 1, 1, seen), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "generated[0] = 6"));
}

static void test_mask(void **state) {
    (void)state;
    float x[4] = {3, 2, 1, 0};
    const int32_t ids[3] = {0, -1, 9}; /* out-of-range ids are skipped */
    fl_sampler_mask_ids(x, 4, ids, 3);
    assert_true(isinf(x[0]) && x[0] < 0);
    assert_float_equal(x[1], 2, 0);
    /* greedy now takes the next best: what min_tokens relies on */
    fl_sampling_params p;
    fl_sampling_params_default(&p);
    void *ws = malloc(fl_sampler_workspace_size(4));
    int32_t tok = -1;
    assert_int_equal(fl_sampler_sample(&p, x, 4, NULL, 0, NULL, ws, &tok), FL_OK);
    assert_int_equal(tok, 1);
    free(ws);
}

static void test_logprobs(void **state) {
    (void)state;
    /* probabilities 1/10, 2/10, 3/10, 4/10 (+ a masked token) */
    const float x[5] = {logf(1), logf(2), logf(3), logf(4), -INFINITY};
    float lp, tl[3];
    int32_t ti[3];
    assert_int_equal(fl_sampler_logprobs(x, 5, 1, 3, &lp, ti, tl), FL_OK);
    assert_float_equal(lp, log(0.2), 1e-6);
    assert_int_equal(ti[0], 3);
    assert_int_equal(ti[1], 2);
    assert_int_equal(ti[2], 1);
    assert_float_equal(tl[0], log(0.4), 1e-6);
    assert_float_equal(tl[1], log(0.3), 1e-6);
    assert_float_equal(tl[2], lp, 0); /* the chosen token's entry is its logprob */
    assert_int_equal(fl_sampler_logprobs(x, 5, 4, 0, &lp, NULL, NULL), FL_OK);
    assert_true(isinf(lp) && lp < 0);
    /* ties: the lower id first, like the greedy pick */
    const float t[4] = {1, 5, 5, 0};
    assert_int_equal(fl_sampler_logprobs(t, 4, 0, 2, &lp, ti, tl), FL_OK);
    assert_int_equal(ti[0], 1);
    assert_int_equal(ti[1], 2);
    assert_int_equal(fl_sampler_logprobs(t, 4, 0, 21, &lp, ti, tl), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_sampler_logprobs(t, 4, 4, 1, &lp, ti, tl), FL_ERR_INVALID_ARG);
}

/* ---- engine on the tiny llama fixture ------------------------------------ */

typedef struct rig {
    fl_test_golden fx;
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    fl_engine *e;
} rig;

static void rig_open(rig *r, const int32_t *extra_eos, int n_extra) {
    memset(r, 0, sizeof *r);
    fl_test_golden_load(GOLDEN, "llama", NULL, 0, &r->fx);
    assert_int_equal(fl_ckpt_open(r->fx.dir, &r->ck), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&r->be), FL_OK);
    fl_model_load_opts lo = {.quant = FL_LOAD_AS_STORED};
    assert_int_equal(fl_model_load(r->ck, r->be, &lo, &r->m), FL_OK);
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.kv_cache_bytes = 64 << 20;
    ec.max_model_len = r->fx.T + 16;
    ec.extra_eos = extra_eos;
    ec.n_extra_eos = n_extra;
    assert_int_equal(fl_engine_init(r->m, &ec, &r->e), FL_OK);
}

static void rig_close(rig *r) {
    fl_engine_free(r->e);
    fl_model_free(r->m);
    fl_backend_free(r->be);
    fl_ckpt_free(r->ck);
    fl_test_golden_free(&r->fx);
}

static void run_all(fl_engine *e) {
    while (fl_engine_has_work(e)) {
        fl_gen **up;
        int nu;
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
    }
}

/* The fixture's first greedy token made an EOS id: plain greedy stops on it
 * at once; min_tokens = 3 masks it for three tokens; ignore_eos emits it and
 * runs to max_tokens. */
static void test_min_tokens_ignore_eos(void **state) {
    (void)state;
    rig r0;
    rig_open(&r0, NULL, 0);
    const int32_t t0 = r0.fx.greedy[0];
    const int T = r0.fx.T;
    rig_close(&r0);
    rig r;
    rig_open(&r, &t0, 1);
    fl_gen a, b, c;
    assert_int_equal(fl_gen_init(&a, 0, r.fx.prompt, T, NULL, 5), FL_OK);
    assert_int_equal(fl_gen_init(&b, 1, r.fx.prompt, T, NULL, 5), FL_OK);
    assert_int_equal(fl_gen_init(&c, 2, r.fx.prompt, T, NULL, 5), FL_OK);
    b.min_tokens = 3;
    c.ignore_eos = true;
    assert_int_equal(fl_engine_add(r.e, &a), FL_OK);
    assert_int_equal(fl_engine_add(r.e, &b), FL_OK);
    assert_int_equal(fl_engine_add(r.e, &c), FL_OK);
    run_all(r.e);
    assert_int_equal(fl_gen_n_generated(&a), 1);
    assert_int_equal(a.finish, FL_FINISH_STOP);
    assert_int_equal(a.seq.tokens[T], t0);
    assert_true(fl_gen_n_generated(&b) >= 3);
    for (int i = 0; i < 3; i++) assert_int_not_equal(b.seq.tokens[T + i], t0);
    assert_int_equal(fl_gen_n_generated(&c), 5);
    assert_int_equal(c.finish, FL_FINISH_LENGTH);
    assert_int_equal(c.seq.tokens[T], t0);
    fl_gen_free(&a);
    fl_gen_free(&b);
    fl_gen_free(&c);
    rig_close(&r);
}

/* Golden: for prompts cut at several lengths k, the first greedy token's
 * logprob and top-5 equal log-softmax of the reference logits at position
 * k - 1 (computed here in double), and the greedy token is the most likely. */
static void test_logprobs_golden(void **state) {
    (void)state;
    rig r;
    rig_open(&r, NULL, 0);
    const int T = r.fx.T, V = r.fx.V;
    double worst = 0;
    for (int k = 1; k <= T; k += (T > 8 ? T / 8 : 1)) {
        fl_gen g;
        assert_int_equal(fl_gen_init(&g, k, r.fx.prompt, k, NULL, 1), FL_OK);
        g.want_logprobs = true;
        g.top_logprobs = 5;
        g.ignore_eos = true;
        assert_int_equal(fl_engine_add(r.e, &g), FL_OK);
        run_all(r.e);
        assert_int_equal(fl_gen_n_generated(&g), 1);
        assert_non_null(g.lp);
        const double *ref = r.fx.ref + (size_t)(k - 1) * V;
        double m = ref[0], z = 0;
        for (int v = 1; v < V; v++) m = ref[v] > m ? ref[v] : m;
        for (int v = 0; v < V; v++) z += exp(ref[v] - m);
        const double lz = m + log(z);
        const int32_t tok = g.seq.tokens[k];
        const fl_token_logprob *lp = &g.lp[0];
        double d = fabs(lp->logprob - (ref[tok] - lz));
        worst = d > worst ? d : worst;
        assert_int_equal(lp->n_top, 5);
        assert_int_equal(lp->top_ids[0], tok); /* greedy = the most likely */
        for (int i = 0; i < 5; i++) {
            d = fabs(lp->top_lps[i] - (ref[lp->top_ids[i]] - lz));
            worst = d > worst ? d : worst;
            assert_true(lp->top_lps[i] <= 0);
            if (i) assert_true(lp->top_lps[i] <= lp->top_lps[i - 1]);
        }
        fl_gen_free(&g);
    }
    printf("  logprobs vs log-softmax(reference): max abs err %.2e\n", worst);
    if (!(worst <= 1e-5)) fail_msg("logprob error %.3e > 1e-5", worst);
    rig_close(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_mask),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_min_tokens_ignore_eos),
        cmocka_unit_test(test_logprobs_golden),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
