/*
 * cuda_rmsdefer.cu — the deferred norm (kernels/backend.h's fl_rms_defer):
 * matmul_add_rms, the producer, whose work is done by the decode GEMV's
 * residual epilogue (gv_resid in cuda_gemv_common.cuh: both W4 GEMV
 * kernels), and rms_defer_apply, the scaling a consumer runs first when its
 * kernel cannot take the partials (cuda_gemv.cu's gate_up_silu and
 * matmul_rope_kv take them in the bulk kernel's epilogue).
 *
 * Why. Inside the graph-replayed decode step each dependent launch costs
 * a few microseconds of release, round trip and ramp whatever it does
 * (FL_DIAG_SKIP times the two add_rmsnorm launches of a layer; docs/cuda.md).
 * Folding the whole norm into the next GEMV's prologue (removed) stalled
 * every block on a row
 * read and two barriers before its first mma. Split instead: the norm is
 * linear after the sum of squares, rmsnorm(x) w W^T = (x w) W^T / rms(x),
 * so the GEMV before it writes x w and each block's partial sum of squares
 * of its rows (each element once across the grid, in the epilogue), and
 * the GEMV after it reads x w as its plain input and scales each token's
 * dot products by 1 / rms in its epilogue; neither main loop changes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_gemv_common.cuh"
#include "kernels/cuda/cuda_workspace.h"

extern "C" fl_status fl_cuda_w4_gemv_resid(fl_backend *b, const bf16 *x, int n, int in, int rows,
                                           const fl_tensor *w, const void *bias, int bias_f32, const gv_resid *rs,
                                           int *slots);
extern "C" int fl_cuda_w4_gemv_use_old(void);

/* The rms_defer override at 0 turns the producer off (matmul_add_rms_max_n
 * says 0, so the forward pass keeps add_rmsnorm: the A/B); else on. */
static bool rms_defer_on(void) { return cuda_tune_on(FL_CUDA_TUNE_RMS_DEFER); }

/* Whether the producer's last block adds the partials up (gv_resid_final)
 * at n tokens, so a consumer reads one total a token (slots 1). Without it
 * each consumer block adds n x (the producer's blocks) partials in its
 * epilogue, a warp a token: at 16 tokens ~8 serial sums a warp in each of
 * gate|up's 896 two-warp blocks, which is why deferring had stopped paying
 * past one token. The rms_defer_final override: 0 never, 1 always; the
 * default from 2 tokens on, because the chain of a layer's GEMVs
 * (test_cuda_rmsdefer) measured faster with the totals from 4 tokens and
 * slower at one token, where the last block's sums lengthen the producer's
 * tail. */
static bool rms_final_on(int n) {
    const long v = fl_cuda_tune(FL_CUDA_TUNE_RMS_DEFER_FINAL);
    return v >= 0 ? v != 0 : n >= 2;
}

extern "C" int fl_cuda_matmul_add_rms_max_n(fl_backend *b, const fl_tensor *w) {
    if (!rms_defer_on() || w->ndim != 2) return 0;
    /* W4 only: the same epilogue on the bf16 decode GEMV measured slower
     * (its one-tile blocks already hide the norm launch under their PDL
     * prologue, and its one-warp epilogue takes the added work serially) */
    if (w->dtype != FL_DTYPE_W4 || fl_cuda_w4_gemv_use_old()) return 0;
    const int64_t rows = w->shape[0], in = w->shape[1];
    /* the GEMV route of matmul (cuda_matmul.cu's matmul_w4), one launch of
     * at most 16 tokens, at most FL_RMS_DEFER_SLOTS blocks (one a tile) */
    if (!w4_packed(rows, in, w->group) || rows / 16 > FL_RMS_DEFER_SLOTS || rows * in / 32 >= ((int64_t)1 << 31))
        return 0;
    const int deq = cuda_impl(b)->w4_deq_min_n - 1;
    return deq < FL_RMS_DEFER_MAX_N ? (deq > 0 ? deq : 0) : FL_RMS_DEFER_MAX_N;
}

