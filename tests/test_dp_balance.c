/*
 * test_dp_balance.c — data-parallel request placement on rank 0 without
 * mpirun: fl_engine_pick_replica sends a request to the replica holding the
 * fewest running + waiting tokens (ties to the lowest index), counting both
 * queued and running sequences and generated tokens; an engine asked for
 * dp > 1 without the world communicator is refused with a message naming dp.
 * (The replicas' forward passes under mpirun are checked against one rank by
 * tests/test_mpi_golden.sh.)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "runtime/engine/engine.h"

static void add_seq(fl_scheduler *s, fl_seq *q, int64_t id, int n) {
    int32_t prompt[64];
    for (int i = 0; i < n; i++) prompt[i] = i + 1;
    assert_int_equal(fl_seq_init(q, id, prompt, n), FL_OK);
    assert_int_equal(fl_scheduler_add(s, q), FL_OK);
}

static void test_pick_replica(void **state) {
    (void)state;
    fl_sched_config cfg = {.block_size = 4, .n_blocks = 64, .max_num_seqs = 8,
                           .max_num_batched_tokens = 64, .max_model_len = 128};
    fl_scheduler s[3];
    fl_seq q[5];
    for (int r = 0; r < 3; r++) assert_int_equal(fl_scheduler_init(&s[r], &cfg), FL_OK);
    assert_int_equal(fl_engine_pick_replica(s, 3), 0); /* all empty: the lowest */
    assert_int_equal(fl_engine_pick_replica(s, 1), 0);
    add_seq(&s[0], &q[0], 0, 10);
    assert_int_equal(fl_engine_pick_replica(s, 3), 1);
    add_seq(&s[1], &q[1], 1, 4);
    assert_int_equal(fl_engine_pick_replica(s, 3), 2);
    add_seq(&s[2], &q[2], 2, 4);
    assert_int_equal(fl_engine_pick_replica(s, 3), 1); /* 10, 4, 4: tie, the lower */
    /* replica 1's sequence runs and grows by two generated tokens: 10, 6, 4 */
    fl_step_plan plan = {0};
    assert_int_equal(fl_scheduler_schedule(&s[1], &plan), FL_OK);
    assert_int_equal(plan.n_tokens, 4);
    fl_scheduler_step_done(&s[1]);
    assert_int_equal(fl_seq_append(&q[1], 7), FL_OK);
    assert_int_equal(fl_seq_append(&q[1], 8), FL_OK);
    assert_int_equal(s[1].n_running, 1);
    assert_int_equal(fl_engine_pick_replica(s, 3), 2);
    /* waiting and running both count: 10, 6 + 3, 4 + 6 */
    add_seq(&s[1], &q[3], 3, 3);
    add_seq(&s[2], &q[4], 4, 6);
    assert_int_equal(fl_engine_pick_replica(s, 3), 1);
    /* a finished sequence no longer counts: 0, 9, 10 */
    fl_scheduler_finish(&s[0], &q[0]);
    assert_int_equal(fl_engine_pick_replica(s, 3), 0);
    assert_int_equal(fl_engine_pick_replica(s + 1, 2), 0); /* 9 vs 10 */
    fl_step_plan_free(&plan);
    for (int i = 0; i < 5; i++) fl_seq_free(&q[i]);
    for (int r = 0; r < 3; r++) fl_scheduler_free(&s[r]);
}

static void test_dp_needs_world(void **state) {
    (void)state;
    fl_ckpt *ck = NULL;
    fl_backend *be = NULL;
    fl_model *m = NULL;
    assert_int_equal(fl_ckpt_open(FL_TEST_DATA "/loader/tiny_llama", &ck), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    assert_int_equal(fl_model_load(ck, be, NULL, &m), FL_OK);
    fl_engine_config c;
    fl_engine_config_default(&c);
    assert_int_equal(c.dp, 1);
    c.n_blocks = 8;
    c.dp = 2; /* world left MPI_COMM_NULL */
    fl_engine *e = NULL;
    assert_int_equal(fl_engine_init(m, &c, &e), FL_ERR_INVALID_ARG);
    assert_null(e);
    assert_non_null(strstr(fl_error_msg(), "dp 2"));
    c.dp = 1; /* the same config with one replica runs */
    assert_int_equal(fl_engine_init(m, &c, &e), FL_OK);
    assert_true(fl_engine_is_leader(e));
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    fl_ckpt_free(ck);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pick_replica),
        cmocka_unit_test(test_dp_needs_world),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
