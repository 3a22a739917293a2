/*
 * test_request.c — request-line parsing (valid forms and every malformed form
 * with the file:line:field message it must produce), the streaming reader,
 * and the result writer (output re-parsed with cJSON, including invalid
 * UTF-8, NUL and control characters in the text).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "runtime/engine/request.h"

static fl_status parse(const char *s, long line, fl_request *r) {
    return fl_request_parse(s, strlen(s), line, "requests.jsonl", r);
}

static void test_prompt_form(void **state) {
    (void)state;
    fl_request r;
    assert_int_equal(parse("{\"custom_id\": \"r1\", \"body\": {\"prompt\": \"Once upon\"}}", 3, &r),
                     FL_OK);
    assert_string_equal(r.custom_id, "r1");
    assert_string_equal(r.prompt, "Once upon");
    assert_null(r.messages);
    assert_int_equal(r.max_tokens, -1);
    assert_int_equal(r.sampling_given, 0);
    assert_int_equal(r.n_stop, 0);
    assert_int_equal(r.line, 3);
    fl_request_free(&r);
    assert_null(r.custom_id);
    fl_request_free(NULL);
}

static void test_messages_form_all_fields(void **state) {
    (void)state;
    const char *line =
        "{\"custom_id\": \"r2\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", "
        "\"body\": {\"model\": \"x\", \"messages\": [{\"role\": \"system\", \"content\": \"Be "
        "nice\"}, {\"role\": \"user\", \"content\": \"Hi \\u00e9\\n\"}, {\"role\": \"assistant\", "
        "\"content\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": \"text\", \"text\": "
        "\"b\"}]}], \"max_tokens\": 64, \"temperature\": 0.7, \"top_p\": 0.9, \"top_k\": 40, "
        "\"min_p\": 0.05, \"repetition_penalty\": 1.1, \"seed\": 7, \"stop\": [\"\\n\\n\", "
        "\"END\"]}}";
    fl_request r;
    assert_int_equal(parse(line, 1, &r), FL_OK);
    assert_null(r.prompt);
    assert_int_equal(r.n_messages, 3);
    assert_string_equal(r.messages[0].role, "system");
    assert_string_equal(r.messages[1].content, "Hi \xc3\xa9\n");
    assert_string_equal(r.messages[2].content, "ab");
    assert_int_equal(r.max_tokens, 64);
    assert_float_equal(r.sampling.temperature, 0.7f, 1e-6);
    assert_float_equal(r.sampling.top_p, 0.9f, 1e-6);
    assert_int_equal(r.sampling.top_k, 40);
    assert_float_equal(r.sampling.min_p, 0.05f, 1e-6);
    assert_float_equal(r.sampling.repetition_penalty, 1.1f, 1e-6);
    assert_true(r.sampling.seed == 7);
    assert_int_equal(r.sampling_given, 0x3f);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[0], "\n\n");
    assert_string_equal(r.stop[1], "END");
    fl_request_free(&r);
}

static void test_optional_forms(void **state) {
    (void)state;
    fl_request r;
    /* stop as one string, max_completion_tokens, top_k -1 = off, nulls = absent */
    assert_int_equal(parse("{\"custom_id\":\"a\",\"body\":{\"prompt\":\"p\",\"stop\":\"\\n\","
                           "\"max_completion_tokens\":5,\"top_k\":-1,\"temperature\":null,"
                           "\"messages\":null,\"n\":1}}",
                           1, &r),
                     FL_OK);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "\n");
    assert_int_equal(r.max_tokens, 5);
    assert_int_equal(r.sampling.top_k, 0);
    assert_int_equal(r.sampling_given, FL_REQUEST_HAS_TOP_K);
    /* the job default fills what the request left out */
    fl_sampling_params job, got;
    fl_sampling_params_default(&job);
    job.temperature = 0.5f;
    job.top_k = 20;
    fl_request_sampling(&r, &job, &got);
    assert_float_equal(got.temperature, 0.5f, 0);
    assert_int_equal(got.top_k, 0);
    fl_request_free(&r);
    /* both max_tokens spellings, equal: fine; trailing whitespace / CR fine */
    assert_int_equal(parse("{\"custom_id\":\"b\",\"body\":{\"prompt\":\"\",\"max_tokens\":3,"
                           "\"max_completion_tokens\":3}}  \r",
                           1, &r),
                     FL_OK);
    assert_int_equal(r.max_tokens, 3);
    assert_string_equal(r.prompt, "");
    fl_request_free(&r);
    /* not NUL-terminated input: only len bytes are read */
    const char buf[] = "{\"custom_id\":\"c\",\"body\":{\"prompt\":\"x\"}}GARBAGE";
    assert_int_equal(fl_request_parse(buf, strlen(buf) - 7, 1, "f", &r), FL_OK);
    assert_string_equal(r.custom_id, "c");
    fl_request_free(&r);
}

