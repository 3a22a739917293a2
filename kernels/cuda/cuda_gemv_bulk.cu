/*
 * cuda_gemv_bulk.cu — the decode W4 GEMV on the packed layout with the codes
 * streamed through shared memory by bulk copies (Hopper's cp.async.bulk,
 * completion counted by an mbarrier), y[n, rows] = x[n, in] @ W^T for 1..16
 * tokens a launch; and its gated-MLP form (DUAL: silu(x Wg^T) * (x Wu^T)).
 *
 * Why a third kernel. The register-ring GEMV (cuda_gemv.cu) tops out at
 * 55-65 % of the copy ceiling: Nsight Compute calls it latency-bound (0.46
 * eligible warps per scheduler, the top stall on global loads), because the
 * bytes a warp keeps in flight are bounded by its registers (R - 1 steps of
 * T x G2 x 16 bytes a lane), and deeper rings spill. Little's law on the
 * H200 wants ~32 KB in flight per SM at ~1 us loaded latency. Here the ring
 * is shared memory: one lane of each warp keeps NS stages of SU units (512
 * bytes each) per tile requested with one bulk copy per tile and stage, a
 * stage refilled once the warp has computed it, so while a warp computes one
 * stage the other NS - 1 (x TW x SU x 512 bytes) are in flight, for a
 * handful of instructions; the registers only hold the unit being computed.
 *
 * Work split. Block = one tile group (TW tiles of 16 rows: DUAL one gate
 * and one up tile of the same rows), ks warps = ks contiguous slices of the
 * columns (aligned to scale groups). A warp's codes are then TW contiguous
 * byte ranges (the layout is tile-major), streamed front to back by its own
 * ring (its own mbarriers: no block-wide barrier until the end); the ks
 * partial sums are added once in shared memory (aliasing the rings, which
 * are drained by then). Blocks of one tile balance the grid best (896 tiles
 * over 132 SMs load the busiest SM 3 % above the mean, blocks of two tiles
 * 18 %), but two tiles a warp share x and sum x, and measured faster: the
 * default is variant 4 (two tiles, see gvb_config).
 *
 * Arithmetic per unit is the register ring's (see cuda_gemv.cu): codes to
 * bf16 128 + c with one LOP3 (or, up to 8 tokens, bf16 denormals:
 * FL_W4_DENORM), mma.m16n8k16 against x fragments loaded
 * straight from global (L1), sum x from an mma against ones, scale and bias
 * applied once per group on the accumulated dot product. The stage's scales
 * (uint2 {scale, bias} of rows g, g + 8 per group) travel in the same stage.
 *
 * PDL: the first NS stages are requested before griddepcontrol.wait (the
 * weights never depend on the previous kernel); x and y after it.
 * Needs sm_90 (cp.async.bulk, mbarrier tx counts); fl_cuda_w4_bulk_takes says no on
 * older devices and the caller keeps the register-ring kernel.
 *
 * Measured: the stream alone (probe: no math) reads near the copy ceiling,
 * so the ring does its job; with the math the kernel is issue-latency bound
 * like the register ring (Nsight Compute: few instructions per scheduler
 * per cycle, ~50 instructions per unit). Full chunks without per-step
 * guards (the compiler interleaves the steps) made it beat the register
 * ring on gate|up+SiLU, wide outputs and q|k|v; the ring keeps long rows
 * (4096 x 14336). cuda_gemv.cu's gv_plain holds the
 * rule that picks between them. Split mma chains (IL) and x carried in the
 * stages (XS) were measured too and are kept as variants for the sweeps,
 * not used by default.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "kernels/cuda/cuda_bulk.cuh"
#include "kernels/cuda/cuda_gemv_common.cuh"

/* Per warp: NS stages of [TW][SU x 512 code bytes] then [TW][SU x 64 scale
 * bytes] (at most one group per unit), then (XS) the stage's x, one row of
 * SU x 128 bytes + 16 of padding (bank spread) per token; then NS mbarriers
 * in 32 bytes. */
/* ROUTED: a warp's partial sums, [TW][NT][32] float4, and (gvb_routed_b)
 * its slots of the current and next item's weights, [2][4] pointers */
template <int TW, int NT>
static __host__ __device__ constexpr unsigned gvb_red_b(void) { return TW * NT * 32u * 16u; }
template <int TW, int NT>
static __host__ __device__ constexpr unsigned gvb_routed_b(void) { return gvb_red_b<TW, NT>() + 64u; }

template <int TW, int SU, int NS, int XS>
struct gvb_sizes {
    static constexpr unsigned code_b = SU * 512u, sc_b = SU * 64u;
    static constexpr unsigned xrow_b = SU * 128u + 16u;
    static __host__ __device__ unsigned stage_b(int n) { return TW * (code_b + sc_b) + (XS ? n * xrow_b : 0u); }
    static __host__ __device__ unsigned warp_b(int n) { return NS * stage_b(n) + 32u; }
};

/* NT: token tiles of 8 (1: up to 8 tokens, 2: up to 16); G2: column blocks
 * per step (2 when a group spans two or more); TW: tiles a warp streams
 * side by side (sharing x and sum x; DUAL: gate tile, up tile); SU: units
 * per tile and stage; NS: stages; IL: independent mma chains per tile; XS:
 * x travels in the stages too (bulk copies issued after griddepcontrol.wait,
 * since the previous kernel writes x), so the math reads it from shared
 * memory instead of waiting on L2 (Nsight Compute: the x loads were the top
 * stall, long scoreboard, of both kernels). */
