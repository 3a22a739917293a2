/*
 * cuda_moe_route.cuh — the routing steps that run inside one block: a
 * router row's top-k (moe_topk in cuda_ops.cu) and the pairs' grouping
 * (moe_group in cuda_moe.cu).
 *
 * moe_topk_row: one router row's softmax top-k, by one warp. probs live in
 * the caller's scratch (shared memory); each of the k picks is a warp argmax
 * (ties: lower expert id, as on the CPU). The softmax sum is accumulated in
 * f32 per lane, then reduced (the CPU uses double: the difference is far
 * below bf16 input resolution).
 * moe_group_block: the (token, expert) pairs grouped by local expert, by the
 * whole block (see moe_group in cuda_moe.cu).
 */
#ifndef FL_CUDA_MOE_ROUTE_CUH
#define FL_CUDA_MOE_ROUTE_CUH

#include <float.h>

#include "kernels/cuda/cuda_common.cuh"

#define TOPK_MAX_EXPERTS 1024 /* moe_topk's limit (its scratch is shared memory) */

/* Warp argmax over v[0..n) (skipping taken[i] when taken is given): the
 * largest value, the lowest index on ties, as the CPU loops pick. */
static __device__ __forceinline__ int warp_argmax(const float *v, int n, const bool *taken, float *best) {
    float bv = -FLT_MAX;
    int bi = -1;
    for (int e = threadIdx.x & 31; e < n; e += 32)
        if ((!taken || !taken[e]) && (bi < 0 || v[e] > bv)) { bv = v[e]; bi = e; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
    }
    *best = bv;
    return bi;
}

/* Row l (n_experts bf16 logits, global or shared) -> ids[0..k), weights[0..k)
 * (global; ids also into ids_sh when given), as moe_topk's contract says
 * (kernels/backend.h). Called by a whole warp; probs, gmax [n_experts] and
 * keep [n_experts] are this warp's scratch (gmax also keeps the picked
 * probs until they are scaled: the global outputs are only written, never
 * read back, so no pick waits on a round trip to L2). */
static __device__ void moe_topk_row(const bf16 *l, int n_experts, int k, const fl_moe_route &r, int grouped,
                                    float *probs, float *gmax, bool *keep, int32_t *ids, float *weights,
                                    int32_t *ids_sh) {
    const int lane = threadIdx.x & 31;
    float mx = -FLT_MAX;
    for (int e = lane; e < n_experts; e += 32) mx = fmaxf(mx, bf2f(l[e]));
    mx = warp_max(mx);
    float sum = 0;
    for (int e = lane; e < n_experts; e += 32) {
        float p = expf(bf2f(l[e]) - mx);
        probs[e] = p;
        sum += p;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < n_experts; e += 32) probs[e] = probs[e] / sum;
    __syncwarp();
    if (grouped) { /* DeepSeek's group-limited greedy: see fl_moe_route */
        const int G = r.n_group, per = n_experts / G;
        for (int g = 0; g < G; g++) {
            float m = -1.0f;
            for (int e = g * per + lane; e < (g + 1) * per; e += 32) m = fmaxf(m, probs[e]);
            m = warp_max(m);
            if (lane == 0) {
                gmax[g] = m;
                keep[g] = false;
            }
        }
        __syncwarp();
        for (int j = 0; j < r.topk_group; j++) {
            float bv;
            const int bg = warp_argmax(gmax, G, keep, &bv);
            if (lane == 0) keep[bg] = true;
            __syncwarp();
        }
        for (int e = lane; e < n_experts; e += 32)
            if (!keep[e / per]) probs[e] = 0.0f;
        __syncwarp();
    }
    float wsum = 0;
    for (int j = 0; j < k; j++) {
        float bv = -1.0f;
        int bi = -1;
        for (int e = lane; e < n_experts; e += 32)
            if (probs[e] > bv) { bv = probs[e]; bi = e; } /* strided: first max is the lowest id */
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi >= 0 && (bi < 0 || oi < bi))) { bv = ov; bi = oi; }
        }
        if (bi < 0) bv = NAN; /* NaN probabilities (a diverged model): as the CPU op, expert 0
                                 with a NaN weight (uniform: bi is the warp's reduction) */
        if (lane == 0) {
            ids[j] = bi < 0 ? 0 : bi;
            if (ids_sh) ids_sh[j] = bi < 0 ? 0 : bi;
            gmax[j] = bv; /* the group maxima are no longer needed */
            if (bi >= 0) probs[bi] = -1.0f; /* taken */
        }
        wsum += bv;
        __syncwarp();
    }
    for (int j = lane; j < k; j += 32) weights[j] = r.renorm ? gmax[j] / wsum : gmax[j] * r.scale;
    __syncwarp();
}

/* moe_group's contract (kernels/backend.h) for P = n k pairs, by the whole
 * block (blockDim.x a multiple of 32); cnt: [n_local + 1] ints of shared
 * memory. Thread j counts local expert j's pairs, a block-wide scan (warp
 * shuffles, in chunks of blockDim.x experts) turns the counts into offsets,
 * then thread j writes its pairs in ascending order. */
static __device__ __forceinline__ void moe_group_block(const int32_t *ids, int P, int e_lo, int n_local,
                                                       int32_t *list, int32_t *cnt) {
    __shared__ int32_t wtot[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = threadIdx.x; j < n_local; j += blockDim.x) {
        int c = 0;
        for (int p = 0; p < P; p++) c += ids[p] - e_lo == j;
        cnt[j + 1] = c;
    }
    int carry = 0;
    for (int base = 0; base < n_local; base += blockDim.x) { /* uniform trip count */
        const int j = base + threadIdx.x;
        int v = j < n_local ? cnt[j + 1] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += t;
        }
        if (lane == 31) wtot[warp] = v;
        __syncthreads();
        if (warp == 0) {
            int s = lane < nw ? wtot[lane] : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(0xffffffffu, s, o);
                if (lane >= o) s += t;
            }
            if (lane < nw) wtot[lane] = s;
        }
        __syncthreads();
        v += carry + (warp ? wtot[warp - 1] : 0);
        if (j < n_local) cnt[j + 1] = v;
        carry += wtot[nw - 1];
        __syncthreads(); /* wtot is rewritten by the next chunk */
    }
    if (threadIdx.x == 0) cnt[0] = 0;
    __syncthreads();
    int32_t *pairs = list + n_local + 1;
    for (int j = threadIdx.x; j <= n_local; j += blockDim.x) list[j] = cnt[j];
    for (int j = threadIdx.x; j < n_local; j += blockDim.x) {
        int at = cnt[j];
        for (int p = 0; p < P; p++)
            if (ids[p] - e_lo == j) pairs[at++] = p;
    }
}

#endif /* FL_CUDA_MOE_ROUTE_CUH */
