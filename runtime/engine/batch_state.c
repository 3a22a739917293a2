/*
 * batch_state.c — bounded line reading, the scan of a results stream and the
 * job identity of a batch job's state file (see batch_state.h).
 *
 * Why bounded: getline() grows its buffer until it meets a '\n', so a
 * results path that is a device (/dev/zero) or a huge file without newlines
 * would take all memory before any check runs.
 */
#include "runtime/engine/batch_state.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/load/json_file.h"

fl_status fl_batch_read_line(FILE *f, const char *name, long line_no, size_t max, char **buf,
                             size_t *cap, size_t *len) {
    size_t n = 0;
    int c = 0;
    *len = 0;
    if (!*buf || *cap < 2) {
        size_t nc = 4096;
        char *nb = realloc(*buf, nc);
        if (!nb) return FL_ERR(FL_ERR_OOM, "out of memory reading %s", name);
        *buf = nb;
        *cap = nc;
    }
    flockfile(f);
    while ((c = getc_unlocked(f)) != EOF) {
        if (n >= max) {
            funlockfile(f);
            return FL_ERR(FL_ERR_FORMAT, "%s:%ld: line longer than %zu bytes; not a results file "
                          "flotilla wrote", name, line_no, max);
        }
        if (n + 2 > *cap) {
            size_t nc = *cap * 2;
            if (nc > max + 2) nc = max + 2;
            char *nb = realloc(*buf, nc);
            if (!nb) {
                funlockfile(f);
                return FL_ERR(FL_ERR_OOM, "out of memory reading %s:%ld", name, line_no);
            }
            *buf = nb;
            *cap = nc;
        }
        (*buf)[n++] = (char)c;
        if (c == '\n') break;
    }
    bool err = ferror(f);
    funlockfile(f);
    (*buf)[n] = 0;
    if (err)
        return FL_ERR(FL_ERR_IO, "reading %s at line %ld: %s", name, line_no,
                      strerror(errno ? errno : EIO));
    *len = n;
    return FL_OK;
}

bool fl_batch_record_parse(const char *text, size_t len, void **json, const char **custom_id,
                           long *error_line) {
    *json = NULL;
    *custom_id = NULL;
    *error_line = 0;
    if (len && text[len - 1] == '\n') len--;
    if (len == 0 || memchr(text, 0, len)) return false;
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!j) return false;
    *json = j;
    for (const char *p = end; p < text + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r') return false;
    if (!cJSON_IsObject(j)) return false;
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "custom_id");
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
    const cJSON *resp = cJSON_GetObjectItemCaseSensitive(j, "response");
    if (resp) {
        /* OpenAI Batch output: a body with choices (200) or an error object */
        const cJSON *code = cJSON_GetObjectItemCaseSensitive(resp, "status_code");
        const cJSON *body = cJSON_GetObjectItemCaseSensitive(resp, "body");
        if (!cJSON_IsObject(resp) || !cJSON_IsNumber(code) || !cJSON_IsObject(body)) return false;
        if (code->valueint == 200) {
            if (!cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(body, "choices"))) return false;
        } else {
            const cJSON *e = cJSON_GetObjectItemCaseSensitive(body, "error");
            const cJSON *msg = cJSON_GetObjectItemCaseSensitive(e, "message");
            const cJSON *line = cJSON_GetObjectItemCaseSensitive(e, "line");
            if (!cJSON_IsObject(e) || !cJSON_IsString(msg)) return false;
            long long ln;
            if (fl_json_int(line, 1, (double)LONG_MAX / 2, &ln)) *error_line = (long)ln;
            err = e;
        }
    } else if (err) {
        const cJSON *msg = cJSON_GetObjectItemCaseSensitive(err, "message");
        const cJSON *line = cJSON_GetObjectItemCaseSensitive(err, "line");
        long long ln;
        if (!cJSON_IsObject(err) || !cJSON_IsString(msg) || !fl_json_int(line, 1, (double)LONG_MAX / 2, &ln))
            return false;
        *error_line = (long)ln;
    } else {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "text");
        const cJSON *fr = cJSON_GetObjectItemCaseSensitive(j, "finish_reason");
        if (!cJSON_IsString(t) || !cJSON_IsString(fr)) return false;
    }
    if (cJSON_IsString(id) && id->valuestring[0]) {
        *custom_id = id->valuestring;
        return true;
    }
    /* an id-less record is an error record keyed by its input line */
    return cJSON_IsNull(id) && err && *error_line > 0;
}

