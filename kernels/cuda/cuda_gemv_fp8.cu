/*
 * cuda_gemv_fp8.cu — the decode GEMV for FP8 linears (kernels/backend.h,
 * "FP8 linears"): y[n, rows] = sx[t] scale[r] sum_c xq[t, c] w[r, c]
 * (+ bias) for 1..16 tokens, w the row-major e4m3 codes [rows, in] as
 * uploaded (what cuBLASLt reads for prefill, so nothing is repacked), xq
 * the tokens' codes (xh) and sx their scales, written just before by
 * cuda_fp8.cu's fp8_quant_rows (its f16 form: each code's value as f16,
 * exact, so the hot loop converts only the weights).
 *
 * Why not cuBLASLt. At 1..16 tokens its e4m3 GEMMs stream the weights far
 * below the copy ceiling: a Llama-3-8B FP8 decode step at batch 1 took
 * 5.64 ms on an H100, 48.6 % of the ceiling and no faster than bf16.
 *
 * The bf16 GEMV's design (cuda_gemv_bf16.cu) on bytes. mma.m16n8k32 e4m3
 * lays its A fragment out byte for byte as mma.m16n8k16 bf16 does (PTX
 * ISA, "Matrix Fragments for mma.m16n8k32": register i of lane (g, t) holds
 * row g + 8 (i & 1), bytes 4 t .. + 3 of the k-step's 16-byte half i >> 1),
 * so the same ldmatrix.x4 of the same 16 rows x 32 bytes loads it, now 32
 * columns. But sm_90 has no FP8 mma.sync: ptxas turns each one into 12
 * e4m3x2 -> f16x2 conversions (A's 8, B's 4), two f16 HMMA.16816 into a
 * zeroed accumulator and 4 FADD into C. This kernel does that itself,
 * minus the waste: the 8 conversions of A (exact: every e4m3 value is an
 * f16), the low code pairs of A's four registers as the first
 * mma.m16n8k16 f16 and the high pairs as the second, each a relabelling
 * of 16 of the k-step's 32 columns (lane t's columns 4 t, 4 t + 1,
 * 16 + 4 t, 17 + 4 t, then the + 2's), accumulating straight into the f32
 * sums; B is x's f16 values at the same columns, one 8-byte load for
 * columns 4 t .. + 3 (both mma's first register) and one at 16 + 4 t
 * (their second), from L1 after the block's first warp. x comes in groups
 * of 4 columns with the tokens' groups side by side, so each of those
 * loads is 1-2 cache lines for the warp's 8 tokens (row-major, as the bf16
 * GEMV reads x: 8, one a token). Per 512 weight bytes: one ldmatrix and 8
 * conversions, then 2 loads and 2 mma a token tile. f32 accumulation of
 * exact products: the contract's sums, as the bf16 GEMV's and cuBLAS's.
 *
 * Work split. Block = one 16-row tile, ks warps = ks contiguous column
 * slices of it (whole chunks of FG_CK = 256 columns); each warp streams its
 * slice through its own ring of NS stages, 16 bulk copies (one a row, lanes
 * 0-15) a stage, rows FG_PITCH = 272 bytes apart so ldmatrix's rows fall in
 * distinct banks. in need only be a multiple of 16 (cuda_fp8.cu's upload
 * rule): a row's last chunk may be short, and its last k-step half (16
 * columns), whose other half of A and B is zeroed (the stage holds stale
 * bytes there, possibly NaN codes, and x's row ends). The ks partial sums
 * are added in shared memory in warp order, then (sx[t] scale[r]) times
 * the sum, + bias, rounded to bf16 once (the CPU's order).
 *
 * PDL: the first NS chunks are requested, and the row scales and bias
 * loaded, before griddepcontrol.wait (weights never depend on the previous
 * kernel); x and its scales after it. fp8_quant_rows is a PDL launch too,
 * so this kernel's weights stream while it quantizes. Needs sm_90 (bulk
 * copies); fl_cuda_fp8_gemv_takes says no elsewhere and the caller keeps
 * cuBLASLt.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "kernels/cuda/cuda_bulk.cuh"
#include "kernels/cuda/cuda_gemv_common.cuh"

#define FG_CK 256                 /* columns (bytes) a chunk (stage) */
#define FG_PITCH (FG_CK + 16)     /* bytes between a stage's rows */
#define FG_STAGE_B (16 * FG_PITCH) /* bytes a stage */
#define FG_MAX_KS 16              /* warps a block at most */
#define FG_NS 3                   /* stages a warp */

