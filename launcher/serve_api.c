/*
 * serve_api.c — the HTTP side of `flotilla serve`: routing, the API key,
 * OpenAI error objects, and answering a completion whole or as server-sent
 * events. Runs in libmicrohttpd's connection threads; the engine thread
 * (cmd_serve.c) does the work (serve.h says who owns what).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "launcher/serve.h"

static const char json_type[] = "application/json";

/* How often a handler waiting for its answer checks that the client is
 * still there. */
enum { GONE_POLL_MS = 100 };

/* An OpenAI error object as the reply. */
static void reply_error(fl_http_reply *r, int status, const char *msg, const char *param) {
    fl_result res = {.error_message = msg, .error_param = param, .error_status = status};
    r->status = status;
    r->content_type = json_type;
    if (fl_result_body_format(&res, &r->body, &r->len) != FL_OK) {
        r->status = 500;
        r->body = NULL;
        r->len = 0;
    }
}

static void reply_json(fl_http_reply *r, cJSON *o) {
    r->body = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (!r->body) {
        reply_error(r, 500, "out of memory", NULL);
        return;
    }
    r->status = 200;
    r->content_type = json_type;
    r->len = strlen(r->body);
}

/* "Bearer KEY" against the key, in time independent of where they differ. */
static bool authorized(const srv *s, const char *header) {
    if (!s->api_key) return true;
    if (!header || strncmp(header, "Bearer ", 7) != 0) return false;
    const char *got = header + 7, *want = s->api_key;
    size_t lg = strlen(got), lw = strlen(want);
    unsigned diff = (unsigned)(lg != lw);
    for (size_t i = 0; i < lw; i++) diff |= (unsigned char)want[i] ^ (unsigned char)(i < lg ? got[i] : 0);
    return diff == 0;
}

void srv_req_release(srv *s, srv_req *r) {
    pthread_mutex_lock(&s->mu);
    bool last = --r->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (!last) return;
    for (int c = 0; r->ch && c < r->rq.n; c++) {
        for (size_t i = 0; i < r->ch[c].n_pieces; i++) {
            fl_prep_lp_free(&r->ch[c].pieces[i].view);
            free(r->ch[c].pieces[i].lp);
        }
        free(r->ch[c].pieces);
        free(r->ch[c].text);
        free(r->ch[c].ids);
        free(r->ch[c].lp);
    }
    free(r->ch);
    free(r->body);
    free(r->error);
    fl_request_free(&r->rq);
    free(r);
}

/* The field a parse message names ("body.n must be ..." -> "n"). */
static void param_of(const char *msg, char *out, size_t n) {
    const char *p = strstr(msg, "body.");
    out[0] = 0;
    if (!p) return;
    p += 5;
    size_t k = 0;
    while (p[k] && k + 1 < n && (p[k] == '_' || (p[k] >= 'a' && p[k] <= 'z'))) k++;
    memcpy(out, p, k);
    out[k] = 0;
}

/* ---- streaming ------------------------------------------------------------------ */

static fl_result chunk_base(const srv *s, const srv_req *r) {
    return (fl_result){.endpoint = r->rq.endpoint, .custom_id = r->custom_id,
                       .model = r->rq.model ? r->rq.model : s->model_name, .created = r->created,
                       .prompt_tokens = r->prompt_tokens};
}

typedef struct stream_ctx {
    srv *s;
    srv_req *r;
} stream_ctx;

/* Appends "data: JSON\n\n" for one chunk to the piece. */
static bool add_event(char **piece, size_t *len, const fl_result *base, const fl_result_chunk *ch) {
    char *j = NULL;
    size_t jl = 0;
    if (fl_result_chunk_format(base, ch, &j, &jl) != FL_OK) return false;
    char *np = realloc(*piece, *len + jl + 9);
    if (!np) {
        free(j);
        return false;
    }
    memcpy(np + *len, "data: ", 6);
    memcpy(np + *len + 6, j, jl);
    memcpy(np + *len + 6 + jl, "\n\n", 3);
    *piece = np;
    *len += jl + 8;
    free(j);
    return true;
}

