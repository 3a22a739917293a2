/*
 * cuda_norm.cuh — the arithmetic of the residual add + RMSNorm's vector
 * kernel (add_rmsnorm_vec_kernel, cuda_ops.cu), shared with the W4 GEMV
 * prologue that folds the same norm in (cuda_gemv_bulk.cu, PN). Both run
 * these functions in the same order, so a fused launch gives the bits the
 * norm kernel then the GEMV give (test_cuda_prenorm compares them with
 * memcmp).
 *
 * The order: a row of d values is nv = d / 8 chunks of 8; the kernel has
 * norm_vec_threads(d) threads, thread t adds chunks t, t + T, t + 2 T, ...
 * (NORM_CHUNKS at most) into one running sum of squares (chunk by chunk,
 * value by value), each warp reduces its 32 sums with warp_sum, and the
 * warps' sums are added in warp order from zero.
 */
#ifndef FL_CUDA_NORM_CUH
#define FL_CUDA_NORM_CUH

#include "kernels/cuda/cuda_common.cuh"

#define NORM_CHUNKS 4   /* chunks of 8 values a thread at most */
#define NORM_MAX_D 8192 /* rows the vector form takes (the thread count fits 256) */

/* The vector kernel's threads for rows of d values: d / 8 chunks over
 * NORM_CHUNKS a thread, rounded up to whole warps. */
static __host__ __device__ __forceinline__ int norm_vec_threads(int d) {
    return ((d / 8 + NORM_CHUNKS - 1) / NORM_CHUNKS + 31) / 32 * 32;
}

/* x + y of one chunk rounded to bf16 (what is stored), its squares added
 * to ss value by value. */
static __device__ __forceinline__ uint4 norm_add_chunk(uint4 x, uint4 y, float &ss) {
    float a[8], b[8];
    bf16x8_unpack(x, a);
    bf16x8_unpack(y, b);
#pragma unroll
    for (int e = 0; e < 8; e++) a[e] += b[e];
    const uint4 s = bf16x8_pack(a);
    bf16x8_unpack(s, a); /* the stored (rounded) values */
#pragma unroll
    for (int e = 0; e < 8; e++) ss += a[e] * a[e];
    return s;
}

static __device__ __forceinline__ float norm_inv(float sumsq, int d, float eps) {
    return 1.0f / sqrtf(sumsq / (float)d + eps);
}

/* Chunk j of the norm weight as loaded: WF32 two uint4 (8 floats), else one
 * (8 bf16 in .x..w of w[0]). */
template <int WF32>
static __device__ __forceinline__ void norm_load_w(const void *w, int j, uint4 (&wr)[2]) {
    wr[0] = ((const uint4 *)w)[(WF32 ? 2 : 1) * j];
    if (WF32) wr[1] = ((const uint4 *)w)[2 * j + 1];
}

/* w * (s * inv) of one stored chunk s, rounded to bf16. */
template <int WF32>
static __device__ __forceinline__ uint4 norm_scale_chunk(uint4 s, const uint4 (&wr)[2], float inv) {
    float v[8], wf[8];
    bf16x8_unpack(s, v);
    if (WF32) {
        const float4 p = *(const float4 *)&wr[0], q = *(const float4 *)&wr[1];
        wf[0] = p.x, wf[1] = p.y, wf[2] = p.z, wf[3] = p.w, wf[4] = q.x, wf[5] = q.y, wf[6] = q.z, wf[7] = q.w;
    } else {
        bf16x8_unpack(wr[0], wf);
    }
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] = wf[e] * (v[e] * inv);
    return bf16x8_pack(v);
}

/* Bytes of shared memory norm_rows_to_smem needs for n rows of d: the rows
 * at a stride of d + 8 (16 bytes of padding spread the rows of an x
 * fragment load over the banks), then 8 floats a row of warp sums. */
static __host__ __device__ __forceinline__ unsigned norm_smem_bytes(int n, int d) {
    return (unsigned)n * ((unsigned)(d + 8) * 2u + 32u);
}

/* The add + norm of n rows of d (d % 8 == 0, d <= NORM_MAX_D) computed by a
 * block of any warp count, into shared memory at hs (rows d + 8 apart;
 * norm_smem_bytes), in add_rmsnorm_vec_kernel's order: the work of each
 * warp k of that kernel's block for row r is one item, the items dealt
 * round-robin to this block's warps; an item's sum of squares lands in
 * red[8 r + k] and a row's total is added in k order from zero. xout (not
 * NULL) also gets the rounded sums. Every thread of the block calls it; it
 * ends with a barrier, after which hs holds the normed rows. The x and y
 * rows are read after the caller's griddepcontrol.wait; the weight is only
 * read here, after it too (an L2 hit: every block of the GEMV reads it). */
template <int WF32>
static __device__ __forceinline__ void norm_rows_to_smem(const bf16 *xin, const bf16 *y, bf16 *xout,
                                                         const void *w, float eps, int n, int d, bf16 *hs) {
    const int nv = d >> 3, T = norm_vec_threads(d), kw = T >> 5, hstride = d + 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float *red = (float *)(hs + (size_t)n * hstride);
    for (int it = warp; it < n * kw; it += nw) {
        const int r = it / kw, t = (it % kw) * 32 + lane;
        const uint4 *xr = (const uint4 *)(xin + (size_t)r * d), *yr = (const uint4 *)(y + (size_t)r * d);
        uint4 *hr = (uint4 *)(hs + (size_t)r * hstride);
        uint4 xv[NORM_CHUNKS], yv[NORM_CHUNKS];
#pragma unroll
        for (int c = 0; c < NORM_CHUNKS; c++) { /* every load in flight before the first store */
            const int j = t + c * T;
            if (j < nv) xv[c] = xr[j], yv[c] = yr[j];
        }
        float ss = 0.0f;
#pragma unroll
        for (int c = 0; c < NORM_CHUNKS; c++) {
            const int j = t + c * T;
            if (j >= nv) continue;
            const uint4 s = norm_add_chunk(xv[c], yv[c], ss);
            hr[j] = s;
            if (xout) ((uint4 *)(xout + (size_t)r * d))[j] = s;
        }
        ss = warp_sum(ss);
        if (lane == 0) red[8 * r + it % kw] = ss;
    }
    __syncthreads();
    for (int it = warp; it < n * kw; it += nw) {
        const int r = it / kw, t = (it % kw) * 32 + lane;
        uint4 *hr = (uint4 *)(hs + (size_t)r * hstride);
        uint4 wr[NORM_CHUNKS][2];
#pragma unroll
        for (int c = 0; c < NORM_CHUNKS; c++) {
            const int j = t + c * T;
            if (j < nv) norm_load_w<WF32>(w, j, wr[c]);
        }
        float tot = 0.0f;
        for (int i = 0; i < kw; i++) tot += red[8 * r + i];
        const float inv = norm_inv(tot, d, eps);
#pragma unroll
        for (int c = 0; c < NORM_CHUNKS; c++) {
            const int j = t + c * T;
            if (j < nv) hr[j] = norm_scale_chunk<WF32>(hr[j], wr[c], inv);
        }
    }
    __syncthreads();
}

#endif /* FL_CUDA_NORM_CUH */