/* bytes of shared memory a warp: NS stages, then NS mbarriers in 32 bytes */
#define FG_WARP_B(NS) ((unsigned)(NS) * FG_STAGE_B + 32u)

#if FL_BULK_DEVICE_OK
/* The e4m3 codes 0, 1 of a register as an f16 pair (lo) and codes 2, 3
 * (hi), exact. In PTX so the high half is an operand selection, not a
 * shift (the intrinsic on r >> 16 got one). */
static __device__ __forceinline__ void fg_f16x2(uint32_t r, uint32_t &lo, uint32_t &hi) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(r));
}
static __device__ __forceinline__ void fg_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

/* NT: token tiles of 8 (1: up to 8 tokens, 2: up to 16); NS: stages.
 * w [rows, in] e4m3 codes (16-byte aligned), wsc [rows] its row scales,
 * xh the tokens' codes as f16 in column groups, [in / 4][n][4] (8-byte
 * aligned; fp8_quant_rows' F16 form), sx [n] their scales. */
template <int NT, int NS>
static __global__ void __launch_bounds__(512, 1)
    fp8_gemv_kernel(const uint8_t *__restrict__ w, const float *__restrict__ wsc, const __half *xh,
                    const float *sx, int n, int in, int rows, const void *bias, int bias_f32, bf16 *y) {
#if !FL_BULK_DEVICE_OK
#if defined(__CUDA_ARCH__)
    __trap(); /* bulk copies need sm_90; fl_cuda_fp8_gemv_takes refuses older devices */
#endif
#else
    static_assert(NS >= 2 && NS <= 4, "32 bytes of mbarriers a warp");
    static_assert(NT >= 1 && NT <= 2, "the epilogue's rows are a warp's for NT <= 2 tiles");
    constexpr unsigned warp_b = FG_WARP_B(NS);
    constexpr int CU = FG_CK / 16; /* 16-column units a chunk */
    extern __shared__ __align__(128) unsigned char smem[];
    const int ks = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int nu = in >> 4;                /* 16-column units of a row */
    const int nck = (nu + CU - 1) / CU;    /* chunks of a row, the last maybe short */
    const int c0 = (int)((int64_t)warp * nck / ks), nch = (int)((int64_t)(warp + 1) * nck / ks) - c0;
    const int row0 = blockIdx.x * 16;
    const uint8_t *wt = w + (size_t)row0 * in; /* this block's tile */
    unsigned char *wb = smem + warp * warp_b;
    uint64_t *bar = (uint64_t *)(wb + NS * FG_STAGE_B);

    if (FL_PDL_EARLY) pdl_trigger();
    bulk_ring_init<NS>(bar, lane);
    /* chunk ch of this warp into stage ch % NS: lane 0 arrives expecting the
     * 16 rows' bytes, then lanes 0-15 copy one row each */
    auto issue = [&](int ch) {
        const int s = ch % NS, u0 = (c0 + ch) * CU, cnt = min(CU, nu - u0);
        const unsigned rb = (unsigned)cnt * 16u;
        if (lane == 0) mbar_expect_tx(&bar[s], 16u * rb);
        __syncwarp();
        if (lane < 16) bulk_g2s(wb + s * FG_STAGE_B + lane * FG_PITCH, wt + (size_t)lane * in + u0 * 16, rb, &bar[s]);
    };
    for (int ch = 0; ch < NS && ch < nch; ch++) issue(ch);
    /* the epilogue's rows (lane l: rows l >> 2 and + 8 of every token tile),
     * their scales and bias: weights, so before the wait */
    const bool epi = warp < NT; /* warp w stores token tile w (ks >= NT), or warp 0 all of them */
    const int erow = row0 + g;
    float ws0 = 0.0f, ws8 = 0.0f, eb0 = 0.0f, eb8 = 0.0f;
    if (epi) {
        ws0 = wsc[erow], ws8 = wsc[erow + 8];
        if (bias) eb0 = vec_load(bias, bias_f32, erow), eb8 = vec_load(bias, bias_f32, erow + 8);
    }
    pdl_wait();
    if (!FL_PDL_EARLY) pdl_trigger();
    float es[NT][2]; /* the token scales of this lane's epilogue columns, early (L2) */
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int tok = nt * 8 + 2 * t4;
        es[nt][0] = epi ? sx[min(tok, n - 1)] : 0.0f;
        es[nt][1] = epi ? sx[min(tok + 1, n - 1)] : 0.0f;
    }

    /* this lane's x per token tile: token nt * 8 + g (padding columns repeat
     * the last token), column group t4 of a k-step; xh is [in / 4][n][4] */
    const __half *xl[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xl[nt] = xh + ((size_t)t4 * n + min(nt * 8 + g, n - 1)) * 4;
    float acc[2][NT][4]; /* the two mma of a k-step accumulate apart: half the dependent chain */
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) acc[h][nt][0] = acc[h][nt][1] = acc[h][nt][2] = acc[h][nt][3] = 0.0f;
    /* ldmatrix: lane l gives row l & 15, bytes 16 (l >> 4) .. + 15 of the k-step */
    const unsigned lrow = (unsigned)(lane & 15) * FG_PITCH + (unsigned)(lane >> 4) * 16u;

    for (int ch = 0; ch < nch; ch++) {
        const int s = ch % NS, u0 = (c0 + ch) * CU, cnt = min(CU, nu - u0);
        mbar_wait(&bar[s], (unsigned)(ch / NS) & 1u);
        const unsigned char *st = wb + s * FG_STAGE_B + lrow;
        /* k-step j (32 columns); half: only its first 16 (a row's last unit) */
        auto step = [&](int j, bool half) {
            uint32_t q[4], a0[4], a1[4];
            ldsm_x4(q, st + j * 32);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if (!half || i < 2) fg_f16x2(q[i], a0[i], a1[i]);
                else a0[i] = a1[i] = 0u; /* registers 2, 3: the k-step's second 16 columns */
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) { /* groups k / 4 + t4 (columns 4 t4 ..) and 4 further (16 + 4 t4 ..) */
                const __half *xp = xl[nt] + (size_t)(u0 * 16 + j * 32) * n;
                const uint2 lo = *(const uint2 *)xp, hi = half ? make_uint2(0u, 0u) : *(const uint2 *)(xp + 16 * n);
                fg_mma(acc[0][nt], a0, lo.x, hi.x);
                fg_mma(acc[1][nt], a1, lo.y, hi.y);
            }
        };
        if (cnt == CU) {
#pragma unroll
            for (int j = 0; j < CU / 2; j++) step(j, false);
        } else {
            for (int j = 0; j < cnt / 2; j++) step(j, false);
            if (cnt & 1) step(cnt / 2, true);
        }
        __syncwarp(); /* every lane is done with stage s */
        if (ch + NS < nch) {
            fence_proxy_async();
            issue(ch + NS);
        }
    }

    /* the warps' partial sums, each in its own (drained) ring */
    float4 *red = (float4 *)wb;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        red[nt * 32 + lane] = make_float4(acc[0][nt][0] + acc[1][nt][0], acc[0][nt][1] + acc[1][nt][1],
                                          acc[0][nt][2] + acc[1][nt][2], acc[0][nt][3] + acc[1][nt][3]);
    __syncthreads();
    if (!epi) return;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        if (nt != warp && ks >= NT) continue; /* warp nt stores tile nt; one warp stores both */
        const int idx = nt * 32 + lane, tok = nt * 8 + 2 * t4;
        float4 v = ((const float4 *)smem)[idx];
        for (int k = 1; k < ks; k++) {
            const float4 o = ((const float4 *)(smem + k * warp_b))[idx];
            v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
        }
        if (tok < n) {
            const size_t o0 = (size_t)tok * rows + erow;
            y[o0] = f2bf((es[nt][0] * ws0) * v.x + eb0);
            y[o0 + 8] = f2bf((es[nt][0] * ws8) * v.z + eb8);
            if (tok + 1 < n) {
                y[o0 + rows] = f2bf((es[nt][1] * ws0) * v.y + eb0);
                y[o0 + rows + 8] = f2bf((es[nt][1] * ws8) * v.w + eb8);
            }
        }
    }
