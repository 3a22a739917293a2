/*
 * cuda_moe_route.cu — a MoE layer's router in one launch (moe_route,
 * contract in kernels/backend.h): the router GEMV, the softmax top-k and the
 * grouping of the (token, expert) pairs by local expert.
 *
 * Why. Apart, these are four dependent launches a MoE layer at decode
 * (cuBLAS's split-K GEMV and its reduce for the router, moe_topk,
 * moe_group) for almost no work: Mixtral's router is 8 x 4096 (64 KB).
 * Nsight Compute, Mixtral w4 batch 1 (2026-12-02): 5.4 + 2.7 + 4.0 + 2.9 us
 * a layer cold, and in the graph-replayed step each dependent stage costs
 * its launch, release and ramp whatever it does.
 *
 * How. Work items are (expert row e, column chunk c of ROUTE_CHUNK), a warp
 * an item. Its lanes load the item's router weights before
 * griddepcontrol.wait (they never depend on the previous kernel), then dot
 * them with every token's x in f32 and write one partial per (token, e, c)
 * to the workspace. The block that finishes last (threadfence, then one
 * atomicAdd on a counter, the pattern of the split decode's fused merge)
 * sums each logit's partials in chunk order (deterministic), rounds it to
 * bf16 as matmul's output is rounded, writes the logits, picks each row's
 * experts (moe_topk_row, a warp a row) and groups the pairs
 * (moe_group_block): the same code as moe_topk and moe_group, so from the
 * same logits the ids, weights and list are the same bits. Then it puts
 * the counter back to 0, so every launch and graph replay starts from 0.
 * The serial tail is what the separate moe_topk and moe_group already were:
 * one block each.
 *
 * Measured (H200, bench/results/2026-12-02-h200-moe-route/): alone 7.9 us a
 * Mixtral layer against 15.0 for the four launches, but end to end no
 * faster (Mixtral, DeepSeek-V2-Lite within noise; Qwen3-30B-A3B 0.5-5 %
 * slower): under PDL the four overlap, and this tail is one serial chain
 * as long as theirs. So the forward takes it only with FL_MOE_ROUTE=1
 * (runtime/model/forward_moe_dev.c).
 */
#include <stdint.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_moe_route.cuh"
#include "kernels/cuda/cuda_workspace.h"

#define ROUTE_THREADS 512 /* 16 warps: at 16 rows the tail picks every row's experts at once */
#define ROUTE_WARPS (ROUTE_THREADS / 32)
#define ROUTE_CHUNK 512 /* columns an item: 32 lanes x 2 pieces of 8 */
#define ROUTE_MAX_E 160 /* experts (router rows) and local experts the tail's shared scratch holds
                           (DeepSeek-V2's 160; static shared memory: 16 warps' scratch) */
#define ROUTE_MAX_K 16  /* top-k the tail's shared copy of the ids holds */
#define ROUTE_TOK 8     /* tokens a pass: accumulators a lane */
#define ROUTE_WS_HEAD 32 /* workspace floats before the partials: [0] is the block counter */

