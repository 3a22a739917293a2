/*
 * cuda_backend.h — the few CUDA-backend entry points beyond the op table
 * (kernels/backend.h), for benchmarks and tests that time work on the
 * backend's stream. Only meaningful when flotilla was built with CUDA.
 */
#ifndef FL_CUDA_BACKEND_H
#define FL_CUDA_BACKEND_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The cudaStream_t (as void *) every op of this CUDA backend is enqueued
 * on; NULL when b is not a CUDA backend. The backend keeps ownership. */
void *fl_backend_cuda_stream(fl_backend *b);

/* The mla_attention op (kernels/cuda/cuda_mla.cu; contract in kernels/backend.h). */
fl_status fl_cuda_mla_attention(fl_backend *b, const void *q, const fl_attn_meta *m, int n_heads, int nope,
                                int rope, int v_dim, int kv_lora, float scale, const fl_tensor *wkv_b,
                                const void *k_cache, const void *v_cache, void *out);

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_BACKEND_H */
