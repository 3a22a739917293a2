/*
 * cuda_w4_gemm.cu — y[n, rows] = x[n, in] @ W[rows, in]^T (+ bias) for W4
 * weights in the packed device layout (cuda_matmul.cu, "W4 packed layout")
 * at tens to hundreds of tokens, in one pass over the weights: each code is
 * read from memory once per 64 tokens and dequantized in registers, where
 * the dequantize + cuBLAS path writes and rereads a bf16 copy of the whole
 * weight (2.5 bytes a weight more than the 0.5 of the codes) and the GEMV
 * rereads the codes every 16 tokens.
 *
 * Block: 4 warps, 2 (rows) x 2 (tokens); block tile 64 rows x 64 tokens;
 * warp tile 32 rows (two 16-row tiles) x 32 tokens (four mma n-tiles of 8).
 * The weight rows are the mma's M, the tokens its N (as in the GEMV), so a
 * lane's 16 bytes of a unit are its A fragments for the unit's 4 k-steps:
 * register m of k-step s = nibbles m and m + 4 of word s, rows g + 8 (m & 1),
 * columns 16 t + 4 s + 2 (m >> 1) + {0, 1}. Each pair is dequantized as the
 * dequantize kernel does it (code * scale + bias in f32, rounded to bf16), so
 * both paths multiply the same bf16 weights. B fragments use the same
 * permuted k order: lane (g, t) takes x[token g][64 kb + 16 t .. + 15], two
 * 16-byte shared loads a 64-column block, conflict-free at a 144-byte row
 * stride (rows g and g + 1 land 16 bytes apart modulo 128).
 *
 * Pipeline: a 64-column block of x (64 tokens), of the codes (4 units) and
 * of the scales (4 tiles x 16 rows) per stage, STAGES stages through
 * cp.async; tokens past n and row tiles past rows are zero-filled and never
 * stored. Grid (row blocks, token blocks): no split over k, so a few
 * thousand rows at a few dozen tokens leave SMs idle.
 */
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

#define WG_THREADS 128
#define WG_ROWS 64                  /* weight rows a block */
#define WG_TOK 64                   /* tokens a block */
#define WG_XS 72                    /* x row stride in shared memory, bf16 (144 bytes) */
#define WG_STAGES 3
#define WG_XB (WG_TOK * WG_XS * 2)  /* bytes of x a stage */
#define WG_CB (WG_ROWS / 16 * 512)  /* bytes of codes a stage */
#define WG_SB (WG_ROWS / 16 * 64)   /* bytes of scales a stage */
#define WG_STAGE (WG_XB + WG_CB + WG_SB)

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

/* bf16 pair {code lo * s + b, code hi * s + b}, f32 arithmetic, rounded */
static __device__ __forceinline__ uint32_t wg_deq(uint32_t lo, uint32_t hi, float2 f) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(fmaf((float)lo, f.x, f.y), fmaf((float)hi, f.x, f.y));
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
    /* x: 64 tokens x 128 bytes = 512 chunks, 4 a thread */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int e = tid + i * WG_THREADS, r = e >> 3, c = e & 7;
        const int tok = t0 + r;
        const bool ok = tok < n;
        const bf16 *src = x + (int64_t)(ok ? tok : 0) * in + kb * 64 + c * 8;
        wg_cp16(sx + r * (WG_XS * 2) + c * 16, src, ok);
    }
    /* codes: 4 units x 512 bytes = 128 chunks, one a thread */
    {
        const int u = tid >> 5, c = tid & 31, tile = rt0 + u;
        const bool ok = tile < n_tiles;
        const uint32_t *src = codes + ((int64_t)(ok ? tile : 0) * nkb + kb) * 128 + c * 4;
        wg_cp16(sx + WG_XB + u * 512 + c * 16, src, ok);
    }
    /* scales: 4 tiles x 16 half2 = 16 chunks */
    if (tid < 16) {
        const int u = tid >> 2, c = tid & 3, tile = rt0 + u;
        const bool ok = tile < n_tiles;
        const __half2 *src = sb + ((int64_t)(ok ? tile : 0) * gpr + (kb >> gshift)) * 16 + c * 4;
        wg_cp16(sx + WG_XB + WG_CB + u * 64 + c * 16, src, ok);
    }
}

