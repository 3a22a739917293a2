/*
 * bench_workload.h — `flotilla bench --workload`: N requests of drawn
 * lengths through the real engine (continuous batching, chunked prefill, a
 * KV cache sized from memory, prefix caching), timed like vLLM's
 * benchmark_serving: throughput, TTFT, TPOT, inter-token latency, and what
 * the scheduler did (peak concurrency, KV blocks, preemptions, prefix hits).
 *
 * fl_bench_workload_run is one run on an engine already built; a sweep over
 * (max concurrency, input length) calls it once per point on the same engine
 * (the engine's counters are read as differences, so runs do not mix; the
 * prefix cache does carry over between runs: a sweep draws new prompts per point).
 */
#ifndef FL_BENCH_WORKLOAD_H
#define FL_BENCH_WORKLOAD_H

#include <stdint.h>

#include "launcher/cli.h"

typedef enum fl_bench_len_dist {
    FL_BENCH_LEN_UNIFORM = 0, /* uniform integer in [L(1-R), L(1+R)] (vLLM's random dataset) */
    FL_BENCH_LEN_LOGNORMAL,   /* exp(N(ln L, sigma^2)): median L, a long tail */
} fl_bench_len_dist;

/* Log-normal sigma for prompts and completions: with median L, the mean is
 * 1.65 L and p90 3.6 L, about the spread of ShareGPT conversations. */
#define FL_BENCH_LOGNORMAL_SIGMA 1.0

typedef struct fl_bench_workload {
    int num_prompts;
    int input_len, output_len;         /* the unique prompt part; the completion */
    double input_range, output_range;  /* uniform: R in [0, 1] */
    fl_bench_len_dist dist;
    int shared_prefix_len;             /* tokens before the unique part, equal in every prompt of a group */
    int num_prefixes;                  /* prefix groups (>= 1): each prompt draws its group uniformly */
    double request_rate;               /* requests/s, Poisson arrivals; INFINITY: all at t = 0 */
    int max_concurrency;               /* requests in flight at most (client side); 0: no limit */
    fl_sampling_params sp;             /* every request's (its seed: the request's index) */
    uint64_t seed;                     /* lengths, tokens and arrivals (separate streams); bench's --seed */
} fl_bench_workload;

/* mean and percentiles of one latency, milliseconds */
typedef struct fl_bench_stat {
    double mean, p50, p90, p99;
    int64_t n;                         /* samples it summarizes */
} fl_bench_stat;

typedef struct fl_bench_workload_result {
    int n_requests, n_completed, n_failed;
    int n_clipped;                     /* requests whose drawn lengths were cut to max_model_len */
    int max_model_len;
    int64_t prompt_tokens, output_tokens, expected_output_tokens;
    int *input_lens, *output_lens, *expected_output_lens; /* [n_requests], owned */
    double *ttft_ms;                   /* [n_requests], owned; -1: none */
    double duration_s, last_arrival_s;
    double req_per_s, output_tok_s, total_tok_s;
    fl_bench_stat ttft, tpot, itl, e2e;
    int64_t itl_kept;                  /* gaps kept for the percentiles (reservoir) */
    int64_t steps, peak_running, preemptions, kv_blocks, peak_kv_blocks_used;
    int64_t swap_preemptions, swap_out_bytes, swap_in_bytes; /* preemptions by swap, bytes moved */
    int64_t admitted_prompt_tokens, cached_prompt_tokens;
    double prefix_hit_rate;
    double host_ms_per_step, forward_ms_per_step;
    /* steps with prompt rows (prefill, recomputation) and decode-only steps:
     * how many, prompt tokens, and their mean forward time */
    int64_t prefill_steps, prefill_rows;
    double prefill_forward_ms_per_step, decode_forward_ms_per_step, prefill_forward_share;
} fl_bench_workload_result;

/* The flags' text (NULL: not given). */
typedef struct fl_bench_workload_opts {
    const char *workload, *num_prompts, *input_len, *output_len, *input_range, *output_range, *length_dist,
        *shared_prefix, *num_prefixes, *request_rate, *max_concurrency;
} fl_bench_workload_opts;

/* Appends the workload flags' table entries to opts at *n. */
void fl_bench_workload_opts_add(fl_bench_workload_opts *wo, fl_cli_opt *opts, int *n);
/* The first workload-only flag given (--workload itself excluded), or NULL. */
const char *fl_bench_workload_flag_given(const fl_bench_workload_opts *wo, const fl_cli_model_opts *mo);
/* Checks the flags into *w and the engine limits into ec; errors name the flag. */
fl_status fl_bench_workload_parse(const fl_bench_workload_opts *wo, const fl_cli_model_opts *mo,
                                  fl_bench_workload *w, fl_engine_config *ec);

/* Rank 0 (fl_engine_is_leader): runs the workload to its end on an idle
 * engine and fills *r (free it with fl_bench_workload_result_free). The
 * other ranks are in fl_engine_follow meanwhile. vocab: token ids are drawn
 * in [0, vocab). */
fl_status fl_bench_workload_run(fl_engine *e, int vocab, const fl_bench_workload *w, fl_bench_workload_result *r);
void fl_bench_workload_result_free(fl_bench_workload_result *r);

/* What the report says about the run besides the result. */
typedef struct fl_bench_workload_info {
    const char *preset, *quantize, *backend, *output; /* output: JSON path or NULL */
    int layers, world, tp, ep, dp;
    double copy_ceiling;               /* bytes/s, world x the slowest rank's */
    int copy_ceiling_threads;          /* threads of the copy it was measured with (CPU: the decode's) */
    const struct fl_bench_sweep *sweep; /* non-NULL with points: a sweep instead of one run (bench_sweep.h) */
} fl_bench_workload_info;

/* The whole of `bench --workload` after the model is built into b: the
 * engine (ec), the run on rank 0 while the others follow, the report. */
fl_status fl_bench_workload_main(fl_cli_bundle *b, fl_engine_config *ec, const fl_bench_workload *w,
                                 fl_bench_workload_info *info);

/* Percentile p (0..100) of n sorted values by linear interpolation between
 * the closest ranks (numpy's default): v[(n-1) p / 100]. 0 when n = 0. */
double fl_bench_percentile(const double *sorted, int64_t n, double p);

#endif /* FL_BENCH_WORKLOAD_H */
