/*
 * cuda_matmul.cu — y[n, out] = x[n, in] @ W[out, in]^T (+ bias) on the GPU.
 *
 * One dispatch point (fl_cuda_matmul) per weight kind:
 *  - BF16 weights: cuBLAS cublasGemmEx, bf16 in/out, f32 compute; the bias
 *    is added by a small kernel afterwards.
 *  - W4 in the packed device layout (w4_packed: rows % 16, in % 64, group a
 *    power of two >= 64; every real model's linear layer), below 64 tokens:
 *    w4_gemv_kernel in cuda_gemv.cu (fl_cuda_w4_gemv), launches of up to 16
 *    tokens, each streaming the weights once into registers, the
 *    multiply-adds on the tensor cores (see "W4 packed layout" below).
 *    w4_mma_kernel here, the previous version (cp.async ring through shared
 *    memory), takes x that is not 16-byte aligned and stays selectable for
 *    measurements (fl_cuda_w4_gemv_tune). From 64 tokens (the w4_gemm
 *    override): the one-pass tensor-core GEMM of cuda_w4_gemm.cu. From 128
 *    tokens (the w4_dequant_min_n override): dequantize the weight into a
 *    bf16 scratch and run cuBLAS (see "W4 at large batches" below); the
 *    tiled GEMM where the scratch is too small.
 *  - W4 row-major (other shapes, e.g. group 32 or 20), n <= 8 tokens:
 *    w4_gemv_kernel. Decode is bound by reading the
 *    weights once, so the kernel is built around the weight stream: a warp
 *    per output row (or per share of a row), each lane reading 16 bytes (32
 *    codes) per load, the next task's loads issued before the current one
 *    is computed, x staged once per resident block in shared memory as f32,
 *    and the code nibbles decoded with integer ops instead of int->float
 *    conversions (see dot32). Scale and bias are applied once per 32
 *    elements, not per element. The grid is one resident wave.
 *  - W4 row-major, larger batches, or shapes the GEMV does not take (x too
 *    large for shared memory):
 *    w4_gemm_kernel, a tiled tensor-core kernel (WMMA bf16, f32 accumulate)
 *    that dequantizes each 64x32 weight tile into shared memory, with the
 *    next tile's global loads in flight during the MMAs. A generic variant
 *    takes any even `in` and any group. Not yet tuned: no split-K, so small
 *    batches on few output rows use few SMs.
 * Kernels never allocate: x is staged in shared memory, tiles likewise.
 */
#include <math.h>
#include <stdlib.h>
#include <mma.h>

#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * W4 GEMV (batch 1..8).
 *
 * Decoding without conversions. A code c sitting in mantissa bits 16..19 of
 * an f32 whose other bits are 0x43000000 is the number 128 + c; in bits
 * 12..15 under 0x47000000 it is 32768 + 16 c. One LOP3 ((w & mask) | magic)
 * builds such a float straight from a (shifted) word of codes, and the 8
 * codes of a word need only 4 shifts, since each of w, w >> 8 and w << 8
 * holds two codes at those two positions: about 2.5 integer + FMA ops per
 * weight instead of shift/mask/convert/scale. The offsets and the factor
 * 16 are folded into x when it is staged: elements read at bits 12..15 are
 * stored as x / 16 (exact), so for a 32-element chunk
 *   a = sum x' * float(code) = sum x c + K,  K = sum x * (128 or 2048)
 * and sum x (c s + b) = s (a - K) + b sum x, with K and sum x computed once
 * per chunk when x is staged. The offsets cost at most 11 of f32's 24 bits
 * of the chunk sum (relative error ~1e-5 of sum |x w|), far below the bf16
 * output's 2^-9.
 *
 * Shared memory holds x as f32, each 32-element chunk padded to 36 floats:
 * lanes read chunks 144 bytes apart, which spreads a quarter-warp's 16-byte
 * reads over distinct banks (a 128-byte stride would hit one bank 8 times).
 * ------------------------------------------------------------------------- */
#define CHUNK_PAD 36
#define MAGIC16 0x43000000u /* code in bits 16..19 -> 128 + c */
#define MAGIC12 0x47000000u /* code in bits 12..15 -> 32768 + 16 c */

/* (a & mask) | magic in one LOP3; written in PTX so the compiler cannot
 * split it into two instructions (LOP3 takes one immediate). */
static __device__ __forceinline__ float code_f32(uint32_t a, uint32_t mask, uint32_t magic) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
    return __uint_as_float(r);
}

/* Element i of a word (nibble i): which position it is read at. Elements
 * 0, 1, 3, 5 at bits 12..15 (x scaled by 1/16, offset 2048 x); 2, 4, 6, 7
 * at bits 16..19 (offset 128 x). */
static __device__ __forceinline__ float x_scale(int i) { return (0x2Bu >> i) & 1 ? 0.0625f : 1.0f; }
static __device__ __forceinline__ float x_offset(int i) { return (0x2Bu >> i) & 1 ? 2048.0f : 128.0f; }

static __device__ __forceinline__ float dot32(const uint4 q, const float *p, uint32_t m12,
                                              uint32_t m16, uint32_t k12, uint32_t k16) {
    const float4 *p4 = (const float4 *)p;
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    float d0 = 0, d1 = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float4 lo = p4[2 * k], hi = p4[2 * k + 1];
        const uint32_t w = words[k], r8 = w >> 8, l8 = w << 8, l12 = w << 12, r12 = w >> 12;
        d0 = fmaf(lo.x, code_f32(l12, k12, m12), d0); /* element 0 */
        d1 = fmaf(lo.y, code_f32(l8, k12, m12), d1);  /* 1 */
        d0 = fmaf(lo.z, code_f32(l8, k16, m16), d0);  /* 2 */
        d1 = fmaf(lo.w, code_f32(w, k12, m12), d1);   /* 3 */
        d0 = fmaf(hi.x, code_f32(w, k16, m16), d0);   /* 4 */
        d1 = fmaf(hi.y, code_f32(r8, k12, m12), d1);  /* 5 */
        d0 = fmaf(hi.z, code_f32(r8, k16, m16), d0);  /* 6 */
        d1 = fmaf(hi.w, code_f32(r12, k16, m16), d1); /* 7 */
    }
    return d0 + d1;
}

/* Stages x [N, in] (bf16) in shared memory: padded f32 scaled per element
 * position (x_scale), and per 32-element chunk {sum x, K = sum x * offset}.
 * Each thread takes 8-element pieces (one 16-byte load, one word of codes'
 * worth), up to 8 loads in flight; the 4 pieces of a chunk sit in 4
 * consecutive lanes, so the chunk sums are two shuffles. */
template <int N>
static __device__ __forceinline__ void stage_x(const bf16 *__restrict__ x, int in, float *sx,
                                               float2 *sxs) {
    const int nch = in >> 5, pstride = nch * CHUNK_PAD;
    const int ppr = in >> 3;     /* pieces per row */
    const int npieces = N * ppr; /* a multiple of 4: in % 32 == 0 */
    const uint4 *x4 = (const uint4 *)x;
    for (int p0 = 0; p0 < npieces; p0 += 8 * blockDim.x) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int p = p0 + k * blockDim.x + threadIdx.x;
            v[k] = p < npieces ? __ldg(x4 + p) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int p = p0 + k * blockDim.x + threadIdx.x;
            const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
            float f[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                f[2 * j] = __uint_as_float(w[j] << 16);
                f[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
            }
            float sum = 0, koff = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                sum += f[i];
                koff = fmaf(f[i], x_offset(i), koff);
                f[i] *= x_scale(i);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            koff += __shfl_xor_sync(0xffffffffu, koff, 1);
            koff += __shfl_xor_sync(0xffffffffu, koff, 2);
            if (p < npieces) {
                const int r = p / ppr, e = (p - r * ppr) << 3;
                float4 *dst = (float4 *)(sx + r * pstride + (e >> 5) * CHUNK_PAD + (e & 31));
                dst[0] = make_float4(f[0], f[1], f[2], f[3]);
                dst[1] = make_float4(f[4], f[5], f[6], f[7]);
                if ((threadIdx.x & 3) == 0) sxs[r * nch + (e >> 5)] = make_float2(sum, koff);
            }
        }
    }
}

