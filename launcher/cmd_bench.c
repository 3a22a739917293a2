/*
 * cmd_bench.c — `flotilla bench`: decode and prefill speed of a synthetic
 * model of a real shape (random weights, no download), reported against the
 * backend's copy-bandwidth ceiling measured in the same run (PERF.md:
 * decode reads every weight once per step, so bytes / bandwidth is the
 * floor). Prints a one-line summary last and writes the full numbers as JSON.
 *
 * --cuda-graphs on|off sets FL_CUDA_GRAPHS for the run (decode steps
 * replayed as CUDA graphs, runtime/forward_graph.h); --step-timing sets
 * FL_STEP_TIMING=1, which syncs between the phases of each decode step and
 * reports their mean durations (host prep, enqueue, GPU wait, logits).
 */
#include <errno.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/cli.h"
#include "runtime/forward_graph.h"
#include "runtime/synth.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n ? v[n / 2] : 0;
}

/* Copy bandwidth (read + write bytes per second), median of 20 copies. */
static fl_status copy_ceiling(fl_backend *be, size_t bytes, double *bw) {
    void *a = NULL, *b = NULL;
    fl_status st = FL_OK;
    double t[20];
    FL_TRY_GOTO(be->ops->alloc(be, bytes, &a), st, done);
    FL_TRY_GOTO(be->ops->alloc(be, bytes, &b), st, done);
    FL_TRY_GOTO(be->ops->memset0(be, a, bytes), st, done);
    FL_TRY_GOTO(be->ops->copy(be, b, a, bytes), st, done); /* warm-up, first touch */
    FL_TRY_GOTO(be->ops->sync(be), st, done);
    for (int i = 0; i < 20; i++) {
        double t0 = fl_engine_now();
        FL_TRY_GOTO(be->ops->copy(be, b, a, bytes), st, done);
        FL_TRY_GOTO(be->ops->sync(be), st, done);
        t[i] = fl_engine_now() - t0;
    }
    *bw = 2.0 * (double)bytes / median(t, 20);
done:
    if (a) be->ops->free(be, a);
    if (b) be->ops->free(be, b);
    return st;
}

typedef struct bench_opts {
    const char *preset, *quant, *batch, *prompt, *gen, *layers, *backend, *output, *seed, *threads,
        *graphs, *timing, *help;
} bench_opts;

