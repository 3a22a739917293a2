/*
 * cpu_stream.h — the host memory bandwidth the CPU backend can draw, measured
 * STREAM-style: a copy and a read of a buffer far larger than the caches,
 * split over as many pool threads (kernels/pool.h) as the backend's ops use, best of a few
 * repetitions. A decode step streams every weight once, so bytes / this
 * bandwidth is its time floor (flotilla bench reports the ratio).
 */
#ifndef FL_CPU_STREAM_H
#define FL_CPU_STREAM_H

#include <stddef.h>

#include "core/status.h"

typedef struct fl_cpu_stream_result {
    double copy_Bps; /* (read + written) bytes / s of the fastest copy, as STREAM's Copy counts */
    double read_Bps; /* bytes / s of the fastest read (a sum over every 8-byte word) */
    int threads;     /* threads each ran on */
} fl_cpu_stream_result;

/* Measures both over `bytes` (rounded down to a multiple of 64; at least
 * 1 MiB) with `threads` threads (< 1: fl_pool_threads(), the count the
 * backend's parallel loops get), `reps` timed repetitions each (at least 1)
 * after one untimed pass that faults the pages in. Allocates two buffers of
 * `bytes` and frees them before returning; FL_ERR_OOM if they do not fit. */
fl_status fl_cpu_stream_measure(size_t bytes, int threads, int reps, fl_cpu_stream_result *out);

#endif /* FL_CPU_STREAM_H */
