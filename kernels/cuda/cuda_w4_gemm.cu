/*
 * cuda_w4_gemm.cu — y[n, rows] = x[n, in] @ W[rows, in]^T (+ bias) for W4
 * weights in the packed device layout (cuda_matmul.cu, "W4 packed layout")
 * at tens to hundreds of tokens, in one pass over the weights: each code is
 * read from memory once per 64 tokens and dequantized in registers, where
 * the dequantize + cuBLAS path writes and rereads a bf16 copy of the whole
 * weight (2.5 bytes a weight more than the 0.5 of the codes) and the GEMV
 * rereads the codes every 16 tokens.
 *
 * Block: 8 warps; block tile 256 rows x 64 tokens; warp tile 32 rows (two
 * 16-row tiles) x all 64 tokens (eight mma n-tiles of 8). Every block
 * rereads its 64 tokens of x from L2 for each 256 rows, so x costs half a
 * byte a weight per 64 tokens, as much as the codes: fewer rows a block
 * (64 at first) made x the larger stream by far and left too few bytes in
 * flight. The weight rows are the mma's M, the tokens its N (as in the
 * GEMV), so a lane's 16 bytes of a unit are its A fragments for the unit's
 * 4 k-steps: register m of k-step s = nibbles m and m + 4 of word s, rows
 * g + 8 (m & 1), columns 16 t + 4 s + 2 (m >> 1) + {0, 1}. Each pair is
 * dequantized as the dequantize kernel does it (code * scale + bias in f32,
 * rounded to bf16), so both paths multiply the same bf16 weights. B
 * fragments use the same permuted k order: lane (g, t) takes x[token g][64 kb
 * + 16 t .. + 15], two 16-byte shared loads a 64-column block, conflict-free
 * at a 144-byte row stride (rows g and g + 1 land 16 bytes apart modulo 128).
 * A warp dequantizes two k-steps at a time to stay under 128 registers (two
 * blocks an SM).
 *
 * Pipeline: a 64-column block of x (64 tokens), of the codes (16 units) and
 * of the scales (16 tiles x 16 rows) per stage, WG_STAGES stages through
 * cp.async; tokens past n and row tiles past rows are zero-filled and never
 * stored.
 *
 * Split k: where the output tiles are fewer than the SMs (a few thousand
 * rows at a few dozen tokens), grid.z blocks share a tile's columns; each
 * writes its f32 partial tile to the workspace and the last to arrive (a
 * counter a tile, reset by it) adds them all in split order, so the sum does
 * not depend on which block came last, and stores y.
 */
#include <algorithm>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

#define WG_THREADS 256
#define WG_ROWS 256                      /* weight rows a block */
#define WG_TILES (WG_ROWS / 16)          /* 16-row tiles a block, two a warp */
#define WG_TOK 64                        /* tokens a block */
#define WG_XS 72                         /* x row stride in shared memory, bf16 (144 bytes) */
#define WG_STAGES 4
#define WG_XB (WG_TOK * WG_XS * 2)       /* bytes of x a stage */
#define WG_CB (WG_TILES * 512)           /* bytes of codes a stage */
#define WG_SB (WG_TILES * 64)            /* bytes of scales a stage */
#define WG_STAGE (WG_XB + WG_CB + WG_SB)
#define WG_SMEM (WG_STAGES * WG_STAGE)   /* 72 KiB: dynamic, opted in at reserve */
#define WG_TILE_F (WG_ROWS * WG_TOK)     /* floats of a partial tile */
#define WG_MAX_SPLIT 8
#define WG_PARTS_PER_SM 3                /* workspace: this many partial tiles an SM */

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

/* A 4-bit code as a float without the quarter-rate int-to-float convert:
 * 2^23 + code has the code as its low mantissa bits, so subtracting 2^23
 * leaves exactly (float)code. */
static __device__ __forceinline__ float wg_code(uint32_t c) {
    return __uint_as_float(0x4B000000u | c) - 8388608.0f;
}

/* bf16 pair {code lo * s + b, code hi * s + b}, f32 arithmetic, rounded */
static __device__ __forceinline__ uint32_t wg_deq(uint32_t lo, uint32_t hi, float2 f) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(fmaf(wg_code(lo), f.x, f.y), fmaf(wg_code(hi), f.x, f.y));
    return *(const uint32_t *)&h;
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
    /* x: 64 tokens x 128 bytes = 512 chunks, 2 a thread */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int e = tid + i * WG_THREADS, r = e >> 3, c = e & 7;
        const int tok = t0 + r;
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

