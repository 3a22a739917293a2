/*
 * bench_workload.c — `flotilla bench --workload` (bench_workload.h): draws
 * the requests (lengths, tokens, Poisson arrivals) from a seed, releases
 * each into the engine between steps when its time comes, times every
 * token on rank 0, and reports throughput, latency percentiles and the
 * scheduler's peaks as a summary block and JSON.
 *
 * Times: a request's clock starts at its scheduled arrival (as a client's
 * would), so TTFT includes waiting for the step in flight and the queue. A
 * token's time is the end of the step that produced it. Inter-token
 * latencies are the gaps between consecutive tokens of one request (a
 * preempted request's gap spans its recomputation); all of them feed the
 * mean, and a uniform reservoir of at most ITL_KEEP feeds the percentiles,
 * so memory stays bounded on long runs.
 */
#include "launcher/bench_workload.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "launcher/bench_sweep.h"

enum { ITL_KEEP = 1 << 22 };

void fl_bench_workload_opts_add(fl_bench_workload_opts *wo, fl_cli_opt *opts, int *n) {
    const fl_cli_opt add[] = {
        {"workload", false, &wo->workload, "run N requests of drawn lengths through the engine and report "
                                           "throughput and latency percentiles (docs/bench.md)"},
        {"num-prompts", true, &wo->num_prompts, "workload: requests (default 200)"},
        {"input-len", true, &wo->input_len, "workload: prompt tokens after the shared prefix (default 128)"},
        {"output-len", true, &wo->output_len, "workload: generated tokens, EOS ignored (default 128)"},
        {"input-len-range", true, &wo->input_range, "workload: R in [0, 1], prompts uniform in "
                                                    "[L(1-R), L(1+R)] (default 0)"},
        {"output-len-range", true, &wo->output_range, "workload: R in [0, 1], completions uniform in "
                                                      "[L(1-R), L(1+R)] (default 0)"},
        {"length-dist", true, &wo->length_dist, "workload: uniform | lognormal (median L, sigma 1: a "
                                                "ShareGPT-like long tail; default uniform)"},
        {"shared-prefix-len", true, &wo->shared_prefix, "workload: tokens every prompt starts with, "
                                                        "before its input-len (default 0)"},
        {"num-prefixes", true, &wo->num_prefixes, "workload: K different shared prefixes, each prompt "
                                                  "starting with one drawn at random (default 1)"},
        {"request-rate", true, &wo->request_rate, "workload: Poisson arrivals per second (default inf: all "
                                                  "at once)"},
        {"max-concurrency", true, &wo->max_concurrency, "workload: requests in flight at most (default: "
                                                        "no limit)"},
    };
    for (size_t i = 0; i < sizeof add / sizeof add[0]; i++) opts[(*n)++] = add[i];
}

const char *fl_bench_workload_flag_given(const fl_bench_workload_opts *wo, const fl_cli_model_opts *mo) {
    const struct {
        const char *v, *name;
    } f[] = {
        {wo->num_prompts, "num-prompts"},
        {wo->input_len, "input-len"},
        {wo->output_len, "output-len"},
        {wo->input_range, "input-len-range"},
        {wo->output_range, "output-len-range"},
        {wo->length_dist, "length-dist"},
        {wo->shared_prefix, "shared-prefix-len"},
        {wo->num_prefixes, "num-prefixes"},
        {wo->request_rate, "request-rate"},
        {wo->max_concurrency, "max-concurrency"},
        {mo->kv_cache_mb, "kv-cache-mb"},
        {mo->gpu_memory_utilization, "gpu-memory-utilization"},
        {mo->memory_budget, "memory-budget"},
        {mo->max_num_seqs, "max-num-seqs"},
        {mo->max_batched_tokens, "max-batched-tokens"},
        {mo->block_size, "block-size"},
        {mo->no_prefix_caching, "no-prefix-caching"},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v) return f[i].name;
    return NULL;
}

/* An integer flag in [lo, 2^24] into *out when given. */
static fl_status int_flag(const char *flag, const char *text, long lo, int *out) {
    long v;
    if (!text) return FL_OK;
    FL_TRY(fl_cli_int(flag, text, lo, 1 << 24, &v));
    *out = (int)v;
    return FL_OK;
}