int fl_cmd_bench(int argc, char **argv) {
    bench_opts o = {0};
    const fl_cli_opt opts[] = {
        {"preset", true, &o.preset, "llama-3-8b | qwen2-7b | mixtral-8x7b | qwen3-30b-a3b"},
        {"quantize", true, &o.quant, "none (bf16) | w4 (group 128); default none"},
        {"batch", true, &o.batch, "sequences decoded together (default 1)"},
        {"prompt-len", true, &o.prompt, "prompt tokens per sequence (default 16)"},
        {"gen-len", true, &o.gen, "generated tokens per sequence (default 32)"},
        {"layers", true, &o.layers, "override the layer count (smaller runs on CPUs)"},
        {"backend", true, &o.backend, "auto | cpu | cuda (default auto)"},
        {"threads", true, &o.threads, "CPU threads"},
        {"seed", true, &o.seed, "weight seed (default 1)"},
        {"output", true, &o.output, "write the full results as JSON here"},
        {"cuda-graphs", true, &o.graphs, "on | off: replay decode steps as CUDA graphs (default on)"},
        {"step-timing", false, &o.timing, "time the phases of each decode step (adds syncs)"},
        {"help", false, &o.help, "show this help"},
        {0},
    };
    fl_status st = fl_cli_parse("bench", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("bench", st);
    if (o.help) {
        fl_cli_usage(stdout, "bench", "--preset NAME [--quantize w4] [--batch B] [--gen-len G]", opts);
        return 0;
    }
    if (!o.preset) {
        fprintf(stderr, "flotilla bench: --preset is required\n");
        return 1;
    }
    long batch = 1, plen = 16, glen = 32, layers = 0, seed = 1;
    fl_backend *be = NULL;
    fl_model *m = NULL;
    fl_engine *e = NULL;
    fl_gen *gens = NULL;
    double *step_t = NULL;
    fl_model_config cfg;
    fl_load_quant q = FL_LOAD_AS_STORED;
    FILE *jf = NULL;
    if (o.batch) FL_TRY_GOTO(fl_cli_int("batch", o.batch, 1, 4096, &batch), st, done);
    if (o.prompt) FL_TRY_GOTO(fl_cli_int("prompt-len", o.prompt, 1, 1 << 20, &plen), st, done);
    if (o.gen) FL_TRY_GOTO(fl_cli_int("gen-len", o.gen, 2, 1 << 20, &glen), st, done);
    if (o.layers) FL_TRY_GOTO(fl_cli_int("layers", o.layers, 1, 1024, &layers), st, done);
    if (o.seed) FL_TRY_GOTO(fl_cli_int("seed", o.seed, 0, 1L << 62, &seed), st, done);
    if (o.threads) {
        long th;
        FL_TRY_GOTO(fl_cli_int("threads", o.threads, 1, 4096, &th), st, done);
        omp_set_num_threads((int)th);
    }
    if (o.quant && !strcmp(o.quant, "w4"))
        q = FL_LOAD_W4;
    else if (o.quant && strcmp(o.quant, "none")) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--quantize must be none or w4, got '%s'", o.quant);
        goto done;
    }
    if (o.graphs && strcmp(o.graphs, "on") && strcmp(o.graphs, "off")) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--cuda-graphs must be on or off, got '%s'", o.graphs);
        goto done;
    }
    /* read by the forward when the engine creates it */
    if (o.graphs) setenv("FL_CUDA_GRAPHS", strcmp(o.graphs, "off") ? "1" : "0", 1);
    if (o.timing) setenv("FL_STEP_TIMING", "1", 1);
    FL_TRY_GOTO(fl_synth_preset(o.preset, &cfg), st, done);
    if (layers) cfg.n_layers = (int)layers;
    FL_TRY_GOTO(fl_backend_init_by_name(o.backend ? o.backend : "auto", 0, &be), st, done);

    double ceiling = 0;
    size_t cbytes = strcmp(be->name, "cpu") ? (size_t)1 << 30 : (size_t)256 << 20;
    FL_TRY_GOTO(copy_ceiling(be, cbytes, &ceiling), st, done);

    double t0 = fl_engine_now();
    FL_TRY_GOTO(fl_synth_model(&cfg, be, q, (uint64_t)seed, &m), st, done);
    double t_build = fl_engine_now() - t0;

    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.block_size = 16;
    ec.max_num_seqs = (int)batch;
    ec.max_num_batched_tokens = (int)(batch * plen < 8192 ? batch * plen : 8192);
    if (ec.max_num_batched_tokens < batch) ec.max_num_batched_tokens = (int)batch;
    ec.max_model_len = (int)(plen + glen + 1);
    int blocks_per_seq = (ec.max_model_len + ec.block_size - 1) / ec.block_size;
    ec.n_blocks = (int)batch * blocks_per_seq;
    FL_TRY_GOTO(fl_engine_init(m, &ec, &e), st, done);

    gens = calloc((size_t)batch, sizeof *gens);
    step_t = calloc((size_t)glen, sizeof *step_t);
    int32_t *prompt = malloc((size_t)plen * sizeof(int32_t));
    FL_CHECK_ALLOC(gens, st, done);
    FL_CHECK_ALLOC(step_t, st, done);
    FL_CHECK_ALLOC(prompt, st, done);
    for (long i = 0; i < batch; i++) {
        for (long j = 0; j < plen; j++) prompt[j] = (int32_t)((i * 7919 + j * 104729) % cfg.vocab_size);
        st = fl_gen_init(&gens[i], i, prompt, (int)plen, NULL, (int)glen);
        if (st == FL_OK) st = fl_engine_add(e, &gens[i]);
        if (st != FL_OK) {
            free(prompt);
            goto done;
        }
    }
    free(prompt);
    /* prefill: until every sequence has its first token */
    t0 = fl_engine_now();
    int n_first = 0, n_steps = 0;
    while (n_first < batch) {
        fl_gen **up;
        int nu;
        FL_TRY_GOTO(fl_engine_step(e, &up, &nu), st, done);
        n_first += nu;
    }
    double t_prefill = fl_engine_now() - t0;
    /* decode: one token per sequence per step */
    while (fl_engine_has_work(e) && n_steps < glen) {
        fl_gen **up;
        int nu;
        double ts = fl_engine_now();
        FL_TRY_GOTO(fl_engine_step(e, &up, &nu), st, done);
        step_t[n_steps++] = fl_engine_now() - ts;
    }
    double step = median(step_t, n_steps);
    int active = cfg.n_experts ? (int)(batch * cfg.n_experts_per_tok < cfg.n_experts
                                           ? batch * cfg.n_experts_per_tok : cfg.n_experts) : 0;
    double wbytes = fl_synth_step_weight_bytes(m, active);
    double kv_bytes = (double)batch * (double)(plen + glen / 2) *
                      (double)fl_kv_cache_token_bytes(be, cfg.n_layers, cfg.n_kv_heads * cfg.head_dim);
    double bw = (wbytes + kv_bytes) / step;
    double tok_s = batch / step;
    fl_forward_graph_stats gs;
    fl_forward_graph_totals(&gs);
    for (char *c = gs.why_off; *c; c++)
        if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) *c = '\''; /* keeps the JSON valid */
    double ph[FL_FWD_T_N] = {0}, fwd_ms = 0;
    for (int i = 0; i < FL_FWD_T_N; i++) {
        ph[i] = gs.timed_steps ? gs.t[i] * 1e3 / (double)gs.timed_steps : 0;
        fwd_ms += ph[i];
    }
    if (o.output) {
        jf = fopen(o.output, "w");
        if (!jf) {
            st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", o.output, strerror(errno));
            goto done;
        }
        fprintf(jf,
                "{\"preset\": \"%s\", \"layers\": %d, \"quantize\": \"%s\", \"backend\": \"%s\", "
                "\"batch\": %ld, \"prompt_len\": %ld, \"gen_len\": %ld, \"decode_steps\": %d, "
                "\"decode_step_ms_median\": %.4f, \"decode_tok_s\": %.2f, \"prefill_s\": %.4f, "
                "\"prefill_tok_s\": %.1f, \"weight_bytes_per_step\": %.0f, \"kv_bytes_per_step\": %.0f, "
                "\"effective_GBps\": %.2f, \"copy_ceiling_GBps\": %.2f, \"fraction_of_ceiling\": %.4f, "
                "\"active_experts\": %d, \"build_s\": %.2f, \"cuda_graphs\": %s, \"graph_replays\": %ld, "
                "\"graph_captures\": %ld, \"graph_capture_failures\": %ld, \"decode_steps_seen\": %ld, "
                "\"graph_off_reason\": \"%s\", \"timed_steps\": %ld, \"phase_ms\": {\"prep\": %.4f, "
                "\"enqueue\": %.4f, \"gpu_wait\": %.4f, \"logits\": %.4f}, \"outside_forward_ms\": %.4f, "
                "\"note\": \"W4 bytes count bf16 scale+bias per group\"}\n",
                o.preset, cfg.n_layers, q == FL_LOAD_W4 ? "w4" : "bf16", be->name, batch, plen, glen,
                n_steps, step * 1e3, tok_s, t_prefill, batch * plen / t_prefill, wbytes, kv_bytes,
                bw / 1e9, ceiling / 1e9, bw / ceiling, active, t_build, gs.enabled ? "true" : "false",
                gs.replays, gs.captures, gs.capture_failures, gs.decode_steps, gs.why_off, gs.timed_steps,
                ph[FL_FWD_T_PREP], ph[FL_FWD_T_ENQUEUE], ph[FL_FWD_T_GPU], ph[FL_FWD_T_LOGITS],
                gs.timed_steps ? step * 1e3 - fwd_ms : 0.0);
    }
    printf("bench %s %s x%d layers on %s, batch %ld: %.2f ms/step, %.1f tok/s decode, %.1f GB/s "
           "= %.1f%% of the %.1f GB/s copy ceiling; prefill %.1f tok/s\n",
           o.preset, q == FL_LOAD_W4 ? "w4" : "bf16", cfg.n_layers, be->name, batch, step * 1e3,
           tok_s, bw / 1e9, 100 * bw / ceiling, ceiling / 1e9, batch * plen / t_prefill);
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
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    return st == FL_OK ? 0 : fl_cli_fail("bench", st);
}