static __global__ void __launch_bounds__(WG_THREADS, 2)
    w4_gemm_mma_kernel(const bf16 *__restrict__ x, int n, int in, int rows, const uint32_t *__restrict__ codes,
                       const __half2 *__restrict__ sb, int gshift, const void *__restrict__ bias, int bias_f32,
                       bf16 *__restrict__ y, float *__restrict__ ws, int *__restrict__ cnt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* bf16 MMA needs sm_80+; the backend refuses older GPUs at init */
#else
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int is_last;
    pdl_enter(); /* before any global access: see launch_pdl */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int nkb = in >> 6, n_tiles = rows >> 4, gpr = nkb >> gshift;
    const int rt0 = blockIdx.x * WG_TILES, t0 = blockIdx.y * WG_TOK;
    const int n_split = (int)gridDim.z, z = (int)blockIdx.z;
    const int kb0 = (int)((int64_t)nkb * z / n_split), nk = (int)((int64_t)nkb * (z + 1) / n_split) - kb0;

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; s++) {
        if (s < nk) wg_load(smem, s, kb0 + s, x, n, in, t0, codes, sb, n_tiles, rt0, nkb, gshift, gpr);
        wg_commit(); /* possibly empty: keeps the group count uniform */
    }
    for (int k = 0; k < nk; k++) {
        wg_wait<WG_STAGES - 2>();
        __syncthreads(); /* stage k landed for every thread; stage k - 1 is free */
        if (k + WG_STAGES - 1 < nk)
            wg_load(smem, (k + WG_STAGES - 1) % WG_STAGES, kb0 + k + WG_STAGES - 1, x, n, in, t0, codes, sb,
                    n_tiles, rt0, nkb, gshift, gpr);
        wg_commit();
        const uint8_t *st = smem + (k % WG_STAGES) * WG_STAGE;
        /* k-steps 2 h and 2 h + 1: their A fragments (codes words 2 h, 2 h + 1
         * of each tile's unit), then every n-tile */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint32_t a[2][2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int u = warp * 2 + i;
                const uint2 wv = *(const uint2 *)(st + WG_XB + u * 512 + lane * 16 + h * 8);
                const float2 f0 = __half22float2(*(const __half2 *)(st + WG_XB + WG_CB + u * 64 + (2 * g) * 4));
                const float2 f1 = __half22float2(*(const __half2 *)(st + WG_XB + WG_CB + u * 64 + (2 * g + 1) * 4));
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const uint32_t ws_ = q ? wv.y : wv.x;
#pragma unroll
                    for (int m = 0; m < 4; m++)
                        a[i][q][m] = wg_deq((ws_ >> (4 * m)) & 15u, (ws_ >> (4 * m + 16)) & 15u, (m & 1) ? f1 : f0);
                }
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const uint4 p = *(const uint4 *)(st + (j * 8 + g) * (WG_XS * 2) + t * 32 + h * 16);
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    wg_mma(acc[i][j], a[i][0], p.x, p.y);
                    wg_mma(acc[i][j], a[i][1], p.z, p.w);
                }
            }
        }
    }
    wg_wait<0>();
    if (n_split > 1) {
        /* this block's partial tile, register e of thread tid at e * WG_THREADS + tid */
        const int tile_id = blockIdx.y * gridDim.x + blockIdx.x;
        float *part = ws + (int64_t)tile_id * n_split * WG_TILE_F;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    __stcg(part + (int64_t)z * WG_TILE_F + ((i * 8 + j) * 4 + c) * WG_THREADS + tid, acc[i][j][c]);
        __threadfence();
        __syncthreads();
        if (tid == 0) is_last = atomicAdd(cnt + tile_id, 1) == n_split - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        /* every split's partial in split order, this block's own too (from L2);
         * a split's 64 loads are independent, so they are in flight together */
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
        for (int zz = 0; zz < n_split; zz++) {
            const float *q = part + (int64_t)zz * WG_TILE_F + tid;
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[i][j][c] += __ldcg(q + ((i * 8 + j) * 4 + c) * WG_THREADS);
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
            for (int j = 0; j < 8; j++) {
                const int tok = t0 + j * 8 + 2 * t;
                if (tok < n) y[(int64_t)tok * rows + row] = f2bf(acc[i][j][2 * hh] + bb);
                if (tok + 1 < n) y[(int64_t)(tok + 1) * rows + row] = f2bf(acc[i][j][2 * hh + 1] + bb);
            }
        }
    }
#endif
}

extern "C" bool fl_cuda_w4_gemm_takes(const void *x, int rows, int in, int group) {
    return ((uintptr_t)x & 15) == 0 && rows % 16 == 0 && in % 64 == 0 && group >= 64 && (group & (group - 1)) == 0 &&
           in % group == 0;
}

extern "C" fl_status fl_cuda_w4_gemm_reserve(fl_backend *b) {
    fl_cuda *c = cuda_impl(b);
    if (c->w4g_ws || c->smem_optin < WG_SMEM) return FL_OK; /* made, or the GPU cannot run it */
    FL_CUDA_CHECK(cudaFuncSetAttribute(w4_gemm_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM));
    FL_CUDA_CHECK(cudaMalloc(&c->w4g_cnt, sizeof(int) * (size_t)c->n_sm));
    FL_CUDA_CHECK(cudaMemset(c->w4g_cnt, 0, sizeof(int) * (size_t)c->n_sm));
    FL_CUDA_CHECK(cudaMalloc(&c->w4g_ws, sizeof(float) * WG_TILE_F * (size_t)WG_PARTS_PER_SM * c->n_sm));
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
    const int gx = (rows + WG_ROWS - 1) / WG_ROWS, gy = (n + WG_TOK - 1) / WG_TOK, tiles = gx * gy;
    if (gy > 65535) return FL_ERR(FL_ERR_UNSUPPORTED, "cuda w4 gemm: %d tokens", n);
    /* split k into as many parts as fill one wave of two blocks an SM (a
     * partial second wave of a few blocks costs as much as a whole one),
     * keeping 4+ column blocks a split and the partials within the
     * workspace (counters: one a tile, tiles < SMs) */
    int split = 1;
    if (tiles < c->n_sm) {
        split = 2 * c->n_sm / tiles;
        split = std::min(split, WG_MAX_SPLIT);
        split = std::min(split, (in >> 6) / 4);
        split = std::min(split, WG_PARTS_PER_SM * c->n_sm / tiles);
        split = std::max(split, 1);
    }
    return launch_pdl(w4_gemm_mma_kernel, dim3((unsigned)gx, (unsigned)gy, (unsigned)split), dim3(WG_THREADS),
                      WG_SMEM, c->stream, x, n, in, rows, (const uint32_t *)w->data, (const __half2 *)w->scales,
                      gshift, bias, bias_f32, y, c->w4g_ws, c->w4g_cnt);
}
