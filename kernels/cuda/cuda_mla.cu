/*
 * cuda_mla.cu — DeepSeek-V2 multi-head latent attention (the backend's
 * mla_attention op) over the bf16 paged cache, in the absorbed form of the
 * CPU reference (kernels/cpu/cpu_attention.c, fl_cpu_mla_attention): the
 * cache keeps one latent record per token, [c (kv_lora) | k_pe (rope)],
 * split over the K and V arrays (rec/2 elements each), and no per-head key
 * or value is ever materialized.
 *
 * Three launches per call (per window of rows, see below), f32 sums:
 *  1. mla_qlat_kernel, block = (head, 16 query rows, 64 latent columns):
 *     q_lat = W_uk,h^T q_nope (W_uk,h read once per 16 rows), written with
 *     the rotated q_pe as one f32 vector [kv_lora + rope] per (row, head),
 *     pre-multiplied by the softmax scale, into the workspace.
 *  2. the attention in latent space, block = (head group, sequence,
 *     context split x row tile): up to 16 query slots (row, head) of one
 *     sequence (decode: the 16 heads of its row) share each cached record,
 *     read once into shared memory per tile of 32 positions; online softmax
 *     per slot (lane = position, a warp per 2 slots); the latent
 *     accumulators [16 slots x kv_lora] are updated from the same tile.
 *     Two kernels: mla_attn_mma_kernel (default) does both products on the
 *     tensor cores (mma.m16n8k16, the 16 slots as M), mla_attn_kernel
 *     (the mla_kernel override simt, and shapes the mma one does not take) on the
 *     CUDA cores. Decode splits the context over blocks (flash-decoding)
 *     when the grid would otherwise not fill the GPU twice; each split
 *     writes (m, l, acc) and kernel 3 merges them. Without a split the
 *     block writes acc / l in place of its q_lat (it is its only reader).
 *  3. mla_out_kernel, block = (head, 16 rows, 16 outputs): merges the
 *     splits, then out = W_uv,h acc, bf16.
 *
 * An int8 or e4m3 cache (kernels/backend.h, kv_int8_head_dim: each half
 * record its codes, then an f32 scale per kv_int8_head_dim values) is read
 * as it is stored: a tile's codes are widened (code x scale, rounded to
 * bf16) into the same shared-memory tile a bf16 cache's records are copied
 * to, so both attention kernels run unchanged behind the load.
 *
 * wkv_b is the weight as upload_weight left it: bf16, or W4 in either
 * device layout (see cuda_common.cuh); W4 elements are dequantized in the
 * two projection kernels, two adjacent columns per load (same byte, or the
 * same 32-bit word of a packed unit).
 *
 * Graph safety: context lengths, query counts and block tables are read
 * from the device meta; grids depend on n_seqs, max_q_len and max_ctx_len
 * only. The f32 workspace (q_lat, split partials) belongs to the backend:
 * ops cannot allocate per call and the backend state (cuda_common.cuh) is
 * not this file's, so the shared registry (cuda_workspace.h, slot MLA) keeps one buffer per backend,
 * grown (never shrunk) on an eager call; the buffer a captured graph
 * recorded is never freed or moved (growth keeps the old buffer alive),
 * and a capture that would need growth fails instead of allocating.
 * Rows are processed in windows whose workspace fits a fixed budget
 * (64 MiB), so a long prefill does not need a workspace proportional to
 * its length; rows outside a launch's window exit at once.
 *
 * Not done (see docs/cuda.md, "MLA"): cp.async double buffering of the
 * record tiles (a tile's loads are one round trip the block waits for),
 * a cheaper split merge, kv_lora above 512, nope above 256.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_workspace.h"

#define MLA_THREADS 256
#define MLA_WARPS (MLA_THREADS / 32)
#define MLA_MAXQ 16       /* query slots (row, head) per attention block: 2 per warp */
#define MLA_TT 32         /* positions per tile: one per lane in the score phase */
#define MLA_MAX_LORA 512  /* 2 latent dims per thread */
#define MLA_MAX_ROPE 128
#define MLA_MAX_NOPE 256
#define MLA_RT 16         /* rows per projection block */
#define MLA_MIN_CHUNK 64  /* positions per context split, at least */
#define MLA_MAX_SPLITS 128
#define MLA_WS_BUDGET ((size_t)64 << 20)
#define MLA_DEFAULT_MMA 1 /* tensor-core attention kernel by default (mla_kernel=simt: CUDA cores) */

/* The projection weight as the kernels read it. */
typedef struct mla_w {
    const void *data;   /* bf16 [rows, cols], or W4 codes */
    const __half2 *sb;  /* W4: {scale, bias} per (row, group) in the layout's order */
    int w4, packed;
    int cols, group, gpr, nkb;
} mla_w;

/* Elements (r, k) and (r, k + 1) of the weight, k even. */
static __device__ __forceinline__ float2 w_pair(const mla_w &w, int r, int k) {
    if (!w.w4) {
        const __nv_bfloat162 v = ((const __nv_bfloat162 *)w.data)[((int64_t)r * w.cols + k) >> 1];
        return __bfloat1622float2(v);
    }
    const int gi = k / w.group; /* k and k + 1 share a group: groups are even */
    int c0, c1;
    float2 f;
    if (!w.packed) {
        const uint8_t byte = ((const uint8_t *)w.data)[(int64_t)r * (w.cols >> 1) + (k >> 1)];
        c0 = byte & 15;
        c1 = byte >> 4;
        f = __half22float2(w.sb[(int64_t)r * w.gpr + gi]);
    } else {
        /* "W4 packed layout" (cuda_matmul.cu): unit (tile, kb) of 128 words;
         * word 4 (4 g + t) + s holds nibble i = hi + 2 b1 + 4 b0 of row
         * 16 tile + g + 8 hi, column 64 kb + 16 t + 4 s + 2 b1 + b0. */
        const int tile = r >> 4, g = r & 7, hi = (r >> 3) & 1;
        const int kb = k >> 6, kk = k & 63, t = kk >> 4, s = (kk >> 2) & 3, b1 = (kk >> 1) & 1;
        const uint32_t word =
            ((const uint32_t *)w.data)[((int64_t)tile * w.nkb + kb) * 128 + (4 * g + t) * 4 + s];
        const int i0 = hi + 2 * b1;
        c0 = (int)(word >> (4 * i0)) & 15;
        c1 = (int)(word >> (4 * (i0 + 4))) & 15;
        f = __half22float2(w.sb[(((int64_t)tile * w.gpr + gi) * 8 + g) * 2 + hi]);
    }
    return make_float2(fmaf((float)c0, f.x, f.y), fmaf((float)c1, f.x, f.y));
}

static __device__ __forceinline__ float2 bf2_word(uint32_t u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u));
}

