/*
 * request.c — parsing of batch request lines, a streaming JSONL reader and
 * the result writer (formats in request.h).
 *
 * Every user mistake becomes an FL_ERR_FORMAT naming file, line and the JSON
 * path of the field ("body.messages[1].content"), because in a batch of a
 * million lines "invalid request" alone is useless. The launcher turns such
 * a failure into an error record for that line and carries on.
 *
 * cJSON does not validate UTF-8 and cannot hold NUL inside strings, so text
 * going out is sanitized first (invalid bytes and NUL -> U+FFFD), and a
 * request holding an escaped NUL ("\u0000") is refused, naming the field,
 * rather than cut at the NUL.
 */
#define _GNU_SOURCE /* memmem */
#include "runtime/engine/request.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <utf8proc.h>

/* ---- errors ------------------------------------------------------------------ */

typedef struct ctx {
    const char *file; /* NULL: an HTTP body, messages carry no "file:line: " */
    long line;
    bool http;        /* flotilla serve: "stream" and "stream_options" are accepted */
} ctx;

static fl_status bad(const ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static fl_status bad(const ctx *c, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!c->file) return FL_ERR(FL_ERR_FORMAT, "%s", msg);
    return FL_ERR(FL_ERR_FORMAT, "%s:%ld: %s", c->file, c->line, msg);
}

/* ---- field helpers ----------------------------------------------------------- */

/* Optional member: NULL when absent or JSON null. */
static const cJSON *opt(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static fl_status get_number(const ctx *c, const cJSON *v, const char *path, double *out) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return bad(c, "%s must be a number", path);
    *out = v->valuedouble;
    return FL_OK;
}

/* A number the sampler keeps as a float: one beyond float's range would
 * become infinity, and a tiny positive one zero, so the bounds are checked
 * on the float. */
static fl_status get_float(const ctx *c, const cJSON *v, const char *path, float *out) {
    double d = 0;
    FL_TRY(get_number(c, v, path, &d));
    if (isinf((float)d)) return bad(c, "%s is out of range (got %g)", path, d);
    *out = (float)d;
    return FL_OK;
}

static fl_status get_int(const ctx *c, const cJSON *v, const char *path, double lo, double hi,
                         double *out) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || floor(v->valuedouble) != v->valuedouble)
        return bad(c, "%s must be an integer", path);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return bad(c, "%s must be between %.0f and %.0f (got %.0f)", path, lo, hi, v->valuedouble);
    *out = v->valuedouble;
    return FL_OK;
}

static char *dup_str(const char *s, fl_status *st) {
    char *d = strdup(s);
    if (!d) *st = FL_ERR(FL_ERR_OOM, "out of memory copying a request string");
    return d;
}

/* A message content: a string, or an array of {"type": "text", "text": "..."}. */
static fl_status get_content(const ctx *c, const cJSON *v, size_t idx, char **out) {
    fl_status st = FL_OK;
    if (cJSON_IsString(v)) {
        *out = dup_str(v->valuestring, &st);
        return st;
    }
    if (!cJSON_IsArray(v))
        return bad(c, "body.messages[%zu].content must be a string (or an array of text parts)",
                   idx);
    size_t total = 0, k = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, v) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsObject(part) || !cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0)
            return bad(c, "body.messages[%zu].content[%zu] must be a {\"type\": \"text\", ...} part "
                          "(only text is supported)", idx, k);
        if (!cJSON_IsString(text))
            return bad(c, "body.messages[%zu].content[%zu].text must be a string", idx, k);
        total += strlen(text->valuestring);
        k++;
    }
    char *s = malloc(total + 1);
    if (!s) return FL_ERR(FL_ERR_OOM, "out of memory joining message content parts");
    size_t off = 0;
    cJSON_ArrayForEach(part, v) {
        const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
        size_t n = strlen(t);
        memcpy(s + off, t, n);
        off += n;
    }
    s[off] = 0;
    *out = s;
    return FL_OK;
}

static fl_status parse_messages(const ctx *c, const cJSON *msgs, fl_request *r) {
    if (!cJSON_IsArray(msgs)) return bad(c, "body.messages must be an array");
    size_t n = (size_t)cJSON_GetArraySize(msgs);
    if (n == 0) return bad(c, "body.messages must not be empty");
    r->messages = calloc(n, sizeof *r->messages);
    if (!r->messages) return FL_ERR(FL_ERR_OOM, "out of memory for %zu messages", n);
    const cJSON *m;
    size_t i = 0;
    cJSON_ArrayForEach(m, msgs) {
        if (!cJSON_IsObject(m)) return bad(c, "body.messages[%zu] must be an object", i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsString(role)) return bad(c, "body.messages[%zu].role must be a string", i);
        if (strcmp(role->valuestring, "system") != 0 && strcmp(role->valuestring, "user") != 0 &&
            strcmp(role->valuestring, "assistant") != 0)
            return bad(c, "body.messages[%zu].role must be \"system\", \"user\" or \"assistant\" "
                          "(got \"%.64s\")", i, role->valuestring);
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!content) return bad(c, "body.messages[%zu].content is missing", i);
        fl_status st = FL_OK;
        r->messages[i].role = dup_str(role->valuestring, &st);
        r->n_messages = i + 1; /* so fl_request_free sees what was filled */
        FL_TRY(st);
        FL_TRY(get_content(c, content, i, &r->messages[i].content));
        i++;
    }
    return FL_OK;
}

