/*
 * cuda_gemv.cu — the decode W4 GEMV: y[n, rows] = x[n, in] @ W^T for 1..16
 * tokens a launch, on the packed W4 layout (see "W4 packed layout" in
 * cuda_matmul.cu: 512-byte units per (16-row tile, 64-column block), lane
 * l's 16 bytes of a unit are its mma.m16n8k16 A fragments for 4 k-steps;
 * scale/bias as half2 pairs of rows g and g + 8 per (tile, group)).
 *
 * Why a second kernel. Decode reads every weight byte once, so the kernel
 * must keep HBM busy (~4 MB in flight over the chip, ~32 KB an SM) while
 * issuing few instructions per byte. The first tensor-core GEMV
 * (w4_mma_kernel) measured 40-52 % of the copy ceiling and Nsight Compute
 * called it issue-bound (~115 instructions per 512 weight bytes at 25 %
 * occupancy: cp.async issue and address math, shared-memory reads back,
 * per-unit scaling, a sum-x mma per unit). This one:
 *  - loads codes straight into registers (16-byte ld.global.nc with
 *    L1::no_allocate: streamed once, x keeps L1), R steps ahead through a
 *    register ring whose slots are compile-time indices (unrolled by R),
 *    so no shared memory and no cp.async bookkeeping;
 *  - gives every warp a fixed share of the column blocks of the block's T
 *    row tiles (warp w takes steps w, w + nw, ...; a step is one scale group
 *    of G2 column blocks, G2 = 2 for groups >= 128): a step's x fragments and
 *    its sum x (one mma against ones per k-step) serve T tiles, and scale
 *    and bias are applied once per group on the accumulated dot product:
 *      sum_k x_k (c_k s + b) = s sum_k (128 + c_k) x_k + (b - 128 s) sum_k x_k
 *    where 128 + c is what one LOP3 makes of a code (bf16 0x4300 | c);
 *    up to 8 tokens the codes enter as bf16 denormals instead, against x
 *    2^64, with no 128 (FL_W4_DENORM, cuda_gemv_common.cuh);
 *  - one block per T tiles (no grid-stride loop), nw warps splitting K, the
 *    warps' partial sums added once in shared memory at the end;
 *  - programmatic dependent launch: the first R - 1 steps of weights are
 *    requested before griddepcontrol.wait (they never depend on the
 *    previous kernel); x and y only after it.
 * Per step of 4 units (T = 2, G2 = 2, batch 1) the SASS loop has ~207
 * instructions (64 LOP3 + 48 shifts of decode (16 shifts and 16 x
 * multiplies with FL_W4_DENORM), 16 + 8 HMMA, 20 FFMA, 10
 * loads, the rest address and loop): ~52 per 512-byte unit, against ~115
 * for the old kernel.
 *
 * Measured with bench_kernels --sweep, it beats the old kernel by a wide
 * margin in the configurations pick_config chooses (one wave of blocks);
 * multi-wave grids and R = 4 at T = 2 (128 registers, spills) are slower.
 * Nsight Compute shows a kernel bound by issue latency: few eligible warps
 * per scheduler, the top stall waiting on L1TEX (x comes from L2), SMs idle
 * in the ramp and tail of a lone launch. Hence two prefetches, built and measured
 * slower, alone and end to end, so off; only bench_kernels' sweep sets them
 * (fl_cuda_w4_gemv_tune):
 *  - pf > 0: the codes of block step i + pf requested into L2 with one
 *    bulk prefetch (cp.async.bulk.prefetch.L2) per tile when the registers
 *    load step i, and the first pf steps plus the block's scales before
 *    griddepcontrol.wait: more bytes in flight than the register ring
 *    holds, and a deeper overlap with the previous kernel's tail;
 *  - xpf: every x line a warp will read prefetched into L1 after the wait,
 *    so the per-step x loads stop waiting on L2.
 *
 * Tuning: fl_cuda_w4_gemv_tune() forces a configuration (T, warps per
 * block, ring depth R, pf, xpf) or the old kernel, for
 * bench/bench_kernels.cu's side by side comparison (scripts/gpu-gemv.sh);
 * by default pick_config chooses by shape and occupancy.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "kernels/cuda/cuda_gemv_common.cuh"

/* Forced configuration for measurements and tests (fl_cuda_w4_gemv_tune,
 * cuda_test_hooks.h). */
static int tune_kernel, tune_t, tune_nw, tune_r, tune_pf = -1, tune_xpf = -1;
extern "C" void fl_cuda_w4_gemv_tune(int kernel, int t, int nw, int r, int pf, int xpf) {
    tune_kernel = kernel;
    tune_t = t;
    tune_nw = nw;
    tune_r = r;
    tune_pf = pf;
    tune_xpf = xpf;
}
extern "C" int fl_cuda_w4_gemv_use_old(void) { return tune_kernel == 2; }
/* The configuration of the last launch (fl_cuda_w4_gemv_last). */
static int last_cfg[5];
extern "C" void fl_cuda_w4_gemv_last(int cfg[5]) {
    for (int i = 0; i < 5; i++) cfg[i] = last_cfg[i];
}

/* Codes and scales: read once, never written while the process runs, so
 * the non-coherent path is safe even under PDL; no L1 allocation so x
 * stays cached there. volatile keeps them in issue order (the prologue's
 * loads must go out before griddepcontrol.wait). */