/* Work split: the block walks its rows in lock-step iterations; in each,
 * warp w takes row base + w / S and the share `w % S` of its chunks (S > 1
 * splits rows over several warps so the last wave is not left to a few
 * warps; the shares are added in shared memory). A warp's work is a flat
 * sequence of tasks (row iteration, pass over U chunk slots per lane), and
 * the loads of task t + 1 are issued before task t is computed, so every
 * lane keeps up to 2U 16-byte loads in flight across row boundaries. */
template <int N>
struct gemv_cfg {
    static constexpr int U = N <= 2 ? 4 : 2; /* chunk slots per lane per task */
    /* warps per block: larger batches need a larger x in shared memory, so
     * fewer blocks fit per SM; more warps per block keep the SM busy */
    static constexpr int W = N <= 2 ? 8 : 16;
};

template <int N, int S>
static __global__ void __launch_bounds__(gemv_cfg<N>::W * 32)
    w4_gemv_kernel(const uint4 *__restrict__ codes, const __half2 *__restrict__ sb,
                   const bf16 *__restrict__ x, int in, int rows, int gshift,
                   const void *__restrict__ bias, int bias_f32, bf16 *__restrict__ y) {
    constexpr int U = gemv_cfg<N>::U, W = gemv_cfg<N>::W;
    extern __shared__ __align__(16) float smem[];
    __shared__ float part[W][N];
    const int nch = in >> 5;              /* 32-element chunks per row */
    const int pstride = nch * CHUNK_PAD;  /* padded floats per x row */
    float *sx = smem;                              /* [N][nch * 36] */
    float2 *sxs = (float2 *)(smem + N * pstride);  /* [N][nch] {sum x, K} */
    stage_x<N>(x, in, sx, sxs);
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gpr = nch >> gshift; /* groups per row */
    const int share = nch / S, c_lo = (warp % S) * share, c_hi = c_lo + share;
    const int npass = (share + 32 * U - 1) / (32 * U);
    const int rows_per_iter = W / S, row_stride = gridDim.x * rows_per_iter;
    const int first = blockIdx.x * rows_per_iter; /* block-uniform */
    const int n_iter = first < rows ? (rows - first + row_stride - 1) / row_stride : 0;
    const int n_task = n_iter * npass;

    uint4 qc[U], qn[U];
    __half2 gc[U], gn[U];
    /* the LOP3 constants, kept in registers (one immediate per LOP3) */
    const uint32_t m12 = MAGIC12, m16 = MAGIC16, k12 = 0x0000F000u, k16 = 0x000F0000u;
    auto load = [&](int t, uint4 *q, __half2 *g) {
        const int it = t / npass, p = t - it * npass;
        const int row = first + it * row_stride + warp / S;
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int ch = c_lo + p * 32 * U + u * 32 + lane;
            if (row < rows && ch < c_hi) {
                q[u] = __ldcs(codes + (int64_t)row * nch + ch); /* streamed once: not kept in L1 */
                g[u] = sb[(int64_t)row * gpr + (ch >> gshift)];
            }
        }
    };
    float acc[N];
#pragma unroll
    for (int r = 0; r < N; r++) acc[r] = 0;
    if (n_task > 0) load(0, qc, gc);
    for (int t = 0; t < n_task; t++) {
        if (t + 1 < n_task) load(t + 1, qn, gn);
        const int it = t / npass, p = t - it * npass;
        const int row = first + it * row_stride + warp / S;
        if (row < rows) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int ch = c_lo + p * 32 * U + u * 32 + lane;
                if (ch < c_hi) {
                    const float2 f = __half22float2(gc[u]); /* scale, bias */
#pragma unroll
                    for (int r = 0; r < N; r++) {
                        const float a = dot32(qc[u], sx + r * pstride + ch * CHUNK_PAD, m12, m16, k12, k16);
                        const float2 xs = sxs[r * nch + ch];
                        acc[r] = fmaf(f.x, a - xs.y, fmaf(f.y, xs.x, acc[r]));
                    }
                }
            }
        }
        if (p == npass - 1) { /* row done: reduce and write */
#pragma unroll
            for (int r = 0; r < N; r++) acc[r] = warp_sum(acc[r]);
            if (S == 1) {
                if (lane == 0 && row < rows)
#pragma unroll
                    for (int r = 0; r < N; r++) {
                        const float bb = bias ? vec_load(bias, bias_f32, row) : 0.0f;
                        y[(int64_t)r * rows + row] = f2bf(acc[r] + bb);
                    }
            } else {
                if (lane == 0)
#pragma unroll
                    for (int r = 0; r < N; r++) part[warp][r] = acc[r];
                __syncthreads();
                if (lane == 0 && warp % S == 0 && row < rows)
#pragma unroll
                    for (int r = 0; r < N; r++) {
                        float v = 0;
#pragma unroll
                        for (int k = 0; k < S; k++) v += part[warp + k][r];
                        const float bb = bias ? vec_load(bias, bias_f32, row) : 0.0f;
                        y[(int64_t)r * rows + row] = f2bf(v + bb);
                    }
                __syncthreads();
            }
#pragma unroll
            for (int r = 0; r < N; r++) acc[r] = 0;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            qc[u] = qn[u];
            gc[u] = gn[u];
        }
    }
}

static size_t gemv_smem_bytes(int n, int in) {
    const size_t nch = (size_t)in / 32;
    return (size_t)n * (nch * CHUNK_PAD + 2 * nch) * sizeof(float);
}

/* Per-instantiation launch state: the shared-memory limit is raised once
 * and the occupancy query cached per shared-memory size, so a launch costs
 * no extra host calls (decode launches hundreds per step). Races between
 * threads only redo the same idempotent queries. */
template <int N, int S>
static fl_status gemv_occupancy(fl_cuda *c, size_t smem, int *per_sm) {
    static int attr_set, occ_smem = -1, occ_blocks;
    auto kern = w4_gemv_kernel<N, S>;
    if (!attr_set) {
        /* dynamic + static shared memory must fit the opt-in limit; the S > 1
         * variants have a small static array (part[][]) */
        cudaFuncAttributes fa;
        FL_CUDA_CHECK(cudaFuncGetAttributes(&fa, kern));
        FL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)(c->smem_optin - fa.sharedSizeBytes)));
        attr_set = 1;
    }
    if (occ_smem != (int)smem) {
        int b = 0;
        FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kern, gemv_cfg<N>::W * 32, smem));
        occ_blocks = b < 1 ? 1 : b;
        occ_smem = (int)smem;
    }
    *per_sm = occ_blocks;
    return FL_OK;
}

template <int N, int S>
static fl_status launch_gemv_s(fl_cuda *c, const bf16 *x, int in, int rows, const fl_tensor *w,
                               int gshift, const void *bias, int bias_f32, bf16 *y, int64_t blocks) {
    const size_t smem = gemv_smem_bytes(N, in);
    w4_gemv_kernel<N, S><<<(unsigned)blocks, gemv_cfg<N>::W * 32, smem, c->stream>>>(
        (const uint4 *)w->data, (const __half2 *)w->scales, x, in, rows, gshift, bias, bias_f32, y);
    FL_CUDA_LAUNCH_CHECK("w4_gemv_kernel");
    return FL_OK;
}

