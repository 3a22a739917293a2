/*
 * json_file.c — whole-file reads and JSON parsing with positioned errors
 * (see json_file.h). The loaders' JSON files are small, so they are read
 * into memory once and parsed by cJSON.
 */
#include "runtime/load/json_file.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "runtime/load/mapfile.h"

fl_status fl_file_read_text(const char *path, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT)
        return FL_ERR(FL_ERR_NOT_FOUND, "%s does not exist", path);
    fl_mapfile m;
    FL_TRY(fl_mapfile_open(path, &m));
    char *buf = malloc(m.size + 1);
    if (!buf) {
        fl_mapfile_close(&m);
        return FL_ERR(FL_ERR_OOM, "out of memory reading %s", path);
    }
    if (m.size) memcpy(buf, m.data, m.size);
    buf[m.size] = 0;
    *len = m.size;
    *text = buf;
    fl_mapfile_close(&m);
    return FL_OK;
}

fl_status fl_json_parse_file(const char *path, cJSON **out) {
    char *buf = NULL;
    size_t len = 0;
    *out = NULL;
    FL_TRY(fl_file_read_text(path, &buf, &len));
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
    if (!root) {
        size_t off = end ? (size_t)(end - buf) : 0;
        if (off > len) off = len;
        int line = 1, col = 1;
        for (size_t i = 0; i < off; i++) {
            if (buf[i] == '\n') {
                line++;
                col = 1;
            } else {
                col++;
            }
        }
        free(buf);
        return FL_ERR(FL_ERR_FORMAT, "%s: invalid JSON at line %d, column %d (byte %zu)", path, line, col, off);
    }
    free(buf);
    *out = root;
    return FL_OK;
}

bool fl_json_int(const cJSON *v, double lo, double hi, long long *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!isfinite(d) || floor(d) != d || d < lo || d > hi) return false;
    *out = (long long)d;
    return true;
}
