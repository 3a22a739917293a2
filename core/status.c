/*
 * status.c — status names and the thread-local last-error message.
 */
#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static _Thread_local char g_msg[1024];
static _Thread_local char g_where[256];

const char *fl_status_str(fl_status st) {
    static const char *const names[FL_STATUS_COUNT] = {
        [FL_OK] = "FL_OK",
        [FL_ERR_INVALID_ARG] = "FL_ERR_INVALID_ARG",
        [FL_ERR_IO] = "FL_ERR_IO",
        [FL_ERR_FORMAT] = "FL_ERR_FORMAT",
        [FL_ERR_NOT_FOUND] = "FL_ERR_NOT_FOUND",
        [FL_ERR_UNSUPPORTED] = "FL_ERR_UNSUPPORTED",
        [FL_ERR_OOM] = "FL_ERR_OOM",
        [FL_ERR_CUDA] = "FL_ERR_CUDA",
        [FL_ERR_CUBLAS] = "FL_ERR_CUBLAS",
        [FL_ERR_NCCL] = "FL_ERR_NCCL",
        [FL_ERR_MPI] = "FL_ERR_MPI",
        [FL_ERR_HWLOC] = "FL_ERR_HWLOC",
        [FL_ERR_SYSTEM] = "FL_ERR_SYSTEM",
        [FL_ERR_INTERNAL] = "FL_ERR_INTERNAL",
    };
    if ((unsigned)st >= FL_STATUS_COUNT) return "FL_ERR_UNKNOWN";
    return names[st];
}

fl_status fl_error_set(fl_status st, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_msg, sizeof g_msg, fmt, ap);
    va_end(ap);
    snprintf(g_where, sizeof g_where, "%s:%d", file, line);
    return st;
}

const char *fl_error_msg(void) { return g_msg; }
const char *fl_error_where(void) { return g_where; }
void fl_error_clear(void) { g_msg[0] = 0; g_where[0] = 0; }

void fl_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "flotilla: internal assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}
