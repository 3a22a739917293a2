/*
 * cuda_backend.h — internal to kernels/cuda/: CUDA-backend entry points
 * shared between its .cu files. Everything outside kernels/cuda/ reaches the
 * backend through the op table (kernels/backend.h).
 */
#ifndef FL_CUDA_BACKEND_H
#define FL_CUDA_BACKEND_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The mla_attention op (kernels/cuda/cuda_mla.cu; contract in kernels/backend.h). */
fl_status fl_cuda_mla_attention(fl_backend *b, const void *q, const fl_attn_meta *m, int n_heads, int nope,
                                int rope, int v_dim, int kv_lora, float scale, const fl_tensor *wkv_b,
                                const void *k_cache, const void *v_cache, void *out);

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_BACKEND_H */
