/*
 * cmd_quantize.c — `flotilla quantize`: makes an int4 checkpoint (AutoAWQ
 * GEMM or compressed-tensors pack-quantized) from a Hugging Face float
 * folder (dense llama / qwen2) and calibration text, on the CPU in f32
 * (docs/quantize.md).
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
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "core/option.h"
#include "launcher/awq_calib.h"
#include "launcher/cli.h"
#include "launcher/quantize_layer.h"
#include "launcher/quantize_output.h"
#include "launcher/quantize_resume.h"
#include "launcher/quantize_share.h"
#include "launcher/resume.h"
#include "launcher/st_writer.h"
#include "runtime/load/json_file.h"

typedef struct quant_opts {
    const char *model, *calib, *output;
    long group, n_samples, seq_len;
    bool awq; /* false: --method rtn, plain group quantization (s = 1, no clipping) */
    fl_qformat format;
} quant_opts;

/* The calibration tokens cut into blocks (samples). */
typedef struct calib {
    int32_t *ids;
    int *len;
    int n_blk;
    int64_t n;
} calib;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Appends the tokens of one text (BOS first when the tokenizer adds one). */
static fl_status add_text(const fl_tokenizer *tok, const char *s, size_t len, int32_t **all, int64_t *n,
                          int64_t *cap) {
    int32_t *ids = NULL;
    size_t k = 0;
    FL_TRY(fl_tokenizer_encode(tok, s, len, false, &ids, &k));
    const bool bos = fl_tokenizer_add_bos(tok) && fl_tokenizer_bos(tok) >= 0;
    if (*n + (int64_t)k + 1 > *cap) {
        int64_t c = 2 * (*n + (int64_t)k + 1);
        int32_t *a = realloc(*all, (size_t)c * sizeof *a);
        if (!a) {
            free(ids);
            return FL_ERR(FL_ERR_OOM, "out of memory tokenizing the calibration text");
        }
        *all = a;
        *cap = c;
    }
    if (bos) (*all)[(*n)++] = fl_tokenizer_bos(tok);
    memcpy(*all + *n, ids, k * sizeof *ids);
    *n += (int64_t)k;
    free(ids);
    return FL_OK;
}

/* JSONL (first non-blank character '{': one object a line with "text" or
 * "prompt") or plain text; every text's tokens concatenated, then cut into
 * at most n_samples blocks of seq_len (the last may be shorter). */
static fl_status read_calib(const char *path, const fl_tokenizer *tok, const quant_opts *o, calib *c) {
    char *text = NULL;
    size_t len = 0;
    int32_t *all = NULL;
    int64_t n = 0, cap = 0;
    fl_status st = FL_OK;
    memset(c, 0, sizeof *c);
    FL_TRY(fl_cli_read_all(path, &text, &len));
    size_t p = strspn(text, " \t\r\n");
    if (p == len) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "%s: the calibration file is empty", path);
        goto done;
    }
    if (text[p] == '{') {
        int line = 0;
        for (char *s = text, *e; *s; s = e + (*e != 0)) {
            e = s + strcspn(s, "\n");
            line++;
            if (strspn(s, " \t\r") == (size_t)(e - s)) continue;
            cJSON *j = cJSON_ParseWithLength(s, (size_t)(e - s));
            const cJSON *t = j ? cJSON_GetObjectItemCaseSensitive(j, "text") : NULL;
            if (!cJSON_IsString(t) && j) t = cJSON_GetObjectItemCaseSensitive(j, "prompt");
            if (!cJSON_IsString(t)) {
                cJSON_Delete(j);
                st = FL_ERR(FL_ERR_FORMAT, "%s:%d: expected a JSON object with a string \"text\" or \"prompt\"",
                            path, line);
                goto done;
            }
            st = add_text(tok, t->valuestring, strlen(t->valuestring), &all, &n, &cap);
            cJSON_Delete(j);
            if (st != FL_OK) goto done;
        }
    } else {
        FL_TRY_GOTO(add_text(tok, text, len, &all, &n, &cap), st, done);
    }
    if (n < 2) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "%s: %lld calibration token(s); at least 2 are needed", path, (long long)n);
        goto done;
    }
    const int64_t want = o->n_samples * o->seq_len;
    if (n > want) n = want;
    c->n_blk = (int)((n + o->seq_len - 1) / o->seq_len);
    c->len = malloc((size_t)c->n_blk * sizeof *c->len);
    FL_CHECK_ALLOC(c->len, st, done);
    for (int b = 0; b < c->n_blk; b++)
        c->len[b] = (int)(n - (int64_t)b * o->seq_len < o->seq_len ? n - (int64_t)b * o->seq_len : o->seq_len);
    c->ids = all;
    c->n = n;
    all = NULL;
