/*
 * cuda_test_hooks.h — what the CUDA tests and bench/bench_kernels.cu call
 * besides the backend's op table: forced kernel configurations, counters
 * and the backend's own route predicates. C linkage; defined in the CUDA
 * backend's sources, so only builds with it (FL_HAVE_CUDA) link them. Tuning overrides are in cuda_tune.h.
 *
 * Threading: the setters change process-wide state; call them between
 * launches, from one thread.
 */
#ifndef FL_CUDA_TEST_HOOKS_H
#define FL_CUDA_TEST_HOOKS_H

#include <stdbool.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_fused.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Forces the packed W4 GEMV's configuration (cuda_gemv.cu): kernel 0 = the
 * default kernel, auto config; 1 = the register-ring kernel with the given
 * t (tiles a block) / nw (warps a block) / r (ring depth), 0: auto for that
 * one; 2 = the old w4_mma_kernel (cuda_matmul.cu); 3 = the bulk-copy kernel
 * with variant t and nw warps (0: auto); 4 = the same streaming its weights
 * without the math (a probe of the memory side). pf (L2 prefetch distance in
 * steps; routed mode: the next item's steps) and xpf (x prefetched into L1)
 * reach the ring kernel only from here (both measured slower; -1 or 0: off). */
void fl_cuda_w4_gemv_tune(int kernel, int t, int nw, int r, int pf, int xpf);
/* The configuration of the last W4 GEMV launch {T, warps, R, pf, xpf}; the
 * bulk kernel: {-variant, warps, rope, 0, 0}, rope 1 when its epilogue
 * rotated q|k (matmul_rope_kv); its routed mode: {-variant, warps, 0, item
 * rows, 0}. */
void fl_cuda_w4_gemv_last(int cfg[5]);
/* Sets the batch from which packed W4 matmuls dequantize + cuBLAS on this
 * backend (the default: 128, or the w4_dequant_min_n override at init). */
void fl_cuda_w4_set_dequant_min_n(fl_backend *b, int n);

/* The bf16 decode GEMV (cuda_gemv_bf16.cu): whether it takes this matmul
 * (sm_90, 1..8 tokens, rows and in multiples of 16, up to 14 tiles an SM or
 * the bf16_gemv override, aligned pointers). fl_cuda_bf16_gemv_force: 1
 * takes it up to 64 tiles an SM, 0 never, -1 back to the rule. */
bool fl_cuda_bf16_gemv_takes(fl_backend *b, const void *x, int n, const fl_tensor *w);
void fl_cuda_bf16_gemv_force(int on);
/* The FP8 decode GEMV (cuda_gemv_fp8.cu): whether it takes this matmul of
 * n tokens (sm_90, an FP8 linear with rows and in multiples of 16, 1..8
 * tokens; the fp8_gemv override: 0 never, 1 up to 16). */
bool fl_cuda_fp8_gemv_takes(fl_backend *b, int n, const fl_tensor *w);
/* Whether cuda_gemv_rows.cu's kernel takes this bf16 matmul (up to 64 rows
 * and 16 tokens). */
bool fl_cuda_gemv_rows_takes(const void *x, int n, const fl_tensor *w);

/* The deferred norm (cuda_rmsdefer.cu): launches that took a deferred norm
 * into their epilogue, producers and consumers, since the process started;
 * and the scaling a consumer runs first when its kernel does not take rd:
 * h[n, d] scaled in place by each token's 1 / rms. */
long fl_cuda_rms_defer_fused(void);
/* FP8 linears (cuda_fp8.cu): FP8 matmuls enqueued since the process
 * started, the decode GEMV's and cuBLASLt's (a test's proof that a model's
 * matmuls took the FP8 path). */
long fl_cuda_fp8_gemm_launches(void);
fl_status fl_cuda_rms_defer_apply(fl_backend *b, const fl_rms_defer *rd, int n, int d, void *h);

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_TEST_HOOKS_H */
