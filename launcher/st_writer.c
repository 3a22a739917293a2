/*
 * st_writer.c — a planned safetensors writer (st_writer.h): 8-byte
 * little-endian header length, the JSON header padded with spaces to a
 * multiple of 8, then the tensors' bytes at the offsets the header names.
 */
#include "launcher/st_writer.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct stw_entry {
    char *name;
    fl_dtype dt;
    int ndim;
    int64_t shape[FL_MAX_DIMS];
    size_t off, nbytes;
    int written;
} stw_entry;

struct fl_stw {
    char *path;
    FILE *f;
    stw_entry *e;
    size_t n, cap, data_start, data_bytes;
    int begun, reopened;
};

static fl_status open_file(const char *path, int reopen, fl_stw **out) {
    *out = NULL;
    fl_stw *w = calloc(1, sizeof *w);
    if (!w) return FL_ERR(FL_ERR_OOM, "out of memory");
    w->path = strdup(path);
    w->f = fopen(path, reopen ? "r+b" : "wb");
    w->reopened = reopen;
    if (!w->path || !w->f) {
        fl_status st = FL_ERR(FL_ERR_IO, "cannot %s %s: %s", reopen ? "open" : "create", path, strerror(errno));
        if (w->f) fclose(w->f);
        free(w->path);
        free(w);
        return st;
    }
    *out = w;
    return FL_OK;
}

fl_status fl_stw_open(const char *path, fl_stw **out) { return open_file(path, 0, out); }
fl_status fl_stw_reopen(const char *path, fl_stw **out) { return open_file(path, 1, out); }

static size_t elem_bytes(fl_dtype dt) {
    switch (dt) {
    case FL_DTYPE_F32: case FL_DTYPE_I32: return 4;
    case FL_DTYPE_F16: case FL_DTYPE_BF16: return 2;
    case FL_DTYPE_I64: return 8;
    default: return 0;
    }
}

fl_status fl_stw_add(fl_stw *w, const char *name, fl_dtype dt, int ndim, const int64_t *shape) {
    if (w->begun) return FL_ERR(FL_ERR_INTERNAL, "%s: tensor %s added after the header", w->path, name);
    if (!elem_bytes(dt) || ndim < 0 || ndim > FL_MAX_DIMS)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor %s of dtype %s (%d-D) cannot be written", w->path, name,
                      fl_dtype_name(dt), ndim);
    for (size_t i = 0; i < w->n; i++)
        if (!strcmp(w->e[i].name, name)) return FL_ERR(FL_ERR_INTERNAL, "%s: tensor %s added twice", w->path, name);
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 64;
        stw_entry *e = realloc(w->e, cap * sizeof *e);
        if (!e) return FL_ERR(FL_ERR_OOM, "out of memory");
        w->e = e;
        w->cap = cap;
    }
    stw_entry *e = &w->e[w->n];
    memset(e, 0, sizeof *e);
    e->name = strdup(name);
    if (!e->name) return FL_ERR(FL_ERR_OOM, "out of memory");
    e->dt = dt;
    e->ndim = ndim;
    e->nbytes = elem_bytes(dt);
    for (int i = 0; i < ndim; i++) {
        e->shape[i] = shape[i];
        e->nbytes *= (size_t)shape[i];
    }
    e->off = w->data_bytes;
    w->data_bytes += e->nbytes;
    w->n++;
    return FL_OK;
}

/* A reopened file's header must be the planned one, byte for byte: the
 * offsets of the tensors an earlier run put depend on every entry. */
static fl_status check_header(fl_stw *w, const uint8_t hl[8], const char *json, size_t len, size_t padded) {
    uint8_t got[8];
    char *text = malloc(padded);
    fl_status st = FL_OK;
    if (!text) return FL_ERR(FL_ERR_OOM, "out of memory reading the header of %s", w->path);
    bool same = fread(got, 1, 8, w->f) == 8 && !memcmp(got, hl, 8) && fread(text, 1, padded, w->f) == padded &&
                !memcmp(text, json, len);
    for (size_t i = len; i < padded && same; i++) same = text[i] == ' ';
    if (!same)
        st = FL_ERR(FL_ERR_FORMAT, "%s: its header is not the one this run writes (another model, format or "
                    "group size)", w->path);
    free(text);
    return st;
}

