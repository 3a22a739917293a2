/*
 * cuda_w4_gemm.cu — y[n, rows] = x[n, in] @ W[rows, in]^T (+ bias) for W4
 * weights in the packed device layout (cuda_matmul.cu, "W4 packed layout")
 * at tens to hundreds of tokens, in one pass over the weights, where the
 * dequantize + cuBLAS path writes and rereads a bf16 copy of the whole
 * weight (2.5 bytes a weight more than the 0.5 of the codes) and the GEMV
 * rereads the codes every 16 tokens.
 *
 * The codes go to the tensor cores as they are: a code c with 0x4300 in
 * its upper bits is the bf16 value 128 + c, so one shift and one logic op
 * make a register of two A values. Within a quantization group the scale s
 * and bias b of a row are constants, so
 *     sum_k (c_k s + b) x_k = s sum_k (128 + c_k) x_k + (b - 128 s) sum_k x_k:
 * the mma accumulates sum (128 + c) x for one group, and at the group's end
 * two fused multiply-adds an output fold it into the result with the
 * group's token sums of x (computed once a stage for the block). An
 * earlier version dequantized every pair in f32 before the mma (about nine
 * instructions a pair) and was issue-bound at a third of the tensor rate.
 * The weights are exact here (the dequantize path rounds code x scale +
 * bias to bf16), so the two paths differ by that rounding.
 *
 * Block: 8 warps; block tile 256 rows x 32 tokens; warp tile 32 rows (two
 * 16-row tiles) x the block's 32 tokens (four mma n-tiles of 8). A lane's
 * 16 bytes of a unit are its A fragments for the unit's 4 k-steps: register
 * m of k-step s = nibbles m and m + 4 of word s, rows g + 8 (m & 1),
 * columns 16 t + 4 s + 2 (m >> 1) + {0, 1}; B fragments use the same
 * permuted k order: lane (g, t) takes x[token g][64 kb + 16 t .. + 15], two
 * 16-byte shared loads a 64-column block, conflict-free at a 144-byte row
 * stride. Token blocks are the grid's fastest dimension, so the blocks
 * sharing a row block run together and read its codes from L2 once.
 *
 * Pipeline: a 64-column block of x (32 tokens), of the codes (16 units) and
 * of the scales (16 tiles x 16 rows) per stage, WG_STAGES stages through
 * cp.async; tokens past n and row tiles past rows are zero-filled and never
 * stored. A stage's token sums are written by the block after the barrier
 * that lands it and read at its group's fold, after a later barrier, from
 * a ring of 8 slots (a group spans at most 4 stages, so the fold never
 * reads the slot being written); the group's scales travel in registers,
 * so the fold does not read a stage the next load may be refilling.
 *
 * Split k: where the output tiles are fewer than the SMs, grid.z blocks
 * share a tile's columns (at group boundaries); each writes its f32 partial
 * tile to the workspace and the last to arrive (a counter a tile, reset by
 * it) adds them all in split order, so the sum does not depend on which
 * block came last, and stores y.
 */
#include <algorithm>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

#define WG_THREADS 256
#define WG_ROWS 256                      /* weight rows a block */
#define WG_TILES (WG_ROWS / 16)          /* 16-row tiles a block, two a warp */
#define WG_TOK 32                        /* tokens a block */
#define WG_NT (WG_TOK / 8)               /* mma n-tiles a warp */
#define WG_XS 72                         /* x row stride in shared memory, bf16 (144 bytes) */
#define WG_STAGES 4
#define WG_XB (WG_TOK * WG_XS * 2)       /* bytes of x a stage */
#define WG_CB (WG_TILES * 512)           /* bytes of codes a stage */
#define WG_SB (WG_TILES * 64)            /* bytes of scales a stage */
#define WG_STAGE (WG_XB + WG_CB + WG_SB)
#define WG_SMEM (WG_STAGES * WG_STAGE)   /* 54 KiB: dynamic, opted in at reserve */
#define WG_TILE_F (WG_ROWS * WG_TOK)     /* floats of a partial tile */
#define WG_MAX_SPLIT 8
#define WG_WS_TILES 768                  /* workspace: partial tiles (six an SM of a 128-SM GPU) */
#define WG_MAX_CNT 1024                  /* workspace: arrival counters (split only below n_sm tiles) */