/* rs (producer) and rd (consumer) of a deferred norm (gv_resid, gv_rmsd):
 * both in the epilogue, so the main loop is the plain one; the producer's
 * norm weight and residual for its first epilogue item are loaded at the
 * start (gv_resid_pre), the consumer's partials prefetched into L1 after
 * the wait and summed once the sums are reduced. */
/* ROUTED (XS 0, no rope or deferred norm): the routed experts' items (see
 * gv_route; fl_cuda_w4_bulk_routed), block (x, y) computing tile group x
 * of items y, y + gridDim.y, ... back to back. A warp's column slice is the
 * same in every item, so its ring runs on from one item into the next: the
 * stages freed by the item's last chunks are refilled with the next item's
 * first ones (whose weights the block looked up at the item's start) while
 * the partial sums, kept apart from the ring, are added and stored. */
/* U16: full chunks past 8 tokens too (see the main loop and gvb_u16_fits;
 * the w4_bulk_unroll16 override). */
template <int NT, int G2, int TW, int SU, int NS, int IL, int XS, bool DUAL, bool ROUTED = false, bool U16 = false>
static __global__ void __launch_bounds__(512, 1)
    w4_bulk_kernel(const uint4 *__restrict__ codes, const uint2 *__restrict__ sb, const uint4 *__restrict__ codes2,
                   const uint2 *__restrict__ sb2, const bf16 *x, int n, int in, int gshift, const void *bias,
                   int bias_f32, bf16 *y, int rows, int probe, const gv_rope rope, const gv_resid rs,
                   const gv_rmsd rd, const gv_route rt) {
#if !FL_BULK_DEVICE_OK
#if defined(__CUDA_ARCH__)
    __trap(); /* bulk copies need sm_90; fl_cuda_w4_bulk_takes refuses older devices */
#endif
#else
    static_assert(NS >= 2 && NS <= 4, "32 bytes of mbarriers a warp");
    static_assert(!DUAL || TW == 2, "DUAL streams one gate and one up tile");
    static_assert(!ROUTED || !XS, "routed items read x from global");
    using S = gvb_sizes<TW, SU, NS, XS>;
    /* ROUTED: the warp's partial sums after its ring (red_off), which keeps
     * streaming while they are added; else they alias the drained ring */
    const unsigned stage_b = S::stage_b(n), red_off = ROUTED ? S::warp_b(n) : 0u;
    const unsigned warp_b = S::warp_b(n) + (ROUTED ? gvb_routed_b<TW, NT>() : 0u);
    constexpr int H = DUAL ? 1 : TW; /* output tiles of the block */
    extern __shared__ __align__(128) unsigned char smem[];
    const int ks = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int nkb = in >> 6, ngrp = nkb >> gshift;
    /* this warp's column blocks [u0, u1): slices aligned to G2 and to the
     * scale group, so every stage holds whole groups */
    const int align = max(G2, 1 << gshift), nal = nkb / align;
    const int u0 = (int)((int64_t)warp * nal / ks) * align, u1 = (int)((int64_t)(warp + 1) * nal / ks) * align;
    const int nch = (u1 - u0 + SU - 1) / SU;
    /* the block's tiles: tile0 + tt ts; rope pairs tiles ts = hd / 32 apart
     * (block b: head b / ts, tiles b % ts and b % ts + ts of it) */
    const int ts = !DUAL && TW == 2 && rope.cos ? rope.hd >> 5 : 1;
    const int tile0 = ts == 1 ? blockIdx.x * H : (blockIdx.x / ts) * (2 * ts) + blockIdx.x % ts;
    unsigned char *wb = smem + warp * warp_b;
    uint64_t *bar = (uint64_t *)(wb + NS * stage_b);

    __shared__ float sinv[16]; /* rd: 1 / rms a token */
    gv_resid_pre pre;          /* rs: this thread's first epilogue item, loaded early */
    const int pidx = threadIdx.x, prow = (tile0 + (pidx >> 5) / NT) * 16 + ((pidx & 31) >> 2);
    const int ptok = ((pidx >> 5) % NT) * 8 + 2 * (pidx & 3);
    const bool pre_on = !DUAL && rs.x && pidx < H * NT * 32;

    if (FL_PDL_EARLY) pdl_trigger();
    bulk_ring_init<NS>(bar, lane);
    if (pre_on) gv_resid_pre_w(rs, prow, pre); /* the norm weight never depends on the previous kernel */
    /* lane 0: request chunk ch (units u0 + ch SU ..) of every tile into
     * stage ch % NS. what: 1 the weights, 2 the x rows (XS), 3 both. The
     * stage's one arrival goes with the last part requested, so the phase
     * cannot complete before every part's bytes are counted. */
    /* chunk gch of the warp's stream (stage gch % NS) is chunk ch of the
     * weights c0 / s0 (DUAL: and c1 / s1): the item's own, past its end
     * (ROUTED) the next item's */
    auto issue = [&](int gch, int ch, int what, const uint4 *c0, const uint2 *s0, const uint4 *c1,
                     const uint2 *s1) {
        const int s = gch % NS, u = u0 + ch * SU, cnt = min(SU, u1 - u);
        const unsigned cbytes = (unsigned)cnt * 512u, sbytes = (unsigned)(cnt >> gshift) * 64u;
        const unsigned wbytes = (what & 1) ? TW * (cbytes + sbytes) : 0u;
        const unsigned xbytes = XS && (what & 2) ? (unsigned)n * cnt * 128u : 0u;
        if (XS && what == 1) mbar_expect_tx_only(&bar[s], wbytes);
        else mbar_expect_tx(&bar[s], wbytes + xbytes);
        unsigned char *st = wb + s * stage_b;
        if (what & 1) {
#pragma unroll
            for (int tt = 0; tt < TW; tt++) {
                const uint4 *cb = DUAL && tt == 1 ? c1 : c0;
                const uint2 *sbb = DUAL && tt == 1 ? s1 : s0;
                const size_t ti = (size_t)tile0 + (DUAL ? 0 : tt * ts);
                bulk_g2s(st + tt * S::code_b, cb + (ti * nkb + u) * 32, cbytes, &bar[s]);
                bulk_g2s(st + TW * S::code_b + tt * S::sc_b, sbb + (ti * ngrp + (u >> gshift)) * 8, sbytes,
                         &bar[s]);
            }
        }
        if (XS && (what & 2)) {
            for (int r = 0; r < n; r++)
                bulk_g2s(st + TW * (S::code_b + S::sc_b) + r * S::xrow_b, x + (size_t)r * in + u * 64, cnt * 128u,
                         &bar[s]);
        }
    };
    /* the weights of the first NS chunks before waiting for the previous
     * kernel (they never depend on it); x only after */
    if (!ROUTED && lane == 0) /* (routed: the weights come from the list, the previous kernel's output) */
        for (int ch = 0; ch < NS && ch < nch; ch++) issue(ch, ch, XS ? 1 : 3, codes, sb, codes2, sb2);
    pdl_wait();
    if (!FL_PDL_EARLY) pdl_trigger();
    if (XS && lane == 0)
        for (int ch = 0; ch < NS && ch < nch; ch++) issue(ch, ch, 2, codes, sb, codes2, sb2);
    if (pre_on) gv_resid_pre_x(rs, rows, prow, ptok, n, pre);
    if (rd.ss) gv_rmsd_prefetch(rd, n);

    /* ROUTED: the next item (expert it_j, first pair it_lo; it_j = n_local:
     * none); q: the block's items done; gbase: the warp's chunks of those
     * items, gi: the next chunk to request (lane 0). The weights of the
     * current and the next item are in the warp's shared slots wp[q & 1]
     * and wp[(q + 1) & 1] (codes, scales, DUAL: up codes, scales), which
     * only lane 0 reads: registers are the kernel's bound. Plain: one pass,
     * gbase 0. */
    int item = 0, it_j = 0, it_lo = 0, q = 0, gbase = 0, gi = 0;
    const int32_t *pairs = NULL;
    const void **wp = (const void **)(wb + red_off + gvb_red_b<TW, NT>()); /* [2][4] */
    auto next_item = [&]() { /* into slot (q + 1) & 1 */
        gv_next_item(rt, NT * 8, (int)blockIdx.y, (int)gridDim.y, it_j, it_lo, item);
        if (lane != 0 || it_j >= rt.n_local) return;
        const void **o = wp + ((q + 1) & 1) * 4;
        o[0] = rt.table[it_j].data;
        o[1] = rt.table[it_j].scales;
        if (DUAL && rt.table2) {
            o[2] = rt.table2[it_j].data;
            o[3] = rt.table2[it_j].scales;
        } else if (DUAL) { /* gate|up stacked: up from tile up_tile0 */
            o[2] = (const uint4 *)o[0] + (size_t)rt.up_tile0 * nkb * 32;
            o[3] = (const uint2 *)o[1] + (size_t)rt.up_tile0 * ngrp * 8;
        }
    };
    /* lane 0: the chunks up to NS ahead of the gdone consumed, this item's
     * then the next's */
    auto pump = [&](int gdone) {
        if (lane != 0) return;
        fence_proxy_async(); /* the stages' generic reads before the copies that refill them */
        for (; gi < gdone + NS; gi++) {
            int ch = gi - gbase;
            const void **w = wp + (q & 1) * 4;
            if (ch >= nch) {
                if (it_j >= rt.n_local || ch - nch >= nch) break;
                ch -= nch, w = wp + ((q + 1) & 1) * 4;
            }
            issue(gi, ch, 3, (const uint4 *)w[0], (const uint2 *)w[1], (const uint4 *)w[2], (const uint2 *)w[3]);
        }
    };
    if (ROUTED) {
        it_lo = rt.list[0];
        q = -1;
        next_item(); /* the first item, into slot 0 */
        q = 0;
        if (it_j >= rt.n_local) return; /* no item for this block row */
    }
  for (;;) {
    if (ROUTED) { /* the next item becomes this one */
        n = min(NT * 8, rt.list[it_j + 1] - it_lo);
        pairs = rt.list + rt.n_local + 1 + it_lo;
        item++;
        it_lo += NT * 8;
        next_item();
        pump(gbase);
    }
    const bf16 *xl[NT]; /* this lane's x row per token tile (padding columns repeat the last token) */
    int xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        xr[nt] = min(nt * 8 + g, n - 1);
        const int r = !ROUTED ? xr[nt] : rt.x_per_pair ? pairs[xr[nt]] : pairs[xr[nt]] / rt.k;
        xl[nt] = x + (size_t)r * in + t4 * 16;
    }
    const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    constexpr bool DN = gv_denorm<NT>(); /* the code decode (FL_W4_DENORM) */
    float acc[TW][NT][4];
#pragma unroll
    for (int tt = 0; tt < TW; tt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[tt][nt][i] = 0.0f;

    for (int ch = 0; ch < nch; ch++) {
        const int gch = gbase + ch, s = gch % NS, u = u0 + ch * SU, cnt = min(SU, u1 - u);
        mbar_wait(&bar[s], (unsigned)(gch / NS) & 1u);
        const unsigned char *st = wb + s * stage_b;
        auto step = [&](int j) { /* column blocks u + j G2 .. + G2 - 1 of the chunk */
            const int kb0 = u + j * G2;
            uint32_t xf[G2][NT][8];
#pragma unroll
            for (int v = 0; v < G2; v++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    if (XS) /* row min(nt 8 + g, n - 1) of the stage's x, this lane's 16 columns */
                        gv_load_x<DN>((const bf16 *)(st + TW * (S::code_b + S::sc_b) + xr[nt] * S::xrow_b) +
                                      (j * G2 + v) * 64 + t4 * 16,
                                  xf[v][nt]);
                    else
                        gv_load_x<DN>(xl[nt] + (kb0 + v) * 64, xf[v][nt]);
                }
            /* sum x over the step's columns, tokens 2 t4 and 2 t4 + 1 (cs[nt][0..1]);
             * IL independent mma chains (k-steps dealt round-robin), added after */
            float cs[NT][4], cz[IL][NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int l = 0; l < IL; l++) cz[l][nt][0] = cz[l][nt][1] = cz[l][nt][2] = cz[l][nt][3] = 0.0f;
#pragma unroll
                for (int v = 0; v < G2; v++)
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        gv_mma(cz[k % IL][nt], ones, xf[v][nt][2 * k], xf[v][nt][2 * k + 1]);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    cs[nt][i] = cz[0][nt][i];
#pragma unroll
                    for (int l = 1; l < IL; l++) cs[nt][i] += cz[l][nt][i];
                }
            }
#pragma unroll
            for (int tt = 0; tt < TW; tt++) {
                float c[NT][4], cc[IL][NT][4];
#pragma unroll
                for (int l = 0; l < IL; l++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) cc[l][nt][0] = cc[l][nt][1] = cc[l][nt][2] = cc[l][nt][3] = 0.0f;
#pragma unroll
                for (int v = 0; v < G2; v++) {
                    const uint4 q = *(const uint4 *)(st + tt * S::code_b + (j * G2 + v) * 512 + lane * 16);
                    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        uint32_t a[4];
                        gv_decode<DN>(w[k], a);
#pragma unroll
                        for (int nt = 0; nt < NT; nt++)
                            gv_mma(cc[k % IL][nt], a, xf[v][nt][2 * k], xf[v][nt][2 * k + 1]);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        c[nt][i] = cc[0][nt][i];
#pragma unroll
                        for (int l = 1; l < IL; l++) c[nt][i] += cc[l][nt][i];
                    }
                const uint2 ss =
                    *(const uint2 *)(st + TW * S::code_b + tt * S::sc_b + ((j * G2) >> gshift) * 64 + g * 8);
                gv_apply_group<NT, DN>(acc[tt], c, cs, ss);
            }
        };
        /* A full chunk without per-step guards, so the compiler can
         * interleave its steps' shared loads and decode (ILP: the warps are
         * few, ~3 a scheduler, and each waits ~10 cycles an instruction);
         * probe: the stream alone (bench_kernels). */
        if (probe) {
        } else if ((NT == 1 || U16) && cnt == SU) { /* (16 tokens: twice the registers; U16: see gvb_unroll16) */
#pragma unroll
            for (int j = 0; j < SU / G2; j++) step(j);
        } else {
#pragma unroll
            for (int j = 0; j < SU / G2; j++)
                if (j * G2 < cnt) step(j);
        }
        __syncwarp(); /* every lane is done with stage s */
        if (ROUTED) {
            pump(gch + 1);
        } else if (lane == 0 && ch + NS < nch) {
            fence_proxy_async();
            issue(ch + NS, ch + NS, 3, codes, sb, codes2, sb2);
        }
    }

    /* the warps' partial sums, each in its own (drained) ring, or (ROUTED)
     * after it */
    float4 *red = (float4 *)(wb + red_off);
