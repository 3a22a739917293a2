/*
 * test_http_server.c — stopping `flotilla serve`'s HTTP listener
 * (launcher/http_server.h): a reply the handler has returned reaches its
 * client whole even when the stop comes right after, an idle keep-alive
 * connection does not hold the stop up, and a client stalling mid-request
 * holds it no longer than the grace.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "launcher/http_server.h"

enum { BIG = 8 << 20 }; /* many socket buffers: the send outlasts the stop */

static atomic_int g_answered;

static void handler(void *ctx, const fl_http_request *rq, fl_http_reply *r) {
    (void)ctx;
    const bool big = strcmp(rq->url, "/big") == 0;
    r->len = big ? BIG : 2;
    r->body = malloc(r->len);
    assert_non_null(r->body);
    memset(r->body, 'x', r->len);
    r->status = 200;
    r->content_type = "text/plain";
    atomic_fetch_add(&g_answered, 1);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void sleep_ms(long ms) { nanosleep(&(struct timespec){.tv_sec = ms / 1000, .tv_nsec = ms % 1000 * 1000000L}, NULL); }

static fl_http_server *start(int *port) {
    const fl_http_opts o = {.host = "127.0.0.1", .port = 0, .max_body_bytes = 1 << 20, .max_connections = 16,
                            .timeout_s = 30, .stall_s = 30};
    fl_http_server *s = NULL;
    assert_int_equal(fl_http_start(&o, handler, NULL, &s, port), FL_OK);
    atomic_store(&g_answered, 0);
    return s;
}

static int dial(int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static void send_all(int fd, const char *s) {
    for (size_t off = 0, n = strlen(s); off < n;) {
        const ssize_t k = send(fd, s + off, n - off, MSG_NOSIGNAL);
        assert_true(k > 0);
        off += (size_t)k;
    }
}

/* Reads one reply: its body's length as received, or -1 when the
 * connection ended before the headers did. */
static long read_reply(int fd) {
    static char buf[1 << 16];
    size_t have = 0;
    char *end = NULL;
    while (!end) {
        const ssize_t k = recv(fd, buf + have, sizeof buf - 1 - have, 0);
        if (k <= 0) return -1;
        have += (size_t)k;
        buf[have] = 0;
        end = strstr(buf, "\r\n\r\n");
    }
    const char *cl = strstr(buf, "Content-Length: ");
    const long want = cl ? strtol(cl + 16, NULL, 10) : 0;
    long got = (long)(have - (size_t)(end + 4 - buf));
    while (got < want) {
        const ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k <= 0) break;
        got += k;
    }
    return got;
}

typedef struct {
    int port;
    long got;
} client;

static void *big_client(void *arg) {
    client *c = arg;
    const int fd = dial(c->port);
    send_all(fd, "GET /big HTTP/1.1\r\nHost: t\r\n\r\n");
    c->got = read_reply(fd);
    close(fd);
    return NULL;
}

/* The stop comes the moment the handler has returned its body. */
static void test_reply_outlives_stop(void **state) {
    (void)state;
    for (int round = 0; round < 3; round++) {
        int port = 0;
        fl_http_server *s = start(&port);
        client c = {.port = port};
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, big_client, &c), 0);
        while (!atomic_load(&g_answered)) sleep_ms(1);
        fl_http_stop(s, 10000);
        pthread_join(t, NULL);
        assert_int_equal(c.got, BIG);
    }
}

static void test_idle_connection_does_not_hold_stop(void **state) {
    (void)state;
    int port = 0;
    fl_http_server *s = start(&port);
    const int fd = dial(port);
    send_all(fd, "GET /small HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(read_reply(fd), 2);
    const double t0 = now_s();
    fl_http_stop(s, 10000); /* the connection stays open, idle */
    assert_true(now_s() - t0 < 3.0);
    close(fd);
}

static void test_stalled_upload_holds_stop_at_most_the_grace(void **state) {
    (void)state;
    int port = 0;
    fl_http_server *s = start(&port);
    const int fd = dial(port);
    send_all(fd, "POST /small HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"half\":");
    sleep_ms(1000); /* the server has the headers */
    const double t0 = now_s();
    fl_http_stop(s, 500);
    const double took = now_s() - t0;
    assert_true(took >= 0.4);
    assert_true(took < 4.0);
    assert_int_equal(atomic_load(&g_answered), 0);
    char b;
    assert_true(recv(fd, &b, 1, 0) <= 0); /* closed */
    close(fd);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reply_outlives_stop),
        cmocka_unit_test(test_idle_connection_does_not_hold_stop),
        cmocka_unit_test(test_stalled_upload_holds_stop_at_most_the_grace),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
