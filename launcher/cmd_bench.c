/*
 * cmd_bench.c — `flotilla bench`: decode and prefill speed of a synthetic
 * model of a real shape (random weights, no download), reported against the
 * backend's copy-bandwidth ceiling measured in the same run (PERF.md:
 * decode reads every weight once per step, so bytes / bandwidth is the
 * floor), or of a real checkpoint (--model: safetensors folder or GGUF).
 * Prints a one-line summary last and writes the full numbers as JSON. On
 * the CPU backend the ceiling is a STREAM-like copy and read over the
 * decode's thread count (kernels/cpu/cpu_stream.h), prefill also reports
 * GFLOP/s, and a --batch over 1 on one rank is followed by a batch-1 pass
 * (docs/bench.md, "CPU backend").
 *
 * The engine settings are generate's (launcher/cli.c, fl_cli_settings_add):
 * --cuda-graphs on|off (decode steps replayed as CUDA graphs,
 * runtime/model/forward_graph.h); --step-timing syncs between the phases of
 * each decode step and reports their mean durations (host prep, enqueue, GPU
 * wait, logits). --moe-overlap off|on|serial|alternate
 * (runtime/model/forward_moe.h): with dp > 1 and a MoE preset the JSON gets the
 * all-to-all exchange's mode and, in the in-order modes (off, serial, and
 * every mode on the CPU), its host-timed cost per decode step. alternate
 * runs decode steps off and on by turns and reports both medians, the
 * exchange time of the off steps and the fraction of it the overlap hides:
 * (step_off - step_on) / exchange_off (scripts/gpu-moe-overlap.sh).
 * FL_BENCH_PROFILE_LAST=1 marks the last decode step of the whole batch as
 * the profiler's range (backend op profile_range): the last one, or the one
 * after which the first sequence is done (a long chunked prefill gives the
 * first sequences decode rows early); `ncu --profile-from-start off` then
 * records that step's kernels only (scripts/gpu-profile.sh).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "kernels/cpu/cpu_stream.h"
#include "kernels/pool.h"
#include "launcher/bench_sweep.h"
#include "launcher/bench_workload.h"
#include "launcher/cli.h"
#include "runtime/model/forward_graph.h"
#include "runtime/model/forward_moe.h"
#include "runtime/load/synth.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n ? v[n / 2] : 0;
}

extern char **environ;

/* The FL_* variables of this run's environment as a JSON object (NULL:
 * out of memory): a results file then says which kernels and knobs it ran
 * with (FL_CUDA_TUNE, FL_CUDA_GRAPHS, ...). */
static cJSON *bench_env(void) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    for (char **e = environ; e && *e; e++) {
        const char *eq = strchr(*e, '=');
        if (strncmp(*e, "FL_", 3) != 0 || !eq || eq - *e > 127) continue;
        char name[128];
        memcpy(name, *e, (size_t)(eq - *e));
        name[eq - *e] = '\0';
        cJSON_AddStringToObject(o, name, eq + 1);
    }
    return o;
}

/* Copy bandwidth (read + write bytes per second), median of 20 copies: the
 * backend's copy on a GPU; on the CPU backend the best of 5 STREAM-like
 * copies split over as many threads as the decode runs (*threads; 1
 * elsewhere), and the read bandwidth of the same buffer into *read_bw (0
 * elsewhere), since a decode step only reads its weights. */
static fl_status copy_ceiling(fl_backend *be, size_t bytes, double *bw, double *read_bw, int *threads) {
    void *a = NULL, *b = NULL;
    fl_status st = FL_OK;
    double t[20];
    const bool cpu = !strcmp(be->name, "cpu"); /* backend memory is host memory there */
    *threads = cpu ? fl_pool_threads() : 1;
    *read_bw = 0;
    if (cpu) {
        fl_cpu_stream_result sr;
        FL_TRY(fl_cpu_stream_measure(bytes, *threads, 5, &sr));
        *bw = sr.copy_Bps;
        *read_bw = sr.read_Bps;
        return FL_OK;
    }
    FL_TRY_GOTO(be->ops->alloc(be, bytes, &a), st, done);
    FL_TRY_GOTO(be->ops->alloc(be, bytes, &b), st, done);
    FL_TRY_GOTO(be->ops->memset0(be, a, bytes), st, done);
    for (int i = -1; i < 20; i++) { /* -1: warm-up, first touch */
        double t0 = fl_engine_now();
        FL_TRY_GOTO(be->ops->copy(be, b, a, bytes), st, done);
        FL_TRY_GOTO(be->ops->sync(be), st, done);
        if (i >= 0) t[i] = fl_engine_now() - t0;
    }
    *bw = 2.0 * (double)bytes / median(t, 20);
done:
    if (a) be->ops->free(be, a);
    if (b) be->ops->free(be, b);
    return st;
}

/* The communication ceiling of a multi-rank run, measured on the same
 * communicator the forward pass uses (NCCL on GPUs, MPI on the CPU):
 * latency of an all-reduce of one token's hidden state (what each
 * tensor-parallel block waits for at batch 1), and the bus bandwidth of a
 * large all-reduce and all-to-all (nccl-tests' busBw: 2(n-1)/n and (n-1)/n
 * times bytes / time). Every rank runs it; the numbers are rank 0's. */
typedef struct comm_ceiling {
    double ar_hidden_us;      /* one all-reduce, host waits for it */
    double ar_hidden_pipe_us; /* 100 enqueued back to back / 100: the device-side cost */
    double ar_busbw, a2a_busbw;
} comm_ceiling;

/* One timed collective: what time_op runs `reps` times between a barrier
 * and one wait for the communicator. */
typedef struct comm_op {
    fl_comm *c;
    fl_comm_dtype dt;
    void *a, *b;
    size_t count;                 /* all-reduce elements (in place on a) */
    const size_t *cnt, *dis;      /* all-to-all parts (a -> b); NULL: all-reduce */
} comm_op;

/* Median over `runs` (after `warm` untimed) of the time per collective of
 * `reps` enqueued back to back. */
static fl_status time_op(const comm_op *op, int warm, int runs, int reps, double *sec) {
    double t[50];
    for (int i = -warm; i < runs; i++) {
        FL_TRY(fl_comm_barrier(op->c));
        double t0 = fl_engine_now();
        for (int k = 0; k < reps; k++)
            FL_TRY(op->cnt ? fl_comm_all_to_all_v(op->c, op->a, op->cnt, op->dis, op->b, op->cnt, op->dis, op->dt)
                           : fl_comm_all_reduce_sum(op->c, op->a, op->a, op->count, op->dt));
        FL_TRY(fl_comm_sync(op->c));
        if (i >= 0) t[i] = (fl_engine_now() - t0) / reps;
    }
    *sec = median(t, runs);
    return FL_OK;
}