static __global__ void __launch_bounds__(ROUTE_THREADS)
    moe_route_kernel(const bf16 *x, int n, int H, const bf16 *w, int E, int nch, int k, fl_moe_route r,
                     int grouped, int e_lo, int n_local, float *ws, bf16 *logits, int32_t *ids, float *weights,
                     int32_t *list) {
    __shared__ float probs[ROUTE_WARPS][ROUTE_MAX_E], gmax[ROUTE_WARPS][ROUTE_MAX_E];
    __shared__ bool keep[ROUTE_WARPS][ROUTE_MAX_E];
    __shared__ bf16 slog[FL_MOE_ROUTE_MAX_N * ROUTE_MAX_E];
    __shared__ int32_t cnt[ROUTE_MAX_E + 1], s_ids[FL_MOE_ROUTE_MAX_N * ROUTE_MAX_K];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int item = blockIdx.x * ROUTE_WARPS + warp;
    const bool live = item < E * nch;
    const int e = live ? item / nch : 0, c = live ? item % nch : 0;
    const int c1 = min(H, (c + 1) * ROUTE_CHUNK);
    int col[2];
    uint4 wv[2] = {};
#pragma unroll
    for (int i = 0; i < 2; i++) {
        col[i] = c * ROUTE_CHUNK + i * 256 + lane * 8;
        if (!live || col[i] >= c1) col[i] = -1;
    }
    /* the weights before the wait (see launch_pdl: nothing before writes
     * them); everything else after it */
    if (FL_PDL_EARLY) pdl_trigger();
#pragma unroll
    for (int i = 0; i < 2; i++)
        if (col[i] >= 0) wv[i] = __ldg((const uint4 *)(w + (size_t)e * H + col[i]));
    pdl_wait();
    if (!FL_PDL_EARLY) pdl_trigger();
    float *part = ws + ROUTE_WS_HEAD;
    if (live) {
        float wf[2][8];
#pragma unroll
        for (int i = 0; i < 2; i++) bf16x8_unpack(wv[i], wf[i]);
        /* every load of a pass issued before the first use: rows past n
         * read row n - 1 and pieces past the chunk read its first piece,
         * and are not accumulated (a load behind a branch would wait for
         * the one before it, 16 x 2 round trips in a row at 16 rows) */
        const int cx0 = col[0] >= 0 ? col[0] : 0, cx1 = col[1] >= 0 ? col[1] : cx0;
        for (int t0 = 0; t0 < n; t0 += ROUTE_TOK) {
            uint4 xv[ROUTE_TOK][2];
#pragma unroll
            for (int tt = 0; tt < ROUTE_TOK; tt++) {
                const bf16 *xr = x + (size_t)min(t0 + tt, n - 1) * H;
                xv[tt][0] = *(const uint4 *)(xr + cx0);
                xv[tt][1] = *(const uint4 *)(xr + cx1);
            }
            float acc[ROUTE_TOK];
#pragma unroll
            for (int tt = 0; tt < ROUTE_TOK; tt++) {
                acc[tt] = 0.0f;
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    float xf[8];
                    bf16x8_unpack(xv[tt][i], xf);
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        acc[tt] = col[i] >= 0 ? fmaf(wf[i][j], xf[j], acc[tt]) : acc[tt];
                }
            }
#pragma unroll
            for (int tt = 0; tt < ROUTE_TOK; tt++) {
                if (t0 + tt >= n) break;
                const float s = warp_sum(acc[tt]);
                if (lane == 0) part[((size_t)(t0 + tt) * E + e) * nch + c] = s;
            }
        }
    }
    /* the last block to finish goes on: every partial is written by then */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd((unsigned *)ws, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < n * E; i += ROUTE_THREADS) {
        float s = 0.0f;
        for (int cc = 0; cc < nch; cc++) s += __ldcg(part + (size_t)i * nch + cc);
        const bf16 v = f2bf(s);
        slog[i] = v;
        logits[i] = v;
    }
    __syncthreads();
    for (int row = warp; row < n; row += ROUTE_WARPS)
        moe_topk_row(slog + row * E, E, k, r, grouped, probs[warp], gmax[warp], keep[warp], ids + (size_t)row * k,
                     weights + (size_t)row * k, s_ids + row * k);
    __syncthreads();
    moe_group_block(s_ids, n * k, e_lo, n_local, list, cnt);
    if (threadIdx.x == 0) *(unsigned *)ws = 0u;
}

extern "C" fl_status fl_cuda_moe_route(fl_backend *b, const void *x, int n, const fl_tensor *router, int k,
                                       const fl_moe_route *r, int e_lo, int n_local, void *logits, int32_t *ids,
                                       float *weights, int32_t *list) {
    if (!router || router->dtype != FL_DTYPE_BF16 || router->ndim != 2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda moe_route: the router must be a 2-D bf16 weight");
    const int64_t E = router->shape[0], H = router->shape[1];
    if (E < 1 || E > ROUTE_MAX_E || H < 8 || H % 8 || H > (1 << 24) || k < 1 || k > E || k > ROUTE_MAX_K ||
        n_local < 1 || n_local > ROUTE_MAX_E || e_lo < 0 || e_lo + n_local > E)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda moe_route: router [%lld, %lld], top-%d, local experts [%d, %d) "
                      "(takes up to %d experts, top-%d, columns a multiple of 8)", (long long)E, (long long)H, k,
                      e_lo, e_lo + n_local, ROUTE_MAX_E, ROUTE_MAX_K);
    if (n < 0 || n > FL_MOE_ROUTE_MAX_N)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda moe_route: %d rows (at most %d)", n, FL_MOE_ROUTE_MAX_N);
    if (n == 0) return FL_OK; /* probe */
    if (((uintptr_t)x & 15) || ((uintptr_t)router->data & 15))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda moe_route: x and the router must be 16-byte aligned");
    const int nch = (int)((H + ROUTE_CHUNK - 1) / ROUTE_CHUNK);
    const int64_t items = E * nch;
    /* sized for FL_MOE_ROUTE_MAX_N rows whatever n is: one allocation on the
     * first (eager) call, never a growth inside a capture */
    float *ws = NULL;
    FL_TRY(fl_cuda_workspace_get(b, FL_CUDA_WS_SLOT_MOE_ROUTE,
                                 (ROUTE_WS_HEAD + (size_t)FL_MOE_ROUTE_MAX_N * items) * sizeof(float), "moe_route",
                                 &ws));
    return launch_pdl(moe_route_kernel, cdiv_u(items, ROUTE_WARPS), ROUTE_THREADS, 0, cuda_impl(b)->stream,
                      (const bf16 *)x, n, (int)H, (const bf16 *)router->data, (int)E, nch, k, *r,
                      fl_moe_route_grouped(r, (int)E) ? 1 : 0, e_lo, n_local, ws, (bf16 *)logits, ids, weights,
                      list);
}