fl_status fl_batch_scan_results(FILE *f, const char *name, size_t max_line, fl_batch_record_fn fn,
                                void *ctx, fl_batch_scan *out) {
    fl_status st = FL_OK;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    memset(out, 0, sizeof *out);
    for (;;) {
        FL_TRY_GOTO(fl_batch_read_line(f, name, out->n_lines + 1, max_line, &buf, &cap, &n), st,
                    done);
        if (n == 0) break;
        if (out->bad_line) {
            st = FL_ERR(FL_ERR_FORMAT, "%s:%ld: not a flotilla result record (and more lines "
                        "follow it, so it is not a line torn by a kill); refusing to resume into "
                        "this file", name, out->bad_line);
            goto done;
        }
        out->n_lines++;
        uint64_t start = out->size;
        out->size += n;
        void *json = NULL;
        const char *id = NULL;
        long eline = 0;
        bool complete = buf[n - 1] == '\n';
        bool ok = complete && fl_batch_record_parse(buf, n, &json, &id, &eline);
        if (ok && fn) st = fn(ctx, id, eline, out->n_lines);
        cJSON_Delete(json);
        if (st != FL_OK) goto done;
        if (!ok) {
            out->bad_line = out->n_lines;
            out->good_end = start;
            continue;
        }
        out->n_records++;
        out->good_end = out->size;
    }
done:
    free(buf);
    return st;
}

/* ---- job identity ----------------------------------------------------------- */

uint64_t fl_batch_hash(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

fl_status fl_batch_ident_set_opt(fl_batch_ident *id, const char *name, const char *value) {
    if (strlen(name) >= sizeof id->opts[0].name || strlen(value) >= sizeof id->opts[0].value)
        return FL_ERR(FL_ERR_INVALID_ARG, "job option %.40s = %.80s is too long", name, value);
    int i = 0;
    while (i < id->n_opts && strcmp(id->opts[i].name, name) != 0) i++;
    if (i == FL_BATCH_MAX_OPTS)
        return FL_ERR(FL_ERR_INVALID_ARG, "more than %d job options", FL_BATCH_MAX_OPTS);
    if (i == id->n_opts) id->n_opts++;
    snprintf(id->opts[i].name, sizeof id->opts[i].name, "%s", name);
    snprintf(id->opts[i].value, sizeof id->opts[i].value, "%s", value);
    return FL_OK;
}

/* The marker key: a state file is recognised by it, so a user's JSON file
 * that happens to sit at that path is never taken for one. */
#define MARK "flotilla_batch_job"

fl_status fl_batch_ident_format(const fl_batch_ident *id, char **out) {
    fl_status st = FL_OK;
    char hex[2][24];
    *out = NULL;
    cJSON *o = cJSON_CreateObject(), *in = NULL, *m = NULL, *op = NULL;
    FL_CHECK_ALLOC(o, st, done);
    snprintf(hex[0], sizeof hex[0], "%016" PRIx64, id->input_hash);
    /* sizes as strings too: JSON numbers are doubles, exact only to 2^53 */
    snprintf(hex[1], sizeof hex[1], "%" PRIu64, id->input_bytes);
    bool ok = cJSON_AddNumberToObject(o, MARK, 1) && (in = cJSON_AddObjectToObject(o, "input")) &&
              cJSON_AddStringToObject(in, "path", id->input) &&
              cJSON_AddStringToObject(in, "bytes", hex[1]) &&
              cJSON_AddStringToObject(in, "fnv1a64", hex[0]) &&
              (m = cJSON_AddObjectToObject(o, "model")) &&
              cJSON_AddStringToObject(m, "path", id->model);
    snprintf(hex[1], sizeof hex[1], "%" PRIu64, id->model_bytes);
    ok = ok && cJSON_AddStringToObject(m, "bytes", hex[1]) &&
         (op = cJSON_AddObjectToObject(o, "options"));
    for (int i = 0; ok && i < id->n_opts; i++)
        ok = cJSON_AddStringToObject(op, id->opts[i].name, id->opts[i].value) != NULL;
    char *txt = ok ? cJSON_Print(o) : NULL;
    FL_CHECK_ALLOC(txt, st, done);
    size_t n = strlen(txt);
    char *line = realloc(txt, n + 2);
    if (!line) free(txt);
    FL_CHECK_ALLOC(line, st, done);
    line[n] = '\n';
    line[n + 1] = 0;
    *out = line;
done:
    cJSON_Delete(o);
    return st;
}

static bool get_str(const cJSON *o, const char *key, char *dst, size_t n) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(v) || strlen(v->valuestring) >= n) return false;
    memcpy(dst, v->valuestring, strlen(v->valuestring) + 1);
    return true;
}

