/*
 * serve_metrics.h — the counters, gauges and histograms `flotilla serve`
 * exposes at GET /metrics, in Prometheus' text format (version 0.0.4).
 *
 * Threading: every function takes the metrics' own lock; any thread.
 */
#ifndef FL_SERVE_METRICS_H
#define FL_SERVE_METRICS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

typedef enum fl_serve_hist {
    FL_SERVE_HIST_TTFT = 0, /* flotilla_time_to_first_token_seconds */
    FL_SERVE_HIST_TPOT,     /* flotilla_time_per_output_token_seconds */
    FL_SERVE_HIST_E2E,      /* flotilla_e2e_request_latency_seconds */
    FL_SERVE_HIST_COUNT
} fl_serve_hist;

enum { FL_SERVE_MAX_BUCKETS = 20, FL_SERVE_MAX_STATUS = 16 };

/* The engine's side, as fl_engine_get_stats gives it (the same counts as
 * generate's summary): gauges now, counters since start. */
typedef struct fl_serve_engine_state {
    int64_t running, waiting;
    double kv_usage;          /* KV cache blocks in use, 0..1 */
    double swap_pool_usage;   /* host swap pool blocks in use, 0..1 (0 without a pool) */
    double prefix_hit;
    int64_t preemptions;      /* both kinds */
    int64_t swap_preemptions; /* ... of which by swap (the rest: recompute) */
    int64_t swapped_bytes;    /* KV bytes moved to the host pools (every rank's shard) */
} fl_serve_engine_state;

typedef struct fl_serve_metrics {
    pthread_mutex_t mu;
    int64_t prompt_tokens, generation_tokens;
    int64_t stream_stalls;
    int n_status;
    int status_code[FL_SERVE_MAX_STATUS]; /* HTTP status of the answered API requests */
    int64_t status_count[FL_SERVE_MAX_STATUS];
    fl_serve_engine_state eng;
    int64_t hist_count[FL_SERVE_HIST_COUNT][FL_SERVE_MAX_BUCKETS + 1]; /* per bucket, +Inf last */
    double hist_sum[FL_SERVE_HIST_COUNT];
} fl_serve_metrics;

void fl_serve_metrics_init(fl_serve_metrics *m);
void fl_serve_metrics_free(fl_serve_metrics *m);
/* One answered completion or chat request, by HTTP status (499: the client
 * closed the connection before the end). */
void fl_serve_metrics_request(fl_serve_metrics *m, int status);
void fl_serve_metrics_tokens(fl_serve_metrics *m, long prompt, long generated);
/* One stream dropped because its client stopped reading. */
void fl_serve_metrics_stall(fl_serve_metrics *m);
void fl_serve_metrics_observe(fl_serve_metrics *m, fl_serve_hist h, double seconds);
/* The engine's state now (the engine thread sets it after each step). */
void fl_serve_metrics_engine(fl_serve_metrics *m, const fl_serve_engine_state *st);
/* The exposition text, malloc'd. */
fl_status fl_serve_metrics_render(fl_serve_metrics *m, char **out, size_t *len);

#endif /* FL_SERVE_METRICS_H */
