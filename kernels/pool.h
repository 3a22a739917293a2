/*
 * pool.h — the host thread pool every parallel CPU loop runs on (the CPU
 * backend's ops, host-side conversions, quantization).
 *
 * Why not OpenMP: a decode step is a couple of hundred matmuls of tens of
 * microseconds each, so the fork/join cost and what idle threads do between
 * them decide the speed. Here the caller is thread 0 and N-1 workers wait
 * for the next loop by spinning briefly (about 5 us, with a pause
 * instruction) and then sleeping on a futex, so back-to-back loops start
 * without a system call while idle workers give their core back at once
 * (a busy 2-core machine or several ranks per node are not slowed down).
 *
 * Threads: fl_pool_set_threads (--threads) if called, else OMP_NUM_THREADS
 * (honoured for existing launch scripts), else the CPUs this process may
 * run on when the pool starts. The pool starts on the first loop, so a
 * rank bound to its share of the node's cores (parallel/bind.h) counts and
 * pins only those; it is joined by fl_pool_shutdown (also run at exit).
 *
 * Threading contract: one loop runs at a time. A loop started from inside
 * a task (nested) or from a second thread while another thread's loop is
 * running runs serially on its calling thread: every index still runs
 * exactly once, just without helpers.
 */
#ifndef FL_POOL_H
#define FL_POOL_H

#include <stdint.h>

#include "core/status.h"

/* The task of one share: indices [lo, hi) of the loop, on pool thread
 * `thread` (0 = the caller, < fl_pool_threads()); it may use per-thread
 * scratch indexed by `thread`. Tasks do not fail; they record errors in
 * their context. */
typedef void (*fl_pool_task)(void *ctx, int64_t lo, int64_t hi, int thread);

/* Runs fn over the indices [0, n) on the pool's threads and returns when
 * all have run. chunk == 0: static, thread t gets the t-th contiguous slice
 * of ceil(n / threads) indices (one call each; the split depends only on n
 * and the thread count). chunk > 0: dynamic, threads claim chunks of
 * `chunk` indices in order until none are left (uneven work). n <= 0 does
 * nothing. One thread (or n == 1): fn(ctx, 0, n, 0) on the caller, with no
 * synchronization. Errors: FL_ERR_INTERNAL when the pool cannot start its
 * threads (the message names the failing call); fn has not run then. */
fl_status fl_pool_for(int64_t n, int64_t chunk, fl_pool_task fn, void *ctx);

/* The number of threads loops run on (starts nothing). */
int fl_pool_threads(void);

/* Sets the thread count (1..4096) for the loops that follow; a running pool
 * of another size is joined first. Call it from the thread that runs the
 * loops, outside any loop. Errors: FL_ERR_INVALID_ARG out of range. */
fl_status fl_pool_set_threads(int n);

/* Joins the workers and frees the pool (the next loop starts it again).
 * A no-op without a pool, or while a loop is running. */
void fl_pool_shutdown(void);

#endif /* FL_POOL_H */