/* cp.async helpers: a tile's record copies are all issued before the block
 * waits, so a tile costs one memory round trip (plain loads with the
 * stores in between cost one per 16-byte chunk a thread copies: measured
 * ~9 us per tile on the H200 at 4a4dbfd). A src_size of 0 zero-fills. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
static __device__ __forceinline__ void cp_async4(void *dst, const void *src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
static __device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}
/* end of cp.async helpers */

/* The records of positions [t0, t0 + nt) (zeros past nt: the cache may hold
 * anything there, and 0 x NaN would poison the accumulators) into sr, row
 * stride rsw words, half % 8 == 0: 16-byte copies where rsw % 4 == 0, else
 * 4-byte ones. sslot[MLA_TT] holds the tile's cache slots (filled by the
 * caller before a barrier). The caller waits (cp_async_wait_all) and syncs. */
static __device__ __forceinline__ void load_tile_async(uint32_t *sr, int rsw, int half, int nt,
                                                       const int *sslot, const bf16 *kc, const bf16 *vc) {
    const int cps = half >> 3, cpr = 2 * cps;
    for (int e = threadIdx.x; e < MLA_TT * cpr; e += MLA_THREADS) {
        const int t = e / cpr, c = e - t * cpr;
        const bool ok = t < nt;
        const bf16 *src = kc;
        if (ok) {
            const int64_t base = (int64_t)sslot[t] * half;
            src = c < cps ? kc + base + 8 * c : vc + base + 8 * (c - cps);
        }
        uint32_t *d = sr + t * rsw + 4 * c;
        if ((rsw & 3) == 0) {
            cp_async16(d, src, ok);
        } else {
#pragma unroll
            for (int u = 0; u < 4; u++) cp_async4(d + u, (const uint32_t *)src + u, ok);
        }
    }
}

/* The tile's cache slots (threads 0..MLA_TT-1; positions past nt: 0, unused). */
static __device__ __forceinline__ void tile_slots(int *sslot, const int32_t *bt, int block_size, int t0, int nt) {
    const int t = threadIdx.x;
    if (t < MLA_TT) {
        const int ta = t0 + t;
        sslot[t] = t < nt ? bt[ta / block_size] * block_size + ta % block_size : 0;
    }
}

/* --- 1. q_lat -------------------------------------------------------------------
 * qw[row - w0, h] = scale * [W_uk,h^T q_nope | q_pe] for rows [w0, w1).
 * Block = (head, 16 rows, 64 columns of kv_lora): lane l owns columns
 * 2 l, 2 l + 1 of the chunk, warp w the w-th eighth of the nope rows of
 * W_uk,h; the 8 warps' partial sums are added in shared memory (in a fixed
 * order: deterministic). Decode thus gets heads x kv_lora / 64 blocks. */
#define MLA_QCOLS 64
static __global__ void __launch_bounds__(MLA_THREADS)
    mla_qlat_kernel(const bf16 *__restrict__ q, const int32_t *__restrict__ q_start, int n_seqs, int w0,
                    int w1, int n_heads, int nope, int rope, int kvb, int kv_lora, float scale, mla_w w,
                    float *__restrict__ qw) {
    extern __shared__ float sq[]; /* [MLA_RT][nope] | red [MLA_WARPS][MLA_RT][MLA_QCOLS] */
    pdl_enter(); /* before any global access: see launch_pdl */
    float *red = sq + MLA_RT * nope;
    const int h = blockIdx.x, r0 = w0 + blockIdx.y * MLA_RT, c0 = blockIdx.z * MLA_QCOLS;
    const int n_rows = min(q_start[n_seqs], w1);
    const int nr = min(MLA_RT, n_rows - r0);
    if (nr <= 0) return;
    const int qk = nope + rope, rec = kv_lora + rope;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int e = threadIdx.x; e < MLA_RT * nope; e += blockDim.x) {
        const int r = e / nope, i = e - r * nope;
        sq[e] = r < nr ? bf2f(q[((int64_t)(r0 + r) * n_heads + h) * qk + i]) : 0.0f;
    }
    if (blockIdx.z == 0)
        for (int e = threadIdx.x; e < nr * rope; e += blockDim.x) {
            const int r = e / rope, j = e - r * rope;
            qw[((int64_t)(r0 + r - w0) * n_heads + h) * rec + kv_lora + j] =
                bf2f(q[((int64_t)(r0 + r) * n_heads + h) * qk + nope + j]) * scale;
        }
    __syncthreads();
    const int k = c0 + 2 * lane;
    const int ipw = (nope + MLA_WARPS - 1) / MLA_WARPS, i_lo = warp * ipw, i_hi = min(nope, i_lo + ipw);
    float a0[MLA_RT], a1[MLA_RT];
#pragma unroll
    for (int r = 0; r < MLA_RT; r++) a0[r] = a1[r] = 0.0f;
    if (k < kv_lora)
#pragma unroll 4 /* independent weight loads in flight */
        for (int i = i_lo; i < i_hi; i++) {
            const float2 wv = w_pair(w, h * kvb + i, k);
#pragma unroll
            for (int r = 0; r < MLA_RT; r++) {
                const float qv = sq[r * nope + i];
                a0[r] = fmaf(qv, wv.x, a0[r]);
                a1[r] = fmaf(qv, wv.y, a1[r]);
            }
        }
#pragma unroll
    for (int r = 0; r < MLA_RT; r++)
        *(float2 *)(red + (warp * MLA_RT + r) * MLA_QCOLS + 2 * lane) = make_float2(a0[r], a1[r]);
    __syncthreads();
    for (int e = threadIdx.x; e < MLA_RT * MLA_QCOLS; e += blockDim.x) {
        const int r = e / MLA_QCOLS, cc = e - r * MLA_QCOLS;
        if (r >= nr || c0 + cc >= kv_lora) continue;
        float v = 0.0f;
        for (int ww = 0; ww < MLA_WARPS; ww++) v += red[(ww * MLA_RT + r) * MLA_QCOLS + cc];
        qw[((int64_t)(r0 + r - w0) * n_heads + h) * rec + c0 + cc] = v * scale;
    }
}

/* --- 2. attention in latent space ------------------------------------------------ */
typedef struct mla_args {
    const int32_t *q_start, *ctx_len, *block_tables;
    int max_blocks, block_size;
    int n_heads, G, RB;   /* heads per block, rows per block (G * RB <= MLA_MAXQ) */
    int kv_lora, rope, rsw; /* rsw: shared-memory record stride in 32-bit words */
    int qsw;              /* mma kernel: bf16 q row stride in 32-bit words */
    int chunk, S;         /* positions per split, splits */
    int w0, w1;           /* row window */
    const bf16 *kc, *vc;
    /* quantized records (qg > 0): qrb bytes a slot, scales from byte qvals,
     * one per qg values; e4m3 codes where fp8 */
    int64_t qrb;
    int qvals, qg, fp8;
    float *qw, *part, *ml;
} mla_args;

