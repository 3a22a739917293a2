/*
 * request.h — batch-job I/O: one request per line of an OpenAI-batch-style
 * JSONL file in, one result per line out.
 *
 * Input line (OpenAI batch format; "method" must be "POST" and "url"
 * "/v1/completions" or "/v1/chat/completions" when given; without "url",
 * "prompt" means completions and "messages" chat):
 *   {"custom_id": "r1", "body": {"prompt": "..."}}
 *   {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
 *    "body": {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}],
 *             "max_tokens": 64,            (or "max_completion_tokens")
 *             "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
 *             "repetition_penalty": 1.1, "seed": 7,
 *             "stop": ["\n\n"] or "...", "n": 3, "presence_penalty": 0.5,
 *             "frequency_penalty": 0.5, "min_tokens": 4, "ignore_eos": false,
 *             "logprobs": true, "top_logprobs": 5}}   (completions: "logprobs": 5)
 * Fields flotilla does not implement (response_format, tools, tool_choice,
 * functions, function_call, logit_bias, suffix, stream: true, echo: true,
 * best_of > n, ...) refuse the request naming the field; other unknown
 * fields (model, user, metadata, ...) are accepted and have no effect.
 * A message content may also be an array of {"type": "text", "text": "..."}
 * parts (OpenAI's multi-part form), which are concatenated. A JSON null for
 * an optional field means "not given". top_k = -1 means off (vLLM's
 * convention), like 0.
 *
 * Output line, one per request, written whole with one fwrite + fflush so a
 * crash never leaves half a record and other readers see complete lines.
 * OpenAI Batch output (default):
 *   {"id": "batch_req_<16 hex>", "custom_id": "r1",
 *    "response": {"status_code": 200, "request_id": "req_<16 hex>", "body":
 *      {"id": "cmpl-<16 hex>", "object": "text_completion", "created": 1700000000,
 *       "model": "...", "choices": [{"index": 0, "text": "...", "logprobs": null,
 *       "finish_reason": "stop"|"length"}], "usage": {"prompt_tokens": 12,
 *       "completion_tokens": 30, "total_tokens": 42}}}, "error": null}
 *   chat: "object": "chat.completion", choices [{"index", "message": {"role":
 *   "assistant", "content": "..."}, "logprobs", "finish_reason"}]. Logprobs:
 *   completions {"tokens", "token_logprobs", "top_logprobs": [{text: lp}],
 *   "text_offset"}; chat {"content": [{"token", "logprob", "bytes",
 *   "top_logprobs": [{"token", "logprob", "bytes"}]}]}. The hex ids are a
 *   hash of the custom_id (of the line for id-less records).
 *   A refused request: "response": {"status_code": 400, "request_id", "body":
 *   {"error": {"message", "type": "invalid_request_error", "param", "code":
 *   null, "line": 7}}}, "error": null (custom_id null when unreadable).
 * Compact (--output-format compact):
 *   {"custom_id": "r1", "text": "...", "prompt_tokens": 12,
 *    "completion_tokens": 30, "finish_reason": "stop"|"length"}
 *   {"custom_id": "r7" | null, "error": {"line": 7, "message": "..."}}
 * Strings are made valid UTF-8 (each invalid byte and each NUL becomes
 * U+FFFD) before cJSON escapes them, so the output is always valid JSON.
 * A request whose strings hold an escaped NUL ("\u0000") is refused with an
 * error record naming the field: strings are NUL-terminated inside.
 *
 * Threading: parse/free/write/format are re-entrant; a reader is one thread's.
 */
#ifndef FL_REQUEST_H
#define FL_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/tok/chat_template.h" /* fl_chat_message */
#include "core/sampler.h"       /* fl_sampling_params */
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bits of fl_request.sampling_given: which sampling fields the request set. */
enum {
    FL_REQUEST_HAS_TEMPERATURE = 1u << 0,
    FL_REQUEST_HAS_TOP_P = 1u << 1,
    FL_REQUEST_HAS_TOP_K = 1u << 2,
    FL_REQUEST_HAS_MIN_P = 1u << 3,
    FL_REQUEST_HAS_REPETITION_PENALTY = 1u << 4,
    FL_REQUEST_HAS_SEED = 1u << 5,
};

/* The OpenAI endpoint a request is for: its "url", or without one
 * completions for "prompt" and chat for "messages". */
