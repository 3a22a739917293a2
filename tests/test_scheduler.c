/*
 * test_scheduler.c — continuous batching invariants on random workloads:
 * every plan is internally consistent, no KV block is shared by two
 * sequences, budgets and max_num_seqs hold, every request completes with
 * exactly its tokens, preemption happens when the cache is short, and all
 * blocks come back at the end.
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roomy_cache),
        cmocka_unit_test(test_short_cache_preempts),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_refuses_impossible),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