static __device__ __forceinline__ uint4 ld_stream16(const uint4 *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
static __device__ __forceinline__ uint2 ld_stream8(const uint2 *p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

/* Bulk prefetch of `bytes` (multiple of 16, 16-byte aligned) into L2: one
 * instruction requests a whole step's codes of a tile, so the HBM side sees
 * pf steps more in flight than the registers hold. */
static __device__ __forceinline__ void gv_prefetch_l2(const void *p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}
static __device__ __forceinline__ void gv_prefetch_l1(const void *p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

/* NT: n8 token tiles (1: up to 8 tokens, 2: up to 16); T: row tiles per
 * block; G2: column blocks per step (2 needs group >= 128); R: ring depth
 * (steps of codes in registers; R - 1 in flight ahead of the one computed).
 * DUAL (the gated MLP's gate and up in one pass, gate_up_silu): the first
 * T / 2 tiles of a step are gate rows (codes, sb), the other T / 2 the same
 * rows of up (codes2, sb2); they share the step's x fragments and sum x,
 * and the block writes silu(gate) * up for its T / 2 tiles of rows. */
template <int NT, int T, int G2, int R, bool DUAL>
static __global__ void __launch_bounds__(512, 1)
    w4_gemv_kernel(const uint4 *__restrict__ codes, const uint2 *__restrict__ sb, const uint4 *__restrict__ codes2,
                   const uint2 *__restrict__ sb2, const bf16 *x, int n, int in, int rows, int gshift,
                   const void *bias, int bias_f32, bf16 *y, int pf, int xpf, const gv_route rt,
                   const gv_resid rs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap(); /* bf16 MMA needs sm_80+; the backend refuses older GPUs at init */
#else
    extern __shared__ __align__(16) float4 red[]; /* [nw][T][NT][32] partial sums */
    const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int nkb = in >> 6, ngrp = nkb >> gshift, nks = nkb / G2;
    constexpr int H = DUAL ? T / 2 : T; /* row tiles of the output per block */
    static_assert(!DUAL || T % 2 == 0, "DUAL takes tiles in gate/up pairs");
    const int tile0 = blockIdx.x * H;
    const int nsteps = warp < nks ? (nks - 1 - warp) / nw + 1 : 0;
    /* 32-bit element offsets: a weight has < 2^31 16-byte chunks (checked by
     * the launcher). Step i of this warp covers column blocks
     * kb0 = (warp + i nw) G2 .. + G2 - 1 of tiles tile0 .. tile0 + T - 1. */
    const unsigned tile_stride = (unsigned)nkb * 32u;
    const unsigned c0 = (unsigned)tile0 * tile_stride + (unsigned)(warp * G2) * 32u + lane;
    const unsigned c_step = (unsigned)(nw * G2) * 32u;
    const unsigned s0 = (unsigned)tile0 * (unsigned)ngrp * 8u + g;

    /* routed: the block's items (see gv_route); plain: one pass */
    const int32_t *pairs = NULL;
    int item = 0, it_j = 0, it_lo = 0; /* next item's index, expert and first pair */
    if (FL_PDL_EARLY) pdl_trigger();
    if (rt.table) {
        pdl_wait();
        pf = 0; /* the prologue below runs after the wait anyway */
        it_lo = rt.list[0];
    }
  for (;;) {
    if (rt.table) { /* advance to this block's next item */
        gv_next_item(rt, NT * 8, (int)blockIdx.y, (int)gridDim.y, it_j, it_lo, item);
        if (it_j >= rt.n_local) break;
        n = min(NT * 8, rt.list[it_j + 1] - it_lo);
        pairs = rt.list + rt.n_local + 1 + it_lo;
        codes = (const uint4 *)rt.table[it_j].data;
        sb = (const uint2 *)rt.table[it_j].scales;
        if (DUAL && rt.table2) {
            codes2 = (const uint4 *)rt.table2[it_j].data;
            sb2 = (const uint2 *)rt.table2[it_j].scales;
        } else if (DUAL) {
            codes2 = codes + (size_t)rt.up_tile0 * tile_stride;
            sb2 = sb + (size_t)rt.up_tile0 * ngrp * 8u;
        }
        item++;
        it_lo += NT * 8;
        /* the next item's first steps into L2 while this one runs, so its
         * ramp reads L2 rather than HBM (items run back to back) */
        if (rt.next_pf > 0 && threadIdx.x == 0) {
            int pj = it_j, plo = it_lo, pit = item;
            gv_next_item(rt, NT * 8, (int)blockIdx.y, (int)gridDim.y, pj, plo, pit);
            if (pj < rt.n_local) {
                const uint4 *nc = (const uint4 *)rt.table[pj].data;
                const uint2 *ns = (const uint2 *)rt.table[pj].scales;
                const unsigned units = (unsigned)min(nkb, rt.next_pf * nw * G2);
#pragma unroll
                for (int tt = 0; tt < T; tt++) {
                    gv_prefetch_l2(nc + (tile0 + tt) * tile_stride, units * 512u);
                    gv_prefetch_l2(ns + (unsigned)(tile0 + tt) * (unsigned)ngrp * 8u, ngrp * 64u);
                }
            }
        }
    }
    uint4 q[R][T][G2];
    uint2 sc[R][T];
    /* L2 prefetch of block step j: column blocks j nw G2 .. + nw G2 - 1 of
     * the block's T tiles, T contiguous ranges, issued by lane 0 of warp
     * j % nw (the bulk prefetch takes uniform operands, so the compiler
     * wraps it in a loop over active lanes: keep it to one lane, rarely). */
    const int nbsteps = (nks + nw - 1) / nw;
    auto prefetch = [&](int j) {
        if (lane == 0 && j < nbsteps && j % nw == warp) {
            const int kb = j * nw * G2, nb = min(nw * G2, nkb - kb);
#pragma unroll
            for (int tt = 0; tt < T; tt++)
                gv_prefetch_l2((DUAL && tt >= H ? codes2 : codes) + (tile0 + tt % H) * tile_stride + (unsigned)kb * 32u,
                               (unsigned)nb * 512u);
        }
    };
    auto load = [&](int i, uint4 (&qq)[T][G2], uint2 (&ss)[T]) {
        if (pf > 0) prefetch(i + pf);
        if (i < nsteps) {
            const unsigned co = c0 + (unsigned)i * c_step;
            const unsigned so = s0 + (unsigned)(((warp + i * nw) * G2) >> gshift) * 8u;
#pragma unroll
            for (int tt = 0; tt < T; tt++) {
                const uint4 *cb = DUAL && tt >= H ? codes2 : codes;
                const uint2 *sbb = DUAL && tt >= H ? sb2 : sb;
                const int ti = tt % H;
#pragma unroll
                for (int u = 0; u < G2; u++) qq[tt][u] = ld_stream16(cb + co + ti * tile_stride + u * 32);
                ss[tt] = ld_stream8(sbb + so + (unsigned)ti * (unsigned)ngrp * 8u);
            }
        }
    };
    /* before waiting for the previous kernel: the first R - 1 steps into
     * registers, the pf after them into L2 (weights never depend on it) */
    if (pf > 0) {
        for (int j = R - 1; j < pf; j++) prefetch(j); /* load(r) below prefetches r + pf */
        if (threadIdx.x == 0) /* the scales of the block's tiles: T contiguous rows */
            for (int tt = 0; tt < T; tt++)
                gv_prefetch_l2((DUAL && tt >= H ? sb2 : sb) + (unsigned)(tile0 + tt % H) * (unsigned)ngrp * 8u,
                               ngrp * 64u);
    }
    /* a deferred norm's producer: this thread's first epilogue item's norm
     * weight before the wait, its residual after (gv_resid_pre) */
    gv_resid_pre pre;
    const int pidx = threadIdx.x, prow = (tile0 + (pidx >> 5) / NT) * 16 + ((pidx & 31) >> 2);
    const int ptok = ((pidx >> 5) % NT) * 8 + 2 * (pidx & 3);
    const bool pre_on = !DUAL && rs.x && !rt.table && pidx < H * NT * 32;
    if (pre_on) gv_resid_pre_w(rs, prow, pre);
#pragma unroll
    for (int r = 0; r < R - 1; r++) load(r, q[r], sc[r]);
    pdl_wait();
    if (!FL_PDL_EARLY) pdl_trigger();
    if (pre_on) gv_resid_pre_x(rs, rows, prow, ptok, n, pre);

    const bf16 *xl[NT]; /* this lane's x row per token tile (padding columns repeat the last token) */
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int r = min(nt * 8 + g, n - 1);
        if (pairs) r = rt.x_per_pair ? pairs[r] : pairs[r] / rt.k;
        xl[nt] = x + (size_t)r * in + t4 * 16;
    }
    /* x: every line this warp will read, requested into L1 now, so the
     * per-step x loads hit L1 instead of waiting on L2 each step (codes do
     * not allocate in L1, so x stays). */
    if (xpf)
        for (int i = 0; i < nsteps; i++)
#pragma unroll
            for (int u = 0; u < G2; u++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) gv_prefetch_l1(xl[nt] + ((warp + i * nw) * G2 + u) * 64);
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    /* the code decode (FL_W4_DENORM); not in the gated form, which measured
     * slower with it (Qwen2-7B's gate|up at one token 29.2 vs 27.3 us,
     * bench_kernels --glu; the same registers, no spills either way) */
    constexpr bool DN = gv_denorm<NT>() && !DUAL;
    float acc[T][NT][4];
#pragma unroll
    for (int tt = 0; tt < T; tt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[tt][nt][i] = 0.0f;

    auto compute = [&](int i, const uint4 (&qq)[T][G2], const uint2 (&ss)[T]) {
        const int kb0 = (warp + i * nw) * G2;
        uint32_t xf[G2][NT][8];
#pragma unroll
        for (int u = 0; u < G2; u++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) gv_load_x<DN>(xl[nt] + (kb0 + u) * 64, xf[u][nt]);
        /* sum x over the step's columns, tokens 2 t4 and 2 t4 + 1 (cs[nt][0..1]) */
        float cs[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            cs[nt][0] = cs[nt][1] = cs[nt][2] = cs[nt][3] = 0.0f;
#pragma unroll
            for (int u = 0; u < G2; u++)
#pragma unroll
                for (int s = 0; s < 4; s++) gv_mma(cs[nt], ones, xf[u][nt][2 * s], xf[u][nt][2 * s + 1]);
        }
#pragma unroll
        for (int tt = 0; tt < T; tt++) {
            float c[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
#pragma unroll
            for (int u = 0; u < G2; u++) {
                const uint32_t w[4] = {qq[tt][u].x, qq[tt][u].y, qq[tt][u].z, qq[tt][u].w};
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    uint32_t a[4];
                    gv_decode<DN>(w[s], a);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) gv_mma(c[nt], a, xf[u][nt][2 * s], xf[u][nt][2 * s + 1]);
                }
            }
            gv_apply_group<NT, DN>(acc[tt], c, cs, ss[tt]);
        }
    };

    for (int i0 = 0; i0 < nsteps; i0 += R) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (i0 + r < nsteps) {
                load(i0 + r + R - 1, q[(r + R - 1) % R], sc[(r + R - 1) % R]);
                compute(i0 + r, q[r], sc[r]);
            }
        }
    }

    /* add the warps' shares; thread idx owns (tile tt, token tile nt, lane l) */
#pragma unroll
    for (int tt = 0; tt < T; tt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            red[((warp * T + tt) * NT + nt) * 32 + lane] =
                make_float4(acc[tt][nt][0], acc[tt][nt][1], acc[tt][nt][2], acc[tt][nt][3]);
    __syncthreads();
    auto warp_sum = [&](int i) {
        float4 v = red[i];
        for (int k = 1; k < nw; k++) {
            const float4 o = red[k * T * NT * 32 + i];
            v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
        }
        return v;
    };
    if (!DUAL && rs.x) { /* a deferred norm's producer (plain mode only, see gv_resid) */
        __shared__ float sq[T][16];
        for (int idx = threadIdx.x; idx < H * NT * 32; idx += blockDim.x) {
            const int l = idx & 31, nt = (idx >> 5) % NT, tt = (idx >> 5) / NT;
            gv_resid_frag(rs, rows, (tile0 + tt) * 16 + (l >> 2), nt * 8 + 2 * (l & 3), n, warp_sum(idx), bias,
                          bias_f32, sq[tt], pre, pre_on && idx == pidx);
        }
        gv_resid_block(rs, sq, H, n);
        break;
    }
    for (int idx = threadIdx.x; idx < H * NT * 32; idx += blockDim.x) {
        const int l = idx & 31, nt = (idx >> 5) % NT, tt = (idx >> 5) / NT;
        float4 v = warp_sum(idx);
        if (DUAL) { /* tile tt + H holds the up rows of gate tile tt */
            const float4 u = warp_sum(idx + H * NT * 32);
            v = make_float4(gv_glu(v.x, u.x), gv_glu(v.y, u.y), gv_glu(v.z, u.z), gv_glu(v.w, u.w));
        }
        const int row = (tile0 + tt) * 16 + (l >> 2), tok = nt * 8 + 2 * (l & 3);
        if (tok < n) {
            const float b0 = bias ? vec_load(bias, bias_f32, row) : 0.0f;
            const float b8 = bias ? vec_load(bias, bias_f32, row + 8) : 0.0f;
            const size_t o0 = pairs ? (size_t)pairs[tok] : (size_t)tok;
            y[o0 * rows + row] = f2bf(v.x + b0);
            y[o0 * rows + row + 8] = f2bf(v.z + b8);
            if (tok + 1 < n) {
                const size_t o1 = pairs ? (size_t)pairs[tok + 1] : (size_t)tok + 1;
                y[o1 * rows + row] = f2bf(v.y + b0);
                y[o1 * rows + row + 8] = f2bf(v.w + b8);
            }
        }
    }
    if (!rt.table) break;
    __syncthreads(); /* red is reused by the next item */
  }
#endif
}

#define GV_MAX_NW 16
#define GV_MAX_SMEM (GV_MAX_NW * 4 * 2 * 32 * 16) /* nw * T * NT * 32 float4: 64 KB */


/* One launch's arguments. */
typedef struct gv_args {
    const bf16 *x;
    int n, in, rows;
    const void *codes, *scales;
    const void *codes2, *scales2; /* dual: up (codes, scales: gate); else NULL */
    int gshift;
    const void *bias;
    int bias_f32;
    bf16 *y;
    int pf, xpf;
    gv_route rt;        /* routed experts (table NULL: a plain GEMV) */
    unsigned gy;        /* grid y: item rows of the routed mode (plain: 1) */
    gv_resid rs;        /* x NULL: none (a plain GEMV only) */
} gv_args;

/* With a == NULL: blocks per SM of this instantiation at nw warps (queried
 * once per nw and cached); otherwise the launch. The shared-memory limit is
 * raised once per instantiation. Races between host threads only redo the
 * same idempotent calls. */
template <int NT, int T, int G2, int R, bool DUAL>
static fl_status gv_run(fl_cuda *c, int nw, const gv_args *a, int *bps) {
    static int attr_set, occ[GV_MAX_NW + 1];
    auto kern = w4_gemv_kernel<NT, T, G2, R, DUAL>;
    const size_t smem = (size_t)nw * T * NT * 32 * sizeof(float4);
    if (!attr_set) {
        FL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, GV_MAX_SMEM));
        attr_set = 1;
    }
    if (!a) {
        if (!occ[nw]) {
            int b = 0;
            FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kern, nw * 32, smem));
            occ[nw] = b < 1 ? 1 : b;
        }
        *bps = occ[nw];
        return FL_OK;
    }
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    const unsigned blocks = (unsigned)(a->rows / 16 / (DUAL ? T / 2 : T));
    gv_resid rs = a->rs;
    rs.spad = (int)((blocks + 3) & ~3u); /* the slots of a producer's partials */
    cfg.gridDim = dim3(blocks, a->gy);
    cfg.blockDim = dim3((unsigned)nw * 32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = attr;
    cfg.numAttrs = fl_cuda_pdl_on() ? 1 : 0;
    FL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, (const uint4 *)a->codes, (const uint2 *)a->scales,
                                     (const uint4 *)a->codes2, (const uint2 *)a->scales2, a->x, a->n, a->in,
                                     a->rows, a->gshift, a->bias, a->bias_f32, a->y, a->pf, a->xpf, a->rt, rs));
    return FL_OK;
}

