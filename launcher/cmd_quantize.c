/*
 * cmd_quantize.c — `flotilla quantize`: makes an int4 checkpoint (AutoAWQ
 * GEMM or compressed-tensors pack-quantized) from a Hugging Face float
 * folder (dense llama / qwen2) and calibration text, on the CPU in f32, or
 * with its matmuls on the GPU (--backend cuda; docs/quantize.md).
 *
 * As AutoAWQ does, layer by layer: the layer's float forward over the
 * calibration tokens captures the inputs of its linear groups (q|k|v, o,
 * gate|up, down) and gives the next layer's input; AWQ's per-input-channel
 * scales are searched for each group (awq_calib.c) and folded into the op
 * before it (the RMSNorm weights, v_proj when its rows are o_proj's
 * inputs, up_proj), the clipping search bounds every linear but q and k,
 * and the linears are quantized to 4-bit groups and packed in the chosen
 * format (quantize_output.c). Non-linear tensors are written in their
 * stored dtype (the scaled norms and biases rounded to it); tokenizer files
 * are copied. Each finished layer is recorded in the output folder, so an
 * interrupted run continues after it (quantize_resume.h).
 *
 * Under mpirun / srun the calibration samples are split over the ranks
 * (quantize_share.h): each rank runs the forward and the searches on its
 * samples, the searches reduce over all of them, and rank 0 alone writes
 * the output, the resume state and the progress lines. The checkpoint is
 * the one-rank run's, byte for byte.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "core/option.h"
#include "launcher/awq_calib.h"
#include "launcher/cli.h"
#include "launcher/quantize_input.h"
#include "launcher/quantize_layer.h"
#include "launcher/quantize_output.h"
#include "launcher/quantize_resume.h"
#include "launcher/quantize_share.h"
#include "launcher/st_writer.h"
#include "parallel/rank.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* w[out, in] columns times s; x[n, in] columns divided by s (the captured
 * input as the scaled model will see it). */
static void scale_cols(float *w, int64_t out, int64_t in, const float *s) {
    for (int64_t r = 0; r < out; r++)
        for (int64_t c = 0; c < in; c++) w[r * in + c] *= s[c];
}
static void unscale_cols(float *x, int64_t n, int64_t in, const float *s) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < in; c++) x[r * in + c] /= s[c];
}

/* AWQ for one layer: scales searched on the float weights and features,
 * folded, then clipping. res[g] receives each group's search (alpha < 0:
 * skipped). */