#pragma unroll
    for (int tt = 0; tt < TW; tt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            red[(tt * NT + nt) * 32 + lane] =
                make_float4(acc[tt][nt][0], acc[tt][nt][1], acc[tt][nt][2], acc[tt][nt][3]);
    __syncthreads();
    auto warp_sum = [&](int i) {
        float4 v = ((const float4 *)(smem + red_off))[i];
        for (int k = 1; k < ks; k++) {
            const float4 o = ((const float4 *)(smem + red_off + k * warp_b))[i];
            v.x += o.x; v.y += o.y; v.z += o.z; v.w += o.w;
        }
        return v;
    };
    if (rd.ss) gv_rmsd_block(rd, n, in, sinv); /* 1 / rms of each token, the same in every block */
    auto scale = [&](float4 &v, int tok) {
        if (rd.ss) gv_rmsd_scale(sinv, n, tok, v);
    };
    if (!DUAL && TW == 2 && ts > 1) {
        /* rope epilogue: thread (lane l, token tile nt) holds rows g, g + 8 of
         * both tiles for tokens 2 t4, 2 t4 + 1; tile 1's rows are the rotation
         * partners (+ hd / 2) of tile 0's. What matmul then rope_kv_store
         * write: y = bf16(dot + bias), then rope_pair on q and k. */
        for (int idx = threadIdx.x; idx < NT * 32; idx += blockDim.x) {
            const int l = idx & 31, nt = idx >> 5;
            float4 va = warp_sum(idx), vb = warp_sum(idx + NT * 32);
            scale(va, nt * 8 + 2 * (l & 3));
            scale(vb, nt * 8 + 2 * (l & 3));
            const float a4[4] = {va.x, va.y, va.z, va.w}, b4[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
            for (int e = 0; e < 4; e++) { /* e: token 2 t4 + (e & 1), row g + 8 (e >> 1) */
                const int tok = nt * 8 + 2 * (l & 3) + (e & 1);
                if (tok < n)
                    gv_rope_store(rope, y, rows, tok, tile0 * 16 + (l >> 2) + 8 * (e >> 1), a4[e], b4[e], bias,
                                  bias_f32);
            }
        }
        return;
    }
    __shared__ float sq[H][16]; /* rs: the squares of a tile's rows per token */
    for (int idx = threadIdx.x; idx < H * NT * 32; idx += blockDim.x) {
        const int l = idx & 31, nt = (idx >> 5) % NT, tt = (idx >> 5) / NT;
        const int row = (tile0 + tt) * 16 + (l >> 2), tok = nt * 8 + 2 * (l & 3);
        float4 v = warp_sum(idx);
        scale(v, tok);
        if (DUAL) { /* piece 1 holds the up rows of the gate tile */
            float4 uq = warp_sum(idx + NT * 32);
            scale(uq, tok);
            v = make_float4(gv_glu(v.x, uq.x), gv_glu(v.y, uq.y), gv_glu(v.z, uq.z), gv_glu(v.w, uq.w));
        }
        if (!DUAL && rs.x) gv_resid_frag(rs, rows, row, tok, n, v, bias, bias_f32, sq[tt], pre, idx == pidx);
        else gv_store_frag(y, rows, row, tok, n, v, bias, bias_f32, pairs);
    }
    if (!DUAL && rs.x) gv_resid_block(rs, sq, H, n);
    if (!ROUTED || it_j >= rt.n_local) break;
    gbase += nch;
    q++;
    __syncthreads(); /* the partial sums' slots are the next item's */
  }
#endif
}

