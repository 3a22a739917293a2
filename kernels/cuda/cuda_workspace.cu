/*
 * cuda_workspace.cu — the per-(backend, slot) f32 scratch registry (contract
 * in cuda_workspace.h). Moved out of cuda_mla.cu so attention's
 * flash-decoding partials use the same grow-on-eager-only rule.
 */
#include <pthread.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_workspace.h"

typedef struct ws_entry {
    fl_backend *b;
    int device;
    void *ptr[FL_CUDA_WS_SLOT_COUNT];
    size_t bytes[FL_CUDA_WS_SLOT_COUNT];
} ws_entry;

static ws_entry g_ws[FL_CUDA_WS_BACKENDS];
static pthread_mutex_t g_ws_lock = PTHREAD_MUTEX_INITIALIZER;

extern "C" fl_status fl_cuda_workspace_get(fl_backend *b, fl_cuda_ws_slot slot, size_t bytes, const char *who,
                                           float **out) {
    fl_cuda *c = cuda_impl(b);
    fl_status st = FL_OK;
    *out = NULL;
    if ((int)slot < 0 || slot >= FL_CUDA_WS_SLOT_COUNT)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: workspace slot %d (have %d)", who, (int)slot,
                      (int)FL_CUDA_WS_SLOT_COUNT);
    pthread_mutex_lock(&g_ws_lock);
    ws_entry *e = NULL;
    for (int i = 0; i < FL_CUDA_WS_BACKENDS && !e; i++)
        if (g_ws[i].b == b && g_ws[i].device == c->device) e = &g_ws[i];
    for (int i = 0; i < FL_CUDA_WS_BACKENDS && !e; i++)
        if (!g_ws[i].b) {
            e = &g_ws[i];
            e->b = b;
            e->device = c->device;
        }
    if (!e) {
        st = FL_ERR(FL_ERR_UNSUPPORTED, "%s: more than %d CUDA backends in one process", who,
                    FL_CUDA_WS_BACKENDS);
        goto done;
    }
    if (e->bytes[slot] < bytes) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(c->stream, &cs) != cudaSuccess) {
            (void)cudaGetLastError();
            cs = cudaStreamCaptureStatusActive;
        }
        if (cs != cudaStreamCaptureStatusNone) {
            st = FL_ERR(FL_ERR_UNSUPPORTED, "%s: a captured step needs %zu bytes of workspace "
                        "(have %zu); run one eager step of this size before capturing", who, bytes,
                        e->bytes[slot]);
            goto done;
        }
        size_t nb = e->bytes[slot] ? e->bytes[slot] : ((size_t)1 << 20);
        while (nb < bytes) nb *= 2;
        void *p = NULL;
        cudaError_t ce = cudaMalloc(&p, nb);
        if (ce != cudaSuccess) {
            (void)cudaGetLastError();
            st = FL_ERR(ce == cudaErrorMemoryAllocation ? FL_ERR_OOM : FL_ERR_CUDA,
                        "%s: workspace of %zu bytes on device %d: %s", who, nb, c->device,
                        cudaGetErrorString(ce));
            goto done;
        }
        ce = cudaMemsetAsync(p, 0, nb, c->stream); /* zeros (see the header): not captured, see above */
        if (ce != cudaSuccess) {
            (void)cudaGetLastError();
            (void)cudaFree(p);
            st = FL_ERR(FL_ERR_CUDA, "%s: zeroing a workspace of %zu bytes on device %d: %s", who, nb, c->device,
                        cudaGetErrorString(ce));
            goto done;
        }
        /* the old buffer stays allocated (see the header); it is at most half the new one */
        e->ptr[slot] = p;
        e->bytes[slot] = nb;
    }
    *out = (float *)e->ptr[slot];
done:
    pthread_mutex_unlock(&g_ws_lock);
    return st;
}