static fl_status awq_layer(fl_backend *be, const fl_model_config *cfg, fl_qlayer *L, fl_qlayer_capture *c,
                           const fl_qshare *sh, int group, int64_t clip_tokens, fl_awq_search res[4]) {
    const int64_t n = fl_qshare_tokens(sh, sh->rank);
    const int64_t d = cfg->hidden_size, ff = cfg->intermediate_size, qd = L->in[FL_QLIN_O];
    float *s[4] = {malloc((size_t)d * 4), malloc((size_t)qd * 4), malloc((size_t)d * 4), malloc((size_t)ff * 4)};
    fl_status st = FL_OK;
    for (int i = 0; i < 4; i++) {
        FL_CHECK_ALLOC(s[i], st, done);
        res[i].alpha = -1;
    }
    const fl_awq_linear qkv[3] = {{L->w[FL_QLIN_Q], L->out[FL_QLIN_Q]},
                                  {L->w[FL_QLIN_K], L->out[FL_QLIN_K]},
                                  {L->w[FL_QLIN_V], L->out[FL_QLIN_V]}};
    const fl_awq_linear o[1] = {{L->w[FL_QLIN_O], d}};
    const fl_awq_linear gu[2] = {{L->w[FL_QLIN_GATE], ff}, {L->w[FL_QLIN_UP], ff}};
    const fl_awq_linear dn[1] = {{L->w[FL_QLIN_DOWN], d}};
    /* o's scales fold into v's rows only when they are o's inputs (no GQA) */
    const bool do_o = L->out[FL_QLIN_V] == qd;
    FL_TRY_GOTO(fl_awq_search_scale(be, c->qkv, n, sh, d, qkv, 3, group, 20, s[0], &res[0]), st, done);
    if (do_o) FL_TRY_GOTO(fl_awq_search_scale(be, c->o, n, sh, qd, o, 1, group, 20, s[1], &res[1]), st, done);
    FL_TRY_GOTO(fl_awq_search_scale(be, c->gu, n, sh, d, gu, 2, group, 20, s[2], &res[2]), st, done);
    FL_TRY_GOTO(fl_awq_search_scale(be, c->down, n, sh, ff, dn, 1, group, 20, s[3], &res[3]), st, done);
    for (int64_t i = 0; i < d; i++) {
        L->in_norm[i] /= s[0][i];
        L->post_norm[i] /= s[2][i];
    }
    for (int k = FL_QLIN_Q; k <= FL_QLIN_V; k++) scale_cols(L->w[k], L->out[k], d, s[0]);
    unscale_cols(c->qkv, n, d, s[0]);
    if (do_o) {
        for (int64_t r = 0; r < qd; r++) {
            for (int64_t i = 0; i < d; i++) L->w[FL_QLIN_V][r * d + i] /= s[1][r];
            if (L->bias[2]) L->bias[2][r] /= s[1][r];
        }
        scale_cols(L->w[FL_QLIN_O], d, qd, s[1]);
        unscale_cols(c->o, n, qd, s[1]);
    }
    scale_cols(L->w[FL_QLIN_GATE], ff, d, s[2]);
    scale_cols(L->w[FL_QLIN_UP], ff, d, s[2]);
    unscale_cols(c->gu, n, d, s[2]);
    for (int64_t r = 0; r < ff; r++)
        for (int64_t i = 0; i < d; i++) L->w[FL_QLIN_UP][r * d + i] /= s[3][r];
    scale_cols(L->w[FL_QLIN_DOWN], d, ff, s[3]);
    unscale_cols(c->down, n, ff, s[3]);
    /* clipping: every linear but q and k (AutoAWQ leaves attention scores alone) */
    const float *xin[FL_QLIN_COUNT] = {NULL, NULL, c->qkv, c->o, c->gu, c->gu, c->down};
    for (int k = FL_QLIN_V; k < FL_QLIN_COUNT; k++)
        FL_TRY_GOTO(fl_awq_search_clip(xin[k], n, sh, L->in[k], L->w[k], L->out[k], group, 20, 0.5f, clip_tokens), st, done);
done:
    for (int i = 0; i < 4; i++) free(s[i]);
    return st;
}

/* h[n, d]: the embeddings of ids[n]. */
static fl_status embed(const fl_ckpt *ck, const fl_model_config *cfg, const int32_t *ids, int64_t n, float *h) {
    fl_tensor t;
    const int64_t expect[2] = {cfg->vocab_size, cfg->hidden_size};
    FL_TRY(fl_ckpt_load_tensor(ck, "model.embed_tokens.weight", 2, expect, &t));
    for (int64_t i = 0; i < n; i++) fl_tensor_row_f32(&t, ids[i], h + i * cfg->hidden_size);
    fl_tensor_free(&t);
    return FL_OK;
}

/* Opens model.safetensors for a run that starts at layer `done`: a new
 * file, or the one an interrupted run of the same identity left, whose
 * first `done` layers are kept. */
static fl_status open_output(const fl_qopts *o, const fl_ckpt *ck, int done, fl_stw **out) {
    char path[4096];
    fl_stw *w = NULL;
    snprintf(path, sizeof path, "%s/model.safetensors", o->output);
    fl_status st = done > 0 ? fl_stw_reopen(path, &w) : fl_stw_open(path, &w);
    if (st == FL_OK) st = fl_qout_plan(ck, o->format, (int)o->group, w);
    if (st == FL_OK) st = fl_stw_begin(w);
    for (int l = 0; l < done && st == FL_OK; l++) {
        snprintf(path, sizeof path, "model.layers.%d.", l);
        st = fl_stw_have_prefix(w, path);
    }
    if (st == FL_OK) st = fl_qout_put_rest(ck, w);
    if (st != FL_OK) {
        fl_stw_close(w);
        if (done > 0) {
            char why[1024]; /* the message buffer is rewritten by FL_ERR */
            snprintf(why, sizeof why, "%s", fl_error_msg());
            return FL_ERR(st, "cannot continue the unfinished run in %s (%s); remove %s/.flotilla-quantize.json "
                          "to start over", o->output, why, o->output);
        }
        return st;
    }
    *out = w;
    return FL_OK;
}