#endif
}

/* Which matmuls it takes: the fp8_gemv override (0: none, cuBLASLt for
 * every FP8 matmul: the A/B; 1: 1..16 tokens, a second token tile), else
 * 1..8 tokens (9..16 unmeasured: the bf16 GEMV's second tile lost to
 * cuBLAS). Every weight height, unlike the bf16 GEMV's 14 tiles an SM: that
 * limit hands tall weights to cuBLAS, which streams them at 94-103 % of the
 * ceiling, while cuBLASLt's FP8 GEMMs left a whole Llama-3-8B step at 48.6 %
 * (no per-shape numbers yet: bench_kernels' fp8 modes give them). The copies
 * need rows of 16-byte aligned codes (in % 16, which the upload rule
 * fl_cuda_fp8_takes also asks) on a Hopper. */
static int fg_max_n(void) {
    const long m = fl_cuda_tune(FL_CUDA_TUNE_FP8_GEMV);
    return m == 0 ? 0 : m > 0 ? 16 : 8;
}

extern "C" bool fl_cuda_fp8_gemv_takes(fl_backend *b, int n, const fl_tensor *w) {
    return n >= 1 && n <= fg_max_n() && w->dtype == FL_DTYPE_F8_E4M3 && w->ndim == 2 && w->scales &&
           w->shape[0] > 0 && w->shape[0] % 16 == 0 && w->shape[1] > 0 && w->shape[1] % 16 == 0 &&
           w->shape[0] <= INT32_MAX && w->shape[1] <= INT32_MAX && ((uintptr_t)w->data & 15) == 0 &&
           fl_cuda_bulk_device_ok(cuda_impl(b));
}