/* The instantiated (NT, G2, T, R, DUAL): the ring holds R x T x G2 x 4
 * code registers, so deeper rings go with fewer tiles; DUAL (T counts gate
 * and up tiles) at T = 2 and 4 with R = 2. */
static fl_status gv_dispatch(fl_cuda *c, int nt2, int g2, int t, int r, int nw, bool dual, const gv_args *a,
                             int *bps) {
#define GV_CASE(NT, G2, TT, RR, D)                                                                  \
    if ((nt2 ? 2 : 1) == NT && g2 == G2 && t == TT && r == RR && dual == D)                         \
        return gv_run<NT, TT, G2, RR, D>(c, nw, a, bps);
#define GV_CASES(NT, G2)                                                                            \
    GV_CASE(NT, G2, 1, 4, false) GV_CASE(NT, G2, 2, 2, false) GV_CASE(NT, G2, 2, 4, false)           \
    GV_CASE(NT, G2, 4, 2, false) GV_CASE(NT, G2, 2, 2, true) GV_CASE(NT, G2, 4, 2, true)
    GV_CASES(1, 1) GV_CASES(1, 2) GV_CASES(2, 1) GV_CASES(2, 2)
#undef GV_CASES
#undef GV_CASE
    return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 gemv: no kernel for T=%d R=%d%s", t, r, dual ? " (dual)" : "");
}