/* The tile's positions from a quantized cache (a.qg > 0) into srh, the
 * bf16 view of load_tile_async's tile (row stride 2 rsw halves): code x its
 * scale, rounded to bf16; zeros past nt. Four codes a thread (one 32-bit
 * load) where the halves are multiples of 4, else one. sslot as for
 * load_tile_async; the caller syncs. */
static __device__ __forceinline__ void load_tile_q(unsigned short *srh, int rsw, int half, int nt, const int *sslot,
                                                   const mla_args &a) {
    const int rec = 2 * half;
    const uint8_t *kq = (const uint8_t *)a.kc, *vq = (const uint8_t *)a.vc;
    const int step = (half & 3) == 0 ? 4 : 1, per = rec / step;
    for (int e = threadIdx.x; e < MLA_TT * per; e += MLA_THREADS) {
        const int t = e / per, d = (e - t * per) * step;
        unsigned short o[4] = {0, 0, 0, 0};
        if (t < nt) {
            const bool isv = d >= half;
            const int dd = isv ? d - half : d;
            const uint8_t *r = (isv ? vq : kq) + (int64_t)sslot[t] * a.qrb;
            const float *sc = (const float *)(r + a.qvals);
            uint32_t codes = step == 4 ? *(const uint32_t *)(r + dd) : r[dd];
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (u < step)
                    o[u] = __bfloat16_as_ushort(
                        f2bf(kv_code_f32((uint8_t)(codes >> (8 * u)), a.fp8) * sc[(dd + u) / a.qg]));
        }
        unsigned short *dst = srh + t * 2 * rsw + d;
        if (step == 4) {
            *(uint32_t *)dst = o[0] | ((uint32_t)o[1] << 16);
            *(uint32_t *)(dst + 2) = o[2] | ((uint32_t)o[3] << 16);
        } else {
            dst[0] = o[0];
        }
    }
}

static __global__ void __launch_bounds__(MLA_THREADS) mla_attn_kernel(const mla_args a) {
    extern __shared__ float smem[];
    pdl_enter(); /* before any global access: see launch_pdl */
    const int rec = a.kv_lora + a.rope, half = rec >> 1, rsw = a.rsw;
    float *sq = smem;                                     /* [MLA_MAXQ][rec] */
    uint32_t *sr = (uint32_t *)(sq + MLA_MAXQ * rec);     /* [MLA_TT][rsw] bf16 pairs */
    float *sp = (float *)(sr + MLA_TT * rsw);             /* [MLA_TT][MLA_MAXQ] */
    float *scorr = sp + MLA_TT * MLA_MAXQ;                /* [MLA_MAXQ] */
    float *sm_m = scorr + MLA_MAXQ, *sm_l = sm_m + MLA_MAXQ;
    int *sslot = (int *)(sm_l + MLA_MAXQ);                /* [MLA_TT] */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int hg = blockIdx.x, s = blockIdx.y;
    const int split = blockIdx.z % a.S, Z = gridDim.z / a.S;
    const int q0 = a.q_start[s], n_q = a.q_start[s + 1] - q0, ctx = a.ctx_len[s];
    const int32_t *bt = a.block_tables + (int64_t)s * a.max_blocks;
    const int G = a.G, RB = a.RB, QB = G * RB;
    /* this window's rows of the sequence: [ilo, ihi) */
    const int ilo = max(0, a.w0 - q0), ihi = min(n_q, a.w1 - q0);
    const bool vec = (half & 7) == 0;
    for (int i0 = ilo + (int)(blockIdx.z / a.S) * RB; i0 < ihi; i0 += Z * RB) {
        const int nrow = min(RB, ihi - i0);
        const int pmax = ctx - n_q + i0 + nrow - 1; /* position of the block's last row */
        const int t_begin = split * a.chunk, t_end = min(t_begin + a.chunk, pmax + 1);
        /* q vectors of the slots; unused slots are zero (their p is 0) */
        for (int e = tid; e < MLA_MAXQ * rec; e += MLA_THREADS) {
            const int j = e / rec, d = e - j * rec, r = j / G, h = hg * G + (j - r * G);
            sq[e] = (j < QB && r < nrow && h < a.n_heads)
                        ? a.qw[((int64_t)(q0 + i0 + r - a.w0) * a.n_heads + h) * rec + d]
                        : 0.0f;
        }
        /* warp `warp` owns slots warp and warp + 8: validity and position */
        int posj[2];
        bool okj[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int j = warp + MLA_WARPS * u, r = j / G, h = hg * G + (j - r * G);
            okj[u] = j < QB && r < nrow && h < a.n_heads;
            posj[u] = ctx - n_q + i0 + r;
        }
        float mj[2] = {-INFINITY, -INFINITY}, lj[2] = {0.0f, 0.0f};
        float acc[MLA_MAXQ][2];
#pragma unroll
        for (int j = 0; j < MLA_MAXQ; j++) acc[j][0] = acc[j][1] = 0.0f;
        const int kw = tid; /* this thread's latent dims 2 kw, 2 kw + 1 */
        __syncthreads();
        for (int t0 = t_begin; t0 < t_end; t0 += MLA_TT) {
            const int nt = min(MLA_TT, t_end - t0);
            /* the tile's records; positions past the end are zeros (the
             * cache may hold anything there: 0 x NaN would poison acc) */
            if (a.qg > 0) {
                tile_slots(sslot, bt, a.block_size, t0, nt);
                __syncthreads();
                load_tile_q((unsigned short *)sr, rsw, half, nt, sslot, a);
            } else if (vec) {
                tile_slots(sslot, bt, a.block_size, t0, nt);
                __syncthreads();
                load_tile_async(sr, rsw, half, nt, sslot, a.kc, a.vc);
                cp_async_wait_all();
            } else {
                unsigned short *srh = (unsigned short *)sr;
                for (int e = tid; e < MLA_TT * rec; e += MLA_THREADS) {
                    const int t = e / rec, d = e - t * rec;
                    unsigned short v = 0;
                    if (t < nt) {
                        const int ta = t0 + t;
                        const int64_t slot = (int64_t)bt[ta / a.block_size] * a.block_size + ta % a.block_size;
                        const bf16 x = d < half ? a.kc[slot * half + d] : a.vc[slot * half + d - half];
                        v = __bfloat16_as_ushort(x);
                    }
                    srh[t * 2 * rsw + d] = v;
                }
            }
            __syncthreads();
            /* scores: lane = position; the record word is shared by the warp's two slots */
            {
                const uint32_t *rr = sr + lane * rsw;
                const float *qa = sq + warp * rec, *qb = sq + (warp + MLA_WARPS) * rec;
                float s0 = 0.0f, s1 = 0.0f;
                if (okj[0] || okj[1]) {
                    for (int k2 = 0; k2 < half; k2++) {
                        const float2 r = bf2_word(rr[k2]);
                        const float2 x = *(const float2 *)(qa + 2 * k2), y = *(const float2 *)(qb + 2 * k2);
                        s0 = fmaf(x.x, r.x, fmaf(x.y, r.y, s0));
                        s1 = fmaf(y.x, r.x, fmaf(y.y, r.y, s1));
                    }
                }
                const int ta = t0 + lane;
                float sc[2] = {s0, s1};
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const bool valid = okj[u] && lane < nt && ta <= posj[u];
                    const float x = valid ? sc[u] : -INFINITY;
                    const float mnew = fmaxf(mj[u], warp_max(x));
                    float corr = 1.0f, p = 0.0f;
                    if (mnew != -INFINITY) {
                        corr = expf(mj[u] - mnew); /* 0 while nothing was seen (mj = -inf) */
                        p = valid ? expf(x - mnew) : 0.0f;
                    }
                    lj[u] = lj[u] * corr + warp_sum(p);
                    mj[u] = mnew;
                    const int j = warp + MLA_WARPS * u;
                    sp[lane * MLA_MAXQ + j] = p;
                    if (lane == 0) scorr[j] = corr;
                }
            }
            __syncthreads();
            /* latent accumulators: acc[j] = acc[j] corr_j + sum_t p_tj c_t */
            if (2 * kw < a.kv_lora) {
#pragma unroll
                for (int j = 0; j < MLA_MAXQ; j++) {
                    const float c = scorr[j];
                    acc[j][0] *= c;
                    acc[j][1] *= c;
                }
                for (int t = 0; t < nt; t++) {
                    const float2 r = bf2_word(sr[t * rsw + kw]);
                    const float4 *pp = (const float4 *)(sp + t * MLA_MAXQ);
#pragma unroll
                    for (int j4 = 0; j4 < MLA_MAXQ / 4; j4++) {
                        const float4 p = pp[j4];
                        acc[4 * j4 + 0][0] = fmaf(p.x, r.x, acc[4 * j4 + 0][0]);
                        acc[4 * j4 + 0][1] = fmaf(p.x, r.y, acc[4 * j4 + 0][1]);
                        acc[4 * j4 + 1][0] = fmaf(p.y, r.x, acc[4 * j4 + 1][0]);
                        acc[4 * j4 + 1][1] = fmaf(p.y, r.y, acc[4 * j4 + 1][1]);
                        acc[4 * j4 + 2][0] = fmaf(p.z, r.x, acc[4 * j4 + 2][0]);
                        acc[4 * j4 + 2][1] = fmaf(p.z, r.y, acc[4 * j4 + 2][1]);
                        acc[4 * j4 + 3][0] = fmaf(p.w, r.x, acc[4 * j4 + 3][0]);
                        acc[4 * j4 + 3][1] = fmaf(p.w, r.y, acc[4 * j4 + 3][1]);
                    }
                }
            }
            __syncthreads(); /* the next tile overwrites sr, sp, scorr */
        }
        if (lane == 0) {
            sm_m[warp] = mj[0];
            sm_l[warp] = lj[0];
            sm_m[warp + MLA_WARPS] = mj[1];
            sm_l[warp + MLA_WARPS] = lj[1];
        }
        __syncthreads();
        if (2 * kw < a.kv_lora) {
#pragma unroll
            for (int j = 0; j < MLA_MAXQ; j++) {
                const int r = j / G, h = hg * G + (j - r * G);
                if (j < QB && r < nrow && h < a.n_heads) {
                    const int64_t rh = (int64_t)(q0 + i0 + r - a.w0) * a.n_heads + h;
                    if (a.S == 1) {
                        /* normalized; no position seen (padding row): zeros */
                        const float l = sm_l[j], inv = l > 0.0f ? 1.0f / l : 0.0f;
                        float2 *o = (float2 *)(a.qw + rh * rec + 2 * kw);
                        *o = make_float2(acc[j][0] * inv, acc[j][1] * inv);
                    } else {
                        float2 *o = (float2 *)(a.part + (rh * a.S + split) * a.kv_lora + 2 * kw);
                        *o = make_float2(acc[j][0], acc[j][1]);
                        if (kw == 0) {
                            a.ml[(rh * a.S + split) * 2] = sm_m[j];
                            a.ml[(rh * a.S + split) * 2 + 1] = sm_l[j];
                        }
                    }
                }
            }
        }
        __syncthreads(); /* sq, sm_m, sm_l are reused by the next row tile */
    }
}