static fl_status time_comm(fl_comm *c, fl_backend *be, int hidden, size_t big, comm_ceiling *out) {
    const int n = fl_comm_size(c);
    const fl_comm_dtype dt = be->act_dtype == FL_DTYPE_F32 ? FL_COMM_F32 : FL_COMM_BF16;
    const size_t es = fl_comm_dtype_size(dt), elems = big / es / (size_t)n * (size_t)n;
    size_t *cnt = calloc((size_t)n, sizeof *cnt), *dis = calloc((size_t)n, sizeof *dis);
    void *a = NULL, *b = NULL;
    double sec = 0;
    fl_status st = FL_OK;
    FL_CHECK_ALLOC(cnt, st, done);
    FL_CHECK_ALLOC(dis, st, done);
    for (int r = 0; r < n; r++) cnt[r] = elems / (size_t)n, dis[r] = (size_t)r * (elems / (size_t)n);
    FL_TRY_GOTO(be->ops->alloc(be, elems * es, &a), st, done);
    FL_TRY_GOTO(be->ops->alloc(be, elems * es, &b), st, done);
    FL_TRY_GOTO(be->ops->memset0(be, a, elems * es), st, done);
    FL_TRY_GOTO(be->ops->sync(be), st, done);
    comm_op op = {.c = c, .dt = dt, .a = a, .b = b, .count = (size_t)hidden};
    /* one hidden state: waited for each time, then 100 back to back */
    FL_TRY_GOTO(time_op(&op, 5, 50, 1, &sec), st, done);
    out->ar_hidden_us = sec * 1e6;
    FL_TRY_GOTO(time_op(&op, 1, 5, 100, &sec), st, done);
    out->ar_hidden_pipe_us = sec * 1e6;
    op.count = elems;
    FL_TRY_GOTO(time_op(&op, 2, 10, 1, &sec), st, done);
    out->ar_busbw = 2.0 * (n - 1) / n * (double)(elems * es) / sec;
    op.cnt = cnt, op.dis = dis;
    FL_TRY_GOTO(time_op(&op, 2, 10, 1, &sec), st, done);
    out->a2a_busbw = (double)(n - 1) / n * (double)(elems * es) / sec;
done:
    if (a) be->ops->free(be, a);
    if (b) be->ops->free(be, b);
    free(cnt);
    free(dis);
    return st;
}

/* The synthetic prompt of sequence i: spread over the vocabulary. */
static void fill_prompt(int32_t *prompt, long i, long plen, int vocab) {
    for (long j = 0; j < plen; j++) prompt[j] = (int32_t)((i * 7919 + j * 104729) % vocab);
}

/* One sequence alone on a fresh engine (*eng, freed by the caller): its
 * prefill time and the median of its glen - 1 decode steps. The CPU
 * backend's batch-1 numbers next to a larger --batch; one rank only (the
 * other ranks would have to follow a second engine). */
static fl_status batch1_pass(fl_model *m, const fl_engine_config *ec_main, long plen, long glen,
                             const fl_sampling_params *sp_main, fl_engine **eng, double *t_prefill,
                             double *step_med) {
    fl_engine_config ec = *ec_main;
    fl_sampling_params sp = *sp_main;
    fl_gen g = {0};
    bool g_init = false;
    int32_t *prompt = malloc((size_t)plen * sizeof *prompt);
    double *st_t = calloc((size_t)glen, sizeof *st_t);
    int n = 0;
    fl_status st = FL_OK;
    FL_CHECK_ALLOC(prompt, st, done);
    FL_CHECK_ALLOC(st_t, st, done);
    ec.max_num_seqs = 1;
    ec.max_num_batched_tokens = (int)(plen < 8192 ? plen : 8192);
    ec.n_blocks = (ec.max_model_len + ec.block_size - 1) / ec.block_size;
    FL_TRY_GOTO(fl_engine_init(m, &ec, eng), st, done);
    fill_prompt(prompt, 0, plen, m->cfg.vocab_size);
    sp.seed = 0;
    FL_TRY_GOTO(fl_gen_init(&g, 0, prompt, (int)plen, &sp, (int)glen), st, done);
    g_init = true;
    FL_TRY_GOTO(fl_engine_add(*eng, &g), st, done);
    double t0 = fl_engine_now();
    while (fl_gen_n_generated(&g) < 1) {
        fl_gen **up;
        int nu;
        FL_TRY_GOTO(fl_engine_step(*eng, &up, &nu), st, done);
    }
    *t_prefill = fl_engine_now() - t0;
    while (fl_engine_has_work(*eng) && n < glen) {
        fl_gen **up;
        int nu;
        double ts = fl_engine_now();
        FL_TRY_GOTO(fl_engine_step(*eng, &up, &nu), st, done);
        st_t[n++] = fl_engine_now() - ts;
    }
    *step_med = median(st_t, n);
done:
    /* the engine may still point at the sequence: free it first */
    fl_engine_free(*eng);
    *eng = NULL;
    if (g_init) fl_gen_free(&g);
    free(prompt);
    free(st_t);
    return st;
}

typedef struct bench_opts {
    const char *preset, *quant, *batch, *prompt, *gen, *layers, *output, *seed, *threads, *temp, *top_k,
        *top_p, *max_len, *help;
    fl_cli_model_opts mo; /* backend, tp, ep, bind, verbose and the engine settings */
    fl_bench_workload_opts wo; /* --workload and its flags */
    const char *sweep_conc, *sweep_input, *sweep_csv;
} bench_opts;

