/*
 * backend.c — backend selection by name and destruction.
 */
#include "kernels/backend.h"

#include <string.h>

#ifndef FL_HAVE_CUDA
fl_status fl_backend_cuda_init(int device, fl_backend **out) {
    (void)device;
    *out = NULL;
    return FL_ERR(FL_ERR_UNSUPPORTED, "this flotilla was built without the CUDA backend "
                  "(no nvcc at configure time); use --backend cpu");
}
#endif

fl_status fl_backend_init_by_name(const char *name, int device, fl_backend **out) {
    *out = NULL;
    if (!name || !strcmp(name, "auto")) {
        if (fl_backend_cuda_init(device, out) == FL_OK) return FL_OK;
        return fl_backend_cpu_init(out);
    }
    if (!strcmp(name, "cpu")) return fl_backend_cpu_init(out);
    if (!strcmp(name, "cuda")) return fl_backend_cuda_init(device, out);
    return FL_ERR(FL_ERR_INVALID_ARG, "unknown backend '%s' (expected auto, cpu or cuda)", name);
}

void *fl_backend_native_stream(fl_backend *b) {
    return b && b->ops->native_stream ? b->ops->native_stream(b) : NULL;
}

void fl_backend_free(fl_backend *b) {
    if (b) b->ops->destroy(b);
}
