/*
 * http_server.h — the HTTP listener of `flotilla serve` (libmicrohttpd).
 *
 * One thread per connection: the library parses the request, this module
 * gathers the body (refusing one over max_body_bytes with 413) and calls
 * the handler in the connection's thread, which may block until its answer
 * is ready. A reply is either a whole body or a stream: next() is called
 * (in the connection's thread, and may block) for each piece until it
 * returns false; close() is called once when the connection is done with
 * the stream, whether it ended or the client went away.
 *
 * A stream whose client stops reading is dropped: once a piece is handed to
 * the library, the client must take some of it within stall_s seconds (the
 * time next() waits for the engine does not count). The stream's socket
 * send buffer is kept small, so that "stopped reading" shows after tens of
 * kilobytes rather than the megabytes a loopback or LAN socket would queue.
 */
#ifndef FL_HTTP_SERVER_H
#define FL_HTTP_SERVER_H

#include <stdbool.h>
#include <stddef.h>

#include "core/status.h"

typedef struct fl_http_reply {
    int status;
    const char *content_type;     /* static string */
    char *body;                   /* malloc'd, taken by the server */
    size_t len;
    const char *allow;            /* 405: the Allow header, or NULL */
    bool authenticate;            /* 401: WWW-Authenticate: Bearer */
    /* streaming instead of body (status 200): next() gives a malloc'd piece
     * (taken) or returns false at the end */
    bool (*next)(void *sctx, char **piece, size_t *len);
    /* stalled: dropped because the client took nothing for stall_s seconds */
    void (*close)(void *sctx, bool stalled);
    void *sctx;
} fl_http_reply;

typedef struct fl_http_request {
    const char *method, *url;
    const char *authorization;    /* the Authorization header, or NULL */
    const char *body;             /* NUL-terminated copy, len bytes */
    size_t len;
    int fd;                       /* the connection's socket (fl_http_client_gone), or -1 */
} fl_http_request;

/* True when the client of rq has closed its side of the connection (or it
 * failed): a handler that waits long polls this to stop work nobody will
 * read. Data the client sent ahead (a pipelined request) is not taken. */
bool fl_http_client_gone(const fl_http_request *rq);

typedef void (*fl_http_handler)(void *ctx, const fl_http_request *rq, fl_http_reply *reply);

typedef struct fl_http_server fl_http_server;

typedef struct fl_http_opts {
    const char *host;             /* an IPv4 address or name */
    int port;                     /* 0: a free one */
    size_t max_body_bytes;        /* 413 above */
    int max_connections;
    /* a connection with no traffic for timeout_s is closed (an idle
     * keep-alive one, or a client stalling mid-request); the time a
     * handler or a stream takes to answer does not count */
    unsigned timeout_s;
    unsigned stall_s;             /* a stream's client taking nothing for this long is dropped */
} fl_http_opts;

/* Listens on o->host:o->port (*bound_port says which port). The caller's
 * signal mask is restored after the server's threads are made with
 * SIGTERM, SIGINT and SIGPIPE blocked, so signals reach the caller. */
fl_status fl_http_start(const fl_http_opts *o, fl_http_handler handler, void *ctx, fl_http_server **out,
                        int *bound_port);
/* Stops accepting connections; the open ones carry on. */
void fl_http_quiesce(fl_http_server *s);
/* Stops accepting connections, waits up to grace_ms for the requests being
 * answered to finish (their replies sent whole), then closes every
 * connection and joins the threads; NULL is a no-op. */
void fl_http_stop(fl_http_server *s, unsigned grace_ms);

#endif /* FL_HTTP_SERVER_H */