/* Ring depth by T: R = 4 at T = 2 measured slower than R = 2 (128 registers
 * with spills), and T = 1 wants the deeper ring to have the same bytes in
 * flight. */
static int gv_ring(int t) { return t == 1 ? 4 : 2; }

/* Default configuration by shape. Blocks all do the same work, so a grid
 * of more than one wave leaves a partial last wave and makes warps pay
 * their pipeline ramp twice: single-wave grids win (H200 measurements,
 * see docs/cuda.md). Among them, the most resident warps (up to 16 an SM),
 * steps of T G2 = 4 units preferred. Grids that cannot fit one wave (huge
 * matrices) score by how full their last wave is. On the H200 this picks
 * the measured best of the sweeps for 4096x14336 (T 1, 8 warps, R 4: the
 * long-row rule below), group 64 (T 4, 8 warps) and 1024x4096 (T 1, 16
 * warps), and for 14336x4096 T 2, 4 warps (T 4, 8 warps measured within
 * the spread of runs of it). mult:
 * the grid holds that many copies of the tiles (routed experts). dual:
 * the gate|up kernel (T counts gate and up tiles, T / 2 output tiles a
 * block): routed experts scored the same way (measured end to end:
 * Mixtral +5 %, Qwen3-30B-A3B +19 % over the three ops); a plain GEMV by
 * the rule below. */
static fl_status pick_config(fl_cuda *c, int ntile, int mult, int nks, int nt2, int g2, bool dual, bool routed,
                             int *t, int *nw, int *r) {
    /* dual also tries 2 warps: its T = 2 blocks carry one output tile, so
     * Llama's 14336-row gate|up needs 896 of them in one wave (7 an SM);
     * T = 4 with G2 = 2 spills (ptxas: 168 bytes at 128 registers) */
    static const int ts[] = {2, 1, 4}, nws[] = {16, 8, 4, 2};
    const int n_nws = dual ? 4 : 3;
    double best = -1;
    *t = dual ? 2 : 1;
    *nw = nks < 4 ? nks : 4;
    *r = dual ? 2 : gv_ring(1);
    if (dual && !routed) {
        /* T 2 (one gate and one up tile a step); warps by the sweep of
         * bench_kernels --glu, each choice within 1.5 points of the best
         * measured at 1 and at 16 tokens: 8 when the grid is under two
         * blocks an SM (DeepSeek-V2-Lite's 2816-row shared experts), 2 while
         * it fits one wave of 2-warp blocks (Llama's 14336 rows), else 4
         * (Qwen2-7B's 18944 rows, where the scoring below chose 16 and lost). */
        int bps2 = 1;
        FL_TRY(gv_dispatch(c, nt2, g2, 2, 2, 2, true, NULL, &bps2));
        const int64_t blocks = ntile;
        *nw = blocks < 2 * (int64_t)c->n_sm ? 8 : blocks <= (int64_t)bps2 * c->n_sm ? 2 : 4;
        if (*nw > nks) *nw = nks;
        return FL_OK;
    }
    for (int ti : ts) {
        const int h = dual ? ti / 2 : ti; /* output tiles a block */
        if (h < 1 || ntile % h) continue;
        for (int wi = 0; wi < n_nws; wi++) {
            const int w = nws[wi];
            if (w > nks) continue;
            int bps = 1;
            const int ri = dual ? 2 : gv_ring(ti);
            FL_TRY(gv_dispatch(c, nt2, g2, ti, ri, w, dual, NULL, &bps));
            const double blocks = (double)(ntile / h) * mult, cap = (double)bps * c->n_sm;
            /* steps of 4 units (T G2 = 4) carry the most bytes per x load and
             * sum-x mma without spilling: T = 2 for groups >= 128, T = 4 for
             * group 64 (measured: 63.6 % vs 42.8 % at T = 2, 14336x4096) */
            const int units = ti * g2;
            double tf = units == 4 ? 1.0 : units == 2 ? 0.8 : units == 8 ? 0.75 : 0.6;
            if (dual && units == 8) tf = 0.5; /* T 4, G2 2: spills (ptxas) */
            /* long rows (64+ steps a tile): one tile a block with the deeper
             * ring (R = 4) wins when it fits one wave (measured on 4096 x
             * 14336 against T 2, 16 warps, at 1 and 16 tokens) */
            if (ti == 1 && nks >= 64 && !dual) tf = 1.05;
            double score;
            if (blocks <= cap) {
                score = std::min(blocks * w / c->n_sm, 16.0) * tf;
            } else {
                const double waves = blocks / cap;
                score = 16.0 * tf * 0.7 * waves / ceil(waves);
            }
            if (score > best + 1e-9) {
                best = score;
                *t = ti;
                *nw = w;
                *r = ri;
            }
        }
    }
    return FL_OK;
}

/* Which kernel plain (not routed) packed W4 GEMVs take: the w4_gemv
 * override: -1 (the default: the rule in gv_plain), bulk (1: the bulk-copy
 * kernel, cuda_gemv_bulk.cu, wherever it runs), ring (0: this file's
 * kernel), dual (2: the bulk kernel for gate|up+SiLU only); with bulk,
 * w4_gemv_variant and w4_gemv_warps force the bulk kernel's variant and
 * warps a block on every launch (0 or -1: auto). */
static int gv_bulk_mode(void) {
    const long v = fl_cuda_tune(FL_CUDA_TUNE_W4_GEMV);
    return v >= 0 && v <= 2 ? (int)v : -1;
}
static int bulk_tuned(fl_cuda_tune_id id) {
    const long v = fl_cuda_tune(id);
    return gv_bulk_mode() == 1 && v > 0 ? (int)v : 0;
}
static int bulk_v(void) { return bulk_tuned(FL_CUDA_TUNE_W4_GEMV_VARIANT); }
static int bulk_ks(void) { return bulk_tuned(FL_CUDA_TUNE_W4_GEMV_WARPS); }

/* Records a bulk-kernel launch (bc: fl_cuda_w4_bulk_launch's cfg_out,
 * rope: its rope epilogue ran) for fl_cuda_w4_gemv_last. */
static void note_bulk(const int bc[3], int rope) {
    last_cfg[0] = -bc[0], last_cfg[1] = bc[1], last_cfg[2] = rope, last_cfg[3] = last_cfg[4] = 0;
}

/* Launches that took a deferred norm into their epilogue (tests ask). */
static long rms_defer_fused;
extern "C" long fl_cuda_rms_defer_fused(void) { return rms_defer_fused; }

