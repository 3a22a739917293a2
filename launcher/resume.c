/*
 * resume.c — restartable batch jobs (see resume.h): the done set read back
 * from the output file, cutting a record torn by a kill, and the duplicate
 * custom_id check of the input.
 *
 * Why a pre-pass over the input: a duplicate found only when the job
 * reaches it would fail a job hours in, after writing half its results; a
 * streaming pass costs one cJSON parse per line and keeps only the ids (one
 * hash set), never the input, in memory. It also gives the progress bar its
 * total.
 */
#include "launcher/resume.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/engine/request.h"

/* ---- string set: open addressing, FNV-1a, grown at 70% load -------------- */

typedef struct slot {
    char *key; /* NULL: empty */
    long val;
} slot;

struct fl_idset {
    slot *slots;
    size_t cap, len; /* cap is a power of two */
};

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static slot *find(const fl_idset *s, const char *key) {
    size_t i = (size_t)hash_str(key) & (s->cap - 1);
    while (s->slots[i].key && strcmp(s->slots[i].key, key) != 0) i = (i + 1) & (s->cap - 1);
    return &s->slots[i];
}

fl_status fl_idset_new(fl_idset **out) {
    fl_idset *s = calloc(1, sizeof *s);
    if (s) s->slots = calloc(64, sizeof *s->slots);
    if (!s || !s->slots) {
        free(s);
        return FL_ERR(FL_ERR_OOM, "out of memory allocating an id set");
    }
    s->cap = 64;
    *out = s;
    return FL_OK;
}

void fl_idset_free(fl_idset *s) {
    if (!s) return;
    for (size_t i = 0; i < s->cap; i++) free(s->slots[i].key);
    free(s->slots);
    free(s);
}

static fl_status grow(fl_idset *s) {
    slot *old = s->slots;
    size_t old_cap = s->cap;
    slot *n = calloc(old_cap * 2, sizeof *n);
    if (!n) return FL_ERR(FL_ERR_OOM, "out of memory growing an id set to %zu ids", s->len);
    s->slots = n;
    s->cap = old_cap * 2;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].key) *find(s, old[i].key) = old[i];
    free(old);
    return FL_OK;
}

fl_status fl_idset_put(fl_idset *s, const char *key, long val, bool *added, long *prev) {
    slot *sl = find(s, key);
    if (sl->key) {
        *added = false;
        if (prev) *prev = sl->val;
        return FL_OK;
    }
    if ((s->len + 1) * 10 > s->cap * 7) {
        FL_TRY(grow(s));
        sl = find(s, key);
    }
    sl->key = strdup(key);
    if (!sl->key) return FL_ERR(FL_ERR_OOM, "out of memory adding to an id set");
    sl->val = val;
    s->len++;
    *added = true;
    return FL_OK;
}

bool fl_idset_has(const fl_idset *s, const char *key) { return s && find(s, key)->key != NULL; }

size_t fl_idset_size(const fl_idset *s) { return s ? s->len : 0; }

const char *fl_resume_key(const char *custom_id, long line, char *buf, size_t n) {
    if (custom_id) return custom_id;
    /* \x01 cannot start a custom_id anyone writes by hand; the line number
     * is stable as long as the input is the same file. */
    snprintf(buf, n, "\x01line %ld", line);
    return buf;
}

/* ---- the output file ------------------------------------------------------ */

/* The key of one result line, or false when it is not a result record. */
static bool record_key(const char *text, size_t len, char *buf, size_t n, char **owned) {
    *owned = NULL;
    cJSON *j = cJSON_ParseWithLength(text, len);
    bool ok = false;
    if (cJSON_IsObject(j)) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "custom_id");
        const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
        const cJSON *line = cJSON_GetObjectItemCaseSensitive(err, "line");
        if (cJSON_IsString(id)) {
            *owned = strdup(id->valuestring);
            ok = *owned != NULL;
        } else if (cJSON_IsNull(id) && cJSON_IsNumber(line)) {
            fl_resume_key(NULL, (long)line->valuedouble, buf, n);
            ok = true;
        }
    }
    cJSON_Delete(j);
    return ok;
}

