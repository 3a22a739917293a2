/*
 * cmd_serve.c — `flotilla serve`: an OpenAI-compatible HTTP server on rank 0
 * of the job (docs/serve.md).
 *
 * libmicrohttpd's threads receive requests (serve_api.c) and queue them;
 * this file's loop, on rank 0's main thread, is the only user of the engine:
 * between steps it admits queued requests and drops those whose client went
 * away, after each step it publishes new text and wakes the HTTP threads,
 * and with nothing to do it sleeps on a condition variable. The other ranks
 * follow rank 0's plans (fl_engine_follow), as in `flotilla generate`.
 * SIGTERM/SIGINT: stop accepting, finish what is in flight, release the
 * followers, exit 0 on every rank.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "launcher/serve.h"

static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig) { stop_signal = sig; }

typedef struct loop {
    srv *s;
    fl_cli_bundle *b;
    fl_prep_chat chat;
    fl_sampling_params defaults;
    int max_tokens;
    srv_req *live;           /* admitted requests (engine thread) */
    int64_t n_seqs;          /* sequence ids given so far */
} loop;

/* Marks r done (mu held by the caller). */
static void fail_locked(srv_req *r, int status, const char *msg, const char *param) {
    r->done = true;
    r->status = status;
    free(r->error);
    r->error = strdup(msg);
    snprintf(r->param, sizeof r->param, "%s", param ? param : "");
}

static void unlink_live(loop *L, srv_req *r) {
    for (srv_req **p = &L->live; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            r->next = NULL;
            return;
        }
}

/* Stops r's choices still in the engine (the client left, or a choice failed). */
static void drop_choices(loop *L, srv_req *r) {
    for (int c = 0; c < r->rq.n; c++) {
        srv_choice *ch = &r->ch[c];
        if (!ch->in_engine) continue;
        fl_engine_finish(L->b->eng, &ch->gen, FL_FINISH_ERROR);
        fl_gen_free(&ch->gen);
        ch->in_engine = false;
    }
    r->pending = 0;
}

/* Queued request -> engine sequences, one per choice. */
static void admit(loop *L, srv_req *r) {
    srv *s = L->s;
    int32_t *ids = NULL;
    size_t n = 0;
    fl_status st = fl_prep_tokenize(L->b->tok, &L->chat, &r->rq, &ids, &n);
    if (st == FL_OK && n == 0) st = FL_ERR(FL_ERR_INVALID_ARG, "the prompt is empty");
    for (int c = 0; st == FL_OK && c < r->rq.n; c++) {
        srv_choice *ch = &r->ch[c];
        st = fl_prep_gen_init(&ch->gen, L->n_seqs++, &r->rq, &L->defaults, L->max_tokens, c,
                              ids, n);
        ch->gen.user = ch;
        if (st == FL_OK) st = fl_engine_add(L->b->eng, &ch->gen);
        if (st != FL_OK) {
            fl_gen_free(&ch->gen);
            break;
        }
        ch->in_engine = true;
        r->pending++;
    }
    free(ids);
    pthread_mutex_lock(&s->mu);
    if (st != FL_OK) {
        drop_choices(L, r);
        fail_locked(r, 400, fl_error_msg(), NULL);
    } else {
        r->admitted = true;
        r->prompt_tokens = (long)n;
        r->next = L->live;
        L->live = r;
    }
    pthread_cond_broadcast(&s->out_cv);
    pthread_mutex_unlock(&s->mu);
    if (st != FL_OK) srv_req_release(s, r);
}

