/*
 * progress.c — progress bar / progress lines and the end-of-job summary of
 * `flotilla generate` (see progress.h). Only rank 0 uses it.
 */
#include "launcher/progress.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void fl_progress_init(fl_progress *p, FILE *f, bool tty, double interval, long total,
                      long skipped, double now) {
    memset(p, 0, sizeof *p);
    p->f = f;
    p->tty = tty;
    p->interval = interval;
    p->t0 = p->last = now;
    p->total = total;
    p->skipped = skipped;
}

void fl_progress_free(fl_progress *p) {
    if (!p) return;
    free(p->ttft);
    free(p->tpot);
    p->ttft = p->tpot = NULL;
}

static fl_status push(double **a, size_t *n, size_t *cap, double v) {
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 256;
        double *na = realloc(*a, nc * sizeof *na);
        if (!na) return FL_ERR(FL_ERR_OOM, "out of memory recording %zu latencies", nc);
        *a = na;
        *cap = nc;
    }
    (*a)[(*n)++] = v;
    return FL_OK;
}

fl_status fl_progress_result(fl_progress *p, const fl_gen *g, bool error, long prompt_tokens,
                             long completion_tokens) {
    if (error) {
        p->errors++;
        return FL_OK;
    }
    p->ok++;
    p->in_tokens += prompt_tokens;
    p->out_tokens += completion_tokens;
    if (g && g->t_first_token > 0 && g->t_added > 0)
        FL_TRY(push(&p->ttft, &p->n_ttft, &p->cap_ttft, g->t_first_token - g->t_added));
    if (g && completion_tokens >= 2 && g->t_finished > g->t_first_token && g->t_first_token > 0)
        FL_TRY(push(&p->tpot, &p->n_tpot, &p->cap_tpot,
                    (g->t_finished - g->t_first_token) / (double)(completion_tokens - 1)));
    return FL_OK;
}

/* Cached prompt tokens / admitted prompt tokens, in percent (0 when none). */
static double prefix_hit_pct(const fl_progress *p) {
    return p->prefix_prompt_tokens > 0 ? 100.0 * (double)p->prefix_cached_tokens / (double)p->prefix_prompt_tokens
                                       : 0.0;
}

/* ", preempted N (S swap, R recompute)" once anything was preempted, else "". */
static void preempt_note(const fl_progress *p, char *buf, size_t n) {
    if (p->preemptions <= 0) {
        buf[0] = 0;
        return;
    }
    snprintf(buf, n, ", preempted %ld (%ld swap, %ld recompute)", p->preemptions, p->swap_preemptions,
             p->preemptions - p->swap_preemptions);
}