/* The warps a block's tile gets (fl_gemv_ring_warps, the bf16 GEMV's rule). */
template <int NT>
static fl_status fg_warps(fl_cuda *c, int in, int64_t rows, int *ks_out) {
    static int occ[FG_MAX_KS + 1];
    return fl_gemv_ring_warps(c, (const void *)fp8_gemv_kernel<NT, FG_NS>, in, rows, FG_CK, FG_MAX_KS,
                              FG_WARP_B(FG_NS), occ, ks_out);
}

template <int NT>
static fl_status fg_launch(fl_cuda *c, const __half *xh, const float *sx, int n, int in, int rows, const uint8_t *w,
                           const float *wsc, const void *bias, int bias_f32, bf16 *y) {
    auto kern = fp8_gemv_kernel<NT, FG_NS>;
    constexpr unsigned warp_b = FG_WARP_B(FG_NS);
    static int attr_set;
    static size_t dyn_max; /* the opt-in less the kernel's static shared memory */
    FL_TRY(fl_gemv_smem_optin(c, kern, &attr_set, &dyn_max));
    int ks = 1;
    FL_TRY(fg_warps<NT>(c, in, rows, &ks));
    if ((size_t)ks * warp_b > dyn_max)
        return FL_ERR(FL_ERR_INTERNAL, "cuda fp8 gemv: %d warps of %u bytes exceed shared memory", ks, warp_b);
    return launch_pdl(kern, dim3((unsigned)(rows / 16)), dim3((unsigned)ks * 32), (size_t)ks * warp_b, c->stream, w,
                      wsc, xh, sx, n, in, rows, bias, bias_f32, y);
}

/* The caller checked fl_cuda_fp8_gemv_takes and quantized x into xh, sx. */
extern "C" fl_status fl_cuda_fp8_gemv(fl_backend *b, const void *xh, const float *sx, int n, const fl_tensor *w,
                                      const fl_tensor *bias, void *y) {
    fl_cuda *c = cuda_impl(b);
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    const void *bp = bias ? bias->data : NULL;
    const int bf32 = bias && bias->dtype == FL_DTYPE_F32;
    if (n < 1 || n > 16 || ((uintptr_t)xh & 7))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda fp8 gemv: %d tokens (1..16; ask fl_cuda_fp8_gemv_takes) or "
                      "x not 8-byte aligned", n);
    const uint8_t *wc = (const uint8_t *)w->data;
    const __half *xc = (const __half *)xh;
    if (n <= 8) return fg_launch<1>(c, xc, sx, n, in, rows, wc, w->scales, bp, bf32, (bf16 *)y);
    return fg_launch<2>(c, xc, sx, n, in, rows, wc, w->scales, bp, bf32, (bf16 *)y);
}
