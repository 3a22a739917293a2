/*
 * cuda_gemv_bf16.cu — the decode GEMV for bf16 weights: y[n, rows] =
 * x[n, in] @ W^T (+ bias) for 1..8 tokens, W row-major [rows, in] as
 * uploaded (the layout cuBLAS reads for prefill, so nothing is repacked).
 *
 * Why not cuBLAS. At batch 1 cuBLAS runs a split-K GEMV and a reduce kernel
 * per matmul, and a decode step's profile shows those reduces as a large
 * share of its time on top of GEMVs near the copy ceiling. A bf16 GEMV has ~10x
 * fewer instructions per weight byte than the W4 one (no decode: one
 * ldmatrix and one mma per 512 bytes), so unlike that one it can be bound by
 * the memory side alone, where the W4 bulk kernel's stream measured 86-98 %
 * of the ceiling (its probe mode).
 *
 * Work split. Block = one 16-row tile, ks warps = ks contiguous column
 * slices of it (whole chunks of CK = 128 columns); each warp streams its
 * slice through its own ring of NS shared-memory stages, one chunk a stage:
 * 16 bulk copies (cp.async.bulk) of 256 bytes, one per row, issued by lanes
 * 0-15 and counted on the stage's mbarrier. Rows sit PITCH = 272 bytes apart
 * in shared memory, so ldmatrix's 8 row addresses of a matrix fall in
 * distinct banks. Per 16-column k-step: one ldmatrix.x4 (the A fragment of
 * mma.m16n8k16), x's B fragment from global (two 32-bit loads a lane, L1
 * after the first warp), one mma per 8 tokens; f32 accumulation. The ks
 * partial sums are added in shared memory at the end (aliasing the drained
 * rings), bias added, rounded to bf16 once.
 *
 * GLU form (gate_up_silu): a block holds the gate tile and the up tile of
 * the same 16 output rows, ks warps each, and its epilogue is silu_mul's
 * (gv_glu): one launch instead of the stacked gate|up GEMV and silu_mul.
 * Each tile keeps the K split the plain launch over the stacked weight
 * uses, so the result is bit for bit that GEMV + silu_mul.
 *
 * Deferred norm (fl_rms_defer, cuda_rmsdefer.cu; the epilogue only): rs
 * makes the plain form a producer (the residual add, h and the block's
 * partial sums of squares: gv_resid), rd makes either form a consumer
 * (each token's dot products scaled by 1 / rms: gv_rmsd).
 *
 * PDL: the first NS chunks are requested before griddepcontrol.wait (the
 * weights never depend on the previous kernel); x and y after it. Needs
 * sm_90 (bulk copies); fl_cuda_bf16_gemv_takes says no elsewhere and the
 * caller keeps cuBLAS.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "kernels/cuda/cuda_bulk.cuh"
#include "kernels/cuda/cuda_gemv_common.cuh"

#define BG_CK 128                     /* columns a chunk (stage) */
#define BG_PITCH (BG_CK * 2 + 16)     /* bytes between a stage's rows */
#define BG_STAGE_B (16 * BG_PITCH)    /* bytes a stage */
#define BG_MAX_KS 16                  /* warps a block at most */

/* bytes of shared memory a warp: NS stages, then NS mbarriers in 32 bytes */
#define BG_WARP_B(NS) ((unsigned)(NS) * BG_STAGE_B + 32u)

/* NT: token tiles of 8 (instantiated: 1, up to 8 tokens; 2 measured
 * issue-bound, see fl_cuda_bf16_gemv_takes); NS: stages. GLU: w is the gate
 * [rows, in], w2 the up weight of the same shape, y [n, rows] =
 * silu(x w^T) * (x w2^T); the block's warps are ks for the gate tile, then
 * ks for the up tile. */