static bool get_u64(const cJSON *o, const char *key, int base, uint64_t *out) {
    char s[32], *end;
    if (!get_str(o, key, s, sizeof s) || !s[0]) return false;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno || *end) return false;
    *out = v;
    return true;
}

fl_status fl_batch_ident_parse(const char *text, size_t len, const char *name,
                               fl_batch_ident *id) {
    fl_status st = FL_OK;
    memset(id, 0, sizeof *id);
    cJSON *o = cJSON_ParseWithLength(text, len);
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(o, "input");
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(o, "model");
    const cJSON *op = cJSON_GetObjectItemCaseSensitive(o, "options");
    if (!cJSON_IsObject(o) || !cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(o, MARK)) ||
        !get_str(in, "path", id->input, sizeof id->input) ||
        !get_u64(in, "bytes", 10, &id->input_bytes) ||
        !get_u64(in, "fnv1a64", 16, &id->input_hash) ||
        !get_str(m, "path", id->model, sizeof id->model) ||
        !get_u64(m, "bytes", 10, &id->model_bytes) || !cJSON_IsObject(op)) {
        st = FL_ERR(FL_ERR_FORMAT, "%s is not a flotilla job state file (expected a JSON object "
                    "with \"" MARK "\", \"input\", \"model\" and \"options\")", name);
        goto done;
    }
    const cJSON *v;
    cJSON_ArrayForEach(v, op) {
        if (!cJSON_IsString(v) || !v->string ||
            fl_batch_ident_set_opt(id, v->string, v->valuestring) != FL_OK) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: options.%.40s is not a short string", name,
                        v->string ? v->string : "?");
            goto done;
        }
    }
done:
    cJSON_Delete(o);
    return st;
}

static const char *opt_value(const fl_batch_ident *id, const char *name) {
    for (int i = 0; i < id->n_opts; i++)
        if (!strcmp(id->opts[i].name, name)) return id->opts[i].value;
    return NULL;
}

/* An option of a missing from b (or different there); swapped: a and b are
 * in the other order, so the message keeps "a's value vs b's". */
static bool opts_differ(const fl_batch_ident *a, const fl_batch_ident *b, bool swapped, char *why,
                        size_t n) {
    for (int i = 0; i < a->n_opts; i++) {
        const char *v = opt_value(b, a->opts[i].name), *mine = a->opts[i].value;
        if (!v || strcmp(v, mine)) {
            if (!v) v = "(not set)";
            snprintf(why, n, "option %s: %s vs %s", a->opts[i].name, swapped ? v : mine,
                     swapped ? mine : v);
            return true;
        }
    }
    return false;
}

bool fl_batch_ident_same(const fl_batch_ident *a, const fl_batch_ident *b, char *why, size_t n) {
    if (n) why[0] = 0;
    if (strcmp(a->input, b->input))
        snprintf(why, n, "input %.1000s vs %.1000s", a->input, b->input);
    else if (a->input_bytes != b->input_bytes)
        snprintf(why, n, "input size %" PRIu64 " vs %" PRIu64 " bytes", a->input_bytes,
                 b->input_bytes);
    else if (a->input_hash != b->input_hash)
        snprintf(why, n, "input hash %016" PRIx64 " vs %016" PRIx64, a->input_hash, b->input_hash);
    else if (strcmp(a->model, b->model))
        snprintf(why, n, "model %.1000s vs %.1000s", a->model, b->model);
    else if (a->model_bytes != b->model_bytes)
        snprintf(why, n, "model size %" PRIu64 " vs %" PRIu64 " bytes", a->model_bytes,
                 b->model_bytes);
    else if (!opts_differ(a, b, false, why, n) && !opts_differ(b, a, true, why, n))
        return true;
    return false;
}
