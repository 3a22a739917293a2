/*
 * cuda_norm.cuh — the arithmetic of the residual add + RMSNorm's vector
 * kernel (add_rmsnorm_vec_kernel, cuda_ops.cu). The deferred norm's
 * epilogues (cuda_gemv_common.cuh, gv_resid) round the sum as
 * norm_add_chunk does, so the residual is the same bits.
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

#endif /* FL_CUDA_NORM_CUH */
