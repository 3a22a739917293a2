/*
 * json_file.h — reading small text files (config.json, index.json,
 * tokenizer_config.json, chat templates) and parsing them with cJSON, with
 * one error convention: a missing file is FL_ERR_NOT_FOUND naming the path,
 * a syntax error is FL_ERR_FORMAT naming the path, line, column and byte.
 */
#ifndef FL_JSON_FILE_H
#define FL_JSON_FILE_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

#include "core/status.h"

/* Reads the whole file into a malloc'd NUL-terminated buffer (*len bytes
 * before the NUL). The caller frees *text. */
fl_status fl_file_read_text(const char *path, char **text, size_t *len);

/* Parses the JSON file `path`; the caller frees *out with cJSON_Delete. */
fl_status fl_json_parse_file(const char *path, cJSON **out);

/* True when v is a JSON number holding an integer in [lo, hi], stored in
 * *out. Casting an out-of-range double to an integer type is undefined
 * behaviour, so every integer read from untrusted JSON goes through here. */
bool fl_json_int(const cJSON *v, double lo, double hi, long long *out);

#endif /* FL_JSON_FILE_H */
