/*
 * quantize_input.c — the input of `flotilla quantize` (quantize_input.h):
 * the model checks, the calibration text (JSONL or plain) tokenized and cut
 * into samples, the run's identity, and the ranks' agreement on all that.
 */
#include "launcher/quantize_input.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/cli.h"
#include "launcher/resume.h"

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
static fl_status read_calib(const char *path, const fl_tokenizer *tok, const fl_qopts *o, fl_qcalib *c) {
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

/* Every calibration id within the vocabulary (checked on every rank before
 * any rank embeds its share). */
static fl_status check_ids(const fl_model_config *cfg, const fl_qcalib *c) {
    for (int64_t i = 0; i < c->n; i++)
        if (c->ids[i] < 0 || c->ids[i] >= cfg->vocab_size)
            return FL_ERR(FL_ERR_INVALID_ARG, "calibration token id %d is outside the vocabulary (%d)", c->ids[i],
                          cfg->vocab_size);
    return FL_OK;
}

/* The identity of this run kept in the output folder until it completes
 * (quantize_resume.h): the model, the calibration file and every option
 * that changes the output. */
static fl_status run_ident(const fl_qopts *o, fl_batch_ident *id) {
    char v[32];
    memset(id, 0, sizeof *id);
    FL_TRY(fl_resume_ident_files(o->calib, o->model, id));
    FL_TRY(fl_batch_ident_set_opt(id, "format", fl_qformat_name(o->format)));
    FL_TRY(fl_batch_ident_set_opt(id, "method", o->awq ? "awq" : "rtn"));
    FL_TRY(fl_batch_ident_set_opt(id, "backend", o->cuda ? "cuda" : "cpu"));
    const char *names[3] = {"group-size", "n-samples", "seq-len"};
    const long vals[3] = {o->group, o->n_samples, o->seq_len};
    for (int i = 0; i < 3; i++) {
        snprintf(v, sizeof v, "%ld", vals[i]);
        FL_TRY(fl_batch_ident_set_opt(id, names[i], v));
    }
    return FL_OK;
}

fl_status fl_qinput_read(const fl_qopts *o, fl_comm *comm, fl_qinput *in) {
    FL_TRY(fl_ckpt_open(o->model, &in->ck));
    FL_TRY(fl_ckpt_model_config(in->ck, &in->cfg));
    FL_TRY(check_model(in->ck, &in->cfg, (int)o->group, o->format));
    FL_TRY(fl_ckpt_tokenizer(in->ck, &in->tok));
    FL_TRY(read_calib(o->calib, in->tok, o, &in->c));
    FL_TRY(check_ids(&in->cfg, &in->c));
    FL_TRY(fl_qshare_init(comm, in->c.len, in->c.n_blk, &in->sh));
    return run_ident(o, &in->id);
}

void fl_qinput_free(fl_qinput *in) {
    fl_qshare_free(&in->sh);
    free(in->c.ids);
    free(in->c.len);
    fl_tokenizer_free(in->tok);
    fl_ckpt_free(in->ck);
}

/* A 31-bit fingerprint of the calibration blocks and the options that
 * shape the work. */
static int input_print(const fl_qopts *o, const fl_qcalib *c) {
    const long opts[7] = {o->group, o->n_samples, o->seq_len, o->awq, (long)o->format, o->clip_tokens, o->cuda};
    uint64_t h = fl_batch_hash(FL_BATCH_HASH_INIT, opts, sizeof opts);
    h = fl_batch_hash(h, c->len, (size_t)c->n_blk * sizeof *c->len);
    h = fl_batch_hash(h, c->ids, (size_t)c->n * sizeof *c->ids);
    return (int)(h & 0x7fffffff);
}

fl_status fl_qinput_agree(fl_comm *comm, const fl_qopts *o, const fl_qinput *in, fl_status st, bool *reported) {
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
                "--n-samples, --seq-len, --group-size, --method, --format, --backend must be the same files and values on "
                "every rank)\n");
    *reported = true;
    return FL_ERR(FL_ERR_INVALID_ARG, "the ranks disagree on the input");
}