/* h:mm:ss, or m:ss under an hour. */
static void fmt_time(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 1e8) {
        snprintf(buf, n, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else
        snprintf(buf, n, "%ld:%02ld", t / 60, t % 60);
}

void fl_progress_live(fl_progress *p, long in_tokens, long out_tokens, double frac) {
    p->live_in = in_tokens;
    p->live_out = out_tokens;
    p->live_frac = frac;
}

bool fl_progress_due(const fl_progress *p, double now) {
    /* the bar at most 4x/s: redrawing per step would cost more than a step
     * of a small model and flood a slow terminal */
    double gap = p->tty ? 0.25 : p->interval;
    return now - p->last >= gap;
}

void fl_progress_tick(fl_progress *p, double now, bool force) {
    if (!force && !fl_progress_due(p, now)) return;
    p->last = now;
    double el = now - p->t0;
    long done = p->ok + p->errors;
    long out_tokens = p->out_tokens + p->live_out;
    double tps = el > 0 ? out_tokens / el : 0;
    /* requests done, counting the running ones by how far they got */
    double progress = (double)done + p->live_frac;
    char els[32], eta[32], tot[32];
    fmt_time(els, sizeof els, el);
    if (p->total >= 0 && progress > 0)
        fmt_time(eta, sizeof eta, el / progress * ((double)p->total - progress));
    else
        snprintf(eta, sizeof eta, "?");
    if (p->total >= 0)
        snprintf(tot, sizeof tot, "%ld", p->total);
    else
        snprintf(tot, sizeof tot, "?");
    char pre[160], note[96];
    preempt_note(p, note, sizeof note);
    /* ", N blocks from disk" once the disk tier served any */
    snprintf(pre, sizeof pre, "%s%ld%s%s", p->disk_hit_blocks > 0 ? ", " : "", p->disk_hit_blocks,
             p->disk_hit_blocks > 0 ? " blocks from disk" : "", note);
    if (p->disk_hit_blocks <= 0) snprintf(pre, sizeof pre, "%s", note);
    if (p->tty) {
        enum { W = 30 };
        char bar[W + 1];
        int fill = p->total > 0 ? (int)((double)done / (double)p->total * W) : 0;
        if (fill > W) fill = W;
        for (int i = 0; i < W; i++) bar[i] = i < fill ? '#' : '.';
        bar[W] = 0;
        /* \r and erase-to-end-of-line: one line redrawn in place */
        fprintf(p->f, "\r[%s] %ld/%s req | %.1f tok/s | %s elapsed | ETA %s | prefix hit %.1f%%%s\x1b[K", bar,
                done, tot, tps, els, eta, prefix_hit_pct(p), pre);
        p->drawn = true;
    } else {
        fprintf(p->f, "flotilla generate: progress %ld/%s requests, %ld output tokens, %.1f tok/s, "
                "elapsed %s, ETA %s, prefix hit %.1f%%%s\n", done, tot, out_tokens, tps, els, eta,
                prefix_hit_pct(p), pre);
    }
    fflush(p->f);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted a[n]; NAN when n == 0. */
static double pct(const double *a, size_t n, double q) {
    if (n == 0) return NAN;
    size_t k = (size_t)ceil(q / 100.0 * (double)n);
    if (k < 1) k = 1;
    return a[k - 1];
}

/* "p50 X, p90 Y, p99 Z" of sorted a[n] times scale, or a plain "n/a (...)"
 * when no request gave a sample (a NaN in a summary reads as a bug). */
static void pct_line(char *buf, size_t n, const double *a, size_t na, double scale,
                     const char *fmt) {
    if (na == 0) {
        snprintf(buf, n, "n/a (no request measured)");
        return;
    }
    static const double qs[3] = {50, 90, 99};
    size_t w = 0;
    for (int i = 0; i < 3 && w < n; i++) {
        w += (size_t)snprintf(buf + w, n - w, "%sp%.0f ", i ? ", " : "", qs[i]);
        if (w < n) w += (size_t)snprintf(buf + w, n - w, fmt, scale * pct(a, na, qs[i]));
    }
}

static cJSON *pct_json(const double *a, size_t n) {
    cJSON *o = cJSON_CreateObject();
    static const double qs[3] = {50, 90, 99};
    static const char *names[3] = {"p50", "p90", "p99"};
    for (int i = 0; o && i < 3; i++) {
        if (n)
            cJSON_AddNumberToObject(o, names[i], pct(a, n, qs[i]));
        else
            cJSON_AddNullToObject(o, names[i]);
    }
    return o;
}

fl_status fl_progress_summary(fl_progress *p, double now, bool interrupted,
                              const char *json_path) {
    fl_progress_live(p, 0, 0, 0); /* the job is over: nothing is in flight */
    if (p->drawn) {
        fl_progress_tick(p, now, true);
        fputc('\n', p->f);
        p->drawn = false;
    }
    if (p->n_ttft) qsort(p->ttft, p->n_ttft, sizeof *p->ttft, cmp_double);
    if (p->n_tpot) qsort(p->tpot, p->n_tpot, sizeof *p->tpot, cmp_double);
    double wall = now - p->t0;
    double tps = wall > 0 ? p->out_tokens / wall : 0;
    char ttft[96], tpot[96];
    pct_line(ttft, sizeof ttft, p->ttft, p->n_ttft, 1, "%.3f s");
    pct_line(tpot, sizeof tpot, p->tpot, p->n_tpot, 1e3, "%.1f ms");
    fprintf(p->f,
            "flotilla generate: %s: %ld requests (%ld ok, %ld errors; %ld already done, %ld dropped)\n"
            "  tokens      %ld input, %ld output\n"
            "  wall time   %.2f s, %.1f output tok/s\n"
            "  TTFT        %s\n"
            "  TPOT        %s\n"
            "  steps       %ld (%ld greedy picked where the logits are, %ld sampled there)\n",
            interrupted ? "interrupted" : "done", p->ok + p->errors, p->ok, p->errors, p->skipped,
            p->dropped, p->in_tokens, p->out_tokens, wall, tps, ttft, tpot, p->steps,
            p->greedy_steps, p->sampled_steps);
    fprintf(p->f, "  prefix hit  %.1f%% of prompt tokens (%ld of %ld from the KV cache)\n", prefix_hit_pct(p),
            p->prefix_cached_tokens, p->prefix_prompt_tokens);
    /* concurrency: how full the batch got (the cache sizes max_num_seqs) */
    fprintf(p->f, "  concurrency %ld sequences at peak (max_num_seqs %ld)\n", p->peak_running, p->max_num_seqs);
    /* preemptions: the KV cache was too small for the batch at some point */
    fprintf(p->f, "  preemption  %ld (%ld by swap, %ld by recompute); swapped %.1f MiB out, %.1f MiB in\n",
            p->preemptions, p->swap_preemptions, p->preemptions - p->swap_preemptions, p->swap_out_bytes / 1048576.0,
            p->swap_in_bytes / 1048576.0);
    if (p->kv_disk)
        fprintf(p->f, "  KV on disk  %ld blocks (%ld prompt tokens) read from --kv-offload-dir\n", p->disk_hit_blocks,
                p->disk_hit_tokens);
    fflush(p->f);
    if (!json_path) return FL_OK;
    fl_status st = FL_OK;
    char *text = NULL;
    FILE *f = NULL;
    cJSON *o = cJSON_CreateObject();
    if (!o) return FL_ERR(FL_ERR_OOM, "out of memory building the summary");
    cJSON_AddNumberToObject(o, "requests", (double)(p->ok + p->errors));
    cJSON_AddNumberToObject(o, "ok", (double)p->ok);
    cJSON_AddNumberToObject(o, "errors", (double)p->errors);
    cJSON_AddNumberToObject(o, "already_done", (double)p->skipped);
    cJSON_AddNumberToObject(o, "dropped", (double)p->dropped);
    cJSON_AddBoolToObject(o, "interrupted", interrupted);
    cJSON_AddNumberToObject(o, "input_tokens", (double)p->in_tokens);
    cJSON_AddNumberToObject(o, "output_tokens", (double)p->out_tokens);
    cJSON_AddNumberToObject(o, "wall_seconds", wall);
    cJSON_AddNumberToObject(o, "output_tokens_per_second", tps);
    cJSON_AddNumberToObject(o, "steps", (double)p->steps);
    cJSON_AddNumberToObject(o, "greedy_steps_on_device", (double)p->greedy_steps);
    cJSON_AddNumberToObject(o, "sampled_steps_on_device", (double)p->sampled_steps);
    cJSON_AddNumberToObject(o, "prefix_prompt_tokens", (double)p->prefix_prompt_tokens);
    cJSON_AddNumberToObject(o, "prefix_cached_tokens", (double)p->prefix_cached_tokens);
    cJSON_AddNumberToObject(o, "prefix_hit_rate",
                            p->prefix_prompt_tokens > 0
                                ? (double)p->prefix_cached_tokens / (double)p->prefix_prompt_tokens
                                : 0.0);
    cJSON_AddItemToObject(o, "ttft_seconds", pct_json(p->ttft, p->n_ttft));
    cJSON_AddItemToObject(o, "tpot_seconds", pct_json(p->tpot, p->n_tpot));
    cJSON_AddNumberToObject(o, "peak_running_sequences", (double)p->peak_running);
    cJSON_AddNumberToObject(o, "max_num_seqs", (double)p->max_num_seqs);
    cJSON_AddNumberToObject(o, "preemptions", (double)p->preemptions);
    cJSON_AddNumberToObject(o, "preemptions_swap", (double)p->swap_preemptions);
    cJSON_AddNumberToObject(o, "preemptions_recompute", (double)(p->preemptions - p->swap_preemptions));
    cJSON_AddNumberToObject(o, "swap_out_bytes", p->swap_out_bytes);
    cJSON_AddNumberToObject(o, "swap_in_bytes", p->swap_in_bytes);
    cJSON_AddBoolToObject(o, "kv_offload", p->kv_disk);
    cJSON_AddNumberToObject(o, "kv_disk_hit_blocks", (double)p->disk_hit_blocks);
    cJSON_AddNumberToObject(o, "kv_disk_hit_tokens", (double)p->disk_hit_tokens);
    text = cJSON_Print(o);
    if (!text) {
        st = FL_ERR(FL_ERR_OOM, "out of memory formatting the summary");
        goto done;
    }
    f = fopen(json_path, "w");
    if (!f || fputs(text, f) == EOF || fputc('\n', f) == EOF) {
        st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", json_path, strerror(errno));
        goto done;
    }
    if (fclose(f) != 0) st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", json_path, strerror(errno));
    f = NULL;
done:
    if (f) fclose(f);
    free(text);
    cJSON_Delete(o);
    return st;
}