static fl_status parse_stop(const ctx *c, const cJSON *v, fl_request *r) {
    fl_status st = FL_OK;
    if (cJSON_IsString(v)) {
        if (!v->valuestring[0]) return bad(c, "body.stop must not be an empty string");
        r->stop = calloc(1, sizeof(char *));
        if (!r->stop) return FL_ERR(FL_ERR_OOM, "out of memory for stop strings");
        r->stop[0] = dup_str(v->valuestring, &st);
        r->n_stop = 1;
        return st;
    }
    if (!cJSON_IsArray(v)) return bad(c, "body.stop must be a string or an array of strings");
    size_t n = (size_t)cJSON_GetArraySize(v);
    if (n == 0) return FL_OK;
    r->stop = calloc(n, sizeof(char *));
    if (!r->stop) return FL_ERR(FL_ERR_OOM, "out of memory for stop strings");
    const cJSON *s;
    size_t i = 0;
    cJSON_ArrayForEach(s, v) {
        if (!cJSON_IsString(s)) return bad(c, "body.stop[%zu] must be a string", i);
        if (!s->valuestring[0]) return bad(c, "body.stop[%zu] must not be empty", i);
        r->stop[i] = dup_str(s->valuestring, &st);
        r->n_stop = ++i;
        FL_TRY(st);
    }
    return FL_OK;
}

static fl_status parse_sampling(const ctx *c, const cJSON *body, fl_request *r) {
    const cJSON *v;
    double d = 0; /* set by get_int before each use; gcc 13 cannot see it */
    float f = 0;
    fl_sampling_params *p = &r->sampling;
    if ((v = opt(body, "temperature"))) {
        FL_TRY(get_float(c, v, "body.temperature", &f));
        if (f < 0) return bad(c, "body.temperature must be >= 0 (got %g)", (double)f);
        p->temperature = f;
        r->sampling_given |= FL_REQUEST_HAS_TEMPERATURE;
    }
    if ((v = opt(body, "top_p"))) {
        FL_TRY(get_float(c, v, "body.top_p", &f));
        if (!(f > 0 && f <= 1)) return bad(c, "body.top_p must be in (0, 1] (got %g)", v->valuedouble);
        p->top_p = f;
        r->sampling_given |= FL_REQUEST_HAS_TOP_P;
    }
    if ((v = opt(body, "top_k"))) {
        FL_TRY(get_int(c, v, "body.top_k", -1, 2147483647.0, &d));
        p->top_k = d < 0 ? 0 : (int)d; /* -1 = off, as in vLLM */
        r->sampling_given |= FL_REQUEST_HAS_TOP_K;
    }
    if ((v = opt(body, "min_p"))) {
        FL_TRY(get_float(c, v, "body.min_p", &f));
        if (!(f >= 0 && f <= 1)) return bad(c, "body.min_p must be in [0, 1] (got %g)", v->valuedouble);
        p->min_p = f;
        r->sampling_given |= FL_REQUEST_HAS_MIN_P;
    }
    if ((v = opt(body, "repetition_penalty"))) {
        FL_TRY(get_float(c, v, "body.repetition_penalty", &f));
        if (!(f > 0)) return bad(c, "body.repetition_penalty must be > 0 (got %g)", v->valuedouble);
        p->repetition_penalty = f;
        r->sampling_given |= FL_REQUEST_HAS_REPETITION_PENALTY;
    }
    if ((v = opt(body, "seed"))) {
        /* JSON numbers reach us as doubles: integers are exact up to 2^53. */
        FL_TRY(get_int(c, v, "body.seed", -9007199254740992.0, 9007199254740992.0, &d));
        p->seed = (uint64_t)(int64_t)d;
        r->sampling_given |= FL_REQUEST_HAS_SEED;
    }
    return FL_OK;
}

/* Refuses a field flotilla does not implement, naming it (r->param). */
static fl_status refuse(const ctx *c, fl_request *r, const char *field, const char *why) {
    snprintf(r->param, sizeof r->param, "%s", field);
    return bad(c, "body.%s is not supported by flotilla%s%s", field, why ? ": " : "", why ? why : "");
}

/* The OpenAI fields beyond the sampling parameters: n, logprobs, the
 * penalties, vLLM's min_tokens / ignore_eos, and the refusal of fields that
 * would change the answer's meaning if dropped. */