fl_status fl_bench_workload_parse(const fl_bench_workload_opts *wo, const fl_cli_model_opts *mo,
                                  fl_bench_workload *w, fl_engine_config *ec) {
    *w = (fl_bench_workload){.num_prompts = 200, .input_len = 128, .output_len = 128, .num_prefixes = 1,
                             .request_rate = INFINITY};
    fl_sampling_params_default(&w->sp);
    FL_TRY(int_flag("num-prompts", wo->num_prompts, 1, &w->num_prompts));
    FL_TRY(int_flag("input-len", wo->input_len, 1, &w->input_len));
    FL_TRY(int_flag("output-len", wo->output_len, 1, &w->output_len));
    FL_TRY(int_flag("shared-prefix-len", wo->shared_prefix, 0, &w->shared_prefix_len));
    FL_TRY(int_flag("max-concurrency", wo->max_concurrency, 1, &w->max_concurrency));
    FL_TRY(int_flag("num-prefixes", wo->num_prefixes, 1, &w->num_prefixes));
    if (w->num_prefixes > 1 && !w->shared_prefix_len)
        return FL_ERR(FL_ERR_INVALID_ARG, "--num-prefixes %d needs --shared-prefix-len", w->num_prefixes);
    if ((int64_t)w->num_prefixes * w->shared_prefix_len > 1 << 26)
        return FL_ERR(FL_ERR_INVALID_ARG, "--num-prefixes %d x --shared-prefix-len %d: more than 2^26 prefix "
                      "tokens", w->num_prefixes, w->shared_prefix_len);
    if (wo->input_range) FL_TRY(fl_cli_float("input-len-range", wo->input_range, 0, 1, &w->input_range));
    if (wo->output_range) FL_TRY(fl_cli_float("output-len-range", wo->output_range, 0, 1, &w->output_range));
    if (wo->length_dist && !strcmp(wo->length_dist, "lognormal"))
        w->dist = FL_BENCH_LEN_LOGNORMAL;
    else if (wo->length_dist && strcmp(wo->length_dist, "uniform"))
        return FL_ERR(FL_ERR_INVALID_ARG, "--length-dist must be uniform or lognormal, got '%s'", wo->length_dist);
    if (w->dist == FL_BENCH_LEN_LOGNORMAL && (wo->input_range || wo->output_range))
        return FL_ERR(FL_ERR_INVALID_ARG, "--%s-len-range applies to --length-dist uniform only",
                      wo->input_range ? "input" : "output");
    if (wo->request_rate && strcmp(wo->request_rate, "inf"))
        FL_TRY(fl_cli_float("request-rate", wo->request_rate, 1e-6, 1e9, &w->request_rate));
    return fl_cli_engine_limits(mo, ec);
}

