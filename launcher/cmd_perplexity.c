/*
 * cmd_perplexity.c — `flotilla perplexity`: the perplexity of a model on a
 * text file, as llama.cpp's perplexity tool and the Hugging Face guide
 * measure it. The whole file is tokenized (BOS first when the tokenizer
 * adds one, as HF's tokenizer(text) does; special tokens written in the
 * text stay plain text), cut into windows of --ctx tokens (with --stride,
 * overlapping windows that score only their new tokens; perplexity.h),
 * each window's prefill is run with logits for every position, and
 * PPL = exp(mean of -log p(next token)) over the scored tokens.
 *
 * Rank 0 tokenizes and drives the windows through fl_engine_prompt_logits;
 * the other ranks of an mpirun job follow the step plans as in `logits`.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/cli.h"
#include "launcher/perplexity.h"

typedef struct ppl_result {
    double nll_sum;
    long long scored;
    int windows;
} ppl_result;

static fl_status tokenize_text(fl_tokenizer *tok, const char *path, const char *text, size_t len,
                               int32_t **ids, int *n) {
    int32_t *raw = NULL;
    size_t nraw = 0;
    FL_TRY(fl_tokenizer_encode(tok, text, len, false, &raw, &nraw));
    const bool bos = fl_tokenizer_add_bos(tok) && fl_tokenizer_bos(tok) >= 0;
    const size_t total = nraw + (bos ? 1 : 0);
    if (total > INT32_MAX / 2) {
        free(raw);
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: %zu tokens is more than flotilla perplexity takes", path, total);
    }
    int32_t *w = malloc((total ? total : 1) * sizeof *w);
    if (!w) {
        free(raw);
        return FL_ERR(FL_ERR_OOM, "out of memory");
    }
    if (bos) w[0] = fl_tokenizer_bos(tok);
    if (nraw) memcpy(w + (bos ? 1 : 0), raw, nraw * sizeof *w);
    free(raw);
    *ids = w;
    *n = (int)total;
    return FL_OK;
}

/* Rank 0: every window through the engine, the scored targets' NLL summed. */
static fl_status score(fl_cli_bundle *b, const int32_t *ids, int n, int ctx, int stride, ppl_result *r) {
    const int V = b->model->cfg.vocab_size;
    fl_status st = FL_OK;
    float *logits = malloc((size_t)ctx * V * sizeof *logits);
    FL_CHECK_ALLOC(logits, st, done);
    fl_ppl_window w;
    for (int k = 0; fl_ppl_window_at(n, ctx, stride, k, &w); k++) {
        const int len = w.end - w.begin;
        FL_TRY_GOTO(fl_engine_prompt_logits(b->eng, ids + w.begin, len, logits), st, done);
        for (int t = w.score_from; t < w.end; t++) {
            r->nll_sum += fl_ppl_nll(logits + (size_t)(t - 1 - w.begin) * V, V, ids[t]);
            r->scored++;
        }
        r->windows++;
        if (b->verbose)
            fprintf(stderr, "flotilla: window %d [%d, %d): running perplexity %.4f over %lld tokens\n", k,
                    w.begin, w.end, exp(r->nll_sum / (double)r->scored), r->scored);
    }
done:
    free(logits);
    return st;
}

static fl_status write_json(const char *path, const char *model, const char *input, const ppl_result *r,
                            int n, int ctx, int stride) {
    fl_status st = FL_OK;
    cJSON *o = cJSON_CreateObject();
    char *s = NULL;
    FILE *f = NULL;
    FL_CHECK_ALLOC(o, st, done);
    const double mean = r->nll_sum / (double)r->scored;
    if (!cJSON_AddNumberToObject(o, "perplexity", exp(mean)) || !cJSON_AddNumberToObject(o, "mean_nll", mean) ||
        !cJSON_AddNumberToObject(o, "scored_tokens", (double)r->scored) ||
        !cJSON_AddNumberToObject(o, "text_tokens", n) || !cJSON_AddNumberToObject(o, "ctx", ctx) ||
        !cJSON_AddNumberToObject(o, "stride", stride) || !cJSON_AddNumberToObject(o, "windows", r->windows) ||
        !cJSON_AddStringToObject(o, "model", model) || !cJSON_AddStringToObject(o, "input", input)) {
        st = FL_ERR(FL_ERR_OOM, "out of memory");
        goto done;
    }
    s = cJSON_Print(o);
    FL_CHECK_ALLOC(s, st, done);
    f = fopen(path, "w");
    if (!f) {
        st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", path, strerror(errno));
        goto done;
    }
    if (fprintf(f, "%s\n", s) < 0 || fflush(f) != 0) st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", path, strerror(errno));
done:
    if (f && fclose(f) != 0 && st == FL_OK) st = FL_ERR(FL_ERR_IO, "cannot write %s", path);
    free(s);
    cJSON_Delete(o);
    return st;
}