/* Every choice of r is done: the response body (non-streaming), metrics. */
static void complete(loop *L, srv_req *r) {
    srv *s = L->s;
    char *body = NULL;
    fl_status st = FL_OK;
    long total = 0;
    if (!r->rq.stream) {
        fl_result_choice *rc = calloc((size_t)r->rq.n, sizeof *rc);
        fl_prep_lp *views = calloc((size_t)r->rq.n, sizeof *views);
        if (!rc || !views) st = FL_ERR(FL_ERR_OOM, "out of memory");
        for (int c = 0; st == FL_OK && c < r->rq.n; c++) {
            const srv_choice *ch = &r->ch[c];
            rc[c] = (fl_result_choice){.text = ch->text, .text_len = ch->len,
                                       .completion_tokens = ch->n_tokens, .finish_reason = ch->finish};
            if (!r->rq.logprobs) continue;
            st = fl_prep_lp_build(L->b->tok, ch->ids, ch->lp, (size_t)ch->n_tokens, &views[c]);
            rc[c].tokens = views[c].toks;
            rc[c].n_tokens = (size_t)ch->n_tokens;
        }
        fl_result res = {.endpoint = r->rq.endpoint, .custom_id = r->custom_id,
                         .model = r->rq.model ? r->rq.model : s->model_name, .created = r->created,
                         .prompt_tokens = r->prompt_tokens, .choices = rc, .n_choices = r->rq.n};
        if (st == FL_OK) st = fl_result_body_format(&res, &body, NULL);
        for (int c = 0; views && c < r->rq.n; c++) fl_prep_lp_free(&views[c]);
        free(views);
        free(rc);
    }
    for (int c = 0; c < r->rq.n; c++) total += r->ch[c].n_tokens;
    /* counted before the answer is out: a client that reads /metrics next sees it */
    if (st == FL_OK) {
        fl_serve_metrics_tokens(&s->metrics, r->prompt_tokens, total);
        fl_serve_metrics_observe(&s->metrics, FL_SERVE_HIST_E2E, fl_engine_now() - r->t_arrive);
    }
    pthread_mutex_lock(&s->mu);
    if (st != FL_OK) {
        fail_locked(r, 500, fl_error_msg(), NULL);
    } else {
        r->done = true;
        r->status = 200;
        r->body = body;
    }
    pthread_cond_broadcast(&s->out_cv);
    pthread_mutex_unlock(&s->mu);
}

/* Length of text[0..len) without a trailing incomplete UTF-8 sequence. */
static size_t utf8_whole(const char *text, size_t len) {
    size_t i = len, k = 0;
    while (i > 0 && k < 4 && ((unsigned char)text[i - 1] & 0xC0) == 0x80) i--, k++;
    if (i == 0) return len;
    unsigned char lead = (unsigned char)text[i - 1];
    size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
    return need > k + 1 ? i - 1 : len;
}

