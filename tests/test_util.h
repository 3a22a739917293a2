/*
 * test_util.h — small helpers shared by the cmocka tests that read fixture
 * files (header-only: each test is its own executable). Failures end the
 * test through cmocka's fail_msg.
 */
#ifndef FL_TEST_UTIL_H
#define FL_TEST_UTIL_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"

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

/* One golden fixture (tests/golden/<name>/, see tests/golden/README.md). */
typedef struct fl_test_golden {
    char dir[512];
    char *text;         /* golden.json */
    cJSON *json;
    int32_t *prompt;    /* [T] */
    int T;
    int32_t *greedy;    /* [n_greedy] reference greedy continuation */
    int n_greedy;
    int V;              /* vocab size */
    double *ref;        /* [T, V] reference logits, or NULL */
} fl_test_golden;

/* Loads fixture `name` under `root`; the reference logits come from
 * logits_file (NULL: golden.json's logits_file) unless skip_logits. */
static inline void fl_test_golden_load(const char *root, const char *name, const char *logits_file,
                                       int skip_logits, fl_test_golden *g) {
    char path[700];
    memset(g, 0, sizeof *g);
    snprintf(g->dir, sizeof g->dir, "%s%s", root, name);
    snprintf(path, sizeof path, "%s/golden.json", g->dir);
    g->text = fl_test_slurp(path, NULL);
    g->json = cJSON_Parse(g->text);
    assert_non_null(g->json);
    g->prompt = fl_test_int_array(cJSON_GetObjectItem(g->json, "prompt_ids"), &g->T);
    g->greedy = fl_test_int_array(cJSON_GetObjectItem(g->json, "greedy_new_tokens"), &g->n_greedy);
    g->V = cJSON_GetObjectItem(g->json, "vocab_size")->valueint;
    if (skip_logits) return;
    snprintf(path, sizeof path, "%s/%s", g->dir,
             logits_file ? logits_file : cJSON_GetObjectItem(g->json, "logits_file")->valuestring);
    size_t nbytes;
    g->ref = (double *)fl_test_slurp(path, &nbytes);
    assert_int_equal(nbytes, sizeof(double) * (size_t)g->T * g->V);
}

static inline void fl_test_golden_free(fl_test_golden *g) {
    free(g->prompt);
    free(g->greedy);
    free(g->ref);
    cJSON_Delete(g->json);
    free(g->text);
    memset(g, 0, sizeof *g);
}

/* Tests that hold the CPU backend to float64 references at 1e-4 or finer
 * run its f32 reference matmuls: the SIMD kernels round activations to
 * int16 blocks (kernels/cpu/cpu_qdot.h; 3e-4 of a logit row on the demo
 * model) and are held to their own bound in test_cpu_ops. FL_CPU_KERNELS
 * set in the environment wins, so a variant can run the same checks on
 * them. Call before creating the backend. */
static inline void fl_test_cpu_reference_kernels(void) {
    if (!fl_opt_is_set(FL_OPT_CPU_KERNELS)) (void)fl_opt_override(FL_OPT_CPU_KERNELS, "c");
}

#endif /* FL_TEST_UTIL_H */