static fl_status parse_openai(const ctx *c, const cJSON *body, fl_request *r) {
    static const char *const never[] = {
        "response_format", "tools", "tool_choice", "functions", "function_call", "logit_bias",
        "suffix", "parallel_tool_calls", "audio", "modalities", "prediction",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
        "web_search_options", "prompt_logprobs",
    };
    const cJSON *v;
    double d = 0;
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++)
        if (opt(body, never[i])) return refuse(c, r, never[i], NULL);
    if (!c->http) {
        if ((v = opt(body, "stream")) && !cJSON_IsFalse(v))
            return refuse(c, r, "stream", "batch results are written whole");
        if (opt(body, "stream_options")) return refuse(c, r, "stream_options", NULL);
    } else {
        if ((v = opt(body, "stream")) && !cJSON_IsBool(v))
            return bad(c, "body.stream must be true or false");
        r->stream = v && cJSON_IsTrue(v);
        const cJSON *so = opt(body, "stream_options");
        if (so) {
            if (!cJSON_IsObject(so)) return bad(c, "body.stream_options must be an object");
            if (!r->stream) return bad(c, "body.stream_options needs \"stream\": true");
            const cJSON *iu = opt(so, "include_usage");
            if (iu && !cJSON_IsBool(iu))
                return bad(c, "body.stream_options.include_usage must be true or false");
            r->stream_include_usage = iu && cJSON_IsTrue(iu);
        }
    }
    if ((v = opt(body, "echo")) && !cJSON_IsFalse(v)) return refuse(c, r, "echo", NULL);
    if ((v = opt(body, "model"))) {
        fl_status st = FL_OK;
        if (!cJSON_IsString(v)) return bad(c, "body.model must be a string");
        r->model = dup_str(v->valuestring, &st);
        FL_TRY(st);
    }
    r->n = 1;
    if ((v = opt(body, "n"))) {
        FL_TRY(get_int(c, v, "body.n", 1, FL_REQUEST_MAX_N, &d));
        r->n = (int)d;
    }
    if ((v = opt(body, "best_of"))) {
        FL_TRY(get_int(c, v, "body.best_of", 1, FL_REQUEST_MAX_N, &d));
        if ((int)d != r->n) return refuse(c, r, "best_of", "only best_of = n is implemented");
    }
    const cJSON *lp = opt(body, "logprobs"), *tl = opt(body, "top_logprobs");
    if (r->endpoint == FL_REQUEST_CHAT) {
        if (lp && !cJSON_IsBool(lp)) return bad(c, "body.logprobs must be true or false (chat)");
        r->logprobs = lp && cJSON_IsTrue(lp);
        if (tl) {
            FL_TRY(get_int(c, tl, "body.top_logprobs", 0, FL_SAMPLER_MAX_TOP_LOGPROBS, &d));
            if (!r->logprobs) return bad(c, "body.top_logprobs needs \"logprobs\": true");
            r->top_logprobs = (int)d;
        }
    } else {
        if (tl) return bad(c, "body.top_logprobs is a chat field; completions take \"logprobs\": N");
        if (lp) {
            FL_TRY(get_int(c, lp, "body.logprobs", 0, FL_SAMPLER_MAX_TOP_LOGPROBS, &d));
            r->logprobs = true;
            r->top_logprobs = (int)d;
        }
    }
    if ((v = opt(body, "presence_penalty"))) {
        FL_TRY(get_number(c, v, "body.presence_penalty", &d));
        if (d < -2 || d > 2) return bad(c, "body.presence_penalty must be in [-2, 2] (got %g)", d);
        r->presence_penalty = (float)d;
    }
    if ((v = opt(body, "frequency_penalty"))) {
        FL_TRY(get_number(c, v, "body.frequency_penalty", &d));
        if (d < -2 || d > 2) return bad(c, "body.frequency_penalty must be in [-2, 2] (got %g)", d);
        r->frequency_penalty = (float)d;
    }
    if ((v = opt(body, "min_tokens"))) {
        FL_TRY(get_int(c, v, "body.min_tokens", 0, 2147483647.0, &d));
        r->min_tokens = (int)d;
    }
    if ((v = opt(body, "ignore_eos"))) {
        if (!cJSON_IsBool(v)) return bad(c, "body.ignore_eos must be true or false");
        r->ignore_eos = cJSON_IsTrue(v);
    }
    return FL_OK;
}

static fl_status parse_body(const ctx *c, const cJSON *body, bool url_given, fl_request *r) {
    fl_status st = FL_OK;
    const cJSON *prompt = opt(body, "prompt"), *msgs = opt(body, "messages");
    if (prompt && msgs) return bad(c, "body has both \"prompt\" and \"messages\"; give exactly one");
    if (!prompt && !msgs) return bad(c, "body needs \"prompt\" (a string) or \"messages\" (an array)");
    if (r->endpoint == FL_REQUEST_CHAT && !msgs)
        return bad(c, "url /v1/chat/completions needs body.messages");
    if (r->endpoint == FL_REQUEST_COMPLETIONS && !prompt && url_given)
        return bad(c, "url /v1/completions needs body.prompt");
    if (!url_given) r->endpoint = prompt ? FL_REQUEST_COMPLETIONS : FL_REQUEST_CHAT;
    if (prompt) {
        if (!cJSON_IsString(prompt)) return bad(c, "body.prompt must be a string");
        r->prompt = dup_str(prompt->valuestring, &st);
        FL_TRY(st);
    } else {
        FL_TRY(parse_messages(c, msgs, r));
    }

    const cJSON *mt = opt(body, "max_tokens"), *mct = opt(body, "max_completion_tokens");
    double a = -1, b = -1;
    if (mt) FL_TRY(get_int(c, mt, "body.max_tokens", 1, 2147483647.0, &a));
    if (mct) FL_TRY(get_int(c, mct, "body.max_completion_tokens", 1, 2147483647.0, &b));
    if (mt && mct && a != b)
        return bad(c, "body.max_tokens (%.0f) and body.max_completion_tokens (%.0f) disagree", a, b);
    r->max_tokens = mct ? (int)b : mt ? (int)a : -1;

    FL_TRY(parse_openai(c, body, r));
    FL_TRY(parse_sampling(c, body, r));
    const cJSON *stop = opt(body, "stop");
    if (stop) FL_TRY(parse_stop(c, stop, r));
    return FL_OK;
}

/* ---- escaped NUL ------------------------------------------------------------ */

/* Where an escaped NUL would be: each \u0000 escape becomes U+FFFF (a
 * noncharacter, "\xEF\xBF\xBF" once parsed), so the parsed copy shows which
 * string held it. */
static const char nul_mark[] = "\xEF\xBF\xBF";

