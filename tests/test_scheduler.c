/*
 * test_scheduler.c — continuous batching invariants on random workloads:
 * every plan is internally consistent, no KV block is shared by two
 * sequences, budgets and max_num_seqs hold, every request completes with
 * exactly its tokens, preemption happens when the cache is short, and all
 * blocks come back at the end. Preemption by swap runs against a simulated
 * cache and host pool that execute each plan's moves, so every step's
 * context is checked slot by slot, with prefix caching on; and the cost
 * model's decision is checked on its own.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "runtime/engine/scheduler.h"

static uint32_t lcg = 12345;
static int rnd(int n) {
    lcg = lcg * 1103515245u + 12345u;
    return (int)((lcg >> 8) % (uint32_t)n);
}

typedef struct workload {
    int n_seqs, max_prompt, max_new;
    fl_sched_config cfg;
} workload;

/* Runs a workload to completion; returns the scheduler's preemption count. */
static int64_t run(const workload *w) {
    fl_scheduler s;
    assert_int_equal(fl_scheduler_init(&s, &w->cfg), FL_OK);
    fl_seq *seqs = calloc((size_t)w->n_seqs, sizeof *seqs);
    int *max_new = calloc((size_t)w->n_seqs, sizeof(int));
    int32_t prompt[256];
    for (int i = 0; i < w->n_seqs; i++) {
        int n = 1 + rnd(w->max_prompt);
        for (int j = 0; j < n; j++) prompt[j] = i * 1000 + j;
        assert_int_equal(fl_seq_init(&seqs[i], i, prompt, n), FL_OK);
        max_new[i] = 1 + rnd(w->max_new);
        assert_int_equal(fl_scheduler_add(&s, &seqs[i]), FL_OK);
    }
    fl_step_plan plan = {0};
    int done = 0, steps = 0;
    char *owner = malloc((size_t)w->cfg.n_blocks);
    while (fl_scheduler_has_work(&s)) {
        assert_true(++steps < 100000);
        assert_int_equal(fl_scheduler_schedule(&s, &plan), FL_OK);
        assert_true(plan.n_tokens > 0); /* this workload always fits */
        assert_true(plan.n_tokens <= w->cfg.max_num_batched_tokens);
        assert_true(plan.n_seqs <= w->cfg.max_num_seqs);
        assert_int_equal(fl_step_plan_validate(&plan, (int64_t)w->cfg.n_blocks * w->cfg.block_size),
                         FL_OK);
        /* the plan carries the right tokens, and blocks are exclusive */
        memset(owner, -1, (size_t)w->cfg.n_blocks);
        for (int i = 0; i < s.n_step; i++) {
            fl_seq *q = s.step[i];
            for (int j = 0; j < q->n_blocks; j++) {
                assert_int_equal(owner[q->blocks[j]], -1);
                owner[q->blocks[j]] = (char)i;
            }
            for (int r = plan.q_start[i]; r < plan.q_start[i + 1]; r++)
                assert_int_equal(plan.tokens[r], q->tokens[plan.positions[r]]);
        }
        fl_scheduler_step_done(&s);
        for (int i = 0; i < s.n_step; i++) {
            fl_seq *q = s.step[i];
            if (!q->step_sample) continue;
            int id = (int)q->id;
            assert_int_equal(fl_seq_append(q, id * 1000 + q->n_tokens), FL_OK);
            if (q->n_tokens - q->n_prompt >= max_new[id] || q->n_tokens >= w->cfg.max_model_len) {
                fl_scheduler_finish(&s, q);
                done++;
            }
        }
    }
    assert_int_equal(done, w->n_seqs);
    assert_int_equal(s.blocks.n_free, w->cfg.n_blocks);
    for (int i = 0; i < w->n_seqs; i++) {
        /* the token stream is exactly prompt + generated, in order */
        for (int j = 0; j < seqs[i].n_tokens; j++) assert_int_equal(seqs[i].tokens[j], i * 1000 + j);
        fl_seq_free(&seqs[i]);
    }
    int64_t pre = s.n_preemptions;
    fl_step_plan_free(&plan);
    fl_scheduler_free(&s);
    free(owner);
    free(seqs);
    free(max_new);
    return pre;
}

