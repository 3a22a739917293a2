/*
 * test_pool.c — the host thread pool (kernels/pool.h): every index of every
 * loop runs exactly once at 1..4 threads, static loops give thread t the
 * t-th slice, nested and concurrent loops run serially, and the pool's
 * thread count follows --threads, then OMP_NUM_THREADS, with bad values
 * refused.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/pool.h"

#define MAX_N 5000

typedef struct count_job {
    atomic_int hits[MAX_N];
    atomic_int calls;
    atomic_int bad_thread; /* a task saw a thread index out of range */
    atomic_int thread_of[MAX_N];
    int threads;
} count_job;

static void count(void *ctx, int64_t lo, int64_t hi, int thread) {
    count_job *j = ctx;
    atomic_fetch_add(&j->calls, 1);
    if (thread < 0 || thread >= j->threads || lo >= hi) atomic_store(&j->bad_thread, 1);
    for (int64_t i = lo; i < hi; i++) {
        atomic_fetch_add(&j->hits[i], 1);
        atomic_store(&j->thread_of[i], thread);
    }
}

static void check_once(count_job *j, int64_t n) {
    for (int64_t i = 0; i < n; i++) assert_int_equal(atomic_load(&j->hits[i]), 1);
    for (int64_t i = n; i < MAX_N; i++) assert_int_equal(atomic_load(&j->hits[i]), 0);
    assert_int_equal(atomic_load(&j->bad_thread), 0);
}

/* Runs first: OMP_NUM_THREADS decides while --threads was never given. */
static void test_env_threads(void **state) {
    (void)state;
    static count_job j;
    setenv("OMP_NUM_THREADS", "two", 1);
    assert_int_equal(fl_pool_for(10, 0, count, &j), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "OMP_NUM_THREADS='two'"));
    assert_int_equal(atomic_load(&j.calls), 0); /* nothing ran */
    setenv("OMP_NUM_THREADS", "3,1", 1);        /* OpenMP's list form: the first level */
    assert_int_equal(fl_pool_threads(), 3);
    j.threads = 3;
    assert_int_equal(fl_pool_for(10, 0, count, &j), FL_OK);
    check_once(&j, 10);
    assert_int_equal(fl_pool_threads(), 3);
    fl_pool_shutdown();
    unsetenv("OMP_NUM_THREADS");
}

static void test_bad_thread_counts(void **state) {
    (void)state;
    assert_int_equal(fl_pool_set_threads(0), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_pool_set_threads(4097), FL_ERR_INVALID_ARG);
}

/* Many loops of awkward sizes, static and chunked, at 1..4 threads. */
static void test_each_index_once(void **state) {
    (void)state;
    static const int64_t sizes[] = {0, 1, 2, 3, 4, 5, 7, 13, 64, 111, 500, 1000, 4097, MAX_N};
    static const int64_t chunks[] = {0, 1, 3, 8, 64, 10000};
    static count_job j;
    for (int t = 1; t <= 4; t++) {
        assert_int_equal(fl_pool_set_threads(t), FL_OK);
        assert_int_equal(fl_pool_threads(), t);
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
            for (size_t c = 0; c < sizeof chunks / sizeof *chunks; c++) {
                memset(&j, 0, sizeof j);
                j.threads = t;
                assert_int_equal(fl_pool_for(sizes[s], chunks[c], count, &j), FL_OK);
                check_once(&j, sizes[s]);
                /* static: one call per thread with a non-empty slice */
                if (chunks[c] == 0) assert_true(atomic_load(&j.calls) <= t);
            }
    }
}

/* A static loop of `threads` indices: index t runs on thread t, so the
 * workers really run (and the caller is thread 0). */
static void test_static_split(void **state) {
    (void)state;
    static count_job j;
    for (int t = 2; t <= 4; t++) {
        assert_int_equal(fl_pool_set_threads(t), FL_OK);
        memset(&j, 0, sizeof j);
        j.threads = t;
        assert_int_equal(fl_pool_for(t, 0, count, &j), FL_OK);
        for (int i = 0; i < t; i++) assert_int_equal(atomic_load(&j.thread_of[i]), i);
        /* 10 indices on 4 threads: slices of ceil(10 / 4) = 3 */
        memset(&j, 0, sizeof j);
        j.threads = t;
        assert_int_equal(fl_pool_for(10, 0, count, &j), FL_OK);
        const int per = (10 + t - 1) / t;
        for (int i = 0; i < 10; i++) assert_int_equal(atomic_load(&j.thread_of[i]), i / per);
    }
}

