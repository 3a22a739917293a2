/*
 * serve.h — what the two sides of `flotilla serve` share: the HTTP threads
 * (serve_api.c) turn requests into srv_req objects and queue them; rank 0's
 * engine thread (cmd_serve.c) admits them between steps, publishes each
 * choice's text after every step and wakes the HTTP threads.
 *
 * Locking: srv.mu guards the queue, every srv_req field marked (mu), and
 * the counters; srv.work_cv wakes the engine thread, srv.out_cv the HTTP
 * threads. A request has two references (HTTP side, engine side) and is
 * freed by whichever lets go last.
 */
#ifndef FL_SERVE_H
#define FL_SERVE_H

#include <pthread.h>
#include <stdbool.h>

#include "launcher/cli.h"
#include "launcher/http_server.h"
#include "launcher/request_prep.h"
#include "launcher/serve_metrics.h"

typedef struct srv_req srv_req;

/* Logprobs published for a stream: the tokens of one publication, decoded. */
typedef struct srv_lp_piece {
    fl_token_logprob *lp;    /* [n] copies: the view points into them */
    fl_prep_lp view;
    size_t n;
} srv_lp_piece;

typedef struct srv_choice {
    fl_gen gen;              /* engine thread; gen.user points here */
    srv_req *req;
    int index;
    bool in_engine;          /* engine thread: added and not yet finished */
    size_t text_checked;     /* engine thread: decoded bytes already searched for stops */
    char *text;              /* (mu) the text published so far: all of it once finished */
    size_t len;
    long n_tokens;           /* (mu) completion tokens, once finished */
    const char *finish;      /* (mu) "stop" / "length" once finished, else NULL */
    int32_t *ids;            /* engine thread: generated ids (logprobs), once finished */
    fl_token_logprob *lp;
    size_t lp_pub;           /* engine thread (streaming): tokens whose logprobs are published */
    srv_lp_piece *pieces;    /* (mu) streaming with logprobs: published, in order */
    size_t n_pieces;
    size_t pieces_sent;      /* HTTP thread (streaming): pieces sent */
    size_t lp_off;           /* HTTP thread (streaming): text bytes of the tokens sent */
    size_t sent;             /* HTTP thread (streaming): bytes of text sent */
    bool first_sent, finish_sent;
} srv_choice;

struct srv_req {
    fl_request rq;           /* parsed by the HTTP thread; read-only once queued */
    char custom_id[64];      /* unique per request: the response ids derive from it */
    long created;
    double t_arrive;         /* fl_engine_now() */
    int refs;                /* (mu) */
    bool cancelled;          /* (mu) the client went away */
    bool admitted;           /* (mu) in the engine: a stream may start */
    bool done;               /* (mu) every choice finished, or the request failed */
    int status;              /* (mu) once done: 200 or the error's status */
    char *body;              /* (mu) once done, not streaming: the response JSON */
    char *error;             /* (mu) once failed: message */
    char param[64];
    long prompt_tokens;      /* (mu) set on admission */
    int pending;             /* engine thread: choices still running */
    double t_first;          /* engine thread: first token of any choice, 0 = none */
    srv_choice *ch;          /* [rq.n] */
    srv_req *next;           /* (mu) the queue; engine thread: the live list */
    int stage;               /* HTTP thread (streaming): 0 chunks, 1 usage sent, 2 [DONE] sent */
};

typedef struct srv {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, out_cv;
    srv_req *q_head, *q_tail;  /* (mu) received, not yet admitted */
    int n_queued;              /* (mu) */
    int active;                /* (mu) completion requests being answered */
    bool stopping;             /* (mu) a signal came: new requests get 503 */
    bool engine_ok;            /* (mu) the engine loop runs */
    unsigned long next_id;     /* (mu) */
    /* fixed after start */
    const char *model_name, *api_key;
    int max_concurrent;
    unsigned stall_s;          /* --stream-stall-timeout */
    fl_serve_metrics metrics;
} srv;

/* HTTP side (serve_api.c): the handler fl_http_start calls. */
void srv_api_handle(void *ctx, const fl_http_request *rq, fl_http_reply *reply);
/* Drops one reference; the last frees the request. Takes srv.mu itself. */
void srv_req_release(srv *s, srv_req *r);

#endif /* FL_SERVE_H */
