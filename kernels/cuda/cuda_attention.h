/*
 * cuda_attention.h — knobs of the CUDA attention op for tests and
 * benchmarks (the op itself is fl_cuda_attention, contract in
 * kernels/backend.h). Normal runs never call these: the op picks its kernel
 * and split count from the call's host-known sizes.
 */
#ifndef FL_CUDA_ATTENTION_H
#define FL_CUDA_ATTENTION_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fl_cuda_attn_kernel {
    FL_CUDA_ATTN_AUTO = 0,    /* the split decode kernel for decode of long contexts (unless
                                 attn_splitdec=0), the tensor-core kernel for prefill (and long decode
                                 at other shapes), the GQA decode kernel for decode of short contexts, SIMT
                                 for what is left */
    FL_CUDA_ATTN_SIMT = 1,    /* always the SIMT kernel attention_kernel (no split) */
    FL_CUDA_ATTN_MMA = 2,     /* the tensor-core kernel attn_mma_kernel wherever its shapes allow (head_dim
                                 64 / 128): long decode on the route before the split decode kernel */
    FL_CUDA_ATTN_DECODE = 3,  /* the GQA decode kernel wherever its shapes allow (max_q_len 1, max_ctx_len
                                 <= 128, head_dim a multiple of 8, 16-byte aligned rows), else as AUTO */
    FL_CUDA_ATTN_SPLITDEC = 4 /* the split decode kernel wherever its shapes allow (max_q_len 1, any
                                 max_ctx_len, head_dim 64 / 128, 16-byte aligned rows), else as AUTO */
} fl_cuda_attn_kernel;

/* Process-wide override: kernel choice, the decode split count (0:
 * automatic; n > 0: exactly n, capped by the workspace budget, by 64 and
 * by max_ctx_len / 64, or / 128 on the split decode kernel) and the
 * tensor-core kernel's K/V tile stages (0: default; 1: load, wait,
 * compute; 2: double-buffered; the split decode kernel has its own ring).
 * Not thread-safe against concurrent attention calls: set it between
 * steps. */
void fl_cuda_attention_set_policy(fl_cuda_attn_kernel kernel, int splits, int stages);

/* Process-wide override of the split decode kernel's prewait mode (-1: the
 * splitdec_prewait override of cuda_tune.h, default on; 0 off; 1 on): stage
 * the K/V rows of earlier steps before griddepcontrol.wait. Read at each
 * call (a captured call keeps the mode of its capture). Not thread-safe
 * against concurrent attention calls. */
void fl_cuda_attention_set_split_modes(int prewait);

/* Process-wide override of the query heads a block of the short-context
 * decode kernel serves (1..4; 0: the attn_dec_heads override of
 * cuda_tune.h, default automatic: the fewest of 1, 2, 4 that keep the grid within
 * two blocks an SM). Read at each call; not thread-safe against concurrent
 * attention calls. */
void fl_cuda_attention_set_decode_heads(int heads);

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_ATTENTION_H */