/* Picks the row split S in {1, 2, 4} that wastes the least of the last
 * wave (rows * S tasks over the resident warps), then launches one resident
 * wave of blocks. */
template <int N>
static fl_status launch_gemv(fl_cuda *c, const bf16 *x, int in, int rows, const fl_tensor *w,
                             int gshift, const void *bias, int bias_f32, bf16 *y) {
    const size_t smem = gemv_smem_bytes(N, in);
    int per_sm = 1;
    FL_TRY((gemv_occupancy<N, 1>(c, smem, &per_sm)));
    constexpr int W = gemv_cfg<N>::W;
    const int64_t nch = in / 32, warps = (int64_t)per_sm * c->n_sm * W;
    int best_s = 1;
    double best_eff = 0;
    for (int s = 1; s <= 4; s *= 2) {
        if (nch % s || nch / s < 32) break;
        const double tasks = (double)rows * s / warps;
        const double eff = tasks / ceil(tasks);
        if (eff > best_eff + 0.05) { /* splitting costs barriers: only for a clear gain */
            best_eff = eff;
            best_s = s;
        }
    }
    const int rows_per_block = W / best_s;
    int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
    const int64_t fill = (int64_t)per_sm * c->n_sm;
    if (blocks > fill) blocks = fill;
    switch (best_s) {
    case 1: return launch_gemv_s<N, 1>(c, x, in, rows, w, gshift, bias, bias_f32, y, blocks);
    case 2:
        FL_TRY((gemv_occupancy<N, 2>(c, smem, &per_sm)));
        return launch_gemv_s<N, 2>(c, x, in, rows, w, gshift, bias, bias_f32, y, blocks);
    default:
        FL_TRY((gemv_occupancy<N, 4>(c, smem, &per_sm)));
        return launch_gemv_s<N, 4>(c, x, in, rows, w, gshift, bias, bias_f32, y, blocks);
    }
}

/* ---------------------------------------------------------------------------
 * W4 packed layout and the tensor-core GEMV (any batch, 16 tokens a launch).
 *
 * Decode reads each weight byte once, so the kernel is shaped around the
 * weight stream: every lane keeps 4 independent 16-byte loads in flight
 * (the next step's, issued before the current step is computed), and the
 * arithmetic per byte is kept small by doing the multiply-adds on the
 * tensor cores: mma.m16n8k16 (bf16 in, f32 accumulate) with A = 16 weight
 * rows x 16 k and B = 16 k x 8 tokens (batch 1 uses one column of 8; the
 * tensor cores are idle otherwise, and batches up to 16 cost the same).
 *
 * Layout (made by fl_cuda_w4_repack at upload). Rows are cut into tiles of
 * 16, columns into blocks of 64; a (tile, block) is a 512-byte unit, units
 * stored tile-major. Lane l = 4 g + t of a warp reads bytes 16 l .. 16 l + 15
 * of a unit: word s (k-step s = 0..3) holds its A fragment of k-step s,
 * nibble i = row 16 T + g + 8 (i & 1), column k = 64 kb + 16 t + 4 s +
 * 2 ((i >> 1) & 1) + (i >> 2). The k order inside a block is permuted (the
 * mma only needs A and B to agree) so that a lane's B fragments for the 4
 * k-steps are x[token][64 kb + 16 t .. + 15]: two 16-byte loads straight
 * from x, no shared memory and no shuffles.
 *
 * Decoding: (w >> 4 m) & 0x000F000F | 0x43004300 is a bf16 pair holding
 * 128 + code of nibbles m and m + 4, exactly the fragment register m (a
 * LOP3 and a shift per 2 weights). The mma sums (128 + c) x over the unit;
 * a second mma with A = 1 gives sum x, and per unit (one group: group %
 * 64 == 0) sum x (c s + b) = s * sum (128 + c) x + (b - 128 s) * sum x,
 * in f32. The sum x mma depends only on x, so it is shared by the T tiles
 * a warp computes per step.
 *
 * Work split: a block of 8 warps owns T consecutive tiles (T in 1, 2, 4,
 * as many as still leave a block per SM); warp w takes the column blocks
 * kb = w, w + 8, ..., U = 4 / T of them per step, and the warps' partial
 * sums are added in shared memory once per tile group.
 *
 * Measured with bench_kernels and Nsight Compute, it reaches well under
 * half of the copy ceiling at batch 1 with DRAM far from busy and few warps
 * a scheduler (registers and shared memory limit occupancy): the kernel is
 * bound by instruction issue latency, not by memory. Deeper rings (5
 * stages) and prefetching x changed little. Next steps: cut the per-step
 * integer work (64-bit address math of the cp.async issue and the t / npass
 * divisions: hoist per-warp base pointers and advance them), more warps per
 * SM (smaller ring per warp, fewer registers), and for T = 1 shapes fewer
 * sum-x mma (compute sum x once per column block and share it).
 * ------------------------------------------------------------------------- */
#define MG_W 8 /* warps per block */

static __device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4],
                                                      uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* x is read with plain (coherent) loads: under programmatic dependent
 * launch the kernel starts before the kernel that writes x has finished, so
 * the read-only (.nc) path's "unchanged during the kernel" rule would not
 * hold; the reads come after griddepcontrol.wait. */
static __device__ __forceinline__ uint4 ld_x16(const void *p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p)
                 : "memory");
    return r;
}

static __device__ __forceinline__ void load_xfrag_pdl(const bf16 *xr, bool xal, uint32_t (&f)[8]) {
    if (xal) {
        const uint4 a = ld_x16(xr), b = ld_x16((const uint4 *)xr + 1);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
        f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
        const volatile unsigned short *h = (const volatile unsigned short *)xr;
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = (uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16);
    }
}

static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* Pipeline: each warp streams its units through a private ring of MG_S (4)
 * stages in shared memory (cp.async, no registers held while in flight):
 * MG_S - 1 steps of 4 units (2 KB a warp) stay in flight, ~100 KB an SM.
 * Every lane copies and later reads its own 16 bytes of each unit, so only
 * the scales (copied by lanes 0..7, read by all) need a __syncwarp. */

template <int T, int NT, bool PX, int MG_S>
static __global__ void __launch_bounds__(MG_W * 32, 2)
    w4_mma_kernel(const uint4 *__restrict__ codes, const uint2 *__restrict__ sb,
                  const bf16 *x, int n, int in, int rows, int gshift,
                  const void *bias, int bias_f32, bf16 *y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* bf16 MMA needs sm_80+; the backend refuses older GPUs at init */
#else
    constexpr int U = 4 / T, L = U * T; /* column blocks per warp per step; units per step */
    extern __shared__ __align__(16) float4 red[]; /* [MG_W][T][NT][32], then the rings */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    uint4 *pq = (uint4 *)(red + MG_W * T * NT * 32) + warp * MG_S * L * 32;        /* [S][L][32] */
    uint2 *ps = (uint2 *)((uint4 *)(red + MG_W * T * NT * 32) + MG_W * MG_S * L * 32) +
                warp * MG_S * L * 8;                                                 /* [S][L][8] */
    const int nkb = in >> 6, ntile = rows >> 4, ngrp = nkb >> gshift, n_grp_tiles = ntile / T;
    const int upw = (nkb + MG_W - 1) / MG_W; /* column blocks per warp per tile group */
    const int npass = (upw + U - 1) / U;
    const int n_iter = (int)blockIdx.x < n_grp_tiles ? (n_grp_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const int n_task = n_iter * npass;
    const bool xal = ((uintptr_t)x & 15) == 0;

    /* The issuer walks tasks in order with counters (no divisions) and 32-bit
     * offsets (a weight has < 2^31 16-byte chunks); smem targets are 32-bit
     * shared addresses. */
    const unsigned sq0 = (unsigned)__cvta_generic_to_shared(pq) + lane * 16;
    const unsigned ss0 = (unsigned)__cvta_generic_to_shared(ps) + (lane & 7) * 8;
    int i_left = n_task, i_p = 0, i_st = 0, i_tile0 = blockIdx.x * T;
    auto issue = [&]() {
        if (i_left > 0) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int kb = warp + (i_p * U + u) * MG_W;
                if (kb < nkb)
#pragma unroll
                    for (int tt = 0; tt < T; tt++) {
                        const int tile = i_tile0 + tt, j = i_st * L + u * T + tt;
                        const uint4 *src = codes + ((unsigned)(tile * nkb + kb) * 32u + lane);
                        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(sq0 + j * 512),
                                     "l"(src) : "memory");
                        if (lane < 8) {
                            const uint2 *ssrc = sb + ((unsigned)(tile * ngrp + (kb >> gshift)) * 8u + lane);
                            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(ss0 + j * 64),
                                         "l"(ssrc) : "memory");
                        }
                    }
            }
            i_left--;
            i_st = i_st + 1 == MG_S ? 0 : i_st + 1;
            if (++i_p == npass) {
                i_p = 0;
                i_tile0 += gridDim.x * T;
            }
        }
        cp_async_commit(); /* possibly empty: keeps the group count uniform */
    };
    if (FL_PDL_EARLY) pdl_trigger();
