/*
 * test_prefix_engine.c — prefix caching must not change results: the same
 * requests (one shared prefix, different suffixes, one prompt that is the
 * bare prefix, one repeated prompt) give the same greedy tokens and
 * bit-identical logits with prefix caching on and off, in a roomy cache
 * (everything in few steps, blocks shared within a step) and in a tight one
 * (chunked prefill, preemption, eviction); the caching run must actually
 * share. Models: the transformers-written tiny Llama and the golden fixtures
 * (dense Llama, Qwen2-MoE, and DeepSeek-V2 for MLA's latent cache), whose
 * own prompt is one of the requests and must still give the reference
 * greedy continuation; and the demo model (same tokens, logits within
 * 1e-5).
 */
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

#include "runtime/engine/engine.h"

enum { NREQ = 7, NEW = 6, MAXP = 64 };

typedef struct run_out {
    int32_t tokens[NREQ][NEW];
    int n_gen[NREQ];
    float *logits;  /* [NREQ][NEW][V] */
    int V;
    fl_engine_stats stats;
} run_out;

static void on_logits(void *ctx, const fl_gen *g, const float *logits, int V) {
    run_out *o = ctx;
    const int k = fl_gen_n_generated(g);
    assert_true(g->seq.id >= 0 && g->seq.id < NREQ && k < NEW);
    memcpy(o->logits + ((size_t)g->seq.id * NEW + k) * V, logits, (size_t)V * sizeof(float));
}

typedef struct layout {
    int n_blocks, block_size, seqs, budget;
} layout;

/* The prompts: prefix[n_prefix] followed by a suffix of 0..6 tokens;
 * request 0 is the prefix itself, request 6 repeats request 3. */
static int make_prompt(int r, const int32_t *prefix, int n_prefix, int V, int32_t *p) {
    memcpy(p, prefix, (size_t)n_prefix * sizeof *p);
    const int rr = r == NREQ - 1 ? 3 : r, ns = rr == 0 ? 0 : 1 + (rr * 5) % 7;
    for (int j = 0; j < ns; j++) p[n_prefix + j] = (rr * 31 + j * 7 + 5) % V;
    return n_prefix + ns;
}

static void run(fl_model *m, const layout *L, bool caching, const int32_t *prefix, int n_prefix, run_out *o) {
    const int V = m->cfg.vocab_size;
    fl_engine_config c;
    fl_engine_config_default(&c);
    c.greedy_on_device = false; /* logits to the host every step */
    c.sample_on_device = false;
    c.n_blocks = L->n_blocks;
    c.block_size = L->block_size;
    c.max_num_seqs = L->seqs;
    c.max_num_batched_tokens = L->budget;
    c.max_model_len = MAXP + NEW + 1;
    c.prefix_caching = caching;
    c.on_logits = on_logits;
    c.on_logits_ctx = o;
    memset(o->tokens, -1, sizeof o->tokens);
    o->V = V;
    o->logits = calloc((size_t)NREQ * NEW * V, sizeof(float));
    fl_engine *e = NULL;
    assert_int_equal(fl_engine_init(m, &c, &e), FL_OK);
    fl_gen g[NREQ];
    for (int r = 0; r < NREQ; r++) {
        int32_t p[MAXP + 8];
        const int n = make_prompt(r, prefix, n_prefix, V, p);
        assert_int_equal(fl_gen_init(&g[r], r, p, n, NULL, NEW), FL_OK);
        assert_int_equal(fl_engine_add(e, &g[r]), FL_OK);
    }
    while (fl_engine_has_work(e)) {
        fl_gen **up;
        int nu;
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
    }
    for (int r = 0; r < NREQ; r++) {
        assert_true(g[r].finish == FL_FINISH_LENGTH || g[r].finish == FL_FINISH_STOP);
        o->n_gen[r] = fl_gen_n_generated(&g[r]);
        memcpy(o->tokens[r], g[r].seq.tokens + g[r].seq.n_prompt, (size_t)o->n_gen[r] * sizeof(int32_t));
        fl_gen_free(&g[r]);
    }
    fl_engine_get_stats(e, &o->stats);
    fl_engine_free(e);
}

/* On vs off under one layout: same tokens, same logits bit for bit (tol
 * 0) or within tol relative (per row, max |diff| / max |ref|); on shares
 * what the layout allows. Returns the on run's cached tokens. */