/* A choice got a token: stop strings, finishing, publishing its text. */
static fl_status on_token(loop *L, srv_choice *ch) {
    srv *s = L->s;
    fl_gen *g = &ch->gen;
    srv_req *r = ch->req;
    const fl_request *rq = &r->rq;
    const int32_t *gen_ids = g->seq.tokens + g->seq.n_prompt;
    size_t n_gen = (size_t)fl_gen_n_generated(g);
    if (r->t_first == 0 && n_gen > 0) {
        r->t_first = fl_engine_now();
        fl_serve_metrics_observe(&s->metrics, FL_SERVE_HIST_TTFT, r->t_first - r->t_arrive);
    }
    const bool check_stop = rq->n_stop && (int)n_gen >= rq->min_tokens; /* vLLM: from min_tokens on */
    if (g->finish == FL_FINISH_NONE && !check_stop && !rq->stream) return FL_OK;
    char *text = NULL;
    FL_TRY(fl_tokenizer_decode(L->b->tok, gen_ids, n_gen, true, &text));
    size_t len = strlen(text), cut;
    if (check_stop && fl_request_find_stop(rq, text, len, ch->text_checked, &cut)) {
        text[cut] = 0; /* the stop string and what follows are not returned */
        len = cut;
        if (g->finish == FL_FINISH_NONE) fl_engine_finish(L->b->eng, g, FL_FINISH_STOP);
        g->finish = FL_FINISH_STOP;
    }
    ch->text_checked = check_stop ? len : 0;
    size_t show = len;
    if (g->finish == FL_FINISH_NONE) {
        /* hold back what may still turn into a stop string or a character */
        size_t hold = 0;
        for (size_t i = 0; i < rq->n_stop; i++) {
            size_t k = strlen(rq->stop[i]);
            if (k - 1 > hold) hold = k - 1;
        }
        show = utf8_whole(text, len > hold ? len - hold : 0);
    }
    /* a stream's logprobs go with the text: the tokens up to n_gen once
     * all of their text is shown, every token once finished */
    srv_lp_piece piece = {0};
    if (rq->stream && rq->logprobs && g->lp &&
        (g->finish != FL_FINISH_NONE || show == len) && n_gen > ch->lp_pub &&
        g->finish != FL_FINISH_ERROR) {
        piece.n = n_gen - ch->lp_pub;
        piece.lp = malloc(piece.n * sizeof *piece.lp);
        if (!piece.lp) {
            free(text);
            return FL_ERR(FL_ERR_OOM, "out of memory");
        }
        memcpy(piece.lp, g->lp + ch->lp_pub, piece.n * sizeof *piece.lp);
        fl_status lst = fl_prep_lp_build(L->b->tok, gen_ids + ch->lp_pub, piece.lp, piece.n, &piece.view);
        if (lst != FL_OK) {
            fl_prep_lp_free(&piece.view);
            free(piece.lp);
            free(text);
            return lst;
        }
        ch->lp_pub = n_gen;
    }
    pthread_mutex_lock(&s->mu);
    if (piece.n) {
        srv_lp_piece *np = realloc(ch->pieces, (ch->n_pieces + 1) * sizeof *np);
        if (np) {
            ch->pieces = np;
            ch->pieces[ch->n_pieces++] = piece;
        } else {
            pthread_mutex_unlock(&s->mu);
            fl_prep_lp_free(&piece.view);
            free(piece.lp);
            free(text);
            return FL_ERR(FL_ERR_OOM, "out of memory");
        }
    }
    /* published text only grows: decoding more tokens extends the text */
    if (show > ch->len && !memcmp(text, ch->text ? ch->text : "", ch->len)) {
        free(ch->text);
        text[show] = 0;
        ch->text = text;
        ch->len = show;
        text = NULL;
    }
    if (g->finish != FL_FINISH_NONE && g->finish != FL_FINISH_ERROR) {
        ch->n_tokens = (long)n_gen;
        ch->finish = g->finish == FL_FINISH_LENGTH ? "length" : "stop";
    }
    pthread_cond_broadcast(&s->out_cv);
    pthread_mutex_unlock(&s->mu);
    free(text);
    if (g->finish == FL_FINISH_NONE) return FL_OK;
    ch->in_engine = false;
    r->pending--;
    if (g->finish == FL_FINISH_ERROR) {
        pthread_mutex_lock(&s->mu);
        fail_locked(r, 500, g->error, NULL);
        pthread_cond_broadcast(&s->out_cv);
        pthread_mutex_unlock(&s->mu);
        fl_gen_free(g);
        drop_choices(L, r);
    } else {
        if (n_gen > 1)
            fl_serve_metrics_observe(&s->metrics, FL_SERVE_HIST_TPOT,
                                     (g->t_finished - g->t_first_token) / (double)(n_gen - 1));
        ch->ids = malloc((n_gen ? n_gen : 1) * sizeof *ch->ids);
        if (!ch->ids) return FL_ERR(FL_ERR_OOM, "out of memory");
        memcpy(ch->ids, gen_ids, n_gen * sizeof *ch->ids);
        ch->lp = g->lp; /* the choice takes the engine's logprobs */
        g->lp = NULL;
        g->lp_cap = 0;
        fl_gen_free(g);
        if (r->pending == 0) complete(L, r);
    }
    if (r->pending == 0) {
        unlink_live(L, r);
        srv_req_release(s, r);
    }
    return FL_OK;
}

static void publish_gauges(loop *L) {
    fl_engine_stats es;
    fl_engine_get_stats(L->b->eng, &es);
    pthread_mutex_lock(&L->s->mu);
    const int queued = L->s->n_queued;
    pthread_mutex_unlock(&L->s->mu);
    const fl_serve_engine_state st = {
        .running = es.running,
        .waiting = es.waiting + queued,
        .kv_usage = es.kv_blocks ? (double)es.kv_blocks_used / (double)es.kv_blocks : 0,
        .swap_pool_usage = es.swap_blocks ? (double)es.swap_blocks_used / (double)es.swap_blocks : 0,
        .prefix_hit = es.prompt_tokens ? (double)es.cached_prompt_tokens / (double)es.prompt_tokens : 0,
        .preemptions = es.preemptions,
        .swap_preemptions = es.swap_preemptions,
        .swapped_bytes = es.swap_out_bytes,
    };
    fl_serve_metrics_engine(&L->s->metrics, &st);
}