typedef struct bad_case {
    const char *line;
    const char *msg; /* expected substring after "requests.jsonl:7: " */
} bad_case;

static void test_malformed(void **state) {
    (void)state;
    static const bad_case cases[] = {
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\"}", "not valid JSON"},
        {"not json", "not valid JSON"},
        {"{\"custom_id\":\"r\",\"body\":{\"prompt\":\"x\"}} {}", "unexpected text after"},
        {"[1, 2]", "must be a JSON object"},
        {"{\"body\": {\"prompt\": \"x\"}}", "custom_id is missing"},
        {"{\"custom_id\": 5, \"body\": {\"prompt\": \"x\"}}", "custom_id must be a non-empty string"},
        {"{\"custom_id\": \"\", \"body\": {\"prompt\": \"x\"}}", "custom_id must be a non-empty"},
        {"{\"custom_id\": \"r\"}", "body is missing"},
        {"{\"custom_id\": \"r\", \"body\": \"x\"}", "body must be an object"},
        {"{\"custom_id\": \"r\", \"body\": {}}", "body needs \"prompt\""},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"messages\": []}}",
         "both \"prompt\" and \"messages\""},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": [\"x\"]}}", "body.prompt must be a string"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": {}}}", "body.messages must be an array"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": []}}", "body.messages must not be empty"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [\"hi\"]}}",
         "body.messages[0] must be an object"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"content\": \"x\"}]}}",
         "body.messages[0].role must be a string"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": "
         "\"x\"}, {\"role\": \"robot\", \"content\": \"y\"}]}}",
         "body.messages[1].role must be \"system\", \"user\" or \"assistant\""},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": "
         "\"x\"}, {\"role\": \"user\", \"content\": 3}]}}",
         "body.messages[1].content must be a string"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"role\": \"user\"}]}}",
         "body.messages[0].content is missing"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": "
         "[{\"type\": \"image_url\"}]}]}}",
         "body.messages[0].content[0] must be a {\"type\": \"text\""},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"max_tokens\": -5}}",
         "body.max_tokens must be between 1 and"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"max_tokens\": 0}}",
         "body.max_tokens must be between 1"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"max_tokens\": 2.5}}",
         "body.max_tokens must be an integer"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"max_tokens\": \"64\"}}",
         "body.max_tokens must be an integer"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"max_tokens\": 4, "
         "\"max_completion_tokens\": 5}}",
         "disagree"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"temperature\": -1}}",
         "body.temperature must be >= 0"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"temperature\": \"hot\"}}",
         "body.temperature must be a number"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"top_p\": 0}}",
         "body.top_p must be in (0, 1]"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"top_p\": 1.5}}", "body.top_p"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"top_k\": -2}}", "body.top_k"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"top_k\": 1.5}}",
         "body.top_k must be an integer"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"min_p\": 2}}", "body.min_p"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"repetition_penalty\": 0}}",
         "body.repetition_penalty must be > 0"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"seed\": true}}",
         "body.seed must be an integer"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"stop\": 7}}",
         "body.stop must be a string or an array"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"stop\": [\"a\", 1]}}",
         "body.stop[1] must be a string"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"stop\": [\"\"]}}",
         "body.stop[0] must not be empty"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"n\": 0}}", "body.n"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"n\": 129}}", "body.n"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"response_format\": {}}}",
         "body.response_format is not supported"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"logit_bias\": {\"1\": 5}}}",
         "body.logit_bias is not supported"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
         "\"tools\": []}}", "body.tools is not supported"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"stream\": true}}",
         "body.stream is not supported"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"echo\": true}}",
         "body.echo is not supported"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"n\": 2, \"best_of\": 3}}",
         "body.best_of is not supported"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"logprobs\": 21}}", "body.logprobs"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"logprobs\": true}}",
         "body.logprobs must be an integer"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"top_logprobs\": 2}}",
         "body.top_logprobs is a chat field"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
         "\"top_logprobs\": 2}}", "needs \"logprobs\": true"},
        {"{\"custom_id\": \"r\", \"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
         "\"logprobs\": 3}}", "body.logprobs must be true or false"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"presence_penalty\": 2.5}}",
         "body.presence_penalty must be in [-2, 2]"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"min_tokens\": -1}}", "body.min_tokens"},
        {"{\"custom_id\": \"r\", \"body\": {\"prompt\": \"x\", \"ignore_eos\": 1}}",
         "body.ignore_eos must be true or false"},
        {"{\"custom_id\": \"r\", \"method\": \"GET\", \"body\": {\"prompt\": \"x\"}}",
         "method must be \"POST\""},
        {"{\"custom_id\": \"r\", \"url\": \"/v1/embeddings\", \"body\": {\"prompt\": \"x\"}}",
         "url must be"},
        {"{\"custom_id\": \"r\", \"url\": \"/v1/chat/completions\", \"body\": {\"prompt\": \"x\"}}",
         "needs body.messages"},
        {"{\"custom_id\": \"r\", \"url\": \"/v1/completions\", \"body\": {\"messages\": "
         "[{\"role\": \"user\", \"content\": \"x\"}]}}", "needs body.prompt"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_request r;
        fl_error_clear();
        fl_status st = parse(cases[i].line, 7, &r);
        if (st != FL_ERR_FORMAT)
            fail_msg("case %zu (%s): status %s, want FL_ERR_FORMAT", i, cases[i].line,
                     fl_status_str(st));
        const char *m = fl_error_msg();
        if (strncmp(m, "requests.jsonl:7: ", 18) != 0 || !strstr(m, cases[i].msg))
            fail_msg("case %zu: message '%s' lacks 'requests.jsonl:7: ...%s'", i, m, cases[i].msg);
        /* what is left is what an error record needs */
        assert_int_equal(r.line, 7);
        assert_null(r.prompt);
        assert_null(r.messages);
        assert_null(r.stop);
        fl_request_free(&r);
    }
    /* custom_id survives a later error, for the error record */
    fl_request r;
    assert_int_equal(parse("{\"custom_id\": \"keep\", \"body\": {}}", 2, &r), FL_ERR_FORMAT);
    assert_string_equal(r.custom_id, "keep");
    fl_request_free(&r);
    /* a NUL byte inside the line */
    const char nul[] = "{\"custom_id\": \"a\0b\", \"body\": {\"prompt\": \"x\"}}";
    assert_int_equal(fl_request_parse(nul, sizeof nul - 1, 4, "f.jsonl", &r), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "f.jsonl:4: line contains a NUL byte"));
    fl_request_free(&r);
}