/* y[n, rows] = x[n, in] @ W^T (+ bias) for a packed W4 weight (codes,
 * scales), or with codes2 (dual) y = silu(x @ W^T) * (x @ W2^T), in
 * launches of up to 16 tokens (each reads the weights once). A deferred
 * norm's producer (rs, n <= 16: one launch, either kernel; y unused) gets
 * its grid's blocks, the partials a token, in *slots; a consumer (rd) runs
 * only as the bulk kernel, *taken saying whether it was enqueued (if not,
 * nothing was: the caller scales x, then calls again without rd); dry (with
 * rd): only *taken, nothing enqueued. */
static fl_status gv_plain(fl_cuda *c, const bf16 *x, int n, int in, int rows, int group, const void *codes,
                          const void *scales, const void *codes2, const void *scales2, const void *bias,
                          int bias_f32, bf16 *y, const gv_resid *rs = NULL, int *slots = NULL,
                          const gv_rmsd *rd = NULL, bool *taken = NULL, bool dry = false) {
    const bool dual = codes2 != NULL;
    if (((uintptr_t)x & 15) != 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 gemv: x must be 16-byte aligned");
    if ((int64_t)rows * in / 32 >= ((int64_t)1 << 31))
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda w4 gemv: weight [%d, %d] exceeds 32-bit offsets", rows, in);
    if ((rs || rd) && (n > 16 || (rs && dual)))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 gemv: a deferred norm for %d tokens%s", n, dual ? " (dual)" : "");
    int gshift = 0;
    while ((64 << gshift) < group) gshift++;
    const int g2 = group >= 128 ? 2 : 1;
    const int ntile = rows / 16, nks = (in / 64) / g2;
    /* the chosen configuration per (dual, NT, G2) for the last shape: decode
     * calls the same few shapes over and over */
    static int memo_ntile[2][2][2], memo_nks[2][2][2], memo_cfg[2][2][2][3];
    /* The bulk-copy kernel by default for the gated MLP's fused gate|up and
     * for rows of up to 8192 columns; the register ring for longer rows
     * (measured with bench_kernels --bulk / --glu: the bulk kernel wins on
     * gate|up+SiLU, the wide-output shapes and q|k|v, ties on 4096 x 4096,
     * and loses on 4096 x 14336, whose 256 tiles make a wave of few warps
     * where the ring's deeper per-warp register pipeline wins). */
    const bool forced = tune_kernel == 3 || tune_kernel == 4;
    const int mode = gv_bulk_mode();
    const bool rule = dual || in <= 8192;
    const bool bulk_ok = tune_kernel == 0 || forced ? fl_cuda_w4_bulk_takes(c, in, group) : false;
    const bool explicit_bulk = forced || mode == 1 || (mode == 2 && dual);
    const gv_resid no_rs = {NULL, NULL, NULL, 0, NULL, 0, NULL};
    const gv_rmsd no_rd = gv_rmsd_of(NULL);
    if (rd) {
        *taken = false;
        if (!bulk_ok || !(explicit_bulk || (mode < 0 && rule))) return FL_OK;
        const gvb_args ba = {x, n, in, rows, codes, scales, codes2, scales2, gshift, bias, bias_f32, y,
                             tune_kernel == 4, {NULL, NULL, NULL, NULL, NULL, 0, 0, 0}, no_rs, *rd, dry, {}};
        int bc[3];
        FL_TRY(fl_cuda_w4_bulk_launch(c, &ba, forced ? tune_t : bulk_v(), forced ? tune_nw : bulk_ks(),
                                      !explicit_bulk, bc));
        *taken = bc[0] != 0;
        if (dry) return FL_OK;
        if (bc[0]) note_bulk(bc, 0);
        rms_defer_fused += *taken;
        return FL_OK;
    }
    for (int i0 = 0; i0 < n; i0 += 16) {
        const int nn = n - i0 < 16 ? n - i0 : 16;
        const int nt2 = nn > 8;
        const gvb_args ba = {x + (int64_t)i0 * in, nn, in, rows, codes, scales, codes2, scales2, gshift,
                             bias, bias_f32, y + (int64_t)i0 * rows, tune_kernel == 4,
                             {NULL, NULL, NULL, NULL, NULL, 0, 0, 0}, rs ? *rs : no_rs, no_rd, 0, {}};
        /* the rule's last condition: one wave (Qwen2-7B's 18944-row gate|up
         * needs 9 blocks an SM, the occupancy API grants fewer; as two waves
         * the model ran 479 -> 440 tok/s end to end with it on the bulk
         * kernel, though faster alone) */
        if (bulk_ok && (explicit_bulk || (mode < 0 && rule))) {
            int bc[3];
            FL_TRY(fl_cuda_w4_bulk_launch(c, &ba, forced ? tune_t : bulk_v(), forced ? tune_nw : bulk_ks(),
                                          !explicit_bulk, bc));
            if (bc[0]) { /* launched */
                note_bulk(bc, 0);
                if (rs) *slots = bc[2], rms_defer_fused++;
                continue;
            }
        }
        int t, nw, r;
        int *m = memo_cfg[dual][nt2][g2 - 1];
        if (memo_ntile[dual][nt2][g2 - 1] == ntile && memo_nks[dual][nt2][g2 - 1] == nks) {
            t = m[0], nw = m[1], r = m[2];
        } else {
            FL_TRY(pick_config(c, ntile, 1, nks, nt2, g2, dual, false, &t, &nw, &r));
            m[0] = t, m[1] = nw, m[2] = r;
            memo_ntile[dual][nt2][g2 - 1] = ntile;
            memo_nks[dual][nt2][g2 - 1] = nks;
        }
        /* w4_gemv_small_t and w4_gemv_small_warps (measurement knobs, both
         * set or neither): T tiles and W warps a block for plain GEMVs of at
         * most 8192 rows and short rows (the attention projections), for
         * A/Bs of the sweep's candidates */
        int small_t = (int)fl_cuda_tune(FL_CUDA_TUNE_W4_GEMV_SMALL_T);
        const int small_nw = (int)fl_cuda_tune(FL_CUDA_TUNE_W4_GEMV_SMALL_WARPS);
        if (!(small_t == 1 || small_t == 2 || small_t == 4) || small_nw < 1 || small_nw > GV_MAX_NW) small_t = 0;
        if (small_t && !dual && ntile <= 512 && nks < 64 && ntile % small_t == 0 && small_nw <= nks) {
            t = small_t;
            nw = small_nw;
            r = gv_ring(t);
        }
        if (tune_kernel == 1 && dual) {
            if (tune_t == 2 || (tune_t == 4 && ntile % 2 == 0)) t = tune_t;
            if (tune_nw) nw = tune_nw > nks ? nks : tune_nw > GV_MAX_NW ? GV_MAX_NW : tune_nw;
        } else if (tune_kernel == 1) {
            if (tune_t) t = tune_t;
            if (tune_nw) nw = tune_nw;
            if (tune_r) r = tune_r;
            if (ntile % t) t = ntile % 2 ? 1 : 2;
            if (ntile % t) t = 1;
            if (t == 1) r = 4;
            if (t == 4) r = 2;
            if (nw > nks) nw = nks;
            if (nw > GV_MAX_NW) nw = GV_MAX_NW;
        }
        gv_args a = {x + (int64_t)i0 * in, nn, in, rows, codes, scales, codes2, scales2, gshift, bias, bias_f32,
                     y + (int64_t)i0 * rows, tune_pf > 0 ? tune_pf : 0, tune_xpf > 0 ? tune_xpf : 0,
                     {NULL, NULL, 0, NULL, 0, 0, 0, 0}, 1, rs ? *rs : no_rs};
        if (rs && ntile / t > FL_RMS_DEFER_SLOTS)
            return FL_ERR(FL_ERR_UNSUPPORTED, "cuda w4 gemv: %d blocks of partials", ntile / t);
        FL_TRY(gv_dispatch(c, nt2, g2, t, r, nw, dual, &a, NULL));
        if (rs) *slots = ntile / t, rms_defer_fused++;
        last_cfg[0] = t, last_cfg[1] = nw, last_cfg[2] = r, last_cfg[3] = a.pf, last_cfg[4] = a.xpf;
    }
    return FL_OK;
}

/* The caller checked w4_packed(rows, in, group). */
extern "C" fl_status fl_cuda_w4_gemv(fl_backend *b, const bf16 *x, int n, int in, int rows, const fl_tensor *w,
                                     const void *bias, int bias_f32, bf16 *y) {
    return gv_plain(cuda_impl(b), x, n, in, rows, w->group, w->data, w->scales, NULL, NULL, bias, bias_f32, y);
}

/* A deferred norm's producer (matmul_add_rms, cuda_rmsdefer.cu): the GEMV's
 * residual epilogue, one launch (n <= 16); *slots: its partials a token. */
extern "C" fl_status fl_cuda_w4_gemv_resid(fl_backend *b, const bf16 *x, int n, int in, int rows,
                                           const fl_tensor *w, const void *bias, int bias_f32, const gv_resid *rs,
                                           int *slots) {
    return gv_plain(cuda_impl(b), x, n, in, rows, w->group, w->data, w->scales, NULL, NULL, bias, bias_f32, NULL,
                    rs, slots);
}

/* The rope_fuse override at 0 turns matmul_rope_kv off (the A/B against
 * matmul then rope_kv_store); else on. */
static bool rope_fuse_on(void) { return cuda_tune_on(FL_CUDA_TUNE_ROPE_FUSE); }

/* The largest n matmul_rope_kv fuses (0: none): packed W4 q|k|v weights on
 * a device the bulk kernel runs, rotation by halves over whole heads of a
 * multiple of 32 from 64 (the kernel's rope mode needs its two tiles apart:
 * head_dim / 32 > 1), at the token counts matmul sends to one GEMV launch.
 * bf16 weights: none (the bf16 GEMV's epilogue form of it, there only to
 * take a deferred norm, measured slower and was removed). */
extern "C" int fl_cuda_matmul_rope_kv_max_n(fl_backend *b, const fl_tensor *w, int head_dim, int rot_dim,
                                            bool interleaved) {
    /* an int8 cache: the epilogue stores bf16 rows, so matmul then rope_kv_store */
    if (b->kv_int8_head_dim > 0 || !rope_fuse_on() || interleaved || rot_dim != head_dim || w->dtype != FL_DTYPE_W4 || w->ndim != 2 ||
        head_dim < 64 || head_dim % 32 || w->shape[0] % head_dim ||
        !w4_packed(w->shape[0], w->shape[1], w->group) ||
        !fl_cuda_w4_bulk_takes(cuda_impl(b), (int)w->shape[1], w->group))
        return 0;
    const int deq = cuda_impl(b)->w4_deq_min_n - 1;
    return deq < 16 ? (deq > 0 ? deq : 0) : 16;
}

/* A consumer's partials as a producer left them (else: wrong norms, not an error). */
static fl_status rd_check(const fl_rms_defer *rd, const char *op) {
    if (rd && (!rd->ss || rd->slots < 1 || rd->slots > FL_RMS_DEFER_SLOTS))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: a deferred norm with %d partials a token (1..%d; run matmul_add_rms "
                      "first)", op, rd->slots, FL_RMS_DEFER_SLOTS);
    return FL_OK;
}

/* The bulk launch matmul_rope_kv makes (*ba) when its conditions hold
 * (false: matmul then rope_kv_store); rd (may be NULL) goes into it. */
static bool rope_kv_bulk_args(fl_backend *b, const void *x, int n, const fl_tensor *w, const fl_tensor *bias,
                              void *y, int n_heads, int n_kv_heads, int head_dim, const float *cos, const float *sin,
                              const int32_t *slots, void *k_cache, void *v_cache, const fl_rms_defer *rd,
                              gvb_args *ba) {
    const int64_t rows = w->shape[0];
    const int qd = n_heads * head_dim, kvd = n_kv_heads * head_dim;
    const bool ok_bias = !bias || ((bias->dtype == FL_DTYPE_F32 || bias->dtype == FL_DTYPE_BF16) &&
                                   fl_tensor_numel(bias) == rows);
    const int mode = gv_bulk_mode(), in = (int)w->shape[1];
    if (!(w->dtype == FL_DTYPE_W4 && n <= fl_cuda_matmul_rope_kv_max_n(b, w, head_dim, head_dim, false) && ok_bias &&
          tune_kernel == 0 &&
          ((uintptr_t)x & 15) == 0 && (mode == 1 || (mode < 0 && in <= 8192)) &&
          rows * in / 32 < ((int64_t)1 << 31))) /* gv_plain's 32-bit offset bound, so both paths agree */
        return false;
    int gshift = 0;
    while ((64 << gshift) < w->group) gshift++;
    const gv_rope rope = {cos, sin, slots, (bf16 *)k_cache, (bf16 *)v_cache, qd, kvd, head_dim};
    *ba = {(const bf16 *)x, n, in, (int)rows, w->data, w->scales, NULL, NULL, gshift, bias ? bias->data : NULL,
           bias && bias->dtype == FL_DTYPE_F32, (bf16 *)y, 0, rope, {NULL, NULL, NULL, 0, NULL, 0, NULL},
           {NULL, 0, 0, 0.0f}, 0, {}};
    ba->rd = gv_rmsd_of(rd); /* scaled in the epilogue */
    return true;
}

/* y = x @ w^T (+ bias), then rope_kv_store's work on y's [q | k | v] rows:
 * one bulk-kernel launch whose epilogue rotates and stores (the rope mode
 * of cuda_gemv_bulk.cu) when gv_plain would launch that kernel, in that
 * configuration, for this matmul (so the values are the same bits); else
 * matmul then rope_kv_store. */
extern "C" fl_status fl_cuda_matmul_rope_kv(fl_backend *b, const void *x, int n, const fl_tensor *w,
                                            const fl_tensor *bias, void *y, int n_heads, int n_kv_heads,
                                            int head_dim, const float *cos, const float *sin,
                                            const int32_t *slots, void *k_cache, void *v_cache,
                                            const fl_rms_defer *rd) {
    const int64_t rows = w->ndim == 2 ? w->shape[0] : 0;
    const int qd = n_heads * head_dim, kvd = n_kv_heads * head_dim;
    if (n_heads <= 0 || n_kv_heads <= 0 || rows != (int64_t)qd + 2 * kvd)
        return FL_ERR(FL_ERR_INVALID_ARG, "matmul_rope_kv: weight has %lld rows, %d q and %d kv heads of %d",
                      (long long)rows, n_heads, n_kv_heads, head_dim);
    if (n <= 0) return FL_OK;
    FL_TRY(rd_check(rd, "matmul_rope_kv"));
    fl_cuda *c = cuda_impl(b);
    const int in = (int)w->shape[1];
    const int stride = qd + 2 * kvd;
    const bool explicit_bulk = gv_bulk_mode() == 1;
    gvb_args ba;
    if (rope_kv_bulk_args(b, x, n, w, bias, y, n_heads, n_kv_heads, head_dim, cos, sin, slots, k_cache, v_cache, rd,
                          &ba)) {
        int bc[3];
        FL_TRY(fl_cuda_w4_bulk_launch(c, &ba, bulk_v(), bulk_ks(), !explicit_bulk, bc));
        if (bc[0]) {
            note_bulk(bc, 1);
            rms_defer_fused += rd != NULL;
            return FL_OK;
        }
        if (rd) { /* not taken: scaled first, then the same launch */
            FL_TRY(fl_cuda_rms_defer_apply(b, rd, n, in, (void *)x));
            ba.rd.ss = NULL;
            rd = NULL;
            FL_TRY(fl_cuda_w4_bulk_launch(c, &ba, bulk_v(), bulk_ks(), !explicit_bulk, bc));
            if (bc[0]) {
                note_bulk(bc, 1);
                return FL_OK;
            }
        }
    }
    if (rd) FL_TRY(fl_cuda_rms_defer_apply(b, rd, n, in, (void *)x));
    FL_TRY(fl_cuda_matmul(b, x, n, w, bias, y));
    return fl_cuda_rope_kv_store(b, y, (bf16 *)y + qd, (const bf16 *)y + qd + kvd, n, n_heads, n_kv_heads,
                                 head_dim, stride, stride, cos, sin, head_dim, false, slots, k_cache, v_cache);
}

/* Whether the fused gate|up + SiLU GEMV serves dense MLPs (which 1) or
 * routed experts (which 2). The glu_fuse override: a mask of the two, 0
 * neither (the A/B against matmul, matmul, silu_mul); -1 (the default) or
 * anything past 3: both. */
extern "C" int fl_cuda_glu_fuse_on(int which) {
    const long t = fl_cuda_tune(FL_CUDA_TUNE_GLU_FUSE);
    const int mask = t >= 0 && t <= 3 ? (int)t : 3;
    return (mask & which) && tune_kernel != 2;
}

/* The largest n gate_up_silu takes for these weights (0: none): packed W4
 * of one shape and group (up NULL: gate is the stacked [2 d, in] gate|up)
 * at the token counts matmul sends to this GEMV (the glu_fuse override at
 * 0: none). */
extern "C" int fl_cuda_gate_up_silu_max_n(fl_backend *b, const fl_tensor *gate, const fl_tensor *up) {
    if (!fl_cuda_glu_fuse_on(1)) return 0;
    if (gate->dtype == FL_DTYPE_BF16) return fl_cuda_bf16_gate_up_silu_max_n(b, gate, up);
    if (gate->dtype != FL_DTYPE_W4 || gate->ndim != 2) return 0;
    const int64_t rows = up ? gate->shape[0] : gate->shape[0] / 2, in = gate->shape[1];
    if (up && (up->dtype != FL_DTYPE_W4 || up->ndim != 2 || up->shape[0] != rows || up->shape[1] != in ||
               up->group != gate->group))
        return 0;
    if (!up && gate->shape[0] % 32) return 0;
    if (!w4_packed(rows, in, gate->group) || (up == NULL && !w4_packed(2 * rows, in, gate->group))) return 0;
    const int deq = cuda_impl(b)->w4_deq_min_n - 1;
    return deq < 255 ? (deq > 0 ? deq : 0) : 255;
}

/* out[n, d] = silu(x @ gate^T) * (x @ up^T), each product rounded to bf16
 * first: matmul, matmul, silu_mul in one pass over the weights (see DUAL).
 * up NULL: gate is the stacked gate|up weight, whose up rows start at tile
 * d / 16 of the packed layout. */
extern "C" fl_status fl_cuda_gate_up_silu(fl_backend *b, const void *x, int n, const fl_tensor *gate,
                                          const fl_tensor *up, void *out, const fl_rms_defer *rd) {
    if (n <= 0) return FL_OK;
    FL_TRY(rd_check(rd, "gate_up_silu"));
    const int in = (int)gate->shape[1];
    if (gate->dtype == FL_DTYPE_BF16 && fl_cuda_glu_fuse_on(1)) { /* rd scaled in its epilogue */
        if (rd) rms_defer_fused++;
        return fl_cuda_bf16_gate_up_silu(b, x, n, gate, up, out, rd);
    }
    if (n > fl_cuda_gate_up_silu_max_n(b, gate, up))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda gate_up_silu: %d tokens or these weights are not taken "
                      "(ask gate_up_silu_max_n)", n);
    const int d = (int)(up ? gate->shape[0] : gate->shape[0] / 2);
    const void *c2 = up ? up->data : (const void *)((const uint4 *)gate->data + (size_t)(d / 16) * (in / 64) * 32);
    const void *s2 = up ? up->scales
                        : (const void *)((const uint2 *)gate->scales + (size_t)(d / 16) * (in / gate->group) * 8);
    if (rd && n <= FL_RMS_DEFER_MAX_N) { /* scaled in the epilogue */
        const gv_rmsd g = gv_rmsd_of(rd);
        bool taken = false;
        FL_TRY(gv_plain(cuda_impl(b), (const bf16 *)x, n, in, d, gate->group, gate->data, gate->scales, c2, s2,
                        NULL, 0, (bf16 *)out, NULL, NULL, &g, &taken));
        if (taken) return FL_OK;
    }
    if (rd) FL_TRY(fl_cuda_rms_defer_apply(b, rd, n, in, (void *)x));
    return gv_plain(cuda_impl(b), (const bf16 *)x, n, in, d, gate->group, gate->data, gate->scales, c2, s2, NULL,
                    0, (bf16 *)out);
}