static bool find_mark(const cJSON *v, char *path, size_t n, size_t w) {
    const cJSON *c;
    size_t i = 0;
    if (cJSON_IsString(v)) return strstr(v->valuestring, nul_mark) != NULL;
    cJSON_ArrayForEach(c, v) {
        size_t k;
        if (cJSON_IsObject(v)) {
            k = (size_t)snprintf(path + w, n - w, "%s%s", w ? "." : "", c->string);
            if (strstr(c->string, nul_mark)) return true; /* the key itself */
        } else {
            k = (size_t)snprintf(path + w, n - w, "[%zu]", i);
        }
        if (w + k < n && find_mark(c, path, n, w + k)) return true;
        path[w] = 0;
        i++;
    }
    return false;
}

bool fl_request_find_nul_escape(const char *text, size_t len, char *path, size_t n) {
    bool found = false;
    if (n) path[0] = 0;
    for (size_t i = 0; i + 5 < len; i++) {
        if (text[i] != '\\') continue;
        if (text[i + 1] == 'u' && !memcmp(text + i + 2, "0000", 4)) {
            found = true;
            break;
        }
        i++; /* the escaped character: "\\u0000" is a backslash and text */
    }
    if (!found || n == 0) return found;
    char *copy = malloc(len + 1);
    if (!copy) return true;
    memcpy(copy, text, len);
    copy[len] = 0;
    for (size_t i = 0; i + 5 < len; i++) {
        if (copy[i] != '\\') continue;
        if (copy[i + 1] == 'u' && !memcmp(copy + i + 2, "0000", 4)) memcpy(copy + i + 2, "FFFF", 4);
        i++;
    }
    cJSON *j = cJSON_ParseWithLength(copy, len);
    if (j && !find_mark(j, path, n, 0)) path[0] = 0;
    cJSON_Delete(j);
    free(copy);
    return true;
}

fl_status fl_request_parse(const char *line, size_t len, long line_no, const char *file,
                           fl_request *out) {
    if (!out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_request_parse: out is NULL");
    memset(out, 0, sizeof *out);
    out->line = line_no;
    out->max_tokens = -1;
    out->n = 1;
    fl_sampling_params_default(&out->sampling);
    const ctx c = {file ? file : "<input>", line_no, false};
    if (!line) return bad(&c, "no text");
    if (memchr(line, 0, len)) return bad(&c, "line contains a NUL byte");

    fl_status st = FL_OK;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    if (!root) {
        long at = end ? (long)(end - line) : 0;
        st = bad(&c, "not valid JSON (error near byte %ld)", at + 1);
        goto fail;
    }
    for (const char *p = end; p < line + len; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') {
            st = bad(&c, "unexpected text after the JSON object (byte %ld)", (long)(p - line) + 1);
            goto fail;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = bad(&c, "a request line must be a JSON object");
        goto fail;
    }
    /* cJSON strings end at their first NUL: a "\u0000" would silently cut
     * the prompt (or a stop string, or the id), so the request is refused */
    char nul_path[256];
    bool nul = fl_request_find_nul_escape(line, len, nul_path, sizeof nul_path);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(root, "custom_id");
    if (!id) {
        st = bad(&c, "custom_id is missing");
        goto fail;
    }
    if (nul && !strcmp(nul_path, "custom_id")) {
        st = bad(&c, "custom_id contains an escaped NUL (\\u0000); strings with NUL characters "
                 "are refused");
        goto fail;
    }
    if (!cJSON_IsString(id) || !id->valuestring[0]) {
        st = bad(&c, "custom_id must be a non-empty string");
        goto fail;
    }
    out->custom_id = dup_str(id->valuestring, &st);
    if (st != FL_OK) goto fail;
    if (nul) {
        st = bad(&c, "%s contains an escaped NUL (\\u0000); strings with NUL characters are "
                 "refused", nul_path[0] ? nul_path : "a string");
        goto fail;
    }
    const cJSON *method = opt(root, "method"), *url = opt(root, "url");
    if (method && (!cJSON_IsString(method) || strcmp(method->valuestring, "POST") != 0)) {
        st = bad(&c, "method must be \"POST\"");
        goto fail;
    }
    if (url) {
        if (cJSON_IsString(url) && !strcmp(url->valuestring, "/v1/completions")) {
            out->endpoint = FL_REQUEST_COMPLETIONS;
        } else if (cJSON_IsString(url) && !strcmp(url->valuestring, "/v1/chat/completions")) {
            out->endpoint = FL_REQUEST_CHAT;
        } else {
            st = bad(&c, "url must be \"/v1/completions\" or \"/v1/chat/completions\" (the "
                     "endpoints flotilla serves)");
            goto fail;
        }
    }
    const cJSON *body = cJSON_GetObjectItemCaseSensitive(root, "body");
    if (!body) {
        st = bad(&c, "body is missing");
        goto fail;
    }
    if (!cJSON_IsObject(body)) {
        st = bad(&c, "body must be an object");
        goto fail;
    }
    FL_TRY_GOTO(parse_body(&c, body, url != NULL, out), st, fail);
    cJSON_Delete(root);
    return FL_OK;

fail:
    cJSON_Delete(root);
    {
        /* Keep only what an error record needs. */
        char *keep_id = out->custom_id;
        char keep_param[sizeof out->param];
        memcpy(keep_param, out->param, sizeof keep_param);
        out->custom_id = NULL;
        fl_request_free(out);
        out->custom_id = keep_id;
        memcpy(out->param, keep_param, sizeof keep_param);
        out->n = 1;
        out->line = line_no;
        out->max_tokens = -1;
        fl_sampling_params_default(&out->sampling);
    }
    return st;
}

fl_status fl_request_parse_body(const char *text, size_t len, fl_request_endpoint endpoint,
                                fl_request *out) {
    if (!out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_request_parse_body: out is NULL");
    memset(out, 0, sizeof *out);
    out->max_tokens = -1;
    out->n = 1;
    out->endpoint = endpoint;
    fl_sampling_params_default(&out->sampling);
    const ctx c = {NULL, 0, true};
    if (!text || len == 0) return bad(&c, "the request body is empty (a JSON object is expected)");
    if (memchr(text, 0, len)) return bad(&c, "the request body contains a NUL byte");
    fl_status st = FL_OK;
    const char *end = NULL;
    char nul_path[256];
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root) {
        st = bad(&c, "the body is not valid JSON (error near byte %ld)",
                 (end ? (long)(end - text) : 0) + 1);
        goto fail;
    }
    for (const char *p = end; p < text + len; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') {
            st = bad(&c, "unexpected text after the JSON object (byte %ld)", (long)(p - text) + 1);
            goto fail;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = bad(&c, "the request body must be a JSON object");
        goto fail;
    }
    if (fl_request_find_nul_escape(text, len, nul_path, sizeof nul_path)) {
        st = bad(&c, "body%s%s contains an escaped NUL (\\u0000); strings with NUL characters are "
                 "refused", nul_path[0] ? "." : "", nul_path);
        goto fail;
    }
    FL_TRY_GOTO(parse_body(&c, root, true, out), st, fail);
    cJSON_Delete(root);
    return FL_OK;
fail:
    cJSON_Delete(root);
    {
        char keep_param[sizeof out->param];
        memcpy(keep_param, out->param, sizeof keep_param);
        fl_request_free(out);
        memcpy(out->param, keep_param, sizeof keep_param);
        out->n = 1;
        out->max_tokens = -1;
        out->endpoint = endpoint;
        fl_sampling_params_default(&out->sampling);
    }
    return st;
}

void fl_request_free(fl_request *r) {
    if (!r) return;
    free(r->custom_id);
    free(r->model);
    free(r->prompt);
    for (size_t i = 0; i < r->n_messages; i++) {
        free(r->messages[i].role);
        free(r->messages[i].content);
    }
    free(r->messages);
    for (size_t i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    memset(r, 0, sizeof *r);
}

void fl_request_sampling(const fl_request *r, const fl_sampling_params *job_defaults,
                         fl_sampling_params *out) {
    fl_sampling_params d;
    if (job_defaults) d = *job_defaults;
    else fl_sampling_params_default(&d);
    if (r) {
        const unsigned g = r->sampling_given;
        if (g & FL_REQUEST_HAS_TEMPERATURE) d.temperature = r->sampling.temperature;
        if (g & FL_REQUEST_HAS_TOP_P) d.top_p = r->sampling.top_p;
        if (g & FL_REQUEST_HAS_TOP_K) d.top_k = r->sampling.top_k;
        if (g & FL_REQUEST_HAS_MIN_P) d.min_p = r->sampling.min_p;
        if (g & FL_REQUEST_HAS_REPETITION_PENALTY) d.repetition_penalty = r->sampling.repetition_penalty;
        if (g & FL_REQUEST_HAS_SEED) d.seed = r->sampling.seed;
    }
    *out = d;
}

bool fl_request_find_stop(const fl_request *r, const char *text, size_t len, size_t from,
                          size_t *cut) {
    if (!r || !text || r->n_stop == 0) return false;
    size_t longest = 0;
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t k = strlen(r->stop[i]);
        if (k > longest) longest = k;
    }
    if (from > len) from = len;
    /* A new match ends after `from`, so it starts at or after this. */
    size_t start = from >= longest ? from - longest + 1 : 0;
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t k = strlen(r->stop[i]);
        if (k == 0 || start >= len) continue;
        const char *hit = memmem(text + start, len - start, r->stop[i], k);
        if (hit && (size_t)(hit - text) < best) best = (size_t)(hit - text);
    }
    if (best == SIZE_MAX) return false;
    if (cut) *cut = best;
    return true;
}

