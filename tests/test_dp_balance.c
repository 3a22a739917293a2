/*
 * test_dp_balance.c — data-parallel request placement on rank 0 without
 * mpirun: without prefix caching fl_engine_pick_replica sends a request to
 * the replica holding the fewest running + waiting tokens (ties to the
 * lowest index), counting both queued and running sequences and generated
 * tokens; with it, a request follows its prefix to the replica that caches
 * it or that a request sharing it was sent to, while the loads differ by
 * less than FL_ROUTE_PREFIX_WEIGHT times the shared tokens; the route set
 * counts, forgets and survives growth; an engine asked for dp > 1 without
 * the world communicator is refused with a message naming dp.
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
    for (int i = 0; i < n; i++) prompt[i] = (int32_t)(i + 1 + 100 * id); /* no two share a block */
    assert_int_equal(fl_seq_init(q, id, prompt, n), FL_OK);
    assert_int_equal(fl_scheduler_add(s, q), FL_OK);
}

/* The pick for a fresh 5-token request, no route sets. */
static int pick(fl_scheduler *s, int dp) {
    const int32_t t[5] = {-1, -2, -3, -4, -5};
    fl_seq q;
    assert_int_equal(fl_seq_init(&q, 99, t, 5), FL_OK);
    const int r = fl_engine_pick_replica(s, NULL, dp, &q);
    fl_seq_free(&q);
    return r;
}

static void test_pick_replica(void **state) {
    (void)state;
    fl_sched_config cfg = {.block_size = 4, .n_blocks = 64, .max_num_seqs = 8,
                           .max_num_batched_tokens = 64, .max_model_len = 128};
    fl_scheduler s[3];
    fl_seq q[5];
    for (int r = 0; r < 3; r++) assert_int_equal(fl_scheduler_init(&s[r], &cfg), FL_OK);
    assert_int_equal(pick(s, 3), 0); /* all empty: the lowest */
    assert_int_equal(pick(s, 1), 0);
    add_seq(&s[0], &q[0], 0, 10);
    assert_int_equal(pick(s, 3), 1);
    add_seq(&s[1], &q[1], 1, 4);
    assert_int_equal(pick(s, 3), 2);
    add_seq(&s[2], &q[2], 2, 4);
    assert_int_equal(pick(s, 3), 1); /* 10, 4, 4: tie, the lower */
    /* replica 1's sequence runs and grows by two generated tokens: 10, 6, 4 */
    fl_step_plan plan = {0};
    assert_int_equal(fl_scheduler_schedule(&s[1], &plan), FL_OK);
    assert_int_equal(plan.n_tokens, 4);
    fl_scheduler_step_done(&s[1]);
    assert_int_equal(fl_seq_append(&q[1], 7), FL_OK);
    assert_int_equal(fl_seq_append(&q[1], 8), FL_OK);
    assert_int_equal(s[1].n_running, 1);
    assert_int_equal(pick(s, 3), 2);
    /* waiting and running both count: 10, 6 + 3, 4 + 6 */
    add_seq(&s[1], &q[3], 3, 3);
    add_seq(&s[2], &q[4], 4, 6);
    assert_int_equal(pick(s, 3), 1);
    /* a finished sequence no longer counts: 0, 9, 10 */
    fl_scheduler_finish(&s[0], &q[0]);
    assert_int_equal(pick(s, 3), 0);
    assert_int_equal(pick(s + 1, 2), 0); /* 9 vs 10 */
    fl_step_plan_free(&plan);
    for (int i = 0; i < 5; i++) fl_seq_free(&q[i]);
    for (int r = 0; r < 3; r++) fl_scheduler_free(&s[r]);
}

/* A prompt of n tokens: the first `shared` from group g, the rest its own. */
static void prompt_of(fl_seq *q, int64_t id, int g, int shared, int n) {
    int32_t t[128];
    for (int i = 0; i < n; i++) t[i] = i < shared ? 1000 * (g + 1) + i : (int32_t)(100000 + 1000 * id + i);
    assert_int_equal(fl_seq_init(q, id, t, n), FL_OK);
}