static void test_find_stop(void **state) {
    (void)state;
    fl_request r;
    assert_int_equal(parse("{\"custom_id\":\"s\",\"body\":{\"prompt\":\"p\","
                           "\"stop\":[\"\\n\\n\",\"END\",\"ab\"]}}", 1, &r),
                     FL_OK);
    size_t cut = 99;
    const char *t = "hello\nworld";
    assert_false(fl_request_find_stop(&r, t, strlen(t), 0, &cut));
    /* a stop string split across two increments is found */
    const char *u = "hello\nworld\n\nmore";
    assert_true(fl_request_find_stop(&r, u, 13, strlen(t), &cut));
    assert_int_equal(cut, 11);
    /* the earliest of several matches wins */
    const char *v = "xxENDyyab";
    assert_true(fl_request_find_stop(&r, v, strlen(v), 0, &cut));
    assert_int_equal(cut, 2);
    /* text checked before `from` is not searched again (it would have stopped) */
    const char *w = "aEN";
    assert_false(fl_request_find_stop(&r, w, 3, 0, &cut));
    const char *w2 = "aENDab";
    assert_true(fl_request_find_stop(&r, w2, 4, 3, &cut));
    assert_int_equal(cut, 1);
    fl_request_free(&r);
    /* no stop strings */
    assert_int_equal(parse("{\"custom_id\":\"s\",\"body\":{\"prompt\":\"p\"}}", 1, &r), FL_OK);
    assert_false(fl_request_find_stop(&r, "END", 3, 0, &cut));
    fl_request_free(&r);
}

