/*
 * bench_sweep.c — a workload per (input length, max concurrency) point,
 * written as CSV with the Pareto front marked (see bench_sweep.h).
 */
#include "launcher/bench_sweep.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "1,4,16" into v; at most FL_BENCH_SWEEP_MAX values in [1, 2^24]. */
static fl_status parse_list(const char *flag, const char *text, int *v, int *n) {
    *n = 0;
    const char *p = text;
    while (*p) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 1 || x > (1 << 24) || (*end && *end != ','))
            return FL_ERR(FL_ERR_INVALID_ARG, "--%s must be a comma-separated list of positive integers, got '%s'",
                          flag, text);
        if (*n == FL_BENCH_SWEEP_MAX)
            return FL_ERR(FL_ERR_INVALID_ARG, "--%s has more than %d values", flag, FL_BENCH_SWEEP_MAX);
        v[(*n)++] = (int)x;
        p = *end ? end + 1 : end;
        if (*end && !*p) return FL_ERR(FL_ERR_INVALID_ARG, "--%s ends with a comma: '%s'", flag, text);
    }
    if (*n == 0) return FL_ERR(FL_ERR_INVALID_ARG, "--%s is empty", flag);
    return FL_OK;
}

fl_status fl_bench_sweep_parse(const char *conc, const char *input, const char *csv, fl_bench_sweep *s) {
    memset(s, 0, sizeof *s);
    if (!conc) {
        if (input || csv)
            return FL_ERR(FL_ERR_INVALID_ARG, "--%s needs --sweep-concurrency", input ? "sweep-input-len" : "sweep-csv");
        return FL_OK;
    }
    FL_TRY(parse_list("sweep-concurrency", conc, s->conc, &s->n_conc));
    if (input) FL_TRY(parse_list("sweep-input-len", input, s->input, &s->n_input));
    if (!csv) return FL_ERR(FL_ERR_INVALID_ARG, "--sweep-concurrency needs --sweep-csv FILE");
    s->csv = csv;
    return FL_OK;
}

int fl_bench_sweep_max_input(const fl_bench_sweep *s, int input_len) {
    int m = input_len;
    for (int i = 0; i < s->n_input; i++) m = s->input[i] > m ? s->input[i] : m;
    return m;
}

typedef struct point {
    int input_len, conc;
    fl_bench_workload_result r;
    bool pareto;
} point;

/* On the front: no other point has at least the output throughput and at
 * most the median per-token latency, one of them strictly. */
static void mark_pareto(point *p, int n) {
    for (int i = 0; i < n; i++) {
        p[i].pareto = p[i].r.tpot.n > 0;
        for (int j = 0; j < n && p[i].pareto; j++) {
            if (j == i || p[j].r.tpot.n == 0) continue;
            const double ti = p[i].r.output_tok_s, tj = p[j].r.output_tok_s;
            const double li = p[i].r.tpot.p50, lj = p[j].r.tpot.p50;
            if (tj >= ti && lj <= li && (tj > ti || lj < li)) p[i].pareto = false;
        }
    }
}

static fl_status write_csv(const char *path, const point *p, int n) {
    FILE *f = fopen(path, "w");
    if (!f) return FL_ERR(FL_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    fprintf(f, "input_len,max_concurrency,requests,completed,duration_s,output_tok_s,total_tok_s,req_per_s,"
               "ttft_p50_ms,ttft_p99_ms,tpot_p50_ms,tpot_p99_ms,itl_p50_ms,itl_p99_ms,peak_running,preemptions,"
               "prefix_hit_rate,pareto\n");
    for (int i = 0; i < n; i++) {
        const fl_bench_workload_result *r = &p[i].r;
        fprintf(f, "%d,%d,%d,%d,%.6f,%.3f,%.3f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%lld,%lld,%.4f,%d\n",
                p[i].input_len, p[i].conc, r->n_requests, r->n_completed, r->duration_s, r->output_tok_s,
                r->total_tok_s, r->req_per_s, r->ttft.p50, r->ttft.p99, r->tpot.p50, r->tpot.p99, r->itl.p50,
                r->itl.p99, (long long)r->peak_running, (long long)r->preemptions, r->prefix_hit_rate,
                p[i].pareto);
    }
    if (ferror(f) | fclose(f)) return FL_ERR(FL_ERR_IO, "writing %s failed", path);
    return FL_OK;
}

fl_status fl_bench_sweep_run(fl_engine *e, int vocab, const fl_bench_workload *w, const fl_bench_sweep *s) {
    const int n_in = s->n_input ? s->n_input : 1, n = n_in * s->n_conc;
    point *p = calloc((size_t)n, sizeof *p);
    if (!p) return FL_ERR(FL_ERR_OOM, "out of memory");
    fl_status st = FL_OK;
    int done = 0;
    printf("%9s %11s %12s %12s %11s %11s %11s %8s\n", "input_len", "concurrency", "output tok/s", "total tok/s",
           "TTFT p50", "TPOT p50", "TPOT p99", "peak");
    for (int i = 0; i < n_in && st == FL_OK; i++) {
        for (int c = 0; c < s->n_conc && st == FL_OK; c++, done++) {
            fl_bench_workload pw = *w;
            if (s->n_input) pw.input_len = s->input[i];
            pw.max_concurrency = s->conc[c];
            pw.seed = w->seed + (uint64_t)done; /* fresh prompts: earlier points' blocks are no hits */
            p[done].input_len = pw.input_len;
            p[done].conc = pw.max_concurrency;
            st = fl_bench_workload_run(e, vocab, &pw, &p[done].r);
            if (st != FL_OK) break;
            const fl_bench_workload_result *r = &p[done].r;
            printf("%9d %11d %12.1f %12.1f %9.1fms %9.2fms %9.2fms %8lld\n", pw.input_len, pw.max_concurrency,
                   r->output_tok_s, r->total_tok_s, r->ttft.p50, r->tpot.p50, r->tpot.p99,
                   (long long)r->peak_running);
            fflush(stdout);
        }
    }
    if (st == FL_OK) {
        mark_pareto(p, n);
        st = write_csv(s->csv, p, n);
        if (st == FL_OK) printf("sweep: %d points written to %s\n", n, s->csv);
    }
    for (int i = 0; i < n; i++) fl_bench_workload_result_free(&p[i].r);
    free(p);
    return st;
}