/* The instantiated stage shapes {TW, SU, NS, IL, XS}; DUAL takes the TW = 2
 * ones. Index + 1 is the variant number of fl_cuda_w4_bulk_launch's `variant`. */
static constexpr int gvb_variants[][5] = {{1, 8, 3, 1, 0}, {2, 4, 3, 1, 0}, {1, 4, 4, 1, 0}, {2, 4, 2, 1, 0},
                                          {1, 8, 2, 1, 0}, {1, 8, 3, 2, 0}, {2, 4, 3, 2, 0}, {2, 4, 3, 1, 1},
                                          {1, 4, 4, 1, 1}, {2, 4, 2, 1, 1}, {1, 8, 3, 1, 1}};
#define GVB_N_VARIANTS ((int)(sizeof gvb_variants / sizeof gvb_variants[0]))
#define GVB_DEFAULT 3 /* the auto configuration's stages (gvb_config) */

/* The instantiations that run 9..16 tokens with full chunks (U16): the
 * DUAL kernel of the default stages, 128 registers without spills (ptxas
 * -v, CUDA 13, sm_90a). The plain ones keep the per-step guards, as the
 * routed ones do: with full chunks their default stages spill and the
 * variant that fits (TW 1 x 4 units x 4 stages, 126 registers) measured
 * slower than the guarded loop, alone and end to end. */