static void test_reader(void **state) {
    (void)state;
    char path[] = "/tmp/fl_test_reqXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "wb");
    /* BOM, CRLF, blank and whitespace-only lines, a long line, no final newline */
    fputs("\xEF\xBB\xBF{\"a\":1}\r\n\n   \t\n{\"b\":2}\n", f);
    for (int i = 0; i < 100000; i++) fputc('x', f);
    fputs("\n\n{\"c\":3}", f);
    fclose(f);

    fl_request_reader *r = NULL;
    assert_int_equal(fl_request_reader_open(path, &r), FL_OK);
    assert_string_equal(fl_request_reader_path(r), path);
    long ln;
    const char *t;
    size_t len;
    assert_int_equal(fl_request_reader_next(r, &ln, &t, &len), FL_OK);
    assert_int_equal(ln, 1);
    assert_string_equal(t, "{\"a\":1}");
    assert_int_equal(len, 7);
    assert_int_equal(fl_request_reader_next(r, &ln, &t, &len), FL_OK);
    assert_int_equal(ln, 4);
    assert_string_equal(t, "{\"b\":2}");
    assert_int_equal(fl_request_reader_next(r, &ln, &t, &len), FL_OK);
    assert_int_equal(ln, 5);
    assert_int_equal(len, 100000);
    assert_int_equal(fl_request_reader_next(r, &ln, &t, &len), FL_OK);
    assert_int_equal(ln, 7);
    assert_string_equal(t, "{\"c\":3}");
    assert_int_equal(fl_request_reader_next(r, &ln, &t, &len), FL_OK);
    assert_null(t);
    fl_request_reader_close(r);
    fl_request_reader_close(NULL);
    unlink(path);

    assert_int_equal(fl_request_reader_open("/nonexistent/requests.jsonl", &r), FL_ERR_IO);
    assert_non_null(strstr(fl_error_msg(), "/nonexistent/requests.jsonl"));
    assert_null(r);
}

/* Writes r to a temp file, reads back the one line, parses it. */
static cJSON *roundtrip(const fl_result *r) {
    FILE *f = tmpfile();
    assert_non_null(f);
    assert_int_equal(fl_result_write(f, r), FL_OK);
    long n = ftell(f);
    rewind(f);
    char *buf = calloc(1, (size_t)n + 1);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    assert_true(n > 0 && buf[n - 1] == '\n');
    assert_null(memchr(buf, '\n', (size_t)n - 1)); /* exactly one line */
    cJSON *j = cJSON_ParseWithLength(buf, (size_t)n);
    if (!j) fail_msg("output is not JSON: %s", buf);
    /* every byte of the output is valid UTF-8 */
    free(buf);
    return j;
}

static void test_writer(void **state) {
    (void)state;
    const char text[] = "ok \xff\xfe bad, \xe2\x82 cut, nul\0here, tab\t, bell\x07, quote\" "
                        "slash\\ \xe2\x82\xac";
    fl_result_choice ch = {.text = text, .text_len = sizeof text - 1, .completion_tokens = 30,
                           .finish_reason = "length"};
    fl_result r = {.style = FL_RESULT_COMPACT, .custom_id = "r1", .prompt_tokens = 12,
                   .choices = &ch, .n_choices = 1};
    cJSON *j = roundtrip(&r);
    assert_string_equal(cJSON_GetObjectItem(j, "custom_id")->valuestring, "r1");
    assert_string_equal(cJSON_GetObjectItem(j, "text")->valuestring,
                        "ok \xEF\xBF\xBD\xEF\xBF\xBD bad, \xEF\xBF\xBD\xEF\xBF\xBD cut, "
                        "nul\xEF\xBF\xBDhere, tab\t, bell\x07, quote\" slash\\ \xe2\x82\xac");
    assert_int_equal(cJSON_GetObjectItem(j, "prompt_tokens")->valueint, 12);
    assert_int_equal(cJSON_GetObjectItem(j, "completion_tokens")->valueint, 30);
    assert_string_equal(cJSON_GetObjectItem(j, "finish_reason")->valuestring, "length");
    assert_null(cJSON_GetObjectItem(j, "error"));
    cJSON_Delete(j);

    fl_result e = {.style = FL_RESULT_COMPACT, .custom_id = NULL,
                   .error_message = "requests.jsonl:7: custom_id is missing", .error_line = 7};
    j = roundtrip(&e);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "custom_id")));
    const cJSON *err = cJSON_GetObjectItem(j, "error");
    assert_int_equal(cJSON_GetObjectItem(err, "line")->valueint, 7);
    assert_string_equal(cJSON_GetObjectItem(err, "message")->valuestring,
                        "requests.jsonl:7: custom_id is missing");
    assert_null(cJSON_GetObjectItem(j, "text"));
    cJSON_Delete(j);

    fl_result_choice ech = {.finish_reason = "stop"};
    fl_result empty = {.style = FL_RESULT_COMPACT, .custom_id = "bad\xc0id", .choices = &ech,
                       .n_choices = 1};
    j = roundtrip(&empty);
    assert_string_equal(cJSON_GetObjectItem(j, "text")->valuestring, "");
    assert_string_equal(cJSON_GetObjectItem(j, "custom_id")->valuestring, "bad\xEF\xBF\xBDid");
    assert_string_equal(cJSON_GetObjectItem(j, "finish_reason")->valuestring, "stop");
    cJSON_Delete(j);

    /* a failing stream is reported, not ignored */
    FILE *ro = fopen("/dev/full", "w");
    if (ro) {
        assert_int_equal(fl_result_write(ro, &r), FL_ERR_IO);
        assert_non_null(strstr(fl_error_msg(), "r1"));
        fclose(ro);
    }
    assert_int_equal(fl_result_write(NULL, &r), FL_ERR_INVALID_ARG);
}