static fl_status run(loop *L, fl_http_server *http) {
    srv *s = L->s;
    for (;;) {
        const bool work = fl_engine_has_work(L->b->eng);
        pthread_mutex_lock(&s->mu);
        for (;;) {
            if (stop_signal && !s->stopping) {
                s->stopping = true;
                fprintf(stderr, "flotilla serve: signal %d: finishing %d requests, then stopping\n",
                        (int)stop_signal, s->active);
            }
            bool cancel = false;
            for (srv_req *r = L->live; r && !cancel; r = r->next) cancel = r->cancelled;
            if (s->q_head || work || cancel || (s->stopping && !L->live)) break;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 200 * 1000000L; /* signals are noticed within this */
            if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
            pthread_cond_timedwait(&s->work_cv, &s->mu, &ts);
        }
        srv_req *q = s->q_head;
        s->q_head = s->q_tail = NULL;
        s->n_queued = 0;
        const bool stopping = s->stopping;
        pthread_mutex_unlock(&s->mu);
        if (stopping) fl_http_quiesce(http);
        while (q) {
            srv_req *nx = q->next;
            q->next = NULL;
            admit(L, q);
            q = nx;
        }
        /* clients that went away: their sequences end now, blocks freed */
        for (srv_req *r = L->live, *nx; r; r = nx) {
            nx = r->next;
            pthread_mutex_lock(&s->mu);
            const bool gone = r->cancelled;
            pthread_mutex_unlock(&s->mu);
            if (!gone) continue;
            drop_choices(L, r);
            unlink_live(L, r);
            srv_req_release(s, r);
        }
        if (fl_engine_has_work(L->b->eng)) {
            fl_gen **up;
            int nu;
            FL_TRY(fl_engine_step(L->b->eng, &up, &nu));
            for (int i = 0; i < nu; i++) FL_TRY(on_token(L, up[i]->user));
        }
        publish_gauges(L);
        if (stopping && !L->live && !fl_engine_has_work(L->b->eng)) {
            pthread_mutex_lock(&s->mu);
            const bool empty = !s->q_head;
            pthread_mutex_unlock(&s->mu);
            if (empty) return FL_OK;
        }
    }
}

/* After the loop: the streams still being written get a bounded time
 * (fl_http_stop then gives every reply its time to reach the client). */
static void drain(srv *s) {
    for (int i = 0; i < 100; i++) {
        pthread_mutex_lock(&s->mu);
        const int active = s->active;
        pthread_cond_broadcast(&s->out_cv);
        pthread_mutex_unlock(&s->mu);
        if (!active) return;
        usleep(50 * 1000);
    }
}

static const char help_epilogue[] =
    "\nEndpoints (docs/serve.md):\n"
    "  POST /v1/completions, POST /v1/chat/completions (\"stream\": true: server-sent\n"
    "  events), GET /v1/models, GET /health, GET /metrics (Prometheus text).\n"
    "  Request bodies take the fields `flotilla generate` takes in a batch line's\n"
    "  \"body\", plus \"stream\" and \"stream_options\"; errors are OpenAI error objects.\n"
    "\nSignals:\n"
    "  SIGTERM/SIGINT stop accepting requests; those in flight are finished, then\n"
    "  every rank exits 0.\n";