template <int NT, int NS, bool GLU>
static __global__ void __launch_bounds__(512, 1)
    bf16_gemv_kernel(const bf16 *__restrict__ w, const bf16 *__restrict__ w2, const bf16 *x, int n, int in,
                     int rows, const void *bias, int bias_f32, bf16 *y, const gv_resid rs, const gv_rmsd rd) {
#if !FL_BULK_DEVICE_OK
#if defined(__CUDA_ARCH__)
    __trap(); /* bulk copies need sm_90; fl_cuda_bf16_gemv_takes refuses older devices */
#endif
#else
    static_assert(NS >= 2 && NS <= 4, "32 bytes of mbarriers a warp");
    constexpr unsigned warp_b = BG_WARP_B(NS);
    extern __shared__ __align__(128) unsigned char smem[];
    const int ks = (blockDim.x >> 5) / (GLU ? 2 : 1), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tt = GLU ? warp / ks : 0, sl = warp - tt * ks; /* tile (gate, up) and column slice */
    const int g = lane >> 2, t4 = lane & 3;
    const int nks = in >> 4;                       /* 16-column k-steps */
    const int nck = (nks + BG_CK / 16 - 1) / (BG_CK / 16); /* chunks of the row */
    const int c0 = (int)((int64_t)sl * nck / ks), nch = (int)((int64_t)(sl + 1) * nck / ks) - c0;
    const int row0 = blockIdx.x * 16;
    const bf16 *wt = (GLU && tt ? w2 : w) + (size_t)row0 * in; /* this warp's tile */
    unsigned char *wb = smem + warp * warp_b;
    uint64_t *bar = (uint64_t *)(wb + NS * BG_STAGE_B);

    __shared__ float sinv[16], sq[1][16]; /* rd: 1 / rms a token; rs: the tile's squares per token */
    gv_resid_pre pre; /* rs: lane l's epilogue item (warp 0), loaded early */
    const bool pre_on = !GLU && rs.x && threadIdx.x < NT * 32;
    const int prow = row0 + ((threadIdx.x & 31) >> 2), ptok = (int)(threadIdx.x >> 5) * 8 + 2 * (threadIdx.x & 3);

    if (FL_PDL_EARLY) pdl_trigger();
    bulk_ring_init<NS>(bar, lane);
    if (pre_on) gv_resid_pre_w(rs, prow, pre); /* the norm weight never depends on the previous kernel */
    /* chunk ch of this warp into stage ch % NS: lane 0 arrives expecting the
     * 16 rows' bytes, then lanes 0-15 copy one row each */
    auto issue = [&](int ch) {
        const int s = ch % NS, k0 = (c0 + ch) * (BG_CK / 16), cnt = min(BG_CK / 16, nks - k0);
        const unsigned rb = (unsigned)cnt * 32u;
        if (lane == 0) mbar_expect_tx(&bar[s], 16u * rb);
        __syncwarp();
        if (lane < 16)
            bulk_g2s(wb + s * BG_STAGE_B + lane * BG_PITCH, wt + (size_t)lane * in + k0 * 16, rb, &bar[s]);
    };
    for (int ch = 0; ch < NS && ch < nch; ch++) issue(ch);
    pdl_wait();
    if (!FL_PDL_EARLY) pdl_trigger();
    if (pre_on) gv_resid_pre_x(rs, rows, prow, ptok, n, pre);
    if (rd.ss) gv_rmsd_prefetch(rd, n);

    const bf16 *xl[NT]; /* this lane's x row per token tile (padding columns repeat the last token) */
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xl[nt] = x + (size_t)min(nt * 8 + g, n - 1) * in + 2 * t4;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    /* ldmatrix: lane l gives row l & 15, columns 8 (l >> 4) .. + 7 of the k-step */
    const unsigned lrow = (unsigned)(lane & 15) * BG_PITCH + (unsigned)(lane >> 4) * 16u;

    for (int ch = 0; ch < nch; ch++) {
        const int s = ch % NS, k0 = (c0 + ch) * (BG_CK / 16), cnt = min(BG_CK / 16, nks - k0);
        mbar_wait(&bar[s], (unsigned)(ch / NS) & 1u);
        const unsigned char *st = wb + s * BG_STAGE_B + lrow;
        auto step = [&](int j) {
            uint32_t a[4];
            ldsm_x4(a, st + j * 32);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const bf16 *xp = xl[nt] + (k0 + j) * 16;
                gv_mma(acc[nt], a, *(const uint32_t *)xp, *(const uint32_t *)(xp + 8));
            }
        };
        if (cnt == BG_CK / 16) {
#pragma unroll
            for (int j = 0; j < BG_CK / 16; j++) step(j);
        } else {
            for (int j = 0; j < cnt; j++) step(j);
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
    for (int nt = 0; nt < NT; nt++) red[nt * 32 + lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
    __syncthreads();
    if (rd.ss) gv_rmsd_block(rd, n, in, sinv); /* 1 / rms of each token, the same in every block */
    auto scale = [&](float4 &v, int tok) {
        if (rd.ss) gv_rmsd_scale(sinv, n, tok, v);
    };
    for (int idx = threadIdx.x; idx < NT * 32; idx += blockDim.x) {
        const int l = idx & 31, nt = idx >> 5;
        const int row = row0 + (l >> 2), tok = nt * 8 + 2 * (l & 3);
        float4 v = ((const float4 *)smem)[idx];
        for (int k = 1; k < ks; k++) {
            const float4 o = ((const float4 *)(smem + k * warp_b))[idx];
            v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
        }
        if (GLU) { /* the up tile's sum, in the same order; then silu_mul's arithmetic */
            float4 u = ((const float4 *)(smem + ks * warp_b))[idx];
            for (int k = 1; k < ks; k++) {
                const float4 o = ((const float4 *)(smem + (ks + k) * warp_b))[idx];
                u.x += o.x; u.y += o.y; u.z += o.z; u.w += o.w;
            }
            scale(u, tok);
            scale(v, tok);
            v = make_float4(gv_glu(v.x, u.x), gv_glu(v.y, u.y), gv_glu(v.z, u.z), gv_glu(v.w, u.w));
        } else {
            scale(v, tok);
        }
        if (!GLU && rs.x)
            gv_resid_frag(rs, rows, row, tok, n, v, bias, bias_f32, sq[0], pre, pre_on && idx == (int)threadIdx.x);
        else gv_store_frag(y, rows, row, tok, n, v, bias, bias_f32);
    }
    if (!GLU && rs.x) gv_resid_block(rs, sq, 1, n);
#endif
}

#define BG_NS 3

/* The most blocks an SM (16-row tiles over the SMs) a weight may have for
 * this kernel to take it: the bf16_gemv override (0 keeps cuBLAS for every
 * bf16 matmul: the A/B), else 14 (see fl_cuda_bf16_gemv_takes).
 * fl_cuda_bf16_gemv_force(on) overrides both for benchmarks and tests (1:
 * taken up to 64 blocks an SM, 0: never, -1: back to the rule). */
static int bg_forced = -1;
extern "C" void fl_cuda_bf16_gemv_force(int on) { bg_forced = on; }
static int bg_max_bpsm(void) {
    if (bg_forced >= 0) return bg_forced ? 64 : 0;
    const long m = fl_cuda_tune(FL_CUDA_TUNE_BF16_GEMV);
    return m < 0 ? 14 : m > 64 ? 64 : (int)m;
}

/* Which matmuls it takes (measured on the H200, bench_kernels, fc81d4a, %
 * of the copy ceiling, this kernel vs cuBLAS at 1 token: 1024 x 4096 48.4 vs
 * 12.5, 6144 x 4096 80.7 vs 69.5, 4096 x 14336 88.8 vs 83.6, 14336 x 4096
 * 85.9 vs 85.2, 28672 x 4096 91.2 vs 93.9; at 16 tokens 43-54 vs 71-93):
 * up to 8 tokens (one token tile: the second's x loads and mma made it
 * issue-bound), and grids of up to 14 blocks an SM: Llama-3-8B's 28672-row
 * gate|up (13.6 on 132 SMs, one-warp blocks) measured +2-3 % end to end
 * over cuBLAS (bf16 batch 1, 132e3eb: 228.5 -> 235.2 and 227.5 -> 231.8
 * tok/s; 8 was the default before). Taller weights (lm_head, Qwen2-7B's
 * 37888-row gate|up: 17.9) stay with cuBLAS, which streams them at
 * 94-103 %, where this kernel would leave a partial last wave. */
extern "C" bool fl_cuda_bf16_gemv_takes(fl_backend *b, const void *x, int n, const fl_tensor *w) {
    fl_cuda *c = cuda_impl(b);
    return n >= 1 && n <= 8 && w->dtype == FL_DTYPE_BF16 && w->ndim == 2 && w->shape[0] % 16 == 0 &&
           w->shape[0] / 16 <= bg_max_bpsm() * (int64_t)c->n_sm &&
           w->shape[1] % 16 == 0 && w->shape[0] <= INT32_MAX / 2 && ((uintptr_t)w->data & 15) == 0 &&
           ((uintptr_t)x & 3) == 0 && fl_cuda_bulk_device_ok(c);
}

/* The warps a block's tile gets (fl_gemv_ring_warps). GLU asks for the
 * stacked gate|up's (2 d rows) so each tile is split as the plain launch
 * splits it. */
template <int NT>
static fl_status bg_warps(fl_cuda *c, int in, int64_t rows, int *ks_out) {
    static int occ[BG_MAX_KS + 1];
    return fl_gemv_ring_warps(c, (const void *)bf16_gemv_kernel<NT, BG_NS, false>, in, rows, BG_CK, BG_MAX_KS,
                              BG_WARP_B(BG_NS), occ, ks_out);
}

/* rs (producer, plain form) and rd (consumer): a deferred norm's epilogue
 * (NULL: none); rs->spad is set here, the grid's blocks rounded up to 4. */
template <int NT, bool GLU>
static fl_status bg_launch(fl_cuda *c, const bf16 *x, int n, int in, int rows, const bf16 *w, const bf16 *w2,
                           const void *bias, int bias_f32, bf16 *y, const gv_resid *rs = NULL,
                           const gv_rmsd *rd = NULL) {
    auto kern = bf16_gemv_kernel<NT, BG_NS, GLU>;
    constexpr unsigned warp_b = BG_WARP_B(BG_NS);
    static int attr_set;
    static size_t dyn_max; /* the opt-in less the kernel's static shared memory */
    FL_TRY(fl_gemv_smem_optin(c, kern, &attr_set, &dyn_max));
    int ks = 1;
    FL_TRY(bg_warps<NT>(c, in, (int64_t)rows * (GLU ? 2 : 1), &ks));
    const int nw = ks * (GLU ? 2 : 1);
    if ((size_t)nw * warp_b > dyn_max)
        return FL_ERR(FL_ERR_INTERNAL, "cuda bf16 gemv: %d warps of %u bytes exceed shared memory", nw, warp_b);
    gv_resid r = rs ? *rs : gv_resid{NULL, NULL, NULL, 0, NULL, 0, NULL};
    r.spad = (rows / 16 + 3) & ~3;
    const gv_rmsd d = rd ? *rd : gv_rmsd_of(NULL);
    return launch_pdl(kern, dim3((unsigned)(rows / 16)), dim3((unsigned)nw * 32), (size_t)nw * warp_b, c->stream, w,
                      w2, x, n, in, rows, bias, bias_f32, y, r, d);
}

/* The caller checked fl_cuda_bf16_gemv_takes. */
extern "C" fl_status fl_cuda_bf16_gemv(fl_backend *b, const void *x, int n, const fl_tensor *w,
                                       const fl_tensor *bias, void *y) {
    fl_cuda *c = cuda_impl(b);
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    const void *bp = bias ? bias->data : NULL;
    const int bf32 = bias && bias->dtype == FL_DTYPE_F32;
    if (n < 1 || n > 8)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda bf16 gemv: %d tokens (1..8; ask fl_cuda_bf16_gemv_takes)", n);
    return bg_launch<1, false>(c, (const bf16 *)x, n, in, rows, (const bf16 *)w->data, NULL, bp, bf32, (bf16 *)y);
}

/* gate_up_silu for bf16 weights: taken where the plain GEMV would take the
 * stacked gate|up (or gate, up apart of the same shape). */
extern "C" int fl_cuda_bf16_gate_up_silu_max_n(fl_backend *b, const fl_tensor *gate, const fl_tensor *up) {
    if (gate->dtype != FL_DTYPE_BF16 || gate->ndim != 2) return 0;
    if (up && (up->dtype != FL_DTYPE_BF16 || up->ndim != 2 || up->shape[0] != gate->shape[0] ||
               up->shape[1] != gate->shape[1] || ((uintptr_t)up->data & 15)))
        return 0;
    const int64_t d = up ? gate->shape[0] : gate->shape[0] / 2;
    if (d % 16 || (!up && gate->shape[0] % 2)) return 0;
    fl_tensor st = *gate; /* the stacked shape decides, as for the plain launch */
    st.shape[0] = 2 * d;
    static const uint32_t x_aligned = 0; /* activation buffers are aligned */
    return fl_cuda_bf16_gemv_takes(b, &x_aligned, 1, &st) ? 8 : 0;
}

extern "C" fl_status fl_cuda_bf16_gate_up_silu(fl_backend *b, const void *x, int n, const fl_tensor *gate,
                                               const fl_tensor *up, void *out, const fl_rms_defer *rd) {
    if (n < 1 || n > fl_cuda_bf16_gate_up_silu_max_n(b, gate, up))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda bf16 gate_up_silu: %d tokens or these weights are not taken", n);
    const int d = (int)(up ? gate->shape[0] : gate->shape[0] / 2), in = (int)gate->shape[1];
    const bf16 *g = (const bf16 *)gate->data;
    const bf16 *u = up ? (const bf16 *)up->data : g + (size_t)d * in;
    const gv_rmsd r = gv_rmsd_of(rd);
    return bg_launch<1, true>(cuda_impl(b), (const bf16 *)x, n, in, d, g, u, NULL, 0, (bf16 *)out, NULL, &r);
}
