/*
 * test_cuda_stream_wait.c — the backend op stream_wait (kernels/backend.h),
 * which the MoE all-to-all uses to order NCCL's stream and the compute
 * stream without host waits (runtime/model/forward_moe.c).
 *
 * The "other" stream is a second CUDA backend's on the same device (its
 * stream via fl_backend_native_stream), so the test needs no CUDA headers.
 * Each direction: the signalling stream is kept busy for milliseconds
 * (a chain of 64 MiB copies) and then writes a pattern into a small buffer;
 * the waiting stream, after stream_wait, copies that buffer out. With the
 * wait the pattern is always there; without it the copy would run long
 * before the busy chain ends and read the old zeros (so a broken op fails
 * the test, with high probability). Also: a stream waiting on itself and
 * NULL/NULL are no-ops; the CPU backend has no such op (one in-order queue),
 * checked everywhere, so CI asserts something without a GPU.
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

enum { BIG = 64 << 20, SMALL = 1 << 16, CHAIN = 64 };

/* The CPU backend has no stream_wait: callers run in order. */
static void test_cpu_has_none(void **state) {
    (void)state;
    fl_backend *cpu = NULL;
    OK(fl_backend_cpu_init(&cpu));
    assert_null(cpu->ops->stream_wait);
    assert_null(fl_backend_native_stream(cpu)); /* not a CUDA backend: no stream */
    fl_backend_free(cpu);
}

/* signaler busy, then pattern -> dst; waiter: after the fence, dst -> out. */
static void one_direction(fl_backend *sig_be, fl_backend *wait_be, bool waiter_is_other) {
    void *big_a = NULL, *big_b = NULL, *src = NULL, *dst = NULL;
    uint8_t *host = malloc(SMALL), *out = malloc(SMALL);
    assert_non_null(host);
    assert_non_null(out);
    for (int i = 0; i < SMALL; i++) host[i] = (uint8_t)(i * 7 + 1);
    OK(sig_be->ops->alloc(sig_be, BIG, &big_a));
    OK(sig_be->ops->alloc(sig_be, BIG, &big_b));
    OK(sig_be->ops->alloc(sig_be, SMALL, &src));
    OK(sig_be->ops->alloc(sig_be, SMALL, &dst));
    OK(sig_be->ops->memset0(sig_be, big_a, BIG));
    OK(sig_be->ops->memset0(sig_be, dst, SMALL));
    OK(sig_be->ops->upload(sig_be, src, host, SMALL));
    OK(sig_be->ops->sync(sig_be));
    /* the signalling stream: milliseconds of copies, then the pattern */
    for (int i = 0; i < CHAIN; i++) OK(sig_be->ops->copy(sig_be, i % 2 ? big_a : big_b, i % 2 ? big_b : big_a, BIG));
    OK(sig_be->ops->copy(sig_be, dst, src, SMALL));
    /* the fence is always issued through one backend (the MoE code's
     * compute backend): waiter or signaler is "the other" stream */
    fl_backend *issuer = waiter_is_other ? sig_be : wait_be;
    void *other = fl_backend_native_stream(waiter_is_other ? wait_be : sig_be);
    assert_non_null(other);
    OK(waiter_is_other ? issuer->ops->stream_wait(issuer, other, NULL)
                       : issuer->ops->stream_wait(issuer, NULL, other));
    /* download is enqueued on the waiting backend's stream, then synchronizes it */
    memset(out, 0, SMALL);
    OK(wait_be->ops->download(wait_be, out, dst, SMALL));
    assert_memory_equal(out, host, SMALL);
    OK(sig_be->ops->sync(sig_be));
    sig_be->ops->free(sig_be, big_a);
    sig_be->ops->free(sig_be, big_b);
    sig_be->ops->free(sig_be, src);
    sig_be->ops->free(sig_be, dst);
    free(host);
    free(out);
}

static void test_both_directions(void **state) {
    (void)state;
    NEED_GPU();
    fl_backend *other = NULL;
    OK(fl_backend_cuda_init(0, &other));
    assert_non_null(g_be->ops->stream_wait);
    assert_ptr_not_equal(fl_backend_native_stream(g_be), fl_backend_native_stream(other));
    for (int rep = 0; rep < 3; rep++) {
        one_direction(g_be, other, true);  /* other stream waits for g_be's */
        one_direction(other, g_be, false); /* g_be's stream waits for the other's */
    }
    /* a stream is ordered with itself: no-ops */
    OK(g_be->ops->stream_wait(g_be, NULL, NULL));
    void *own = fl_backend_native_stream(g_be);
    OK(g_be->ops->stream_wait(g_be, own, NULL));
    OK(g_be->ops->stream_wait(g_be, NULL, own));
    OK(g_be->ops->sync(g_be));
    fl_backend_free(other);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_has_none),
        cmocka_unit_test(test_both_directions),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