static __device__ __forceinline__ void wg_cp16(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
static __device__ __forceinline__ void wg_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wg_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

static __device__ __forceinline__ void wg_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Stage `slot` <- 64-column block kb: x rows t0 .., the codes of row tiles
 * rt0 .., their scales of kb's group. */
static __device__ __forceinline__ void wg_load(uint8_t *smem, int slot, int kb, const bf16 *__restrict__ x, int n,
                                               int in, int t0, const uint32_t *__restrict__ codes,
                                               const __half2 *__restrict__ sb, int n_tiles, int rt0, int nkb,
                                               int gshift, int gpr) {
    const int tid = threadIdx.x;
    uint8_t *st = smem + slot * WG_STAGE;
    const uint32_t sx = (uint32_t)__cvta_generic_to_shared(st);
    /* x: 32 tokens x 128 bytes = 256 chunks, one a thread */
    {
        const int r = tid >> 3, c = tid & 7, tok = t0 + r;
        const bool ok = tok < n;
        const bf16 *src = x + (int64_t)(ok ? tok : 0) * in + kb * 64 + c * 8;
        wg_cp16(sx + r * (WG_XS * 2) + c * 16, src, ok);
    }
    /* codes: 16 units x 512 bytes = 512 chunks, 2 a thread */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int e = tid + i * WG_THREADS, u = e >> 5, c = e & 31, tile = rt0 + u;
        const bool ok = tile < n_tiles;
        const uint32_t *src = codes + ((int64_t)(ok ? tile : 0) * nkb + kb) * 128 + c * 4;
        wg_cp16(sx + WG_XB + u * 512 + c * 16, src, ok);
    }
    /* scales: 16 tiles x 16 half2 = 64 chunks */
    if (tid < WG_TILES * 4) {
        const int u = tid >> 2, c = tid & 3, tile = rt0 + u;
        const bool ok = tile < n_tiles;
        const __half2 *src = sb + ((int64_t)(ok ? tile : 0) * gpr + (kb >> gshift)) * 16 + c * 4;
        wg_cp16(sx + WG_XB + WG_CB + u * 64 + c * 16, src, ok);
    }
}

#define WG_XSUMS 8 /* token-sum slots: a group's (up to 4 stages) are never the one being written */

/* acc += s * accg + (b - 128 s) * (the group's token sums), then accg = 0:
 * sc the group's (scale, bias) of rows g and g + 8 of this warp's two
 * tiles, its token sums summed over its stages (xs[last], xs[last - 1], ...). */