template <int NT, int G2, int VI, bool DUAL>
static constexpr bool gvb_u16_fits(void) {
    return NT == 2 && G2 == 2 && VI == GVB_DEFAULT && DUAL;
}

/* The w4_bulk_unroll16 override (default on; 0 off): the instantiations
 * gvb_u16_fits names at 9..16 tokens, on because batch 16 measured faster
 * with them end to end. */
static bool gvb_unroll16(void) { return cuda_tune_on(FL_CUDA_TUNE_W4_BULK_UNROLL16); }

/* gy: item rows of a ROUTED grid (plain: 1) */
template <int NT, int G2, int TW, int SU, int NS, int IL, int XS, bool DUAL, bool ROUTED = false, bool U16 = false>
static fl_status gvb_run(fl_cuda *c, int ks, const gvb_args *a, int *bps, unsigned gy = 1) {
    static int attr_set, occ[GVB_MAX_KS + 1][17]; /* blocks an SM by warps and XS tokens */
    static size_t dyn_max;                       /* the opt-in less the kernel's static shared memory */
    auto kern = w4_bulk_kernel<NT, G2, TW, SU, NS, IL, XS, DUAL, ROUTED, U16>;
    const int nx = XS ? a->n : 0;
    const size_t smem = (size_t)ks * (gvb_sizes<TW, SU, NS, XS>::warp_b(nx) + (ROUTED ? gvb_routed_b<TW, NT>() : 0u));
    if (!attr_set) {
        cudaFuncAttributes fa;
        FL_CUDA_CHECK(cudaFuncGetAttributes(&fa, kern));
        dyn_max = c->smem_optin > fa.sharedSizeBytes ? c->smem_optin - fa.sharedSizeBytes : 0;
        FL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn_max));
        attr_set = 1;
    }
    if (smem > dyn_max)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 bulk gemv: %zu bytes of shared memory for %d warps", smem, ks);
    if (bps) {
        if (!occ[ks][nx]) {
            int b = 0;
            FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kern, ks * 32, smem));
            occ[ks][nx] = b < 1 ? 1 : b;
        }
        *bps = occ[ks][nx];
        return FL_OK;
    }
    const unsigned blocks = (unsigned)(a->rows / 16 / (DUAL ? 1 : TW));
    gv_resid rs = a->rs;
    rs.spad = (int)((blocks + 3) & ~3u); /* the slots of the producer's partials */
    return launch_pdl(kern, dim3(blocks, gy), dim3((unsigned)ks * 32), smem, c->stream, (const uint4 *)a->codes,
                      (const uint2 *)a->scales, (const uint4 *)a->codes2, (const uint2 *)a->scales2, a->x, a->n,
                      a->in, a->gshift, a->bias, a->bias_f32, a->y, a->rows, a->probe, a->rope, rs, a->rd, a->rt);
}