#pragma unroll
    for (int i = 0; i < MG_S - 1; i++) issue();
    /* The weights never depend on the previous kernel; x and y do. */
    pdl_wait();
    if (!FL_PDL_EARLY) pdl_trigger();

    float acc[T][NT][4];
#pragma unroll
    for (int tt = 0; tt < T; tt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[tt][nt][i] = 0.0f;
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    /* x fragments: with PX, step t + 1's are loaded (into registers) while
     * step t is computed, so their latency (L1/L2, long under a full weight
     * stream) stays off the critical path. */
    constexpr int UX = PX ? U : 1;
    uint32_t xc[UX][NT][8], xn[UX][NT][8];
    auto load_x = [&](int t, uint32_t (&xf)[UX][NT][8]) {
        if (t < n_task) {
            const int p = t % npass;
#pragma unroll
            for (int u = 0; u < UX; u++) {
                const int kb = warp + (p * U + u) * MG_W;
                if (kb < nkb)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const int tok = min(nt * 8 + g, n - 1); /* padding columns: discarded */
                        load_xfrag_pdl(x + (int64_t)tok * in + kb * 64 + t4 * 16, xal, xf[u][nt]);
                    }
            }
        }
    };
    if (PX) load_x(0, xc);
    int p = 0, st = 0, it = 0; /* compute-side counters: pass, ring stage, tile group */
    for (int t = 0; t < n_task; t++) {
        __syncwarp(); /* every lane is done with the stage the next issue refills */
        issue();
        if (PX) load_x(t + 1, xn);
        cp_async_wait<MG_S - 1>();
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int kb = warp + (p * U + u) * MG_W;
            if (kb < nkb) {
                uint32_t xf[NT][8];
                float cs[NT][4]; /* sum x of tokens 2 t4, 2 t4 + 1 (c[0], c[1]) */
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    if (PX) {
#pragma unroll
                        for (int i = 0; i < 8; i++) xf[nt][i] = xc[PX ? u : 0][nt][i];
                    } else {
                        const int tok = min(nt * 8 + g, n - 1); /* padding columns: discarded */
                        load_xfrag_pdl(x + (int64_t)tok * in + kb * 64 + t4 * 16, xal, xf[nt]);
                    }
                    cs[nt][0] = cs[nt][1] = cs[nt][2] = cs[nt][3] = 0.0f;
#pragma unroll
                    for (int s = 0; s < 4; s++) mma_bf16_16816(cs[nt], ones, xf[nt][2 * s], xf[nt][2 * s + 1]);
                }
#pragma unroll
                for (int tt = 0; tt < T; tt++) {
                    const int j = u * T + tt;
                    const uint4 q = pq[(st * L + j) * 32 + lane];
                    const uint2 sc = ps[(st * L + j) * 8 + g];
                    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
                    float c[NT][4];
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
#pragma unroll
                    for (int s = 0; s < 4; s++) {
                        uint32_t a[4];
#pragma unroll
                        for (int m = 0; m < 4; m++) a[m] = ((w[s] >> (4 * m)) & 0x000F000Fu) | 0x43004300u;
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) mma_bf16_16816(c[nt], a, xf[nt][2 * s], xf[nt][2 * s + 1]);
                    }
                    const float2 f0 = __half22float2(*(const __half2 *)&sc.x); /* row g */
                    const float2 f1 = __half22float2(*(const __half2 *)&sc.y); /* row g + 8 */
                    const float o0 = fmaf(-128.0f, f0.x, f0.y), o1 = fmaf(-128.0f, f1.x, f1.y);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        acc[tt][nt][0] = fmaf(f0.x, c[nt][0], fmaf(o0, cs[nt][0], acc[tt][nt][0]));
                        acc[tt][nt][1] = fmaf(f0.x, c[nt][1], fmaf(o0, cs[nt][1], acc[tt][nt][1]));
                        acc[tt][nt][2] = fmaf(f1.x, c[nt][2], fmaf(o1, cs[nt][0], acc[tt][nt][2]));
                        acc[tt][nt][3] = fmaf(f1.x, c[nt][3], fmaf(o1, cs[nt][1], acc[tt][nt][3]));
                    }
                }
            }
        }
        if (p == npass - 1) { /* tile group done: add the warps' shares, write */
#pragma unroll
            for (int tt = 0; tt < T; tt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    red[((warp * T + tt) * NT + nt) * 32 + lane] =
                        make_float4(acc[tt][nt][0], acc[tt][nt][1], acc[tt][nt][2], acc[tt][nt][3]);
                    acc[tt][nt][0] = acc[tt][nt][1] = acc[tt][nt][2] = acc[tt][nt][3] = 0.0f;
                }
            __syncthreads();
            if ((int)threadIdx.x < T * NT * 32) {
                const int idx = threadIdx.x, l = idx & 31, nt = (idx >> 5) % NT, tt = (idx >> 5) / NT;
                float4 v = red[idx];
#pragma unroll
                for (int k = 1; k < MG_W; k++) {
                    const float4 o = red[k * T * NT * 32 + idx];
                    v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
                }
                const int row = ((blockIdx.x + it * gridDim.x) * T + tt) * 16 + (l >> 2);
                const int tok = nt * 8 + 2 * (l & 3);
                const float b0 = bias ? vec_load(bias, bias_f32, row) : 0.0f;
                const float b8 = bias ? vec_load(bias, bias_f32, row + 8) : 0.0f;
                if (tok < n) {
                    y[(int64_t)tok * rows + row] = f2bf(v.x + b0);
                    y[(int64_t)tok * rows + row + 8] = f2bf(v.z + b8);
                }
                if (tok + 1 < n) {
                    y[(int64_t)(tok + 1) * rows + row] = f2bf(v.y + b0);
                    y[(int64_t)(tok + 1) * rows + row + 8] = f2bf(v.w + b8);
                }
            }
            __syncthreads();
        }
        st = st + 1 == MG_S ? 0 : st + 1;
        if (++p == npass) {
            p = 0;
            it++;
        }
        if (PX)
#pragma unroll
            for (int u = 0; u < UX; u++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 8; i++) xc[u][nt][i] = xn[u][nt][i];
    }
    cp_async_wait<0>(); /* no copy may outlive the block */
#endif
}

