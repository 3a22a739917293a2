/*
 * cuda_norm.cuh — one row of the residual add fused with RMSNorm, as a
 * device function that any block size can run: add_rmsnorm_kernel
 * (cuda_ops.cu, a block per row) and the W4 GEMVs' tail (cuda_gemv.cu,
 * cuda_gemv_bulk.cu: the GEMV's last block to finish runs it on the rows
 * the grid just wrote, in place of a separate launch).
 *
 * Why a fixed reduction order. The fused path must give what the separate
 * kernel gives, bit for bit (same logits with and without the fusion, so a
 * greedy run does not change with a launch detail), but the two run with
 * different block sizes (256 threads; the GEMV's 32..512). So the sum of
 * squares is split over FL_NORM_V "virtual lanes", not over threads:
 * lane v sums the squares of elements v, v + FL_NORM_V, ... in ascending
 * order, and warp 0 adds the FL_NORM_V partials in one fixed tree. A
 * thread takes lanes threadIdx.x, threadIdx.x + blockDim.x, ...; the result
 * depends on the data only.
 */
#ifndef FL_CUDA_NORM_CUH
#define FL_CUDA_NORM_CUH

#include "kernels/cuda/cuda_common.cuh"

#define FL_NORM_V 256 /* virtual lanes of the sum of squares */
/* the row function's FL_NORM_V + 1 floats, then the tail's last-block flag */
#define FL_NORM_SCRATCH_BYTES ((FL_NORM_V + 2) * sizeof(float))

/* x[d] += y[d] (each sum rounded to bf16, as add_kernel stores it), then
 * out[j] = bf16(w[j] * (x[j] * inv)) with inv = 1 / sqrt(sum x^2 / d + eps)
 * over the stored x. y is read through L2 (ld.global.cg): in the GEMV tail
 * other blocks of the grid wrote it, and this SM's L1 may hold no line of
 * it that is not stale. part: FL_NORM_SCRATCH_BYTES of shared memory. Every
 * thread of the block calls it; it starts and ends at a barrier. out must
 * not alias x or y.
 * Latency, not bandwidth, is the cost (one row is 8-16 KB): E elements of a
 * lane are loaded before any is stored (a store may alias a later load, so
 * the compiler would not hoist it), and when the block has a thread per
 * lane and the row fits one batch (E x FL_NORM_V elements: 4096 at E = 16)
 * the sums and the weight stay in registers across the reduction, so the
 * row costs about two L2 round trips. Otherwise the second pass re-reads
 * x, E elements at a time. E changes neither the order nor the values. */
template <int E>
static __device__ void fl_add_rmsnorm_row(bf16 *__restrict__ x, const bf16 *__restrict__ y, const void *w,
                                          int wf32, float eps, int d, bf16 *__restrict__ out, float *part) {
    __syncthreads(); /* part may still be read by the previous row */
    const bool held = blockDim.x >= FL_NORM_V && d <= E * FL_NORM_V;
    float keep[E], wk[E];
    for (int v = threadIdx.x; v < FL_NORM_V; v += blockDim.x) {
        float ss = 0.0f;
        for (int j0 = v; j0 < d; j0 += E * FL_NORM_V) {
            bf16 xv[E], yv[E];
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int j = j0 + e * FL_NORM_V;
                if (j < d) {
                    xv[e] = x[j];
                    yv[e] = __ldcg(y + j);
                    if (held) wk[e] = vec_load(w, wf32, j);
                }
            }
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int j = j0 + e * FL_NORM_V;
                if (j < d) {
                    const bf16 s = f2bf(bf2f(xv[e]) + bf2f(yv[e]));
                    x[j] = s;
                    const float f = bf2f(s);
                    keep[e] = f;
                    ss += f * f;
                }
            }
        }
        part[v] = ss;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < FL_NORM_V / 32; i++) s += part[threadIdx.x + 32 * i];
        s = warp_sum(s);
        if (threadIdx.x == 0) part[FL_NORM_V] = s;
    }
    __syncthreads(); /* also makes every thread's x stores visible to the block */
    const float inv = 1.0f / sqrtf(part[FL_NORM_V] / (float)d + eps);
    if (held) {
        if (threadIdx.x < FL_NORM_V) {
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int j = threadIdx.x + e * FL_NORM_V;
                if (j < d) out[j] = f2bf(wk[e] * (keep[e] * inv));
            }
        }
        return;
    }
    for (int j0 = threadIdx.x; j0 < d; j0 += E * blockDim.x) {
        float xv[E], wv[E];
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = j0 + e * blockDim.x;
            if (j < d) {
                xv[e] = bf2f(x[j]);
                wv[e] = vec_load(w, wf32, j);
            }
        }
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = j0 + e * blockDim.x;
            if (j < d) out[j] = f2bf(wv[e] * (xv[e] * inv));
        }
    }
}

/* The W4 GEMVs' optional tail (done == NULL: none): after the grid has
 * written y[n, d], resid[n, d] += y and out = rmsnorm(resid) * w, row by
 * row, by the grid's last block to finish. */
typedef struct gv_tail {
    unsigned *done; /* blocks finished so far; 0 between launches (the last block resets it) */
    bf16 *resid;
    const void *w;
    int wf32;
    float eps;
    bf16 *out;
} gv_tail;

/* Called by every thread of every block at the very end of the GEMV, after
 * its y stores. The classic last-block pattern (CUDA's threadFenceReduction
 * sample): each block fences its stores, then counts itself in; the block
 * that counts last sees every other block's y. No block waits on another,
 * so it cannot hang whatever the residency. One counter per backend is
 * enough: the launches of its one stream run their post-wait code one
 * grid after the other (PDL's griddepcontrol.wait). scratch: the kernel's
 * dynamic shared memory (at least FL_NORM_SCRATCH_BYTES, the launcher
 * checks), free again once the block's own epilogue is done. */
static __device__ __noinline__ void gv_run_tail(const gv_tail t, const bf16 *y, int n, int d, float *scratch) {
    /* the flag lives in the scratch, not in a __shared__ variable of its
     * own: static shared memory would lower the dynamic maximum the
     * kernels' launchers set (the bulk kernel asks for the whole opt-in) */
    volatile unsigned *last = (volatile unsigned *)(scratch + FL_NORM_V + 1);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(t.done, 1u) + 1u == gridDim.x * gridDim.y;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    for (int r = 0; r < n; r++)
        fl_add_rmsnorm_row<16>(t.resid + (size_t)r * d, y + (size_t)r * d, t.w, t.wf32, t.eps, d,
                               t.out + (size_t)r * d, scratch);
    if (threadIdx.x == 0) *t.done = 0u;
}

#endif /* FL_CUDA_NORM_CUH */