/* Variant VI (an index of gvb_variants), plain or DUAL, with full chunks
 * past 8 tokens where gvb_u16_fits and w4_bulk_unroll16 say so. */
template <int NT, int G2, int VI, bool D>
static fl_status gvb_run_v(fl_cuda *c, int ks, const gvb_args *a, int *bps) {
    constexpr int TW = gvb_variants[VI][0], SU = gvb_variants[VI][1], NS = gvb_variants[VI][2];
    constexpr int IL = gvb_variants[VI][3], XS = gvb_variants[VI][4];
    if constexpr (gvb_u16_fits<NT, G2, VI, D>())
        if (gvb_unroll16())
            return gvb_run<NT, G2, TW, SU, NS, IL, XS, D, false, true>(c, ks, a, bps);
    return gvb_run<NT, G2, TW, SU, NS, IL, XS, D>(c, ks, a, bps);
}

static fl_status gvb_dispatch(fl_cuda *c, int nt2, int g2, int v, int ks, bool dual,
                              const gvb_args *a, int *bps) {
#define GVB_CASE(NT, G2, VI, D)                                                                          \
    if ((nt2 ? 2 : 1) == NT && g2 == G2 && v == VI && dual == D)                                         \
        return gvb_run_v<NT, G2, VI, D>(c, ks, a, bps);
#define GVB_CASES(NT, G2)                                                                                \
    GVB_CASE(NT, G2, 0, false) GVB_CASE(NT, G2, 1, false) GVB_CASE(NT, G2, 2, false)                    \
    GVB_CASE(NT, G2, 3, false) GVB_CASE(NT, G2, 4, false) GVB_CASE(NT, G2, 5, false)                    \
    GVB_CASE(NT, G2, 6, false) GVB_CASE(NT, G2, 7, false) GVB_CASE(NT, G2, 8, false)                    \
    GVB_CASE(NT, G2, 9, false) GVB_CASE(NT, G2, 10, false) GVB_CASE(NT, G2, 1, true)                    \
    GVB_CASE(NT, G2, 3, true)                                                                            \
    GVB_CASE(NT, G2, 6, true) GVB_CASE(NT, G2, 7, true) GVB_CASE(NT, G2, 9, true)
    GVB_CASES(1, 1) GVB_CASES(1, 2) GVB_CASES(2, 1) GVB_CASES(2, 2)
#undef GVB_CASES
#undef GVB_CASE
    return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 bulk gemv: no kernel for variant %d%s", v + 1, dual ? " (dual)" : "");
}

/* Whether this build carries sm_90+ code: a build for older architectures
 * only would run the kernel's trap body on a Hopper (through the PTX JIT). */
static constexpr bool gvb_built_for_sm90(void) {
#ifdef __CUDA_ARCH_LIST__
    constexpr int archs[] = {__CUDA_ARCH_LIST__};
    for (int a : archs)
        if (a >= 900) return true;
    return false;
#else
    return true;
#endif
}

/* Whether the device has bulk copies (sm_90+) and the build has code for
 * them, asked once (cuda_bulk.cuh). */
extern "C" bool fl_cuda_bulk_device_ok(fl_cuda *c) {
    if (!gvb_built_for_sm90()) return false;
    static int ok = -1;
    if (ok < 0) {
        int major = 0;
        ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->device) == cudaSuccess &&
             major >= 9;
    }
    return ok == 1;
}

extern "C" bool fl_cuda_w4_bulk_takes(fl_cuda *c, int in, int group) {
    if (!fl_cuda_bulk_device_ok(c) || group < 64 || group > 256) return false; /* stages hold whole groups (SU >= 4) */
    return in % group == 0 && in % 64 == 0;
}