static void print_layer(const fl_qopts *o, int l, int n_layers, const fl_awq_search res[4], double secs) {
    static const char *const gname[4] = {"qkv", "o", "gate|up", "down"};
    fprintf(stderr, "flotilla quantize: layer %d/%d", l + 1, n_layers);
    for (int g = 0; g < 4 && o->awq; g++) {
        if (res[g].alpha < 0) fprintf(stderr, " %s skipped", gname[g]);
        else
            fprintf(stderr, " %s alpha %.2f err x%.2f", gname[g], res[g].alpha,
                    res[g].err_plain > 0 ? res[g].err / res[g].err_plain : 1.0);
    }
    fprintf(stderr, " (%.1f s)\n", secs);
}

static fl_status quantize(const fl_qopts *o, fl_comm *comm, fl_backend *be, bool *reported) {
    fl_qinput in = {0};
    fl_stw *w = NULL;
    fl_qresume *rs = NULL;
    fl_qlayer L = {0};
    fl_qlayer_capture cap = {0};
    float *h = NULL, *h2 = NULL, *hall = NULL; /* hall: every rank's h, on rank 0 (one rank: h itself) */
    fl_status st = FL_OK;
    int32_t done = 0;
    FL_TRY_GOTO(fl_qinput_agree(comm, o, &in, fl_qinput_read(o, comm, &in), reported), st, out);
    const fl_model_config *cfg = &in.cfg;
    const fl_qshare *sh = &in.sh;
    const bool root = sh->rank == 0;
    const int64_t n = in.c.n, d = cfg->hidden_size, t0 = fl_qshare_tok_begin(sh, sh->rank),
                  n_loc = fl_qshare_tokens(sh, sh->rank);
    const int b0 = sh->first[sh->rank], nb = sh->first[sh->rank + 1] - b0;
    h = malloc((size_t)(n_loc * d) * sizeof *h);
    h2 = malloc((size_t)(n_loc * d) * sizeof *h2);
    FL_CHECK_ALLOC(h, st, out);
    FL_CHECK_ALLOC(h2, st, out);
    if (root) {
        hall = comm ? malloc((size_t)(n * d) * sizeof *hall) : h;
        FL_CHECK_ALLOC(hall, st, out);
        if (mkdir(o->output, 0777) != 0 && errno != EEXIST) {
            st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", o->output, strerror(errno));
            goto out;
        }
        FL_TRY_GOTO(fl_qresume_open(o->output, &in.id, cfg->n_layers, n, d, hall, &done, &rs), st, out);
        FL_TRY_GOTO(open_output(o, in.ck, done, &w), st, out);
    }
    if (comm) FL_TRY_GOTO(fl_comm_broadcast(comm, &done, 1, 0, FL_COMM_I32), st, out);
    if (done > 0) FL_TRY_GOTO(fl_qshare_scatter_rows(sh, hall, d, h), st, out);
    FL_TRY_GOTO(fl_qlayer_capture_alloc(cfg, n_loc, &cap), st, out);
    if (done == 0) FL_TRY_GOTO(embed(in.ck, cfg, in.c.ids + t0, n_loc, h), st, out);
    if (root) {
        fprintf(stderr, "flotilla quantize: %s, %d layers, %lld calibration tokens in %d samples, group %ld, %s, %s, "
                "matmuls on %s", fl_arch_name(cfg->arch), cfg->n_layers, (long long)n, in.c.n_blk, o->group,
                o->awq ? "awq" : "rtn", fl_qformat_name(o->format), be ? be->name : "the host (f32)");
        if (sh->ranks > 1) fprintf(stderr, ", samples split over %d ranks", sh->ranks);
        fprintf(stderr, "\n");
        if (done > 0)
            fprintf(stderr, "flotilla quantize: continuing the unfinished run in %s after layer %d/%d\n", o->output,
                    done, cfg->n_layers);
    }
    const long kill_after = fl_opt_int(FL_OPT_TEST_QUANTIZE_KILL);
    for (int l = done; l < cfg->n_layers; l++) {
        const double ts = now_s();
        FL_TRY_GOTO(fl_qlayer_load(in.ck, cfg, l, &L), st, out);
        /* the next layer sees this layer's float output, as in AutoAWQ */
        FL_TRY_GOTO(fl_qlayer_forward(be, cfg, &L, h, sh->len + b0, nb, h2, &cap), st, out);
        fl_awq_search res[4] = {{-1, 0, 0}, {-1, 0, 0}, {-1, 0, 0}, {-1, 0, 0}};
        if (o->awq) FL_TRY_GOTO(awq_layer(be, cfg, &L, &cap, sh, (int)o->group, o->clip_tokens, res), st, out);
        if (root) FL_TRY_GOTO(fl_qout_put_layer(in.ck, o->format, w, l, &L, (int)o->group), st, out);
        fl_qlayer_free(&L);
        /* the layer's bytes are on disk before the state says it is finished */
        if (root) FL_TRY_GOTO(fl_stw_sync(w), st, out);
        if (root && l + 1 == kill_after) raise(SIGKILL);
        float *tmp = h;
        h = h2;
        h2 = tmp;
        if (!comm) hall = h;
        FL_TRY_GOTO(fl_qshare_gather_rows(sh, h, d, hall), st, out);
        if (root) {
            FL_TRY_GOTO(fl_qresume_commit(rs, l + 1, hall), st, out);
            print_layer(o, l, cfg->n_layers, res, now_s() - ts);
        }
    }
    if (root) {
        st = fl_stw_close(w);
        w = NULL;
        if (st == FL_OK) st = fl_qout_side_files(o->model, o->output, o->format, (int)o->group);
        if (st == FL_OK) st = fl_qresume_finish(rs);
    }
out:
    if (w) fl_stw_close(w);
    fl_qresume_free(rs);
    fl_qlayer_free(&L);
    fl_qlayer_capture_free(&cap);
    if (comm) free(hall);
    free(h);
    free(h2);
    fl_qinput_free(&in);
    return st;
}