/* The most tokens a step defers its norms at (default 16; the rms_defer_n
 * override). While every consumer block added all the producer's partials
 * itself, deferring paid only at one token (each epilogue's extra work grew
 * with the tokens, a norm launch's cost does not); with the producer's
 * totals past one token (cuda_rmsdefer.cu, rms_final_on) it measured faster
 * up to 16 tokens. */
static int rms_defer_n(void) {
    const long v = fl_cuda_tune(FL_CUDA_TUNE_RMS_DEFER_N);
    return v < 0 ? 16 : v > FL_RMS_DEFER_MAX_N ? FL_RMS_DEFER_MAX_N : (int)v;
}

/* Whether op (FL_RMS_DEFER_GATE_UP: gate_up_silu of w, up; FL_RMS_DEFER_QKV:
 * matmul_rope_kv of w, head_dim) at n tokens would take a deferred norm in
 * its own kernel (the bulk W4 GEMV's epilogue, not the scaling launch
 * first), at token counts rms_defer_n allows. */
extern "C" bool fl_cuda_rms_defer_pays(fl_backend *b, int op, const fl_tensor *w, const fl_tensor *up, int n,
                                       int head_dim) {
    if (n < 1 || n > rms_defer_n()) return false;
    fl_cuda *c = cuda_impl(b);
    const fl_rms_defer rd = {NULL, 1, 0.0f}; /* the partials' address does not enter the decision */
    if (op == FL_RMS_DEFER_QKV) {
        if (w->ndim != 2 || head_dim < 1 || w->shape[0] % head_dim) return false;
        gvb_args ba;
        /* only the rope pairing (whole heads of the rows) enters the
         * decision, not the q / k / v split */
        if (!rope_kv_bulk_args(b, NULL, n, w, NULL, NULL, (int)(w->shape[0] / head_dim), 0, head_dim, NULL, NULL,
                               NULL, NULL, NULL, &rd, &ba))
            return false;
        ba.rope.cos = (const float *)&rd; /* not read: the launcher asks whether cos is set */
        ba.dry = 1;
        int bc[3];
        const bool ok = fl_cuda_w4_bulk_launch(c, &ba, bulk_v(), bulk_ks(), gv_bulk_mode() != 1, bc) == FL_OK;
        if (!ok) fl_error_clear();
        return ok && bc[0] != 0;
    }
    if (op != FL_RMS_DEFER_GATE_UP || w->dtype != FL_DTYPE_W4 || n > fl_cuda_gate_up_silu_max_n(b, w, up))
        return false;
    const int in = (int)w->shape[1], d = (int)(up ? w->shape[0] : w->shape[0] / 2);
    const gv_rmsd g = {NULL, 1, 4, 0.0f};
    bool taken = false;
    if (gv_plain(c, NULL, n, in, d, w->group, w->data, w->scales, w->data, w->scales, NULL, 0, NULL, NULL, NULL, &g,
                 &taken, true) != FL_OK) {
        fl_error_clear();
        return false;
    }
    return taken;
}

