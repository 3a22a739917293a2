/*
 * test_batch_state.c — the pure half of resuming a batch job
 * (runtime/engine/batch_state.h) on fmemopen buffers: the bounded line
 * reader (a line over the bound is an error naming the line, and memory
 * stays at the bound), the scan of a results stream (valid records, a torn
 * last line, a foreign line in the middle, error records without an id),
 * the job identity (round trip through the state file's text, every
 * difference named), FNV-1a 64 against known values; and the escaped-NUL
 * finder of request lines (runtime/engine/request.h).
 */
#define _GNU_SOURCE /* fmemopen */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "runtime/engine/batch_state.h"
#include "runtime/engine/request.h"

static FILE *mem(const char *s, size_t n) {
    FILE *f = fmemopen((void *)s, n, "r");
    assert_non_null(f);
    return f;
}

static void test_read_line_bounded(void **state) {
    (void)state;
    static const char text[] = "ab\ncdef\n\nno newline";
    FILE *f = mem(text, sizeof text - 1);
    char *buf = NULL;
    size_t cap = 0, len = 0;
    assert_int_equal(fl_batch_read_line(f, "t", 1, 16, &buf, &cap, &len), FL_OK);
    assert_int_equal(len, 3);
    assert_string_equal(buf, "ab\n");
    assert_int_equal(fl_batch_read_line(f, "t", 2, 16, &buf, &cap, &len), FL_OK);
    assert_string_equal(buf, "cdef\n");
    assert_int_equal(fl_batch_read_line(f, "t", 3, 16, &buf, &cap, &len), FL_OK);
    assert_string_equal(buf, "\n");
    assert_int_equal(fl_batch_read_line(f, "t", 4, 16, &buf, &cap, &len), FL_OK);
    assert_string_equal(buf, "no newline");
    assert_int_equal(fl_batch_read_line(f, "t", 5, 16, &buf, &cap, &len), FL_OK);
    assert_int_equal(len, 0);
    fclose(f);

    /* a line at the bound passes; one byte more is an error naming it, and
     * the buffer never grows past the bound */
    static const char at[] = "0123456789\n";
    f = mem(at, sizeof at - 1);
    assert_int_equal(fl_batch_read_line(f, "t", 1, 11, &buf, &cap, &len), FL_OK);
    assert_int_equal(len, 11);
    fclose(f);
    f = mem(at, sizeof at - 1);
    assert_int_equal(fl_batch_read_line(f, "out.jsonl", 7, 10, &buf, &cap, &len), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "out.jsonl:7: line longer than 10 bytes"));
    fclose(f);
    free(buf);

    /* an endless stream (a device) is cut at the bound */
    buf = NULL;
    cap = 0;
    f = fopen("/dev/zero", "r");
    assert_non_null(f);
    assert_int_equal(fl_batch_read_line(f, "/dev/zero", 1, 1 << 20, &buf, &cap, &len), FL_ERR_FORMAT);
    assert_true(cap <= (1 << 20) + 2);
    fclose(f);
    free(buf);
}

typedef struct seen {
    char ids[8][32];
    long eline[8], oline[8];
    int n;
} seen;

static fl_status on_rec(void *ctx, const char *id, long error_line, long out_line) {
    seen *s = ctx;
    snprintf(s->ids[s->n], sizeof s->ids[0], "%s", id ? id : "(null)");
    s->eline[s->n] = error_line;
    s->oline[s->n++] = out_line;
    return FL_OK;
}

#define OK1 "{\"custom_id\":\"a\",\"text\":\"x\",\"prompt_tokens\":1,\"completion_tokens\":1,\"finish_reason\":\"stop\"}\n"
#define ERR2 "{\"custom_id\":null,\"error\":{\"line\":4,\"message\":\"bad\"}}\n"
#define ERR3 "{\"custom_id\":\"c\",\"error\":{\"line\":5,\"message\":\"bad\"}}\n"