static __device__ __forceinline__ void wg_fold(float (&acc)[2][WG_NT][4], float (&accg)[2][WG_NT][4],
                                               const __half2 (&sc)[2][2], const float (*xs)[WG_TOK], int last,
                                               int per_group, int t) {
    float xsum[WG_NT][2];
#pragma unroll
    for (int j = 0; j < WG_NT; j++) xsum[j][0] = xsum[j][1] = 0.0f;
    for (int q = 0; q < per_group; q++) {
        const float *v = xs[(last - q) & (WG_XSUMS - 1)];
#pragma unroll
        for (int j = 0; j < WG_NT; j++) {
            xsum[j][0] += v[j * 8 + 2 * t];
            xsum[j][1] += v[j * 8 + 2 * t + 1];
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float2 f = __half22float2(sc[i][h]);
            const float sv = f.x, bv = fmaf(-128.0f, f.x, f.y);
#pragma unroll
            for (int j = 0; j < WG_NT; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &o = acc[i][j][2 * h + e], &p = accg[i][j][2 * h + e];
                    o = fmaf(bv, xsum[j][e], fmaf(sv, p, o));
                    p = 0.0f;
                }
        }
}

static __global__ void __launch_bounds__(WG_THREADS, 2)
    w4_gemm_mma_kernel(const bf16 *__restrict__ x, int n, int in, int rows, const uint32_t *__restrict__ codes,
                       const __half2 *__restrict__ sb, int gshift, const void *__restrict__ bias, int bias_f32,
                       bf16 *__restrict__ y, float *__restrict__ ws, int *__restrict__ cnt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* bf16 MMA needs sm_80+; the backend refuses older GPUs at init */
#else
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ float xs[WG_XSUMS][WG_TOK]; /* token sums of x, stage k's in slot k % WG_XSUMS */
    __shared__ int is_last;
    pdl_enter(); /* before any global access: see launch_pdl */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int nkb = in >> 6, n_tiles = rows >> 4, gpr = nkb >> gshift, per_group = 1 << gshift;
    const int t0 = blockIdx.x * WG_TOK, rt0 = blockIdx.y * WG_TILES;
    const int n_split = (int)gridDim.z, z = (int)blockIdx.z;
    /* a split's columns are whole groups */
    const int kb0 = (int)((int64_t)gpr * z / n_split) << gshift;
    const int nk = ((int)((int64_t)gpr * (z + 1) / n_split) << gshift) - kb0;

    float acc[2][WG_NT][4], accg[2][WG_NT][4];
    __half2 sc[2][2]; /* the current group's (scale, bias), rows g and g + 8 of the warp's tiles */
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < WG_NT; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = accg[i][j][c] = 0.0f;

#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; s++) {
        if (s < nk) wg_load(smem, s, kb0 + s, x, n, in, t0, codes, sb, n_tiles, rt0, nkb, gshift, gpr);
        wg_commit(); /* possibly empty: keeps the group count uniform */
    }
    for (int k = 0; k < nk; k++) {
        wg_wait<WG_STAGES - 2>();
        __syncthreads(); /* stage k landed for every thread; stage k - 1 is free; xs of k - 1 visible */
        const int slot = k % WG_STAGES;
        /* the group that ended with stage k - 1 (its scales are in sc) */
        if (k > 0 && (k & (per_group - 1)) == 0) wg_fold(acc, accg, sc, xs, k - 1, per_group, t);
        const uint8_t *st = smem + slot * WG_STAGE;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                sc[i][h] = *(const __half2 *)(st + WG_XB + WG_CB + (warp * 2 + i) * 64 + (2 * g + h) * 4);
        if (k + WG_STAGES - 1 < nk)
            wg_load(smem, (k + WG_STAGES - 1) % WG_STAGES, kb0 + k + WG_STAGES - 1, x, n, in, t0, codes, sb,
                    n_tiles, rt0, nkb, gshift, gpr);
        wg_commit();
        {
            /* this stage's token sums: 8 threads a token, 8 columns each */
            const uint4 p = *(const uint4 *)(st + (tid >> 3) * (WG_XS * 2) + (tid & 7) * 16);
            const uint32_t pw[4] = {p.x, p.y, p.z, p.w};
            float v = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float2 f = __bfloat1622float2(*(const __nv_bfloat162 *)&pw[q]);
                v += f.x + f.y;
            }
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            if ((tid & 7) == 0) xs[k & (WG_XSUMS - 1)][tid >> 3] = v;
        }
        /* k-steps 2 h and 2 h + 1: A registers straight from the codes
         * (128 + code as bf16), then every n-tile */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint32_t a[2][2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const uint2 wv = *(const uint2 *)(st + WG_XB + (warp * 2 + i) * 512 + lane * 16 + h * 8);
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const uint32_t w = q ? wv.y : wv.x;
#pragma unroll
                    for (int m = 0; m < 4; m++) a[i][q][m] = ((w >> (4 * m)) & 0x000F000Fu) | 0x43004300u;
                }
            }
#pragma unroll
            for (int j = 0; j < WG_NT; j++) {
                const uint4 p = *(const uint4 *)(st + (j * 8 + g) * (WG_XS * 2) + t * 32 + h * 16);
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    wg_mma(accg[i][j], a[i][0], p.x, p.y);
                    wg_mma(accg[i][j], a[i][1], p.z, p.w);
                }
            }
        }
    }
    wg_wait<0>();
    __syncthreads(); /* the last stage's token sums */
    if (nk > 0) wg_fold(acc, accg, sc, xs, nk - 1, per_group, t);
    if (n_split > 1) {
        /* this block's partial tile, register e of thread tid at e * WG_THREADS + tid */
        const int tile_id = blockIdx.y * gridDim.x + blockIdx.x;
        float *part = ws + (int64_t)tile_id * n_split * WG_TILE_F;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < WG_NT; j++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    __stcg(part + (int64_t)z * WG_TILE_F + ((i * WG_NT + j) * 4 + c) * WG_THREADS + tid,
                           acc[i][j][c]);
        __threadfence();
        __syncthreads();
        if (tid == 0) is_last = atomicAdd(cnt + tile_id, 1) == n_split - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        /* every split's partial in split order, this block's own too (from L2);
         * a split's loads are independent, so they are in flight together */
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < WG_NT; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
        for (int zz = 0; zz < n_split; zz++) {
            const float *q = part + (int64_t)zz * WG_TILE_F + tid;
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < WG_NT; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[i][j][c] += __ldcg(q + ((i * WG_NT + j) * 4 + c) * WG_THREADS);
        }
        if (tid == 0) cnt[tile_id] = 0; /* for the next launch (which waits for this grid: launch_pdl) */
    }
    /* c0, c1: row g, tokens 2 t, 2 t + 1 of the n-tile; c2, c3: row g + 8 */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r0 = (rt0 + warp * 2 + i) * 16 + g;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = r0 + 8 * hh;
            if (row >= rows) continue;
            const float bb = bias ? vec_load(bias, bias_f32, row) : 0.0f;