static __global__ void __launch_bounds__(WG_THREADS)
    w4_gemm_mma_kernel(const bf16 *__restrict__ x, int n, int in, int rows, const uint32_t *__restrict__ codes,
                       const __half2 *__restrict__ sb, int gshift, const void *__restrict__ bias, int bias_f32,
                       bf16 *__restrict__ y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* bf16 MMA needs sm_80+; the backend refuses older GPUs at init */
#else
    __shared__ __align__(16) uint8_t smem[WG_STAGES * WG_STAGE];
    pdl_enter(); /* before any global access: see launch_pdl */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wr = warp >> 1, wt = warp & 1;
    const int nkb = in >> 6, n_tiles = rows >> 4, gpr = nkb >> gshift;
    const int rt0 = blockIdx.x * (WG_ROWS / 16), t0 = blockIdx.y * WG_TOK;

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; s++) {
        if (s < nkb) wg_load(smem, s, s, x, n, in, t0, codes, sb, n_tiles, rt0, nkb, gshift, gpr);
        wg_commit(); /* possibly empty: keeps the group count uniform */
    }
    for (int kb = 0; kb < nkb; kb++) {
        wg_wait<WG_STAGES - 2>();
        __syncthreads(); /* stage kb landed for every thread; stage kb - 1 is free */
        if (kb + WG_STAGES - 1 < nkb)
            wg_load(smem, (kb + WG_STAGES - 1) % WG_STAGES, kb + WG_STAGES - 1, x, n, in, t0, codes, sb, n_tiles,
                    rt0, nkb, gshift, gpr);
        wg_commit();
        const uint8_t *st = smem + (kb % WG_STAGES) * WG_STAGE;
        /* A: this warp's two row tiles, all 4 k-steps */
        uint32_t a[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int u = wr * 2 + i;
            const uint4 w = *(const uint4 *)(st + WG_XB + u * 512 + lane * 16);
            const float2 f0 = __half22float2(*(const __half2 *)(st + WG_XB + WG_CB + u * 64 + (2 * g) * 4));
            const float2 f1 = __half22float2(*(const __half2 *)(st + WG_XB + WG_CB + u * 64 + (2 * g + 1) * 4));
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int s = 0; s < 4; s++)
#pragma unroll
                for (int m = 0; m < 4; m++)
                    a[i][s][m] = wg_deq((ws[s] >> (4 * m)) & 15u, (ws[s] >> (4 * m + 16)) & 15u, (m & 1) ? f1 : f0);
        }
        /* B per n-tile: x[token][16 t .. 16 t + 15] of the block, k-steps 0..3 */
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint8_t *xr = st + (wt * 32 + j * 8 + g) * (WG_XS * 2) + t * 32;
            const uint4 p0 = *(const uint4 *)xr, p1 = *(const uint4 *)(xr + 16);
            const uint32_t b[4][2] = {{p0.x, p0.y}, {p0.z, p0.w}, {p1.x, p1.y}, {p1.z, p1.w}};
#pragma unroll
            for (int s = 0; s < 4; s++)
#pragma unroll
                for (int i = 0; i < 2; i++) wg_mma(acc[i][j], a[i][s], b[s][0], b[s][1]);
        }
    }
    wg_wait<0>();
    /* c0, c1: row g, tokens 2 t, 2 t + 1 of the n-tile; c2, c3: row g + 8 */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r0 = (rt0 + wr * 2 + i) * 16 + g;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = r0 + 8 * h;
            if (row >= rows) continue;
            const float bb = bias ? vec_load(bias, bias_f32, row) : 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int tok = t0 + wt * 32 + j * 8 + 2 * t;
                if (tok < n) y[(int64_t)tok * rows + row] = f2bf(acc[i][j][2 * h] + bb);
                if (tok + 1 < n) y[(int64_t)(tok + 1) * rows + row] = f2bf(acc[i][j][2 * h + 1] + bb);
            }
        }
    }
#endif
}

extern "C" bool fl_cuda_w4_gemm_takes(const void *x, int rows, int in, int group) {
    return ((uintptr_t)x & 15) == 0 && rows % 16 == 0 && in % 64 == 0 && group >= 64 && (group & (group - 1)) == 0 &&
           in % group == 0;
}

extern "C" fl_status fl_cuda_w4_gemm(fl_backend *b, const bf16 *x, int n, int in, int rows, const fl_tensor *w,
                                     const void *bias, int bias_f32, bf16 *y) {
    if (!fl_cuda_w4_gemm_takes(x, rows, in, w->group))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 gemm: [%d, %d] group %d (packed layout, 16-byte x)", rows, in,
                      w->group);
    if (n <= 0) return FL_OK;
    int gshift = 0;
    while ((64 << gshift) < w->group) gshift++;
    const dim3 grid((unsigned)((rows + WG_ROWS - 1) / WG_ROWS), (unsigned)((n + WG_TOK - 1) / WG_TOK));
    if (grid.y > 65535) return FL_ERR(FL_ERR_UNSUPPORTED, "cuda w4 gemm: %d tokens", n);
    return launch_pdl(w4_gemm_mma_kernel, grid, dim3(WG_THREADS), 0, cuda_impl(b)->stream, x, n, in, rows,
                      (const uint32_t *)w->data, (const __half2 *)w->scales, gshift, bias, bias_f32, y);
}