static void test_scan(void **state) {
    (void)state;
    fl_batch_scan sc;
    seen s = {0};
    static const char good[] = OK1 ERR2 ERR3;
    FILE *f = mem(good, sizeof good - 1);
    assert_int_equal(fl_batch_scan_results(f, "o", 1 << 20, on_rec, &s, &sc), FL_OK);
    fclose(f);
    assert_int_equal(sc.n_records, 3);
    assert_int_equal(sc.bad_line, 0);
    assert_int_equal(sc.good_end, sizeof good - 1);
    assert_int_equal(s.n, 3);
    assert_string_equal(s.ids[0], "a");
    assert_string_equal(s.ids[1], "(null)");
    assert_int_equal(s.eline[1], 4);
    assert_int_equal(s.oline[2], 3);

    /* a torn last line: reported, not an error, good_end before it */
    static const char torn[] = OK1 "{\"custom_id\":\"b\",\"te";
    f = mem(torn, sizeof torn - 1);
    assert_int_equal(fl_batch_scan_results(f, "o", 1 << 20, NULL, NULL, &sc), FL_OK);
    fclose(f);
    assert_int_equal(sc.n_records, 1);
    assert_int_equal(sc.bad_line, 2);
    assert_int_equal(sc.good_end, strlen(OK1));
    assert_int_equal(sc.size, sizeof torn - 1);

    /* complete JSON that is not a record (a settings file) is not one either */
    static const char settings[] = "{\"learning_rate\": 0.1}\n";
    f = mem(settings, sizeof settings - 1);
    assert_int_equal(fl_batch_scan_results(f, "o", 1 << 20, NULL, NULL, &sc), FL_OK);
    fclose(f);
    assert_int_equal(sc.n_records, 0);
    assert_int_equal(sc.bad_line, 1);
    assert_int_equal(sc.good_end, 0);

    /* a foreign line followed by more: FL_ERR_FORMAT naming it */
    static const char mid[] = OK1 "garbage\n" OK1;
    f = mem(mid, sizeof mid - 1);
    assert_int_equal(fl_batch_scan_results(f, "out.jsonl", 1 << 20, NULL, NULL, &sc), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "out.jsonl:2: not a flotilla result record"));
    fclose(f);

    /* a line over the bound: an error, whatever follows */
    f = mem(good, sizeof good - 1);
    assert_int_equal(fl_batch_scan_results(f, "out.jsonl", 40, NULL, NULL, &sc), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "out.jsonl:1: line longer than 40 bytes"));
    fclose(f);
}

