/*
 * progress.h — what a batch job tells its user while it runs and when it
 * ends: a progress bar on a terminal (redrawn at most 4 times a second), one
 * plain line every N seconds elsewhere (a Slurm log), and a summary
 * (requests, tokens, wall time, output tok/s, TTFT and TPOT percentiles) as
 * text and, optionally, as a JSON file.
 *
 * Latencies come from the engine's timestamps (fl_gen.t_added,
 * t_first_token, t_finished). TTFT = t_first_token - t_added; TPOT =
 * (t_finished - t_first_token) / (completion tokens - 1), for requests with
 * at least 2 completion tokens.
 */
#ifndef FL_PROGRESS_H
#define FL_PROGRESS_H

#include <stdbool.h>
#include <stdio.h>

#include "runtime/engine/engine.h"
#include "core/status.h"

typedef struct fl_progress {
    FILE *f;            /* where progress goes (stderr) */
    bool tty;           /* draw a bar (else: lines every interval seconds) */
    double interval;    /* seconds between lines off a terminal */
    double t0, last;    /* start, last draw (fl_engine_now clock) */
    long total;         /* requests this run has to do; -1: unknown (stdin) */
    long skipped;       /* already in the output when the job started */
    long ok, errors, dropped;
    long in_tokens, out_tokens;     /* of finished requests */
    long live_in, live_out;         /* of requests in flight (fl_progress_live) */
    double live_frac;               /* their progress in whole requests */
    bool drawn;         /* a bar is on screen: end it with '\n' */
    double *ttft, *tpot; /* seconds, one per request */
    size_t n_ttft, n_tpot, cap_ttft, cap_tpot;
    /* the engine's steps, set before the summary: how many, and how many
     * brought only tokens to rank 0 (greedy picks, device sampling) */
    long steps, greedy_steps, sampled_steps;
    /* prefix caching, from the engine's stats (set before each tick and the
     * summary): prompt tokens admitted, and how many the cache held; the
     * hit rate is their ratio */
    long prefix_prompt_tokens, prefix_cached_tokens;
    /* the most sequences running at once, and the engine's max_num_seqs */
    long peak_running, max_num_seqs;
    /* preemptions for want of KV blocks (from the engine's stats, set before
     * each tick and the summary): all, those by swap (the rest recomputed),
     * and the bytes moved to and from the host swap pools */
    long preemptions, swap_preemptions;
    double swap_out_bytes, swap_in_bytes;
    /* the KV cache's disk tier (--kv-offload-dir; kv_disk false: off):
     * blocks and tokens of prefix hits read from disk */
    bool kv_disk;
    long disk_hit_blocks, disk_hit_tokens;
} fl_progress;

void fl_progress_init(fl_progress *p, FILE *f, bool tty, double interval, long total,
                      long skipped, double now);
void fl_progress_free(fl_progress *p);

/* One request done: g (NULL for a request that never ran) gives latencies. */
fl_status fl_progress_result(fl_progress *p, const fl_gen *g, bool error, long prompt_tokens,
                             long completion_tokens);

/* The requests in flight: prompt tokens computed and completion tokens
 * generated so far, and their progress counted in whole requests (each
 * generated / max tokens); the next line counts them with the finished ones. */
void fl_progress_live(fl_progress *p, long in_tokens, long out_tokens, double frac);

/* True when fl_progress_tick would draw now (so callers gather the live
 * counts only then). */
bool fl_progress_due(const fl_progress *p, double now);

/* Redraws the bar / prints a line when it is time (or always with force). */
void fl_progress_tick(fl_progress *p, double now, bool force);

/* Ends the bar and prints the summary to p->f; with json_path also writes it
 * there as a JSON object. interrupted: the job stopped on a signal. */
fl_status fl_progress_summary(fl_progress *p, double now, bool interrupted,
                              const char *json_path);

#endif /* FL_PROGRESS_H */
