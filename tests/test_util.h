/*
 * test_util.h — small helpers shared by the cmocka tests that read fixture
 * files (header-only: each test is its own executable). Failures end the
 * test through cmocka's fail_msg.
 */
#ifndef FL_TEST_UTIL_H
#define FL_TEST_UTIL_H

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Reads a whole file, NUL-terminated; *len gets its size when non-NULL. */
static inline char *fl_test_slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    fclose(f);
    if (len) *len = (size_t)n;
    return buf;
}

/* A JSON array of integers as a malloc'd int32 array of *n elements. */
static inline int32_t *fl_test_int_array(const cJSON *a, int *n) {
    *n = cJSON_GetArraySize(a);
    int32_t *v = malloc(sizeof(int32_t) * (size_t)(*n ? *n : 1));
    for (int i = 0; i < *n; i++) v[i] = (int32_t)cJSON_GetArrayItem(a, i)->valuedouble;
    return v;
}

#endif /* FL_TEST_UTIL_H */