/* Repack: one thread per output word (see the layout above). */
static __global__ void w4_repack_kernel(const uint8_t *__restrict__ src, uint32_t *__restrict__ dst,
                                        int rows, int cols) {
    const int64_t nwords = (int64_t)rows * cols / 8, nkb = cols / 64, row_bytes = cols / 2;
    for (int64_t wi = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; wi < nwords;
         wi += (int64_t)gridDim.x * blockDim.x) {
        const int64_t unit = wi >> 7, tile = unit / nkb, kb = unit - tile * nkb;
        const int l = (int)(wi >> 2) & 31, s = (int)wi & 3, g = l >> 2, t = l & 3;
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int64_t row = tile * 16 + g + 8 * (i & 1);
            const int64_t k = kb * 64 + 16 * t + 4 * s + 2 * ((i >> 1) & 1) + (i >> 2);
            const uint8_t byte = src[row * row_bytes + (k >> 1)];
            word |= (uint32_t)((k & 1) ? byte >> 4 : byte & 15) << (4 * i);
        }
        dst[wi] = word;
    }
}

extern "C" fl_status fl_cuda_w4_repack(fl_backend *b, const void *src, void *dst, int rows, int cols) {
    if (!w4_packed(rows, cols, 64))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 repack: [%d, %d] is not a packed W4 shape", rows, cols);
    fl_cuda *c = cuda_impl(b);
    const int64_t nwords = (int64_t)rows * cols / 8;
    const unsigned blocks = (unsigned)std::min<int64_t>((nwords + 255) / 256, (int64_t)c->n_sm * 32);
    w4_repack_kernel<<<blocks, 256, 0, c->stream>>>((const uint8_t *)src, (uint32_t *)dst, rows, cols);
    FL_CUDA_LAUNCH_CHECK("w4_repack_kernel");
    return FL_OK;
}

/* Programmatic dependent launch (on unless the pdl override is 0): the next
 * kernel may start while this one drains, and this one prefetches its
 * weights before waiting for the kernel that wrote x. */
template <int T, int NT, bool PX, int MG_S>
static fl_status launch_mma_tn(fl_cuda *c, const bf16 *x, int n, int in, int rows, const fl_tensor *w,
                               int gshift, const void *bias, int bias_f32, bf16 *y) {
    static int occ_blocks; /* blocks per SM, queried once per instantiation */
    auto kern = w4_mma_kernel<T, NT, PX, MG_S>;
    const size_t smem = (size_t)MG_W * T * NT * 32 * sizeof(float4) +
                        (size_t)MG_W * MG_S * 4 * (32 * sizeof(uint4) + 8 * sizeof(uint2));
    if (!occ_blocks) {
        int bl = 0;
        FL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bl, kern, MG_W * 32, smem));
        occ_blocks = bl < 1 ? 1 : bl;
    }
    const int64_t groups = rows / 16 / T, fill = (int64_t)occ_blocks * c->n_sm;
    /* as many blocks as fit at once, all with the same number of tile groups */
    const int64_t per_block = (groups + fill - 1) / fill;
    const int64_t blocks = (groups + per_block - 1) / per_block;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3(MG_W * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = attr;
    cfg.numAttrs = fl_cuda_pdl_on() ? 1 : 0;
    FL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, (const uint4 *)w->data, (const uint2 *)w->scales, x, n, in,
                                     rows, gshift, bias, bias_f32, y));
    return FL_OK;
}

/* The ring stages (4, or 5 with the w4_stages override) and the x
 * prefetch one step ahead: T = 2 only, the variant measured and tested on
 * the H200 (16-token launches 26.7 us vs 31.4 us at T = 1); at T = 1 and 4
 * it measured 1-7 % slower at batch 1 (more instructions in a kernel that is
 * issue-latency bound, see the notes at the top of this section). It costs
 * U * NT * 8 registers, so the T = 1, 16-token variant never uses it. */
template <int T, int NT>
static fl_status launch_mma_t(fl_cuda *c, const bf16 *x, int n, int in, int rows, const fl_tensor *w,
                              int gshift, const void *bias, int bias_f32, bf16 *y) {
    const bool s5 = fl_cuda_tune(FL_CUDA_TUNE_W4_STAGES) == 5;
    if constexpr ((4 / T) * NT <= 4 && T == 2)
        return s5 ? launch_mma_tn<T, NT, (4 / T) * NT <= 4, 5>(c, x, n, in, rows, w, gshift, bias, bias_f32, y)
                  : launch_mma_tn<T, NT, (4 / T) * NT <= 4, 4>(c, x, n, in, rows, w, gshift, bias, bias_f32, y);
    return s5 ? launch_mma_tn<T, NT, false, 5>(c, x, n, in, rows, w, gshift, bias, bias_f32, y)
              : launch_mma_tn<T, NT, false, 4>(c, x, n, in, rows, w, gshift, bias, bias_f32, y);
}

/* Packed W4 matmul: launches of up to 16 tokens (each streams the weights
 * once). T: the most tiles per block that still leaves a block per SM. */
static fl_status matmul_w4_packed(fl_cuda *c, const bf16 *x, int n, int in, int rows, const fl_tensor *w,
                                  const void *bias, int bias_f32, bf16 *y) {
    int gshift = 0;
    while ((64 << gshift) < w->group) gshift++;
    const int ntile = rows / 16;
    const int t_env = fl_cuda_tune(FL_CUDA_TUNE_W4_T) > 0 ? (int)fl_cuda_tune(FL_CUDA_TUNE_W4_T) : 0;
    int T = ntile % 4 == 0 && ntile / 4 >= c->n_sm ? 4 : ntile % 2 == 0 && ntile / 2 >= c->n_sm ? 2 : 1;
    if ((t_env == 1 || t_env == 2 || t_env == 4) && ntile % t_env == 0) T = t_env;
    /* 16-token launches with T = 1 spend 4 sum-x mma and 4 x loads per unit:
     * T = 2 halves that (measured: 4096x14336, 16 tokens, 31.4 -> 26.7 us),
     * whereas at batch <= 8 the fuller grid of T = 1 wins (19.5 vs 22.5 us). */
    const int T16 = T == 1 && ntile % 2 == 0 && t_env == 0 ? 2 : T;
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int nn = n - i0 < 16 ? n - i0 : 16;
        const bf16 *xi = x + (int64_t)i0 * in;
        bf16 *yi = y + (int64_t)i0 * rows;
        const bool two = nn > 8;
        switch ((two ? T16 : T) * 2 + two) {
        case 2: FL_TRY((launch_mma_t<1, 1>(c, xi, nn, in, rows, w, gshift, bias, bias_f32, yi))); break;
        case 3: FL_TRY((launch_mma_t<1, 2>(c, xi, nn, in, rows, w, gshift, bias, bias_f32, yi))); break;
        case 4: FL_TRY((launch_mma_t<2, 1>(c, xi, nn, in, rows, w, gshift, bias, bias_f32, yi))); break;
        case 5: FL_TRY((launch_mma_t<2, 2>(c, xi, nn, in, rows, w, gshift, bias, bias_f32, yi))); break;
        case 8: FL_TRY((launch_mma_t<4, 1>(c, xi, nn, in, rows, w, gshift, bias, bias_f32, yi))); break;
        default: FL_TRY((launch_mma_t<4, 2>(c, xi, nn, in, rows, w, gshift, bias, bias_f32, yi))); break;
        }
    }
    return FL_OK;
}

/* ---------------------------------------------------------------------------
 * W4 tiled GEMM (any batch). Block: 128 threads, 4 warps in 2x2, tile 64
 * tokens x 64 output rows, K step 32; each warp owns 32x32 = 2x2 WMMA
 * fragments. The weight tile is dequantized (f32 math, rounded to bf16) into
 * shared memory by element, which handles any group and any even `in`.
 * ------------------------------------------------------------------------- */
#define GM_BM 64
#define GM_BN 64
#define GM_BK 32
#define GM_LDA (GM_BK + 8)
#define GM_LDC (GM_BN + 4)

