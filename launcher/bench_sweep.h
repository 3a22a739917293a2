/*
 * bench_sweep.h — `flotilla bench --workload --sweep-concurrency LIST
 * [--sweep-input-len LIST] --sweep-csv FILE`: the workload once per (input
 * length, max concurrency) point on one engine, one CSV row a point, with
 * the points on the throughput / per-token-latency Pareto front marked
 * (scripts/plot-sweep.sh draws it).
 */
#ifndef FL_BENCH_SWEEP_H
#define FL_BENCH_SWEEP_H

#include "launcher/bench_workload.h"

enum { FL_BENCH_SWEEP_MAX = 32 }; /* values per list */

typedef struct fl_bench_sweep {
    int n_conc, n_input;
    int conc[FL_BENCH_SWEEP_MAX];  /* max concurrency of each point */
    int input[FL_BENCH_SWEEP_MAX]; /* input length of each point; n_input 0: the workload's */
    const char *csv;
} fl_bench_sweep;

/* Parses the flags (NULL: not given) into *s; s->n_conc is 0 when there is
 * no sweep. Errors name the flag. */
fl_status fl_bench_sweep_parse(const char *conc, const char *input, const char *csv, fl_bench_sweep *s);

/* The longest prompt + completion a sweep point can draw (sizes max_model_len). */
int fl_bench_sweep_max_input(const fl_bench_sweep *s, int input_len);

/* Rank 0: every point on engine e (idle), a line per point on stdout, the
 * CSV written at the end. Each point draws its own prompts (seed + point),
 * so the prefix cache shares only the workload's shared prefix. */
fl_status fl_bench_sweep_run(fl_engine *e, int vocab, const fl_bench_workload *w, const fl_bench_sweep *s);

#endif /* FL_BENCH_SWEEP_H */