typedef enum fl_request_endpoint {
    FL_REQUEST_COMPLETIONS = 0, /* /v1/completions */
    FL_REQUEST_CHAT,            /* /v1/chat/completions */
} fl_request_endpoint;

#define FL_REQUEST_MAX_N 128

typedef struct fl_request {
    char *custom_id;              /* required, non-empty */
    fl_request_endpoint endpoint;
    char *model;                  /* body.model, or NULL */
    int n;                        /* choices, 1..FL_REQUEST_MAX_N */
    bool logprobs;                /* completions: "logprobs" given; chat: "logprobs": true */
    int top_logprobs;             /* 0..20: completions' "logprobs" N, chat's "top_logprobs" */
    float presence_penalty, frequency_penalty; /* [-2, 2], 0 = off */
    int min_tokens;               /* vLLM: EOS masked and stop strings ignored before this */
    bool ignore_eos;              /* vLLM: EOS does not end the completion */
    char param[64];               /* on a parse failure, the body field at fault ("" if none) */
    char *prompt;                 /* exactly one of prompt / messages is set */
    fl_chat_message *messages;    /* [n_messages] */
    size_t n_messages;
    int max_tokens;               /* >= 1, or -1 = not given (use the job default) */
    fl_sampling_params sampling;  /* fields named in sampling_given hold the request's
                                     values, the others fl_sampling_params_default's */
    unsigned sampling_given;      /* FL_REQUEST_HAS_* bits */
    char **stop;                  /* [n_stop] non-empty stop strings */
    size_t n_stop;
    long line;                    /* 1-based line number in the input */
    bool stream;                  /* HTTP bodies only: "stream": true (server-sent events) */
    bool stream_include_usage;    /* HTTP: "stream_options": {"include_usage": true} */
} fl_request;

/* Parses one JSONL line (line[0..len), need not be NUL-terminated). file
 * names the input in messages (NULL: "<input>"). On failure returns
 * FL_ERR_FORMAT with a message "file:line: field ..." (e.g.
 * "requests.jsonl:7: body.messages[1].content must be a string") and leaves
 * *out holding only line and, when it was readable, custom_id (for the error
 * record). Call fl_request_free(out) in both cases. */
fl_status fl_request_parse(const char *line, size_t len, long line_no, const char *file,
                           fl_request *out);

/* Parses one HTTP request body (flotilla serve) for endpoint: the same
 * fields as a batch line's "body", plus "stream" and "stream_options".
 * On failure returns FL_ERR_FORMAT with a message naming the field
 * ("body.n must be ...", no file:line prefix) and out->param set when the
 * field is one flotilla refuses. Call fl_request_free(out) in both cases. */
fl_status fl_request_parse_body(const char *text, size_t len, fl_request_endpoint endpoint,
                                fl_request *out);

/* True when the JSON text[0..len) holds an escaped NUL ("\u0000", which
 * cJSON's NUL-terminated strings would silently cut). path[n] receives the
 * JSON path of the first string holding one ("body.prompt",
 * "body.messages[1].content", "[3]"), or "" when the text does not parse.
 * fl_request_parse refuses such a request with an error naming the path. */
bool fl_request_find_nul_escape(const char *text, size_t len, char *path, size_t n);

/* Frees what r owns and zeroes it; NULL is a no-op. */
void fl_request_free(fl_request *r);

/* The request's sampling parameters with every field it did not give taken
 * from job_defaults. */
void fl_request_sampling(const fl_request *r, const fl_sampling_params *job_defaults,
                         fl_sampling_params *out);

/* Stop-string check for incremental generation. text[0..len) is the
 * completion decoded so far; from is how much of it the previous call already
 * checked (0 on the first call), so each call costs O(new text + longest stop
 * string). Returns true when a stop string occurs, with *cut = the byte
 * offset where the earliest one starts: the completion to report is
 * text[0..*cut) (OpenAI semantics: the stop string is not included) and
 * finish_reason is "stop". */
bool fl_request_find_stop(const fl_request *r, const char *text, size_t len, size_t from,
                          size_t *cut);

/* ---- reading a JSONL file line by line ------------------------------------ */

typedef struct fl_request_reader fl_request_reader;

/* Opens path ("-" = stdin) for streaming: memory use is one line, however
 * large the file. */
fl_status fl_request_reader_open(const char *path, fl_request_reader **out);