static __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    const uint32_t a = __bfloat16_as_ushort(f2bf(lo)), b = __bfloat16_as_ushort(f2bf(hi));
    return a | (b << 16);
}

/* Generic form: any even `in`, any group, any x alignment; elements are
 * loaded and dequantized one by one. */
static __device__ __forceinline__ void gemm_tile_generic(const bf16 *__restrict__ x, int n, int in,
                                                         int rows, const uint8_t *__restrict__ codes,
                                                         const __half2 *__restrict__ sb, int group,
                                                         int m0, int n0, int k0, bf16 *As, bf16 *Bs) {
    const int tid = threadIdx.x;
    const int64_t row_bytes = in / 2, gpr = in / group;
    for (int e = tid; e < GM_BM * GM_BK; e += 128) {
        const int r = e / GM_BK, cc = e % GM_BK;
        const int tok = m0 + r, k = k0 + cc;
        As[r * GM_LDA + cc] = (tok < n && k < in) ? x[(int64_t)tok * in + k] : f2bf(0.0f);
    }
    for (int e = tid; e < GM_BN * GM_BK; e += 128) {
        const int r = e / GM_BK, cc = e % GM_BK;
        const int orow = n0 + r, k = k0 + cc;
        float v = 0.0f;
        if (orow < rows && k < in) {
            const uint8_t byte = codes[(int64_t)orow * row_bytes + (k >> 1)];
            const int code = (k & 1) ? (byte >> 4) : (byte & 15);
            const float2 f = __half22float2(sb[(int64_t)orow * gpr + k / group]);
            v = fmaf((float)code, f.x, f.y);
        }
        Bs[r * GM_LDA + cc] = f2bf(v);
    }
}

/* Tiled W4 GEMM. VEC (in % 32 == 0, group % 32 == 0, x 16-byte aligned):
 * 16-byte loads of x, 8-byte loads of codes (half a 32-element chunk per
 * thread), the next K step's loads issued before the current step's MMAs. */
template <bool VEC, bool PACKED>
static __global__ void __launch_bounds__(128)
    w4_gemm_kernel(const bf16 *__restrict__ x, int n, int in, int rows,
                   const uint8_t *__restrict__ codes, const __half2 *__restrict__ sb, int group,
                   const void *__restrict__ bias, int bias_f32, bf16 *__restrict__ y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* bf16 MMA needs sm_80+; the backend refuses older GPUs at init */
#else
    using namespace nvcuda;
    __shared__ __align__(32) bf16 As[GM_BM * GM_LDA];
    __shared__ __align__(32) bf16 Bs[GM_BN * GM_LDA];
    __shared__ __align__(32) float Cs[GM_BM * GM_LDC];
    const int tid = threadIdx.x, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int m0 = blockIdx.y * GM_BM, n0 = blockIdx.x * GM_BN;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);

    /* VEC staging registers: A rows tid/4 and tid/4 + 32, 8 elements at
     * (tid % 4) * 8; B row tid/2, elements (tid % 2) * 16 .. + 15. */
    const int nch = in >> 5, gpr = in / group;
    const int ar = tid >> 2, ap = (tid & 3) * 8, br = tid >> 1, bh = tid & 1;
    /* PACKED (see "W4 packed layout"): the 32 columns of step k0 are half h
     * of column block kb, physical k = 64 kb + 16 (c / 8) + 8 h + c % 8 for
     * tile column c; thread (rt = tid / 32, lane) loads its 8 bytes (k-steps
     * 2 h, 2 h + 1) of row tile n0 / 16 + rt, i.e. rows g and g + 8. */
    const int nkb = in >> 6, prt = tid >> 5, plane = tid & 31, pg = plane >> 2, pt = plane & 3;
    const int pgshift = PACKED ? 31 - __clz(group >> 6) : 0;
    uint4 ra[2];
    uint2 rb = make_uint2(0, 0), rs = make_uint2(0, 0);
    __half2 rg = __floats2half2_rn(0.0f, 0.0f);
    auto load_regs = [&](int k0) {
        const int xoff = PACKED ? (k0 & ~63) + 16 * (tid & 3) + (k0 & 32) / 4 : k0 + ap;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int tok = m0 + ar + 32 * i;
            ra[i] = tok < n ? __ldg((const uint4 *)(x + (int64_t)tok * in + xoff)) : make_uint4(0, 0, 0, 0);
        }
        if (PACKED) {
            const int64_t tile = n0 / 16 + prt, kb = k0 >> 6;
            if (tile * 16 < rows) {
                rb = __ldcs((const uint2 *)((const uint4 *)codes + (tile * nkb + kb) * 32 + plane) + ((k0 >> 5) & 1));
                rs = __ldg((const uint2 *)sb + (tile * (nkb >> pgshift) + (kb >> pgshift)) * 8 + pg);
            } else {
                rb = rs = make_uint2(0, 0);
            }
            return;
        }
        const int orow = n0 + br;
        if (orow < rows) {
            rb = __ldcs((const uint2 *)(codes + ((int64_t)orow * nch + (k0 >> 5)) * 16) + bh);
            rg = sb[(int64_t)orow * gpr + k0 / group];
        } else {
            rb = make_uint2(0, 0);
            rg = __floats2half2_rn(0.0f, 0.0f);
        }
    };
    if (VEC) load_regs(0);

    for (int k0 = 0; k0 < in; k0 += GM_BK) {
        if (PACKED) {
#pragma unroll
            for (int i = 0; i < 2; i++) *(uint4 *)(As + (ar + 32 * i) * GM_LDA + ap) = ra[i];
            const float2 f0 = __half22float2(*(const __half2 *)&rs.x); /* row g */
            const float2 f1 = __half22float2(*(const __half2 *)&rs.y); /* row g + 8 */
#pragma unroll
            for (int sp = 0; sp < 2; sp++) {
                const uint32_t w = sp ? rb.y : rb.x;
                float v[8];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float2 f = (i & 1) ? f1 : f0;
                    v[i] = fmaf((float)((w >> (4 * i)) & 15u), f.x, f.y);
                }
                /* row g: columns 8 t + 4 sp + {0, 1, 2, 3} = nibbles 0, 4, 2, 6;
                 * row g + 8: nibbles 1, 5, 3, 7 */
                const int c0 = 8 * pt + 4 * sp;
                *(uint2 *)(Bs + (prt * 16 + pg) * GM_LDA + c0) =
                    make_uint2(pack_bf16x2(v[0], v[4]), pack_bf16x2(v[2], v[6]));
                *(uint2 *)(Bs + (prt * 16 + pg + 8) * GM_LDA + c0) =
                    make_uint2(pack_bf16x2(v[1], v[5]), pack_bf16x2(v[3], v[7]));
            }
        } else if (VEC) {
#pragma unroll
            for (int i = 0; i < 2; i++) *(uint4 *)(As + (ar + 32 * i) * GM_LDA + ap) = ra[i];
            const float2 f = __half22float2(rg);
            const uint32_t w[2] = {rb.x, rb.y};
            uint32_t o[8];
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int i = 0; i < 8; i += 2) {
                    const float v0 = fmaf((float)((w[j] >> (4 * i)) & 15u), f.x, f.y);
                    const float v1 = fmaf((float)((w[j] >> (4 * i + 4)) & 15u), f.x, f.y);
                    o[j * 4 + i / 2] = pack_bf16x2(v0, v1);
                }
            uint4 *bd = (uint4 *)(Bs + br * GM_LDA + bh * 16);
            bd[0] = make_uint4(o[0], o[1], o[2], o[3]);
            bd[1] = make_uint4(o[4], o[5], o[6], o[7]);
        } else {
            gemm_tile_generic(x, n, in, rows, codes, sb, group, m0, n0, k0, As, Bs);
        }
        __syncthreads();
        if (VEC && k0 + GM_BK < in) load_regs(k0 + GM_BK); /* in flight during the MMAs */