/* A bad option is every rank's alike (same command line): rank 0 says so
 * and the ranks leave together. */
static int arg_fail(fl_status st) {
    if (fl_cli_world_size() == 1) return fl_cli_fail("quantize", st);
    if (fl_cli_world_rank() == 0) fprintf(stderr, "flotilla quantize: %s\n", fl_error_msg());
    return 1;
}

int fl_cmd_quantize(int argc, char **argv) {
    const char *model = NULL, *calib_p = NULL, *output = NULL, *group_s = NULL, *format = NULL, *ns = NULL,
               *sl = NULL, *backend = NULL, *method = NULL, *help = NULL;
    fl_cli_opt opts[] = {
        {"model", true, &model, "Hugging Face folder of the float model (required)"},
        {"calib", true, &calib_p, "calibration text: JSONL with \"text\" or \"prompt\", or plain text (required)"},
        {"output", true, &output, "folder to write the checkpoint into (required); an unfinished run's folder "
                                  "is continued after its last finished layer"},
        {"group-size", true, &group_s, "inputs per 4-bit group: 32, 64 or 128 (default 128)"},
        {"format", true, &format, "awq (AutoAWQ GEMM, default) | compressed-tensors (llm-compressor "
                                  "pack-quantized W4A16)"},
        {"n-samples", true, &ns, "calibration samples (default 128)"},
        {"seq-len", true, &sl, "tokens per sample (default 512)"},
        {"method", true, &method, "awq (default) | rtn: plain group quantization, no scale or clip search"},
        {"backend", true, &backend, "cpu (default: everything on the host in f32) | cuda: the linears' matmuls "
                                    "on this rank's GPU (bf16 values, f32 sums, as AutoAWQ's GPU search)"},
        {"help", false, &help, "show this help"},
        {0},
    };
    fl_status st = fl_cli_parse("quantize", argc, argv, opts);
    if (st != FL_OK) return arg_fail(st);
    if (help) {
        if (fl_cli_world_rank() == 0)
            fl_cli_usage(stdout, "quantize",
                         "--model HF_FOLDER --calib FILE --output DIR [--format awq|compressed-tensors] "
                         "[--group-size 128] [--n-samples N --seq-len L]",
                         opts);
        return 0;
    }
    if (!model || !calib_p || !output) {
        if (fl_cli_world_rank() == 0) fprintf(stderr, "flotilla quantize: --model, --calib and --output are required\n");
        return 1;
    }
    fl_qopts o = {.model = model, .calib = calib_p, .output = output, .awq = true, .format = FL_QFORMAT_AWQ,
                  .clip_tokens = fl_opt_int(FL_OPT_TEST_QUANTIZE_CLIP_TOKENS)};
    if (o.clip_tokens < 1) {
        if (fl_cli_world_rank() == 0)
            fprintf(stderr, "flotilla quantize: FL_TEST_QUANTIZE_CLIP_TOKENS must be at least 1, got %ld\n", o.clip_tokens);
        return 1;
    }
    st = fl_cli_int("group-size", group_s ? group_s : "128", 8, 1 << 20, &o.group);
    if (st == FL_OK) st = fl_cli_int("n-samples", ns ? ns : "128", 1, 1 << 20, &o.n_samples);
    if (st == FL_OK) st = fl_cli_int("seq-len", sl ? sl : "512", 2, 1 << 20, &o.seq_len);
    if (st == FL_OK && o.group != 32 && o.group != 64 && o.group != 128) /* the groups W4 kernels take */
        st = FL_ERR(FL_ERR_INVALID_ARG, "--group-size must be 32, 64 or 128, got %ld", o.group);
    if (st == FL_OK && format && strcmp(format, "awq") && strcmp(format, "compressed-tensors"))
        st = FL_ERR(FL_ERR_INVALID_ARG, "--format must be awq or compressed-tensors, got '%s'", format);
    if (st == FL_OK && format && !strcmp(format, "compressed-tensors")) o.format = FL_QFORMAT_CT;
    if (st == FL_OK && backend && strcmp(backend, "cpu") && strcmp(backend, "cuda"))
        st = FL_ERR(FL_ERR_INVALID_ARG, "--backend must be cpu or cuda, got '%s'", backend);
    if (st == FL_OK && method && strcmp(method, "awq") && strcmp(method, "rtn"))
        st = FL_ERR(FL_ERR_INVALID_ARG, "--method must be awq or rtn, got '%s'", method);
    if (st == FL_OK && method) o.awq = !strcmp(method, "awq");
    o.cuda = backend && !strcmp(backend, "cuda");
    if (st != FL_OK) return arg_fail(st);
    /* under mpirun / srun the ranks split the calibration samples */
    fl_comm *comm = NULL;
    bool reported = false;
    if (fl_cli_world_size() > 1) st = fl_comm_init_mpi(MPI_COMM_WORLD, &comm);
    /* --backend cuda: this rank's GPU (its local rank's, as generate picks;
     * one process: GPU 0, MPI may not be running). The ranks agree on the
     * backend first: picking the GPU is a collective the CPU ranks would
     * not join. */
    fl_backend *be = NULL;
    if (st == FL_OK && comm) {
        int all_cuda = 0, no_cuda = 0;
        st = fl_comm_agree_min(comm, o.cuda, &all_cuda);
        if (st == FL_OK) st = fl_comm_agree_min(comm, !o.cuda, &no_cuda);
        if (st == FL_OK && !all_cuda && !no_cuda) {
            if (fl_comm_rank(comm) == 0)
                fprintf(stderr,
                        "flotilla quantize: --backend must be the same on every rank (some have cpu, some cuda)\n");
            reported = true;
            st = FL_ERR(FL_ERR_INVALID_ARG, "the ranks disagree on --backend");
        }
    }
    if (st == FL_OK && o.cuda) {
        int gpu = 0;
        if (comm) {
            fl_par_rank_info ri;
            st = fl_par_rank_discover(MPI_COMM_WORLD, NULL, &ri);
            gpu = st == FL_OK && ri.gpu > 0 ? ri.gpu : 0;
        }
        if (st == FL_OK) st = fl_backend_cuda_init(gpu, &be);
    }
    if (st == FL_OK) st = quantize(&o, comm, be, &reported);
    fl_backend_free(be);
    /* a failure not every rank saw ends the job (fl_par_abort): its peers may wait in a collective */
    if (st != FL_OK && !reported) return fl_cli_fail("quantize", st);
    fl_comm_free(comm);
    if (st != FL_OK) return 1;
    if (fl_cli_world_rank() == 0) fprintf(stderr, "flotilla quantize: wrote %s\n", output);
    return 0;
}