int fl_cmd_perplexity(int argc, char **argv) {
    fl_cli_model_opts mo = {0};
    const char *in = NULL, *outp = NULL, *ctx_s = NULL, *stride_s = NULL, *help = NULL;
    fl_cli_opt opts[FL_CLI_MAX_OPTS] = {
        {"input", true, &in, "text file whose perplexity is measured (required)"},
        {"ctx", true, &ctx_s, "tokens per window (default 512)"},
        {"stride", true, &stride_s, "tokens between window starts; < ctx overlaps windows (default ctx)"},
        {"output", true, &outp, "also write the result as JSON to this file"},
        {"help", false, &help, "show this help"},
    };
    int n_opts = 5;
    fl_cli_model_opts_add(&mo, opts, &n_opts);
    fl_status st = fl_cli_parse("perplexity", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("perplexity", st);
    if (help) {
        fl_cli_usage(stdout, "perplexity", "--model PATH --input TEXT [--ctx N] [--stride S] [--output FILE.json]",
                     opts);
        return 0;
    }
    if (!in || !mo.model) {
        fprintf(stderr, "flotilla perplexity: --model and --input are required\n");
        return 1;
    }
    long ctx = 512, stride;
    st = fl_cli_int("ctx", ctx_s ? ctx_s : "512", 2, 1 << 24, &ctx);
    if (st == FL_OK) st = fl_cli_int("stride", stride_s ? stride_s : ctx_s ? ctx_s : "512", 1, ctx, &stride);
    if (st != FL_OK) return fl_cli_fail("perplexity", st);
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    int n = 0;
    ppl_result r = {0};
    fl_cli_bundle b;
    memset(&b, 0, sizeof b);
    /* every rank reads the file, so an empty one stops them all alike, before the engine */
    FL_TRY_GOTO(fl_cli_read_all(in, &text, &len), st, done);
    if (len == 0) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "%s: the file is empty", in);
        goto done;
    }
    static char len_buf[32];
    if (mo.max_model_len == NULL) {
        snprintf(len_buf, sizeof len_buf, "%ld", ctx); /* one window is the longest prompt */
        mo.max_model_len = len_buf;
    }
    FL_TRY_GOTO(fl_cli_bundle_open(&mo, FL_CLI_NEED_ENGINE | FL_CLI_NEED_TOKENIZER, &b), st, done);
    if (!fl_engine_is_leader(b.eng)) {
        st = fl_engine_follow(b.eng); /* rank 0 drives and reports */
        goto done;
    }
    FL_TRY_GOTO(tokenize_text(b.tok, in, text, len, &ids, &n), st, release);
    if (n < 2) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "%s: %d token%s; perplexity needs at least 2 (one to predict from, one "
                    "to predict)", in, n, n == 1 ? "" : "s");
        goto release;
    }
    double t0 = fl_engine_now();
    /* a failure inside a forward may leave the group mid-collective: the job ends (fl_cli_finish) */
    FL_TRY_GOTO(score(&b, ids, n, (int)ctx, (int)stride, &r), st, done);
    if (b.verbose)
        fprintf(stderr, "flotilla: %d windows in %.3f s\n", r.windows, fl_engine_now() - t0);
    printf("perplexity: %.4f over %lld tokens (ctx %ld", exp(r.nll_sum / (double)r.scored), r.scored, ctx);
    if (stride != ctx) printf(", stride %ld", stride);
    printf(")\n");
    fflush(stdout);
    if (outp) FL_TRY_GOTO(write_json(outp, mo.model, in, &r, n, (int)ctx, (int)stride), st, release);
release:;
    /* the followers wait for plans until told there are none: tell them also after bad text */
    fl_status rs = fl_engine_release_followers(b.eng);
    if (st == FL_OK) st = rs;
done:
    free(ids);
    free(text);
    return fl_cli_finish("perplexity", &b, st);
}