#pragma unroll
        for (int kk = 0; kk < GM_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> bfr[2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                wmma::load_matrix_sync(a[i], As + (wm * 32 + i * 16) * GM_LDA + kk, GM_LDA);
#pragma unroll
            for (int j = 0; j < 2; j++)
                wmma::load_matrix_sync(bfr[j], Bs + (wn * 32 + j * 16) * GM_LDA + kk, GM_LDA);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], a[i], bfr[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * GM_LDC + wn * 32 + j * 16, acc[i][j],
                                    GM_LDC, wmma::mem_row_major);
    __syncthreads();
    for (int e = tid; e < GM_BM * GM_BN; e += 128) {
        const int r = e / GM_BN, cc = e % GM_BN;
        const int tok = m0 + r, orow = n0 + cc;
        if (tok < n && orow < rows) {
            const float bb = bias ? vec_load(bias, bias_f32, orow) : 0.0f;
            y[(int64_t)tok * rows + orow] = f2bf(Cs[r * GM_LDC + cc] + bb);
        }
    }
#endif
}

static fl_status launch_gemv_n(fl_cuda *c, int n, const bf16 *x, int in, int rows, const fl_tensor *w,
                               int gshift, const void *bp, int bf32, bf16 *y) {
    switch (n) {
    case 1: return launch_gemv<1>(c, x, in, rows, w, gshift, bp, bf32, y);
    case 2: return launch_gemv<2>(c, x, in, rows, w, gshift, bp, bf32, y);
    case 3: return launch_gemv<3>(c, x, in, rows, w, gshift, bp, bf32, y);
    case 4: return launch_gemv<4>(c, x, in, rows, w, gshift, bp, bf32, y);
    case 5: return launch_gemv<5>(c, x, in, rows, w, gshift, bp, bf32, y);
    case 6: return launch_gemv<6>(c, x, in, rows, w, gshift, bp, bf32, y);
    case 7: return launch_gemv<7>(c, x, in, rows, w, gshift, bp, bf32, y);
    default: return launch_gemv<8>(c, x, in, rows, w, gshift, bp, bf32, y);
    }
}

/* The decode GEMV on the packed layout (cuda_gemv.cu); the old tensor-core
 * GEMV above stays selectable for side-by-side measurements. */
extern "C" fl_status fl_cuda_w4_gemv(fl_backend *b, const bf16 *x, int n, int in, int rows, const fl_tensor *w,
                                     const void *bias, int bias_f32, bf16 *y);
extern "C" int fl_cuda_w4_gemv_use_old(void);

/* ---------------------------------------------------------------------------
 * W4 at large batches: dequantize, then cuBLAS.
 *
 * From some batch on, the matmul is compute bound and what matters is the
 * tensor-core rate: the tiled WMMA GEMM above reaches ~130 TFLOP/s, cuBLAS
 * on bf16 several times that. Expanding the weight to bf16 costs one pass
 * (read 0.5 + write 2 bytes per weight, ~40 us for 4096 x 14336 at HBM
 * speed), which a GEMM of a few hundred tokens repays; vLLM's AWQ path does
 * the same above 256 tokens. Values are code * scale + bias rounded to bf16,
 * as the tiled GEMM rounds them, so both paths compute the same products.
 * One thread per 8 adjacent columns of a row, 32-bit index math only (a
 * first version with a 64-bit division per column pair ran at ~1/4 of the
 * bandwidth): in the packed layout (see "W4 packed layout") columns
 * 8 j .. 8 j + 7 of row 16 T + 8 h + g are in two consecutive words of one
 * lane, word s holding columns 4 s' .. 4 s' + 3 of the lane's 16 in nibbles
 * h, h + 4, h + 2, h + 6; the thread reads those 8 bytes and writes 16,
 * coalesced along the row.
 * ------------------------------------------------------------------------- */
static __global__ void __launch_bounds__(128)
    w4_dequant_packed_kernel(const uint32_t *__restrict__ codes, const __half2 *__restrict__ sb, int rows, int in,
                             int group, bf16 *__restrict__ out) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x; /* column octet */
    if (j >= in / 8) return;
    const int k0 = 8 * j, nkb = in >> 6, gpr = in / group;
    const int kb = k0 >> 6, kk = k0 & 63, t = kk >> 4, s = (kk >> 2) & 2;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const int tile = row >> 4, r = row & 15, g = r & 7, h = r >> 3;
        const uint2 w = __ldcs((const uint2 *)(codes + ((size_t)(tile * nkb + kb) * 32 + 4 * g + t) * 4 + s));
        const float2 f = __half22float2(sb[((size_t)tile * gpr + k0 / group) * 16 + 2 * g + h]);
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const uint32_t v = q ? w.y : w.x;
            const float c0 = (float)((v >> (4 * h)) & 15u), c1 = (float)((v >> (4 * h + 16)) & 15u);
            const float c2 = (float)((v >> (4 * h + 8)) & 15u), c3 = (float)((v >> (4 * h + 24)) & 15u);
            o[2 * q] = pack_bf16x2(fmaf(c0, f.x, f.y), fmaf(c1, f.x, f.y));
            o[2 * q + 1] = pack_bf16x2(fmaf(c2, f.x, f.y), fmaf(c3, f.x, f.y));
        }
        *(uint4 *)(out + (size_t)row * in + k0) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

/* The scratch holds at most this many weights (512 MB of bf16): a larger
 * matrix (a quantized lm_head of a big vocabulary) keeps the tiled GEMM. */
#define W4_DEQ_MAX_ELEMS ((size_t)256 << 20)
/* From this many tokens to w4_deq_min_n, packed W4 takes the one-pass GEMM. */
#define W4_GEMM_MIN_N 64

extern "C" fl_status fl_cuda_w4_deq_reserve(fl_backend *b, int64_t rows, int64_t cols) {
    fl_cuda *c = cuda_impl(b);
    const size_t need = (size_t)rows * (size_t)cols;
    FL_TRY(fl_cuda_w4_gemm_reserve(b));
    if (need <= c->w4_deq_elems || need > W4_DEQ_MAX_ELEMS) return FL_OK;
    if (c->w4_deq) {
        FL_CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* a matmul may still read it */
        FL_CUDA_CHECK(cudaFree(c->w4_deq));
        c->w4_deq = NULL;
        c->w4_deq_elems = 0;
    }
    FL_CUDA_CHECK(cudaMalloc(&c->w4_deq, need * 2));
    c->w4_deq_elems = need;
    return FL_OK;
}

extern "C" void fl_cuda_w4_set_dequant_min_n(fl_backend *b, int n) { cuda_impl(b)->w4_deq_min_n = n; }