static void test_roomy_cache(void **state) {
    (void)state;
    workload w = {.n_seqs = 60, .max_prompt = 40, .max_new = 20,
                  .cfg = {.block_size = 16, .n_blocks = 400, .max_num_seqs = 8,
                          .max_num_batched_tokens = 64, .max_model_len = 512}};
    assert_int_equal(run(&w), 0);
}

static void test_short_cache_preempts(void **state) {
    (void)state;
    workload w = {.n_seqs = 40, .max_prompt = 30, .max_new = 30,
                  .cfg = {.block_size = 4, .n_blocks = 24, .max_num_seqs = 6,
                          .max_num_batched_tokens = 16, .max_model_len = 64}};
    assert_true(run(&w) > 0);
}

static void test_chunked_prefill(void **state) {
    (void)state;
    workload w = {.n_seqs = 10, .max_prompt = 200, .max_new = 5,
                  .cfg = {.block_size = 16, .n_blocks = 200, .max_num_seqs = 4,
                          .max_num_batched_tokens = 7, .max_model_len = 256}};
    run(&w);
}

static void test_refuses_impossible(void **state) {
    (void)state;
    fl_sched_config cfg = {.block_size = 4, .n_blocks = 2, .max_num_seqs = 2,
                           .max_num_batched_tokens = 8, .max_model_len = 64};
    fl_scheduler s;
    assert_int_equal(fl_scheduler_init(&s, &cfg), FL_OK);
    int32_t p[64] = {0};
    fl_seq a, b;
    assert_int_equal(fl_seq_init(&a, 0, p, 64), FL_OK);
    assert_int_equal(fl_scheduler_add(&s, &a), FL_ERR_INVALID_ARG); /* > max_model_len */
    assert_int_equal(fl_seq_init(&b, 1, p, 20), FL_OK);
    assert_int_equal(fl_scheduler_add(&s, &b), FL_ERR_INVALID_ARG); /* > cache */
    fl_seq_free(&a);
    fl_seq_free(&b);
    fl_scheduler_free(&s);
    cfg.max_num_seqs = 0;
    assert_int_equal(fl_scheduler_init(&s, &cfg), FL_ERR_INVALID_ARG);
}

/* The cost model: copying out and back against re-prefilling. */
static void test_swap_pays(void **state) {
    (void)state;
    assert_false(fl_sched_swap_pays(0, 100, 1e-6, 1000));  /* nothing private to copy */
    assert_true(fl_sched_swap_pays(3, 48, 1e-3, 0));       /* prefill rate not measured yet */
    /* 10 blocks: 2 x 10 x 1 ms = 20 ms to copy < 160 tokens at 1000 tok/s = 160 ms */
    assert_true(fl_sched_swap_pays(10, 160, 1e-3, 1000));
    /* a short sequence: 2 x 1 ms to copy > 1 token at 1000 tok/s = 1 ms */
    assert_false(fl_sched_swap_pays(1, 1, 1e-3, 1000));
    /* the boundary: equal costs recompute */
    assert_false(fl_sched_swap_pays(1, 2, 1e-3, 1000));
    assert_true(fl_sched_swap_pays(1, 3, 1e-3, 1000));
}

typedef struct swap_stats {
    int64_t preemptions, swaps, blocks_out, blocks_in;
} swap_stats;

/* Runs a workload whose prompts share a 9-token prefix against a simulated
 * device cache and host pool (one token id a slot): each step first makes
 * the plan's swap-outs then swap-ins, then writes the step's rows, and every
 * sequence of the step must then find its exact tokens in its context. */