double fl_bench_percentile(const double *sorted, int64_t n, double p) {
    if (n <= 0) return 0;
    const double x = (double)(n - 1) * p / 100.0;
    const int64_t i = (int64_t)x;
    if (i + 1 >= n) return sorted[n - 1];
    return sorted[i] + (x - (double)i) * (sorted[i + 1] - sorted[i]);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v (n values, seconds) and summarizes them in milliseconds; the mean
 * is sum / total (the reservoir's total may exceed n). */
static fl_bench_stat summarize(double *v, int64_t n, double sum, int64_t total) {
    fl_bench_stat s = {.n = total};
    if (!n) return s;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    s.mean = sum / (double)total * 1e3;
    s.p50 = fl_bench_percentile(v, n, 50) * 1e3;
    s.p90 = fl_bench_percentile(v, n, 90) * 1e3;
    s.p99 = fl_bench_percentile(v, n, 99) * 1e3;
    return s;
}

/* One drawn length: uniform in [L(1-R), L(1+R)] or log-normal of median L. */
static int draw_len(fl_rng *rng, fl_bench_len_dist d, int len, double range) {
    double x;
    if (d == FL_BENCH_LEN_LOGNORMAL) {
        /* Box-Muller; 1 - U keeps the logarithm finite */
        const double u1 = 1.0 - fl_rng_uniform(rng), u2 = fl_rng_uniform(rng);
        const double z = sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
        x = round(exp(log((double)len) + FL_BENCH_LOGNORMAL_SIGMA * z));
    } else {
        const long lo = (long)floor(len * (1.0 - range)), hi = (long)ceil(len * (1.0 + range));
        x = (double)(lo + (long)(fl_rng_uniform(rng) * (double)(hi - lo + 1)));
    }
    return x < 1 ? 1 : x > (1 << 24) ? 1 << 24 : (int)x;
}

/* Rank 0's record of one request. */
typedef struct req {
    int n_in, n_out;   /* prompt (prefix included) and completion tokens, as drawn and clipped */
    double arrival;    /* seconds from the start */
    double t_first, t_last, t_done;
} req;

static void sleep_until(double t) {
    const double d = t - fl_engine_now();
    if (d <= 0) return;
    struct timespec ts = {.tv_sec = (time_t)d, .tv_nsec = (long)((d - floor(d)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

void fl_bench_workload_result_free(fl_bench_workload_result *r) {
    if (!r) return;
    free(r->input_lens);
    free(r->output_lens);
    free(r->expected_output_lens);
    free(r->ttft_ms);
    memset(r, 0, sizeof *r);
}

fl_status fl_bench_workload_run(fl_engine *e, int vocab, const fl_bench_workload *w, fl_bench_workload_result *r) {
    const int N = w->num_prompts, M = fl_engine_max_model_len(e), P = w->shared_prefix_len;
    fl_status st = FL_OK;
    memset(r, 0, sizeof *r);
    fl_engine_reset_peaks(e);
    r->n_requests = N;
    r->max_model_len = M;
    if (P > M - 2)
        return FL_ERR(FL_ERR_INVALID_ARG, "--shared-prefix-len %d leaves no room for a prompt token and an output "
                      "token in max_model_len %d", P, M);
    req *rq = calloc((size_t)N, sizeof *rq);
    fl_gen *gens = calloc((size_t)N, sizeof *gens);
    int32_t *prompt = NULL, *prefixes = NULL;
    double *itl = NULL, *tmp = NULL;
    int64_t itl_n = 0, itl_total = 0;
    double itl_sum = 0;
    int max_in = 1;
    r->input_lens = calloc((size_t)N, sizeof(int));
    r->output_lens = calloc((size_t)N, sizeof(int));
    r->expected_output_lens = calloc((size_t)N, sizeof(int));
    r->ttft_ms = calloc((size_t)N, sizeof(double));
    FL_CHECK_ALLOC(rq, st, done);
    FL_CHECK_ALLOC(gens, st, done);
    FL_CHECK_ALLOC(r->input_lens, st, done);
    FL_CHECK_ALLOC(r->output_lens, st, done);
    FL_CHECK_ALLOC(r->expected_output_lens, st, done);
    FL_CHECK_ALLOC(r->ttft_ms, st, done);
    /* Separate streams, so a different rate leaves the lengths and tokens as they were. */
    fl_rng len_rng, tok_rng, arr_rng, keep_rng, grp_rng;
    fl_rng_seed(&len_rng, w->seed * 4 + 0);
    fl_rng_seed(&tok_rng, w->seed * 4 + 1);
    fl_rng_seed(&arr_rng, w->seed * 4 + 2);
    fl_rng_seed(&keep_rng, w->seed * 4 + 3);
    fl_rng_seed(&grp_rng, w->seed ^ 0x70726566697865ull); /* its own: one group leaves the others as they were */
    double t = 0;
    for (int i = 0; i < N; i++) {
        int in = draw_len(&len_rng, w->dist, w->input_len, w->input_range);
        int out = draw_len(&len_rng, w->dist, w->output_len, w->output_range);
        /* prompt + completion must fit in max_model_len: the completion first, then the prompt */
        const int out_c = out > M - P - 1 ? M - P - 1 : out;
        const int in_c = in > M - P - out_c ? M - P - out_c : in;
        r->n_clipped += out_c != out || in_c != in;
        rq[i].n_in = P + in_c, rq[i].n_out = out_c;
        if (rq[i].n_in > max_in) max_in = rq[i].n_in;
        /* vLLM's benchmark_serving: the first request at once, then exponential gaps */
        if (i > 0 && isfinite(w->request_rate)) t += -log(1.0 - fl_rng_uniform(&arr_rng)) / w->request_rate;
        rq[i].arrival = t;
        r->expected_output_tokens += out_c;
    }
    r->last_arrival_s = t;
    prompt = malloc((size_t)max_in * sizeof *prompt);
    prefixes = malloc(((size_t)w->num_prefixes * P + 1) * sizeof *prefixes);
    FL_CHECK_ALLOC(prompt, st, done);
    FL_CHECK_ALLOC(prefixes, st, done);
    /* group 0's prefix is the one prompt[0 .. P) held with one group */
    for (size_t j = 0; j < (size_t)w->num_prefixes * P; j++)
        prefixes[j] = (int32_t)(fl_rng_next(&tok_rng) % (uint64_t)vocab);
    /* a request's gaps are one fewer than its tokens */
    const int64_t keep = r->expected_output_tokens < ITL_KEEP ? r->expected_output_tokens + 1 : ITL_KEEP;
    itl = malloc((size_t)keep * sizeof *itl);
    FL_CHECK_ALLOC(itl, st, done);

    fl_engine_stats s0, s1;
    fl_engine_get_stats(e, &s0);
    const double t0 = fl_engine_now();
    double host_s = 0, t_end = t0;
    int next = 0, in_flight = 0, n_done = 0;
    while (n_done < N) {
        const double now = fl_engine_now() - t0;
        while (next < N && rq[next].arrival <= now && (!w->max_concurrency || in_flight < w->max_concurrency)) {
            req *q = &rq[next];
            const int g = w->num_prefixes > 1 ? (int)(fl_rng_next(&grp_rng) % (uint64_t)w->num_prefixes) : 0;
            memcpy(prompt, prefixes + (size_t)g * P, (size_t)P * sizeof *prompt);
            for (int j = P; j < q->n_in; j++) prompt[j] = (int32_t)(fl_rng_next(&tok_rng) % (uint64_t)vocab);
            fl_sampling_params sp = w->sp;
            sp.seed = (uint64_t)next;
            FL_TRY_GOTO(fl_gen_init(&gens[next], next, prompt, q->n_in, &sp, q->n_out), st, done);
            gens[next].ignore_eos = true;
            gens[next].user = q;
            FL_TRY_GOTO(fl_engine_add(e, &gens[next]), st, done);
            next++, in_flight++;
        }
        if (!fl_engine_has_work(e)) {
            if (next >= N) {
                st = FL_ERR(FL_ERR_INTERNAL, "bench: %d requests unfinished and the engine idle", N - n_done);
                goto done;
            }
            /* idle: nothing in flight, so the concurrency limit is not what holds the next one */
            sleep_until(t0 + rq[next].arrival);
            continue;
        }
        fl_engine_stats sa, sb;
        fl_engine_get_stats(e, &sa);
        const double ts = fl_engine_now();
        fl_gen **up;
        int nu;
        FL_TRY_GOTO(fl_engine_step(e, &up, &nu), st, done);
        const double te = fl_engine_now();
        fl_engine_get_stats(e, &sb);
        host_s += (te - ts) - (sb.forward_seconds - sa.forward_seconds);
        for (int k = 0; k < nu; k++) {
            fl_gen *g = up[k];
            req *q = g->user;
            const int n = fl_gen_n_generated(g);
            if (g->finish == FL_FINISH_ERROR) {
                fprintf(stderr, "flotilla bench: request %lld failed: %s\n", (long long)(q - rq), g->error);
                r->n_failed++;
            } else if (n == 1) {
                q->t_first = te - t0;
            } else if (n > 1) {
                const double gap = te - t0 - q->t_last;
                itl_sum += gap;
                /* reservoir sampling (Vitter's R): every gap kept with equal chance */
                const int64_t slot =
                    itl_total < keep ? itl_total : (int64_t)(fl_rng_next(&keep_rng) % (uint64_t)(itl_total + 1));
                if (slot < keep) itl[slot] = gap;
                itl_total++;
            }
            q->t_last = te - t0;
            if (g->finish == FL_FINISH_NONE) continue;
            if (g->finish != FL_FINISH_ERROR) {
                q->t_done = te - t0;
                r->n_completed++;
                r->prompt_tokens += q->n_in;
                r->output_tokens += n;
            }
            r->output_lens[q - rq] = n;
            fl_gen_free(g);
            n_done++, in_flight--;
            t_end = te;
        }
    }
    fl_engine_get_stats(e, &s1);
    itl_n = itl_total < keep ? itl_total : keep;
    r->itl_kept = itl_n;
    r->duration_s = t_end - t0;
    const double d = r->duration_s > 0 ? r->duration_s : 1e-9;
    r->req_per_s = r->n_completed / d;
    r->output_tok_s = (double)r->output_tokens / d;
    r->total_tok_s = (double)(r->prompt_tokens + r->output_tokens) / d;
    r->steps = s1.steps - s0.steps;
    r->peak_running = s1.peak_running; /* reset at the start of this run */
    r->peak_kv_blocks_used = s1.peak_kv_blocks_used;
    r->kv_blocks = s1.kv_blocks;
    r->preemptions = s1.preemptions - s0.preemptions;
    r->swap_preemptions = s1.swap_preemptions - s0.swap_preemptions;
    r->swap_out_bytes = s1.swap_out_bytes - s0.swap_out_bytes;
    r->swap_in_bytes = s1.swap_in_bytes - s0.swap_in_bytes;
    r->admitted_prompt_tokens = s1.prompt_tokens - s0.prompt_tokens;
    r->cached_prompt_tokens = s1.cached_prompt_tokens - s0.cached_prompt_tokens;
    r->prefix_hit_rate = r->admitted_prompt_tokens ? (double)r->cached_prompt_tokens / r->admitted_prompt_tokens : 0;
    r->host_ms_per_step = r->steps ? host_s * 1e3 / r->steps : 0;
    const double fwd_s = s1.forward_seconds - s0.forward_seconds;
    const double pf_s = s1.prefill_forward_seconds - s0.prefill_forward_seconds;
    r->forward_ms_per_step = r->steps ? fwd_s * 1e3 / r->steps : 0;
    r->prefill_steps = s1.prefill_steps - s0.prefill_steps;
    r->prefill_rows = s1.prefill_tokens - s0.prefill_tokens;
    r->prefill_forward_ms_per_step = r->prefill_steps ? pf_s * 1e3 / r->prefill_steps : 0;
    const int64_t decode_steps = r->steps - r->prefill_steps;
    r->decode_forward_ms_per_step = decode_steps > 0 ? (fwd_s - pf_s) * 1e3 / decode_steps : 0;
    r->prefill_forward_share = fwd_s > 0 ? pf_s / fwd_s : 0;
    /* per-request latencies of the completed requests */
    tmp = malloc((size_t)N * sizeof *tmp);
    FL_CHECK_ALLOC(tmp, st, done);
    int64_t n = 0;
    double sum = 0;
    for (int i = 0; i < N; i++) {
        r->input_lens[i] = rq[i].n_in, r->expected_output_lens[i] = rq[i].n_out;
        r->ttft_ms[i] = rq[i].t_done > 0 ? (rq[i].t_first - rq[i].arrival) * 1e3 : -1;
        if (rq[i].t_done > 0) tmp[n++] = rq[i].t_first - rq[i].arrival, sum += tmp[n - 1];
    }
    r->ttft = summarize(tmp, n, sum, n);
    n = 0, sum = 0;
    for (int i = 0; i < N; i++)
        if (rq[i].t_done > 0 && r->output_lens[i] > 1)
            tmp[n++] = (rq[i].t_done - rq[i].t_first) / (r->output_lens[i] - 1), sum += tmp[n - 1];
    r->tpot = summarize(tmp, n, sum, n);
    n = 0, sum = 0;
    for (int i = 0; i < N; i++)
        if (rq[i].t_done > 0) tmp[n++] = rq[i].t_done - rq[i].arrival, sum += tmp[n - 1];
    r->e2e = summarize(tmp, n, sum, n);
    r->itl = summarize(itl, itl_n, itl_sum, itl_total);
done:
    /* after a failure the engine lets go of the requests still in it before they are freed */
    for (int i = 0; st != FL_OK && gens && i < N; i++) {
        if (gens[i].seq.tokens && gens[i].finish == FL_FINISH_NONE) fl_engine_finish(e, &gens[i], FL_FINISH_ERROR);
        fl_gen_free(&gens[i]);
    }
    free(gens);
    free(rq);
    free(prompt);
    free(prefixes);
    free(itl);
    free(tmp);
    if (st != FL_OK) fl_bench_workload_result_free(r);
    return st;
}

static void add_stat(cJSON *o, const char *name, const fl_bench_stat *s) {
    cJSON *x = cJSON_AddObjectToObject(o, name);
    cJSON_AddNumberToObject(x, "mean", s->mean);
    cJSON_AddNumberToObject(x, "p50", s->p50);
    cJSON_AddNumberToObject(x, "p90", s->p90);
    cJSON_AddNumberToObject(x, "p99", s->p99);
    cJSON_AddNumberToObject(x, "n", (double)s->n);
}

static cJSON *int_array(const int *v, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

static const char *kv_name(const fl_engine_config *c, const fl_cli_bundle *b) {
    if (c->kv_dtype != FL_KV_DTYPE_AUTO) return fl_kv_dtype_name(c->kv_dtype);
    return b->be->act_dtype == FL_DTYPE_F32 ? "f32" : "bf16";
}

static fl_status write_json(const char *path, const fl_bench_workload *w, const fl_bench_workload_info *in,
                            const fl_engine_config *c, const fl_cli_bundle *b, const fl_bench_workload_result *r) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return FL_ERR(FL_ERR_OOM, "bench: out of memory for the JSON report");
    cJSON_AddStringToObject(o, "mode", "workload");
    cJSON_AddStringToObject(o, "preset", in->preset);
    cJSON_AddStringToObject(o, "quantize", in->quantize);
    cJSON_AddNumberToObject(o, "layers", in->layers);
    cJSON_AddStringToObject(o, "backend", in->backend);
    cJSON_AddNumberToObject(o, "world", in->world);
    cJSON_AddNumberToObject(o, "tp", in->tp);
    cJSON_AddNumberToObject(o, "ep", in->ep);
    cJSON_AddNumberToObject(o, "dp", in->dp);
    cJSON *wl = cJSON_AddObjectToObject(o, "workload");
    cJSON_AddNumberToObject(wl, "num_prompts", w->num_prompts);
    cJSON_AddNumberToObject(wl, "input_len", w->input_len);
    cJSON_AddNumberToObject(wl, "output_len", w->output_len);
    cJSON_AddNumberToObject(wl, "input_len_range", w->input_range);
    cJSON_AddNumberToObject(wl, "output_len_range", w->output_range);
    cJSON_AddStringToObject(wl, "length_dist", w->dist == FL_BENCH_LEN_LOGNORMAL ? "lognormal" : "uniform");
    cJSON_AddNumberToObject(wl, "shared_prefix_len", w->shared_prefix_len);
    cJSON_AddNumberToObject(wl, "num_prefixes", w->num_prefixes);
    if (isfinite(w->request_rate)) cJSON_AddNumberToObject(wl, "request_rate", w->request_rate);
    else cJSON_AddStringToObject(wl, "request_rate", "inf");
    cJSON_AddNumberToObject(wl, "max_concurrency", w->max_concurrency);
    cJSON_AddNumberToObject(wl, "seed", (double)w->seed);
    cJSON *eg = cJSON_AddObjectToObject(o, "engine");
    cJSON_AddNumberToObject(eg, "max_num_seqs", c->max_num_seqs);
    cJSON_AddNumberToObject(eg, "max_num_batched_tokens", c->max_num_batched_tokens);
    cJSON_AddNumberToObject(eg, "max_model_len", c->max_model_len);
    cJSON_AddNumberToObject(eg, "n_blocks", c->n_blocks);
    cJSON_AddNumberToObject(eg, "block_size", c->block_size);
    cJSON_AddStringToObject(eg, "kv_dtype", kv_name(c, b));
    cJSON_AddBoolToObject(eg, "prefix_caching", c->prefix_caching);
    cJSON_AddNumberToObject(o, "completed", r->n_completed);
    cJSON_AddNumberToObject(o, "failed", r->n_failed);
    cJSON_AddNumberToObject(o, "clipped", r->n_clipped);
    cJSON_AddNumberToObject(o, "duration_s", r->duration_s);
    cJSON_AddNumberToObject(o, "last_arrival_s", r->last_arrival_s);
    cJSON_AddNumberToObject(o, "total_input_tokens", (double)r->prompt_tokens);
    cJSON_AddNumberToObject(o, "total_output_tokens", (double)r->output_tokens);
    cJSON_AddNumberToObject(o, "expected_output_tokens", (double)r->expected_output_tokens);
    cJSON_AddNumberToObject(o, "request_throughput", r->req_per_s);
    cJSON_AddNumberToObject(o, "output_throughput", r->output_tok_s);
    cJSON_AddNumberToObject(o, "total_token_throughput", r->total_tok_s);
    add_stat(o, "ttft_ms", &r->ttft);
    add_stat(o, "tpot_ms", &r->tpot);
    add_stat(o, "itl_ms", &r->itl);
    add_stat(o, "e2e_latency_ms", &r->e2e);
    cJSON_AddNumberToObject(o, "itl_samples_kept", (double)r->itl_kept);
    cJSON_AddNumberToObject(o, "steps", (double)r->steps);
    cJSON_AddNumberToObject(o, "peak_running", (double)r->peak_running);
    cJSON_AddNumberToObject(o, "kv_blocks", (double)r->kv_blocks);
    cJSON_AddNumberToObject(o, "peak_kv_blocks_used", (double)r->peak_kv_blocks_used);
    cJSON_AddNumberToObject(o, "peak_kv_fraction", r->kv_blocks ? (double)r->peak_kv_blocks_used / r->kv_blocks : 0);
    cJSON_AddNumberToObject(o, "preemptions", (double)r->preemptions);
    cJSON_AddNumberToObject(o, "preemptions_swap", (double)r->swap_preemptions);
    cJSON_AddNumberToObject(o, "preemptions_recompute", (double)(r->preemptions - r->swap_preemptions));
    cJSON_AddNumberToObject(o, "swap_out_bytes", (double)r->swap_out_bytes);
    cJSON_AddNumberToObject(o, "swap_in_bytes", (double)r->swap_in_bytes);
    cJSON_AddNumberToObject(o, "admitted_prompt_tokens", (double)r->admitted_prompt_tokens);
    cJSON_AddNumberToObject(o, "cached_prompt_tokens", (double)r->cached_prompt_tokens);
    cJSON_AddNumberToObject(o, "prefix_hit_rate", r->prefix_hit_rate);
    cJSON_AddNumberToObject(o, "host_ms_per_step", r->host_ms_per_step);
    cJSON_AddNumberToObject(o, "forward_ms_per_step", r->forward_ms_per_step);
    cJSON_AddNumberToObject(o, "prefill_steps", (double)r->prefill_steps);
    cJSON_AddNumberToObject(o, "prefill_rows", (double)r->prefill_rows);
    cJSON_AddNumberToObject(o, "prefill_forward_ms_per_step", r->prefill_forward_ms_per_step);
    cJSON_AddNumberToObject(o, "decode_forward_ms_per_step", r->decode_forward_ms_per_step);
    cJSON_AddNumberToObject(o, "prefill_forward_share", r->prefill_forward_share);
    cJSON_AddNumberToObject(o, "copy_ceiling_GBps", in->copy_ceiling / 1e9);
    cJSON_AddNumberToObject(o, "copy_ceiling_threads", in->copy_ceiling_threads);
    cJSON_AddItemToObject(o, "input_lens", int_array(r->input_lens, r->n_requests));
    cJSON_AddItemToObject(o, "output_lens", int_array(r->output_lens, r->n_requests));
    cJSON_AddItemToObject(o, "expected_output_lens", int_array(r->expected_output_lens, r->n_requests));
    cJSON *tt = cJSON_AddArrayToObject(o, "ttfts_ms");
    for (int i = 0; tt && i < r->n_requests; i++) cJSON_AddItemToArray(tt, cJSON_CreateNumber(r->ttft_ms[i]));
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!text) return FL_ERR(FL_ERR_OOM, "bench: out of memory for the JSON report");
    fl_status st = FL_OK;
    FILE *f = fopen(path, "w");
    if (!f) st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    else {
        const bool wrote = fprintf(f, "%s\n", text) >= 0;
        if (fclose(f) != 0 || !wrote) st = FL_ERR(FL_ERR_IO, "cannot write %s", path);
    }
    cJSON_free(text);
    return st;
}

static void print_stat(const char *name, const fl_bench_stat *s) {
    printf("%-22s %10.2f %10.2f %10.2f %10.2f\n", name, s->mean, s->p50, s->p90, s->p99);
}

static void print_summary(const fl_bench_workload *w, const fl_bench_workload_info *in, const fl_engine_config *c,
                          const fl_cli_bundle *b, const fl_bench_workload_result *r) {
    char rate[32] = "inf";
    if (isfinite(w->request_rate)) snprintf(rate, sizeof rate, "%g", w->request_rate);
    printf("============ workload: %s %s x%d layers on %s, world %d (tp %d, ep %d, dp %d) ============\n",
           in->preset, in->quantize, in->layers, in->backend, in->world, in->tp, in->ep, in->dp);
    char groups[48] = "";
    if (w->num_prefixes > 1) snprintf(groups, sizeof groups, ", one of %d", w->num_prefixes);
    printf("requests %d (%s lengths, input %d%s, output %d, shared prefix %d%s), rate %s/s, seed %llu\n",
           w->num_prompts, w->dist == FL_BENCH_LEN_LOGNORMAL ? "lognormal" : "uniform", w->input_len,
           w->shared_prefix_len ? " + prefix" : "", w->output_len, w->shared_prefix_len, groups, rate,
           (unsigned long long)w->seed);
    printf("engine: max_num_seqs %d, max_batched_tokens %d, max_model_len %d, %d KV blocks of %d tokens "
           "(%s), prefix caching %s\n", c->max_num_seqs, c->max_num_batched_tokens, c->max_model_len,
           c->n_blocks, c->block_size, kv_name(c, b), c->prefix_caching ? "on" : "off");
    printf("completed %d, failed %d, clipped to max_model_len %d\n", r->n_completed, r->n_failed, r->n_clipped);
    printf("duration %.3f s (last arrival %.3f s)\n", r->duration_s, r->last_arrival_s);
    printf("input tokens %lld, output tokens %lld\n", (long long)r->prompt_tokens, (long long)r->output_tokens);
    printf("throughput: %.2f req/s, %.1f output tok/s, %.1f total tok/s\n", r->req_per_s, r->output_tok_s,
           r->total_tok_s);
    printf("%-22s %10s %10s %10s %10s\n", "latency (ms)", "mean", "p50", "p90", "p99");
    print_stat("TTFT", &r->ttft);
    print_stat("TPOT", &r->tpot);
    print_stat("inter-token", &r->itl);
    print_stat("end-to-end", &r->e2e);
    printf("scheduler: %lld steps, peak %lld running, KV blocks peak %lld of %lld (%.1f%%), %lld preemptions "
           "(%lld swap, %.1f MiB out)\n",
           (long long)r->steps, (long long)r->peak_running, (long long)r->peak_kv_blocks_used,
           (long long)r->kv_blocks, r->kv_blocks ? 100.0 * r->peak_kv_blocks_used / r->kv_blocks : 0.0,
           (long long)r->preemptions, (long long)r->swap_preemptions, r->swap_out_bytes / 1048576.0);
    printf("prefix cache: %lld of %lld prompt tokens cached (%.1f%%)\n", (long long)r->cached_prompt_tokens,
           (long long)r->admitted_prompt_tokens, 100 * r->prefix_hit_rate);
    printf("per step: %.3f ms forward, %.3f ms host (scheduling, sampling, bookkeeping); copy ceiling %.1f GB/s\n",
           r->forward_ms_per_step, r->host_ms_per_step, in->copy_ceiling / 1e9);
    printf("forward time: %.1f%% in %lld steps with prompt rows (%lld rows, %.3f ms each), the rest in %lld "
           "decode-only steps (%.3f ms each)\n",
           100 * r->prefill_forward_share, (long long)r->prefill_steps, (long long)r->prefill_rows,
           r->prefill_forward_ms_per_step, (long long)(r->steps - r->prefill_steps), r->decode_forward_ms_per_step);
}

fl_status fl_bench_workload_main(fl_cli_bundle *b, fl_engine_config *ec, const fl_bench_workload *w,
                                 fl_bench_workload_info *info) {
    fl_status st = FL_OK;
    fl_bench_workload_result r;
    memset(&r, 0, sizeof r);
    ec->verbose = b->verbose; /* the memory plan next to what was measured */
    FL_TRY(fl_cli_engine_parallel(b, ec));
    FL_TRY(fl_engine_init(b->model, ec, &b->eng));
    fl_engine *e = b->eng;
    const bool sweep = info->sweep && info->sweep->n_conc > 0;
    if (!fl_engine_is_leader(e)) {
        FL_TRY(fl_engine_follow(e));
    } else {
        st = sweep ? fl_bench_sweep_run(e, b->model->cfg.vocab_size, w, info->sweep)
                   : fl_bench_workload_run(e, b->model->cfg.vocab_size, w, &r);
        /* the followers are released either way, so a bad workload ends every rank */
        fl_status rs = fl_engine_release_followers(e);
        if (st == FL_OK) st = rs;
        if (st != FL_OK) return st;
    }
    /* the ceiling of the run: world x the slowest rank's copy bandwidth */
    if (info->world > 1) {
        double mine = info->copy_ceiling;
        if (MPI_Allreduce(&mine, &info->copy_ceiling, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD) != MPI_SUCCESS)
            st = FL_ERR(FL_ERR_MPI, "bench: MPI_Allreduce of the copy ceiling failed");
    }
    info->copy_ceiling *= info->world;
    if (st == FL_OK && fl_engine_is_leader(e) && !sweep) {
        const fl_engine_config *c = fl_engine_config_of(e);
        print_summary(w, info, c, b, &r);
        if (info->output) st = write_json(info->output, w, info, c, b, &r);
    }
    fl_bench_workload_result_free(&r);
    return st;
}