/* Next line that is not blank (whitespace only). *text (NUL-terminated, line
 * terminator and a leading UTF-8 BOM removed) stays valid until the next call
 * or close. At end of file returns FL_OK with *text = NULL. FL_ERR_IO on a
 * read error. */
fl_status fl_request_reader_next(fl_request_reader *r, long *line_no, const char **text,
                                 size_t *len);

/* The path given to open ("-" for stdin). */
const char *fl_request_reader_path(const fl_request_reader *r);

void fl_request_reader_close(fl_request_reader *r);

/* ---- writing results ------------------------------------------------------- */

/* The shape of a result line. */
typedef enum fl_result_style {
    FL_RESULT_OPENAI = 0, /* OpenAI Batch output (the default; see below) */
    FL_RESULT_COMPACT,    /* {custom_id, text, prompt_tokens, completion_tokens, finish_reason} */
} fl_result_style;

/* One generated token's log-probabilities as written: the chosen token's
 * text and value, and its alternatives (most likely first). Text is any
 * bytes; it is written made valid UTF-8 and, for chat, also as "bytes". */
typedef struct fl_result_token {
    const char *text;
    size_t len;
    float logprob;
    int n_top;
    const char *const *top_text; /* [n_top] */
    const size_t *top_len;       /* [n_top] */
    const float *top_lps;        /* [n_top] */
} fl_result_token;

typedef struct fl_result_choice {
    const char *text;         /* generated text, any bytes (may be NULL when text_len is 0) */
    size_t text_len;
    long completion_tokens;
    const char *finish_reason; /* "stop" (EOS or a stop string) or "length" */
    const fl_result_token *tokens; /* [n_tokens] logprobs, or NULL: "logprobs": null */
    size_t n_tokens;
} fl_result_choice;

typedef struct fl_result {
    fl_result_style style;
    fl_request_endpoint endpoint; /* openai: the body's object kind */
    const char *custom_id;    /* NULL writes null (error records only) */
    /* error record when error_message != NULL; the fields below are unused */
    const char *error_message;
    const char *error_param;  /* openai: the field at fault, or NULL */
    int error_status;         /* openai: HTTP-like status, 0 = 400 */
    long error_line;          /* 1-based input line */
    /* success record */
    const char *model;        /* openai: body.model */
    long created;             /* openai: Unix seconds */
    long prompt_tokens;
    const fl_result_choice *choices; /* [n_choices]; compact: exactly one */
    int n_choices;
} fl_result;

/* Appends one result line to f (one fwrite, then fflush). FL_ERR_IO when the
 * write fails (errno's text in the message). */
fl_status fl_result_write(FILE *f, const fl_result *r);

/* The result line (with its '\n') as a malloc'd string, for callers that
 * gather output elsewhere (e.g. a rank that sends it to the writer rank). */
fl_status fl_result_format(const fl_result *r, char **out, size_t *out_len);

/* ---- HTTP responses (flotilla serve) ---------------------------------------- */

/* The OpenAI response body alone (r->style is ignored): the completion or
 * chat.completion object, or {"error": {message, type, param, code}} (with
 * "line" only when error_line > 0). Malloc'd JSON text without a newline.
 * The object's id derives from r->custom_id, as in the batch output. */
fl_status fl_result_body_format(const fl_result *r, char **out, size_t *out_len);

/* One streamed chunk of choice `index` (OpenAI's chunk shapes:
 * "text_completion" with "text", or "chat.completion.chunk" with "delta"
 * {role on the first chunk, content}, and "logprobs" in the whole
 * response's shape for the chunk's tokens). usage = true: the final chunk of
 * stream_options.include_usage instead (no choices, usage from
 * r->prompt_tokens and completion_tokens). */
typedef struct fl_result_chunk {
    int index;
    const char *text;          /* new text, any bytes */
    size_t len;
    bool first;                /* chat: the choice's first chunk carries the role */
    const char *finish_reason; /* NULL: null (more to come) */
    bool usage;
    long completion_tokens;    /* usage chunk: every choice's tokens */
    /* the logprobs of the tokens this chunk carries ("logprobs": null when
     * tokens is NULL); text_offset: completions' offset of the first, the
     * bytes of the choice's tokens in earlier chunks */
    const fl_result_token *tokens;
    size_t n_tokens;
    size_t text_offset;
} fl_result_chunk;
fl_status fl_result_chunk_format(const fl_result *r, const fl_result_chunk *ch, char **out,
                                 size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif /* FL_REQUEST_H */