/* Auto configuration (bench_kernels --bulk and --glu on the H200): variant 4 (two tiles a warp sharing x, 4 units a stage, 2
 * stages; DUAL: the gate and up tile), the best or within 1 % of it on every
 * measured shape at 1 and 16 tokens; warps a block (column slices) so that
 * the one wave holds ~16 warps an SM (16 / blocks an SM: 2 for Llama's
 * 896-block gate|up, 4 for 14336 x 4096, 8 for q|k|v, 16 for 4096 x 4096,
 * each the measured best), at least 2 for DUAL (Qwen2-7B's 1184 blocks),
 * within the shared memory and the column slices there are. An odd tile
 * count takes variant 1 (one tile a warp). */
/* The warps an SM the auto rule aims the one wave at: 16, or the
 * w4_bulk_warps override (a measurement knob). (24, on a DUAL kernel with
 * its registers capped at 80 so they fit, measured slower end to end than
 * 16 at 104 registers.) 16 x 112 registers is 57K of an
 * SM's 64K, so a successor's block (attention: 256 threads x 64 registers)
 * cannot be resident beside a 16-warp block before it exits; fewer warps
 * trade the GEMV's own latency hiding for that overlap. */
static int gvb_warps_sm(void) {
    const long v = fl_cuda_tune(FL_CUDA_TUNE_W4_BULK_WARPS);
    return v >= 1 && v <= 32 ? (int)v : 16;
}

/* The configuration of a launch: variant index *v and warps *ks (variant,
 * ks: forced, 0 auto), and whether the grid is one wave of blocks. */
static fl_status gvb_config(fl_cuda *c, const gvb_args *a, int variant, int ks, int *v_out, int *ks_out,
                            bool *one_wave) {
    const bool dual = a->codes2 != NULL;
    const int nt2 = a->n > 8, g2 = (64 << a->gshift) >= 128 ? 2 : 1;
    const int ntile = a->rows / 16;
    int v = variant > 0 && variant <= GVB_N_VARIANTS ? variant - 1 : GVB_DEFAULT;
    if (dual && gvb_variants[v][0] != 2) v = 1;     /* DUAL streams a gate and an up tile */
    if (!dual && ntile % gvb_variants[v][0]) v = 0; /* an odd tile count: one tile a warp */
    const int h = dual ? 1 : gvb_variants[v][0];
    const int align = std::max(g2, 1 << a->gshift), nal = (a->in / 64) / align;
    if (gvb_variants[v][1] % align)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda w4 bulk gemv: group %d", 64 << a->gshift);
    const int max_ks = std::min(GVB_MAX_KS, nal);
    const int64_t blocks = ntile / h, bpsm = (blocks + c->n_sm - 1) / c->n_sm;
    if (ks <= 0) {
        ks = (int)std::max<int64_t>(dual ? 2 : 1, gvb_warps_sm() / bpsm);
        ks = std::min(ks, max_ks);
        for (; ks > 1; ks--) { /* the wave must fit: shared memory bounds the blocks an SM */
            int bps = 0;
            const fl_status e = gvb_dispatch(c, nt2, g2, v, ks, dual, a, &bps);
            if (e == FL_ERR_INVALID_ARG) fl_error_clear(); /* too wide for shared memory */
            else if (e != FL_OK) return e;                 /* a CUDA error: keep its message */
            else if (bps >= bpsm) break;
        }
    }
    ks = std::max(1, std::min(ks, max_ks));
    int bps = 0;
    for (; ks > 1; ks--) { /* a forced split too wide for shared memory: the widest that fits */
        const fl_status e = gvb_dispatch(c, nt2, g2, v, ks, dual, a, &bps);
        if (e == FL_OK) break;
        if (e != FL_ERR_INVALID_ARG) return e;
        fl_error_clear();
    }
    if (ks == 1) FL_TRY(gvb_dispatch(c, nt2, g2, v, ks, dual, a, &bps));
    *v_out = v;
    *ks_out = ks;
    *one_wave = bps >= bpsm;
    return FL_OK;
}

extern "C" fl_status fl_cuda_w4_bulk_launch(fl_cuda *c, const gvb_args *a, int variant, int ks, bool need_one_wave,
                                            int cfg_out[3]) {
    /* the preconditions gv_plain establishes, checked here too (a wrong call
     * would drop tokens or index past the occupancy cache) */
    if (a->n < 1 || a->n > 16 || a->rows % 16 || a->in % 64 || ((uintptr_t)a->x & 15))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 bulk gemv: n %d (1..16), rows %d, in %d or x misaligned", a->n,
                      a->rows, a->in);
    int v = 0;
    bool one = false;
    cfg_out[0] = cfg_out[1] = cfg_out[2] = 0;
    if (a->rs.x && (a->codes2 || a->rope.cos))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 bulk gemv: a residual epilogue with DUAL or rope");
    /* the configuration is the plain GEMV's (the same column slices, so the
     * same sums) */
    FL_TRY(gvb_config(c, a, variant, ks, &v, &ks, &one));
    if (need_one_wave && !(one && ks >= (a->codes2 ? 2 : 1))) return FL_OK;
    if (a->rope.cos && (a->codes2 || gvb_variants[v][0] != 2 || a->rope.hd < 64 || a->rope.hd % 32 ||
                        a->rows % a->rope.hd))
        return FL_OK; /* the rope epilogue pairs the two tiles of a warp */
    const int nt2 = a->n > 8, g2 = (64 << a->gshift) >= 128 ? 2 : 1;
    const bool dual = a->codes2 != NULL;
    const int64_t blocks = a->rows / 16 / (dual ? 1 : gvb_variants[v][0]);
    if (a->rs.x && blocks > FL_RMS_DEFER_SLOTS) return FL_OK;
    cfg_out[0] = v + 1, cfg_out[1] = ks, cfg_out[2] = (int)blocks;
    return a->dry ? FL_OK : gvb_dispatch(c, nt2, g2, v, ks, dual, a, NULL);
}

