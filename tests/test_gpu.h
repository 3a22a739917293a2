/*
 * test_gpu.h — what the CUDA test programs share (included once per
 * program): the CUDA backend opened once (g_be, NULL when no GPU is usable,
 * with the reason in g_why: CI has no GPU and every GPU test skips cleanly),
 * the skip, and a status check that names the failing call.
 */
#ifndef FL_TEST_GPU_H
#define FL_TEST_GPU_H

#include <stdio.h>

#include "kernels/backend.h"
#include "runtime/status.h"

static fl_backend *g_be;
static char g_why[512];

#define NEED_GPU()                                                    \
    do {                                                              \
        if (!g_be) {                                                  \
            printf("  skipped (no GPU): %s\n", g_why);                \
            skip();                                                   \
        }                                                             \
    } while (0)

#define OK(call)                                                                               \
    do {                                                                                       \
        fl_status st_ = (call);                                                                \
        if (st_ != FL_OK) fail_msg("%s -> %s: %s", #call, fl_status_str(st_), fl_error_msg()); \
    } while (0)

static int gpu_group_setup(void **state) {
    (void)state;
    if (fl_backend_cuda_init(0, &g_be) != FL_OK) {
        snprintf(g_why, sizeof g_why, "%s", fl_error_msg());
        printf("no usable GPU, GPU tests skip: %s\n", g_why);
        g_be = NULL;
        fl_error_clear();
    }
    return 0;
}

static int gpu_group_teardown(void **state) {
    (void)state;
    fl_backend_free(g_be);
    g_be = NULL;
    return 0;
}

#endif /* FL_TEST_GPU_H */