static void test_pick_prefix(void **state) {
    (void)state;
    fl_sched_config cfg = {.block_size = 4, .n_blocks = 64, .max_num_seqs = 8, .max_num_batched_tokens = 64,
                           .max_model_len = 128, .prefix_caching = true, .prefix_seed = 7};
    fl_scheduler s[2];
    fl_route_set routed[2] = {{0}};
    for (int r = 0; r < 2; r++) assert_int_equal(fl_scheduler_init(&s[r], &cfg), FL_OK);
    fl_seq a, b, c, d, e;
    /* a (group 0: 16 shared tokens of 20) goes to 0; b, unrelated, to 1 */
    prompt_of(&a, 1, 0, 16, 20);
    assert_int_equal(fl_engine_pick_replica(s, routed, 2, &a), 0);
    assert_int_equal(a.n_hashes, 4); /* (20 - 1) / 4 blocks could be cached */
    assert_int_equal(fl_scheduler_add(&s[0], &a), FL_OK);
    assert_int_equal(fl_route_set_add(&routed[0], a.hashes, a.n_hashes), FL_OK);
    prompt_of(&b, 2, 1, 8, 8);
    assert_int_equal(fl_engine_pick_replica(s, routed, 2, &b), 1);
    assert_int_equal(fl_scheduler_add(&s[1], &b), FL_OK);
    /* c shares a's 16 tokens (4 blocks): 20 + 20 - 4 * 16 < 8 + 20, so it follows a */
    prompt_of(&c, 3, 0, 16, 20);
    assert_int_equal(fl_engine_pick_replica(s, routed, 2, &c), 0);
    assert_int_equal(fl_engine_pick_replica(s, NULL, 2, &c), 1); /* load alone */
    /* once replica 0 holds 64 + 16 tokens more than replica 1, c goes to 1 */
    fl_seq fill[4];
    for (int i = 0; i < 4; i++) {
        prompt_of(&fill[i], 10 + i, 5 + i, 0, 20);
        assert_int_equal(fl_scheduler_add(&s[0], &fill[i]), FL_OK);
    }
    assert_int_equal(fl_engine_pick_replica(s, routed, 2, &c), 1); /* 100 + 20 - 64 > 8 + 20 */
    for (int i = 0; i < 4; i++) fl_scheduler_finish(&s[0], &fill[i]);
    /* a finished and forgotten: no affinity left in the route set... */
    fl_route_set_remove(&routed[0], a.hashes, a.n_hashes);
    fl_scheduler_finish(&s[0], &a);
    assert_int_equal(fl_route_set_leading(&routed[0], c.hashes, c.n_hashes), 0);
    assert_int_equal(fl_engine_pick_replica(s, routed, 2, &c), 0); /* 0 + 20 < 8 + 20 */
    /* ...but a replica whose cache holds the prefix attracts it: b's blocks
     * computed and published on replica 1, then b finished */
    fl_step_plan plan = {0};
    assert_int_equal(fl_scheduler_schedule(&s[1], &plan), FL_OK);
    fl_scheduler_step_done(&s[1]);
    fl_scheduler_finish(&s[1], &b);
    prompt_of(&d, 4, 1, 8, 12); /* b's 8 tokens (2 blocks) then its own */
    prompt_of(&e, 5, 0, 16, 30);
    assert_int_equal(fl_scheduler_add(&s[1], &e), FL_OK); /* replica 1 now holds 30 tokens */
    assert_int_equal(fl_scheduler_cached_prefix(&s[1], &d, fl_scheduler_prompt_hashes(&s[1], &d)), 2);
    assert_int_equal(fl_engine_pick_replica(s, routed, 2, &d), 1); /* 30 + 12 - 32 < 0 + 12 */
    fl_step_plan_free(&plan);
    fl_seq *all[] = {&a, &b, &c, &d, &e, &fill[0], &fill[1], &fill[2], &fill[3]};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) fl_seq_free(all[i]);
    for (int r = 0; r < 2; r++) {
        fl_scheduler_free(&s[r]);
        fl_route_set_free(&routed[r]);
    }
}

static void test_route_set(void **state) {
    (void)state;
    fl_route_set rs = {0};
    enum { N = 5000 };
    uint64_t *h = malloc(N * sizeof *h);
    assert_non_null(h);
    for (int i = 0; i < N; i++) h[i] = (uint64_t)i * 0x9e3779b97f4a7c15ull; /* h[0] = 0 too */
    assert_int_equal(fl_route_set_leading(&rs, h, N), 0);
    assert_int_equal(fl_route_set_add(&rs, h, N), FL_OK);      /* grows many times */
    assert_int_equal(fl_route_set_add(&rs, h, N / 2), FL_OK);  /* the first half twice */
    assert_int_equal(rs.n, N);
    assert_int_equal(fl_route_set_leading(&rs, h, N), N);
    fl_route_set_remove(&rs, h, N); /* the second half goes, the first stays once */
    assert_int_equal(rs.n, N / 2);
    assert_int_equal(fl_route_set_leading(&rs, h, N), N / 2);
    for (int i = N / 2; i < N; i++) assert_int_equal(fl_route_set_leading(&rs, h + i, 1), 0);
    /* every other key of the first half goes: the rest are still found
     * (deletion pulls back the keys that probed past a freed slot) */
    for (int i = 0; i < N / 2; i += 2) fl_route_set_remove(&rs, h + i, 1);
    for (int i = 0; i < N / 2; i++) assert_int_equal(fl_route_set_leading(&rs, h + i, 1), i % 2);
    fl_route_set_remove(&rs, h + 1, 1); /* a key once more than added: no effect on others */
    fl_route_set_remove(&rs, h + 1, 1);
    assert_int_equal(fl_route_set_leading(&rs, h + 3, 1), 1);
    fl_route_set_free(&rs);
    fl_route_set_free(&rs);
    /* keys of one home: removing the first shifts the second back; a new
     * key in the freed slot starts from a count of 0 (added once, removed
     * once, it is gone, and the set is as it was) */
    const uint64_t one[3] = {5, 5 + 64, 6};
    assert_int_equal(fl_route_set_add(&rs, one, 2), FL_OK);
    assert_int_equal(rs.mask, 63);
    /* the probe start (route.c's home) is k ^ (k >> 29): small keys land on themselves */
    fl_route_set_remove(&rs, one, 1);
    assert_int_equal(fl_route_set_leading(&rs, one + 1, 1), 1);
    assert_int_equal(fl_route_set_add(&rs, one + 2, 1), FL_OK);
    fl_route_set_remove(&rs, one + 2, 1);
    assert_int_equal(fl_route_set_leading(&rs, one + 2, 1), 0);
    assert_int_equal(rs.n, 1);
    fl_route_set_remove(&rs, one + 1, 1);
    assert_int_equal(rs.n, 0);
    fl_route_set_free(&rs);
    free(h);
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
        cmocka_unit_test(test_pick_prefix),
        cmocka_unit_test(test_route_set),
        cmocka_unit_test(test_dp_needs_world),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