static swap_stats run_swapping(const workload *w) {
    fl_scheduler s;
    assert_int_equal(fl_scheduler_init(&s, &w->cfg), FL_OK);
    const int bs = w->cfg.block_size, nh = w->cfg.n_host_blocks > 0 ? w->cfg.n_host_blocks : 1;
    int32_t *dev = malloc((size_t)w->cfg.n_blocks * bs * sizeof *dev);
    int32_t *host = malloc((size_t)nh * bs * sizeof *host);
    fl_seq *seqs = calloc((size_t)w->n_seqs, sizeof *seqs);
    int *max_new = calloc((size_t)w->n_seqs, sizeof(int));
    int32_t prompt[256];
    for (int i = 0; i < w->n_seqs; i++) {
        int n = 10 + rnd(w->max_prompt);
        for (int j = 0; j < n; j++) prompt[j] = j < 9 ? 7 * j + 1 : i * 1000 + j;
        assert_int_equal(fl_seq_init(&seqs[i], i, prompt, n), FL_OK);
        max_new[i] = 1 + rnd(w->max_new);
        assert_int_equal(fl_scheduler_add(&s, &seqs[i]), FL_OK);
    }
    fl_step_plan plan = {0};
    int done = 0, steps = 0;
    while (fl_scheduler_has_work(&s)) {
        assert_true(++steps < 100000);
        assert_int_equal(fl_scheduler_schedule(&s, &plan), FL_OK);
        assert_true(plan.n_tokens > 0);
        assert_int_equal(fl_step_plan_validate(&plan, (int64_t)w->cfg.n_blocks * bs), FL_OK);
        assert_true(plan.n_swap_out <= nh && plan.n_swap_in <= nh);
        for (int i = 0; i < plan.n_swap_out; i++) {
            const int32_t d = plan.swap_out[2 * i], h = plan.swap_out[2 * i + 1];
            assert_true(d >= 0 && d < w->cfg.n_blocks && h >= 0 && h < nh);
            memcpy(host + (size_t)h * bs, dev + (size_t)d * bs, (size_t)bs * sizeof *dev);
        }
        for (int i = 0; i < plan.n_swap_in; i++) {
            const int32_t h = plan.swap_in[2 * i], d = plan.swap_in[2 * i + 1];
            assert_true(d >= 0 && d < w->cfg.n_blocks && h >= 0 && h < nh);
            memcpy(dev + (size_t)d * bs, host + (size_t)h * bs, (size_t)bs * sizeof *dev);
        }
        for (int r = 0; r < plan.n_tokens; r++) dev[plan.slots[r]] = plan.tokens[r];
        for (int i = 0; i < s.n_step; i++) {
            fl_seq *q = s.step[i];
            assert_int_equal(q->n_swapped, 0);
            for (int pos = 0; pos < plan.ctx_len[i]; pos++) {
                const int32_t blk = plan.block_tables[(size_t)i * plan.max_blocks + pos / bs];
                assert_int_equal(dev[blk * bs + pos % bs], q->tokens[pos]);
            }
        }
        fl_scheduler_step_done(&s);
        for (int i = 0; i < s.n_step; i++) {
            fl_seq *q = s.step[i];
            if (!q->step_sample) continue;
            int id = (int)q->id;
            assert_int_equal(fl_seq_append(q, id * 1000 + q->n_tokens), FL_OK);
            if (q->n_tokens - q->n_prompt >= max_new[id] || q->n_tokens >= w->cfg.max_model_len) {
                fl_scheduler_finish(&s, q);
                done++;
            }
        }
    }
    assert_int_equal(done, w->n_seqs);
    /* every block is back: device ones free or cached, host ones free */
    assert_int_equal(fl_kv_blocks_n_available(&s.blocks), w->cfg.n_blocks);
    assert_int_equal(s.n_host_free + s.n_host_pending, w->cfg.n_host_blocks);
    swap_stats st = {s.n_preemptions, s.n_swap_preemptions, s.blocks_swapped_out, s.blocks_swapped_in};
    for (int i = 0; i < w->n_seqs; i++) fl_seq_free(&seqs[i]);
    fl_step_plan_free(&plan);
    fl_scheduler_free(&s);
    free(dev);
    free(host);
    free(seqs);
    free(max_new);
    return st;
}