/* Mutation fuzzing (run under FL_SANITIZE=ON to catch memory errors): valid
 * lines with random byte flips, deletions, duplications and truncations must
 * parse to FL_OK with the documented invariants or to FL_ERR_FORMAT, and
 * every outcome must format to a valid JSON record. */
static uint64_t fuzz_state = 0x243F6A8885A308D3ULL;
static uint64_t fuzz_next(void) {
    fuzz_state ^= fuzz_state << 13;
    fuzz_state ^= fuzz_state >> 7;
    fuzz_state ^= fuzz_state << 17;
    return fuzz_state;
}


/* The OpenAI fields: endpoint from url or body, n, logprobs in both
 * endpoints' forms, penalties, vLLM's extensions, harmless fields accepted,
 * refused ones named in param. */
static void test_openai_fields(void **state) {
    (void)state;
    fl_request r;
    assert_int_equal(parse("{\"custom_id\": \"c\", \"method\": \"POST\", \"url\": \"/v1/completions\", "
                           "\"body\": {\"model\": \"m\", \"prompt\": \"x\", \"n\": 3, \"logprobs\": 2, "
                           "\"presence_penalty\": 0.5, \"frequency_penalty\": -1, \"min_tokens\": 4, "
                           "\"ignore_eos\": true, \"user\": \"u\", \"metadata\": {\"k\": 1}, "
                           "\"stream\": false, \"echo\": false, \"best_of\": 3}}", 1, &r), FL_OK);
    assert_int_equal(r.endpoint, FL_REQUEST_COMPLETIONS);
    assert_string_equal(r.model, "m");
    assert_int_equal(r.n, 3);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 2);
    assert_float_equal(r.presence_penalty, 0.5, 1e-7);
    assert_float_equal(r.frequency_penalty, -1, 1e-7);
    assert_int_equal(r.min_tokens, 4);
    assert_true(r.ignore_eos);
    fl_request_free(&r);
    assert_int_equal(parse("{\"custom_id\": \"h\", \"body\": {\"messages\": [{\"role\": \"user\", "
                           "\"content\": \"x\"}], \"logprobs\": true, \"top_logprobs\": 5}}", 2, &r), FL_OK);
    assert_int_equal(r.endpoint, FL_REQUEST_CHAT); /* no url: messages mean chat */
    assert_int_equal(r.n, 1);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 5);
    fl_request_free(&r);
    assert_int_equal(parse("{\"custom_id\": \"h\", \"body\": {\"messages\": [{\"role\": \"user\", "
                           "\"content\": \"x\"}], \"logprobs\": false}}", 2, &r), FL_OK);
    assert_false(r.logprobs);
    fl_request_free(&r);
    assert_int_equal(parse("{\"custom_id\": \"t\", \"body\": {\"prompt\": \"x\", \"tool_choice\": "
                           "\"auto\"}}", 9, &r), FL_ERR_FORMAT);
    assert_string_equal(r.param, "tool_choice");
    assert_string_equal(r.custom_id, "t");
    fl_request_free(&r);
}

/* The OpenAI Batch output line: envelope, body, usage sums, logprobs in
 * both endpoints' shapes, error records. */
