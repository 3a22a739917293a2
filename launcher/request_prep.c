/*
 * request_prep.c — a parsed request made ready for the engine, and a
 * finished choice's logprobs made ready for the result writer; shared by
 * generate and serve so both give the same answer to the same request.
 */
#include "launcher/request_prep.h"

#include <stdlib.h>
#include <string.h>

fl_status fl_prep_tokenize(fl_tokenizer *tok, const fl_prep_chat *chat, const fl_request *rq,
                           int32_t **ids, size_t *n) {
    char *text = NULL;
    bool add_bos = false;
    if (rq->messages) {
        if (chat->family == FL_CHAT_FAMILY_NONE)
            return FL_ERR(FL_ERR_UNSUPPORTED, "the model has no chat template flotilla understands; "
                          "send \"prompt\" instead of \"messages\"");
        int32_t bos = fl_tokenizer_bos(tok);
        const char *bos_text = bos >= 0 ? fl_tokenizer_token_str(tok, bos) : "";
        FL_TRY(fl_chat_template_render(chat->family, chat->template_src, rq->messages,
                                       rq->n_messages, bos_text ? bos_text : "", &text));
    } else {
        text = strdup(rq->prompt);
        if (!text) return FL_ERR(FL_ERR_OOM, "out of memory");
        add_bos = fl_tokenizer_add_bos(tok) && fl_tokenizer_bos(tok) >= 0;
    }
    int32_t *raw = NULL;
    size_t nraw = 0;
    fl_status st = fl_tokenizer_encode(tok, text, strlen(text), true, &raw, &nraw);
    free(text);
    if (st != FL_OK) return st;
    if (add_bos) {
        int32_t *w = malloc((nraw + 1) * sizeof *w);
        if (!w) {
            free(raw);
            return FL_ERR(FL_ERR_OOM, "out of memory");
        }
        w[0] = fl_tokenizer_bos(tok);
        memcpy(w + 1, raw, nraw * sizeof *w);
        free(raw);
        raw = w;
        nraw++;
    }
    *ids = raw;
    *n = nraw;
    return FL_OK;
}

fl_status fl_prep_gen_init(fl_gen *g, int64_t id, const fl_request *rq,
                           const fl_sampling_params *defaults, int max_tokens, int c,
                           const int32_t *ids, size_t n) {
    fl_sampling_params sp;
    fl_request_sampling(rq, defaults, &sp);
    sp.seed += (uint64_t)c; /* choice c: its own stream, reproducible */
    const int max_new = rq->max_tokens > 0 ? rq->max_tokens : max_tokens;
    fl_status st = fl_gen_init(g, id, ids, (int)n, &sp, max_new);
    g->presence_penalty = rq->presence_penalty;
    g->frequency_penalty = rq->frequency_penalty;
    g->min_tokens = rq->min_tokens;
    g->ignore_eos = rq->ignore_eos;
    g->want_logprobs = rq->logprobs;
    g->top_logprobs = rq->top_logprobs;
    return st;
}

void fl_prep_lp_free(fl_prep_lp *v) {
    for (size_t i = 0; i < v->n_own; i++) free(v->own[i]);
    free(v->own);
    free(v->toks);
    free(v->text);
    free(v->len);
    memset(v, 0, sizeof *v);
}

fl_status fl_prep_lp_build(fl_tokenizer *tok, const int32_t *ids, const fl_token_logprob *lps,
                           size_t nt, fl_prep_lp *v) {
    const size_t per = 1 + FL_SAMPLER_MAX_TOP_LOGPROBS;
    memset(v, 0, sizeof *v);
    v->toks = calloc(nt + 1, sizeof *v->toks);
    v->text = calloc(nt * per + 1, sizeof *v->text);
    v->len = calloc(nt * per + 1, sizeof *v->len);
    v->own = calloc(nt * per + 1, sizeof *v->own);
    if (!v->toks || !v->text || !v->len || !v->own) return FL_ERR(FL_ERR_OOM, "out of memory");
    for (size_t i = 0; i < nt; i++) {
        const fl_token_logprob *lp = &lps[i];
        for (int k = 0; k <= lp->n_top; k++) {
            const int32_t id = k == 0 ? ids[i] : lp->top_ids[k - 1];
            char *s = NULL;
            FL_TRY(fl_tokenizer_decode(tok, &id, 1, false, &s));
            v->own[v->n_own++] = s;
            v->text[i * per + (size_t)k] = s;
            v->len[i * per + (size_t)k] = strlen(s);
        }
        v->toks[i] = (fl_result_token){
            .text = v->text[i * per], .len = v->len[i * per], .logprob = lp->logprob,
            .n_top = lp->n_top, .top_text = v->text + i * per + 1, .top_len = v->len + i * per + 1,
            .top_lps = lp->top_lps,
        };
    }
    return FL_OK;
}