static void test_record_parse(void **state) {
    (void)state;
    static const struct {
        const char *text;
        bool ok;
    } cases[] = {
        {OK1, true},
        {ERR2, true},
        {"{\"custom_id\":\"a\",\"text\":\"x\"}\n", false},                 /* no finish_reason */
        {"{\"custom_id\":\"\",\"text\":\"x\",\"finish_reason\":\"stop\"}", false}, /* empty id */
        {"{\"custom_id\":null,\"text\":\"x\",\"finish_reason\":\"stop\"}", false}, /* no id, no error */
        {"{\"custom_id\":\"a\",\"error\":\"x\"}", false},
        {"[1, 2]", false},
        {"{\"custom_id\":\"a\",\"text\":\"x\",\"finish_reason\":\"stop\"} trailing", false},
        {"", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        void *json;
        const char *id;
        long el;
        bool ok = fl_batch_record_parse(cases[i].text, strlen(cases[i].text), &json, &id, &el);
        if (ok != cases[i].ok) fail_msg("case %zu (%s): %d", i, cases[i].text, ok);
        cJSON_Delete(json);
    }
}

static void test_hash(void **state) {
    (void)state;
    /* FNV-1a 64 reference values */
    assert_true(fl_batch_hash(FL_BATCH_HASH_INIT, "", 0) == 0xcbf29ce484222325ull);
    assert_true(fl_batch_hash(FL_BATCH_HASH_INIT, "a", 1) == 0xaf63dc4c8601ec8cull);
    assert_true(fl_batch_hash(FL_BATCH_HASH_INIT, "foobar", 6) == 0x85944171f73967e8ull);
    /* streaming in pieces gives the same hash */
    uint64_t h = fl_batch_hash(FL_BATCH_HASH_INIT, "foo", 3);
    assert_true(fl_batch_hash(h, "bar", 3) == 0x85944171f73967e8ull);
}

static void make_ident(fl_batch_ident *id) {
    memset(id, 0, sizeof *id);
    snprintf(id->input, sizeof id->input, "/data/in \"quoted\".jsonl");
    id->input_bytes = 123456789012345ull;
    id->input_hash = 0xfedcba9876543210ull;
    snprintf(id->model, sizeof id->model, "/models/m.gguf");
    id->model_bytes = 98362432;
    assert_int_equal(fl_batch_ident_set_opt(id, "temperature", "0.7"), FL_OK);
    assert_int_equal(fl_batch_ident_set_opt(id, "max_tokens", "256"), FL_OK);
}

static void test_ident(void **state) {
    (void)state;
    fl_batch_ident a, b, c;
    char why[256], *text = NULL;
    make_ident(&a);
    assert_int_equal(fl_batch_ident_format(&a, &text), FL_OK);
    assert_int_equal(fl_batch_ident_parse(text, strlen(text), "s.json", &b), FL_OK);
    free(text);
    assert_true(fl_batch_ident_same(&a, &b, why, sizeof why));
    assert_string_equal(b.input, a.input);
    assert_true(b.input_hash == a.input_hash && b.input_bytes == a.input_bytes);

    c = b;
    c.input_hash ^= 1;
    assert_false(fl_batch_ident_same(&a, &c, why, sizeof why));
    assert_string_equal(why, "input hash fedcba9876543210 vs fedcba9876543211");
    c = b;
    c.model_bytes++;
    assert_false(fl_batch_ident_same(&a, &c, why, sizeof why));
    assert_non_null(strstr(why, "model size"));
    c = b;
    assert_int_equal(fl_batch_ident_set_opt(&c, "temperature", "0"), FL_OK);
    assert_false(fl_batch_ident_same(&a, &c, why, sizeof why));
    assert_string_equal(why, "option temperature: 0.7 vs 0");
    c = b;
    assert_int_equal(fl_batch_ident_set_opt(&c, "seed", "3"), FL_OK); /* only in c */
    assert_false(fl_batch_ident_same(&a, &c, why, sizeof why));
    assert_string_equal(why, "option seed: (not set) vs 3");

    /* anything that is not a state file is refused, naming it */
    static const char *const bad[] = {
        "{\"learning_rate\": 0.1}",
        "not json",
        "{\"flotilla_batch_job\": 1, \"input\": {\"path\": \"x\"}}",
        "{\"flotilla_batch_job\": 1, \"input\": {\"path\": \"x\", \"bytes\": \"1\", \"fnv1a64\": \"zz\"},"
        " \"model\": {\"path\": \"m\", \"bytes\": \"1\"}, \"options\": {}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(fl_batch_ident_parse(bad[i], strlen(bad[i]), "s.json", &c), FL_ERR_FORMAT);
        assert_non_null(strstr(fl_error_msg(), "s.json"));
    }
}

static void test_find_nul(void **state) {
    (void)state;
    char p[128];
    static const struct {
        const char *text, *path; /* path NULL: no escaped NUL */
    } cases[] = {
        {"{\"custom_id\": \"a\", \"body\": {\"prompt\": \"x\\u0000y\"}}", "body.prompt"},
        {"{\"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"\\u0000\"}]}}",
         "body.messages[0].content"},
        {"{\"body\": {\"stop\": [\"a\", \"b\\u0000\"]}}", "body.stop[1]"},
        {"[\"ok\", \"x\\u0000\"]", "[1]"},
        {"{\"custom_id\": \"a\\u0000\"}", "custom_id"},
        {"{\"k\\u0000\": 1}", "k\xEF\xBF\xBF"},
        {"{\"prompt\": \"a\\\\u0000b\"}", NULL}, /* an escaped backslash, then text */
        {"{\"prompt\": \"\\u00000\"}", "prompt"},
        {"{\"prompt\": \"\\u0001\"}", NULL},
        {"{\"prompt\": \"plain\"}", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bool found = fl_request_find_nul_escape(cases[i].text, strlen(cases[i].text), p, sizeof p);
        if (found != (cases[i].path != NULL)) fail_msg("case %zu (%s): found %d", i, cases[i].text, found);
        if (found && strcmp(p, cases[i].path)) fail_msg("case %zu: path '%s', want '%s'", i, p, cases[i].path);
    }
    /* the request parser refuses it, naming the field and line */
    fl_request r;
    const char *line = "{\"custom_id\": \"a\", \"body\": {\"prompt\": \"x\\u0000y\"}}";
    assert_int_equal(fl_request_parse(line, strlen(line), 9, "in.jsonl", &r), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "in.jsonl:9: body.prompt contains an escaped NUL"));
    assert_string_equal(r.custom_id, "a"); /* the error record keeps the id */
    fl_request_free(&r);
    line = "{\"custom_id\": \"a\\u0000b\", \"body\": {\"prompt\": \"x\"}}";
    assert_int_equal(fl_request_parse(line, strlen(line), 2, "in.jsonl", &r), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "in.jsonl:2: custom_id contains an escaped NUL"));
    assert_null(r.custom_id); /* a cut id could name another request */
    fl_request_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_line_bounded),
        cmocka_unit_test(test_scan),
        cmocka_unit_test(test_record_parse),
        cmocka_unit_test(test_hash),
        cmocka_unit_test(test_ident),
        cmocka_unit_test(test_find_nul),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