static void test_writer_openai(void **state) {
    (void)state;
    const char *tt[2] = {"a", "b"};
    const size_t tl[2] = {1, 1};
    const float lps[2] = {-0.1f, -2.5f};
    fl_result_token tok = {.text = "a", .len = 1, .logprob = -0.1f, .n_top = 2, .top_text = tt,
                           .top_len = tl, .top_lps = lps};
    fl_result_choice ch[2] = {
        {.text = "a", .text_len = 1, .completion_tokens = 1, .finish_reason = "length",
         .tokens = &tok, .n_tokens = 1},
        {.text = "bc", .text_len = 2, .completion_tokens = 2, .finish_reason = "stop"},
    };
    fl_result r = {.endpoint = FL_REQUEST_COMPLETIONS, .custom_id = "r1", .model = "m",
                   .created = 7, .prompt_tokens = 5, .choices = ch, .n_choices = 2};
    cJSON *j = roundtrip(&r);
    assert_string_equal(cJSON_GetObjectItem(j, "custom_id")->valuestring, "r1");
    assert_int_equal(strncmp(cJSON_GetObjectItem(j, "id")->valuestring, "batch_req_", 10), 0);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "error")));
    const cJSON *resp = cJSON_GetObjectItem(j, "response");
    assert_int_equal(cJSON_GetObjectItem(resp, "status_code")->valueint, 200);
    const cJSON *body = cJSON_GetObjectItem(resp, "body");
    assert_string_equal(cJSON_GetObjectItem(body, "object")->valuestring, "text_completion");
    assert_string_equal(cJSON_GetObjectItem(body, "model")->valuestring, "m");
    const cJSON *u = cJSON_GetObjectItem(body, "usage");
    assert_int_equal(cJSON_GetObjectItem(u, "completion_tokens")->valueint, 3);
    assert_int_equal(cJSON_GetObjectItem(u, "total_tokens")->valueint, 8);
    const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(body, "choices"), 0);
    const cJSON *c1 = cJSON_GetArrayItem(cJSON_GetObjectItem(body, "choices"), 1);
    assert_int_equal(cJSON_GetObjectItem(c1, "index")->valueint, 1);
    assert_string_equal(cJSON_GetObjectItem(c1, "text")->valuestring, "bc");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(c1, "logprobs")));
    const cJSON *lp = cJSON_GetObjectItem(c0, "logprobs");
    assert_string_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "tokens"), 0)->valuestring, "a");
    const cJSON *top0 = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 0);
    assert_float_equal(cJSON_GetObjectItem(top0, "b")->valuedouble, -2.5, 1e-6);
    assert_int_equal(cJSON_GetArraySize(top0), 2); /* "a" once: chosen and first of the top */
    cJSON_Delete(j);

    r.endpoint = FL_REQUEST_CHAT;
    j = roundtrip(&r);
    body = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "response"), "body");
    assert_string_equal(cJSON_GetObjectItem(body, "object")->valuestring, "chat.completion");
    c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(body, "choices"), 0);
    const cJSON *msg = cJSON_GetObjectItem(c0, "message");
    assert_string_equal(cJSON_GetObjectItem(msg, "role")->valuestring, "assistant");
    assert_string_equal(cJSON_GetObjectItem(msg, "content")->valuestring, "a");
    const cJSON *e0 = cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetObjectItem(c0, "logprobs"), "content"), 0);
    assert_string_equal(cJSON_GetObjectItem(e0, "token")->valuestring, "a");
    assert_int_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(e0, "bytes"), 0)->valueint, 'a');
    const cJSON *t1 = cJSON_GetArrayItem(cJSON_GetObjectItem(e0, "top_logprobs"), 1);
    assert_string_equal(cJSON_GetObjectItem(t1, "token")->valuestring, "b");
    cJSON_Delete(j);

    fl_result e = {.custom_id = NULL, .error_message = "x.jsonl:4: body.tools is not supported",
                   .error_param = "tools", .error_line = 4};
    j = roundtrip(&e);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "custom_id")));
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "error")));
    resp = cJSON_GetObjectItem(j, "response");
    assert_int_equal(cJSON_GetObjectItem(resp, "status_code")->valueint, 400);
    const cJSON *err = cJSON_GetObjectItem(cJSON_GetObjectItem(resp, "body"), "error");
    assert_string_equal(cJSON_GetObjectItem(err, "type")->valuestring, "invalid_request_error");
    assert_string_equal(cJSON_GetObjectItem(err, "param")->valuestring, "tools");
    assert_int_equal(cJSON_GetObjectItem(err, "line")->valueint, 4);
    cJSON_Delete(j);
}

