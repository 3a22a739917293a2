/*
 * http_server.c — libmicrohttpd glue for `flotilla serve` (contract in
 * http_server.h). Thread per connection, so a handler or a stream may block
 * on the engine without stalling other clients.
 */
#define _GNU_SOURCE /* POLLRDHUP: the peer closed its side */
#include "launcher/http_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

/* A stream's socket send buffer (the kernel doubles it): a stalled
 * client is noticed after about this much unread text. */
enum { STREAM_SNDBUF = 64 << 10 };

struct fl_http_server {
    struct MHD_Daemon *d;
    fl_http_handler handler;
    void *ctx;
    size_t max_body;
    unsigned timeout_s, stall_s;
    bool quiesced;
    /* requests between their headers and the last byte of their reply:
     * a handler returning its body is not yet the client reading it */
    atomic_int busy;
};

typedef struct stream stream;

/* One request's upload, gathered across the access handler's calls. */
typedef struct upload {
    char *buf;
    size_t len, cap;
    bool too_big;
    stream *st;       /* the reply's stream, while both live */
} upload;

/* A stream being sent: the piece next() gave and how much of it went out.
 * The connection's thread alone touches it. */
struct stream {
    fl_http_reply r;
    struct MHD_Connection *c;
    unsigned timeout_s, stall_s;
    upload *u;        /* the request's upload, while both live */
    bool stalled;     /* the library closed the connection on the stall timeout */
    char *piece;
    size_t len, off;
};

/* The library calls this once the last piece went out to the socket: the
 * stall clock runs only while a piece waits for the client. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream *s = cls;
    while (s->off == s->len) {
        free(s->piece);
        s->piece = NULL;
        s->len = s->off = 0;
        /* waiting for the engine is not the client's stall */
        MHD_set_connection_option(s->c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
        if (!s->r.next(s->r.sctx, &s->piece, &s->len)) {
            /* answered: the connection idles under the timeout again */
            MHD_set_connection_option(s->c, MHD_CONNECTION_OPTION_TIMEOUT, s->timeout_s);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        /* from 0, the library restarts the clock: the client has stall_s */
        MHD_set_connection_option(s->c, MHD_CONNECTION_OPTION_TIMEOUT, s->stall_s);
    }
    size_t k = s->len - s->off < max ? s->len - s->off : max;
    memcpy(buf, s->piece + s->off, k);
    s->off += k;
    return (ssize_t)k;
}

static void stream_free(void *cls) {
    stream *s = cls;
    if (s->u) s->u->st = NULL;
    s->r.close(s->r.sctx, s->stalled);
    free(s->piece);
    free(s);
}

/* u: the request's upload (a stream links to it), or NULL. */
static enum MHD_Result send_reply(struct MHD_Connection *c, fl_http_reply *r, const fl_http_server *srv,
                                  upload *u) {
    struct MHD_Response *resp;
    stream *st = NULL;
    if (r->next) {
        stream *s = calloc(1, sizeof *s);
        if (!s) {
            r->close(r->sctx, false);
            return MHD_NO;
        }
        s->r = *r;
        s->c = c;
        s->timeout_s = srv->timeout_s;
        s->stall_s = srv->stall_s;
        st = s;
        resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, s, stream_free);
        if (!resp) {
            stream_free(s);
            return MHD_NO;
        }
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        if (u) {
            s->u = u;
            u->st = s;
        }
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        const int sndbuf = STREAM_SNDBUF;
        if (ci) (void)setsockopt(ci->connect_fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    } else {
        resp = MHD_create_response_from_buffer(r->len, r->body ? r->body : (char *)"",
                                               r->body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
        if (!resp) {
            free(r->body);
            return MHD_NO;
        }
    }
    if (r->content_type) MHD_add_response_header(resp, "Content-Type", r->content_type);
    if (r->allow) MHD_add_response_header(resp, "Allow", r->allow);
    if (r->authenticate) MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    /* the headers are the first piece the client must take (the handler
     * ran with the timeout off, so the clock starts now) */
    if (st && ret == MHD_YES) MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, srv->stall_s);
    return ret;
}

