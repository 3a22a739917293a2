/*
 * cuda_workspace.h — per-backend f32 scratch buffers for CUDA ops that need
 * one (MLA's q_lat and split partials, flash-decoding partials).
 *
 * Ops never allocate per call (kernels/backend.h), and the backend state
 * (fl_cuda, cuda_common.cuh) has no field for every op's scratch, so one
 * small registry keeps a buffer per (backend, slot). Slots keep the users
 * apart: MLA and attention run in the same step and their buffers must not
 * alias when a graph records both.
 *
 * Contract (what makes it safe under CUDA graphs):
 *  - a buffer only grows, and only on an eager call: growth allocates a new
 *    buffer and keeps the old one allocated for the life of the process, so a
 *    graph that recorded the old pointer still reads valid memory (it is at
 *    most half the size of the new one, so the leak is bounded by 2x);
 *  - while the backend's stream is being captured, a request that needs
 *    growth fails with FL_ERR_UNSUPPORTED instead of allocating. Callers size
 *    requests from host-known launch parameters only (n_seqs, max_q_len,
 *    max_ctx_len), so the eager step the engine runs before capturing a
 *    bucket (runtime/model/forward_graph.c) asks for the same size;
 *  - the returned pointer is valid until the process ends; the contents are
 *    the caller's for the duration of its ops on the backend's stream;
 *  - a newly allocated buffer is zero-filled (cudaMemsetAsync on the
 *    backend's stream, so every op enqueued after the call sees zeros). A
 *    user that leaves its buffer zero after each of its ops (matmul_add_rms's
 *    block counter, FL_CUDA_WS_SLOT_RMS_CNT) can rely on zeros at every op
 *    and every graph replay: the old buffer a graph recorded keeps the
 *    zeros the last op left, and a grown one starts zeroed.
 * Thread-safe (a mutex); the registry holds at most FL_CUDA_WS_BACKENDS
 * backends per process.
 */
#ifndef FL_CUDA_WORKSPACE_H
#define FL_CUDA_WORKSPACE_H

#include <stddef.h>

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fl_cuda_ws_slot {
    FL_CUDA_WS_SLOT_MLA = 0,  /* cuda_mla.cu */
    FL_CUDA_WS_SLOT_ATTN = 1, /* cuda_attention.cu: flash-decoding partials */
    FL_CUDA_WS_SLOT_RMS_CNT = 2, /* cuda_rmsdefer.cu: matmul_add_rms's block counter (rms_final_on;
                                    zero between ops) */
    FL_CUDA_WS_SLOT_FP8 = 3,  /* cuda_fp8.cu: a step's activations as e4m3 codes and their scales */
    FL_CUDA_WS_SLOT_COUNT
} fl_cuda_ws_slot;

#define FL_CUDA_WS_BACKENDS 64

/* *out = the backend's buffer for `slot`, at least `bytes` long (see the
 * contract above). `who` names the op in error messages. */
fl_status fl_cuda_workspace_get(fl_backend *b, fl_cuda_ws_slot slot, size_t bytes, const char *who,
                                float **out);

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_WORKSPACE_H */