static workload swap_workload(int n_host_blocks, double copy_s) {
    return (workload){.n_seqs = 40, .max_prompt = 30, .max_new = 40,
                      .cfg = {.block_size = 4, .n_blocks = 30, .max_num_seqs = 6, .max_num_batched_tokens = 16,
                              .max_model_len = 96, .prefix_caching = true, .prefix_seed = 99,
                              .n_host_blocks = n_host_blocks, .block_copy_seconds = copy_s}};
}

/* A roomy pool: every preemption swaps (prefill rate unmeasured: swapping
 * pays), and blocks come back in (or from the prefix cache). */
static void test_swap_preempts(void **state) {
    (void)state;
    workload w = swap_workload(200, 1e-3);
    swap_stats st = run_swapping(&w);
    print_message("  swap: %lld preemptions, %lld by swap, %lld blocks out, %lld in\n", (long long)st.preemptions,
                  (long long)st.swaps, (long long)st.blocks_out, (long long)st.blocks_in);
    assert_true(st.preemptions > 0);
    assert_int_equal(st.swaps, st.preemptions);
    assert_true(st.blocks_out > 0 && st.blocks_in > 0 && st.blocks_in <= st.blocks_out);
}

/* A pool of 3 blocks: swap while it has room, recompute when it is full. */
static void test_swap_pool_full(void **state) {
    (void)state;
    workload w = swap_workload(3, 1e-3);
    swap_stats st = run_swapping(&w);
    print_message("  tiny pool: %lld preemptions, %lld by swap\n", (long long)st.preemptions, (long long)st.swaps);
    assert_true(st.swaps > 0 && st.swaps < st.preemptions);
}

/* No pool, and a pool whose copies cost more than any recompute: only
 * recompute (the scheduler measures no rate, so set one). */
static void test_swap_off_or_dear(void **state) {
    (void)state;
    workload w = swap_workload(0, 1e-3);
    swap_stats st = run_swapping(&w);
    assert_true(st.preemptions > 0);
    assert_int_equal(st.swaps, 0);
    assert_int_equal(st.blocks_out, 0);
    /* 1000 s a block: never pays once a prefill rate is known */
    fl_scheduler s;
    w = swap_workload(200, 1000.0);
    assert_int_equal(fl_scheduler_init(&s, &w.cfg), FL_OK);
    s.prefill_tok_per_s = 1e3;
    int32_t p[40];
    fl_seq a[3];
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 40; j++) p[j] = i * 100 + j;
        assert_int_equal(fl_seq_init(&a[i], i, p, 40), FL_OK);
        assert_int_equal(fl_scheduler_add(&s, &a[i]), FL_OK);
    }
    fl_step_plan plan = {0};
    for (int k = 0; k < 40 && fl_scheduler_has_work(&s); k++) {
        assert_int_equal(fl_scheduler_schedule(&s, &plan), FL_OK);
        assert_int_equal(plan.n_swap_out, 0);
        fl_scheduler_step_done(&s);
        for (int i = 0; i < s.n_step; i++)
            if (s.step[i]->step_sample) assert_int_equal(fl_seq_append(s.step[i], 5), FL_OK);
    }
    assert_true(s.n_preemptions > 0);
    assert_int_equal(s.n_swap_preemptions, 0);
    for (int i = 0; i < 3; i++) fl_seq_free(&a[i]);
    fl_step_plan_free(&plan);
    fl_scheduler_free(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roomy_cache),
        cmocka_unit_test(test_short_cache_preempts),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_refuses_impossible),
        cmocka_unit_test(test_swap_pays),
        cmocka_unit_test(test_swap_preempts),
        cmocka_unit_test(test_swap_pool_full),
        cmocka_unit_test(test_swap_off_or_dear),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