/* --- 2b. the same on the tensor cores -------------------------------------------
 * Same grid, same workspace, same online softmax (lane = position, a warp
 * per 2 slots); the two products run as mma.m16n8k16 (bf16 in, f32
 * accumulate) with the block's 16 query slots as the M dimension:
 *   scores [16 slots x 32 positions] = Q [16 x rec] R^T: warp w takes the 8
 *     positions 8 (w & 3).. and half of the rec / 16 k-steps (w >> 2); the
 *     two halves are added in shared memory;
 *   acc [16 slots x kv_lora] += P [16 x 32] R [32 x kv_lora]: warp w owns the
 *     8-dim column tiles w, w + 8, ... (8 of them at kv_lora 512), 4 f32
 *     accumulators per tile per lane (rows g and g + 8 of the fragment).
 * q_lat and p enter the tensor cores as two bf16 terms each, the rounded
 * value and its rounding residual (two mma per product, ~16 significant
 * bits instead of 8: with one term the 16-head error against the f32
 * reference reached 8.7e-3 of the 1e-2 tolerance in emulation); records
 * are bf16 already, sums are f32. Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
 * A regs {row g, cols 2t..}, {row g + 8, 2t..}, {g, 2t + 8..}, {g + 8, 2t + 8..};
 * B regs {k 2t, 2t + 1; col g}, {k 2t + 8, 2t + 9; col g}; C {g, 2t}, {g, 2t + 1},
 * {g + 8, 2t}, {g + 8, 2t + 1}. Shared-memory row strides are 4 mod 8 words,
 * so the 8 x 4 fragment loads of a warp hit 32 distinct banks.
 * Needs rec % 16 == 0 and kv_lora % 8 == 0 (the host falls back otherwise). */
#define MLA_SSW (MLA_TT + 1) /* partial-score row stride (floats) */
#define MLA_PW 20            /* p row stride in words: 16 bf16 pairs + 4 */

static __device__ __forceinline__ void mla_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t pack_bf2(float lo, float hi) {
    return (uint32_t)__bfloat16_as_ushort(f2bf(lo)) | ((uint32_t)__bfloat16_as_ushort(f2bf(hi)) << 16);
}

