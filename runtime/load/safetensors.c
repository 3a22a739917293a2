/*
 * safetensors.c — validating parser for one .safetensors file (see
 * safetensors.h for the layout).
 *
 * Why so many checks: checkpoints come from the internet and the data
 * pointers we hand out are read by kernels without bounds checks, so every
 * number in the header is verified here, once, before anything is exposed.
 * The JSON header is parsed by cJSON straight out of the mapping (it is not
 * NUL-terminated, hence ParseWithLength).
 */
#include "runtime/load/safetensors.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Integers in JSON arrive as doubles; only exact non-negative integers up
 * to 2^53 are accepted so that the conversion below is exact. */
static int json_to_u64(const cJSON *j, uint64_t *v) {
    if (!cJSON_IsNumber(j)) return 0;
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > 9007199254740992.0 || floor(d) != d) return 0;
    *v = (uint64_t)d;
    return 1;
}

static int parse_dtype(const char *s, fl_dtype *dt) {
    if (strcmp(s, "F32") == 0) *dt = FL_DTYPE_F32;
    else if (strcmp(s, "F16") == 0) *dt = FL_DTYPE_F16;
    else if (strcmp(s, "BF16") == 0) *dt = FL_DTYPE_BF16;
    else if (strcmp(s, "I32") == 0) *dt = FL_DTYPE_I32;
    else if (strcmp(s, "I64") == 0) *dt = FL_DTYPE_I64;
    else if (strcmp(s, "F8_E4M3") == 0) *dt = FL_DTYPE_F8_E4M3;
    else return 0;
    return 1;
}

/* Validates one header entry and fills *t (name not set here). */
static fl_status parse_entry(const char *path, const cJSON *e, const uint8_t *base,
                             uint64_t data_size, fl_ckpt_tensor *t) {
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return FL_ERR(FL_ERR_FORMAT, "%s: header entry for tensor \"%s\" is not an object", path, name);

    const cJSON *jdt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *jshape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *joff = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(jdt))
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\": missing or non-string \"dtype\"", path, name);
    if (!parse_dtype(jdt->valuestring, &t->dtype))
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: tensor \"%s\" has dtype %s, which is not supported (supported: F32, F16, BF16, I32, I64, F8_E4M3)",
                      path, name, jdt->valuestring);
    if (!cJSON_IsArray(jshape))
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\": missing or non-array \"shape\"", path, name);
    int ndim = cJSON_GetArraySize(jshape);
    if (ndim > FL_MAX_DIMS)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" has %d dims (at most %d supported)", path,
                      name, ndim, FL_MAX_DIMS);
    t->ndim = ndim;
    /* numel overflow guard: every dim is < 2^53 and the product is checked
     * against the data size below, so stop as soon as it exceeds 2^62. */
    uint64_t numel = 1;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, jshape) {
        uint64_t v;
        if (!json_to_u64(d, &v))
            return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\": shape[%d] is not a non-negative integer", path,
                          name, i);
        t->shape[i++] = (int64_t)v;
        if (v != 0 && numel > (UINT64_C(1) << 62) / v)
            return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\": shape is too large", path, name);
        numel *= v;
    }
    for (; i < FL_MAX_DIMS; i++) t->shape[i] = 0;

    uint64_t begin, end;
    if (!cJSON_IsArray(joff) || cJSON_GetArraySize(joff) != 2 ||
        !json_to_u64(cJSON_GetArrayItem(joff, 0), &begin) || !json_to_u64(cJSON_GetArrayItem(joff, 1), &end))
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\": \"data_offsets\" must be [begin, end] integers",
                      path, name);
    if (begin > end || end > data_size)
        return FL_ERR(FL_ERR_FORMAT,
                      "%s: tensor \"%s\": data_offsets [%llu, %llu] out of range (data section is %llu bytes)",
                      path, name, (unsigned long long)begin, (unsigned long long)end,
                      (unsigned long long)data_size);
    uint64_t want = numel * (uint64_t)fl_dtype_row_bytes(t->dtype, 1);
    if (end - begin != want)
        return FL_ERR(FL_ERR_FORMAT,
                      "%s: tensor \"%s\": data_offsets [%llu, %llu] hold %llu bytes but %s x %llu elements "
                      "need %llu",
                      path, name, (unsigned long long)begin, (unsigned long long)end,
                      (unsigned long long)(end - begin), fl_dtype_name(t->dtype), (unsigned long long)numel,
                      (unsigned long long)want);
    t->data = base + begin;
    t->nbytes = (size_t)want;
    t->file = path;
    return FL_OK;
}

fl_status fl_safetensors_parse(const char *path, const void *data, size_t size,
                               fl_ckpt_tensor **tensors, size_t *n) {
    fl_status st = FL_OK;
    cJSON *root = NULL;
    fl_ckpt_tensor *ts = NULL;
    size_t nt = 0;
    *tensors = NULL;
    *n = 0;

    const uint8_t *bytes = data;
    if (size < 8) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: truncated safetensors file (%zu bytes, the header length alone needs 8)",
                    path, size);
        goto fail;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | bytes[i];
    if (hlen > size - 8) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: header length %llu exceeds the file size (%zu bytes): truncated or not a "
                    "safetensors file", path, (unsigned long long)hlen, size);
        goto fail;
    }
    const char *hdr = (const char *)bytes + 8;
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!root) {
        size_t off = end ? (size_t)(end - hdr) : 0;
        if (!end && cJSON_GetErrorPtr()) off = (size_t)(cJSON_GetErrorPtr() - hdr);
        st = FL_ERR(FL_ERR_FORMAT, "%s: header is not valid JSON (error near byte %zu of the header)", path, off);
        goto fail;
    }
    if (!cJSON_IsObject(root)) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: header JSON is not an object", path);
        goto fail;
    }
    /* Anything after the JSON value must be padding (the reference writer
     * pads with spaces to 8 bytes). */
    for (const char *p = end; p && p < hdr + hlen; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r' && *p != '\0') {
            st = FL_ERR(FL_ERR_FORMAT, "%s: trailing garbage after the header JSON at byte %zu", path,
                        (size_t)(p - hdr));
            goto fail;
        }
    }
    const uint8_t *base = bytes + 8 + hlen;
    uint64_t data_size = (uint64_t)(size - 8 - hlen);

    size_t cap = (size_t)cJSON_GetArraySize(root);
    ts = calloc(cap ? cap : 1, sizeof *ts);
    FL_CHECK_ALLOC(ts, st, fail);
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (!e->string) continue;
        if (strcmp(e->string, "__metadata__") == 0) continue;
        fl_ckpt_tensor *t = &ts[nt];
        FL_TRY_GOTO(parse_entry(path, e, base, data_size, t), st, fail);
        t->name = strdup(e->string);
        FL_CHECK_ALLOC(t->name, st, fail);
        nt++;
    }
    cJSON_Delete(root);
    *tensors = ts;
    *n = nt;
    return FL_OK;

fail:
    cJSON_Delete(root);
    fl_safetensors_tensors_free(ts, nt);
    return st;
}

void fl_safetensors_tensors_free(fl_ckpt_tensor *tensors, size_t n) {
    if (!tensors) return;
    for (size_t i = 0; i < n; i++) free((char *)tensors[i].name);
    free(tensors);
}