fl_status fl_stw_begin(fl_stw *w) {
    fl_status st = FL_OK;
    char *json = NULL;
    cJSON *h = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(h, "__metadata__");
    if (!h || !meta || !cJSON_AddStringToObject(meta, "format", "pt")) goto oom;
    for (size_t i = 0; i < w->n; i++) {
        const stw_entry *e = &w->e[i];
        cJSON *t = cJSON_AddObjectToObject(h, e->name), *shape = cJSON_CreateArray(), *offs = cJSON_CreateArray();
        if (!t || !shape || !offs || !cJSON_AddItemToObject(t, "shape", shape) ||
            !cJSON_AddItemToObject(t, "data_offsets", offs) ||
            !cJSON_AddStringToObject(t, "dtype", fl_dtype_name(e->dt)))
            goto oom;
        for (int d = 0; d < e->ndim; d++)
            if (!cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)e->shape[d]))) goto oom;
        if (!cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)e->off)) ||
            !cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(e->off + e->nbytes))))
            goto oom;
    }
    json = cJSON_PrintUnformatted(h);
    if (!json) goto oom;
    size_t len = strlen(json), padded = (len + 7) / 8 * 8;
    uint8_t hl[8];
    for (int i = 0; i < 8; i++) hl[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    if (w->reopened) {
        st = check_header(w, hl, json, len, padded);
        if (st != FL_OK) goto done;
    } else {
        if (fwrite(hl, 1, 8, w->f) != 8 || fwrite(json, 1, len, w->f) != len) goto io;
        for (size_t i = len; i < padded; i++)
            if (fputc(' ', w->f) == EOF) goto io;
    }
    w->data_start = 8 + padded;
    w->begun = 1;
    goto done;
oom:
    st = FL_ERR(FL_ERR_OOM, "out of memory writing the header of %s", w->path);
    goto done;
io:
    st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", w->path, strerror(errno));
done:
    free(json);
    cJSON_Delete(h);
    return st;
}

fl_status fl_stw_put(fl_stw *w, const char *name, const void *data) {
    for (size_t i = 0; i < w->n; i++) {
        stw_entry *e = &w->e[i];
        if (strcmp(e->name, name)) continue;
        if (!w->begun || e->written) return FL_ERR(FL_ERR_INTERNAL, "%s: tensor %s put twice or early", w->path, name);
        if (fseeko(w->f, (off_t)(w->data_start + e->off), SEEK_SET) != 0 ||
            fwrite(data, 1, e->nbytes, w->f) != e->nbytes)
            return FL_ERR(FL_ERR_IO, "cannot write %s (%s): %s", w->path, name, strerror(errno));
        e->written = 1;
        return FL_OK;
    }
    return FL_ERR(FL_ERR_INTERNAL, "%s: tensor %s was not declared", w->path, name);
}

fl_status fl_stw_have_prefix(fl_stw *w, const char *prefix) {
    if (!w->begun || !w->reopened) return FL_ERR(FL_ERR_INTERNAL, "%s: tensors counted as written early", w->path);
    const size_t m = strlen(prefix);
    for (size_t i = 0; i < w->n; i++)
        if (!strncmp(w->e[i].name, prefix, m)) w->e[i].written = 1;
    return FL_OK;
}

fl_status fl_stw_sync(fl_stw *w) {
    if (fflush(w->f) != 0 || fsync(fileno(w->f)) != 0)
        return FL_ERR(FL_ERR_IO, "cannot write %s: %s", w->path, strerror(errno));
    return FL_OK;
}

fl_status fl_stw_close(fl_stw *w) {
    if (!w) return FL_OK;
    fl_status st = FL_OK;
    for (size_t i = 0; i < w->n && st == FL_OK; i++)
        if (!w->e[i].written) st = FL_ERR(FL_ERR_INTERNAL, "%s: tensor %s was never written", w->path, w->e[i].name);
    if (fclose(w->f) != 0 && st == FL_OK) st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", w->path, strerror(errno));
    for (size_t i = 0; i < w->n; i++) free(w->e[i].name);
    free(w->e);
    free(w->path);
    free(w);
    return st;
}