/* ---- reader -------------------------------------------------------------------- */

struct fl_request_reader {
    FILE *f;
    bool owns;
    char *path;
    char *buf;
    size_t cap;
    long line_no;
};

fl_status fl_request_reader_open(const char *path, fl_request_reader **out) {
    if (!path || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_request_reader_open: NULL argument");
    *out = NULL;
    fl_request_reader *r = calloc(1, sizeof *r);
    if (!r) return FL_ERR(FL_ERR_OOM, "out of memory opening %s", path);
    r->path = strdup(path);
    if (!r->path) {
        free(r);
        return FL_ERR(FL_ERR_OOM, "out of memory opening %s", path);
    }
    if (strcmp(path, "-") == 0) {
        r->f = stdin;
    } else {
        r->f = fopen(path, "rb");
        r->owns = true;
        if (!r->f) {
            fl_status st = FL_ERR(FL_ERR_IO, "cannot open request file %s: %s", path, strerror(errno));
            free(r->path);
            free(r);
            return st;
        }
    }
    *out = r;
    return FL_OK;
}

fl_status fl_request_reader_next(fl_request_reader *r, long *line_no, const char **text,
                                 size_t *len) {
    if (!r || !text) return FL_ERR(FL_ERR_INVALID_ARG, "fl_request_reader_next: NULL argument");
    *text = NULL;
    if (len) *len = 0;
    for (;;) {
        errno = 0;
        ssize_t n = getline(&r->buf, &r->cap, r->f);
        if (n < 0) {
            if (ferror(r->f))
                return FL_ERR(FL_ERR_IO, "reading %s after line %ld: %s", r->path, r->line_no,
                              strerror(errno ? errno : EIO));
            return FL_OK; /* end of file */
        }
        r->line_no++;
        char *s = r->buf;
        size_t l = (size_t)n;
        while (l > 0 && (s[l - 1] == '\n' || s[l - 1] == '\r')) s[--l] = 0;
        if (r->line_no == 1 && l >= 3 && memcmp(s, "\xEF\xBB\xBF", 3) == 0) {
            s += 3;
            l -= 3;
        }
        size_t i = 0;
        while (i < l && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\f' || s[i] == '\v'))
            i++;
        if (i == l) continue; /* blank */
        *text = s;
        if (len) *len = l;
        if (line_no) *line_no = r->line_no;
        return FL_OK;
    }
}

const char *fl_request_reader_path(const fl_request_reader *r) { return r ? r->path : NULL; }

void fl_request_reader_close(fl_request_reader *r) {
    if (!r) return;
    if (r->owns && r->f) fclose(r->f);
    free(r->buf);
    free(r->path);
    free(r);
}

/* ---- writer -------------------------------------------------------------------- */

/* Valid UTF-8 copy of s[0..n): every byte that does not start a valid
 * sequence, and every NUL, becomes U+FFFD. */
static char *utf8_sanitize(const char *s, size_t n) {
    char *o = malloc(3 * n + 1); /* worst case: every byte -> 3-byte U+FFFD */
    if (!o) return NULL;
    size_t w = 0, i = 0;
    while (i < n) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k =
            utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
        if (k <= 0 || cp == 0) {
            memcpy(o + w, "\xEF\xBF\xBD", 3);
            w += 3;
            i += 1;
        } else {
            memcpy(o + w, s + i, (size_t)k);
            w += (size_t)k;
            i += (size_t)k;
        }
    }
    o[w] = 0;
    return o;
}

static bool add_str(cJSON *obj, const char *key, const char *s, size_t n) {
    char *clean = utf8_sanitize(s ? s : "", s ? n : 0);
    if (!clean) return false;
    cJSON *v = cJSON_AddStringToObject(obj, key, clean);
    free(clean);
    return v != NULL;
}

/* obj[s] = value, the key s made valid UTF-8; a key already there is kept
 * (the chosen token comes first, and JSON objects need unique keys). */
static bool add_str_key(cJSON *obj, const char *s, size_t n, double value) {
    char *clean = utf8_sanitize(s ? s : "", s ? n : 0);
    if (!clean) return false;
    bool ok = cJSON_GetObjectItemCaseSensitive(obj, clean) ||
              cJSON_AddNumberToObject(obj, clean, value) != NULL;
    free(clean);
    return ok;
}

/* Ids derived from the custom_id (FNV-1a 64): stable across a resumed job. */
static void hex_id(char *buf, size_t n, const char *prefix, const fl_result *r) {
    uint64_t h = 14695981039346656037ull;
    char lb[32];
    const char *s = r->custom_id;
    if (!s) {
        snprintf(lb, sizeof lb, "\x01line %ld", r->error_line);
        s = lb;
    }
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    snprintf(buf, n, "%s%016llx", prefix, (unsigned long long)h);
}

static cJSON *bytes_array(const char *s, size_t n) {
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++)
        if (!cJSON_AddItemToArray(a, cJSON_CreateNumber((unsigned char)s[i]))) {
            cJSON_Delete(a);
            return NULL;
        }
    return a;
}