fl_status fl_resume_open_output(const char *path, bool fresh, fl_idset *done, long *n_done,
                                long *torn_bytes, FILE **out) {
    fl_status st = FL_OK;
    char *buf = NULL;
    size_t cap = 0;
    FILE *f = NULL;
    *n_done = 0;
    *torn_bytes = 0;
    *out = NULL;
    int fd = open(path, O_RDWR | O_CREAT | (fresh ? O_TRUNC : 0), 0644);
    if (fd < 0) return FL_ERR(FL_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    f = fdopen(fd, "r+");
    if (!f) {
        st = FL_ERR(FL_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        close(fd);
        return st;
    }
    /* good_end: the end of the last complete, valid record. A bad record is
     * forgiven only when it is the last one (a kill mid-write); one followed
     * by more records means the file is not ours to truncate. */
    long good_end = 0, pos = 0, line_no = 0, bad_line = 0;
    ssize_t n;
    while ((n = getline(&buf, &cap, f)) > 0) {
        line_no++;
        long start = pos;
        pos += n;
        if (bad_line) {
            st = FL_ERR(FL_ERR_FORMAT, "%s:%ld: not a flotilla result record (and more records "
                        "follow it, so it is not a line torn by a kill); refusing to resume into "
                        "this file", path, bad_line);
            goto fail;
        }
        char kb[48], *owned = NULL;
        bool complete = buf[n - 1] == '\n';
        if (!complete || !record_key(buf, (size_t)n, kb, sizeof kb, &owned)) {
            bad_line = line_no;
            good_end = start;
            continue;
        }
        bool added;
        st = fl_idset_put(done, owned ? owned : kb, line_no, &added, NULL);
        free(owned);
        if (st != FL_OK) goto fail;
        (*n_done)++;
        good_end = pos;
    }
    if (ferror(f)) {
        st = FL_ERR(FL_ERR_IO, "reading %s after line %ld: %s", path, line_no, strerror(errno));
        goto fail;
    }
    if (pos > good_end) {
        *torn_bytes = pos - good_end;
        if (fflush(f) != 0 || ftruncate(fd, (off_t)good_end) != 0 || fsync(fd) != 0) {
            st = FL_ERR(FL_ERR_IO, "cannot cut the torn last record (line %ld) of %s: %s", bad_line,
                        path, strerror(errno));
            goto fail;
        }
    }
    if (fseek(f, 0, SEEK_END) != 0) {
        st = FL_ERR(FL_ERR_IO, "cannot seek in %s: %s", path, strerror(errno));
        goto fail;
    }
    free(buf);
    *out = f;
    return FL_OK;
fail:
    free(buf);
    fclose(f);
    return st;
}

/* ---- the input pre-pass --------------------------------------------------- */

fl_status fl_resume_scan_input(const char *path, const fl_idset *done, long *n_total,
                               long *n_todo) {
    fl_request_reader *rd = NULL;
    fl_idset *seen = NULL;
    fl_status st;
    *n_total = *n_todo = 0;
    FL_TRY(fl_request_reader_open(path, &rd));
    FL_TRY_GOTO(fl_idset_new(&seen), st, fail);
    for (;;) {
        long line;
        const char *text;
        size_t len;
        FL_TRY_GOTO(fl_request_reader_next(rd, &line, &text, &len), st, fail);
        if (!text) break;
        (*n_total)++;
        cJSON *j = cJSON_ParseWithLength(text, len);
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "custom_id");
        if (cJSON_IsString(id) && !id->valuestring[0]) id = NULL; /* "" is refused, keyed by line */
        char kb[48];
        const char *key = fl_resume_key(cJSON_IsString(id) ? id->valuestring : NULL, line, kb,
                                        sizeof kb);
        bool added = true;
        long prev = 0;
        st = FL_OK;
        if (cJSON_IsString(id)) st = fl_idset_put(seen, key, line, &added, &prev);
        if (st == FL_OK && !added)
            st = FL_ERR(FL_ERR_INVALID_ARG, "duplicate custom_id \"%.200s\" at %s:%ld and %s:%ld; "
                        "custom_ids must be unique for results to be matched and resumed",
                        key, path, prev, path, line);
        if (st == FL_OK && !fl_idset_has(done, key)) (*n_todo)++;
        cJSON_Delete(j);
        if (st != FL_OK) goto fail;
    }
    st = FL_OK;
fail:
    fl_idset_free(seen);
    fl_request_reader_close(rd);
    return st;
}
