/*
 * serve_metrics.c — Prometheus metrics of `flotilla serve` (serve_metrics.h).
 * Histogram buckets are fixed, in seconds, covering a CPU test model's
 * seconds-long steps and a GPU's milliseconds alike.
 */
#include "launcher/serve_metrics.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name, *help;
    double le[FL_SERVE_MAX_BUCKETS];
    int n;
} hists[FL_SERVE_HIST_COUNT] = {
    {"flotilla_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
     {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160},
     20},
    {"flotilla_time_per_output_token_seconds", "Time between a choice's tokens after its first.",
     {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
      0.4, 0.5, 0.75, 1, 2.5},
     20},
    {"flotilla_e2e_request_latency_seconds", "Time from a request's arrival to its last token.",
     {0.01, 0.05, 0.1, 0.3, 0.6, 1, 2, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920},
     20},
};

void fl_serve_metrics_init(fl_serve_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
}

void fl_serve_metrics_free(fl_serve_metrics *m) {
    if (m) pthread_mutex_destroy(&m->mu);
}

void fl_serve_metrics_request(fl_serve_metrics *m, int status) {
    pthread_mutex_lock(&m->mu);
    int i = 0;
    while (i < m->n_status && m->status_code[i] != status) i++;
    if (i == m->n_status && m->n_status < FL_SERVE_MAX_STATUS) m->status_code[m->n_status++] = status;
    if (i < m->n_status) m->status_count[i]++;
    pthread_mutex_unlock(&m->mu);
}

void fl_serve_metrics_tokens(fl_serve_metrics *m, long prompt, long generated) {
    pthread_mutex_lock(&m->mu);
    m->prompt_tokens += prompt;
    m->generation_tokens += generated;
    pthread_mutex_unlock(&m->mu);
}

void fl_serve_metrics_stall(fl_serve_metrics *m) {
    pthread_mutex_lock(&m->mu);
    m->stream_stalls++;
    pthread_mutex_unlock(&m->mu);
}

void fl_serve_metrics_observe(fl_serve_metrics *m, fl_serve_hist h, double seconds) {
    pthread_mutex_lock(&m->mu);
    int b = 0;
    while (b < hists[h].n && seconds > hists[h].le[b]) b++;
    m->hist_count[h][b]++;
    m->hist_sum[h] += seconds;
    pthread_mutex_unlock(&m->mu);
}

void fl_serve_metrics_engine(fl_serve_metrics *m, const fl_serve_engine_state *st) {
    pthread_mutex_lock(&m->mu);
    m->eng = *st;
    pthread_mutex_unlock(&m->mu);
}

typedef struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

static void put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = b->oom ? -1 : vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = (b->cap + (size_t)n + 1) * 2;
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
}

static void metric(sbuf *b, const char *name, const char *type, const char *help) {
    put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

fl_status fl_serve_metrics_render(fl_serve_metrics *m, char **out, size_t *len) {
    sbuf b = {0};
    b.cap = 4096;
    b.p = malloc(b.cap);
    if (!b.p) return FL_ERR(FL_ERR_OOM, "out of memory");
    b.p[0] = 0;
    pthread_mutex_lock(&m->mu);
    metric(&b, "flotilla_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
    put(&b, "flotilla_prompt_tokens_total %lld\n", (long long)m->prompt_tokens);
    metric(&b, "flotilla_generation_tokens_total", "counter", "Tokens generated for finished requests.");
    put(&b, "flotilla_generation_tokens_total %lld\n", (long long)m->generation_tokens);
    metric(&b, "flotilla_requests_total", "counter",
           "Completion and chat requests answered, by HTTP status (499: client went away).");
    for (int i = 0; i < m->n_status; i++)
        put(&b, "flotilla_requests_total{status=\"%d\"} %lld\n", m->status_code[i],
            (long long)m->status_count[i]);
    metric(&b, "flotilla_stream_stalls_total", "counter",
           "Streams dropped because the client read nothing for --stream-stall-timeout seconds.");
    put(&b, "flotilla_stream_stalls_total %lld\n", (long long)m->stream_stalls);
    const fl_serve_engine_state *e = &m->eng;
    metric(&b, "flotilla_preemptions_total", "counter",
           "Sequences preempted for want of KV blocks, by kind: swap (blocks to the host pool) or recompute.");
    put(&b, "flotilla_preemptions_total{kind=\"swap\"} %lld\n", (long long)e->swap_preemptions);
    put(&b, "flotilla_preemptions_total{kind=\"recompute\"} %lld\n",
        (long long)(e->preemptions - e->swap_preemptions));
    metric(&b, "flotilla_swapped_bytes_total", "counter",
           "KV cache bytes moved to the host swap pool (every rank's shard).");
    put(&b, "flotilla_swapped_bytes_total %lld\n", (long long)e->swapped_bytes);
    metric(&b, "flotilla_requests_running", "gauge", "Sequences running in the engine.");
    put(&b, "flotilla_requests_running %lld\n", (long long)e->running);
    metric(&b, "flotilla_requests_waiting", "gauge", "Sequences and requests waiting to run.");
    put(&b, "flotilla_requests_waiting %lld\n", (long long)e->waiting);
    metric(&b, "flotilla_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use.");
    put(&b, "flotilla_kv_cache_usage_ratio %.6f\n", e->kv_usage);
    metric(&b, "flotilla_kv_swap_pool_usage_ratio", "gauge",
           "Fraction of the host swap pool's blocks in use (0 without a pool).");
    put(&b, "flotilla_kv_swap_pool_usage_ratio %.6f\n", e->swap_pool_usage);
    metric(&b, "flotilla_prefix_cache_hit_ratio", "gauge",
           "Fraction of admitted prompt tokens whose K/V the prefix cache held.");
    put(&b, "flotilla_prefix_cache_hit_ratio %.6f\n", e->prefix_hit);
    for (int h = 0; h < FL_SERVE_HIST_COUNT; h++) {
        metric(&b, hists[h].name, "histogram", hists[h].help);
        int64_t cum = 0;
        for (int i = 0; i < hists[h].n; i++) {
            cum += m->hist_count[h][i];
            put(&b, "%s_bucket{le=\"%g\"} %lld\n", hists[h].name, hists[h].le[i], (long long)cum);
        }
        cum += m->hist_count[h][hists[h].n];
        put(&b, "%s_bucket{le=\"+Inf\"} %lld\n", hists[h].name, (long long)cum);
        put(&b, "%s_sum %.6f\n%s_count %lld\n", hists[h].name, m->hist_sum[h], hists[h].name,
            (long long)cum);
    }
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.p);
        return FL_ERR(FL_ERR_OOM, "out of memory rendering metrics");
    }
    *out = b.p;
    *len = b.len;
    return FL_OK;
}