static enum MHD_Result too_big(struct MHD_Connection *c, const fl_http_server *s) {
    const size_t max = s->max_body;
    fl_http_reply r = {.status = 413, .content_type = "application/json"};
    char msg[256];
    int n = snprintf(msg, sizeof msg, "{\"error\": {\"message\": \"the request body is larger than "
                     "--max-body-bytes (%zu bytes)\", \"type\": \"invalid_request_error\", "
                     "\"param\": null, \"code\": null}}", max);
    r.body = strdup(msg);
    r.len = r.body ? (size_t)n : 0;
    return send_reply(c, &r, s, NULL);
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *c, const char *url,
                                 const char *method, const char *version, const char *data,
                                 size_t *data_size, void **con_cls) {
    (void)version;
    fl_http_server *s = cls;
    upload *u = *con_cls;
    if (!u) { /* headers are in: refuse an announced oversize body at once */
        u = calloc(1, sizeof *u);
        if (!u) return MHD_NO;
        *con_cls = u;
        atomic_fetch_add(&s->busy, 1); /* on_completed takes it back */
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > s->max_body) u->too_big = true;
        return MHD_YES;
    }
    if (*data_size) { /* a piece of the body */
        if (!u->too_big && u->len + *data_size > s->max_body) u->too_big = true;
        if (!u->too_big) {
            if (u->len + *data_size + 1 > u->cap) {
                size_t cap = (u->len + *data_size + 1) * 2;
                if (cap > s->max_body + 1) cap = s->max_body + 1;
                char *nb = realloc(u->buf, cap);
                if (!nb) return MHD_NO;
                u->buf = nb;
                u->cap = cap;
            }
            memcpy(u->buf + u->len, data, *data_size);
            u->len += *data_size;
        }
        *data_size = 0;
        return MHD_YES;
    }
    if (u->too_big) return too_big(c, s);
    fl_http_request rq = {.method = method, .url = url, .body = u->buf ? u->buf : "", .len = u->len,
                          .authorization = MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                                                       "Authorization")};
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    rq.fd = ci ? (int)ci->connect_fd : -1;
    if (u->buf) u->buf[u->len] = 0;
    fl_http_reply r = {0};
    /* the time to answer is the engine's, not the client's idling: the
     * handler watches the client itself (fl_http_client_gone) */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    s->handler(s->ctx, &rq, &r);
    const bool streamed = r.next != NULL;
    const enum MHD_Result ret = send_reply(c, &r, s, u);
    if (!streamed) MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, s->timeout_s);
    return ret;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)c;
    fl_http_server *s = cls;
    upload *u = *con_cls;
    if (u) atomic_fetch_sub(&s->busy, 1);
    if (u && u->st) { /* the library calls this before it frees the reply */
        u->st->stalled = toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED;
        u->st->u = NULL;
    }
    if (u) free(u->buf);
    free(u);
    *con_cls = NULL;
}

bool fl_http_client_gone(const fl_http_request *rq) {
    if (!rq || rq->fd < 0) return false;
    struct pollfd p = {.fd = rq->fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLERR | POLLHUP | POLLNVAL | POLLRDHUP)) return true;
    /* readable: end of file, or bytes sent ahead that stay for the library */
    char b;
    const ssize_t k = recv(rq->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

fl_status fl_http_start(const fl_http_opts *o, fl_http_handler handler, void *ctx, fl_http_server **out,
                        int *bound_port) {
    const char *host = o->host;
    const int port = o->port;
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int gai = getaddrinfo(host, NULL, &hints, &ai);
    if (gai != 0 || !ai)
        return FL_ERR(FL_ERR_INVALID_ARG, "--host %s: cannot resolve it to an IPv4 address (%s)", host,
                      gai ? gai_strerror(gai) : "no address");
    struct sockaddr_in sa;
    memcpy(&sa, ai->ai_addr, sizeof sa);
    freeaddrinfo(ai);
    sa.sin_port = htons((uint16_t)port);
    fl_http_server *s = calloc(1, sizeof *s);
    if (!s) return FL_ERR(FL_ERR_OOM, "out of memory");
    s->handler = handler;
    s->ctx = ctx;
    s->max_body = o->max_body_bytes;
    s->timeout_s = o->timeout_s;
    s->stall_s = o->stall_s;
    atomic_init(&s->busy, 0);
    /* the server's threads inherit this mask: signals go to the engine thread */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    s->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                                MHD_USE_ITC,
                            0, NULL, NULL, on_access, s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)o->max_connections,
                            MHD_OPTION_CONNECTION_TIMEOUT, o->timeout_s, MHD_OPTION_END);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!s->d) {
        free(s);
        return FL_ERR(FL_ERR_IO, "cannot listen on %s:%d (port in use, or no such address?)", host,
                      port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    *bound_port = di ? (int)di->port : port;
    *out = s;
    return FL_OK;
}

void fl_http_quiesce(fl_http_server *s) {
    if (!s || s->quiesced) return;
    MHD_socket fd = MHD_quiesce_daemon(s->d);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    s->quiesced = true;
}

void fl_http_stop(fl_http_server *s, unsigned grace_ms) {
    if (!s) return;
    fl_http_quiesce(s);
    for (unsigned waited = 0; atomic_load(&s->busy) > 0 && waited < grace_ms; waited += 10)
        nanosleep(&(struct timespec){.tv_nsec = 10 * 1000000L}, NULL);
    MHD_stop_daemon(s->d);
    free(s);
}