static fl_status matmul_w4_dequant(fl_backend *b, const bf16 *x, int n, const fl_tensor *w, const fl_tensor *bias,
                                   bf16 *y) {
    fl_cuda *c = cuda_impl(b);
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    const dim3 grid((unsigned)cdiv_u(in / 8, 128), (unsigned)std::min(rows, 65535));
    w4_dequant_packed_kernel<<<grid, 128, 0, c->stream>>>((const uint32_t *)w->data, (const __half2 *)w->scales,
                                                          rows, in, w->group, (bf16 *)c->w4_deq);
    FL_CUDA_LAUNCH_CHECK("w4_dequant_packed_kernel");
    const float alpha = 1.0f, beta = 0.0f;
    FL_CUBLAS_CHECK(cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, in, &alpha, c->w4_deq, CUDA_R_16BF,
                                 in, x, CUDA_R_16BF, in, &beta, y, CUDA_R_16BF, rows, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
    if (bias) return fl_cuda_add_bias(b, y, n, rows, bias);
    return FL_OK;
}

/* --------------------------------------------------------------------------- */
static fl_status matmul_w4(fl_backend *b, const bf16 *x, int n, const fl_tensor *w,
                           const fl_tensor *bias, bf16 *y) {
    fl_cuda *c = cuda_impl(b);
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    const void *bp = bias ? bias->data : NULL;
    const int bf32 = bias && bias->dtype == FL_DTYPE_F32;
    if (w4_packed(rows, in, w->group)) {
        /* 64-127 tokens: the one-pass tensor-core GEMM (cuda_w4_gemm.cu;
         * measured 7-12 % faster decode steps than the GEMV's rereads at
         * batch 64-96, slower from 160 than dequantize + cuBLAS) */
        long gm = fl_cuda_tune(FL_CUDA_TUNE_W4_GEMM);
        if (gm < 0) gm = W4_GEMM_MIN_N;
        if (gm > 0 && n >= gm && n < c->w4_deq_min_n && c->w4g_ws && fl_cuda_w4_gemm_takes(x, rows, in, w->group))
            return fl_cuda_w4_gemm(b, x, n, in, rows, w, bp, bf32, y);
        /* Large batches: dequantize + cuBLAS where the scratch holds the
         * weight (every packed weight up to 256M elements: reserved at upload) */
        if (n >= cuda_impl(b)->w4_deq_min_n && (size_t)rows * in <= cuda_impl(b)->w4_deq_elems)
            return matmul_w4_dequant(b, x, n, w, bias, y);
        /* Otherwise the tiled GEMM reads the packed layout too (the GEMV
         * re-streams the weights every 16 tokens). */
        if (n >= 256 && ((uintptr_t)x & 15) == 0) {
            dim3 grid(cdiv_u(rows, GM_BN), cdiv_u(n, GM_BM));
            if (grid.y > 65535)
                return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: %d tokens exceed the W4 GEMM grid", n);
            w4_gemm_kernel<true, true><<<grid, 128, 0, c->stream>>>(
                x, n, in, rows, (const uint8_t *)w->data, (const __half2 *)w->scales, w->group, bp, bf32, y);
            FL_CUDA_LAUNCH_CHECK("w4_gemm_kernel");
            return FL_OK;
        }
        /* x not 16-byte aligned (a slice of a larger buffer): the old GEMV
         * has a 2-byte load path; the new one reads x 16 bytes at a time */
        if (!fl_cuda_w4_gemv_use_old() && ((uintptr_t)x & 15) == 0)
            return fl_cuda_w4_gemv(b, x, n, in, rows, w, bp, bf32, y);
        return matmul_w4_packed(c, x, n, in, rows, w, bp, bf32, y);
    }
    int gshift = -1;
    for (int s = 0; s <= 5; s++)
        if ((32 << s) == w->group) gshift = s;
    const bool aligned = ((uintptr_t)x & 15) == 0 && in % 32 == 0 && w->group % 32 == 0;
    /* Small batches go through the GEMV, up to 4 launches of at most 8
     * tokens each (as many as fit x in shared memory): each launch streams
     * the weights once, which beats the untuned GEMM until n is larger. */
    int nfit = 0;
    if (gshift >= 0 && aligned)
        for (nfit = 8; nfit > 0 && gemv_smem_bytes(nfit, in) + 1024 > c->smem_optin; nfit--) {}
    if (nfit > 0 && (n + nfit - 1) / nfit <= 4) {
        for (int i0 = 0; i0 < n; i0 += nfit) {
            const int nn = n - i0 < nfit ? n - i0 : nfit;
            FL_TRY(launch_gemv_n(c, nn, x + (int64_t)i0 * in, in, rows, w, gshift, bp, bf32,
                                 y + (int64_t)i0 * rows));
        }
        return FL_OK;
    }
    dim3 grid(cdiv_u(rows, GM_BN), cdiv_u(n, GM_BM));
    if (grid.y > 65535)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: %d tokens exceed the W4 GEMM grid", n);
    if (aligned)
        w4_gemm_kernel<true, false><<<grid, 128, 0, c->stream>>>(x, n, in, rows, (const uint8_t *)w->data,
                                                          (const __half2 *)w->scales, w->group, bp, bf32, y);
    else
        w4_gemm_kernel<false, false><<<grid, 128, 0, c->stream>>>(x, n, in, rows, (const uint8_t *)w->data,
                                                           (const __half2 *)w->scales, w->group, bp, bf32, y);
    FL_CUDA_LAUNCH_CHECK("w4_gemm_kernel");
    return FL_OK;
}

/* The gemv_rows override at 0 keeps cuBLAS for the few-row bf16 matmuls
 * (the A/B); else cuda_gemv_rows.cu's kernel takes them. */
static bool gemv_rows_on(void) { return cuda_tune_on(FL_CUDA_TUNE_GEMV_ROWS); }

static fl_status matmul_bf16(fl_backend *b, const bf16 *x, int n, const fl_tensor *w,
                             const fl_tensor *bias, bf16 *y) {
    fl_cuda *c = cuda_impl(b);
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    /* decode-sized batches: the bulk-copy GEMV (cuda_gemv_bf16.cu) instead of
     * cuBLAS's split-K GEMV + reduce */
    if (fl_cuda_bf16_gemv_takes(b, x, n, w)) return fl_cuda_bf16_gemv(b, x, n, w, bias, y);
    /* a few rows (a MoE router): a block a row (cuda_gemv_rows.cu) */
    if (gemv_rows_on() && fl_cuda_gemv_rows_takes(x, n, w)) return fl_cuda_gemv_rows(b, x, n, w, bias, y);
    const float alpha = 1.0f, beta = 0.0f;
    /* Column-major view: y^T[rows, n] = W[rows, in] (stored as W^T col-major,
     * hence OP_T) times x^T[in, n]. */
    FL_CUBLAS_CHECK(cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, in, &alpha, w->data,
                                 CUDA_R_16BF, in, x, CUDA_R_16BF, in, &beta, y, CUDA_R_16BF, rows,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (bias) return fl_cuda_add_bias(b, y, n, rows, bias);
    return FL_OK;
}

extern "C" fl_status fl_cuda_matmul(fl_backend *b, const void *x, int n, const fl_tensor *w,
                                    const fl_tensor *bias, void *y) {
    if (w->ndim != 2) return FL_ERR(FL_ERR_INVALID_ARG, "matmul: weight must be 2-D");
    if (w->shape[0] > INT32_MAX || w->shape[1] > INT32_MAX)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: weight [%lld, %lld] is too large",
                      (long long)w->shape[0], (long long)w->shape[1]);
    if (bias) {
        if (fl_tensor_numel(bias) != w->shape[0])
            return FL_ERR(FL_ERR_INVALID_ARG, "matmul: bias has %lld elements, weight has %lld rows",
                          (long long)fl_tensor_numel(bias), (long long)w->shape[0]);
        if (bias->dtype != FL_DTYPE_F32 && bias->dtype != FL_DTYPE_BF16)
            return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: bias dtype %s (expected an F32/BF16 "
                          "device vector)", fl_dtype_name(bias->dtype));
    }
    if (n <= 0 || w->shape[0] <= 0) return FL_OK; /* an empty grid is a launch error */
    switch (w->dtype) {
    case FL_DTYPE_BF16: return matmul_bf16(b, (const bf16 *)x, n, w, bias, (bf16 *)y);
    case FL_DTYPE_W4: return matmul_w4(b, (const bf16 *)x, n, w, bias, (bf16 *)y);
    case FL_DTYPE_F8_E4M3: return fl_cuda_fp8_matmul(b, x, n, w, bias, y);
    default:
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: weight dtype %s is not supported (upload_weight "
                      "makes BF16, W4 or FP8)", fl_dtype_name(w->dtype));
    }
}