static __global__ void __launch_bounds__(MLA_THREADS) mla_attn_mma_kernel(const mla_args a) {
    extern __shared__ float smem[];
    pdl_enter(); /* before any global access: see launch_pdl */
    const int rec = a.kv_lora + a.rope, half = rec >> 1, rsw = a.rsw, qsw = a.qsw;
    uint32_t *sqh = (uint32_t *)smem;                     /* [MLA_MAXQ][qsw] bf16 pairs, q rounded */
    uint32_t *sql = sqh + MLA_MAXQ * qsw;                 /* [MLA_MAXQ][qsw] the rounding residual */
    uint32_t *sr = sql + MLA_MAXQ * qsw;                  /* [MLA_TT][rsw] bf16 pairs */
    float *ss = (float *)(sr + MLA_TT * rsw);             /* [2][MLA_MAXQ][MLA_SSW] */
    uint32_t *sph = (uint32_t *)(ss + 2 * MLA_MAXQ * MLA_SSW); /* [MLA_MAXQ][MLA_PW] bf16 pairs, p rounded */
    uint32_t *spl = sph + MLA_MAXQ * MLA_PW;              /* [MLA_MAXQ][MLA_PW] the rounding residual */
    float *scorr = (float *)(spl + MLA_MAXQ * MLA_PW);    /* [MLA_MAXQ] */
    float *sm_m = scorr + MLA_MAXQ, *sm_l = sm_m + MLA_MAXQ;
    int *sslot = (int *)(sm_l + MLA_MAXQ);                /* [MLA_TT] */
    unsigned short *srh = (unsigned short *)sr, *sphh = (unsigned short *)sph, *splh = (unsigned short *)spl;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int hg = blockIdx.x, s = blockIdx.y;
    const int split = blockIdx.z % a.S, Z = gridDim.z / a.S;
    const int q0 = a.q_start[s], n_q = a.q_start[s + 1] - q0, ctx = a.ctx_len[s];
    const int32_t *bt = a.block_tables + (int64_t)s * a.max_blocks;
    const int G = a.G, RB = a.RB, QB = G * RB;
    const int ilo = max(0, a.w0 - q0), ihi = min(n_q, a.w1 - q0);
    const bool vec = (half & 7) == 0;
    const int KS = rec >> 4, pn = warp & 3, kh = warp >> 2;
    const int ks0 = kh ? KS / 2 : 0, ks1 = kh ? KS : KS / 2;
    const int ntiles = a.kv_lora >> 3;
    for (int i0 = ilo + (int)(blockIdx.z / a.S) * RB; i0 < ihi; i0 += Z * RB) {
        const int nrow = min(RB, ihi - i0);
        const int pmax = ctx - n_q + i0 + nrow - 1;
        const int t_begin = split * a.chunk, t_end = min(t_begin + a.chunk, pmax + 1);
        for (int e = tid; e < MLA_MAXQ * half; e += MLA_THREADS) {
            const int j = e / half, kw = e - j * half, r = j / G, h = hg * G + (j - r * G);
            uint32_t v = 0, vl = 0;
            if (j < QB && r < nrow && h < a.n_heads) {
                const float2 x = *(const float2 *)(a.qw + ((int64_t)(q0 + i0 + r - a.w0) * a.n_heads + h) * rec + 2 * kw);
                v = pack_bf2(x.x, x.y);
                vl = pack_bf2(x.x - __uint_as_float(v << 16), x.y - __uint_as_float(v & 0xFFFF0000u));
            }
            sqh[j * qsw + kw] = v;
            sql[j * qsw + kw] = vl;
        }
        int posj[2];
        bool okj[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int j = warp + MLA_WARPS * u, r = j / G, h = hg * G + (j - r * G);
            okj[u] = j < QB && r < nrow && h < a.n_heads;
            posj[u] = ctx - n_q + i0 + r;
        }
        float mj[2] = {-INFINITY, -INFINITY}, lj[2] = {0.0f, 0.0f};
        float acc[8][4];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        __syncthreads();
        for (int t0 = t_begin; t0 < t_end; t0 += MLA_TT) {
            const int nt = min(MLA_TT, t_end - t0);
            if (a.qg > 0) {
                tile_slots(sslot, bt, a.block_size, t0, nt);
                __syncthreads();
                load_tile_q(srh, rsw, half, nt, sslot, a);
            } else if (vec) {
                tile_slots(sslot, bt, a.block_size, t0, nt);
                __syncthreads();
                load_tile_async(sr, rsw, half, nt, sslot, a.kc, a.vc);
                cp_async_wait_all();
            } else {
                for (int e = tid; e < MLA_TT * rec; e += MLA_THREADS) {
                    const int t = e / rec, d = e - t * rec;
                    unsigned short v = 0;
                    if (t < nt) {
                        const int ta = t0 + t;
                        const int64_t slot = (int64_t)bt[ta / a.block_size] * a.block_size + ta % a.block_size;
                        const bf16 x = d < half ? a.kc[slot * half + d] : a.vc[slot * half + d - half];
                        v = __bfloat16_as_ushort(x);
                    }
                    srh[t * 2 * rsw + d] = v;
                }
            }
            __syncthreads();
            /* partial scores of positions 8 pn.. over k-steps [ks0, ks1) */
            {
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const uint32_t *qa = sqh + g * qsw + t4, *qb = sqh + (g + 8) * qsw + t4;
                const uint32_t *la = sql + g * qsw + t4, *lb = sql + (g + 8) * qsw + t4;
                const uint32_t *rb = sr + (pn * 8 + g) * rsw + t4;
                for (int ks = ks0; ks < ks1; ks++) {
                    const int kw = ks * 8;
                    const uint32_t af[4] = {qa[kw], qb[kw], qa[kw + 4], qb[kw + 4]};
                    const uint32_t lf[4] = {la[kw], lb[kw], la[kw + 4], lb[kw + 4]};
                    const uint32_t r0 = rb[kw], r1 = rb[kw + 4];
                    mla_mma(c, af, r0, r1);
                    mla_mma(c, lf, r0, r1);
                }
                float *sso = ss + kh * MLA_MAXQ * MLA_SSW + pn * 8 + 2 * t4;
                sso[g * MLA_SSW] = c[0];
                sso[g * MLA_SSW + 1] = c[1];
                sso[(g + 8) * MLA_SSW] = c[2];
                sso[(g + 8) * MLA_SSW + 1] = c[3];
            }
            __syncthreads();
            {
                const int ta = t0 + lane;
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const int j = warp + MLA_WARPS * u;
                    const bool valid = okj[u] && lane < nt && ta <= posj[u];
                    const float x = valid ? ss[j * MLA_SSW + lane] + ss[(MLA_MAXQ + j) * MLA_SSW + lane] : -INFINITY;
                    const float mnew = fmaxf(mj[u], warp_max(x));
                    float corr = 1.0f, p = 0.0f;
                    if (mnew != -INFINITY) {
                        corr = expf(mj[u] - mnew);
                        p = valid ? expf(x - mnew) : 0.0f;
                    }
                    const bf16 pb = f2bf(p), pl = f2bf(p - bf2f(pb));
                    lj[u] = lj[u] * corr + warp_sum(p);
                    mj[u] = mnew;
                    sphh[j * 2 * MLA_PW + lane] = __bfloat16_as_ushort(pb);
                    splh[j * 2 * MLA_PW + lane] = __bfloat16_as_ushort(pl);
                    if (lane == 0) scorr[j] = corr;
                }
            }
            __syncthreads();
            {
                const float cg = scorr[g], cg8 = scorr[g + 8];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    acc[i][0] *= cg;
                    acc[i][1] *= cg;
                    acc[i][2] *= cg8;
                    acc[i][3] *= cg8;
                }
                for (int kp = 0; kp < 2 && 16 * kp < nt; kp++) {
                    const int o0 = g * MLA_PW + kp * 8 + t4, o1 = o0 + 8 * MLA_PW;
                    const uint32_t af[4] = {sph[o0], sph[o1], sph[o0 + 4], sph[o1 + 4]};
                    const uint32_t lf[4] = {spl[o0], spl[o1], spl[o0 + 4], spl[o1 + 4]};
                    const unsigned short *r0 = srh + (16 * kp + 2 * t4) * 2 * rsw;
                    const int rs2 = 2 * rsw;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int ntile = warp + MLA_WARPS * i;
                        if (ntile < ntiles) {
                            const int dim = ntile * 8 + g;
                            const uint32_t b0 = (uint32_t)r0[dim] | ((uint32_t)r0[rs2 + dim] << 16);
                            const uint32_t b1 = (uint32_t)r0[8 * rs2 + dim] | ((uint32_t)r0[9 * rs2 + dim] << 16);
                            mla_mma(acc[i], af, b0, b1);
                            mla_mma(acc[i], lf, b0, b1);
                        }
                    }
                }
            }
            __syncthreads();
        }
        if (lane == 0) {
            sm_m[warp] = mj[0];
            sm_l[warp] = lj[0];
            sm_m[warp + MLA_WARPS] = mj[1];
            sm_l[warp + MLA_WARPS] = lj[1];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int ntile = warp + MLA_WARPS * i;
            if (ntile >= ntiles) continue;
            const int d = ntile * 8 + 2 * t4;
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int j = g + 8 * u, r = j / G, h = hg * G + (j - r * G);
                if (!(j < QB && r < nrow && h < a.n_heads)) continue;
                const int64_t rh = (int64_t)(q0 + i0 + r - a.w0) * a.n_heads + h;
                const float v0 = acc[i][2 * u], v1 = acc[i][2 * u + 1];
                if (a.S == 1) {
                    const float l = sm_l[j], inv = l > 0.0f ? 1.0f / l : 0.0f;
                    *(float2 *)(a.qw + rh * rec + d) = make_float2(v0 * inv, v1 * inv);
                } else {
                    *(float2 *)(a.part + (rh * a.S + split) * a.kv_lora + d) = make_float2(v0, v1);
                    if (d == 0) {
                        a.ml[(rh * a.S + split) * 2] = sm_m[j];
                        a.ml[(rh * a.S + split) * 2 + 1] = sm_l[j];
                    }
                }
            }
        }
        __syncthreads();
    }
}