#pragma unroll
            for (int j = 0; j < WG_NT; j++) {
                const int tok = t0 + j * 8 + 2 * t;
                if (tok < n) y[(int64_t)tok * rows + row] = f2bf(acc[i][j][2 * hh] + bb);
                if (tok + 1 < n) y[(int64_t)(tok + 1) * rows + row] = f2bf(acc[i][j][2 * hh + 1] + bb);
            }
        }
    }
#endif
}

extern "C" bool fl_cuda_w4_gemm_takes(const void *x, int rows, int in, int group) {
    /* groups of 64..256 columns: a group's stages fit the token-sum ring */
    return ((uintptr_t)x & 15) == 0 && rows > 0 && in > 0 && rows % 16 == 0 && in % 64 == 0 && group >= 64 &&
           group <= 256 && (group & (group - 1)) == 0 && in % group == 0;
}

extern "C" fl_status fl_cuda_w4_gemm_reserve(fl_backend *b) {
    fl_cuda *c = cuda_impl(b);
    if (c->w4g_ws || c->smem_optin < WG_SMEM) return FL_OK; /* made, or the GPU cannot run it */
    FL_CUDA_CHECK(cudaFuncSetAttribute(w4_gemm_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM));
    /* one allocation of a size the planner mirrors (FL_CUDA_W4_GEMM_WS_BYTES) */
    static_assert(FL_CUDA_W4_GEMM_WS_BYTES == sizeof(float) * WG_TILE_F * WG_WS_TILES + sizeof(int) * WG_MAX_CNT,
                  "backend.h's W4 GEMM workspace size");
    /* published once its counters are zero, on the stream the GEMMs use (the
     * backend's stream does not wait for the legacy default stream) */
    float *ws = NULL;
    FL_CUDA_CHECK(cudaMalloc(&ws, FL_CUDA_W4_GEMM_WS_BYTES));
    int *cnt = (int *)(ws + (size_t)WG_TILE_F * WG_WS_TILES);
    if (cudaMemsetAsync(cnt, 0, sizeof(int) * WG_MAX_CNT, c->stream) != cudaSuccess) {
        cudaFree(ws);
        return FL_ERR(FL_ERR_CUDA, "cuda w4 gemm: zeroing the split-k counters failed");
    }
    c->w4g_ws = ws;
    c->w4g_cnt = cnt;
    return FL_OK;
}

extern "C" fl_status fl_cuda_w4_gemm(fl_backend *b, const bf16 *x, int n, int in, int rows, const fl_tensor *w,
                                     const void *bias, int bias_f32, bf16 *y) {
    fl_cuda *c = cuda_impl(b);
    if (!fl_cuda_w4_gemm_takes(x, rows, in, w->group) || !c->w4g_ws)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 gemm: [%d, %d] group %d (packed layout, 16-byte x, workspace)",
                      rows, in, w->group);
    if (n <= 0) return FL_OK;
    int gshift = 0;
    while ((64 << gshift) < w->group) gshift++;
    /* token blocks fastest (x), row blocks (y), splits of k (z) */
    const int gx = (n + WG_TOK - 1) / WG_TOK, gy = (rows + WG_ROWS - 1) / WG_ROWS, tiles = gx * gy;
    if (gy > 65535) return FL_ERR(FL_ERR_UNSUPPORTED, "cuda w4 gemm: %d rows", rows);
    /* split k into as many parts as fill one wave of two blocks an SM (a
     * partial second wave of a few blocks costs as much as a whole one), in
     * whole groups of 4+ column blocks, the partials within the workspace
     * (counters: one a tile, tiles < SMs) */
    int split = 1;
    if (tiles < c->n_sm && tiles <= WG_MAX_CNT) {
        split = 2 * c->n_sm / tiles;
        split = std::min(split, WG_MAX_SPLIT);
        split = std::min(split, (in >> 6) / 4);
        split = std::min(split, (in >> 6) >> gshift);
        split = std::min(split, WG_WS_TILES / tiles);
        split = std::max(split, 1);
    }
    return launch_pdl(w4_gemm_mma_kernel, dim3((unsigned)gx, (unsigned)gy, (unsigned)split), dim3(WG_THREADS),
                      WG_SMEM, c->stream, x, n, in, rows, (const uint32_t *)w->data, (const __half2 *)w->scales,
                      gshift, bias, bias_f32, y, c->w4g_ws, c->w4g_cnt);
}