int fl_cmd_bench(int argc, char **argv) {
    bench_opts o = {0};
    /* the presets' names, from synth.c's table */
    char preset_help[512] = "";
    for (int i = 0; i < fl_synth_preset_count(); i++) {
        size_t len = strlen(preset_help);
        snprintf(preset_help + len, sizeof preset_help - len, "%s%s", i ? " | " : "", fl_synth_preset_name(i));
    }
    fl_cli_opt opts[FL_CLI_MAX_OPTS] = {
        {"preset", true, &o.preset, preset_help},
        {"model", true, &o.mo.model, "time this checkpoint (HF folder, .safetensors, .gguf) instead of a preset"},
        {"quantize", true, &o.quant, "none (bf16; a --model as stored) | w4 (group 128) | fp8 (e4m3 weights and activations); default none"},
        {"batch", true, &o.batch, "sequences decoded together (default 1)"},
        {"prompt-len", true, &o.prompt, "prompt tokens per sequence (default 16)"},
        {"gen-len", true, &o.gen, "generated tokens per sequence (default 32)"},
        {"max-model-len", true, &o.max_len, "context limit the engine is sized for (default prompt + gen + 1; "
                                            "a serving job's is the model's, e.g. 8192)"},
        {"layers", true, &o.layers, "override the layer count (smaller runs on CPUs)"},
        {"backend", true, &o.mo.backend, "auto | cpu | cuda (default auto)"},
        {"tp", true, &o.mo.tp, "tensor-parallel ranks (under mpirun; default: world size)"},
        {"ep", true, &o.mo.ep, "expert-parallel ranks for MoE layers (default 1)"},
        {"dp", true, &o.mo.dp, "data-parallel replicas (default world / tp)"},
        {"bind", true, &o.mo.bind, "auto | none: pin each rank near its GPU (default auto)"},
        {"verbose", false, &o.mo.verbose, "print each rank's layout and binding"},
        {"threads", true, &o.threads, "CPU threads"},
        {"seed", true, &o.seed, "weight seed; --workload: also the lengths, tokens and arrivals (default 1)"},
        {"temperature", true, &o.temp, "sample the generated tokens at this temperature (default 0 = greedy)"},
        {"top-k", true, &o.top_k, "sampling: keep the k most likely tokens (default 0 = off)"},
        {"top-p", true, &o.top_p, "sampling: nucleus mass (default 1 = off)"},
        {"output", true, &o.output, "write the full results as JSON here"},
        {"config", true, &o.mo.config, "YAML file of options (flags override it)"},
        {"help", false, &o.help, "show this help"},
    };
    int n_opts = 0;
    while (opts[n_opts].name) n_opts++;
    fl_cli_settings_add(&o.mo, opts, &n_opts);
    fl_bench_workload_opts_add(&o.wo, opts, &n_opts);
    {
        const fl_cli_opt sw[] = {
            {"sweep-concurrency", true, &o.sweep_conc, "workload: run it once per max concurrency in this list "
                                                       "(e.g. 1,8,64,256) and write --sweep-csv"},
            {"sweep-input-len", true, &o.sweep_input, "workload sweep: and once per input length in this list"},
            {"sweep-csv", true, &o.sweep_csv, "workload sweep: one CSV row per point, the Pareto front of "
                                              "throughput vs per-token latency marked (scripts/plot-sweep.sh)"},
        };
        for (size_t i = 0; i < sizeof sw / sizeof sw[0]; i++) opts[n_opts++] = sw[i];
    }
    fl_cli_engine_limits_add(&o.mo, opts, &n_opts);
    fl_status st = fl_cli_parse("bench", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("bench", st);
    if (o.help) {
        fl_cli_usage(stdout, "bench", "--preset NAME | --model PATH [--quantize w4] [--batch B] [--gen-len G]\n"
                     "       flotilla bench --workload --preset NAME [--num-prompts N] [--input-len L] "
                     "[--output-len L] [--request-rate R]", opts);
        printf("\npresets (synthetic random weights of these shapes):\n");
        for (int i = 0; i < fl_synth_preset_count(); i++)
            printf("  %-18s %s\n", fl_synth_preset_name(i), fl_synth_preset_about(i));
        return 0;
    }
    if (!o.preset == !o.mo.model) {
        fprintf(stderr, "flotilla bench: give one of --preset NAME and --model PATH\n");
        return 1;
    }
    /* what the report names: the preset, or the checkpoint */
    const char *what = o.preset ? o.preset : o.mo.model;
    long batch = 1, plen = 16, glen = 32, layers = 0, seed = 1, max_len = 0;
    fl_cli_bundle bu;
    memset(&bu, 0, sizeof bu);
    bu.verbose = o.mo.verbose != NULL;
    fl_gen *gens = NULL;
    double *step_t = NULL, *mode_t[2] = {NULL, NULL}; /* alternate: off / on steps */
    int n_mode[2] = {0, 0};
    double x_off_s = 0; /* alternate: the off steps' activation exchange */
    fl_model_config cfg;
    fl_load_quant q = FL_LOAD_AS_STORED;
    FILE *jf = NULL;
    /* the engine's settings (flags, --config keys, FL_ variables), checked
     * before anything is built */
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    FL_TRY_GOTO(fl_cli_engine_settings(&o.mo, &ec), st, done);
    if (o.batch) FL_TRY_GOTO(fl_cli_int("batch", o.batch, 1, 4096, &batch), st, done);
    if (o.prompt) FL_TRY_GOTO(fl_cli_int("prompt-len", o.prompt, 1, 1 << 20, &plen), st, done);
    if (o.gen) FL_TRY_GOTO(fl_cli_int("gen-len", o.gen, 2, 1 << 20, &glen), st, done);
    if (o.layers && o.mo.model) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--layers applies to --preset only (a --model has its own)");
        goto done;
    }
    if (o.layers) FL_TRY_GOTO(fl_cli_int("layers", o.layers, 1, 1024, &layers), st, done);
    if (o.max_len) FL_TRY_GOTO(fl_cli_int("max-model-len", o.max_len, 2, 1 << 24, &max_len), st, done);
    if (o.seed) FL_TRY_GOTO(fl_cli_int("seed", o.seed, 0, 1L << 62, &seed), st, done);
    /* --workload: N drawn requests through the engine (launcher/bench_workload.c) */
    fl_bench_workload wl;
    fl_bench_sweep sweep;
    FL_TRY_GOTO(fl_bench_sweep_parse(o.sweep_conc, o.sweep_input, o.sweep_csv, &sweep), st, done);
    if (o.wo.workload) {
        const char *fixed = o.batch ? "batch" : o.prompt ? "prompt-len" : o.gen ? "gen-len" : NULL;
        if (fixed) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "--%s sizes the fixed batch; --workload takes --num-prompts, "
                        "--input-len and --output-len", fixed);
            goto done;
        }
        FL_TRY_GOTO(fl_bench_workload_parse(&o.wo, &o.mo, &wl, &ec), st, done);
        wl.seed = (uint64_t)seed;
        if (max_len && wl.shared_prefix_len > max_len - 2) { /* before a model is built */
            st = FL_ERR(FL_ERR_INVALID_ARG, "--shared-prefix-len %d leaves no room for a prompt token and an "
                        "output token in --max-model-len %ld", wl.shared_prefix_len, max_len);
            goto done;
        }
        ec.max_model_len = (int)max_len; /* 0: the preset's, capped by the cache */
    } else {
        const char *wflag = fl_bench_workload_flag_given(&o.wo, &o.mo);
        if (!wflag && sweep.n_conc) wflag = "sweep-concurrency";
        if (wflag) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "--%s applies to --workload only (the fixed batch sizes its own "
                        "cache)", wflag);
            goto done;
        }
        /* the fixed batch's cache is sized here, its element type is the user's */
        if (o.mo.kv_cache_dtype) FL_TRY_GOTO(fl_kv_dtype_parse(o.mo.kv_cache_dtype, &ec.kv_dtype), st, done);
    }
    if (!o.wo.workload && max_len && max_len < plen + glen + 1) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--max-model-len %ld is under prompt + gen + 1 = %ld", max_len,
                    plen + glen + 1);
        goto done;
    }
    /* the decode's sampling, one rng stream per sequence */
    fl_sampling_params sp;
    fl_sampling_params_default(&sp);
    double sv = 0;
    long sk = 0;
    if (o.temp) FL_TRY_GOTO(fl_cli_float("temperature", o.temp, 0, 100, &sv), st, done);
    sp.temperature = (float)sv;
    sv = 1;
    if (o.top_p) FL_TRY_GOTO(fl_cli_float("top-p", o.top_p, 1e-6, 1, &sv), st, done);
    sp.top_p = (float)sv;
    if (o.top_k) FL_TRY_GOTO(fl_cli_int("top-k", o.top_k, 0, 1 << 30, &sk), st, done);
    sp.top_k = (int)sk;
    if (o.threads) {
        long th;
        FL_TRY_GOTO(fl_cli_int("threads", o.threads, 1, 4096, &th), st, done);
        FL_TRY_GOTO(fl_pool_set_threads((int)th), st, done);
    }
    FL_TRY_GOTO(fl_cli_quant(o.quant, &q), st, done);
    /* Under mpirun every rank builds (or loads) its own shard of the model
     * and follows rank 0's steps, exactly as flotilla generate does. */
    fl_shard shard = {.tp_size = 1, .ep_size = 1, .ex_size = 1};
    double t0 = fl_engine_now(), t_build = 0;
    if (o.mo.model) {
        o.mo.quantize = o.quant; /* checked above */
        FL_TRY_GOTO(fl_cli_bundle_open(&o.mo, FL_CLI_NEED_WEIGHTS, &bu), st, done);
        t_build = fl_engine_now() - t0;
        cfg = bu.model->cfg;
        shard = bu.model->shard;
    } else {
        FL_TRY_GOTO(fl_synth_preset(o.preset, &cfg), st, done);
        if (layers) cfg.n_layers = (int)layers;
        FL_TRY_GOTO(fl_cli_parallel_open(&o.mo, &cfg, &bu, &shard), st, done);
        FL_TRY_GOTO(fl_cli_backend_open(&o.mo, &bu), st, done);
    }
    const int dp = bu.groups ? fl_par_groups_layout(bu.groups)->dp : 1;
    fl_backend *be = bu.be;
    const int world = fl_cli_world_size();
    const bool cpu = !strcmp(be->name, "cpu");

    double ceiling = 0, read_ceiling = 0;
    int ceiling_threads = 1;
    size_t cbytes = cpu ? (size_t)256 << 20 : (size_t)1 << 30;
    FL_TRY_GOTO(copy_ceiling(be, cbytes, &ceiling, &read_ceiling, &ceiling_threads), st, done);
    comm_ceiling cc = {0};
    /* the group a step's collectives run over: tp (dp > 1 MoE: the ep group
     * of the all-to-all, opened with the engine below, so measured there) */
    fl_comm *timed = NULL;
    if (bu.comm && fl_comm_size(bu.comm) > 1 && !o.wo.workload) {
        timed = bu.comm;
        FL_TRY_GOTO(time_comm(timed, be, cfg.hidden_size, cbytes / 4, &cc), st, done);
    }

    if (!o.mo.model) {
        t0 = fl_engine_now();
        FL_TRY_GOTO(fl_synth_model(&cfg, &shard, be, q, (uint64_t)seed, &bu.model), st, done);
        t_build = fl_engine_now() - t0;
    }
    fl_model *m = bu.model;
    if (o.wo.workload) {
        wl.sp = sp;
        fl_bench_workload_info info = {.preset = what,
                                       .quantize = fl_cli_quant_name(q, o.mo.model != NULL),
                                       .backend = be->name, .output = o.output, .layers = cfg.n_layers,
                                       .world = world, .tp = shard.tp_size, .ep = shard.ep_size, .dp = dp,
                                       .copy_ceiling = ceiling, .copy_ceiling_threads = ceiling_threads,
                                       .sweep = &sweep};
        st = fl_bench_workload_main(&bu, &ec, &wl, &info);
        goto done;
    }

    ec.block_size = 16;
    ec.max_num_seqs = (int)batch;
    ec.max_num_batched_tokens = (int)(batch * plen < 8192 ? batch * plen : 8192);
    if (ec.max_num_batched_tokens < batch) ec.max_num_batched_tokens = (int)batch;
    ec.max_model_len = (int)(max_len ? max_len : plen + glen + 1);
    int blocks_per_seq = (ec.max_model_len + ec.block_size - 1) / ec.block_size;
    ec.n_blocks = (int)batch * blocks_per_seq;
    ec.verbose = bu.verbose; /* the memory plan next to what was measured */
    ec.fwd.count_experts = true; /* the MoE bytes from the experts read (a download a step on a GPU) */
    FL_TRY_GOTO(fl_cli_engine_parallel(&bu, &ec), st, done);
    if (!timed && bu.ep_comm && fl_comm_size(bu.ep_comm) > 1) {
        timed = bu.ep_comm;
        FL_TRY_GOTO(time_comm(timed, be, cfg.hidden_size, cbytes / 4, &cc), st, done);
    }
    FL_TRY_GOTO(fl_engine_init(m, &ec, &bu.eng), st, done);
    fl_engine *e = bu.eng;
    const fl_kv_dtype kv_dtype = fl_engine_config_of(e)->kv_dtype; /* resolved; e is freed before the JSON */
    const bool leader = fl_engine_is_leader(e);

    int n_steps = 0;
    double t_prefill = 0;
    if (!leader) {
        FL_TRY_GOTO(fl_engine_follow(e), st, done);
    } else {
        gens = calloc((size_t)batch, sizeof *gens);
        step_t = calloc((size_t)glen, sizeof *step_t);
        mode_t[0] = calloc((size_t)glen, sizeof(double));
        mode_t[1] = calloc((size_t)glen, sizeof(double));
        FL_CHECK_ALLOC(mode_t[0], st, done);
        FL_CHECK_ALLOC(mode_t[1], st, done);
        int32_t *prompt = malloc((size_t)plen * sizeof(int32_t));
        FL_CHECK_ALLOC(gens, st, done);
        FL_CHECK_ALLOC(step_t, st, done);
        FL_CHECK_ALLOC(prompt, st, done);
        for (long i = 0; i < batch; i++) {
            fill_prompt(prompt, i, plen, cfg.vocab_size);
            sp.seed = (uint64_t)i;
            st = fl_gen_init(&gens[i], i, prompt, (int)plen, &sp, (int)glen);
            if (st == FL_OK) st = fl_engine_add(e, &gens[i]);
            if (st != FL_OK) {
                free(prompt);
                goto done;
            }
        }
        free(prompt);
        /* prefill: until every sequence has its first token. Updates are not
         * counted: chunked prefill mixes decode rows of the sequences already
         * prefilled into the same steps, so they would count twice. */
        t0 = fl_engine_now();
        for (long n_first = 0; n_first < batch;) {
            fl_gen **up;
            int nu;
            FL_TRY_GOTO(fl_engine_step(e, &up, &nu), st, done);
            for (int k = 0; k < nu; k++) n_first += fl_gen_n_generated(up[k]) == 1;
        }
        t_prefill = fl_engine_now() - t0;
        fl_forward_moe_totals_reset(); /* the exchange totals count decode steps only */
        const bool profile_last = fl_opt_bool(FL_OPT_BENCH_PROFILE_LAST) && be->ops->profile_range;
        bool marked = false;
        /* decode: one token per sequence per step */
        while (fl_engine_has_work(e) && n_steps < glen) {
            fl_gen **up;
            int nu;
            fl_moe_exchange_stats xs0;
            fl_forward_moe_totals(&xs0);
            /* the prefill made each sequence's first token: glen - 1 decode
             * steps, fewer for the sequences chunked prefill served first */
            long gmax = 0;
            for (long i = 0; profile_last && i < batch; i++) {
                const long g = (long)fl_gen_n_generated(&gens[i]);
                gmax = g > gmax ? g : gmax;
            }
            const bool mark = profile_last && !marked && (n_steps == glen - 2 || gmax + 1 >= glen);
            marked = marked || mark;
            if (mark) {
                FL_TRY_GOTO(be->ops->sync(be), st, done);
                FL_TRY_GOTO(be->ops->profile_range(be, true), st, done);
            }
            double ts = fl_engine_now();
            FL_TRY_GOTO(fl_engine_step(e, &up, &nu), st, done);
            step_t[n_steps++] = fl_engine_now() - ts;
            if (mark) {
                FL_TRY_GOTO(be->ops->sync(be), st, done);
                FL_TRY_GOTO(be->ops->profile_range(be, false), st, done);
            }
            fl_moe_exchange_stats xs;
            fl_forward_moe_totals(&xs);
            if (xs.enabled && xs.mode == FL_MOE_OVERLAP_ALTERNATE && xs.layers > xs0.layers) {
                const int on = xs.last_mode != FL_MOE_OVERLAP_OFF;
                mode_t[on][n_mode[on]++] = step_t[n_steps - 1];
                if (!on) x_off_s += xs.act_s - xs0.act_s;
            }
        }
        FL_TRY_GOTO(fl_engine_release_followers(e), st, done);
    }
    /* Bytes a step reads, summed over ranks. MoE layers read the distinct
     * experts their tokens were routed to, as the forward pass counted them
     * in the decode steps (fl_forward_moe_expert_reads; on a GPU the
     * device-routed layers' groupings are downloaded once after each step's
     * sync, count_experts above). Where a rank could not count them, the
     * bytes assume the tokens spread over min(batch k, experts) experts, an
     * upper bound the random router can undercut (Mixtral batch 16 once
     * printed 120 % of the ceiling), and the report says so. A follower
     * counts every step of one token per sequence; in this fixed batch
     * those are the decode steps (a prompt of one token would count too). */
    const int n_local = m->dims.n_experts;
    double active_local = 0, exact = 1;
    if (cfg.n_experts && n_local) {
        fl_moe_expert_reads rd;
        fl_forward_moe_expert_reads(&rd);
        exact = rd.layers > 0 && rd.counted == rd.layers;
        const long bound = batch * cfg.n_experts_per_tok < cfg.n_experts ? batch * cfg.n_experts_per_tok
                                                                        : cfg.n_experts;
        active_local = exact ? (double)rd.experts / (double)rd.counted : (double)bound * n_local / cfg.n_experts;
    }
    /* A checkpoint's bytes are its tensors as the backend holds them (a W4
     * group's scale and bias: two f32 on the CPU, a half2 on CUDA); a
     * preset's come from its shapes (fl_synth_step_weight_bytes). */
    const double w4_group_bytes = cpu ? 8 : 4;
    double wbytes = 0;
    if (o.mo.model) {
        fl_model_step_reads rd;
        FL_TRY_GOTO(fl_model_step_reads_count(m, w4_group_bytes, active_local, &rd), st, done);
        wbytes = rd.bytes;
    } else {
        FL_TRY_GOTO(fl_synth_step_weight_bytes(&cfg, &shard, q, active_local, &wbytes), st, done);
    }
    /* Prefill FLOPs: 2 x the weights a prompt token multiplies (its k
     * experts in MoE layers) x tokens, plus lm_head once per sequence (only
     * the last token's logits are computed); attention's own FLOPs left out. */
    const double tok_experts = cfg.n_experts ? (double)cfg.n_experts_per_tok * n_local / cfg.n_experts : 0;
    fl_model_step_reads pr;
    FL_TRY_GOTO(fl_model_step_reads_count(m, w4_group_bytes, tok_experts, &pr), st, done);
    const double seqs_local = (double)batch / dp;
    double prefill_flops = 2.0 * (pr.layer_params * seqs_local * (double)plen + (pr.params - pr.layer_params) * seqs_local);
    /* a replica holds (and reads) the KV of its share of the batch */
    const double kv_token_bytes = (double)cfg.n_layers * (double)fl_kv_token_layer_bytes(
        kv_dtype, m->dims.n_kv_heads, cfg.head_dim, fl_kv_int8_group(&cfg));
    double kv_bytes = seqs_local * (double)(plen + glen / 2) * kv_token_bytes;
    double local[5] = {wbytes, kv_bytes, active_local, exact, prefill_flops},
           total[5] = {wbytes, kv_bytes, active_local, exact, prefill_flops};
    double ceil_local[2] = {ceiling, read_ceiling}, ceil_min[2] = {ceiling, read_ceiling};
    if (world > 1) { /* every replica's and shard's bytes */
        MPI_Comm mc = MPI_COMM_WORLD;
        if (MPI_Reduce(local, total, 5, MPI_DOUBLE, MPI_SUM, 0, mc) != MPI_SUCCESS ||
            MPI_Reduce(ceil_local, ceil_min, 2, MPI_DOUBLE, MPI_MIN, 0, mc) != MPI_SUCCESS) {
            st = FL_ERR(FL_ERR_MPI, "bench: MPI_Reduce of the byte counts failed");
            goto done;
        }
    }
    /* the distinct experts a MoE layer reads per decode step: every rank's
     * count, over the ranks that hold a copy of each expert (tp ranks at
     * dp = 1 all read their slice of the same experts) */
    const double active = n_local ? total[2] * cfg.n_experts / ((double)world * n_local) : 0;
    const bool active_exact = total[3] == world;
    if (!leader) goto done;
    double step = median(step_t, n_steps);
    /* Communication's share of a decode step, estimated: two all-reduces of
     * the step's hidden states per layer over the tp group (after attention
     * and after the MLP/MoE), each at the back-to-back cost measured above
     * (batch <= 16 rows stay in NCCL's latency-bound regime). */
    const bool tp_reduces = timed == bu.comm && timed != NULL;
    const double comm_ms = tp_reduces ? 2.0 * cfg.n_layers * cc.ar_hidden_pipe_us / 1e3 : 0;
    /* the aggregate ceiling of the run is every rank's copy bandwidth (and,
     * on the CPU, read bandwidth) */
    double agg_ceiling = ceil_min[0] * world, agg_read = ceil_min[1] * world;
    double bw = (total[0] + total[1]) / step;
    double tok_s = batch / step;
    const double prefill_tok_s = batch * plen / t_prefill, prefill_gflops = total[4] / t_prefill / 1e9;
    fl_forward_graph_stats gs;
    fl_forward_graph_totals(&gs);
    fl_engine_stats es = {0};
    if (bu.eng) fl_engine_get_stats(bu.eng, &es);
    for (char *c = gs.why_off; *c; c++)
        if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) *c = '\''; /* keeps the JSON valid */
    double ph[FL_FWD_T_N] = {0}, fwd_ms = 0;
    for (int i = 0; i < FL_FWD_T_N; i++) {
        ph[i] = gs.timed_steps ? gs.t[i] * 1e3 / (double)gs.timed_steps : 0;
        fwd_ms += ph[i];
    }
    /* The MoE exchange per decode step (rank 0's share; every rank of an ep
     * group runs the same exchanges): activations there and back, host-timed
     * in the in-order modes only (timing the overlapped one would need the
     * syncs the overlap removes), and the synchronous control part (the
     * count and expert-id exchanges, the same in every mode). */
    fl_moe_exchange_stats ms;
    fl_forward_moe_totals(&ms);
    const double moe_layers = n_steps ? (double)ms.layers / n_steps : 0;
    const double moe_ctrl_ms = n_steps ? ms.ctrl_s * 1e3 / n_steps : 0;
    double moe_x_ms = n_steps && ms.layers && ms.timed_layers == ms.layers ? ms.act_s * 1e3 / n_steps : -1;
    /* the exchange's bandwidth inside the layer (bytes sent to the other
     * ranks / exchange time) against the all-to-all bus bandwidth measured
     * above on large messages: decode exchanges are small and latency-bound */
    const double moe_x_gbs = moe_x_ms > 0 && ms.act_s > 0 ? ms.act_bytes / ms.act_s / 1e9 : -1;
    const double moe_x_frac = moe_x_gbs >= 0 && cc.a2a_busbw > 0 ? moe_x_gbs * 1e9 / cc.a2a_busbw : -1;
    /* alternate: off and on steps of the same run */
    const bool alt = ms.enabled && ms.mode == FL_MOE_OVERLAP_ALTERNATE;
    double alt_off = -1, alt_on = -1, hidden = -1;
    if (alt && n_mode[0] && n_mode[1]) {
        alt_off = median(mode_t[0], n_mode[0]) * 1e3;
        alt_on = median(mode_t[1], n_mode[1]) * 1e3;
        moe_x_ms = x_off_s * 1e3 / n_mode[0];
        hidden = moe_x_ms > 0 ? (alt_off - alt_on) / moe_x_ms : -1;
    }
    /* CPU, one rank, --batch over 1: one sequence of the same lengths alone
     * on a fresh engine, after every statistic above was read (its steps
     * would count in the totals); at batch 1 a MoE token reads its k experts */
    double b1_step = -1, b1_prefill = -1, b1_bw = -1;
    if (cpu && world == 1 && batch > 1) {
        fl_engine_free(bu.eng);
        bu.eng = NULL;
        FL_TRY_GOTO(batch1_pass(m, &ec, plen, glen, &sp, &bu.eng, &b1_prefill, &b1_step), st, done);
        double b1_w = wbytes;
        if (cfg.n_experts && o.mo.model) {
            fl_model_step_reads rd1;
            FL_TRY_GOTO(fl_model_step_reads_count(m, w4_group_bytes, tok_experts, &rd1), st, done);
            b1_w = rd1.bytes;
        } else if (cfg.n_experts) {
            FL_TRY_GOTO(fl_synth_step_weight_bytes(&cfg, &shard, q, tok_experts, &b1_w), st, done);
        }
        b1_bw = (b1_w + (double)(plen + glen / 2) * kv_token_bytes) / b1_step;
    }
    const char *qname = fl_cli_quant_name(q, o.mo.model != NULL);
    if (o.output) {
        jf = fopen(o.output, "w");
        if (!jf) {
            st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", o.output, strerror(errno));
            goto done;
        }
        /* built with cJSON: strings escaped, NaN and infinities written as null */
        cJSON *r = cJSON_CreateObject();
        cJSON *env = bench_env();
        if (!r || !env) {
            cJSON_Delete(r);
            cJSON_Delete(env);
            st = FL_ERR(FL_ERR_OOM, "bench: out of memory for the JSON report");
            goto done;
        }
        cJSON_AddItemToObject(r, "env", env);
        /* the settings in force, whichever of flag, key, variable or default gave them */
        cJSON *set = cJSON_AddObjectToObject(r, "settings");
        cJSON_AddBoolToObject(set, "cuda_graphs", ec.fwd.cuda_graphs);
        cJSON_AddBoolToObject(set, "graph_ctx_buckets", ec.fwd.graph_ctx_buckets);
        cJSON_AddBoolToObject(set, "step_timing", ec.fwd.step_timing);
        cJSON_AddStringToObject(set, "moe_overlap", fl_moe_overlap_name(ec.fwd.moe_overlap));
        cJSON_AddNumberToObject(set, "moe_micro_batches", ec.fwd.moe_micro_batches);
        cJSON_AddBoolToObject(set, "greedy_on_device", ec.greedy_on_device);
        cJSON_AddBoolToObject(set, "sample_on_device", ec.sample_on_device);
        cJSON_AddBoolToObject(set, "p2p_allreduce", bu.comm_cfg.p2p_allreduce);
        cJSON_AddNumberToObject(set, "p2p_allreduce_max_bytes", (double)bu.comm_cfg.p2p_allreduce_max_bytes);
        cJSON_AddBoolToObject(set, "nccl_own_stream", bu.comm_cfg.own_stream);
        if (o.preset) cJSON_AddStringToObject(r, "preset", o.preset);
        else cJSON_AddNullToObject(r, "preset");
        if (o.mo.model) cJSON_AddStringToObject(r, "model", o.mo.model);
        else cJSON_AddNullToObject(r, "model");
        cJSON_AddNumberToObject(r, "layers", cfg.n_layers);
        cJSON_AddStringToObject(r, "quantize", qname);
        cJSON_AddStringToObject(r, "kv_cache_dtype", fl_kv_dtype_name(kv_dtype));
        cJSON_AddNumberToObject(r, "threads", ceiling_threads);
        cJSON_AddStringToObject(r, "backend", be->name);
        cJSON_AddNumberToObject(r, "world", world);
        cJSON_AddNumberToObject(r, "tp", shard.tp_size);
        cJSON_AddNumberToObject(r, "ep", shard.ep_size);
        cJSON_AddNumberToObject(r, "dp", dp);
        cJSON_AddNumberToObject(r, "comm_group_size", timed ? fl_comm_size(timed) : 1);
        cJSON_AddNumberToObject(r, "batch", (double)batch);
        cJSON_AddNumberToObject(r, "prompt_len", (double)plen);
        cJSON_AddNumberToObject(r, "gen_len", (double)glen);
        cJSON_AddNumberToObject(r, "max_model_len", (double)ec.max_model_len);
        cJSON_AddNumberToObject(r, "temperature", sp.temperature);
        cJSON_AddNumberToObject(r, "top_k", sp.top_k);
        cJSON_AddNumberToObject(r, "top_p", sp.top_p);
        cJSON_AddNumberToObject(r, "greedy_steps", (double)es.greedy_steps);
        cJSON_AddNumberToObject(r, "sampled_on_device_steps", (double)es.sampled_steps);
        cJSON_AddNumberToObject(r, "decode_steps", n_steps);
        cJSON_AddNumberToObject(r, "decode_step_ms_median", step * 1e3);
        cJSON_AddNumberToObject(r, "decode_tok_s", tok_s);
        cJSON_AddNumberToObject(r, "prefill_s", t_prefill);
        cJSON_AddNumberToObject(r, "prefill_tok_s", prefill_tok_s);
        cJSON_AddNumberToObject(r, "prefill_tokens", (double)(batch * plen));
        cJSON_AddNumberToObject(r, "prefill_GFLOPs", prefill_gflops);
        cJSON_AddNumberToObject(r, "weight_bytes_per_step", total[0]);
        cJSON_AddNumberToObject(r, "kv_bytes_per_step", total[1]);
        cJSON_AddNumberToObject(r, "effective_GBps", bw / 1e9);
        cJSON_AddNumberToObject(r, "copy_ceiling_GBps", agg_ceiling / 1e9);
        cJSON_AddNumberToObject(r, "copy_ceiling_threads", ceiling_threads);
        cJSON_AddNumberToObject(r, "fraction_of_ceiling", bw / agg_ceiling);
        if (agg_read > 0) { /* the CPU backend's read bandwidth */
            cJSON_AddNumberToObject(r, "read_ceiling_GBps", agg_read / 1e9);
            cJSON_AddNumberToObject(r, "fraction_of_read_ceiling", bw / agg_read);
        }
        if (b1_step > 0) { /* the batch-1 pass */
            cJSON *b1 = cJSON_AddObjectToObject(r, "batch1");
            cJSON_AddNumberToObject(b1, "decode_step_ms_median", b1_step * 1e3);
            cJSON_AddNumberToObject(b1, "decode_tok_s", 1 / b1_step);
            cJSON_AddNumberToObject(b1, "prefill_s", b1_prefill);
            cJSON_AddNumberToObject(b1, "prefill_tok_s", plen / b1_prefill);
            cJSON_AddNumberToObject(b1, "effective_GBps", b1_bw / 1e9);
            cJSON_AddNumberToObject(b1, "fraction_of_ceiling", b1_bw / agg_ceiling);
            if (agg_read > 0) cJSON_AddNumberToObject(b1, "fraction_of_read_ceiling", b1_bw / agg_read);
        }
        cJSON_AddNumberToObject(r, "allreduce_hidden_us", cc.ar_hidden_us);
        cJSON_AddNumberToObject(r, "allreduce_hidden_pipelined_us", cc.ar_hidden_pipe_us);
        cJSON_AddNumberToObject(r, "allreduce_busbw_GBps", cc.ar_busbw / 1e9);
        cJSON_AddNumberToObject(r, "alltoall_busbw_GBps", cc.a2a_busbw / 1e9);
        cJSON_AddNumberToObject(r, "comm_ms_per_step_est", comm_ms);
        cJSON_AddNumberToObject(r, "comm_share_est", step > 0 ? comm_ms / (step * 1e3) : 0);
        cJSON_AddNumberToObject(r, "active_experts", active);
        cJSON_AddBoolToObject(r, "active_experts_exact", active_exact);
        cJSON_AddNumberToObject(r, "build_s", t_build);
        cJSON_AddBoolToObject(r, "cuda_graphs", gs.enabled);
        cJSON_AddNumberToObject(r, "graph_replays", (double)gs.replays);
        cJSON_AddNumberToObject(r, "graph_captures", (double)gs.captures);
        cJSON_AddNumberToObject(r, "graph_capture_failures", (double)gs.capture_failures);
        cJSON_AddNumberToObject(r, "decode_steps_seen", (double)gs.decode_steps);
        cJSON_AddStringToObject(r, "graph_off_reason", gs.why_off);
        cJSON_AddNumberToObject(r, "timed_steps", (double)gs.timed_steps);
        cJSON *phase = cJSON_AddObjectToObject(r, "phase_ms");
        cJSON_AddNumberToObject(phase, "prep", ph[FL_FWD_T_PREP]);
        cJSON_AddNumberToObject(phase, "enqueue", ph[FL_FWD_T_ENQUEUE]);
        cJSON_AddNumberToObject(phase, "gpu_wait", ph[FL_FWD_T_GPU]);
        cJSON_AddNumberToObject(phase, "logits", ph[FL_FWD_T_LOGITS]);
        cJSON_AddNumberToObject(r, "outside_forward_ms", gs.timed_steps ? step * 1e3 - fwd_ms : 0.0);
        cJSON_AddStringToObject(r, "note", "bytes summed over ranks; ceiling = world x the slowest rank's copy "
                                           "bandwidth; W4 bytes count bf16 scale+bias per group");
        /* the MoE all-to-all (dp > 1): null where it is off or was not timed */
        if (ms.enabled) {
            cJSON_AddStringToObject(r, "moe_overlap", fl_moe_overlap_name(ms.mode));
            cJSON_AddBoolToObject(r, "moe_overlap_events", ms.events);
            cJSON_AddNumberToObject(r, "moe_micro_batches", ms.micro_batches);
            cJSON_AddNumberToObject(r, "moe_exchange_layers_per_step", moe_layers);
            cJSON_AddNumberToObject(r, "moe_control_ms_per_step", moe_ctrl_ms);
            if (alt && alt_off >= 0) {
                cJSON_AddNumberToObject(r, "moe_steps_off", n_mode[0]);
                cJSON_AddNumberToObject(r, "moe_steps_on", n_mode[1]);
                cJSON_AddNumberToObject(r, "moe_step_ms_off", alt_off);
                cJSON_AddNumberToObject(r, "moe_step_ms_on", alt_on);
                cJSON_AddNumberToObject(r, "moe_exchange_hidden_fraction", hidden);
            }
            if (moe_x_gbs >= 0) {
                cJSON_AddNumberToObject(r, "moe_exchange_GBps", moe_x_gbs);
                cJSON_AddNumberToObject(r, "moe_exchange_fraction_of_a2a_busbw", moe_x_frac);
            }
            if (moe_x_ms >= 0) cJSON_AddNumberToObject(r, "moe_exchange_ms_per_step", moe_x_ms);
            else cJSON_AddNullToObject(r, "moe_exchange_ms_per_step");
        } else {
            cJSON_AddNullToObject(r, "moe_overlap");
            cJSON_AddNullToObject(r, "moe_exchange_ms_per_step");
        }
        char *text = cJSON_PrintUnformatted(r);
        cJSON_Delete(r);
        if (!text) {
            st = FL_ERR(FL_ERR_OOM, "bench: out of memory for the JSON report");
            goto done;
        }
        fprintf(jf, "%s\n", text);
        cJSON_free(text);
    }
    printf("bench %s %s x%d layers on %s, batch %ld: %.2f ms/step, %.1f tok/s decode, %.1f GB/s "
           "= %.1f%% of the %.1f GB/s copy ceiling; prefill %.1f tok/s\n",
           what, qname, cfg.n_layers, be->name, batch, step * 1e3, tok_s, bw / 1e9, 100 * bw / agg_ceiling,
           agg_ceiling / 1e9, prefill_tok_s);
    if (agg_read > 0)
        printf("  cpu, %d threads: decode at %.1f%% of the %.1f GB/s read ceiling; prefill of %ld x %ld tokens "
               "%.1f GFLOP/s\n", ceiling_threads, 100 * bw / agg_read, agg_read / 1e9, batch, plen, prefill_gflops);
    if (b1_step > 0)
        printf("  batch 1: %.2f ms/step, %.1f tok/s decode, %.1f GB/s = %.1f%% of the copy ceiling, %.1f%% of "
               "the read ceiling; prefill %.1f tok/s\n", b1_step * 1e3, 1 / b1_step, b1_bw / 1e9,
               100 * b1_bw / agg_ceiling, 100 * b1_bw / agg_read, plen / b1_prefill);
    if (cfg.n_experts && !active_exact)
        printf("  (MoE at batch %ld: the experts read were not counted; the bytes assume %.0f distinct experts a layer, an upper bound: read the tok/s, not the "
               "%% of the ceiling)\n", batch, active);
    else if (cfg.n_experts)
        printf("  MoE: %.2f distinct experts read per layer and decode step (counted)\n", active);
    if (timed)
        printf("bench %d ranks (tp %d, ep %d, dp %d): all-reduce of one hidden state %.1f us waited for, "
               "%.1f us back to back; all-reduce bus bandwidth %.1f GB/s, all-to-all %.1f GB/s\n",
               world, shard.tp_size, shard.ep_size, dp, cc.ar_hidden_us, cc.ar_hidden_pipe_us,
               cc.ar_busbw / 1e9, cc.a2a_busbw / 1e9);
    if (tp_reduces)
        printf("bench %d all-reduces per step: ~%.2f ms of the %.2f ms step (%.0f%%, estimated from the "
               "back-to-back cost)\n", 2 * cfg.n_layers, comm_ms, step * 1e3, 100 * comm_ms / (step * 1e3));
    if (ms.enabled) {
        printf("  moe exchange (%s%s, %d micro-batches): %.1f layers/step, control %.3f ms per step",
               fl_moe_overlap_name(ms.mode), ms.events ? ", events" : ", in order", ms.micro_batches, moe_layers,
               moe_ctrl_ms);
        if (moe_x_ms >= 0) printf(", activations all-to-all %.3f ms per step%s", moe_x_ms, alt ? " (off steps)" : "");
        if (moe_x_gbs >= 0)
            printf(" at %.2f GB/s = %.1f%% of the all-to-all bus bandwidth\n", moe_x_gbs, 100 * moe_x_frac);
        else if (moe_x_ms >= 0)
            printf("\n");
        else printf(", activations overlapped (not timed)\n");
        if (alt && alt_off >= 0)
            printf("  moe overlap: %d off steps %.3f ms, %d on steps %.3f ms (medians): %.0f%% of the "
                   "exchange hidden\n", n_mode[0], alt_off, n_mode[1], alt_on, 100 * hidden);
    }
    if (sp.temperature > 0)
        printf("  sampling (temperature %g, top-k %d, top-p %g): %lld of %lld steps sampled by the backend (sample_rows)\n",
               (double)sp.temperature, sp.top_k, (double)sp.top_p, (long long)es.sampled_steps,
               (long long)es.steps);
    printf("  cuda graphs %s: %ld replays, %ld captures of %ld decode steps%s%s\n", gs.enabled ? "on" : "off",
           gs.replays, gs.captures, gs.decode_steps, gs.why_off[0] ? "; " : "", gs.why_off);
    if (gs.timed_steps)
        printf("  decode step phases (mean ms over %ld): prep %.3f, enqueue %.3f, gpu wait %.3f, logits %.3f; "
               "outside the forward %.3f\n", gs.timed_steps, ph[FL_FWD_T_PREP], ph[FL_FWD_T_ENQUEUE],
               ph[FL_FWD_T_GPU], ph[FL_FWD_T_LOGITS], step * 1e3 - fwd_ms);
done:
    if (jf && fclose(jf) != 0 && st == FL_OK) st = FL_ERR(FL_ERR_IO, "cannot write %s", o.output);
    if (gens)
        for (long i = 0; i < batch; i++) fl_gen_free(&gens[i]);
    free(gens);
    free(step_t);
    free(mode_t[0]);
    free(mode_t[1]);
    return fl_cli_finish("bench", &bu, st);
}