extern "C" fl_status fl_cuda_matmul_add_rms(fl_backend *b, const void *x, int n, const fl_tensor *w,
                                            const fl_tensor *bias, void *resid, const fl_tensor *norm_w, void *h,
                                            fl_rms_defer *rd) {
    if (n <= 0) return FL_OK;
    if (n > fl_cuda_matmul_add_rms_max_n(b, w))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda matmul_add_rms: %d tokens or these weights are not taken "
                      "(ask matmul_add_rms_max_n)", n);
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    if (norm_w->dtype != FL_DTYPE_F32 && norm_w->dtype != FL_DTYPE_BF16)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul_add_rms: norm weight dtype %s (expected F32/BF16)",
                      fl_dtype_name(norm_w->dtype));
    if (fl_tensor_numel(norm_w) != rows)
        return FL_ERR(FL_ERR_INVALID_ARG, "matmul_add_rms: norm weight has %lld elements, rows have %d",
                      (long long)fl_tensor_numel(norm_w), rows);
    if (bias && (fl_tensor_numel(bias) != rows || (bias->dtype != FL_DTYPE_F32 && bias->dtype != FL_DTYPE_BF16)))
        return FL_ERR(FL_ERR_INVALID_ARG, "matmul_add_rms: bias of %lld elements (%s) for %d rows",
                      (long long)fl_tensor_numel(bias), fl_dtype_name(bias->dtype), rows);
    if (!rd || !rd->ss || h == resid || h == x || resid == x)
        return FL_ERR(FL_ERR_INVALID_ARG, "matmul_add_rms: no partials, or h, resid and x alias");
    if (((uintptr_t)x & 15) != 0) return FL_ERR(FL_ERR_INVALID_ARG, "cuda matmul_add_rms: x must be 16-byte aligned");
    gv_resid rs = {(bf16 *)resid, (bf16 *)h, norm_w->data, norm_w->dtype == FL_DTYPE_F32, rd->ss, 0, NULL};
    if (rms_final_on(n)) { /* the counter stays 0 between launches (the workspace's zero-filled slot) */
        float *cnt = NULL;
        FL_TRY(fl_cuda_workspace_get(b, FL_CUDA_WS_SLOT_RMS_CNT, sizeof(int), "cuda matmul_add_rms", &cnt));
        rs.cnt = (int *)cnt;
    }
    int slots = 0;
    FL_TRY(fl_cuda_w4_gemv_resid(b, (const bf16 *)x, n, in, rows, w, bias ? bias->data : NULL,
                                 bias && bias->dtype == FL_DTYPE_F32, &rs, &slots));
    rd->slots = rs.cnt ? 1 : slots; /* the totals at ss[tok * 4], or every block's partial */
    return FL_OK;
}

/* One block a token: 1 / rms from the partials (gv_rmsd_inv, what the
 * consumers' epilogue computes), then h scaled in place and rounded. */
static __global__ void rms_defer_apply_kernel(const gv_rmsd rd, int d, bf16 *h) {
    pdl_enter();
    __shared__ float inv;
    if (threadIdx.x < 32) {
        const float v = gv_rmsd_inv(rd.ss + (size_t)blockIdx.x * rd.spad, rd.slots, d, rd.eps);
        if (threadIdx.x == 0) inv = v;
    }
    __syncthreads();
    bf16 *row = h + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) row[i] = f2bf(bf2f(row[i]) * inv);
}

extern "C" fl_status fl_cuda_rms_defer_apply(fl_backend *b, const fl_rms_defer *rd, int n, int d, void *h) {
    if (n <= 0) return FL_OK;
    if (!rd->ss || rd->slots < 1 || rd->slots > FL_RMS_DEFER_SLOTS)
        return FL_ERR(FL_ERR_INVALID_ARG, "rms_defer_apply: %d partials a token (1..%d)", rd->slots,
                      FL_RMS_DEFER_SLOTS);
    return launch_pdl(rms_defer_apply_kernel, dim3((unsigned)n), dim3(256), 0, cuda_impl(b)->stream, gv_rmsd_of(rd), d,
                      (bf16 *)h);
}