int fl_cmd_serve(int argc, char **argv) {
    fl_cli_model_opts mo = {0};
    const char *host = "127.0.0.1", *port_s = NULL, *api_key = NULL, *name = NULL, *max_body_s = NULL,
               *max_conc_s = NULL, *timeout_s = NULL, *stall_s = NULL, *max_tokens = NULL, *temp = NULL, *seed = NULL, *help = NULL;
    fl_cli_opt opts[FL_CLI_MAX_OPTS] = {
        {"host", true, &host, "address to listen on (default 127.0.0.1)"},
        {"port", true, &port_s, "port to listen on (default 8000; 0 = a free one, printed)"},
        {"api-key", true, &api_key, "require Authorization: Bearer KEY on /v1/ endpoints"},
        {"served-model-name", true, &name, "the model id in /v1/models and responses (default: "
                                           "the model path's basename)"},
        {"max-body-bytes", true, &max_body_s, "largest request body accepted (default 1048576; 413 above)"},
        {"max-concurrent-requests", true, &max_conc_s, "completion requests at once (default 256; "
                                                       "429 above)"},
        {"timeout-keep-alive", true, &timeout_s, "seconds a connection may stay silent (idle between "
                                                 "requests, or stalling mid-request) before it is "
                                                 "closed (default 5); answering time does not count"},
        {"stream-stall-timeout", true, &stall_s, "seconds a streaming client may read nothing while "
                                                 "text waits for it before the stream is dropped and "
                                                 "its sequence stopped (default 60)"},
        {"max-tokens", true, &max_tokens, "completion length when a request gives none (default 256)"},
        {"temperature", true, &temp, "default temperature (default 0 = greedy)"},
        {"seed", true, &seed, "default sampling seed (default 0)"},
        {"help", false, &help, "show this help"},
    };
    int n = 12;
    fl_cli_model_opts_add(&mo, opts, &n);
    fl_status st = fl_cli_parse("serve", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("serve", st);
    if (help) {
        fl_cli_usage(stdout, "serve", "--model PATH [--host ADDR] [--port N]", opts);
        fputs(help_epilogue, stdout);
        return 0;
    }
    if (!mo.model) {
        fprintf(stderr, "flotilla serve: missing --model (see flotilla serve --help)\n");
        return 1;
    }
    srv s;
    memset(&s, 0, sizeof s);
    loop L = {.s = &s, .max_tokens = 256};
    fl_cli_bundle b = {0};
    fl_http_server *http = NULL;
    long port = 8000, max_body = 1 << 20, max_conc = 256, timeout = 5, stall = 60, lv;
    double dv;
    fl_sampling_params_default(&L.defaults);
    if (port_s) FL_TRY_GOTO(fl_cli_int("port", port_s, 0, 65535, &port), st, done);
    if (max_body_s) FL_TRY_GOTO(fl_cli_int("max-body-bytes", max_body_s, 64, 1L << 32, &max_body), st, done);
    if (max_conc_s)
        FL_TRY_GOTO(fl_cli_int("max-concurrent-requests", max_conc_s, 1, 100000, &max_conc), st, done);
    if (timeout_s) FL_TRY_GOTO(fl_cli_int("timeout-keep-alive", timeout_s, 1, 86400, &timeout), st, done);
    if (stall_s) FL_TRY_GOTO(fl_cli_int("stream-stall-timeout", stall_s, 1, 86400, &stall), st, done);
    if (max_tokens) {
        FL_TRY_GOTO(fl_cli_int("max-tokens", max_tokens, 1, 1 << 24, &lv), st, done);
        L.max_tokens = (int)lv;
    }
    if (temp) {
        FL_TRY_GOTO(fl_cli_float("temperature", temp, 0, 100, &dv), st, done);
        L.defaults.temperature = (float)dv;
    }
    if (seed) {
        FL_TRY_GOTO(fl_cli_int("seed", seed, 0, 0x7fffffffffffffffL, &lv), st, done);
        L.defaults.seed = (uint64_t)lv;
    }
    if (api_key && !api_key[0]) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "--api-key is empty");
        goto done;
    }
    if (!name) {
        const char *p = mo.model + strlen(mo.model);
        while (p > mo.model && p[-1] == '/') p--; /* "dir/" names dir */
        const char *e = p;
        while (p > mo.model && p[-1] != '/') p--;
        static char base[256];
        snprintf(base, sizeof base, "%.*s", (int)(e - p), p);
        name = base[0] ? base : mo.model;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART; /* every rank: only rank 0 acts, the others follow */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    FL_TRY_GOTO(fl_cli_bundle_open(&mo, FL_CLI_NEED_TOKENIZER | FL_CLI_NEED_ENGINE, &b), st, done);
    if (!fl_engine_is_leader(b.eng)) {
        st = fl_engine_follow(b.eng);
        goto done;
    }
    L.b = &b;
    L.chat.template_src = fl_ckpt_chat_template(b.ck);
    L.chat.family = fl_chat_template_detect(L.chat.template_src);
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.work_cv, NULL);
    pthread_cond_init(&s.out_cv, NULL);
    fl_serve_metrics_init(&s.metrics);
    s.model_name = name;
    s.api_key = api_key;
    s.max_concurrent = (int)max_conc;
    s.stall_s = (unsigned)stall;
    s.engine_ok = true;
    int bound = 0;
    const fl_http_opts ho = {.host = host, .port = (int)port, .max_body_bytes = (size_t)max_body,
                             .max_connections = (int)max_conc + 64, .timeout_s = (unsigned)timeout,
                             .stall_s = (unsigned)stall};
    st = fl_http_start(&ho, srv_api_handle, &s, &http, &bound);
    if (st == FL_OK) {
        fprintf(stderr, "flotilla serve: listening on http://%s:%d (model %s)\n", host, bound, name);
        st = run(&L, http);
    }
    pthread_mutex_lock(&s.mu);
    s.engine_ok = false;
    s.stopping = true;
    pthread_mutex_unlock(&s.mu);
    if (st != FL_OK) { /* the engine failed: answer everyone waiting */
        pthread_mutex_lock(&s.mu);
        for (srv_req *r = L.live; r; r = r->next) fail_locked(r, 500, fl_error_msg(), NULL);
        pthread_mutex_unlock(&s.mu);
    }
    drain(&s);
    fl_http_stop(http, 5000);
    if (st == FL_OK) st = fl_engine_release_followers(b.eng);
    fl_serve_metrics_free(&s.metrics);
    if (st == FL_OK) fprintf(stderr, "flotilla serve: stopped\n");
done:
    return fl_cli_finish("serve", &b, st);
}