typedef struct nest_job {
    count_job inner[8];
    atomic_int inner_bad;
} nest_job;

/* Each outer index runs an inner loop: it must run serially on this thread. */
static void nest_outer(void *ctx, int64_t lo, int64_t hi, int thread) {
    nest_job *j = ctx;
    for (int64_t i = lo; i < hi; i++) {
        count_job *in = &j->inner[i];
        in->threads = 1; /* serial: every inner task sees thread 0 */
        if (fl_pool_for(100, 0, count, in) != FL_OK || atomic_load(&in->calls) != 1) atomic_store(&j->inner_bad, 1);
    }
    (void)thread;
}

static void test_nested_runs_serially(void **state) {
    (void)state;
    static nest_job j;
    memset(&j, 0, sizeof j);
    assert_int_equal(fl_pool_set_threads(4), FL_OK);
    assert_int_equal(fl_pool_for(8, 1, nest_outer, &j), FL_OK);
    assert_int_equal(atomic_load(&j.inner_bad), 0);
    for (int i = 0; i < 8; i++) check_once(&j.inner[i], 100);
}

typedef struct side_arg {
    count_job job;
    int loops, failed;
} side_arg;

static void *side_thread(void *p) {
    side_arg *a = p;
    for (int k = 0; k < a->loops && !a->failed; k++) {
        memset(&a->job, 0, sizeof a->job);
        a->job.threads = 4;
        if (fl_pool_for(777, k % 2 ? 5 : 0, count, &a->job) != FL_OK) a->failed = 1;
        for (int i = 0; i < 777 && !a->failed; i++)
            if (atomic_load(&a->job.hits[i]) != 1) a->failed = 1;
    }
    return NULL;
}

/* Two threads starting loops at once: one gets the pool, the other runs
 * its loop serially; both see every index once. */
static void test_concurrent_callers(void **state) {
    (void)state;
    assert_int_equal(fl_pool_set_threads(4), FL_OK);
    static side_arg a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    a.loops = b.loops = 300;
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, side_thread, &a), 0);
    assert_int_equal(pthread_create(&tb, NULL, side_thread, &b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_int_equal(a.failed, 0);
    assert_int_equal(b.failed, 0);
}

typedef struct sum_job {
    int64_t *v;
} sum_job;

static void add_one(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    sum_job *j = ctx;
    for (int64_t i = lo; i < hi; i++) j->v[i]++;
}

/* Many back-to-back tiny loops (the decode pattern), some after a pause
 * long enough that the workers sleep: no wake-up may be lost. */
static void test_many_loops_and_sleeps(void **state) {
    (void)state;
    int64_t v[16] = {0};
    sum_job j = {.v = v};
    for (int t = 2; t <= 3; t++) {
        assert_int_equal(fl_pool_set_threads(t), FL_OK);
        for (int k = 0; k < 20000; k++) {
            assert_int_equal(fl_pool_for(16, k % 3 == 2 ? 1 : 0, add_one, &j), FL_OK);
            if (k % 2000 == 0) usleep(2000); /* past the spin: workers are asleep */
        }
    }
    for (int i = 0; i < 16; i++) assert_int_equal(v[i], 40000);
}

/* Shutdown joins the workers; the next loop starts a pool again. */
static void test_shutdown_and_restart(void **state) {
    (void)state;
    static count_job j;
    assert_int_equal(fl_pool_set_threads(3), FL_OK);
    for (int r = 0; r < 3; r++) {
        memset(&j, 0, sizeof j);
        j.threads = 3;
        assert_int_equal(fl_pool_for(1000, 0, count, &j), FL_OK);
        check_once(&j, 1000);
        fl_pool_shutdown();
        fl_pool_shutdown(); /* twice: a no-op */
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_env_threads),
        cmocka_unit_test(test_bad_thread_counts),
        cmocka_unit_test(test_each_index_once),
        cmocka_unit_test(test_static_split),
        cmocka_unit_test(test_nested_runs_serially),
        cmocka_unit_test(test_concurrent_callers),
        cmocka_unit_test(test_many_loops_and_sleeps),
        cmocka_unit_test(test_shutdown_and_restart),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