static void test_fuzz_mutations(void **state) {
    (void)state;
    static const char *seeds[] = {
        "{\"custom_id\": \"r1\", \"body\": {\"prompt\": \"Once upon a time\", \"max_tokens\": 8}}",
        "{\"custom_id\":\"r2\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":"
        "{\"messages\":[{\"role\":\"system\",\"content\":\"sys\"},{\"role\":\"user\","
        "\"content\":[{\"type\":\"text\",\"text\":\"a\\u00e9\"}]}],\"temperature\":0.5,"
        "\"top_p\":0.9,\"top_k\":40,\"min_p\":0.1,\"repetition_penalty\":1.2,\"seed\":3,"
        "\"stop\":[\"x\",\"yy\"]}}",
        "{\"custom_id\": \"r3\", \"body\": {\"prompt\": \"\\ud83d\\ude00 \\n\", \"stop\": \"END\"}}",
    };
    char buf[1024];
    int ok = 0, bad = 0;
    for (int it = 0; it < 30000; it++) {
        const char *seed = seeds[fuzz_next() % 3];
        size_t n = strlen(seed);
        memcpy(buf, seed, n);
        int muts = 1 + (int)(fuzz_next() % 4);
        for (int k = 0; k < muts && n > 0; k++) {
            size_t at = fuzz_next() % n;
            switch (fuzz_next() % 5) {
            case 0: buf[at] = (char)(fuzz_next() & 0xff); break;
            case 1: buf[at] = "{}[]\",:\\0-e.9 "[fuzz_next() % 14]; break;
            case 2: { /* delete a range */
                size_t len = 1 + fuzz_next() % 8;
                if (at + len > n) len = n - at;
                memmove(buf + at, buf + at + len, n - at - len);
                n -= len;
                break;
            }
            case 3: { /* duplicate a range */
                size_t len = 1 + fuzz_next() % 16;
                if (at + len > n) len = n - at;
                if (n + len < sizeof buf) {
                    memmove(buf + at + len, buf + at, n - at);
                    n += len;
                }
                break;
            }
            default: n = at; break; /* truncate */
            }
        }
        fl_request r;
        fl_status st = fl_request_parse(buf, n, it + 1, "fuzz.jsonl", &r);
        fl_result_choice rc = {.finish_reason = "stop"};
        fl_result res = {.style = it % 2 ? FL_RESULT_COMPACT : FL_RESULT_OPENAI,
                         .endpoint = r.endpoint, .custom_id = r.custom_id, .choices = &rc,
                         .n_choices = 1};
        if (st == FL_OK) {
            ok++;
            assert_non_null(r.custom_id);
            assert_true(r.custom_id[0] != 0);
            assert_true((r.prompt != NULL) != (r.messages != NULL));
            assert_true(r.max_tokens == -1 || r.max_tokens >= 1);
            for (size_t i = 0; i < r.n_messages; i++) assert_non_null(r.messages[i].content);
            fl_sampling_params sp;
            fl_request_sampling(&r, NULL, &sp);
            assert_int_equal(fl_sampling_params_validate(&sp), FL_OK);
            rc.text = r.prompt ? r.prompt : r.messages[0].content;
            rc.text_len = strlen(rc.text);
        } else {
            bad++;
            assert_int_equal(st, FL_ERR_FORMAT);
            assert_non_null(strstr(fl_error_msg(), "fuzz.jsonl:"));
            res.error_message = fl_error_msg();
            res.error_line = it + 1;
        }
        char *line = NULL;
        size_t len = 0;
        assert_int_equal(fl_result_format(&res, &line, &len), FL_OK);
        cJSON *j = cJSON_ParseWithLength(line, len);
        if (!j) fail_msg("record is not JSON: %s", line);
        cJSON_Delete(j);
        free(line);
        fl_request_free(&r);
    }
    assert_true(ok > 100 && bad > 100); /* the mutations explore both outcomes */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompt_form),
        cmocka_unit_test(test_messages_form_all_fields),
        cmocka_unit_test(test_optional_forms),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_find_stop),
        cmocka_unit_test(test_reader),
        cmocka_unit_test(test_writer),
        cmocka_unit_test(test_openai_fields),
        cmocka_unit_test(test_writer_openai),
        cmocka_unit_test(test_fuzz_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