/* The routed instantiations: the default stages, DUAL or plain with two
 * tiles a warp, and plain with one (an odd tile count). */
static fl_status gvb_dispatch_routed(fl_cuda *c, int nt2, int g2, int v, int ks, bool dual, const gvb_args *a,
                                     int *bps, unsigned gy) {
#define GVB_RCASE(NT, G2, VI, D)                                                                         \
    if ((nt2 ? 2 : 1) == NT && g2 == G2 && v == VI && dual == D)                                         \
        return gvb_run<NT, G2, gvb_variants[VI][0], gvb_variants[VI][1], gvb_variants[VI][2],            \
                       gvb_variants[VI][3], gvb_variants[VI][4], D, true>(c, ks, a, bps, gy);
#define GVB_RCASES(NT, G2) GVB_RCASE(NT, G2, GVB_DEFAULT, true) GVB_RCASE(NT, G2, GVB_DEFAULT, false) \
    GVB_RCASE(NT, G2, 0, false)
    GVB_RCASES(1, 1) GVB_RCASES(1, 2) GVB_RCASES(2, 1) GVB_RCASES(2, 2)
#undef GVB_RCASES
#undef GVB_RCASE
    return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 bulk gemv: no routed kernel for variant %d", v + 1);
}

extern "C" fl_status fl_cuda_w4_bulk_routed(fl_cuda *c, const gvb_args *a, int active, int min_rows,
                                            int cfg_out[3]) {
    const gv_route &rt = a->rt;
    cfg_out[0] = cfg_out[1] = cfg_out[2] = 0;
    if (!rt.table || a->n < 1 || a->rows % 16 || a->in % 64 || ((uintptr_t)a->x & 15) || a->rope.cos || a->rs.x ||
        a->rd.ss || a->codes2)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda w4 bulk gemv (routed): n %d, rows %d, in %d, x misaligned or an "
                      "epilogue it does not have", a->n, a->rows, a->in);
    const bool dual = rt.table2 != NULL || rt.up_tile0 > 0;
    const int nt2 = a->n > 8, g2 = (64 << a->gshift) >= 128 ? 2 : 1, ntile = a->rows / 16;
    const int v = dual || ntile % 2 == 0 ? GVB_DEFAULT : 0;
    const int align = std::max(g2, 1 << a->gshift), nal = (a->in / 64) / align;
    if (gvb_variants[v][1] % align || nal < 1)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda w4 bulk gemv (routed): group %d, %d columns", 64 << a->gshift,
                      a->in);
    const int max_ks = std::min(GVB_MAX_KS, nal), W = gvb_warps_sm();
    const int64_t bx = ntile / (dual ? 1 : gvb_variants[v][0]);
    /* whether ks warps a block fit `need` blocks an SM (shared memory and
     * registers; the occupancy is cached per instantiation and ks) */
    auto fits = [&](int k, int64_t need, bool *ok) -> fl_status {
        int b = 0;
        const fl_status e = gvb_dispatch_routed(c, nt2, g2, v, k, dual, a, &b, 1);
        *ok = false;
        if (e == FL_ERR_INVALID_ARG) { /* too wide for shared memory */
            fl_error_clear();
            return FL_OK;
        }
        FL_TRY(e);
        *ok = b >= need;
        return FL_OK;
    };
    /* Item rows: at most min(k, n_local), the experts every token is sure
     * to bring (all of them at one token with every expert local); and one
     * when an expert's tile groups fill half a wave by themselves and there
     * is more than one token. Sized for `active` instead, a step whose
     * routing is skewed (the synthetic Mixtral's 16 tokens chose ~2 of 8
     * experts) left most rows idle: the down GEMV well below the register
     * ring under Nsight Compute, whose rows always run every item. */
    int gy = std::min(std::min(active, rt.k), rt.n_local), ks = 1;
    if (a->n > 1 && 2 * bx * max_ks >= (int64_t)W * c->n_sm) gy = 1;
    gy = gy < 1 ? 1 : gy > 65535 ? 65535 : gy;
    bool ok = false;
    for (;; gy--) {
        const int64_t bpsm = (bx * gy + c->n_sm - 1) / c->n_sm;
        if (bpsm <= W)
            for (ks = (int)std::min<int64_t>(max_ks, std::max<int64_t>(1, W / bpsm)); ks >= 1; ks--) {
                FL_TRY(fits(ks, bpsm, &ok));
                if (ok) break;
            }
        if (ok || gy == 1) break;
    }
    if (!ok) ks = 1; /* one expert's tiles are more than a wave: a warp a block, in waves */
    if (gy < min_rows) return FL_OK;
    cfg_out[0] = v + 1, cfg_out[1] = ks, cfg_out[2] = gy;
    return a->dry ? FL_OK : gvb_dispatch_routed(c, nt2, g2, v, ks, dual, a, NULL, (unsigned)gy);
}