/* Everything new since the last call, as events; blocks until there is some. */
static bool stream_next(void *sctx, char **piece, size_t *len) {
    stream_ctx *x = sctx;
    srv *s = x->s;
    srv_req *r = x->r;
    *piece = NULL;
    *len = 0;
    bool ok = true;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        const fl_result base = chunk_base(s, r);
        if (r->stage == 2) {
            ok = false;
            break;
        }
        bool all_fin = true;
        for (int c = 0; c < r->rq.n; c++) {
            srv_choice *ch = &r->ch[c];
            if (ch->len > ch->sent || (ch->finish && !ch->finish_sent) ||
                ch->n_pieces > ch->pieces_sent) {
                fl_result_chunk k = {.index = c, .text = ch->text + ch->sent, .len = ch->len - ch->sent,
                                     .first = !ch->first_sent, .finish_reason = ch->finish,
                                     .text_offset = ch->lp_off};
                /* the logprobs of the tokens published since the last chunk */
                fl_result_token *toks = NULL;
                if (r->rq.logprobs) {
                    size_t nt = 0;
                    for (size_t i = ch->pieces_sent; i < ch->n_pieces; i++) nt += ch->pieces[i].n;
                    toks = malloc((nt ? nt : 1) * sizeof *toks);
                    if (!toks) goto oom;
                    nt = 0;
                    for (size_t i = ch->pieces_sent; i < ch->n_pieces; i++)
                        for (size_t t = 0; t < ch->pieces[i].n; t++) {
                            toks[nt] = ch->pieces[i].view.toks[t];
                            ch->lp_off += toks[nt++].len;
                        }
                    k.tokens = toks;
                    k.n_tokens = nt;
                    ch->pieces_sent = ch->n_pieces;
                }
                const bool added = add_event(piece, len, &base, &k);
                free(toks);
                if (!added) goto oom;
                ch->sent = ch->len;
                ch->first_sent = true;
                if (ch->finish) ch->finish_sent = true;
            }
            all_fin = all_fin && ch->finish_sent;
        }
        if (r->done && r->error && *len == 0) { /* failed after the stream began */
            fl_result e = {.error_message = r->error, .error_status = 500};
            char *j = NULL;
            size_t jl = 0;
            if (fl_result_body_format(&e, &j, &jl) != FL_OK) goto oom;
            *piece = malloc(jl + 32);
            if (!*piece) {
                free(j);
                goto oom;
            }
            *len = (size_t)sprintf(*piece, "data: %s\n\ndata: [DONE]\n\n", j);
            free(j);
            r->stage = 2;
            break;
        }
        if (all_fin && r->done && *len == 0) {
            if (r->stage == 0 && r->rq.stream_include_usage) {
                long total = 0;
                for (int c = 0; c < r->rq.n; c++) total += r->ch[c].n_tokens;
                fl_result_chunk k = {.usage = true, .completion_tokens = total};
                if (!add_event(piece, len, &base, &k)) goto oom;
                r->stage = 1;
                break;
            }
            *piece = strdup("data: [DONE]\n\n");
            if (!*piece) goto oom;
            *len = strlen(*piece);
            r->stage = 2;
            break;
        }
        if (*len) break;
        pthread_cond_wait(&s->out_cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
oom:
    pthread_mutex_unlock(&s->mu);
    free(*piece);
    *piece = NULL;
    return false;
}

static void stream_close(void *sctx, bool stalled) {
    stream_ctx *x = sctx;
    srv *s = x->s;
    pthread_mutex_lock(&s->mu);
    const bool whole = x->r->stage == 2 && !stalled;
    if (!x->r->done) x->r->cancelled = true; /* the engine thread drops it at the next step */
    s->active--;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    if (stalled) {
        fprintf(stderr, "flotilla serve: %s: the client read nothing for %u s "
                "(--stream-stall-timeout): stream dropped\n", x->r->custom_id, s->stall_s);
        fl_serve_metrics_stall(&s->metrics);
    }
    fl_serve_metrics_request(&s->metrics, whole ? 200 : 499);
    srv_req_release(s, x->r);
    free(x);
}

/* ---- completions ------------------------------------------------------------------ */

static void completion(srv *s, const fl_http_request *h, fl_request_endpoint ep, fl_http_reply *reply) {
    srv_req *r = calloc(1, sizeof *r);
    if (!r) {
        reply_error(reply, 500, "out of memory", NULL);
        return;
    }
    if (fl_request_parse_body(h->body, h->len, ep, &r->rq) != FL_OK) {
        char param[64];
        param_of(fl_error_msg(), param, sizeof param);
        reply_error(reply, 400, fl_error_msg(), r->rq.param[0] ? r->rq.param : param[0] ? param : NULL);
        fl_serve_metrics_request(&s->metrics, 400);
        fl_request_free(&r->rq);
        free(r);
        return;
    }
    r->ch = calloc((size_t)r->rq.n, sizeof *r->ch);
    int refuse = 0;
    pthread_mutex_lock(&s->mu);
    if (!r->ch) refuse = 500;
    else if (s->stopping) refuse = 503;
    else if (s->active >= s->max_concurrent) refuse = 429;
    if (!refuse) {
        s->active++;
        snprintf(r->custom_id, sizeof r->custom_id, "serve-%ld-%ld-%lu", (long)getpid(),
                 (long)time(NULL), s->next_id++);
        r->created = (long)time(NULL);
        r->t_arrive = fl_engine_now();
        r->refs = 2;
        for (int c = 0; c < r->rq.n; c++) r->ch[c].req = r, r->ch[c].index = c;
        if (s->q_tail) s->q_tail->next = r; else s->q_head = r;
        s->q_tail = r;
        s->n_queued++;
        pthread_cond_signal(&s->work_cv);
    }
    pthread_mutex_unlock(&s->mu);
    if (refuse) {
        reply_error(reply, refuse, refuse == 503 ? "the server is shutting down"
                    : refuse == 429 ? "too many concurrent requests (--max-concurrent-requests)"
                                    : "out of memory", NULL);
        fl_serve_metrics_request(&s->metrics, refuse);
        free(r->ch);
        fl_request_free(&r->rq);
        free(r);
        return;
    }
    pthread_mutex_lock(&s->mu);
    /* a stream starts once the engine took the request, so a request it
     * refuses (prompt too long, ...) still gets its error status; until
     * then the client is watched, so one that leaves frees its sequences */
    while (!r->done && !(r->rq.stream && r->admitted)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += GONE_POLL_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&s->out_cv, &s->mu, &ts);
        if (r->done || !fl_http_client_gone(h)) continue;
        r->cancelled = true; /* the engine thread drops it at the next step */
        s->active--;
        pthread_cond_signal(&s->work_cv);
        pthread_mutex_unlock(&s->mu);
        fl_serve_metrics_request(&s->metrics, 499);
        srv_req_release(s, r);
        reply_error(reply, 499, "the client closed the connection", NULL);
        return;
    }
    if (r->rq.stream && !r->done) {
        pthread_mutex_unlock(&s->mu);
        stream_ctx *x = malloc(sizeof *x);
        if (!x) {
            pthread_mutex_lock(&s->mu);
            r->cancelled = true;
            s->active--;
            pthread_mutex_unlock(&s->mu);
            srv_req_release(s, r);
            reply_error(reply, 500, "out of memory", NULL);
            return;
        }
        *x = (stream_ctx){s, r};
        *reply = (fl_http_reply){.status = 200, .content_type = "text/event-stream",
                                 .next = stream_next, .close = stream_close, .sctx = x};
        return;
    }
    if (r->rq.stream && r->status == 200) { /* finished before it started: stream it all the same */
        pthread_mutex_unlock(&s->mu);
        stream_ctx *x = malloc(sizeof *x);
        if (x) {
            *x = (stream_ctx){s, r};
            *reply = (fl_http_reply){.status = 200, .content_type = "text/event-stream",
                                     .next = stream_next, .close = stream_close, .sctx = x};
            return;
        }
        pthread_mutex_lock(&s->mu);
    }
    s->active--;
    const int status = r->status;
    if (status == 200) {
        reply->status = 200;
        reply->content_type = json_type;
        reply->body = r->body;
        reply->len = r->body ? strlen(r->body) : 0;
        r->body = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    if (status != 200) reply_error(reply, status, r->error ? r->error : "failed", r->param[0] ? r->param : NULL);
    fl_serve_metrics_request(&s->metrics, status);
    srv_req_release(s, r);
}

/* ---- the other endpoints ------------------------------------------------------------ */

static void models(srv *s, fl_http_reply *reply) {
    cJSON *o = cJSON_CreateObject(), *m = cJSON_CreateObject();
    cJSON *data = o ? cJSON_AddArrayToObject(o, "data") : NULL;
    bool ok = o && m && data && cJSON_AddStringToObject(o, "object", "list") &&
              cJSON_AddStringToObject(m, "id", s->model_name) &&
              cJSON_AddStringToObject(m, "object", "model") &&
              cJSON_AddNumberToObject(m, "created", (double)time(NULL)) &&
              cJSON_AddStringToObject(m, "owned_by", "flotilla") && cJSON_AddItemToArray(data, m);
    if (!ok) {
        cJSON_Delete(m);
        cJSON_Delete(o);
        o = NULL;
    }
    reply_json(reply, o);
}

void srv_api_handle(void *ctx, const fl_http_request *h, fl_http_reply *reply) {
    srv *s = ctx;
    const bool get = !strcmp(h->method, "GET"), post = !strcmp(h->method, "POST");
    const char *url = h->url;
    struct { const char *path; bool post; bool auth; } routes[] = {
        {"/v1/completions", true, true}, {"/v1/chat/completions", true, true},
        {"/v1/models", false, true}, {"/health", false, false}, {"/metrics", false, false},
    };
    int k = -1;
    for (int i = 0; i < 5; i++)
        if (!strcmp(url, routes[i].path)) k = i;
    if (k < 0) {
        char msg[300];
        snprintf(msg, sizeof msg, "no such endpoint: %.200s", url);
        reply_error(reply, 404, msg, NULL);
        return;
    }
    if (routes[k].post ? !post : !get) {
        char msg[300];
        snprintf(msg, sizeof msg, "%s takes %s, not %.20s", url, routes[k].post ? "POST" : "GET",
                 h->method);
        reply_error(reply, 405, msg, NULL);
        reply->allow = routes[k].post ? "POST" : "GET";
        return;
    }
    if (routes[k].auth && !authorized(s, h->authorization)) {
        reply_error(reply, 401, "invalid or missing API key (Authorization: Bearer KEY)", NULL);
        reply->authenticate = true;
        return;
    }
    switch (k) {
    case 0: completion(s, h, FL_REQUEST_COMPLETIONS, reply); return;
    case 1: completion(s, h, FL_REQUEST_CHAT, reply); return;
    case 2: models(s, reply); return;
    case 3: {
        pthread_mutex_lock(&s->mu);
        const bool up = s->engine_ok && !s->stopping;
        pthread_mutex_unlock(&s->mu);
        if (!up) {
            reply_error(reply, 503, "the engine is not running", NULL);
            return;
        }
        reply->status = 200;
        reply->content_type = "text/plain";
        reply->body = strdup("ok\n");
        reply->len = reply->body ? 3 : 0;
        return;
    }
    default:
        if (fl_serve_metrics_render(&s->metrics, &reply->body, &reply->len) != FL_OK) {
            reply_error(reply, 500, fl_error_msg(), NULL);
            return;
        }
        reply->status = 200;
        reply->content_type = "text/plain; version=0.0.4; charset=utf-8";
    }
}
