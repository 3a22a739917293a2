/*
 * fuzz_request.c — libFuzzer target for the JSONL request parser
 * (runtime/engine/request.c): one input is one request line.
 *
 * The parser's promises (request.h) are checked on every input: FL_OK gives
 * a non-empty custom_id and exactly one of prompt / messages (each message
 * with a role and content), max_tokens >= 1 or -1, non-empty stop strings; a
 * failure leaves no prompt or messages behind. An accepted request then goes
 * through what the engine does with it: its sampling parameters, the stop
 * string scan over its own text, its chat messages through each template
 * family, and a result record written back (valid JSON whatever the bytes).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "runtime/engine/request.h"
#include "runtime/tok/chat_template.h"

static void check_accepted(const fl_request *r) {
    if (!r->custom_id || !r->custom_id[0]) abort();
    if ((r->prompt != NULL) == (r->n_messages != 0)) abort();
    for (size_t i = 0; i < r->n_messages; i++)
        if (!r->messages[i].role || !r->messages[i].content) abort();
    if (r->max_tokens != -1 && r->max_tokens < 1) abort();
    for (size_t i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0]) abort();

    fl_sampling_params def, s;
    fl_sampling_params_default(&def);
    fl_request_sampling(r, &def, &s);

    /* the stop scan, in two increments as generation would call it */
    const char *text = r->prompt ? r->prompt : r->messages[r->n_messages - 1].content;
    size_t len = strlen(text), cut = 0;
    if (fl_request_find_stop(r, text, len / 2, 0, &cut) && cut > len / 2) abort();
    if (fl_request_find_stop(r, text, len, len / 2, &cut) && cut > len) abort();

    if (r->n_messages) {
        static const fl_chat_family fams[] = {FL_CHAT_FAMILY_CHATML, FL_CHAT_FAMILY_LLAMA3,
                                              FL_CHAT_FAMILY_MISTRAL};
        for (size_t f = 0; f < sizeof fams / sizeof fams[0]; f++) {
            char *out = NULL;
            if (fl_chat_template_render(fams[f], NULL, r->messages, r->n_messages, "<s>", &out) ==
                    FL_OK &&
                !out)
                abort();
            free(out);
        }
    }

    /* the result record for it must be one line of valid JSON, in both styles */
    const fl_result_choice choice = {.text = text, .text_len = len, .completion_tokens = 2,
                                     .finish_reason = "stop"};
    for (int style = FL_RESULT_OPENAI; style <= FL_RESULT_COMPACT; style++) {
        fl_result res = {.style = (fl_result_style)style, .endpoint = r->endpoint,
                         .custom_id = r->custom_id, .prompt_tokens = 1, .choices = &choice,
                         .n_choices = 1};
        char *line = NULL;
        size_t n = 0;
        if (fl_result_format(&res, &line, &n) == FL_OK) {
            if (n == 0 || line[n - 1] != '\n' || memchr(line, '\n', n - 1)) abort();
            cJSON *j = cJSON_ParseWithLength(line, n);
            if (!j) abort();
            cJSON_Delete(j);
            free(line);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* a private copy: the line need not be NUL-terminated, and a read past
     * its end must hit ASan's redzone */
    char *line = malloc(size ? size : 1);
    if (!line) return 0;
    memcpy(line, data, size);
    fl_request r;
    memset(&r, 0xA5, sizeof r); /* the parser must not rely on a zeroed struct */
    if (fl_request_parse(line, size, 7, "fuzz.jsonl", &r) == FL_OK) {
        check_accepted(&r);
    } else {
        if (r.prompt || r.messages || r.n_messages || r.stop || r.n_stop) abort();
        if (r.line != 7) abort();
        /* the error record names the id when it was readable */
        fl_result res = {.custom_id = r.custom_id, .error_message = "bad", .error_line = 7};
        char *rec = NULL;
        size_t n = 0;
        if (fl_result_format(&res, &rec, &n) == FL_OK) free(rec);
    }
    fl_request_free(&r);
    free(line);
    return 0;
}
