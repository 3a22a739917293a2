/*
 * fuzz_request_body.c — libFuzzer target for the HTTP request body parser of
 * `flotilla serve` (fl_request_parse_body, runtime/engine/request.c): one
 * input is one POST body, parsed for both endpoints.
 *
 * The parser's promises (request.h) are checked on every input: FL_OK gives
 * the endpoint's own input (completions a prompt, chat messages each with a
 * role and content), every field within its documented bounds (n, logprobs,
 * penalties, max_tokens, min_tokens, finite sampling values, non-empty stop
 * strings, stream_options only with stream); a failure leaves nothing owned
 * behind and a message naming the problem. An accepted request's answers are
 * then formatted as the server would (the whole body and each streamed chunk
 * shape, logprobs included when asked) and must be valid JSON whatever the
 * bytes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/sampler.h"
#include "runtime/engine/request.h"

static void must_parse(const char *text, size_t n) {
    cJSON *j = cJSON_ParseWithLength(text, n);
    if (!j) abort();
    cJSON_Delete(j);
}

static void check_accepted(const fl_request *r, fl_request_endpoint ep) {
    if (r->endpoint != ep) abort();
    if (ep == FL_REQUEST_COMPLETIONS ? (!r->prompt || r->n_messages) : (r->prompt || !r->n_messages))
        abort();
    for (size_t i = 0; i < r->n_messages; i++)
        if (!r->messages[i].role || !r->messages[i].content) abort();
    if (r->n < 1 || r->n > FL_REQUEST_MAX_N) abort();
    if (r->top_logprobs < 0 || r->top_logprobs > FL_SAMPLER_MAX_TOP_LOGPROBS) abort();
    if (r->top_logprobs && !r->logprobs) abort();
    if (!(r->presence_penalty >= -2 && r->presence_penalty <= 2)) abort();
    if (!(r->frequency_penalty >= -2 && r->frequency_penalty <= 2)) abort();
    if (r->min_tokens < 0) abort();
    if (r->max_tokens != -1 && r->max_tokens < 1) abort();
    if (r->stream_include_usage && !r->stream) abort();
    for (size_t i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0]) abort();
    const fl_sampling_params *p = &r->sampling;
    if (!isfinite(p->temperature) || p->temperature < 0) abort();
    if (!(p->top_p > 0 && p->top_p <= 1)) abort();
    if (p->top_k < 0) abort();
    if (!(p->min_p >= 0 && p->min_p <= 1)) abort();
    if (!isfinite(p->repetition_penalty) || !(p->repetition_penalty > 0)) abort();

    /* the answers, as the server formats them, around the request's own text */
    const char *text = r->prompt ? r->prompt : r->messages[r->n_messages - 1].content;
    const size_t len = strlen(text);
    const char *top_text[1] = {text};
    const size_t top_len[1] = {len};
    const float top_lp[1] = {-0.5f};
    const fl_result_token tok = {.text = text, .len = len, .logprob = -0.25f,
                                 .n_top = r->top_logprobs ? 1 : 0, .top_text = top_text,
                                 .top_len = top_len, .top_lps = top_lp};
    const fl_result_choice choice = {.text = text, .text_len = len, .completion_tokens = 1,
                                     .finish_reason = "stop", .tokens = r->logprobs ? &tok : NULL,
                                     .n_tokens = r->logprobs ? 1 : 0};
    const fl_result res = {.endpoint = r->endpoint, .custom_id = "serve-1", .model = r->model ? r->model : "m",
                           .created = 1, .prompt_tokens = 1, .choices = &choice, .n_choices = 1};
    char *out = NULL;
    size_t n = 0;
    if (fl_result_body_format(&res, &out, &n) == FL_OK) {
        must_parse(out, n);
        free(out);
    }
    const fl_result_chunk chunks[] = {
        {.index = r->n - 1, .text = text, .len = len, .first = true,
         .tokens = r->logprobs ? &tok : NULL, .n_tokens = r->logprobs ? 1 : 0, .text_offset = len},
        {.index = 0, .text = text, .len = len / 2, .finish_reason = "length"},
        {.usage = true, .completion_tokens = 3},
    };
    for (size_t i = 0; i < sizeof chunks / sizeof chunks[0]; i++) {
        out = NULL;
        if (fl_result_chunk_format(&res, &chunks[i], &out, &n) == FL_OK) {
            must_parse(out, n);
            free(out);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* a private copy: a body need not be NUL-terminated, and a read past its
     * end must hit ASan's redzone */
    char *body = malloc(size ? size : 1);
    if (!body) return 0;
    memcpy(body, data, size);
    for (int ep = FL_REQUEST_COMPLETIONS; ep <= FL_REQUEST_CHAT; ep++) {
        fl_request r;
        memset(&r, 0xA5, sizeof r); /* the parser must not rely on a zeroed struct */
        if (fl_request_parse_body(body, size, (fl_request_endpoint)ep, &r) == FL_OK) {
            check_accepted(&r, (fl_request_endpoint)ep);
        } else {
            if (r.prompt || r.messages || r.n_messages || r.stop || r.n_stop || r.model) abort();
            if (r.endpoint != (fl_request_endpoint)ep) abort();
            const char *msg = fl_error_msg();
            if (!msg || !msg[0]) abort();
        }
        fl_request_free(&r);
    }
    free(body);
    return 0;
}