/* --- 3. merge and up-projection --------------------------------------------------
 * Block = (head, 16 rows, 16 outputs of v_dim). The split weights f_s =
 * e^(m_s - M) / L per row are computed once (a warp per row, lanes over
 * splits), then the rows' merged latent acc goes to shared memory and
 * out = W_uv,h acc, a warp per output row (W_uv,h read once per 16 rows). */
#define MLA_OUTS 16
static __global__ void __launch_bounds__(MLA_THREADS)
    mla_out_kernel(const int32_t *__restrict__ q_start, int n_seqs, int w0, int w1, int n_heads, int nope,
                   int kvb, int kv_lora, int rope, int v_dim, int S, mla_w w, const float *__restrict__ qw,
                   const float *__restrict__ part, const float *__restrict__ ml, bf16 *__restrict__ out) {
    extern __shared__ float sa[]; /* [MLA_RT][kv_lora] | sf [MLA_RT][S] */
    pdl_enter(); /* before any global access: see launch_pdl */
    float *sf = sa + MLA_RT * kv_lora;
    const int h = blockIdx.x, r0 = w0 + blockIdx.y * MLA_RT, i0 = blockIdx.z * MLA_OUTS;
    const int n_rows = min(q_start[n_seqs], w1);
    const int nr = min(MLA_RT, n_rows - r0);
    if (nr <= 0) return;
    const int rec = kv_lora + rope;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (S > 1) {
        /* M = max m_s, L = sum l_s e^(m_s - M): an empty split (l = 0) adds nothing */
        for (int r = warp; r < nr; r += MLA_WARPS) {
            const float *mlr = ml + ((int64_t)(r0 + r - w0) * n_heads + h) * S * 2;
            float M = -INFINITY;
            for (int sp = lane; sp < S; sp += 32)
                if (mlr[2 * sp + 1] > 0.0f) M = fmaxf(M, mlr[2 * sp]);
            M = warp_max(M);
            float L = 0.0f;
            for (int sp = lane; sp < S; sp += 32) {
                const float l = mlr[2 * sp + 1];
                if (l > 0.0f) L = fmaf(l, expf(mlr[2 * sp] - M), L);
            }
            L = warp_sum(L);
            for (int sp = lane; sp < S; sp += 32) {
                const float l = mlr[2 * sp + 1];
                sf[r * S + sp] = (l > 0.0f && L > 0.0f) ? expf(mlr[2 * sp] - M) / L : 0.0f;
            }
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < nr * kv_lora; e += blockDim.x) {
        const int r = e / kv_lora, k = e - r * kv_lora;
        const int64_t rh = (int64_t)(r0 + r - w0) * n_heads + h;
        float v;
        if (S == 1) {
            v = qw[rh * rec + k];
        } else {
            /* 8 independent loads in flight per step: the merge is latency-bound */
            const float *pp = part + rh * S * kv_lora + k, *f = sf + r * S;
            float v8[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            int sp = 0;
            for (; sp + 8 <= S; sp += 8) {
                float x[8];
#pragma unroll
                for (int u = 0; u < 8; u++) x[u] = pp[(int64_t)(sp + u) * kv_lora];
#pragma unroll
                for (int u = 0; u < 8; u++) v8[u] = fmaf(x[u], f[sp + u], v8[u]);
            }
            for (; sp < S; sp++) v8[0] = fmaf(pp[(int64_t)sp * kv_lora], f[sp], v8[0]);
            v = ((v8[0] + v8[1]) + (v8[2] + v8[3])) + ((v8[4] + v8[5]) + (v8[6] + v8[7]));
        }
        sa[e] = v;
    }
    for (int e = nr * kv_lora + threadIdx.x; e < MLA_RT * kv_lora; e += blockDim.x) sa[e] = 0.0f;
    __syncthreads();
    const int i_end = min(v_dim, i0 + MLA_OUTS);
    for (int i = i0 + warp; i < i_end; i += MLA_WARPS) {
        float o[MLA_RT];
#pragma unroll
        for (int r = 0; r < MLA_RT; r++) o[r] = 0.0f;
        const int wr = h * kvb + nope + i;
#pragma unroll 4 /* independent weight loads in flight */
        for (int k = 2 * lane; k < kv_lora; k += 64) {
            const float2 wv = w_pair(w, wr, k);
#pragma unroll
            for (int r = 0; r < MLA_RT; r++) {
                const float2 x = *(const float2 *)(sa + r * kv_lora + k);
                o[r] = fmaf(wv.x, x.x, fmaf(wv.y, x.y, o[r]));
            }
        }
#pragma unroll
        for (int r = 0; r < MLA_RT; r++) {
            const float v = warp_sum(o[r]);
            if (lane == 0 && r < nr) out[((int64_t)(r0 + r) * n_heads + h) * v_dim + i] = f2bf(v);
        }
    }
}

extern "C" fl_status fl_cuda_mla_attention(fl_backend *b, const void *q, const fl_attn_meta *m, int n_heads,
                                           int nope, int rope, int v_dim, int kv_lora, float scale,
                                           const fl_tensor *wkv_b, const void *k_cache, const void *v_cache,
                                           void *out) {
    const int rec = kv_lora + rope, kvb = nope + v_dim, qg = b->kv_int8_head_dim;
    if (n_heads <= 0 || nope <= 0 || rope < 0 || v_dim <= 0 || kv_lora <= 0 || rec % 2)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda mla_attention: heads %d, nope %d, rope %d, v %d, kv_lora %d",
                      n_heads, nope, rope, v_dim, kv_lora);
    if (kv_lora % 2 || kv_lora > MLA_MAX_LORA || rope > MLA_MAX_ROPE || nope > MLA_MAX_NOPE)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda mla_attention: kv_lora %d, rope %d, nope %d (kv_lora must be "
                      "even and at most %d, rope at most %d, nope at most %d)", kv_lora, rope, nope,
                      MLA_MAX_LORA, MLA_MAX_ROPE, MLA_MAX_NOPE);
    if (qg > 0 && (rec / 2) % qg)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda mla_attention: int8 KV scales of %d values do not tile records of %d",
                      qg, rec / 2);
    if (!wkv_b || wkv_b->ndim != 2 || wkv_b->shape[0] != (int64_t)n_heads * kvb || wkv_b->shape[1] != kv_lora)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda mla_attention: kv_b_proj is [%lld, %lld], expected [%d, %d]",
                      wkv_b ? (long long)wkv_b->shape[0] : 0LL,
                      wkv_b && wkv_b->ndim == 2 ? (long long)wkv_b->shape[1] : 0LL, n_heads * kvb, kv_lora);
    mla_w w = {};
    w.data = wkv_b->data;
    w.cols = kv_lora;
    if (wkv_b->dtype == FL_DTYPE_W4) {
        if (wkv_b->group <= 0 || wkv_b->group % 2 || kv_lora % wkv_b->group || !wkv_b->scales)
            return FL_ERR(FL_ERR_INVALID_ARG, "cuda mla_attention: W4 kv_b_proj [%d, %d] with group %d",
                          n_heads * kvb, kv_lora, wkv_b->group);
        w.w4 = 1;
        w.packed = w4_packed(wkv_b->shape[0], kv_lora, wkv_b->group);
        w.sb = (const __half2 *)wkv_b->scales;
        w.group = wkv_b->group;
        w.gpr = kv_lora / wkv_b->group;
        w.nkb = kv_lora / 64;
    } else if (wkv_b->dtype != FL_DTYPE_BF16) {
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda mla_attention: kv_b_proj of dtype %s (upload_weight makes "
                      "bf16 or W4)", fl_dtype_name(wkv_b->dtype));
    }
    if (m->n_seqs <= 0 || m->block_size <= 0 || m->max_blocks < 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda mla_attention: %d sequences, block size %d", m->n_seqs,
                      m->block_size);
    if (m->max_ctx_len <= 0) return FL_OK; /* no sequence has a token */
    if (m->n_seqs > 65535)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda mla_attention: %d sequences in one call (at most 65535)",
                      m->n_seqs);
    fl_cuda *c = cuda_impl(b);

    /* Launch shape, from host-known maxima only (graph safety). */
    const int rows_hint = m->max_q_len > 0 ? m->max_q_len : m->max_ctx_len;
    const int64_t R = (int64_t)m->n_seqs * rows_hint; /* bound on the call's query rows */
    const int G = n_heads < MLA_MAXQ ? n_heads : MLA_MAXQ;
    const int n_hg = (n_heads + G - 1) / G;
    int RB = MLA_MAXQ / G;
    if (RB > rows_hint) RB = rows_hint;
    const int64_t tiles = (rows_hint + RB - 1) / RB;
    /* Context splits when the blocks without them would not fill the GPU
     * twice (decode); each split at least MLA_MIN_CHUNK positions, and the
     * partials stay small next to the rows' records. */
    int S = 1;
    const int64_t base = (int64_t)n_hg * m->n_seqs * (tiles < 4096 ? tiles : 4096);
    if (base < 2 * (int64_t)c->n_sm) {
        int64_t want = (2 * (int64_t)c->n_sm + base - 1) / base;
        const int64_t by_ctx = (m->max_ctx_len + MLA_MIN_CHUNK - 1) / MLA_MIN_CHUNK;
        const int64_t by_rows = R > 0 ? 1024 / R : 1;
        if (want > by_ctx) want = by_ctx;
        if (want > by_rows) want = by_rows;
        if (want > MLA_MAX_SPLITS) want = MLA_MAX_SPLITS;
        S = want > 1 ? (int)want : 1;
    }
    if (fl_cuda_tune(FL_CUDA_TUNE_MLA_SPLITS) > 0) { /* measurements: force the split count */
        const int64_t by_ctx = ((int64_t)m->max_ctx_len + MLA_TT - 1) / MLA_TT;
        int64_t f = fl_cuda_tune(FL_CUDA_TUNE_MLA_SPLITS);
        if (f > MLA_MAX_SPLITS) f = MLA_MAX_SPLITS;
        if (f > by_ctx) f = by_ctx;
        S = (int)f;
    }
    int chunk = (m->max_ctx_len + S - 1) / S;
    chunk = (chunk + MLA_TT - 1) / MLA_TT * MLA_TT;
    S = (m->max_ctx_len + chunk - 1) / chunk;
    /* Rows per window: the workspace (q_lat [rows, heads, rec], plus the
     * split partials [rows, heads, S, kv_lora + 2]) within the budget. */
    const size_t per_row = sizeof(float) * (size_t)n_heads * ((size_t)rec + (S > 1 ? (size_t)S * (kv_lora + 2) : 0));
    int64_t RW = (int64_t)(MLA_WS_BUDGET / per_row);
    const long wr = fl_cuda_tune(FL_CUDA_TUNE_MLA_WINDOW_ROWS); /* tests: force several windows */
    if (wr > 0 && wr < RW) RW = wr;
    if (RW < MLA_RT) RW = MLA_RT;
    if (RW > (int64_t)65535 * MLA_RT) RW = (int64_t)65535 * MLA_RT; /* grid.y of the projections */
    if (RW > R) RW = R;
    RW = (RW + MLA_RT - 1) / MLA_RT * MLA_RT;
    if (R > INT32_MAX - RW)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda mla_attention: %lld query rows", (long long)R);
    const int64_t Z64 = (((RW < rows_hint ? RW : rows_hint) + RB - 1) / RB);
    const int Z = (int)(Z64 < 4096 ? Z64 : 4096);
    if ((int64_t)Z * S > 65535 || n_hg > 65535)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda mla_attention: grid of %d x %d blocks", Z, S);

    /* Kernel: the tensor-core one where its shapes hold (rec % 16, kv_lora
     * % 8), unless the mla_kernel override is simt (0; tests and
     * measurements run both). */
    const long kt = fl_cuda_tune(FL_CUDA_TUNE_MLA_KERNEL);
    bool use_mma = rec % 16 == 0 && kv_lora % 8 == 0 && MLA_DEFAULT_MMA;
    if (kt == 0) use_mma = false;
    if (kt == 1) use_mma = rec % 16 == 0 && kv_lora % 8 == 0;
    int rsw, qsw = 0;
    size_t smem;
    if (use_mma) {
        /* row strides 4 mod 8 words: conflict-free fragment loads */
        rsw = rec / 2 + (12 - rec / 2 % 8) % 8;
        qsw = rsw;
        smem = sizeof(float) * ((size_t)2 * MLA_MAXQ * qsw + (size_t)MLA_TT * rsw + 2 * MLA_MAXQ * MLA_SSW +
                                2 * MLA_MAXQ * MLA_PW + 3 * MLA_MAXQ + MLA_TT);
    } else {
        rsw = rec / 2;
        if (rsw % 2 == 0) rsw++; /* odd word stride: lane-per-record reads hit distinct banks */
        smem = sizeof(float) * ((size_t)MLA_MAXQ * rec + (size_t)MLA_TT * rsw + MLA_TT * MLA_MAXQ + 3 * MLA_MAXQ +
                                MLA_TT);
    }
    if (smem > c->smem_optin)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda mla_attention: needs %zu bytes of shared memory (device has %zu)",
                      smem, c->smem_optin);
    if (smem > 48 * 1024) {
        /* per device, once: attributes are set outside any capture (the
         * first call of a shape is eager) */
        static size_t set_for[64];
        if (c->device < 0 || c->device >= 64 || set_for[c->device] < smem) {
            FL_CUDA_CHECK(cudaFuncSetAttribute(mla_attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)c->smem_optin));
            FL_CUDA_CHECK(cudaFuncSetAttribute(mla_attn_mma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)c->smem_optin));
            if (c->device >= 0 && c->device < 64) set_for[c->device] = c->smem_optin;
        }
    }
    float *ws = NULL;
    FL_TRY(fl_cuda_workspace_get(b, FL_CUDA_WS_SLOT_MLA, per_row * (size_t)RW, "cuda mla_attention", &ws));
    float *qw = ws;
    float *part = ws + (size_t)RW * n_heads * rec;
    float *ml = part + (size_t)RW * n_heads * S * kv_lora;

    const bf16 *qb = (const bf16 *)q;
    for (int64_t w0 = 0; w0 < R; w0 += RW) {
        const int iw0 = (int)w0, iw1 = (int)(w0 + RW);
        const dim3 qgrid((unsigned)n_heads, cdiv_u(RW, MLA_RT), cdiv_u(kv_lora, MLA_QCOLS));
        /* PDL for all four kernels (see launch_pdl): each one's launch, and
         * the next W4 GEMV's weight requests, overlap the one before */
        FL_TRY(launch_pdl(mla_qlat_kernel, qgrid, dim3(MLA_THREADS),
                          sizeof(float) * MLA_RT * (nope + MLA_WARPS * MLA_QCOLS), c->stream, qb,
                          (const int32_t *)m->q_start, m->n_seqs, iw0, iw1, n_heads, nope, rope, kvb, kv_lora,
                          scale, w, qw));
        mla_args a;
        a.q_start = m->q_start;
        a.ctx_len = m->ctx_len;
        a.block_tables = m->block_tables;
        a.max_blocks = m->max_blocks;
        a.block_size = m->block_size;
        a.n_heads = n_heads;
        a.G = G;
        a.RB = RB;
        a.kv_lora = kv_lora;
        a.rope = rope;
        a.rsw = rsw;
        a.qsw = qsw;
        a.chunk = chunk;
        a.S = S;
        a.w0 = iw0;
        a.w1 = iw1;
        a.kc = (const bf16 *)k_cache;
        a.vc = (const bf16 *)v_cache;
        a.qg = qg > 0 ? qg : 0;
        a.qrb = qg > 0 ? (int64_t)fl_kv_int8_record_bytes(rec / 2, qg) : 0;
        a.qvals = ((rec / 2) + 3) & ~3;
        a.fp8 = qg > 0 && b->kv_fp8_codes;
        a.qw = qw;
        a.part = part;
        a.ml = ml;
        const dim3 agrid((unsigned)n_hg, (unsigned)m->n_seqs, (unsigned)(Z * S));
        FL_TRY(launch_pdl(use_mma ? mla_attn_mma_kernel : mla_attn_kernel, agrid, dim3(MLA_THREADS), smem,
                          c->stream, (const mla_args)a));
        const dim3 ogrid((unsigned)n_heads, cdiv_u(RW, MLA_RT), cdiv_u(v_dim, MLA_OUTS));
        FL_TRY(launch_pdl(mla_out_kernel, ogrid, dim3(MLA_THREADS), sizeof(float) * MLA_RT * (kv_lora + S),
                          c->stream, (const int32_t *)m->q_start, m->n_seqs, iw0, iw1, n_heads, nope, kvb,
                          kv_lora, rope, v_dim, S, w, (const float *)qw, (const float *)part,
                          (const float *)ml, (bf16 *)out));
    }
    return FL_OK;
}