static bool add_item(cJSON *obj, const char *key, cJSON *item) {
    if (!item) return false;
    if (!cJSON_AddItemToObject(obj, key, item)) {
        cJSON_Delete(item);
        return false;
    }
    return true;
}

/* A choice's "logprobs" in the endpoint's shape for tokens[n]; off0 is
 * the completions text_offset of the first (a stream's later chunks go on
 * from where the earlier ones ended). */
static cJSON *logprobs_json(fl_request_endpoint ep, const fl_result_token *tokens, size_t n,
                            size_t off0) {
    if (!tokens) return cJSON_CreateNull();
    cJSON *o = cJSON_CreateObject();
    bool ok = o != NULL;
    if (ep == FL_REQUEST_CHAT) {
        cJSON *content = ok ? cJSON_AddArrayToObject(o, "content") : NULL;
        ok = content != NULL;
        for (size_t i = 0; ok && i < n; i++) {
            const fl_result_token *t = &tokens[i];
            cJSON *e = cJSON_CreateObject();
            ok = e && cJSON_AddItemToArray(content, e) && add_str(e, "token", t->text, t->len) &&
                 cJSON_AddNumberToObject(e, "logprob", t->logprob) &&
                 add_item(e, "bytes", bytes_array(t->text, t->len));
            cJSON *tops = ok ? cJSON_AddArrayToObject(e, "top_logprobs") : NULL;
            ok = ok && tops;
            for (int k = 0; ok && k < t->n_top; k++) {
                cJSON *a = cJSON_CreateObject();
                ok = a && cJSON_AddItemToArray(tops, a) &&
                     add_str(a, "token", t->top_text[k], t->top_len[k]) &&
                     cJSON_AddNumberToObject(a, "logprob", t->top_lps[k]) &&
                     add_item(a, "bytes", bytes_array(t->top_text[k], t->top_len[k]));
            }
        }
    } else {
        cJSON *toks = ok ? cJSON_AddArrayToObject(o, "tokens") : NULL;
        cJSON *lps = ok ? cJSON_AddArrayToObject(o, "token_logprobs") : NULL;
        cJSON *tops = ok ? cJSON_AddArrayToObject(o, "top_logprobs") : NULL;
        cJSON *offs = ok ? cJSON_AddArrayToObject(o, "text_offset") : NULL;
        ok = toks && lps && tops && offs;
        size_t off = off0;
        for (size_t i = 0; ok && i < n; i++) {
            const fl_result_token *t = &tokens[i];
            char *clean = utf8_sanitize(t->text ? t->text : "", t->text ? t->len : 0);
            cJSON *d = cJSON_CreateObject();
            ok = clean && d && cJSON_AddItemToArray(toks, cJSON_CreateString(clean)) &&
                 cJSON_AddItemToArray(lps, cJSON_CreateNumber(t->logprob)) &&
                 cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
            free(clean);
            if (!ok) {
                cJSON_Delete(d);
                break;
            }
            ok = cJSON_AddItemToArray(tops, d);
            /* the chosen token first, so it is there even when outside the top N */
            ok = ok && add_str_key(d, t->text, t->len, t->logprob);
            for (int k = 0; ok && k < t->n_top; k++)
                ok = add_str_key(d, t->top_text[k], t->top_len[k], t->top_lps[k]);
            off += t->len;
        }
    }
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

/* The OpenAI response body: a completion object, or {"error": {...}}. */
static bool build_body(const fl_result *r, cJSON *body) {
    char id[64];
    bool ok = true;
    if (r->error_message) {
        cJSON *e = cJSON_AddObjectToObject(body, "error");
        const int status = r->error_status ? r->error_status : 400;
        ok = e && add_str(e, "message", r->error_message, strlen(r->error_message)) &&
             cJSON_AddStringToObject(e, "type", status < 500 ? "invalid_request_error" : "server_error") &&
             (r->error_param && r->error_param[0]
                  ? add_str(e, "param", r->error_param, strlen(r->error_param))
                  : cJSON_AddNullToObject(e, "param") != NULL) &&
             cJSON_AddNullToObject(e, "code") &&
             (r->error_line <= 0 || cJSON_AddNumberToObject(e, "line", (double)r->error_line));
    } else {
        const bool chat = r->endpoint == FL_REQUEST_CHAT;
        hex_id(id, sizeof id, chat ? "chatcmpl-" : "cmpl-", r);
        long completion = 0;
        ok = cJSON_AddStringToObject(body, "id", id) &&
             cJSON_AddStringToObject(body, "object", chat ? "chat.completion" : "text_completion") &&
             cJSON_AddNumberToObject(body, "created", (double)r->created) &&
             add_str(body, "model", r->model ? r->model : "", r->model ? strlen(r->model) : 0);
        cJSON *choices = ok ? cJSON_AddArrayToObject(body, "choices") : NULL;
        ok = ok && choices;
        for (int i = 0; ok && i < r->n_choices; i++) {
            const fl_result_choice *ch = &r->choices[i];
            cJSON *c = cJSON_CreateObject();
            ok = c && cJSON_AddItemToArray(choices, c) && cJSON_AddNumberToObject(c, "index", i);
            if (ok && chat) {
                cJSON *m = cJSON_AddObjectToObject(c, "message");
                ok = m && cJSON_AddStringToObject(m, "role", "assistant") &&
                     add_str(m, "content", ch->text, ch->text_len);
            } else if (ok) {
                ok = add_str(c, "text", ch->text, ch->text_len);
            }
            ok = ok && add_item(c, "logprobs", logprobs_json(r->endpoint, ch->tokens, ch->n_tokens, 0)) &&
                 cJSON_AddStringToObject(c, "finish_reason",
                                         ch->finish_reason ? ch->finish_reason : "stop");
            completion += ch->completion_tokens;
        }
        cJSON *u = ok ? cJSON_AddObjectToObject(body, "usage") : NULL;
        ok = ok && u && cJSON_AddNumberToObject(u, "prompt_tokens", (double)r->prompt_tokens) &&
             cJSON_AddNumberToObject(u, "completion_tokens", (double)completion) &&
             cJSON_AddNumberToObject(u, "total_tokens", (double)(r->prompt_tokens + completion));
    }
    return ok;
}

static fl_status format_openai(const fl_result *r, cJSON *o) {
    char id[64];
    bool ok = true;
    hex_id(id, sizeof id, "batch_req_", r);
    ok = cJSON_AddStringToObject(o, "id", id) != NULL;
    ok = ok && (r->custom_id ? add_str(o, "custom_id", r->custom_id, strlen(r->custom_id))
                             : cJSON_AddNullToObject(o, "custom_id") != NULL);
    cJSON *resp = ok ? cJSON_AddObjectToObject(o, "response") : NULL;
    ok = resp != NULL;
    hex_id(id, sizeof id, "req_", r);
    ok = ok && cJSON_AddNumberToObject(resp, "status_code",
                                       r->error_message ? (r->error_status ? r->error_status : 400) : 200) &&
         cJSON_AddStringToObject(resp, "request_id", id);
    cJSON *body = ok ? cJSON_AddObjectToObject(resp, "body") : NULL;
    ok = ok && body;
    ok = ok && build_body(r, body);
    ok = ok && cJSON_AddNullToObject(o, "error");
    return ok ? FL_OK : FL_ERR(FL_ERR_OOM, "out of memory building a result record");
}

static fl_status format_compact(const fl_result *r, cJSON *o) {
    bool ok = r->custom_id ? add_str(o, "custom_id", r->custom_id, strlen(r->custom_id))
                           : cJSON_AddNullToObject(o, "custom_id") != NULL;
    if (r->error_message) {
        cJSON *e = cJSON_AddObjectToObject(o, "error");
        ok = ok && e && cJSON_AddNumberToObject(e, "line", (double)r->error_line) &&
             add_str(e, "message", r->error_message, strlen(r->error_message));
    } else {
        if (r->n_choices != 1 || !r->choices)
            return FL_ERR(FL_ERR_INVALID_ARG, "a compact result has exactly one choice (got %d)",
                          r->n_choices);
        const fl_result_choice *ch = &r->choices[0];
        ok = ok && add_str(o, "text", ch->text, ch->text_len) &&
             cJSON_AddNumberToObject(o, "prompt_tokens", (double)r->prompt_tokens) &&
             cJSON_AddNumberToObject(o, "completion_tokens", (double)ch->completion_tokens) &&
             cJSON_AddStringToObject(o, "finish_reason",
                                     ch->finish_reason ? ch->finish_reason : "stop");
    }
    return ok ? FL_OK : FL_ERR(FL_ERR_OOM, "out of memory building a result record");
}

fl_status fl_result_format(const fl_result *r, char **out, size_t *out_len) {
    if (!r || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_result_format: NULL argument");
    *out = NULL;
    fl_status st = FL_OK;
    char *txt = NULL;
    cJSON *o = cJSON_CreateObject();
    FL_CHECK_ALLOC(o, st, fail);
    st = r->style == FL_RESULT_COMPACT ? format_compact(r, o) : format_openai(r, o);
    if (st != FL_OK) goto fail;
    txt = cJSON_PrintUnformatted(o);
    FL_CHECK_ALLOC(txt, st, fail);
    size_t n = strlen(txt);
    char *line = realloc(txt, n + 2);
    FL_CHECK_ALLOC(line, st, fail);
    txt = NULL;
    line[n] = '\n';
    line[n + 1] = 0;
    *out = line;
    if (out_len) *out_len = n + 1;
fail:
    free(txt);
    cJSON_Delete(o);
    return st;
}

fl_status fl_result_write(FILE *f, const fl_result *r) {
    if (!f) return FL_ERR(FL_ERR_INVALID_ARG, "fl_result_write: FILE is NULL");
    char *line = NULL;
    size_t n = 0;
    FL_TRY(fl_result_format(r, &line, &n));
    fl_status st = FL_OK;
    errno = 0;
    if (fwrite(line, 1, n, f) != n || fflush(f) != 0)
        st = FL_ERR(FL_ERR_IO, "writing the result for %s failed: %s",
                    r->custom_id ? r->custom_id : "(no custom_id)", strerror(errno ? errno : EIO));
    free(line);
    return st;
}

/* ---- HTTP responses (flotilla serve) ------------------------------------------- */

/* o printed without a newline into *out; o is deleted. */
static fl_status print_json(cJSON *o, bool ok, char **out, size_t *out_len) {
    char *txt = ok ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (!txt) return FL_ERR(FL_ERR_OOM, "out of memory building a response");
    *out = txt;
    if (out_len) *out_len = strlen(txt);
    return FL_OK;
}

fl_status fl_result_body_format(const fl_result *r, char **out, size_t *out_len) {
    if (!r || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_result_body_format: NULL argument");
    *out = NULL;
    cJSON *o = cJSON_CreateObject();
    return print_json(o, o && build_body(r, o), out, out_len);
}

fl_status fl_result_chunk_format(const fl_result *r, const fl_result_chunk *ch, char **out,
                                 size_t *out_len) {
    if (!r || !ch || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_result_chunk_format: NULL argument");
    *out = NULL;
    const bool chat = r->endpoint == FL_REQUEST_CHAT;
    char id[64];
    hex_id(id, sizeof id, chat ? "chatcmpl-" : "cmpl-", r);
    cJSON *o = cJSON_CreateObject();
    bool ok = o && cJSON_AddStringToObject(o, "id", id) &&
              cJSON_AddStringToObject(o, "object", chat ? "chat.completion.chunk" : "text_completion") &&
              cJSON_AddNumberToObject(o, "created", (double)r->created) &&
              add_str(o, "model", r->model ? r->model : "", r->model ? strlen(r->model) : 0);
    cJSON *choices = ok ? cJSON_AddArrayToObject(o, "choices") : NULL;
    ok = ok && choices;
    if (ok && ch->usage) {
        cJSON *u = cJSON_AddObjectToObject(o, "usage");
        ok = u && cJSON_AddNumberToObject(u, "prompt_tokens", (double)r->prompt_tokens) &&
             cJSON_AddNumberToObject(u, "completion_tokens", (double)ch->completion_tokens) &&
             cJSON_AddNumberToObject(u, "total_tokens",
                                     (double)(r->prompt_tokens + ch->completion_tokens));
        return print_json(o, ok, out, out_len);
    }
    cJSON *c = ok ? cJSON_CreateObject() : NULL;
    ok = c && cJSON_AddItemToArray(choices, c) && cJSON_AddNumberToObject(c, "index", ch->index);
    if (ok && chat) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        ok = d && (!ch->first || cJSON_AddStringToObject(d, "role", "assistant")) &&
             (ch->finish_reason && !ch->len ? true : add_str(d, "content", ch->text, ch->len));
    } else if (ok) {
        ok = add_str(c, "text", ch->text, ch->len);
    }
    ok = ok && add_item(c, "logprobs", logprobs_json(r->endpoint, ch->tokens, ch->n_tokens,
                                                     ch->text_offset)) &&
         (ch->finish_reason ? cJSON_AddStringToObject(c, "finish_reason", ch->finish_reason) != NULL
                            : cJSON_AddNullToObject(c, "finish_reason") != NULL);
    return print_json(o, ok, out, out_len);
}
