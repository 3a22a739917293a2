/*
 * cpu_stream.c — STREAM-like copy and read bandwidth of host memory
 * (cpu_stream.h). Each thread works on its own contiguous slice, as the
 * matmuls split weight rows, and touches it first so its pages sit near it.
 */
#include "kernels/cpu/cpu_stream.h"

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

fl_status fl_cpu_stream_measure(size_t bytes, int threads, int reps, fl_cpu_stream_result *out) {
    if (!out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_cpu_stream_measure: out is NULL");
    memset(out, 0, sizeof *out);
    bytes &= ~(size_t)63;
    if (bytes < ((size_t)1 << 20)) bytes = (size_t)1 << 20;
    if (threads < 1) threads = omp_get_max_threads();
    if (reps < 1) reps = 1;
    const size_t n = bytes / sizeof(uint64_t);
    uint64_t *a = aligned_alloc(64, bytes), *b = aligned_alloc(64, bytes);
    if (!a || !b) {
        free(a);
        free(b);
        return FL_ERR(FL_ERR_OOM, "stream: cannot allocate 2 x %zu MiB to measure the memory bandwidth",
                      bytes >> 20);
    }
    double best_copy = 0, best_read = 0;
    volatile uint64_t sink = 0;
    /* first touch by the thread that will stream each slice */
#pragma omp parallel num_threads(threads)
    {
        size_t lo, hi;
        slice(n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (size_t i = lo; i < hi; i++) a[i] = i, b[i] = 0;
    }
    for (int r = -1; r < reps; r++) { /* -1: untimed warm-up */
        double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
        {
            size_t lo, hi;
            slice(n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            if (lo < hi) memcpy(b + lo, a + lo, (hi - lo) * sizeof *a);
        }
        double t1 = omp_get_wtime();
        uint64_t sum = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
        {
            size_t lo, hi;
            slice(n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            sum += read_words(b + lo, hi - lo);
        }
        double t2 = omp_get_wtime();
        sink += sum;
        if (r < 0) continue;
        if (t1 > t0 && 2.0 * (double)bytes / (t1 - t0) > best_copy) best_copy = 2.0 * (double)bytes / (t1 - t0);
        if (t2 > t1 && (double)bytes / (t2 - t1) > best_read) best_read = (double)bytes / (t2 - t1);
    }
    (void)sink;
    free(a);
    free(b);
    out->copy_Bps = best_copy;
    out->read_Bps = best_read;
    out->threads = threads;
    return FL_OK;
}