done:
    free(all);
    free(text);
    return st;
}

static fl_status check_model(const fl_ckpt *ck, const fl_model_config *cfg, int group, fl_qformat format) {
    const char *path = fl_ckpt_path(ck);
    if (strcmp(fl_ckpt_format(ck), "safetensors"))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: flotilla quantize reads Hugging Face folders (config.json, "
                      "safetensors, tokenizer.json), not %s files", path, fl_ckpt_format(ck));
    if (cfg->n_experts > 0 || cfg->arch == FL_ARCH_DEEPSEEK_V2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s is a Mixture-of-Experts%s model; flotilla quantize handles dense "
                      "LlamaForCausalLM and Qwen2ForCausalLM only", path, fl_arch_name(cfg->arch),
                      cfg->arch == FL_ARCH_DEEPSEEK_V2 ? " / MLA" : "");
    if (cfg->arch != FL_ARCH_LLAMA && cfg->arch != FL_ARCH_QWEN2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s is not supported by flotilla quantize (dense llama and qwen2 "
                      "only)", path, fl_arch_name(cfg->arch));
    if (cfg->quant != FL_QUANT_NONE)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: the checkpoint is already quantized (config.json "
                      "quantization_config); give the float model", path);
    const int64_t qd = (int64_t)cfg->n_heads * cfg->head_dim, kvd = (int64_t)cfg->n_kv_heads * cfg->head_dim;
    const int64_t ins[3] = {cfg->hidden_size, qd, cfg->intermediate_size};
    const int64_t outs[4] = {qd, kvd, cfg->hidden_size, cfg->intermediate_size};
    const char *in_names[3] = {"hidden_size", "num_attention_heads * head_dim", "intermediate_size"};
    const char *out_names[4] = {"num_attention_heads * head_dim", "num_key_value_heads * head_dim", "hidden_size",
                                "intermediate_size"};
    int fits = 0; /* the largest usual group size every input dimension takes, for the message */
    for (int g = 128; g >= 32 && !fits; g /= 2)
        if (ins[0] % g == 0 && ins[1] % g == 0 && ins[2] % g == 0) fits = g;
    for (int i = 0; i < 3; i++)
        if (ins[i] % group)
            return FL_ERR(FL_ERR_INVALID_ARG, "%s: %s = %lld is not a multiple of --group-size %d%s",
                          path, in_names[i], (long long)ins[i], group,
                          fits == 64 ? " (64 fits)" : fits == 32 ? " (32 fits)" : " (no group size of 32, 64 or 128 fits this model)");
    for (int i = 0; i < 4 && format == FL_QFORMAT_AWQ; i++)
        if (outs[i] % 8)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s = %lld is not a multiple of 8 (AutoAWQ packs 8 outputs a word)",
                          path, out_names[i], (long long)outs[i]);
    return FL_OK;
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
static fl_status awq_layer(const fl_model_config *cfg, fl_qlayer *L, fl_qlayer_capture *c, const fl_qshare *sh,
                           int group, fl_awq_search res[4]) {
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
    FL_TRY_GOTO(fl_awq_search_scale(c->qkv, n, sh, d, qkv, 3, group, 20, s[0], &res[0]), st, done);
    if (do_o) FL_TRY_GOTO(fl_awq_search_scale(c->o, n, sh, qd, o, 1, group, 20, s[1], &res[1]), st, done);
    FL_TRY_GOTO(fl_awq_search_scale(c->gu, n, sh, d, gu, 2, group, 20, s[2], &res[2]), st, done);
    FL_TRY_GOTO(fl_awq_search_scale(c->down, n, sh, ff, dn, 1, group, 20, s[3], &res[3]), st, done);
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
        FL_TRY_GOTO(fl_awq_search_clip(xin[k], n, sh, L->in[k], L->w[k], L->out[k], group, 20, 0.5f, 512), st, done);
done:
    for (int i = 0; i < 4; i++) free(s[i]);
    return st;
}

/* Every calibration id within the vocabulary (checked on every rank before
 * any rank embeds its share). */
static fl_status check_ids(const fl_model_config *cfg, const calib *c) {
    for (int64_t i = 0; i < c->n; i++)
        if (c->ids[i] < 0 || c->ids[i] >= cfg->vocab_size)
            return FL_ERR(FL_ERR_INVALID_ARG, "calibration token id %d is outside the vocabulary (%d)", c->ids[i],
                          cfg->vocab_size);
    return FL_OK;
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

/* The identity of this run kept in the output folder until it completes
 * (quantize_resume.h): the model, the calibration file and every option
 * that changes the output. */
static fl_status run_ident(const quant_opts *o, fl_batch_ident *id) {
    char v[32];
    memset(id, 0, sizeof *id);
    FL_TRY(fl_resume_ident_files(o->calib, o->model, id));
    FL_TRY(fl_batch_ident_set_opt(id, "format", fl_qformat_name(o->format)));
    FL_TRY(fl_batch_ident_set_opt(id, "method", o->awq ? "awq" : "rtn"));
    const char *names[3] = {"group-size", "n-samples", "seq-len"};
    const long vals[3] = {o->group, o->n_samples, o->seq_len};
    for (int i = 0; i < 3; i++) {
        snprintf(v, sizeof v, "%ld", vals[i]);
        FL_TRY(fl_batch_ident_set_opt(id, names[i], v));
    }
    return FL_OK;
}

/* Opens model.safetensors for a run that starts at layer `done`: a new
 * file, or the one an interrupted run of the same identity left, whose
 * first `done` layers are kept. */
static fl_status open_output(const quant_opts *o, const fl_ckpt *ck, int done, fl_stw **out) {
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

static void print_layer(const quant_opts *o, int l, int n_layers, const fl_awq_search res[4], double secs) {
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

/* What every rank reads alike: the model, its tokenizer, the calibration
 * blocks and their split over the ranks, the run's identity. */
typedef struct qinput {
    fl_ckpt *ck;
    fl_tokenizer *tok;
    fl_model_config cfg;
    calib c;
    fl_qshare sh;
    fl_batch_ident id;
} qinput;

static fl_status read_input(const quant_opts *o, fl_comm *comm, qinput *in) {
    FL_TRY(fl_ckpt_open(o->model, &in->ck));
    FL_TRY(fl_ckpt_model_config(in->ck, &in->cfg));
    FL_TRY(check_model(in->ck, &in->cfg, (int)o->group, o->format));
    FL_TRY(fl_ckpt_tokenizer(in->ck, &in->tok));
    FL_TRY(read_calib(o->calib, in->tok, o, &in->c));
    FL_TRY(check_ids(&in->cfg, &in->c));
    FL_TRY(fl_qshare_init(comm, in->c.len, in->c.n_blk, &in->sh));
    return run_ident(o, &in->id);
}

static void free_input(qinput *in) {
    fl_qshare_free(&in->sh);
    free(in->c.ids);
    free(in->c.len);
    fl_tokenizer_free(in->tok);
    fl_ckpt_free(in->ck);
}

/* A 31-bit fingerprint of the calibration blocks and the options that
 * shape the work. */
static int input_print(const quant_opts *o, const calib *c) {
    const long opts[5] = {o->group, o->n_samples, o->seq_len, o->awq, (long)o->format};
    uint64_t h = fl_batch_hash(FL_BATCH_HASH_INIT, opts, sizeof opts);
    h = fl_batch_hash(h, c->len, (size_t)c->n_blk * sizeof *c->len);
    h = fl_batch_hash(h, c->ids, (size_t)c->n * sizeof *c->ids);
    return (int)(h & 0x7fffffff);
}

/* Every rank reads the same files with the same options, so a failure in
 * read_input is (almost always) every rank's: the lowest failing rank
 * prints it, the ranks leave together, and *reported says it is printed.
 * One that failed alone is reported by it the same way, not left hanging. */
static fl_status agree_input(fl_comm *comm, const quant_opts *o, const qinput *in, fl_status st, bool *reported) {
    if (!comm) return st;
    const int me = fl_comm_rank(comm), ranks = fl_comm_size(comm);
    int least = ranks;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", st == FL_OK ? "" : fl_error_msg());
    FL_TRY(fl_comm_agree_min(comm, st == FL_OK ? ranks : me, &least));
    if (least < ranks) {
        if (me == least && me) fprintf(stderr, "flotilla quantize: rank %d: %s\n", me, msg);
        else if (me == least) fprintf(stderr, "flotilla quantize: %s\n", msg);
        *reported = true;
        return FL_ERR(FL_ERR_INVALID_ARG, "rank %d failed to read the input", least);
    }
    /* ranks that cut other blocks would pair mismatched collectives */
    const int print = input_print(o, &in->c);
    int lo = 0, neg_hi = 0;
    FL_TRY(fl_comm_agree_min(comm, print, &lo));
    FL_TRY(fl_comm_agree_min(comm, -print, &neg_hi));
    if (lo == -neg_hi) return FL_OK;
    if (me == 0)
        fprintf(stderr, "flotilla quantize: the ranks disagree on the calibration tokens or the options (--calib, "
                "--n-samples, --seq-len, --group-size, --method, --format must be the same files and values on "
                "every rank)\n");
    *reported = true;
    return FL_ERR(FL_ERR_INVALID_ARG, "the ranks disagree on the input");
}

static fl_status quantize(const quant_opts *o, fl_comm *comm, bool *reported) {
    qinput in = {0};
    fl_stw *w = NULL;
    fl_qresume *rs = NULL;
    fl_qlayer L = {0};
    fl_qlayer_capture cap = {0};
    float *h = NULL, *h2 = NULL, *hall = NULL; /* hall: every rank's h, on rank 0 (one rank: h itself) */
    fl_status st = FL_OK;
    int32_t done = 0;
    FL_TRY_GOTO(agree_input(comm, o, &in, read_input(o, comm, &in), reported), st, out);
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
        fprintf(stderr, "flotilla quantize: %s, %d layers, %lld calibration tokens in %d samples, group %ld, %s, %s",
                fl_arch_name(cfg->arch), cfg->n_layers, (long long)n, in.c.n_blk, o->group, o->awq ? "awq" : "rtn",
                fl_qformat_name(o->format));
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
        FL_TRY_GOTO(fl_qlayer_forward(cfg, &L, h, sh->len + b0, nb, h2, &cap), st, out);
        fl_awq_search res[4] = {{-1, 0, 0}, {-1, 0, 0}, {-1, 0, 0}, {-1, 0, 0}};
        if (o->awq) FL_TRY_GOTO(awq_layer(cfg, &L, &cap, sh, (int)o->group, res), st, out);
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
    free_input(&in);
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
        {"backend", true, &backend, "cpu (the only one)"},
        {"help", false, &help, "show this help"},
        {0},
    };
    fl_status st = fl_cli_parse("quantize", argc, argv, opts);
    if (st != FL_OK) return arg_fail(st);
    if (help) {
        fl_cli_usage(stdout, "quantize",
                     "--model HF_FOLDER --calib FILE --output DIR [--format awq|compressed-tensors] "
                     "[--group-size 128] [--n-samples N --seq-len L]",
                     opts);
        return 0;
    }
    if (!model || !calib_p || !output) {
        fprintf(stderr, "flotilla quantize: --model, --calib and --output are required\n");
        return 1;
    }
    quant_opts o = {.model = model, .calib = calib_p, .output = output, .awq = true, .format = FL_QFORMAT_AWQ};
    st = fl_cli_int("group-size", group_s ? group_s : "128", 8, 1 << 20, &o.group);
    if (st == FL_OK) st = fl_cli_int("n-samples", ns ? ns : "128", 1, 1 << 20, &o.n_samples);
    if (st == FL_OK) st = fl_cli_int("seq-len", sl ? sl : "512", 2, 1 << 20, &o.seq_len);
    if (st == FL_OK && o.group != 32 && o.group != 64 && o.group != 128) /* the groups W4 kernels take */
        st = FL_ERR(FL_ERR_INVALID_ARG, "--group-size must be 32, 64 or 128, got %ld", o.group);
    if (st == FL_OK && format && strcmp(format, "awq") && strcmp(format, "compressed-tensors"))
        st = FL_ERR(FL_ERR_INVALID_ARG, "--format must be awq or compressed-tensors, got '%s'", format);
    if (st == FL_OK && format && !strcmp(format, "compressed-tensors")) o.format = FL_QFORMAT_CT;
    if (st == FL_OK && backend && strcmp(backend, "cpu"))
        st = FL_ERR(FL_ERR_UNSUPPORTED, "--backend %s: flotilla quantize runs on the cpu backend only", backend);
    if (st == FL_OK && method && strcmp(method, "awq") && strcmp(method, "rtn"))
        st = FL_ERR(FL_ERR_INVALID_ARG, "--method must be awq or rtn, got '%s'", method);
    if (st == FL_OK && method) o.awq = !strcmp(method, "awq");
    if (st != FL_OK) return arg_fail(st);
    /* under mpirun / srun the ranks split the calibration samples */
    fl_comm *comm = NULL;
    bool reported = false;
    if (fl_cli_world_size() > 1) st = fl_comm_init_mpi(MPI_COMM_WORLD, &comm);
    if (st == FL_OK) st = quantize(&o, comm, &reported);
    /* a failure not every rank saw ends the job (fl_par_abort): its peers may wait in a collective */
    if (st != FL_OK && !reported) return fl_cli_fail("quantize", st);
    fl_comm_free(comm);
    if (st != FL_OK) return 1;
    if (fl_cli_world_rank() == 0) fprintf(stderr, "flotilla quantize: wrote %s\n", output);
    return 0;
}