static int64_t compare_tol(fl_model *m, const char *name, const layout *L, const int32_t *prefix, int n_prefix,
                           bool want_preemption, double tol) {
    run_out on, off;
    run(m, L, true, prefix, n_prefix, &on);
    run(m, L, false, prefix, n_prefix, &off);
    const int V = on.V;
    double worst = 0;
    for (int r = 0; r < NREQ; r++) {
        assert_int_equal(on.n_gen[r], off.n_gen[r]);
        for (int k = 0; k < on.n_gen[r]; k++) {
            if (on.tokens[r][k] != off.tokens[r][k])
                fail_msg("%s: request %d token %d: %d with prefix caching, %d without", name, r, k,
                         on.tokens[r][k], off.tokens[r][k]);
            const float *a = on.logits + ((size_t)r * NEW + k) * V, *b = off.logits + ((size_t)r * NEW + k) * V;
            if (tol > 0) {
                double num = 0, den = 0;
                for (int v = 0; v < V; v++) {
                    num = fmax(num, fabs((double)a[v] - b[v]));
                    den = fmax(den, fabs((double)b[v]));
                }
                worst = fmax(worst, num / den);
                if (!(num <= tol * den))
                    fail_msg("%s: request %d step %d: logits differ by %.3e relative", name, r, k, num / den);
            } else if (memcmp(a, b, (size_t)V * sizeof(float)) != 0) {
                int v = 0;
                while (a[v] == b[v]) v++;
                fail_msg("%s: request %d step %d: logit %d is %.9g with prefix caching, %.9g without", name,
                         r, k, v, a[v], b[v]);
            }
        }
    }
    assert_int_equal(off.stats.cached_prompt_tokens, 0);
    assert_int_equal(on.stats.prompt_tokens, off.stats.prompt_tokens);
    printf("  %-12s blocks %3d of %2d tokens, %d seqs, budget %3d: %lld of %lld prompt tokens cached, "
           "%lld preemptions (%lld without caching), logits differ by %.1e\n", name, L->n_blocks, L->block_size, L->seqs, L->budget,
           (long long)on.stats.cached_prompt_tokens, (long long)on.stats.prompt_tokens,
           (long long)on.stats.preemptions, (long long)off.stats.preemptions, worst);
    if (want_preemption) assert_true(on.stats.preemptions > 0);
    const int64_t cached = on.stats.cached_prompt_tokens;
    free(on.logits);
    free(off.logits);
    return cached;
}

static int64_t compare(fl_model *m, const char *name, const layout *L, const int32_t *prefix, int n_prefix,
                       bool want_preemption) {
    return compare_tol(m, name, L, prefix, n_prefix, want_preemption, 0);
}

/* Roomy: every request prefilled in the first step, the prefix shared by
 * the six that follow the first (request 0 is the bare prefix: its last
 * token is computed, so its last block is not shared). Tight: chunks,
 * preemption, eviction; sharing still happens. */
static void compare_layouts(fl_model *m, const char *name, const int32_t *prefix, int n_prefix) {
    const layout roomy = {.n_blocks = 96, .block_size = 4, .seqs = 8, .budget = 512};
    const layout tight = {.n_blocks = 12, .block_size = 4, .seqs = 4, .budget = 9};
    const int full = n_prefix / 4 * 4;
    /* request 0 computes the prefix; 1..6 share its full blocks */
    assert_int_equal(compare(m, name, &roomy, prefix, n_prefix, false), 6 * full);
    assert_true(compare(m, name, &tight, prefix, n_prefix, true) > 0);
}