/* The moe_bulk override: which routed expert GEMVs take the bulk-copy
 * kernel (fl_cuda_w4_bulk_routed) where it runs: 0 none (the register
 * ring's routed mode below), 1 all, 2 the gate|up+SiLU pass only (DUAL),
 * auto (the default, 3): the rule in fl_cuda_w4_gemv_routed. */
static int moe_bulk_mode(void) {
    const long v = fl_cuda_tune(FL_CUDA_TUNE_MOE_BULK);
    return v >= 0 && v <= 2 ? (int)v : 3;
}

/* The routed experts' GEMV (moe_matmul for packed W4; see gv_route): one
 * launch for all local experts. The configuration is chosen as if
 * min(pairs, n_local) experts were active (decode: each active expert's
 * tiles are the work), then as many item rows (grid y) as fit one wave. */
/* table2 / up_tile0 (dual, moe_gate_up_silu): out = silu(gate) * up with the
 * gate experts in table and the up experts in table2, or stacked in table
 * with up from tile up_tile0; w0 then has the shape of one half. */
extern "C" fl_status fl_cuda_w4_gemv_routed(fl_backend *b, const bf16 *x, int x_per_pair, int n, int k,
                                            const int32_t *list, int n_local, const fl_tensor *table,
                                            const fl_tensor *table2, int up_tile0, const fl_tensor *w0,
                                            bf16 *y) {
    fl_cuda *c = cuda_impl(b);
    const bool dual = table2 != NULL || up_tile0 > 0;
    const int rows = (int)w0->shape[0], in = (int)w0->shape[1];
    if (((uintptr_t)x & 15) != 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda moe_matmul: x must be 16-byte aligned");
    if ((int64_t)rows * in / 32 >= ((int64_t)1 << 31))
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda moe_matmul: weight [%d, %d] exceeds 32-bit offsets", rows, in);
    int gshift = 0;
    while ((64 << gshift) < w0->group) gshift++;
    const int g2 = w0->group >= 128 ? 2 : 1;
    const int ntile = rows / 16, nks = (in / 64) / g2;
    const int nt2 = n > 8;
    const int64_t pairs = (int64_t)n * k;
    const int active = (int)(pairs < n_local ? pairs : n_local);
    const gv_route rt = {table, table2, up_tile0, list, n_local, k, x_per_pair, 0};
    const int mb = moe_bulk_mode();
    if ((tune_kernel == 3 || (tune_kernel == 0 && mb > 0 && (mb != 2 || dual))) &&
        fl_cuda_w4_bulk_takes(c, in, w0->group)) {
        gvb_args ba = {};
        ba.x = x, ba.n = n, ba.in = in, ba.rows = rows, ba.gshift = gshift, ba.y = y, ba.rt = rt;
        int bc[3];
        /* auto: each choice measured end to end against the ring (flotilla
         * bench w4): at one token the gate|up pass of experts of 1024+ rows
         * (Mixtral, DeepSeek-V2-Lite; Qwen3's 768-row experts lose); past
         * one token both passes where the grid has several item rows
         * (Qwen3-30B-A3B), not where one row walks every item (Mixtral,
         * DeepSeek-V2-Lite). */
        const bool forced = tune_kernel == 3 || mb != 3;
        if (forced || n > 1 || (dual && rows >= 1024)) {
            /* past one token (auto): launched only with two item rows or more */
            FL_TRY(fl_cuda_w4_bulk_routed(c, &ba, active, forced || n == 1 ? 1 : 2, bc));
            if (bc[0]) {
                last_cfg[0] = -bc[0], last_cfg[1] = bc[1], last_cfg[2] = 0, last_cfg[3] = bc[2], last_cfg[4] = 0;
                return FL_OK;
            }
        }
    }
    /* The plain GEMV's configuration for one expert when its tiles already
     * fill half a wave or more (Mixtral: the items then run back to back in
     * each block; measured on the H200, choosing for 2 active experts made
     * the 14336 x 4096 gate 38 % of the copy ceiling against 59 % for
     * per-expert launches), else one chosen for the active experts' tiles
     * together (Qwen3's 768-row experts: 10.4 % against 5.7 %). */
    int t, nw, r, bps = 1;
    FL_TRY(pick_config(c, ntile, 1, nks, nt2, g2, dual, true, &t, &nw, &r));
    FL_TRY(gv_dispatch(c, nt2, g2, t, r, nw, dual, NULL, &bps));
    if (2 * (int64_t)(ntile / (dual ? t / 2 : t)) < (int64_t)bps * c->n_sm && active > 1) {
        FL_TRY(pick_config(c, ntile, active, nks, nt2, g2, dual, true, &t, &nw, &r));
        FL_TRY(gv_dispatch(c, nt2, g2, t, r, nw, dual, NULL, &bps));
    }
    /* item rows: as many as one wave holds beside the tiles, at most the
     * active experts */
    const int blocks_x = ntile / (dual ? t / 2 : t);
    int gy = (int)((int64_t)bps * c->n_sm / blocks_x);
    gy = gy < 1 ? 1 : gy > active ? active : gy;
    /* the next item's L2 prefetch (gv_route.next_pf) only from
     * bench_kernels' sweep: +4 % at Mixtral batch 16 but -40 % on Qwen3's
     * small experts (bench_kernels --moe), so off in the product */
    const int xpf = tune_xpf > 0 ? tune_xpf : 0;
    gv_args a = {x, n, in, rows, NULL, NULL, NULL, NULL, gshift, NULL, 0, y, 0, xpf,
                 {table, table2, up_tile0, list, n_local, k, x_per_pair, dual ? 0 : tune_pf > 0 ? tune_pf : 0},
                 (unsigned)gy, {NULL, NULL, NULL, 0, NULL, 0, NULL}};
    FL_TRY(gv_dispatch(c, nt2, g2, t, r, nw, dual, &a, NULL));
    last_cfg[0] = t, last_cfg[1] = nw, last_cfg[2] = r, last_cfg[3] = 0, last_cfg[4] = xpf;
    return FL_OK;
}
