/*
 * cpu_stream.c — STREAM-like copy and read bandwidth of host memory
 * (cpu_stream.h). Each pool thread works on its own contiguous slice, as
 * the matmuls split weight rows, and touches it first so its pages sit near it.
 */
#include "kernels/cpu/cpu_stream.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/pool.h"

/* The slice [lo, hi) of n words thread t of nt owns. */
static void slice(size_t n, int t, int nt, size_t *lo, size_t *hi) {
    const size_t per = (n + (size_t)nt - 1) / (size_t)nt;
    *lo = (size_t)t * per < n ? (size_t)t * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* Sum of the words: four independent accumulators keep the loads, not the
 * adds, the bottleneck; the result is returned so the reads cannot be
 * dropped. */
static uint64_t read_words(const uint64_t *p, size_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += p[i];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
    }
    for (; i < n; i++) s0 += p[i];
    return s0 + s1 + s2 + s3;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct padded_sum {
    _Alignas(64) uint64_t v; /* a cache line each: the threads' sums do not share one */
} padded_sum;

typedef struct stream_job {
    uint64_t *a, *b;
    padded_sum *sums; /* [threads] */
    size_t n;
    int threads;
} stream_job;

/* Pool tasks over slice indices [lo, hi) of threads slices. */
static void stream_touch(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const stream_job *j = ctx;
    for (int64_t t = lo; t < hi; t++) {
        size_t s0, s1;
        slice(j->n, (int)t, j->threads, &s0, &s1);
        for (size_t i = s0; i < s1; i++) j->a[i] = i, j->b[i] = 0;
    }
}

static void stream_copy(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const stream_job *j = ctx;
    for (int64_t t = lo; t < hi; t++) {
        size_t s0, s1;
        slice(j->n, (int)t, j->threads, &s0, &s1);
        if (s0 < s1) memcpy(j->b + s0, j->a + s0, (s1 - s0) * sizeof *j->a);
    }
}

static void stream_read(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const stream_job *j = ctx;
    for (int64_t t = lo; t < hi; t++) {
        size_t s0, s1;
        slice(j->n, (int)t, j->threads, &s0, &s1);
        j->sums[t].v = read_words(j->b + s0, s1 - s0);
    }
}

fl_status fl_cpu_stream_measure(size_t bytes, int threads, int reps, fl_cpu_stream_result *out) {
    if (!out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_cpu_stream_measure: out is NULL");
    memset(out, 0, sizeof *out);
    bytes &= ~(size_t)63;
    if (bytes < ((size_t)1 << 20)) bytes = (size_t)1 << 20;
    if (threads < 1) threads = fl_pool_threads();
    if (reps < 1) reps = 1;
    const size_t n = bytes / sizeof(uint64_t);
    uint64_t *a = aligned_alloc(64, bytes), *b = aligned_alloc(64, bytes);
    padded_sum *sums = aligned_alloc(64, (size_t)threads * sizeof *sums); /* sizeof is 64 */
    if (!a || !b || !sums) {
        free(a);
        free(b);
        free(sums);
        return FL_ERR(FL_ERR_OOM, "stream: cannot allocate 2 x %zu MiB to measure the memory bandwidth",
                      bytes >> 20);
    }
    double best_copy = 0, best_read = 0;
    volatile uint64_t sink = 0;
    /* one slice per thread, the slices the matmuls' static split would make */
    stream_job j = {.a = a, .b = b, .sums = sums, .n = n, .threads = threads};
    fl_status st = fl_pool_for(threads, 0, stream_touch, &j); /* first touch by the slice's thread */
    for (int r = -1; r < reps && st == FL_OK; r++) { /* -1: untimed warm-up */
        const double t0 = now_s();
        st = fl_pool_for(threads, 0, stream_copy, &j);
        const double t1 = now_s();
        if (st == FL_OK) st = fl_pool_for(threads, 0, stream_read, &j);
        const double t2 = now_s();
        uint64_t sum = 0;
        for (int t = 0; t < threads; t++) sum += j.sums[t].v;
        sink += sum;
        if (r < 0) continue;
        if (t1 > t0 && 2.0 * (double)bytes / (t1 - t0) > best_copy) best_copy = 2.0 * (double)bytes / (t1 - t0);
        if (t2 > t1 && (double)bytes / (t2 - t1) > best_read) best_read = (double)bytes / (t2 - t1);
    }
    (void)sink;
    free(a);
    free(b);
    free(j.sums);
    if (st != FL_OK) return st;
    out->copy_Bps = best_copy;
    out->read_Bps = best_read;
    out->threads = threads;
    return FL_OK;
}