static void test_tiny_llama(void **state) {
    (void)state;
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    assert_int_equal(fl_ckpt_open(FL_TEST_DATA "/loader/tiny_llama", &ck), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    assert_int_equal(fl_model_load(ck, be, NULL, &m), FL_OK);
    int32_t prefix[22];
    for (int i = 0; i < 22; i++) prefix[i] = (i * 11 + 2) % m->cfg.vocab_size;
    compare_layouts(m, "tiny_llama", prefix, 22);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
}

/* A golden fixture: its prompt (padded to 21 tokens) is the prefix;
 * request 0 with exactly the fixture's prompt still gives the reference
 * greedy tokens with caching on (it runs after a request that shares its
 * blocks: the first six of them share the bare prompt's blocks). */
static void golden(const char *name) {
    fl_test_golden fx;
    fl_test_golden_load(FL_TEST_DATA "/golden/", name, NULL, 1, &fx);
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    if (fl_ckpt_open(fx.dir, &ck) != FL_OK) fail_msg("%s: %s", name, fl_error_msg());
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    if (fl_model_load(ck, be, NULL, &m) != FL_OK) fail_msg("%s: %s", name, fl_error_msg());
    int32_t prefix[MAXP];
    const int n_prefix = 21;
    assert_true(fx.T <= n_prefix);
    memcpy(prefix, fx.prompt, (size_t)fx.T * sizeof *prefix);
    for (int i = fx.T; i < n_prefix; i++) prefix[i] = (i * 13 + 1) % fx.V;
    compare_layouts(m, name, prefix, n_prefix);

    /* The fixture's own prompt behind a request that starts with it. */
    fl_engine_config c;
    fl_engine_config_default(&c);
    c.block_size = 4;
    c.n_blocks = 64;
    c.max_model_len = MAXP + NEW + 1;
    fl_engine *e;
    assert_int_equal(fl_engine_init(m, &c, &e), FL_OK);
    fl_gen first, ref;
    assert_int_equal(fl_gen_init(&first, 0, prefix, n_prefix, NULL, 2), FL_OK);
    assert_int_equal(fl_gen_init(&ref, 1, fx.prompt, fx.T, NULL, fx.n_greedy), FL_OK);
    assert_int_equal(fl_engine_add(e, &first), FL_OK);
    assert_int_equal(fl_engine_add(e, &ref), FL_OK);
    while (fl_engine_has_work(e)) {
        fl_gen **up;
        int nu;
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
    }
    fl_engine_stats st;
    fl_engine_get_stats(e, &st);
    assert_int_equal(st.cached_prompt_tokens, (fx.T - 1) / 4 * 4);
    for (int i = 0; i < fx.n_greedy && i < fl_gen_n_generated(&ref); i++)
        if (ref.seq.tokens[fx.T + i] != fx.greedy[i])
            fail_msg("%s: greedy token %d is %d with a cached prefix, reference %d", name, i,
                     ref.seq.tokens[fx.T + i], fx.greedy[i]);
    assert_true(fl_gen_n_generated(&ref) > 0);
    fl_gen_free(&first);
    fl_gen_free(&ref);
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
    fl_test_golden_free(&fx);
}

static void test_golden_llama(void **state) {
    (void)state;
    golden("llama");
}

static void test_golden_qwen2_moe(void **state) {
    (void)state;
    golden("qwen2_moe");
}

static void test_golden_deepseek_v2(void **state) {
    (void)state;
    golden("deepseek_v2");
}

/* Dynamic-NTK RoPE rotates K by the prompt's length: the engine turns
 * prefix caching off for it, and says so in its config. */
static void test_dynamic_rope_off(void **state) {
    (void)state;
    fl_test_golden fx;
    fl_test_golden_load(FL_TEST_DATA "/golden/", "llama_dynamic", NULL, 1, &fx);
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    assert_int_equal(fl_ckpt_open(fx.dir, &ck), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    assert_int_equal(fl_model_load(ck, be, NULL, &m), FL_OK);
    int32_t prefix[MAXP];
    for (int i = 0; i < 21; i++) prefix[i] = i < fx.T ? fx.prompt[i] : (i * 13 + 1) % fx.V;
    run_out o;
    const layout roomy = {.n_blocks = 96, .block_size = 4, .seqs = 8, .budget = 512};
    run(m, &roomy, true, prefix, 21, &o);
    assert_int_equal(o.stats.cached_prompt_tokens, 0);
    assert_true(o.stats.prompt_tokens > 0);
    free(o.logits);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
    fl_test_golden_free(&fx);
}

/* The demo model (SmolLM2-135M as Q4_1/Q8_0 GGUF, scripts/fetch_demo_model.sh;
 * FL_DEMO_GGUF): the same tokens; logits within 1e-5 relative, since the
 * CPU W4 matmul sums in another order below 4 rows (docs/engine.md). */
static void test_demo_model(void **state) {
    (void)state;
    const char *path = getenv("FL_DEMO_GGUF");
    if (!path || !*path) path = FL_TEST_DATA "/../models/SmolLM2-135M-Instruct.Q4_1.gguf";
    fl_ckpt *ck;
    fl_backend *be;
    fl_model *m;
    if (fl_ckpt_open(path, &ck) != FL_OK)
        fail_msg("demo model: %s (scripts/fetch_demo_model.sh, or set FL_DEMO_GGUF)", fl_error_msg());
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    assert_int_equal(fl_model_load(ck, be, NULL, &m), FL_OK);
    int32_t prefix[40];
    for (int i = 0; i < 40; i++) prefix[i] = 1000 + (i * 37) % 5000;
    const layout roomy = {.n_blocks = 96, .block_size = 16, .seqs = 8, .budget = 512};
    /* 6 requests share the prefix's 2 whole blocks */
    assert_int_equal(compare_tol(m, "demo", &roomy, prefix, 40, false, 1e-5), 6 * 32);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_llama),
        cmocka_unit_test(test_golden_llama),
        cmocka_unit_test(test_golden_qwen2_moe),
        cmocka_unit_test(test_golden_deepseek_v2),
        cmocka_unit_test(test_dynamic_rope_off),
        cmocka_unit_test(test_demo_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
