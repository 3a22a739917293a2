/*
 * cuda_attention.cu — paged causal attention over the bf16 KV cache
 * (fl_attn_meta semantics exactly as kernels/cpu/cpu_attention.c: query row
 * i of sequence s sits at position ctx_len[s] - n_q(s) + i and attends to
 * cached positions 0..that position through the block table). Four kernels:
 *
 * attn_mma_kernel (head_dim 64 and 128; prefill, and decode with a context
 * split), FlashAttention-2 style on the tensor cores (mma.sync m16n8k16,
 * bf16 inputs, f32 accumulation and f32 online softmax with expf):
 *  - rows are packed per KV head: for KV head hk of sequence s, row r =
 *    (query i = r / group, query head hk * group + r % group). So a block
 *    reads each K/V tile once for all query heads of its GQA group (4 heads
 *    per KV head in Llama-3-8B, 7 in Qwen2-7B): the K/V traffic of decode
 *    drops by the group size, and the 16-row MMA tile is filled by the
 *    group's heads at decode instead of being 1/16 used;
 *  - block = 4 warps = (KV head, sequence, row tile x context split). WM =
 *    4: each warp owns 16 rows of a 64-row tile (prefill); WM = 1: the 4
 *    warps share 16 rows and split each 64-position K/V tile 4 ways
 *    (decode, where the rows are only the group's heads); the warps' states
 *    are merged in shared memory at the end;
 *  - K/V tiles of 64 positions are gathered through the block table with
 *    cp.async into shared memory, double-buffered (tile j + 1 loads while
 *    tile j is computed; single-buffered stays selectable for
 *    measurements); positions past the block's range are zero-filled, so
 *    masked positions multiply 0, never cache garbage;
 *    S = Q K^T from Q fragments held in registers, causal mask, online
 *    softmax on the accumulator fragments, P re-packed as the A operand of
 *    P V (no trip through shared memory), V fragments with ldmatrix.trans;
 *  - causal prefill: a block stops at its last row's position, and the
 *    heaviest tiles (last rows) are issued first.
 *  - flash-decoding: when (KV heads x sequences x row tiles) blocks would
 *    not fill one wave, the context is split S ways (S from the host-known
 *    max_ctx_len, the SM count and the kernel's occupancy; each sequence's
 *    own chunk, max(128, ceil(ctx / S)) rounded to 64, is computed on the
 *    device), each split writes (m, l, unnormalized acc) per (row, head) in f32 to a
 *    workspace, and attn_merge_kernel combines them. Every split writes its
 *    (m, l), with l = 0 when it saw nothing, so the merge never reads a
 *    stale partial. The merge reads all (m, l) of a row at once (warp 0),
 *    keeps the weights e^(m_k - M) in shared memory and has every split's
 *    partial of a dim in flight at once: two round trips a row.
 *  Since attn_split_decode_kernel, decode of long contexts takes this
 *  kernel only when forced (FL_CUDA_ATTN_MMA, attn_splitdec=0) or at
 *  max_q_len > 1. Measured there (H200, Llama-3-8B shape): b1 ctx 4096
 *  18.6 us (905 GB/s of K/V, 22 % of the copy ceiling), b1 ctx 16384 42 us,
 *  b8 ctx 4096 48.6 us; forced split counts 8..64 all within 10 %. What
 *  it waits on, by reading the code (not profiled): a tile's cp.async
 *  issue reads the block table from global memory between copies (8
 *  dependent reads a thread a tile: the copies' "memory" clobber keeps
 *  them in order), 2 tiles in flight a block, and the merge as it was
 *  looped over the splits with its loads inside.
 *
 * attn_split_decode_kernel (decode of long contexts: max_q_len 1,
 * max_ctx_len > 128, head_dim 64 / 128, 16-byte aligned rows), built to
 * stream K/V at the copy ceiling:
 *  - block = 4 warps = (KV head x head slice, sequence, split): the decode
 *    row of up to 16 query heads of one GQA group is one m16 slab (4 of 16
 *    rows used by Llama-3-8B, 7 by Qwen2-7B; groups over 16 take
 *    ceil(group / 16) slices), so K/V are read once per group; the
 *    per-tile math is attn_mma_kernel's (am_tile_step: mma.m16n8k16, f32
 *    online softmax with expf, P rounded to bf16 for P V), the 4 warps
 *    splitting each 64-position tile and merged at the end (am_stash,
 *    am_merge_warps). Over int8 / e4m3 records the products are
 *    transposed instead (am_tile_step_q8: positions as the mma's rows, up
 *    to 8 heads as its columns, groups over 8 in ceil(group / 8) slices),
 *    which halves the mma count and o's registers (4 blocks an SM instead
 *    of 3); Tensor cores rather than SIMT f32: ~2 mma per
 *    position against ~50 warp instructions per position (group 4; ~80 at
 *    group 7) for SIMT, of ~128 an SM can issue per position at 4.1 TB/s;
 *  - the split's chunk streams through a ring of ST stages (ST = 3 at
 *    head_dim 128, 5 at 64: ~100 KB of shared memory, 2 blocks an SM,
 *    ST - 1 tiles = 64 KB of K/V in flight a block, 128 KB an SM, about
 *    Little's law at ~4 us of latency); stage j % ST is refilled with tile
 *    j + ST - 1 as soon as tile j - 1's math is done;
 *  - no global read between copies: the cache offsets of a tile's 64
 *    positions sit in a shared ring (ST slots, a thread per position);
 *    the first ST tiles' entries are read at once (round trip 2, with the
 *    query rows by cp.async), later ones one ring ahead, the read issued
 *    before a tile's math and stored after it, so its latency hides;
 *    copying is then shared reads and cp.async only. Entries are read only
 *    for positions below the chunk's end (never past the context, never
 *    past max_blocks); positions past it are zero-filled and masked;
 *  - splits: S from the host-known max_ctx_len, n_seqs, KV heads x slices
 *    and the occupancy (one full wave: 2 x 132 blocks; b1 ctx 4096 at
 *    Llama-3-8B: S = 33, 128 positions a split; b8: S = 4), at least 128
 *    positions a split, at most 64, the partials within ATTN_WS_BUDGET;
 *    each sequence's chunk (ceil(ctx / S) rounded to 64, at least 128) is
 *    computed on the device, as attn_mma_kernel does. S > 1 writes (m, l,
 *    acc) in attn_mma_kernel's workspace format (l = 0 for a split that
 *    sees nothing); S = 1 (large batches) writes the output itself: one
 *    launch, no workspace;
 *  - merge (S > 1): attn_merge_kernel, a second launch that PDL overlaps
 *    with this one's tail, with am_merge_splits (warps read every split's
 *    (m, l) at once, then each thread all S partials of a dim: two round
 *    trips). A merge by the last split block in the same launch measured
 *    slower (its one block merges its heads serially); the launcher no
 *    longer selects it, and its branch in the kernel (cnt_base, always NULL)
 *    goes when the kernel can be re-validated on a GPU;
 *  - PDL, splitdec_prewait (cuda_tune.h; default on, 0 off): the
 *    lengths, the block table and the first ST - 1 tiles' K/V rows of
 *    positions < ctx - n_q (stored by earlier steps; see
 *    attn_decode_kernel for why none of it is written in-step) are issued
 *    before griddepcontrol.wait; the query row, the rows at positions >=
 *    ctx - n_q (this step's own: at decode the one position ctx - 1, in the
 *    last non-empty split) and every global write come after it. The late
 *    rows of a pre-issued tile are skipped before the wait (not
 *    zero-filled: two copies into one row land in no defined order) and
 *    copied after it in their own cp.async group, and that tile waits for
 *    all groups (wait_all) instead of all but the newest ST - 1. The query
 *    row is loaded with plain loads (not a cp.async group). Off: the wait
 *    comes first, before any global access.
 *  fl_cuda_attention_set_split_modes overrides both switches per process
 *  (tests, A/B).
 *  Route: AUTO (and the DECODE policy at these lengths) takes it for
 *  max_q_len 1 and max_ctx_len > AD_MAX_T at head_dim 64 / 128 with
 *  aligned rows; the attn_splitdec override at 0 turns it off for A/B runs
 *  (back to attn_mma_kernel), FL_CUDA_ATTN_SPLITDEC forces it at any
 *  context (tests), FL_CUDA_ATTN_MMA forces the route before it. It is
 *  the default because it measured faster than the route before at every
 *  long context, alone and in the decode step, most of it from the early
 *  staging.
 *
 * attn_decode_kernel (decode of short contexts: max_q_len 1, max_ctx_len
 * <= 128, any head_dim a multiple of 8 up to 256, 16-byte aligned rows; f32
 * SIMT math, expf). Decode there is latency, not bytes (K/V of 48 positions
 * x 8 heads is ~200 KB): what counts is how many dependent global round
 * trips a block waits for. So:
 *  - block = (KV head, sequence) serving up to 4 query heads of its GQA
 *    group (larger groups: ceil(group / 4) blocks per KV head), so K/V are
 *    read once per group, not once per query head;
 *  - round trip 1: lengths and the block-table entry of every position the
 *    shared rows can hold (up to max_ctx_len: in the table, even past the
 *    context); round trip 2: every K and V row of the context at once
 *    (cp.async, 16 bytes, a row per head_dim / 8 threads) plus the query
 *    rows; then nothing but shared memory. Both are issued before
 *    griddepcontrol.wait for the rows earlier steps stored (only the query
 *    rows and this step's K/V rows wait for the q|k|v GEMV; the kernel
 *    says why that is safe; attn_prewait=0: all after the wait);
 *  - S = Q K^T: a warp takes 32 / TP positions x TP lanes splitting
 *    head_dim, every head of the block per K chunk converted (TP = 8, 4, 2
 *    by context length: one pass of the 8 warps); exact softmax (the row
 *    max from per-warp maxima, then expf), no online rescaling;
 *  - O = P V / sum P: a warp takes (head, 64 dims) x 4 position slices
 *    (the 8 lanes of a V row read 128 contiguous bytes), shuffles merge the
 *    slices; with fewer than 8 such tasks, warps split the positions
 *    further and merge in shared memory.
 *  Shared K/V rows are sized by the host-known max_ctx_len (rounded to 8,
 *  at most 128 x 2 x 528 bytes at head_dim 256); rows are (head_dim / 8) | 1
 *  16-byte units long, so 8 rows at one column hit distinct banks.
 *
 * attention_kernel (SIMT, any head_dim up to 256): block per (head,
 * sequence, z) taking query rows z, z + gridDim.z, ...; 8 warps take groups
 * of 4 positions, lanes split head_dim, per-warp online softmax merged in
 * shared memory. It serves what the others do not take: decode of longer
 * contexts at head_dims 80 / 96 / 256, prefill at those head dims,
 * misaligned inputs and unknown query counts (max_q_len 0) at head_dims the
 * tensor-core kernel does not take. It was the short-decode kernel before
 * attn_decode_kernel: ~7.9 us for Llama-3-8B at batch 1, ctx 48 (Nsight
 * Compute), ~8 dependent round trips (block table, K row, V row per group
 * of 4 positions, twice, then the merge), K/V read once per query head.
 *
 * Graph safety: grids depend on n_seqs, max_q_len, max_ctx_len and the
 * shapes only (and, for the split counts, the SM count and occupancy); lengths, query counts and block tables are read on the
 * device. The split workspace comes from
 * cuda_workspace.h (grown on eager calls only; their sizes are functions of
 * the same host-known numbers, so the eager step before a capture sizes
 * them) and the partials are bounded by ATTN_WS_BUDGET.
 * f32 math throughout, expf, no fast math: the result tracks the CPU
 * reference to bf16 resolution (P is rounded to bf16 for the P V product,
 * 2^-9 relative per weight, as FlashAttention does).
 */
#include <float.h>
#include <stdint.h>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_workspace.h"

/* --- SIMT kernel (any head_dim up to 256) ------------------------------------------ */
#define ATT_WARPS 8
#define ATT_MAX_D 256
#define ATT_NJ (ATT_MAX_D / 32)
#define ATT_G 4 /* positions per warp step */

/* I8: the cache holds int8 records (kernels/backend.h, kv_int8_head_dim =
 * head_dim) of rb bytes, e4m3 codes when fp8: a K dot is the code row's
 * times the position's scale, a V row's weight p times its scale. */
template <bool I8>
static __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_kernel(const bf16 *__restrict__ q, int q_stride, int n_seqs,
                     const int32_t *__restrict__ q_start, const int32_t *__restrict__ ctx_len,
                     const int32_t *__restrict__ block_tables, int max_blocks, int block_size,
                     int n_heads, int group, int head_dim, int64_t kv_dim, float scale,
                     const void *__restrict__ kc, const void *__restrict__ vc, int64_t rb, int fp8,
                     bf16 *__restrict__ out) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][ATT_MAX_D];
    pdl_enter(); /* before any global access: see launch_pdl */
    const int h = blockIdx.x, s = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q0 = q_start[s], n_q = q_start[s + 1] - q0;
    const int32_t *bt = block_tables + (int64_t)s * max_blocks;
    const int kvh = h / group;
    const int64_t koff = (int64_t)kvh * head_dim, vals = (kv_dim + 3) & ~(int64_t)3; /* I8: scales from vals */
  for (int i = blockIdx.z; i < n_q; i += gridDim.z) {
    const int row = q0 + i, pos = ctx_len[s] - n_q + i;
    float qv[ATT_NJ], acc[ATT_NJ];
    const bf16 *qh = q + (int64_t)row * q_stride + (int64_t)h * head_dim;
#pragma unroll
    for (int j = 0; j < ATT_NJ; j++) {
        const int d = lane + 32 * j;
        qv[j] = d < head_dim ? bf2f(qh[d]) : 0.0f;
        acc[j] = 0.0f;
    }
    float mx = -FLT_MAX, l = 0.0f;
    /* Each warp takes groups of ATT_G consecutive positions; the loads and
     * dot products of a group are independent, so they overlap instead of
     * paying one memory latency per position. */
    for (int t0 = warp * ATT_G; t0 <= pos; t0 += ATT_WARPS * ATT_G) {
        float sc[ATT_G], ks[ATT_G], vs[ATT_G];
        const void *vt[ATT_G];
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            const int t = t0 + g < pos ? t0 + g : pos; /* clamp: duplicates are masked below */
            const int64_t slot = (int64_t)bt[t / block_size] * block_size + t % block_size;
            float part = 0.0f;
            if constexpr (I8) {
                const uint8_t *kr = (const uint8_t *)kc + slot * rb, *vr = (const uint8_t *)vc + slot * rb;
                const uint8_t *kt = kr + koff;
                vt[g] = vr + koff;
                ks[g] = ((const float *)(kr + vals))[kvh];
                vs[g] = ((const float *)(vr + vals))[kvh];
#pragma unroll
                for (int j = 0; j < ATT_NJ; j++) {
                    const int d = lane + 32 * j;
                    if (d < head_dim) part = fmaf(qv[j], kv_code_f32(kt[d], fp8), part);
                }
            } else {
                const bf16 *kt = (const bf16 *)kc + slot * kv_dim + koff;
                vt[g] = (const bf16 *)vc + slot * kv_dim + koff;
                ks[g] = vs[g] = 1.0f;
#pragma unroll
                for (int j = 0; j < ATT_NJ; j++) {
                    const int d = lane + 32 * j;
                    if (d < head_dim) part = fmaf(qv[j], bf2f(kt[d]), part);
                }
            }
            sc[g] = part;
        }
        float mnew = mx;
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            sc[g] = t0 + g <= pos ? warp_sum(sc[g]) * ks[g] * scale : -INFINITY;
            mnew = fmaxf(mnew, sc[g]);
        }
        const float corr = expf(mx - mnew);
        float p[ATT_G];
        l *= corr;
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            p[g] = expf(sc[g] - mnew); /* 0 for masked positions */
            l += p[g];
        }
#pragma unroll
        for (int j = 0; j < ATT_NJ; j++) {
            const int d = lane + 32 * j;
            if (d < head_dim) {
                float a = acc[j] * corr;
#pragma unroll
                for (int g = 0; g < ATT_G; g++) {
                    if constexpr (I8) a = fmaf(p[g] * vs[g], kv_code_f32(((const uint8_t *)vt[g])[d], fp8), a);
                    else a = fmaf(p[g], bf2f(((const bf16 *)vt[g])[d]), a);
                }
                acc[j] = a;
            }
        }
        mx = mnew;
    }
    if (lane == 0) {
        sm_m[warp] = mx;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ATT_NJ; j++) {
        const int d = lane + 32 * j;
        if (d < head_dim) sm_acc[warp][d] = acc[j];
    }
    __syncthreads();
    /* Merge: M = max m_w, L = sum l_w e^(m_w - M); a warp that saw no
     * position has l = 0 and m = -FLT_MAX, so it contributes exactly 0. */
    float M = -FLT_MAX;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.0f, f[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = sm_l[w] > 0.0f ? expf(sm_m[w] - M) : 0.0f;
        L += sm_l[w] * f[w];
    }
    bf16 *o = out + ((int64_t)row * n_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) v += sm_acc[w][d] * f[w];
        o[d] = f2bf(L > 0.0f ? v / L : 0.0f); /* no position seen (padding row): 0 */
    }
    __syncthreads(); /* shared state is reused by the next row */
  }
}


/* --- tensor-core kernel (head_dim 64 / 128) ---------------------------------------- */
#define AM_THREADS 128
#define AM_BN 64          /* positions per K/V tile */
#define AM_MIN_CHUNK 128  /* positions per context split, at least */
#define AM_MAX_SPLITS 64
#define ATTN_WS_BUDGET ((size_t)64 << 20) /* bytes of split partials, at most */
#define AM_DEFAULT_STAGES 2 /* K/V tiles double-buffered (1: load, wait, compute) */

typedef struct attn_args {
    const bf16 *q;
    int q_stride;
    const int32_t *q_start, *ctx_len, *block_tables;
    int max_blocks, block_size;
    int n_heads, group, rows_hint, S;
    float scale;
    int64_t kv_dim;
    int64_t rb;  /* int8 records (attn_split_decode_kernel<D, true>): bytes a slot */
    int vals;    /* int8 records: bytes of values before the scales */
    int fp8;     /* int8 records: e4m3 codes (kernels/backend.h, kv_fp8_codes) */
    const bf16 *kc, *vc;
    bf16 *out;
    float *pacc; /* S > 1: [n_seqs * rows_hint * n_heads][S][D] */
    float *pml;  /* S > 1: [n_seqs * rows_hint * n_heads][S][2] (m, l) */
} attn_args;

static __device__ __forceinline__ void am_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t am_pack(float lo, float hi) {
    return (uint32_t)__bfloat16_as_ushort(f2bf(lo)) | ((uint32_t)__bfloat16_as_ushort(f2bf(hi)) << 16);
}

/* 16 bytes global -> shared, or 16 zero bytes when !ok (src is not read). */
static __device__ __forceinline__ void am_cp16(void *dst, const void *src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

/* 4 bytes global -> shared, or 4 zero bytes when !ok (an int8 record's scale). */
static __device__ __forceinline__ void am_cp4(void *dst, const void *src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(ok ? 4 : 0) : "memory");
}

/* Four 8x8 b16 matrices, transposed: lane l addresses row l & 7 of matrix l >> 3. */
static __device__ __forceinline__ void am_ldsm_t(uint32_t (&r)[4], const void *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

/* Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
 * A regs {row g, cols 2t, 2t+1}, {g + 8, 2t..}, {g, 2t + 8..}, {g + 8, 2t + 8..};
 * B regs {k 2t, 2t + 1; n g}, {k 2t + 8, 2t + 9; n g}; C {g, 2t}, {g, 2t + 1},
 * {g + 8, 2t}, {g + 8, 2t + 1}. The S accumulators of n-blocks 2j, 2j + 1
 * are exactly the A fragment of k-step j of P V. Shared rows are D + 8
 * bf16 long (68 or 36 words, 4 mod 32), so the 8 x 4 fragment loads of a
 * warp and ldmatrix's 8 row addresses hit distinct banks. The helpers
 * below serve attn_mma_kernel and attn_split_decode_kernel alike. */

/* The A fragments of Q for the 16-row slab at row wr of the shared Q tile
 * Qs (rows D + 8 bf16 long). */
template <int D>
static __device__ __forceinline__ void am_load_qf(const bf16 *Qs, int wr, uint32_t (&qf)[D / 16][4]) {
    constexpr int DS = D + 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const bf16 *q0p = Qs + (wr + g) * DS + kk * 16 + 2 * t;
        qf[kk][0] = *(const uint32_t *)q0p;
        qf[kk][1] = *(const uint32_t *)(q0p + 8 * DS);
        qf[kk][2] = *(const uint32_t *)(q0p + 8);
        qf[kk][3] = *(const uint32_t *)(q0p + 8 * DS + 8);
    }
}

/* One online-softmax step for a lane's two rows: the tile's row maxima mx
 * reduced over the quad, the running maxima m moved up, l and corr (the
 * factor the rows' accumulated O must take) rescaled to them. */
static __device__ __forceinline__ void am_rescale(float (&mx)[2], float (&m)[2], float (&l)[2], float (&corr)[2]) {
#pragma unroll
    for (int h2 = 0; h2 < 2; h2++) {
        mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(0xffffffffu, mx[h2], 1));
        mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(0xffffffffu, mx[h2], 2));
        const float mnew = fmaxf(m[h2], mx[h2]);
        corr[h2] = expf(m[h2] - mnew);
        m[h2] = mnew;
        l[h2] *= corr[h2];
    }
}

/* o's accumulators of row g times c0, of row g + 8 times c1. */
template <int DN>
static __device__ __forceinline__ void am_scale_rows(float (&o)[DN][4], float c0, float c1) {
#pragma unroll
    for (int n = 0; n < DN; n++) {
        o[n][0] *= c0;
        o[n][1] *= c0;
        o[n][2] *= c1;
        o[n][3] *= c1;
    }
}

/* One warp's share of a K/V tile: its NW positions (shared rows pw .. pw +
 * NW - 1 of Ks and Vs, cache positions kp0 ..) against its 16-row slab (Q
 * fragments qf; the slab's rows g and g + 8 sit at positions posA and posB:
 * the causal mask; positions from hi on are masked too): S = Q K^T, online
 * softmax into (m, l), O += P V into o. */
template <int D, int NW>
static __device__ __forceinline__ void am_tile_step(const bf16 *Ks, const bf16 *Vs, int pw, int kp0,
                                                    const uint32_t (&qf)[D / 16][4], int posA, int posB, int hi,
                                                    float scale, float (&m)[2], float (&l)[2],
                                                    float (&o)[D / 8][4]) {
    constexpr int NB = NW / 8;  /* S n-blocks per warp */
    constexpr int KS = NW / 16; /* P V k-steps per warp */
    constexpr int DS = D + 8;   /* shared row stride, bf16 */
    constexpr int DK = D / 16;  /* Q K^T k-steps */
    constexpr int DN = D / 8;   /* P V n-blocks */
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float sc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++) sc[nb][0] = sc[nb][1] = sc[nb][2] = sc[nb][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DK; kk++) {
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            const bf16 *kp = Ks + (pw + nb * 8 + g) * DS + kk * 16 + 2 * t;
            am_mma(sc[nb], qf[kk], *(const uint32_t *)kp, *(const uint32_t *)(kp + 8));
        }
    }
    /* scale, mask (causal and the split's end), row maxima */
    float mx[2] = {-FLT_MAX, -FLT_MAX};
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int kpos = kp0 + nb * 8 + 2 * t + (e & 1);
            const int pos = e < 2 ? posA : posB;
            const float v = kpos <= pos && kpos < hi ? sc[nb][e] * scale : -INFINITY;
            sc[nb][e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
    }
    float corr[2];
    am_rescale(mx, m, l, corr);
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float p = expf(sc[nb][e] - m[e >> 1]); /* masked: exp(-inf) = 0 */
            sc[nb][e] = p;
            l[e >> 1] += p;
        }
    }
    am_scale_rows<DN>(o, corr[0], corr[1]);
    /* O += P V: P from the S accumulators, V through ldmatrix.trans */
#pragma unroll
    for (int j = 0; j < KS; j++) {
        uint32_t pa[4];
        pa[0] = am_pack(sc[2 * j][0], sc[2 * j][1]);
        pa[1] = am_pack(sc[2 * j][2], sc[2 * j][3]);
        pa[2] = am_pack(sc[2 * j + 1][0], sc[2 * j + 1][1]);
        pa[3] = am_pack(sc[2 * j + 1][2], sc[2 * j + 1][3]);
        const int mi = lane >> 3, rr = lane & 7;
        const bf16 *vrow = Vs + (pw + 16 * j + rr + (mi & 1) * 8) * DS + (mi >> 1) * 8;
#pragma unroll
        for (int np = 0; np < D / 16; np++) {
            uint32_t vb[4];
            am_ldsm_t(vb, vrow + np * 16);
            am_mma(o[2 * np], pa, vb[0], vb[1]);
            am_mma(o[2 * np + 1], pa, vb[2], vb[3]);
        }
    }
}

/* --- quantized records straight into the tensor cores (split decode) ----------
 * A tile's int8 / e4m3 codes stay as stored in shared memory; each lane turns
 * the codes its mma fragments need into f16 in registers, exactly (int8 and
 * e4m3 values are f16 values), and the records' scales are applied outside
 * the products: S = (K_codes Q^T) * k_scale per position, and V's scale is
 * folded into P (normalized by a power of two so P stays in [0, 1] for f16).
 * No widened copy, no second barrier, and Q, in f16 with the softmax scale
 * folded in, loses less than the bf16 path's rounding of code * scale.
 * The products are transposed against the bf16 kernel's: the warp's 16
 * positions are the mma's M and the GQA group's heads (up to 8: SD_ROWS8)
 * its N, so a 16-position step is D / 16 mma for S^T = K Q^T and D / 16 for
 * O^T = V^T P^T, where a 16-row head slab (4 or 7 rows used) needs twice
 * that, and o is half the registers; P^T reaches the B operand through two
 * movmatrix transposes. Index maps (any permutation of the summed index is
 * free when both operands use it):
 *  - S^T, k-step kk: fragment slots 2t, 2t + 1, 2t + 8, 2t + 9 are dims
 *    (D / 4) t + 4 kk .. + 3, so a lane's K codes of a row are one D / 4
 *    byte run, one or two 16-byte loads;
 *  - O^T, m-block mb: row g is dim (D / 8) g + 2 mb, row g + 8 the dim
 *    after it, so a lane's V codes of a position are one D / 8 byte run;
 *    the epilogue writes each o to its dim.
 * Rows are D bytes; the 16-byte chunk c of row r is stored at c ^ q8_swz(r)
 * (copy_rows), which puts the rows a quarter warp reads at once into
 * distinct banks at head_dim 128 (2-way at 64 for V). */
#define SD_ROWS8 8 /* query heads a block, at most, over quantized records: the mma's N */

template <int D>
static __device__ __forceinline__ int q8_swz(int r) { return D == 128 ? (r & 7) : ((r >> 1) & 3); }

/* NB (8, 16 or 32) bytes of row r at byte b0 (a multiple of NB) as words. */
template <int D, int NB>
static __device__ __forceinline__ void q8_run(const uint8_t *rows, int r, int b0, uint32_t (&w)[NB / 4]) {
#pragma unroll
    for (int c = 0; c < (NB + 15) / 16; c++) {
        const uint8_t *p = rows + r * D + ((((b0 >> 4) + c) ^ q8_swz<D>(r)) << 4) + (b0 & 15);
        if constexpr (NB >= 16) {
            const uint4 v = *(const uint4 *)p;
            w[4 * c] = v.x, w[4 * c + 1] = v.y, w[4 * c + 2] = v.z, w[4 * c + 3] = v.w;
        } else {
            const uint2 v = *(const uint2 *)p;
            w[0] = v.x, w[1] = v.y;
        }
    }
}

/* Two codes as an f16x2, exactly: byte lo (low half) and byte hi (high
 * half) of the 8 bytes {x, y} (__byte_perm numbering), int8 or e4m3. The
 * int8 path biases each code by 128 into the low mantissa byte of 1024.0
 * and subtracts 1152: a permute, a logic op and a half2 subtract a pair. */
static __device__ __forceinline__ uint32_t q8_pair(uint32_t x, uint32_t y, unsigned lo, unsigned hi, bool fp8) {
    if (fp8) {
        const uint32_t two = __byte_perm(x, y, lo | (hi << 4));
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffffu), __NV_E4M3);
        return (uint32_t)h.x | ((uint32_t)h.y << 16);
    }
    const uint32_t two = (__byte_perm(x, y, lo | (hi << 8)) & 0x00ff00ffu) ^ 0x64806480u;
    const __half2 v = __hsub2(*(const __half2 *)&two, __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480)));
    return *(const uint32_t *)&v;
}

static __device__ __forceinline__ void am_mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t q8_h2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t *)&h;
}

/* An 8 x 8 f16 fragment (row lane / 4, columns 2 (lane % 4) ..) transposed. */
static __device__ __forceinline__ uint32_t q8_trans(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

/* Q^T's B fragments (slab rows 0..7 of Qs, rows D + 8 bf16 long) in f16 and
 * the S^T dim order above, times scale, clamped to f16's range. */
template <int D>
static __device__ __forceinline__ void am_load_qb_q8(const bf16 *Qs, float scale, uint32_t (&qb)[D / 16][2]) {
    constexpr int DS = D + 8, KB = D / 4;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    auto q = [&](int d) { return fminf(fmaxf(__bfloat162float(Qs[g * DS + d]) * scale, -65504.0f), 65504.0f); };
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const int d = KB * t + 4 * kk;
        qb[kk][0] = q8_h2(q(d), q(d + 1));
        qb[kk][1] = q8_h2(q(d + 2), q(d + 3));
    }
}

/* One warp's 16 positions of a tile of quantized rows (see above): rows pw
 * .. pw + 15 of K8 / V8, scales Ksc / Vsc, cache positions kp0 .., against
 * qb (am_load_qb_q8: the softmax scale is in it); positions from hi on are
 * masked. A lane holds heads 2t and 2t + 1: m, l (l summed over the lane's
 * positions only) and o[mb] = O^T rows (D / 8) g + 2 mb (+ 1) of those
 * heads. o holds O / osc (osc: a warp-wide power of two, 1 at the start):
 * the step's P is scaled by 1 / R for f16's range, so o is kept in units of
 * the last R and rescaled once a step (skipped when every factor is 1);
 * the caller multiplies by osc at the end. Powers of two scale exactly, so
 * the result is the one of scaling o to O every step (barring f32 under-
 * or overflow of the factors, far outside bf16 use). */
template <int D>
static __device__ __forceinline__ void am_tile_step_q8(const uint8_t *K8, const uint8_t *V8, const float *Ksc,
                                                       const float *Vsc, int pw, int kp0,
                                                       const uint32_t (&qb)[D / 16][2], int hi, bool fp8,
                                                       float (&m)[2], float (&l)[2], float (&o)[D / 16][4],
                                                       float &osc) {
    constexpr int DK = D / 16, KB = D / 4, VB = D / 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    /* S^T: positions pw + g and pw + g + 8 (rows), heads 2t, 2t + 1; two
     * accumulator chains */
    uint32_t k0[KB / 4], k1[KB / 4];
    q8_run<D, KB>(K8, pw + g, KB * t, k0);
    q8_run<D, KB>(K8, pw + g + 8, KB * t, k1);
    float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < DK; kk++) {
        const uint32_t a[4] = {q8_pair(k0[kk], k0[kk], 0, 1, fp8), q8_pair(k1[kk], k1[kk], 0, 1, fp8),
                               q8_pair(k0[kk], k0[kk], 2, 3, fp8), q8_pair(k1[kk], k1[kk], 2, 3, fp8)};
        if (kk & 1) am_mma_f16(sb, a, qb[kk][0], qb[kk][1]);
        else am_mma_f16(sa, a, qb[kk][0], qb[kk][1]);
    }
    const float ks0 = Ksc[pw + g], ks1 = Ksc[pw + g + 8], vs0 = Vsc[pw + g], vs1 = Vsc[pw + g + 8];
    const bool ok0 = kp0 + g < hi, ok1 = kp0 + g + 8 < hi;
    float sc[4];
    sc[0] = ok0 ? (sa[0] + sb[0]) * ks0 : -INFINITY;
    sc[1] = ok0 ? (sa[1] + sb[1]) * ks0 : -INFINITY;
    sc[2] = ok1 ? (sa[2] + sb[2]) * ks1 : -INFINITY;
    sc[3] = ok1 ? (sa[3] + sb[3]) * ks1 : -INFINITY;
    /* the tile's maxima of heads 2t, 2t + 1 over the 8 lanes of a column
     * (position kp0 < hi is always seen, so they are finite) */
    float corr[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; h2++) {
        float mx = fmaxf(sc[h2], sc[2 + h2]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float mnew = fmaxf(m[h2], mx);
        corr[h2] = expf(m[h2] - mnew);
        m[h2] = mnew;
        l[h2] *= corr[h2];
    }
    /* R: the power of two at or above the warp's largest V scale (1 when
     * all are 0: zero-filled rows), exact to divide by and multiply back */
    float vmax = fmaxf(vs0, vs1);
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 4));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 8));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 16));
    uint32_t rb = (__float_as_uint(vmax) + 0x7fffffu) & 0x7f800000u;
    if (rb == 0u || rb >= 0x7f000000u) rb = 0x3f800000u; /* 0, or a scale too large to invert: 1 */
    const float R = __uint_as_float(rb), Rinv = __uint_as_float(0x7f000000u - rb);
    const float w0 = vs0 * Rinv, w1 = vs1 * Rinv;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float p = expf(sc[e] - m[e & 1]); /* masked: exp(-inf) = 0 */
        l[e & 1] += p;
        sc[e] = p * (e < 2 ? w0 : w1);
    }
    const float f0 = corr[0] * osc * Rinv, f1 = corr[1] * osc * Rinv;
    if (__any_sync(0xffffffffu, f0 != 1.0f || f1 != 1.0f)) {
#pragma unroll
        for (int mb = 0; mb < DK; mb++) {
            o[mb][0] *= f0;
            o[mb][1] *= f1;
            o[mb][2] *= f0;
            o[mb][3] *= f1;
        }
    }
    osc = R;
    /* P^T's B fragments: [position 2t, 2t + 1 (+ 8)][head g] */
    const uint32_t pb0 = q8_trans(q8_h2(sc[0], sc[1])), pb1 = q8_trans(q8_h2(sc[2], sc[3]));
    /* O^T += V^T P^T: V rows pw + 2t, + 1, + 8, + 9, the lane's dims */
    uint32_t v0[VB / 4], v1[VB / 4], v2[VB / 4], v3[VB / 4];
    q8_run<D, VB>(V8, pw + 2 * t, VB * g, v0);
    q8_run<D, VB>(V8, pw + 2 * t + 1, VB * g, v1);
    q8_run<D, VB>(V8, pw + 2 * t + 8, VB * g, v2);
    q8_run<D, VB>(V8, pw + 2 * t + 9, VB * g, v3);
#pragma unroll
    for (int mb = 0; mb < DK; mb++) {
        const int wi = mb >> 1, b = 2 * (mb & 1);
        const uint32_t a[4] = {q8_pair(v0[wi], v1[wi], b, 4 + b, fp8), q8_pair(v0[wi], v1[wi], b + 1, 5 + b, fp8),
                               q8_pair(v2[wi], v3[wi], b, 4 + b, fp8), q8_pair(v2[wi], v3[wi], b + 1, 5 + b, fp8)};
        am_mma_f16(o[mb], a, pb0, pb1);
    }
}

/* Epilogue, step 1 over am_tile_step_q8's state: l summed over a head's 8
 * lanes, then (m, l, o) into Eo / Em / El as am_stash lays them out (slab
 * rows 0..7: the heads). */
template <int D>
static __device__ __forceinline__ void am_stash_q8(float *Eo, float *Em, float *El, const float (&m)[2],
                                                   float (&l)[2], const float (&o)[D / 16][4]) {
    constexpr int ES = D + 8, VB = D / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h2 = 0; h2 < 2; h2++) {
        l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 4);
        l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 8);
        l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 16);
    }
    float *eo = Eo + warp * 16 * ES;
#pragma unroll
    for (int mb = 0; mb < D / 16; mb++)
#pragma unroll
        for (int e = 0; e < 4; e++) eo[(2 * t + (e & 1)) * ES + VB * g + 2 * mb + (e >> 1)] = o[mb][e];
    if (g == 0) {
        Em[warp * 16 + 2 * t] = m[0];
        El[warp * 16 + 2 * t] = l[0];
        Em[warp * 16 + 2 * t + 1] = m[1];
        El[warp * 16 + 2 * t + 1] = l[1];
    }
}

/* Epilogue, step 1: the warp's (m, l, o) into shared memory, l summed over
 * the 4 lanes of each row first. Eo [warp][16 rows][D + 8] f32, Em and El
 * [warp][16]. */
template <int D>
static __device__ __forceinline__ void am_stash(float *Eo, float *Em, float *El, const float (&m)[2], float (&l)[2],
                                                const float (&o)[D / 8][4]) {
    constexpr int ES = D + 8; /* epilogue row stride, floats */
    constexpr int DN = D / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h2 = 0; h2 < 2; h2++) {
        l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 1);
        l[h2] += __shfl_xor_sync(0xffffffffu, l[h2], 2);
    }
    float *eo = Eo + warp * 16 * ES;
#pragma unroll
    for (int n = 0; n < DN; n++) {
        *(float2 *)(eo + g * ES + n * 8 + 2 * t) = make_float2(o[n][0], o[n][1]);
        *(float2 *)(eo + (g + 8) * ES + n * 8 + 2 * t) = make_float2(o[n][2], o[n][3]);
    }
    if (t == 0) {
        Em[warp * 16 + g] = m[0];
        El[warp * 16 + g] = l[0];
        Em[warp * 16 + g + 8] = m[1];
        El[warp * 16 + g + 8] = l[1];
    }
}

/* Epilogue, step 2 (after a barrier): row rr, dim d of the slab held by
 * warps w0 .. w0 + WN - 1, their states merged: M = the largest m of the
 * warps that saw a position (-FLT_MAX when none did), L = sum l e^(m - M),
 * O = sum o e^(m - M) (unnormalized; L = 0 and O = 0 when nothing was
 * seen). */
template <int D, int WN>
static __device__ __forceinline__ void am_merge_warps(const float *Eo, const float *Em, const float *El, int w0,
                                                      int rr, int d, float &M, float &L, float &O) {
    constexpr int ES = D + 8;
    M = -FLT_MAX;
#pragma unroll
    for (int w = 0; w < WN; w++)
        if (El[(w0 + w) * 16 + rr] > 0.0f) M = fmaxf(M, Em[(w0 + w) * 16 + rr]);
    L = 0.0f;
    O = 0.0f;
#pragma unroll
    for (int w = 0; w < WN; w++) {
        const float lw = El[(w0 + w) * 16 + rr];
        if (lw > 0.0f) {
            const float f = expf(Em[(w0 + w) * 16 + rr] - M);
            L += lw * f;
            O += Eo[((w0 + w) * 16 + rr) * ES + d] * f;
        }
    }
}

/* I8: int8 records (a.rb, a.vals); a tile's codes are loaded into
 * registers and widened (times their row's scale, rounded to bf16) into
 * the same shared tile, so the math is the bf16 kernel's. */
template <int D, int WM, int ST, bool I8>
static __global__ void __launch_bounds__(AM_THREADS) attn_mma_kernel(attn_args a) {
    constexpr int WN = 4 / WM;      /* warps sharing one 16-row slab (split of the tile's positions) */
    constexpr int BM = 16 * WM;     /* rows per block */
    constexpr int NW = AM_BN / WN;  /* positions per warp per tile */
    constexpr int DS = D + 8;       /* shared row stride, bf16 */
    constexpr int DK = D / 16;      /* Q K^T k-steps */
    constexpr int DN = D / 8;       /* P V n-blocks */
    constexpr int CH = D / 8;       /* 16-byte chunks per row */
    constexpr int ES = D + 8;       /* epilogue row stride, floats */
    static_assert(BM <= AM_BN, "the Q tile fits the first K buffer");
    static_assert(ST == 1 || ST == 2, "one or two K/V stages");
    pdl_enter(); /* before any global access: see launch_pdl */
    /* dynamic shared memory, am_smem_bytes(D, ST): ST stages of [K tile |
     * V tile], aliased by the Q tile (before the loop) and by the epilogue */
    extern __shared__ __align__(16) unsigned char sm[];
    bf16 *const Qs = (bf16 *)sm;
    float *Eo = (float *)sm, *Em = Eo + 4 * 16 * ES, *El = Em + 4 * 16;

    const int hk = blockIdx.x, s = blockIdx.y;
    const int S = a.S, split = (int)blockIdx.z % S, zt = (int)blockIdx.z / S, Zt = (int)gridDim.z / S;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const int group = a.group;
    const int q0 = a.q_start[s], n_q = a.q_start[s + 1] - q0, ctx = a.ctx_len[s];
    const int rows = n_q * group;
    const int ntiles = (rows + BM - 1) / BM;
    int chunk = ctx, lo = 0;
    if (S > 1) {
        chunk = (ctx + S - 1) / S;
        chunk = (chunk + AM_BN - 1) / AM_BN * AM_BN;
        if (chunk < AM_MIN_CHUNK) chunk = AM_MIN_CHUNK;
        lo = split * chunk;
    }
    const int hi_split = lo + chunk < ctx ? lo + chunk : ctx; /* lo >= ctx: nothing to see */
    const int32_t *bt = a.block_tables + (int64_t)s * a.max_blocks;
    const int64_t koff = (int64_t)hk * D;
    const int wr = (warp / WN) * 16, pw = (warp % WN) * NW;

    for (int it = zt; it < ntiles; it += Zt) {
        const int r0 = (ntiles - 1 - it) * BM; /* last rows (most positions) first */
        /* Q tile: BM packed rows, zeros past the sequence's rows */
        for (int c = tid; c < BM * CH; c += AM_THREADS) {
            const int r = c / CH, part = c % CH, rr = r0 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (rr < rows) {
                const int i = rr / group, head = hk * group + rr % group;
                v = *(const uint4 *)(a.q + (int64_t)(q0 + i) * a.q_stride + (int64_t)head * D + part * 8);
            }
            *(uint4 *)(Qs + r * DS + part * 8) = v;
        }
        __syncthreads();
        uint32_t qf[DK][4];
        am_load_qf<D>(Qs, wr, qf);
        __syncthreads(); /* Qs is the K buffer */
        /* positions of this thread's two rows (-1: padding row, sees nothing) */
        const int rA = r0 + wr + g, rB = rA + 8;
        const int posA = rA < rows ? ctx - n_q + rA / group : -1;
        const int posB = rB < rows ? ctx - n_q + rB / group : -1;
        const int rlast_blk = (r0 + BM < rows ? r0 + BM : rows) - 1;
        const int rlast_w = (r0 + wr + 16 < rows ? r0 + wr + 16 : rows) - 1;
        const int maxpos_blk = rlast_blk >= r0 ? ctx - n_q + rlast_blk / group : -1;
        const int maxpos_w = rlast_w >= r0 + wr ? ctx - n_q + rlast_w / group : -1;
        const int hi = hi_split < maxpos_blk + 1 ? hi_split : maxpos_blk + 1;

        float m[2] = {-FLT_MAX, -FLT_MAX}, l[2] = {0.0f, 0.0f};
        float o[DN][4];
#pragma unroll
        for (int n = 0; n < DN; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

        /* K/V tile at t0 into stage st: cp.async, zeros past hi */
        auto load_tile = [&](int t0, int st) {
            bf16 *Kd = (bf16 *)sm + st * 2 * AM_BN * DS, *Vd = Kd + AM_BN * DS;
            if constexpr (I8) {
                constexpr int CH8 = D / 16, PER = AM_BN * CH8 / AM_THREADS;
                static_assert(PER * AM_THREADS == AM_BN * CH8, "a tile is whole loads");
                const uint8_t *const kc8 = (const uint8_t *)a.kc, *const vc8 = (const uint8_t *)a.vc;
                uint4 kr[PER], vr[PER];
                float ks[PER], vs[PER];
#pragma unroll
                for (int u = 0; u < PER; u++) { /* every load in flight before any is used */
                    const int c = tid + u * AM_THREADS, r = c / CH8, part = c % CH8, tp = t0 + r;
                    kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
                    ks[u] = vs[u] = 0.0f;
                    if (tp < hi) {
                        const int64_t slot = (int64_t)bt[tp / a.block_size] * a.block_size + tp % a.block_size;
                        const int64_t base = slot * a.rb;
                        kr[u] = *(const uint4 *)(kc8 + base + koff + part * 16);
                        vr[u] = *(const uint4 *)(vc8 + base + koff + part * 16);
                        ks[u] = *(const float *)(kc8 + base + a.vals + hk * 4);
                        vs[u] = *(const float *)(vc8 + base + a.vals + hk * 4);
                    }
                }
#pragma unroll
                for (int u = 0; u < PER; u++) {
                    const int c = tid + u * AM_THREADS, r = c / CH8, part = c % CH8;
                    float fk[2][8], fv[2][8];
                    kv16_scaled(kr[u], ks[u], a.fp8, fk);
                    kv16_scaled(vr[u], vs[u], a.fp8, fv);
                    *(uint4 *)(Kd + r * DS + part * 16) = bf16x8_pack(fk[0]);
                    *(uint4 *)(Kd + r * DS + part * 16 + 8) = bf16x8_pack(fk[1]);
                    *(uint4 *)(Vd + r * DS + part * 16) = bf16x8_pack(fv[0]);
                    *(uint4 *)(Vd + r * DS + part * 16 + 8) = bf16x8_pack(fv[1]);
                }
            } else {
                for (int c = tid; c < AM_BN * CH; c += AM_THREADS) {
                    const int r = c / CH, part = c % CH, tp = t0 + r;
                    const bool ok = tp < hi;
                    const bf16 *ksrc = a.kc, *vsrc = a.vc;
                    if (ok) {
                        const int64_t slot = (int64_t)bt[tp / a.block_size] * a.block_size + tp % a.block_size;
                        ksrc = a.kc + slot * a.kv_dim + koff + part * 8;
                        vsrc = a.vc + slot * a.kv_dim + koff + part * 8;
                    }
                    am_cp16(Kd + r * DS + part * 8, ksrc, ok);
                    am_cp16(Vd + r * DS + part * 8, vsrc, ok);
                }
            }
            asm volatile("cp.async.commit_group;" ::: "memory"); /* I8: an empty group, the waits stay as counted */
        };
        /* two stages: tile j + 1 loads while tile j is computed (the
         * barrier at the end of iteration j - 1 freed its stage) */
        if (ST == 2 && lo < hi) load_tile(lo, 0);
        for (int t0 = lo, jt = 0; t0 < hi; t0 += AM_BN, jt++) {
            const int cur = ST == 2 ? (jt & 1) : 0;
            if (ST == 1) {
                load_tile(t0, 0);
                asm volatile("cp.async.wait_group 0;" ::: "memory");
            } else if (t0 + AM_BN < hi) {
                load_tile(t0 + AM_BN, cur ^ 1);
                asm volatile("cp.async.wait_group 1;" ::: "memory");
            } else {
                asm volatile("cp.async.wait_group 0;" ::: "memory");
            }
            __syncthreads();
            const bf16 *Ks = (const bf16 *)sm + cur * 2 * AM_BN * DS, *Vs = Ks + AM_BN * DS;
            /* warp-uniform: skip a tile part that lies past all of this warp's rows */
            if (t0 + pw <= maxpos_w && t0 + pw < hi)
                am_tile_step<D, NW>(Ks, Vs, pw, t0 + pw, qf, posA, posB, hi_split, a.scale, m, l, o);
            __syncthreads(); /* the load issued next overwrites this stage */
        }

        /* epilogue: every warp's (m, l, o) to shared memory, then per (row, dim)
         * the WN warps of a slab merge and the result goes out */
        am_stash<D>(Eo, Em, El, m, l, o);
        __syncthreads();
        for (int idx = tid; idx < BM * D; idx += AM_THREADS) {
            const int r = idx / D, d = idx % D, row = r0 + r;
            if (row >= rows) continue;
            float M, L, O;
            am_merge_warps<D, WN>(Eo, Em, El, (r / 16) * WN, r % 16, d, M, L, O);
            const int i = row / group, head = hk * group + row % group;
            if (S == 1) {
                a.out[((int64_t)(q0 + i) * a.n_heads + head) * D + d] = f2bf(L > 0.0f ? O / L : 0.0f);
            } else if (i < a.rows_hint) {
                const int64_t ps = (((int64_t)s * a.rows_hint + i) * a.n_heads + head) * S + split;
                a.pacc[ps * D + d] = O;
                if (d == 0) {
                    a.pml[2 * ps] = M;
                    a.pml[2 * ps + 1] = L;
                }
            }
        }
        __syncthreads(); /* the next row tile reuses shared memory */
    }
}

/* Merges the S split partials of np (row, head) pairs: pair k's (m, l) at
 * pml[2 (ps0 + k S + split)], its unnormalized acc at pacc[(ps0 + k S +
 * split) D ..], its bf16 output row at o0 + k D. Called by every thread of
 * a block (128 threads: 4 warps; attn_merge_kernel with one pair, the
 * fused merge of attn_split_decode_kernel with a head slice's pairs). Warp
 * w reads every split's (m, l) of pairs w, w + 4, ... at once (S <=
 * AM_MAX_SPLITS = 64: two a lane) and turns them into the weights e^(m_k -
 * M) in shared sw [np][AM_MAX_SPLITS] (0 for a split that saw nothing, l =
 * 0: never a stale partial) and sL [np]; then each thread loads all S
 * partials of its (pair, dim) before summing them. Loads go through L2
 * (__ldcg): the fused merge reads partials other blocks just wrote. Ends
 * with a barrier (sw and sL may be reused). */
static __device__ __forceinline__ void am_merge_splits(int np, int64_t ps0, bf16 *o0, int S, int D,
                                                       const float *pacc, const float *pml, float *sw, float *sL) {
    static_assert(AM_MAX_SPLITS <= 64, "a warp reads two splits a lane");
    const int tid = threadIdx.x, lane = tid & 31, nw = (int)(blockDim.x >> 5);
    for (int pr = tid >> 5; pr < np; pr += nw) {
        const int64_t ps = ps0 + (int64_t)pr * S;
        float mk[2], lk[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int k = lane + 32 * u;
            mk[u] = k < S ? __ldcg(pml + 2 * (ps + k)) : -FLT_MAX;
            lk[u] = k < S ? __ldcg(pml + 2 * (ps + k) + 1) : 0.0f;
        }
        float M = -FLT_MAX;
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (lk[u] > 0.0f) M = fmaxf(M, mk[u]);
        M = warp_max(M);
        float L = 0.0f;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int k = lane + 32 * u;
            const float w = lk[u] > 0.0f ? expf(mk[u] - M) : 0.0f;
            if (k < S) sw[pr * AM_MAX_SPLITS + k] = w;
            L += lk[u] * w;
        }
        L = warp_sum(L);
        if (lane == 0) sL[pr] = L;
    }
    __syncthreads();
#pragma unroll 1
    for (int e = tid; e < np * D; e += blockDim.x) {
        const int pr = e / D, d = e % D;
        const float *const w = sw + pr * AM_MAX_SPLITS;
        const int64_t ps = ps0 + (int64_t)pr * S;
        float x[AM_MAX_SPLITS]; /* every split's partial of dim d, all loads in flight at once */
#pragma unroll
        for (int k = 0; k < AM_MAX_SPLITS; k++) x[k] = k < S && w[k] > 0.0f ? __ldcg(pacc + (ps + k) * D + d) : 0.0f;
        float v = 0.0f;
#pragma unroll
        for (int k = 0; k < AM_MAX_SPLITS; k++)
            if (k < S) v = fmaf(x[k], w[k], v);
        const float L = sL[pr];
        o0[(int64_t)pr * D + d] = f2bf(L > 0.0f ? v / L : 0.0f);
    }
    __syncthreads();
}

/* Merges the S split partials of each (row, head): block = (head, sequence,
 * row z, z + gridDim.z, ...), am_merge_splits a row at a time: two
 * dependent round trips a row after the lengths, where a loop over the
 * splits with the loads inside waited on one per unrolled group of splits
 * (and redid every expf per dim). */
static __global__ void __launch_bounds__(128)
    attn_merge_kernel(const int32_t *__restrict__ q_start, int rows_hint, int n_heads, int D, int S,
                      const float *__restrict__ pacc, const float *__restrict__ pml, bf16 *__restrict__ out) {
    __shared__ float sw[AM_MAX_SPLITS]; /* weight of split k: e^(m_k - M), 0 when l_k = 0 */
    __shared__ float sL;                /* sum_k l_k e^(m_k - M) */
    pdl_enter(); /* before any global access: see launch_pdl */
    const int h = blockIdx.x, s = blockIdx.y;
    const int q0 = q_start[s], n_q = q_start[s + 1] - q0;
    const int nr = n_q < rows_hint ? n_q : rows_hint;
    for (int i = blockIdx.z; i < nr; i += gridDim.z)
        am_merge_splits(1, (((int64_t)s * rows_hint + i) * n_heads + h) * S, out + ((int64_t)(q0 + i) * n_heads + h) * D,
                        S, D, pacc, pml, sw, &sL);
}

/* --- split decode kernel (long contexts: max_q_len 1, head_dim 64 / 128) ----------- */
#define SD_ROWS 16 /* query heads per block, at most: one m16 slab */
#define SD_MAX_CTX (1 << 30) /* positions, at most (int arithmetic on positions stays far from overflow) */

/* K/V stages of attn_split_decode_kernel<D>: ~100 KB of tiles a block, so
 * two blocks share an SM (228 KB) with ST - 1 tiles (64 KB of K/V at either
 * head_dim) in flight each while one is computed. */
static __host__ __device__ constexpr int sd_stages(int D) { return D == 128 ? 3 : 5; }

/* int8 / e4m3 records (I8): a stage holds a tile's raw rows, [K codes | V
 * codes] (AM_BN rows of D bytes, chunks swizzled: q8_swz) then [K scales |
 * V scales] (AM_BN f32 each), half a bf16 stage's bytes, read by the tensor
 * cores as they are (am_tile_step_q8): 3 stages at head_dim 128 (~55 KB
 * with Q and the offsets), 5 at 64 (~48 KB): 4 blocks an SM, which the
 * kernel's registers allow too. */
static __host__ __device__ constexpr int sd_stages_i8(int D) { return D == 128 ? 3 : 5; }
static __host__ __device__ constexpr int sd_stage8_bytes(int D) { return 2 * AM_BN * D + 2 * AM_BN * 4; }

/* Dynamic shared memory of attn_split_decode_kernel<D> (bytes): ST stages of
 * [K tile | V tile] (AM_BN rows of D + 8 bf16), the Q slab (SD_ROWS rows),
 * the ring of per-position cache offsets (ST x AM_BN int64). The
 * epilogue's f32 slabs alias the stages. */
static constexpr int sd_smem_bytes(int D, bool I8 = false) {
    return I8 ? sd_stages_i8(D) * sd_stage8_bytes(D) + SD_ROWS * (D + 8) * 2 + sd_stages_i8(D) * AM_BN * 8
              : sd_stages(D) * 2 * AM_BN * (D + 8) * 2 + SD_ROWS * (D + 8) * 2 + sd_stages(D) * AM_BN * 8;
}

/* Block = (KV head hk x head slice, sequence s, split): the query row of s
 * for up to SD_ROWS (I8: SD_ROWS8) query heads of hk's GQA group (a larger
 * group takes ceil(group / that) slices) against the split's chunk of positions,
 * streamed through a ring of ST tiles; see the file comment. Writes the
 * split's (m, l, unnormalized acc) per head (S > 1; then either
 * attn_merge_kernel combines them) or the normalized output (S = 1).
 * prewait: stage the older K/V rows before griddepcontrol.wait
 * (splitdec_prewait); cnt_base: always NULL (the fused merge, see the file
 * comment). (Kernel parameters rather than attn_args
 * fields: attn_mma_kernel's code stays as it was.) */
template <int D, bool I8>
static __global__ void __launch_bounds__(AM_THREADS)
    attn_split_decode_kernel(attn_args a, int prewait, unsigned *__restrict__ cnt_base) {
    constexpr int ST = I8 ? sd_stages_i8(D) : sd_stages(D);
    constexpr int NW = AM_BN / 4;          /* positions per warp per tile */
    constexpr int DS = D + 8;              /* shared row stride, bf16 */
    constexpr int DN = D / 8;              /* P V n-blocks */
    constexpr int CH = D / 8;              /* 16-byte chunks per row */
    constexpr int ES = D + 8;              /* epilogue row stride, floats */
    constexpr int RSTEP = AM_THREADS / CH; /* rows between one thread's copies of a tile */
    constexpr int RPT = AM_BN / RSTEP;     /* K (and V) copies per thread per tile */
    constexpr int TILE = 2 * AM_BN * DS;   /* bf16 per stage: K tile | V tile */
    constexpr int QPT = SD_ROWS * CH / AM_THREADS; /* 16-byte query loads per thread */
    static_assert(AM_THREADS % CH == 0 && AM_BN % RSTEP == 0, "a tile is whole copy steps");
    static_assert(AM_BN <= AM_THREADS, "a thread per position for the offsets of a tile");
    static_assert(QPT * AM_THREADS == SD_ROWS * CH, "the query slab is whole loads");
    constexpr int CH8 = D / 16;            /* I8: 16-byte chunks of a row of codes */
    constexpr int RSTEP8 = AM_THREADS / CH8, RPT8 = AM_BN / RSTEP8;
    constexpr int STAGE8 = sd_stage8_bytes(D);
    constexpr int RING = I8 ? ST * STAGE8 : ST * TILE * 2; /* bytes of the stage ring */
    static_assert(AM_THREADS % CH8 == 0 && AM_BN % RSTEP8 == 0 && STAGE8 % 16 == 0, "int8 tiles are whole copies");
    static_assert((4 * 16 * ES + 2 * 4 * 16) * 4 <= RING, "the epilogue fits the stages");
    static_assert((SD_ROWS * AM_MAX_SPLITS + SD_ROWS) * 4 <= RING, "the merge's weights fit the stages");
    /* PDL (splitdec_prewait, prewait): the lengths, the block table
     * and the K/V rows of positions before this step's query row (< ctx -
     * n_q) are read BEFORE griddepcontrol.wait, as attn_decode_kernel does
     * (its comment says why none of it is written by a kernel of this
     * step); the query row, the K/V rows at positions >= ctx - n_q (this
     * step's own, stored by the previous kernel) and every global write
     * (partials, counters, output) come after it. prewait 0: the wait
     * comes first, before any global access. */
    if (FL_PDL_EARLY) pdl_trigger();
    if (!prewait) {
        pdl_wait();
        if (!FL_PDL_EARLY) pdl_trigger();
    }
    extern __shared__ __align__(16) unsigned char sm[]; /* sd_smem_bytes(D, I8) */
    __shared__ int s_last;                              /* fused merge: this block is the last split */
    bf16 *const stages = (bf16 *)sm;                    /* bf16: the ring of [K | V] tiles */
    uint8_t *const st8 = sm;                            /* I8: the ring of raw tiles (sd_stage8_bytes) */
    bf16 *const Qs = I8 ? (bf16 *)(sm + RING) : stages + ST * TILE;
    int64_t *const offs = (int64_t *)(Qs + SD_ROWS * DS); /* [ST][AM_BN]: cache offset of a tile's positions */
    float *const Eo = (float *)sm, *const Em = Eo + 4 * 16 * ES, *const El = Em + 4 * 16;

    const int tid = threadIdx.x, warp = tid >> 5;
    constexpr int SR = I8 ? SD_ROWS8 : SD_ROWS; /* query heads a block, at most */
    const int group = a.group, hsplit = (group + SR - 1) / SR;
    const int hk = (int)blockIdx.x / hsplit, hs = (int)blockIdx.x % hsplit;
    const int hper = (group + hsplit - 1) / hsplit, h0 = hk * group + hs * hper; /* first query head */
    const int nh = hper < group - hs * hper ? hper : group - hs * hper;
    const int s = blockIdx.y, split = blockIdx.z, S = a.S;
    /* An early return still passes griddepcontrol.wait under prewait: the
     * PDL chain stays ordered only because a grid completes after its own
     * wait (cuda_common.cuh), so a launch whose blocks all left before it
     * could complete while the q|k|v GEMV still runs. */
    auto leave = [&]() {
        if (prewait) pdl_wait();
    };
    /* an empty head slice: nothing to compute or write (every split of the
     * slice returns here, so its merge counter is never touched) */
    if (nh <= 0) return leave();

    /* Round trip 1: the lengths. Row 0 (the decode row) sits at position
     * ctx - n_q and sees positions 0 .. ctx - n_q; a table shorter than
     * that (a broken contract) cuts the context rather than read past it. */
    const int q0 = a.q_start[s], n_q = a.q_start[s + 1] - q0, ctx = a.ctx_len[s];
    /* no query row: nothing to write (the merge skips the sequence; every
     * split of it returns here, its counter untouched) */
    if (n_q <= 0) return leave();
    int64_t nvis = (int64_t)ctx - n_q + 1;
    if (nvis > (int64_t)a.max_blocks * a.block_size) nvis = (int64_t)a.max_blocks * a.block_size;
    if (nvis < 0) nvis = 0;
    /* this sequence's own chunk, as attn_mma_kernel's: ceil(nvis / S)
     * rounded to whole tiles, at least AM_MIN_CHUNK */
    int64_t chunk = (nvis + S - 1) / S;
    chunk = (chunk + AM_BN - 1) / AM_BN * AM_BN;
    if (chunk < AM_MIN_CHUNK) chunk = AM_MIN_CHUNK;
    const int64_t lo64 = (int64_t)split * chunk, hi64 = lo64 + chunk < nvis ? lo64 + chunk : nvis;
    const int nt = lo64 < hi64 ? (int)((hi64 - lo64 + AM_BN - 1) / AM_BN) : 0; /* tiles of the chunk */
    const int lo = nt > 0 ? (int)lo64 : 0, hi = nt > 0 ? (int)hi64 : 0;       /* lo < hi <= nvis */
    /* positions [lo, nold) were stored by earlier steps and are copied
     * before the wait; [nold, hi) (at most the decode row's own position,
     * ctx - n_q, in the last split) only after it. Without prewait the
     * wait is behind us: nold = hi. */
    const int nold = !prewait ? hi : ctx - n_q < lo ? lo : ctx - n_q < hi ? ctx - n_q : hi;

    /* out (S = 1) or the split's partial (S > 1) of head slot r, dim d */
    auto put = [&](int r, int d, float M, float L, float O) {
        const int head = h0 + r;
        if (S == 1) {
            a.out[((int64_t)q0 * a.n_heads + head) * D + d] = f2bf(L > 0.0f ? O / L : 0.0f);
        } else {
            const int64_t ps = ((int64_t)s * a.rows_hint * a.n_heads + head) * S + split;
            a.pacc[ps * D + d] = O;
            if (d == 0) {
                a.pml[2 * ps] = M;
                a.pml[2 * ps + 1] = L;
            }
        }
    };

    const int32_t *bt = a.block_tables + (int64_t)s * a.max_blocks;
    const int64_t koff = (int64_t)hk * D;
    const int bs = a.block_size;
    /* block-table entry of position tp (read only below hi: entries past
     * the context may be anything), and the element offset of its K/V row */
    auto entry = [&](int tp) -> int { return tp < hi ? bt[tp / bs] : 0; };
    auto row_off = [&](int e, int tp) -> int64_t {
        /* I8: the byte offset of the slot's record (codes at + koff, scales at + vals) */
        return I8 ? ((int64_t)e * bs + tp % bs) * a.rb : ((int64_t)e * bs + tp % bs) * a.kv_dim + koff;
    };

    /* Copies of tile jt of the chunk into stage jt % ST (its offsets from
     * ring slot jt % ST): the rows of positions in [c_lo, c_hi); with zf,
     * the rows of positions from hi on are zero-filled (a masked p = 0 must
     * not meet a NaN of stale shared memory in P V). Other rows are left
     * alone (a late copy fills them: two copies to one row would land in
     * no defined order). The caller commits. */
    const int part = tid % CH, r0 = tid / CH;
    auto copy_rows = [&](int jt, int c_lo, int c_hi, bool zf) {
        if constexpr (I8) {
            /* a row's codes as CH8 16-byte copies, its two scales by the
             * row's first thread; zero-filled rows get scale 0 */
            const uint8_t *const kc8 = (const uint8_t *)a.kc, *const vc8 = (const uint8_t *)a.vc;
            uint8_t *const Kd = st8 + (jt % ST) * STAGE8, *const Vd = Kd + AM_BN * D;
            float *const Ksd = (float *)(Vd + AM_BN * D), *const Vsd = Ksd + AM_BN;
            const int64_t *const of = offs + (jt % ST) * AM_BN;
            const int t0 = lo + jt * AM_BN, p8 = tid % CH8, q0r = tid / CH8;
            const int64_t soff = a.vals + (int64_t)hk * 4;
            int64_t off[RPT8];
#pragma unroll
            for (int k = 0; k < RPT8; k++) off[k] = of[q0r + k * RSTEP8];
#pragma unroll
            for (int k = 0; k < RPT8; k++) {
                const int r = q0r + k * RSTEP8, t = t0 + r;
                const bool ok = t >= c_lo && t < c_hi;
                if (ok || (zf && t >= hi)) {
                    const int dc = r * D + ((p8 ^ q8_swz<D>(r)) << 4); /* see am_tile_step_q8 */
                    am_cp16(Kd + dc, ok ? kc8 + off[k] + koff + p8 * 16 : kc8, ok);
                    am_cp16(Vd + dc, ok ? vc8 + off[k] + koff + p8 * 16 : vc8, ok);
                    if (p8 == 0) {
                        am_cp4(Ksd + r, ok ? kc8 + off[k] + soff : kc8, ok);
                        am_cp4(Vsd + r, ok ? vc8 + off[k] + soff : vc8, ok);
                    }
                }
            }
        } else {
            bf16 *const Kd = stages + (jt % ST) * TILE, *const Vd = Kd + AM_BN * DS;
            const int64_t *const of = offs + (jt % ST) * AM_BN;
            const int t0 = lo + jt * AM_BN;
            int64_t off[RPT]; /* all offsets read before the copies (am_cp16 orders memory) */
#pragma unroll
            for (int k = 0; k < RPT; k++) off[k] = of[r0 + k * RSTEP] + part * 8;
#pragma unroll
            for (int k = 0; k < RPT; k++) {
                const int r = r0 + k * RSTEP, t = t0 + r;
                const bool ok = t >= c_lo && t < c_hi;
                if (ok || (zf && t >= hi)) {
                    am_cp16(Kd + r * DS + part * 8, ok ? a.kc + off[k] : a.kc, ok);
                    am_cp16(Vd + r * DS + part * 8, ok ? a.vc + off[k] : a.vc, ok);
                }
            }
        }
    };
    /* Tile jt in full, one group. Tiles past the chunk commit an empty
     * group, so the group count stays uniform: groups 0 .. ST - 2 (before
     * the wait), then L (the late rows, after it: possibly empty), then ST -
     * 1, ST, ... from the loop. At iteration j, ST - 1 groups newer than
     * tile j's are committed (ST when L is newer too), so waiting for all
     * but the newest ST - 1 lands tile j, except its late rows (group L):
     * a tile with late rows waits for all. */
    auto issue = [&](int jt) {
        if (jt < nt) copy_rows(jt, lo, hi, true);
        asm volatile("cp.async.commit_group;" ::: "memory");
    };

    if (nt > 0) {
        /* Round trip 2 (before the wait with prewait): the offsets of the
         * first ST tiles, a thread per position, all entries requested
         * before any is used; then the first ST - 1 tiles' rows below nold. */
        if (tid < AM_BN) {
            int e[ST];
#pragma unroll
            for (int jt = 0; jt < ST; jt++) e[jt] = entry(lo + jt * AM_BN + tid);
#pragma unroll
            for (int jt = 0; jt < ST; jt++) offs[jt * AM_BN + tid] = row_off(e[jt], lo + jt * AM_BN + tid);
        }
        __syncthreads();
#pragma unroll
        for (int jt = 0; jt < ST - 1; jt++) {
            if (jt < nt) copy_rows(jt, lo, nold, true);
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
    }
    if (prewait) {
        pdl_wait(); /* q and this step's K/V rows come from the previous kernels */
        if (!FL_PDL_EARLY) pdl_trigger();
    }

    if (nt == 0) { /* the split sees nothing: l = 0 (the merge skips it), or zeros */
        for (int idx = tid; idx < nh * D; idx += AM_THREADS) put(idx / D, idx % D, -FLT_MAX, 0.0f, 0.0f);
    } else {
        /* The query row's heads (zeros past nh: the slab's padding rows
         * compute on zeros and are never written), all loads in flight
         * before any store; then the late rows of the first ST - 1 tiles
         * (group L, committed by every thread, empty when there are none). */
        uint4 qv[QPT];
#pragma unroll
        for (int k = 0; k < QPT; k++) {
            const int c = tid + k * AM_THREADS, r = c / CH, pc = c % CH;
            qv[k] = r < nh ? *(const uint4 *)(a.q + (int64_t)q0 * a.q_stride + (int64_t)(h0 + r) * D + pc * 8)
                           : make_uint4(0u, 0u, 0u, 0u);
        }
        if (nold < hi) {
#pragma unroll
            for (int jt = 0; jt < ST - 1; jt++)
                if (jt < nt && lo + (jt + 1) * AM_BN > nold) copy_rows(jt, nold, hi, false);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
#pragma unroll
        for (int k = 0; k < QPT; k++) {
            const int c = tid + k * AM_THREADS, r = c / CH, pc = c % CH;
            *(uint4 *)(Qs + r * DS + pc * 8) = qv[k];
        }
        __syncthreads();
        uint32_t qf[I8 ? 1 : D / 16][4], qb[I8 ? D / 16 : 1][2];
        if constexpr (I8) am_load_qb_q8<D>(Qs, a.scale, qb);
        else am_load_qf<D>(Qs, 0, qf);

        float m[2] = {-FLT_MAX, -FLT_MAX}, l[2] = {0.0f, 0.0f};
        float o[I8 ? DN / 2 : DN][4], osc = 1.0f; /* I8: O^T / osc (am_tile_step_q8) */
#pragma unroll
        for (int n = 0; n < (I8 ? DN / 2 : DN); n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        const int pw = warp * NW; /* the 4 warps split each tile's positions */
        for (int j = 0; j < nt; j++) {
            /* the stage of tile j + ST - 1 is tile j - 1's, freed by the
             * barrier that ended iteration j - 1; its offsets were stored
             * before it */
            issue(j + ST - 1);
            /* the block-table entry for tile j + ST, requested now and stored
             * after this tile's math (its latency hides behind it) into tile
             * j's ring slot, which was last read when tile j was issued */
            const int tp_next = lo + (j + ST) * AM_BN + tid;
            const int e_next = tid < AM_BN ? entry(tp_next) : 0;
            if (j < ST - 1 && nold < hi && lo + (j + 1) * AM_BN > nold)
                asm volatile("cp.async.wait_all;" ::: "memory"); /* tile j has late rows (group L) */
            else
                asm volatile("cp.async.wait_group %0;" ::"n"(ST - 1) : "memory");
            __syncthreads();
            const int kp0 = lo + j * AM_BN + pw;
            /* warp-uniform: skip a part past the chunk; the chunk's end is
             * the only mask (the row sees every position below nvis >= hi) */
            if constexpr (I8) {
                const uint8_t *const K8 = st8 + (j % ST) * STAGE8, *const V8 = K8 + AM_BN * D;
                const float *const Ksc = (const float *)(V8 + AM_BN * D), *const Vsc = Ksc + AM_BN;
                if (kp0 < hi) am_tile_step_q8<D>(K8, V8, Ksc, Vsc, pw, kp0, qb, hi, a.fp8 != 0, m, l, o, osc);
            } else {
                const bf16 *Ks = stages + (j % ST) * TILE, *Vs = Ks + AM_BN * DS;
                if (kp0 < hi) am_tile_step<D, NW>(Ks, Vs, pw, kp0, qf, hi - 1, hi - 1, hi, a.scale, m, l, o);
            }
            if (tid < AM_BN) offs[(j % ST) * AM_BN + tid] = row_off(e_next, tp_next);
            __syncthreads(); /* stage j % ST is reloaded, and the new offsets read, next iteration */
        }

        /* epilogue: the 4 warps' states merged through shared memory
         * (aliasing the stages: the groups still pending are empty ones) */
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        if constexpr (I8) {
#pragma unroll
            for (int n = 0; n < DN / 2; n++) o[n][0] *= osc, o[n][1] *= osc, o[n][2] *= osc, o[n][3] *= osc;
            am_stash_q8<D>(Eo, Em, El, m, l, o);
        } else {
            am_stash<D>(Eo, Em, El, m, l, o);
        }
        __syncthreads();
        for (int idx = tid; idx < nh * D; idx += AM_THREADS) {
            const int r = idx / D, d = idx % D;
            float M, L, O;
            am_merge_warps<D, 4>(Eo, Em, El, 0, r, d, M, L, O);
            put(r, d, M, L, O);
        }
    }

    /* Fused merge (cnt_base, S > 1): every split block of this (head slice,
     * sequence) counts itself once its partials are visible (each writer's
     * __threadfence, then the barrier, then one thread's atomic); the block
     * that counts last (old value S - 1) fences again and reads all S
     * partials (L2, __ldcg: never an L1 line of this SM), writes the output
     * rows of its heads and puts the counter back to 0 for the next call
     * (no other block touches it in this launch: all S have counted). */
    if (S > 1 && cnt_base) {
        unsigned *const cnt = cnt_base + ((int64_t)s * gridDim.x + blockIdx.x);
        __threadfence();
        __syncthreads(); /* also: every thread is done with the stages (Eo) */
        if (tid == 0) s_last = atomicAdd(cnt, 1u) == (unsigned)(S - 1);
        __syncthreads();
        if (s_last) {
            __threadfence();
            float *const sw = (float *)sm, *const sL = sw + SD_ROWS * AM_MAX_SPLITS; /* alias the stages */
            am_merge_splits(nh, ((int64_t)s * a.rows_hint * a.n_heads + h0) * S,
                            a.out + ((int64_t)q0 * a.n_heads + h0) * D, S, D, a.pacc, a.pml, sw, sL);
            if (tid == 0) *cnt = 0u;
        }
    }
}

/* --- GQA decode kernel (short contexts, head_dim a multiple of 8 up to 256) -------- */
#define AD_THREADS 256
#define AD_WARPS (AD_THREADS / 32)
#define AD_MAX_T 128 /* positions staged in shared memory, at most (= AM_MIN_CHUNK) */
#define AD_HEADS 4   /* query heads per block, at most */

typedef struct attn_dec_args {
    const bf16 *q;
    int q_stride;
    const int32_t *q_start, *ctx_len, *block_tables;
    int max_blocks, block_size;
    int n_heads, group, hsplit, head_dim;
    int T; /* positions the shared K/V rows hold: max_ctx_len rounded up to 8 */
    int prewait; /* stage the rows of earlier steps before griddepcontrol.wait (attn_prewait) */
    float scale;
    int64_t kv_dim;
    const bf16 *kc, *vc;
    bf16 *out;
} attn_dec_args;

/* Dynamic shared memory of attn_decode_kernel (bytes): T rows of K and of V,
 * each (head_dim / 8) | 1 16-byte units long (odd: 8 consecutive rows read
 * at one column hit 8 distinct bank groups). */
static constexpr size_t ad_smem_bytes(int T, int D) { return (size_t)2 * T * ((D / 8) | 1) * 16; }

/* 16 bytes global -> shared. No "memory" clobber, unlike am_cp16: the
 * issuing loop then keeps its shared-memory reads of row offsets in flight
 * instead of waiting for each one behind the previous copy; the wait below
 * (cp.async.wait_all, with the clobber) and __syncthreads order the reads
 * of the copied rows. */
static __device__ __forceinline__ void ad_cp16(void *dst, const void *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}

/* Block = (KV head hk x head slice, sequence s): up to AD_HEADS query heads
 * of hk's GQA group (hsplit blocks share a group larger than that). See the
 * file comment for the phases. */
static __global__ void __launch_bounds__(AD_THREADS) attn_decode_kernel(attn_dec_args a) {
    extern __shared__ __align__(16) unsigned char ad_sm[]; /* K rows | V rows, ad_smem_bytes(T, D) */
    __shared__ int64_t sm_off[AD_MAX_T];                   /* cache element offset of position t */
    __shared__ __align__(16) float qs[AD_HEADS][ATT_MAX_D]; /* the block's query heads, f32 */
    __shared__ __align__(16) float sp[AD_HEADS][AD_MAX_T];  /* scores, then softmax numerators */
    __shared__ float wm[AD_HEADS][AD_MAX_T / 4];            /* per-warp score maxima (>= 4 positions a warp) */
    __shared__ __align__(16) float red[AD_WARPS][64];       /* P V partials across warps */
    __shared__ float redl[AD_WARPS];
    /* PDL: the lengths, the block table and the K/V rows of positions
     * before this step's query rows are read BEFORE griddepcontrol.wait.
     * None of it is written by a kernel of this step: the step's tables are
     * uploaded (a copy, which PDL does not overlap) before its first kernel,
     * and this step's kernels store K/V only at its own rows' positions
     * (distinct positions, distinct slots); the older rows were stored by
     * earlier steps, which the host has waited for (the logits or sampled
     * ids come back at every step's end). So round trip 1 and most of round
     * trip 2 overlap the q|k|v GEMV; after the wait only the query rows and
     * the K/V rows of this step's positions are left to load. */
    if (FL_PDL_EARLY) pdl_trigger();
    const int D = a.head_dim, CH = D >> 3, RS = CH | 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int s = blockIdx.y, hk = (int)blockIdx.x / a.hsplit, hs = (int)blockIdx.x % a.hsplit;
    const int hper = (a.group + a.hsplit - 1) / a.hsplit;
    const int h0 = hk * a.group + hs * hper; /* first query head of the block */
    const int nh = hper < a.group - hs * hper ? hper : a.group - hs * hper;
    if (nh <= 0) return; /* not with the host's hsplit = ceil(group / heads a block) */
    const int T = a.T;
    const int32_t *bt = a.block_tables + (int64_t)s * a.max_blocks;
    const int64_t koff = (int64_t)hk * D;

    /* Round trip 1: the sequence's lengths and every block-table entry the
     * staged positions can use, all at once (entries past the context are
     * in the table, only never used). */
    const int q0 = a.q_start[s], n_q = a.q_start[s + 1] - q0, ctx = a.ctx_len[s];
    if (tid < T) {
        const int b = tid / a.block_size;
        sm_off[tid] = b < a.max_blocks ? ((int64_t)bt[b] * a.block_size + tid % a.block_size) * a.kv_dim + koff : 0;
    }
    __syncthreads();
    /* Round trip 2: every K and V row of the context in flight at once
     * (16-byte copies, a row per CH threads), then the query rows. A context
     * longer than T (max_ctx_len did not bound ctx_len, a broken contract)
     * is cut at T rather than overrun shared memory. */
    bf16 *const Ks = (bf16 *)ad_sm, *const Vs = Ks + (size_t)T * RS * 8;
    /* no query row: nothing to stage (or wait for); a table shorter than the
     * context (a broken contract) cuts it, as attn_split_decode_kernel does */
    const int64_t tab = (int64_t)a.max_blocks * a.block_size;
    const int nkv = n_q <= 0 ? 0 : (int)(ctx < T ? (ctx < tab ? ctx : tab) : (T < tab ? T : tab));
    /* positions [0, nold) were stored by earlier steps (see the top) */
    const int nold = n_q <= 0 || !a.prewait ? 0 : ctx - n_q < 0 ? 0 : ctx - n_q < nkv ? ctx - n_q : nkv;
    /* copies of the K and V rows [t_lo, t_hi) */
    auto stage = [&](int t_lo, int t_hi) {
        const int rows_per = AD_THREADS / CH, part = tid % CH;
        if (tid >= rows_per * CH) return;
        /* 4 rows a step, their offsets read before any copy is issued (no
         * read waits behind a copy; the index is clamped, not branched on) */
        for (int t = t_lo + tid / CH; t < t_hi; t += 4 * rows_per) {
            int64_t off[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int tk = t + k * rows_per;
                off[k] = sm_off[tk < T ? tk : T - 1] + part * 8;
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int tk = t + k * rows_per;
                if (tk < t_hi) {
                    ad_cp16(Ks + ((size_t)tk * RS + part) * 8, a.kc + off[k]);
                    ad_cp16(Vs + ((size_t)tk * RS + part) * 8, a.vc + off[k]);
                }
            }
        }
    };
    stage(0, nold);
    pdl_wait(); /* q and this step's K/V rows come from the previous kernels */
    if (!FL_PDL_EARLY) pdl_trigger();
    stage(nold, nkv);
    const uint4 *const K4 = (const uint4 *)Ks, *const V4 = (const uint4 *)Vs;

    /* Query rows of the sequence (one at decode; more only when the caller's
     * max_q_len = 1 was wrong, handled alike from the same staged rows). */
    for (int i = 0; i < n_q; i++) {
        int nvis = ctx - n_q + i + 1; /* row i sits at position ctx - n_q + i */
        if (nvis > nkv) nvis = nkv;
        if (tid < nh * CH) {
            const int h = tid / CH, part = tid % CH;
            const uint4 u = *(const uint4 *)(a.q + (int64_t)(q0 + i) * a.q_stride + (int64_t)(h0 + h) * D + part * 8);
            float f[8];
            bf16x8_unpack(u, f);
            *(float4 *)&qs[h][part * 8] = make_float4(f[0], f[1], f[2], f[3]);
            *(float4 *)&qs[h][part * 8 + 4] = make_float4(f[4], f[5], f[6], f[7]);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        bf16 *const o = a.out + ((int64_t)(q0 + i) * a.n_heads + h0) * D;
        if (nvis <= 0) { /* no visible position (ctx 0: a padding sequence): zeros */
            for (int e = tid; e < nh * D; e += AD_THREADS) o[e] = f2bf(0.0f);
            continue;
        }

        /* S = Q K^T * scale: a warp takes PP positions x TP lanes each (the
         * lanes of a position split head_dim: chunks ds, ds + TP, ...), all
         * nh heads per K chunk read (one conversion serves them), TP as
         * large as keeps the positions within one pass of the 8 warps. */
        int TP = 8;
        while (TP > 1 && (nvis * TP + 31) / 32 > AD_WARPS) TP >>= 1;
        const int PP = 32 / TP, p = lane & (PP - 1), ds = lane / PP;
        const int npb = (nvis + PP - 1) / PP;
        for (int pb = warp; pb < npb; pb += AD_WARPS) {
            const int t = pb * PP + p, tr = t < nvis ? t : nvis - 1;
            const uint4 *krow = K4 + (size_t)tr * RS;
            float acc[AD_HEADS];
#pragma unroll
            for (int h = 0; h < AD_HEADS; h++) acc[h] = 0.0f;
            for (int c = ds; c < CH; c += TP) {
                float kf[8];
                bf16x8_unpack(krow[c], kf);
#pragma unroll
                for (int h = 0; h < AD_HEADS; h++) {
                    if (h < nh) {
                        const float4 qa = *(const float4 *)&qs[h][c * 8], qb = *(const float4 *)&qs[h][c * 8 + 4];
                        float v = acc[h];
                        v = fmaf(qa.x, kf[0], v);
                        v = fmaf(qa.y, kf[1], v);
                        v = fmaf(qa.z, kf[2], v);
                        v = fmaf(qa.w, kf[3], v);
                        v = fmaf(qb.x, kf[4], v);
                        v = fmaf(qb.y, kf[5], v);
                        v = fmaf(qb.z, kf[6], v);
                        v = fmaf(qb.w, kf[7], v);
                        acc[h] = v;
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < AD_HEADS; h++) {
                if (h < nh) { /* block-uniform: every lane takes part in the shuffles */
                    float v = acc[h];
                    for (int off = PP; off < 32; off <<= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
                    v = t < nvis ? v * a.scale : -INFINITY;
                    if (ds == 0 && t < nvis) sp[h][t] = v;
                    for (int off = 1; off < PP; off <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
                    if (lane == 0) wm[h][pb] = v; /* finite: position pb * PP is visible */
                }
            }
        }
        __syncthreads();
        /* P = exp(S - max): the exact max over the row (no rescaling later),
         * so p <= 1 and the max's p is 1 (the sum below is >= 1) */
        for (int e = tid; e < nh * nvis; e += AD_THREADS) {
            const int h = e / nvis, t = e - h * nvis;
            float M = wm[h][0];
            for (int b = 1; b < npb; b++) M = fmaxf(M, wm[h][b]);
            sp[h][t] = expf(sp[h][t] - M);
        }
        __syncthreads();

        /* O = P V / sum P: a warp takes (head, 8 chunks of 8 dims) x 4
         * position slices (lanes c_lo + 8 ts_lo: the 8 lanes reading one V
         * row read 128 contiguous bytes); when fewer than 8 such tasks
         * exist, TSW warps split the positions further and merge their
         * partials in shared memory. */
        const int CHB = (CH + 7) >> 3, UG = nh * CHB;
        const int TSW = UG >= AD_WARPS ? 1 : AD_WARPS / UG, TS = 4 * TSW;
        const int c_lo = lane & 7, ts_lo = lane >> 3;
        for (int task = warp; task < UG * TSW; task += AD_WARPS) {
            const int ug = task % UG, ts = (task / UG) * 4 + ts_lo;
            const int h = ug / CHB, c = (ug % CHB) * 8 + c_lo;
            float acc[8], l = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) acc[j] = 0.0f;
            if (c < CH) {
#pragma unroll 4
                for (int t = ts; t < nvis; t += TS) {
                    const float pt = sp[h][t];
                    float vf[8];
                    bf16x8_unpack(V4[(size_t)t * RS + c], vf);
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[j] = fmaf(pt, vf[j], acc[j]);
                    l += pt;
                }
            }
#pragma unroll
            for (int off = 8; off < 32; off <<= 1) {
                l += __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
            }
            if (ts_lo == 0 && c < CH) {
                if (TSW == 1) {
                    uint4 u;
                    u.x = am_pack(acc[0] / l, acc[1] / l);
                    u.y = am_pack(acc[2] / l, acc[3] / l);
                    u.z = am_pack(acc[4] / l, acc[5] / l);
                    u.w = am_pack(acc[6] / l, acc[7] / l);
                    *(uint4 *)(o + (int64_t)h * D + c * 8) = u;
                } else {
                    *(float4 *)&red[task][c_lo * 8] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    *(float4 *)&red[task][c_lo * 8 + 4] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                    if (c_lo == 0) redl[task] = l;
                }
            }
        }
        if (TSW > 1) {
            __syncthreads();
            for (int e = tid; e < UG * 64; e += AD_THREADS) {
                const int ug = e >> 6, r = e & 63, h = ug / CHB, c = (ug % CHB) * 8 + (r >> 3);
                if (c >= CH) continue;
                float v = 0.0f, L = 0.0f;
                for (int w = 0; w < TSW; w++) {
                    v += red[w * UG + ug][r];
                    L += redl[w * UG + ug];
                }
                o[(int64_t)h * D + c * 8 + (r & 7)] = f2bf(v / L);
            }
        }
        __syncthreads(); /* qs, sp, wm and red are reused by the next row */
    }
}

static int g_kernel_policy = FL_CUDA_ATTN_AUTO, g_split_policy = 0, g_stage_policy = 0;

extern "C" void fl_cuda_attention_set_policy(fl_cuda_attn_kernel kernel, int splits, int stages) {
    g_kernel_policy = kernel;
    g_split_policy = splits > 0 ? splits : 0;
    g_stage_policy = stages == 1 || stages == 2 ? stages : 0;
}

/* attn_split_decode_kernel's modes: -1 = the environment's (below), 0 / 1. */
static int g_sd_prewait = -1;

extern "C" void fl_cuda_attention_set_split_modes(int prewait) { g_sd_prewait = prewait < 0 ? -1 : prewait != 0; }

/* Shared memory of attn_mma_kernel<D, *, ST> (bytes): ST stages of K and V
 * tiles, or the epilogue's f32 slabs if larger. */
static constexpr int am_smem_bytes(int D, int ST) {
    return ST * 2 * AM_BN * (D + 8) * 2 > 4 * 16 * (D + 8) * 4 + 4 * 16 * 2 * 4
               ? ST * 2 * AM_BN * (D + 8) * 2
               : 4 * 16 * (D + 8) * 4 + 4 * 16 * 2 * 4;
}

/* Once per device and kernel instance (the first call of a shape is eager:
 * the engine runs a step before capturing one): opts kern in to more than
 * 48 KB of shared memory where needed and asks how many blocks fit on an
 * SM. occ_for is the kernel instance's cache (0: not prepared on that
 * device yet). */
static fl_status attn_prepare(fl_cuda *c, const void *kern, int smem, int (&occ_for)[64], int *occ) {
    const int dev = c->device >= 0 && c->device < 64 ? c->device : -1;
    if (dev >= 0 && occ_for[dev] > 0) {
        *occ = occ_for[dev];
        return FL_OK;
    }
    if ((size_t)smem > c->smem_optin)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda attention: needs %d bytes of shared memory (device has %zu)", smem,
                      c->smem_optin);
    if (smem > 48 * 1024)
        FL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int n = 0;
    FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, AM_THREADS, smem));
    if (n < 1) n = 1;
    if (dev >= 0) occ_for[dev] = n;
    *occ = n;
    return FL_OK;
}

template <int D, int WM, int ST, bool I8 = false>
static fl_status mma_prepare(fl_cuda *c, int *occ) {
    static int occ_for[64];
    return attn_prepare(c, (const void *)attn_mma_kernel<D, WM, ST, I8>, am_smem_bytes(D, ST), occ_for, occ);
}

template <int D, bool I8>
static fl_status sd_prepare(fl_cuda *c, int *occ) {
    static int occ_for[64];
    return attn_prepare(c, (const void *)attn_split_decode_kernel<D, I8>, sd_smem_bytes(D, I8), occ_for, occ);
}

template <int D, int WM, int ST, bool I8>
static fl_status launch_mma(fl_cuda *c, const attn_args &a, dim3 grid) {
    int occ;
    const fl_status st = mma_prepare<D, WM, ST, I8>(c, &occ);
    if (st != FL_OK) return st;
    /* PDL (see launch_pdl): the next kernel, the W4 GEMV of the output
     * projection, requests its weights while attention runs */
    return launch_pdl(attn_mma_kernel<D, WM, ST, I8>, grid, dim3(AM_THREADS), am_smem_bytes(D, ST), c->stream, a);
}

/* The attn_decode override at 0 keeps short-context decode on the SIMT
 * kernel (the A/B against attn_decode_kernel; a forced FL_CUDA_ATTN_DECODE
 * policy still takes it). */
static bool attn_decode_on(void) { return cuda_tune_on(FL_CUDA_TUNE_ATTN_DECODE); }

/* Query heads a block of attn_decode_kernel serves (1..AD_HEADS): the
 * override of fl_cuda_attention_set_decode_heads, else the attn_dec_heads
 * one (cuda_tune.h), else the fewest of 1, 2, 4 that keep the grid (KV heads x
 * head slices x sequences) within two blocks an SM. Fewer heads a block
 * make more blocks of shorter dependent chains (each block re-reads its KV
 * head's rows; the other slices of a GQA group find them in L2): measured
 * alone and end to end, the fewest heads a block won while the grid stays
 * within two blocks an SM, and more heads a block won past that. */
static int g_dec_heads = 0;
static int attn_dec_heads(const fl_cuda *c, int n_kv_heads, int group, int n_seqs) {
    if (g_dec_heads > 0) return g_dec_heads;
    const long tuned = fl_cuda_tune(FL_CUDA_TUNE_ATTN_DEC_HEADS);
    if (tuned > 0 && tuned <= AD_HEADS) return (int)tuned;
    for (int h = 1; h < AD_HEADS; h *= 2)
        if ((int64_t)n_kv_heads * ((group + h - 1) / h) * n_seqs <= 2 * (int64_t)c->n_sm) return h;
    return AD_HEADS;
}

extern "C" void fl_cuda_attention_set_decode_heads(int heads) {
    g_dec_heads = heads >= 1 && heads <= AD_HEADS ? heads : 0;
}

/* The attn_prewait override at 0: attn_decode_kernel stages every K/V row
 * after griddepcontrol.wait (the A/B of its early staging). */
static bool attn_prewait_on(void) { return cuda_tune_on(FL_CUDA_TUNE_ATTN_PREWAIT); }

/* The attn_splitdec override at 0 keeps long-context decode on the split
 * tensor-core kernel attn_mma_kernel (the A/B against
 * attn_split_decode_kernel; a forced FL_CUDA_ATTN_SPLITDEC policy still
 * takes it). */
static bool attn_splitdec_on(void) { return cuda_tune_on(FL_CUDA_TUNE_ATTN_SPLITDEC); }

/* Prewait off (fl_cuda_attention_set_split_modes or the splitdec_prewait
 * override at 0): attn_split_decode_kernel waits (griddepcontrol.wait)
 * before any global access instead of staging the older K/V rows first. */
static bool sd_prewait_on(void) {
    return g_sd_prewait >= 0 ? g_sd_prewait == 1 : cuda_tune_on(FL_CUDA_TUNE_SPLITDEC_PREWAIT);
}

/* Once per device: opts attn_decode_kernel in to the dynamic shared memory
 * of its largest staging (AD_MAX_T positions at head_dim 256, 132 KiB) or
 * as much as the device allows next to its static arrays, and returns that
 * amount; a call that needs more takes attention_kernel. */
static fl_status dec_prepare(fl_cuda *c, size_t *max_dyn) {
    static size_t dyn_for[64]; /* 0: not prepared on that device yet */
    const int dev = c->device >= 0 && c->device < 64 ? c->device : -1;
    if (dev >= 0 && dyn_for[dev] > 0) {
        *max_dyn = dyn_for[dev];
        return FL_OK;
    }
    cudaFuncAttributes fa;
    FL_CUDA_CHECK(cudaFuncGetAttributes(&fa, attn_decode_kernel));
    size_t want = ad_smem_bytes(AD_MAX_T, ATT_MAX_D);
    const size_t avail = c->smem_optin > fa.sharedSizeBytes ? c->smem_optin - fa.sharedSizeBytes : 0;
    if (want > avail) want = avail;
    if (want > 0)
        FL_CUDA_CHECK(cudaFuncSetAttribute(attn_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)want));
    if (dev >= 0) dyn_for[dev] = want;
    *max_dyn = want;
    return FL_OK;
}

/* The tensor-core kernels' arguments for one call (S = 1, no partials yet). */
static attn_args attn_args_of(const void *q, int q_stride, const fl_attn_meta *m, int n_heads, int n_kv_heads,
                              int head_dim, int rows_hint, float scale, const void *k_cache, const void *v_cache,
                              void *out) {
    attn_args a;
    a.q = (const bf16 *)q;
    a.q_stride = q_stride;
    a.q_start = m->q_start;
    a.ctx_len = m->ctx_len;
    a.block_tables = m->block_tables;
    a.max_blocks = m->max_blocks;
    a.block_size = m->block_size;
    a.n_heads = n_heads;
    a.group = n_heads / n_kv_heads;
    a.rows_hint = rows_hint;
    a.S = 1;
    a.scale = scale;
    a.kv_dim = (int64_t)n_kv_heads * head_dim;
    a.rb = 0;
    a.vals = 0;
    a.fp8 = 0;
    a.kc = (const bf16 *)k_cache;
    a.vc = (const bf16 *)v_cache;
    a.out = (bf16 *)out;
    a.pacc = NULL;
    a.pml = NULL;
    return a;
}

/* a.S > 1: points a.pacc / a.pml into the attention workspace, sized for
 * n_seqs x a.rows_hint x a.n_heads x a.S partials of head_dim floats plus
 * (m, l). */
static fl_status attn_partials(fl_backend *b, attn_args &a, int n_seqs, int head_dim) {
    const size_t n_part = (size_t)n_seqs * a.rows_hint * a.n_heads * a.S;
    float *ws = NULL;
    FL_TRY(fl_cuda_workspace_get(b, FL_CUDA_WS_SLOT_ATTN, sizeof(float) * n_part * (head_dim + 2), "cuda attention",
                                 &ws));
    a.pacc = ws;
    a.pml = ws + n_part * head_dim;
    return FL_OK;
}

/* attn_merge_kernel over a's partials: block per (head, sequence, row z). */
static fl_status attn_merge(fl_cuda *c, const attn_args &a, int n_seqs, int head_dim) {
    const int z = a.rows_hint < 64 ? a.rows_hint : 64;
    const dim3 mgrid((unsigned)a.n_heads, (unsigned)n_seqs, (unsigned)z);
    return launch_pdl(attn_merge_kernel, mgrid, dim3(128), 0, c->stream, a.q_start, a.rows_hint, a.n_heads, head_dim,
                      a.S, (const float *)a.pacc, (const float *)a.pml, a.out);
}

/* Decode (a.rows_hint 1) on attn_split_decode_kernel, head_dim 64 / 128,
 * 16-byte aligned rows (the caller checked): S splits such that (KV heads
 * x head slices x sequences x S) blocks make one full wave (blocks per SM
 * from the occupancy query: 2 by shared memory, 4 over quantized
 * records), at least AM_MIN_CHUNK
 * positions a split, the partials within ATTN_WS_BUDGET (else fewer
 * splits; S = 1 needs none and writes the output itself); a forced split
 * count (fl_cuda_attention_set_policy) replaces the wave rule. */
static fl_status split_decode(fl_backend *b, fl_cuda *c, attn_args a, int n_seqs, int max_ctx_len, int n_kv_heads,
                              int head_dim) {
    const bool i8 = a.rb > 0;
    const int rows = i8 ? SD_ROWS8 : SD_ROWS, hsplit = (a.group + rows - 1) / rows;
    int occ = 1;
    FL_TRY(head_dim == 128 ? (i8 ? sd_prepare<128, true>(c, &occ) : sd_prepare<128, false>(c, &occ))
                           : (i8 ? sd_prepare<64, true>(c, &occ) : sd_prepare<64, false>(c, &occ)));
    const int64_t base = (int64_t)n_kv_heads * hsplit * n_seqs;
    int64_t want = g_split_policy > 0 ? g_split_policy : (int64_t)occ * c->n_sm / base;
    const int64_t by_ctx = ((int64_t)max_ctx_len + AM_MIN_CHUNK - 1) / AM_MIN_CHUNK;
    const size_t per_split = sizeof(float) * (size_t)n_seqs * (size_t)a.n_heads * (size_t)(head_dim + 2);
    const int64_t by_ws = (int64_t)(ATTN_WS_BUDGET / per_split);
    if (want > by_ctx) want = by_ctx;
    if (want > by_ws) want = by_ws;
    if (want > AM_MAX_SPLITS) want = AM_MAX_SPLITS;
    a.S = want > 1 ? (int)want : 1;
    const int prewait = sd_prewait_on() ? 1 : 0;
    if (a.S > 1) FL_TRY(attn_partials(b, a, n_seqs, head_dim));
    const dim3 grid((unsigned)(n_kv_heads * hsplit), (unsigned)n_seqs, (unsigned)a.S);
    /* PDL (see launch_pdl): the merge, or the output projection's GEMV,
     * launches while this runs */
    typedef void (*sd_kernel)(attn_args, int, unsigned *);
    const sd_kernel kern = head_dim == 128 ? (i8 ? attn_split_decode_kernel<128, true> : attn_split_decode_kernel<128, false>)
                                           : (i8 ? attn_split_decode_kernel<64, true> : attn_split_decode_kernel<64, false>);
    FL_TRY(launch_pdl(kern, grid, dim3(AM_THREADS), (size_t)sd_smem_bytes(head_dim, i8), c->stream, a, prewait,
                      (unsigned *)NULL));
    return a.S > 1 ? attn_merge(c, a, n_seqs, head_dim) : FL_OK;
}

extern "C" fl_status fl_cuda_attention(fl_backend *b, const void *q, int q_stride, const fl_attn_meta *m,
                                       int n_heads, int n_kv_heads, int head_dim, float scale,
                                       const void *k_cache, const void *v_cache, void *out) {
    if (head_dim > ATT_MAX_D || head_dim <= 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads)
        return FL_ERR(head_dim > ATT_MAX_D ? FL_ERR_UNSUPPORTED : FL_ERR_INVALID_ARG,
                      "cuda attention: heads %d / kv heads %d / head_dim %d (head_dim at most %d)",
                      n_heads, n_kv_heads, head_dim, ATT_MAX_D);
    if (m->n_seqs <= 0 || m->block_size <= 0 || m->max_blocks < 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda attention: %d sequences, block size %d, %d blocks per table",
                      m->n_seqs, m->block_size, m->max_blocks);
    if (m->max_ctx_len <= 0) return FL_OK; /* no sequence has a token */
    if (m->n_seqs > 65535)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda attention: %d sequences in one call (at most 65535)",
                      m->n_seqs);
    fl_cuda *c = cuda_impl(b);
    const int group = n_heads / n_kv_heads;
    /* Query rows live in device memory (q_start); the grid is sized from the
     * host-known max_q_len (or, when the caller leaves it 0, max_ctx_len,
     * which bounds every sequence's query count), so there is no host read
     * in the step. */
    const int rows_hint = m->max_q_len > 0 ? m->max_q_len : m->max_ctx_len;

    /* Tensor-core kernel: head_dim 64 / 128 and 16-byte aligned rows (its
     * loads are 16 bytes wide). */
    const bool aligned = q_stride % 8 == 0 && (uintptr_t)q % 16 == 0 && (uintptr_t)k_cache % 16 == 0 &&
                         (uintptr_t)v_cache % 16 == 0;
    const bool i8 = b->kv_int8_head_dim > 0;
    int64_t rb8 = 0;
    if (i8) {
        /* int8 records: decode at head_dim 64 / 128 on the split decode
         * kernel (any context), prefill there on the tensor-core kernel
         * (both widen a tile's codes to bf16 in shared memory), everything
         * else on the SIMT kernel */
        if (b->kv_int8_head_dim != head_dim)
            return FL_ERR(FL_ERR_INVALID_ARG, "cuda attention: int8 KV records of %d-value heads, head_dim %d",
                          b->kv_int8_head_dim, head_dim);
        const int64_t kv_dim = (int64_t)n_kv_heads * head_dim;
        const int64_t rb = (int64_t)fl_kv_int8_record_bytes(kv_dim, head_dim);
        if (rows_hint == 1 && (head_dim == 64 || head_dim == 128) && aligned && m->max_ctx_len <= SD_MAX_CTX &&
            g_kernel_policy != FL_CUDA_ATTN_SIMT) {
            attn_args a = attn_args_of(q, q_stride, m, n_heads, n_kv_heads, head_dim, 1, scale, k_cache, v_cache, out);
            a.rb = rb;
            a.vals = (int)((kv_dim + 3) & ~3);
            a.fp8 = b->kv_fp8_codes;
            return split_decode(b, c, a, m->n_seqs, m->max_ctx_len, n_kv_heads, head_dim);
        }
        rb8 = rb;
        const bool mma8 = (head_dim == 64 || head_dim == 128) && aligned && g_kernel_policy != FL_CUDA_ATTN_SIMT;
        const int z = rows_hint < 64 ? rows_hint : 64;
        if (!mma8)
            return launch_pdl(attention_kernel<true>, dim3((unsigned)n_heads, (unsigned)m->n_seqs, (unsigned)z),
                              dim3(ATT_WARPS * 32), 0, c->stream, (const bf16 *)q, q_stride, m->n_seqs,
                              (const int32_t *)m->q_start, (const int32_t *)m->ctx_len,
                              (const int32_t *)m->block_tables, m->max_blocks, m->block_size, n_heads, group,
                              head_dim, kv_dim, scale, k_cache, v_cache, rb, (int)b->kv_fp8_codes, (bf16 *)out);
    }
    /* Decode of long contexts (max_q_len 1, max_ctx_len > AD_MAX_T) takes
     * the split decode kernel: the tensor-core split path below streams K/V
     * at ~22 % of the copy ceiling there (b1 ctx 4096, H200). Forced
     * (FL_CUDA_ATTN_SPLITDEC), it takes short contexts too. */
    const bool sd_policy = g_kernel_policy == FL_CUDA_ATTN_SPLITDEC ||
                           ((g_kernel_policy == FL_CUDA_ATTN_AUTO || g_kernel_policy == FL_CUDA_ATTN_DECODE) &&
                            m->max_ctx_len > AD_MAX_T && attn_splitdec_on());
    if (sd_policy && rows_hint == 1 && (head_dim == 64 || head_dim == 128) && aligned &&
        m->max_ctx_len <= SD_MAX_CTX)
        return split_decode(b, c,
                            attn_args_of(q, q_stride, m, n_heads, n_kv_heads, head_dim, 1, scale, k_cache, v_cache,
                                         out),
                            m->n_seqs, m->max_ctx_len, n_kv_heads, head_dim);
    bool mma_ok = (head_dim == 64 || head_dim == 128) && aligned && g_kernel_policy != FL_CUDA_ATTN_SIMT;
    const int64_t rows64 = (int64_t)rows_hint * group; /* packed rows of one (KV head, sequence), at most */
    const int WM = rows64 <= 16 ? 1 : 4;
    const int64_t ntiles = (rows64 + 16 * WM - 1) / (16 * WM);
    /* Context splits (flash-decoding) when the blocks without them would not
     * fill the GPU: as many as one wave holds (blocks per SM from the
     * occupancy query: 2-3 for head_dim 128, registers bound), each split at
     * least AM_MIN_CHUNK positions, the partials within ATTN_WS_BUDGET. */
    const int two = g_stage_policy > 0 ? g_stage_policy == 2 : AM_DEFAULT_STAGES == 2;
    int S = 1;
    if (mma_ok && WM == 1) {
        /* one full wave: the splits of a sequence are equally long, so a
         * partial second wave would cost as much as a whole one */
        typedef fl_status (*prep_fn)(fl_cuda *, int *);
        static const prep_fn preps[2][2] = {{mma_prepare<64, 1, 1>, mma_prepare<64, 1, 2>},
                                            {mma_prepare<128, 1, 1>, mma_prepare<128, 1, 2>}};
        int occ = 1;
        FL_TRY(preps[head_dim == 128][two](c, &occ));
        const int64_t base = (int64_t)n_kv_heads * m->n_seqs * ntiles;
        const int64_t target = (int64_t)occ * c->n_sm;
        int64_t want = g_split_policy > 0 ? g_split_policy : target / base;
        const int64_t by_ctx = g_split_policy > 0 ? (m->max_ctx_len + AM_BN - 1) / AM_BN
                                                  : (m->max_ctx_len + AM_MIN_CHUNK - 1) / AM_MIN_CHUNK;
        const size_t per_split = sizeof(float) * (size_t)m->n_seqs * (size_t)rows_hint * (size_t)n_heads *
                                 (size_t)(head_dim + 2);
        const int64_t by_ws = (int64_t)(ATTN_WS_BUDGET / per_split);
        if (want > by_ctx) want = by_ctx;
        if (want > by_ws) want = by_ws;
        if (want > AM_MAX_SPLITS) want = AM_MAX_SPLITS;
        S = want > 1 ? (int)want : 1;
    }
    /* Decode of short contexts (max_ctx_len <= AM_MIN_CHUNK: no split) is
     * not the tensor-core kernel's unless asked (the decode kernel below
     * takes it, one launch, no workspace). Longer unsplit decode
     * (large batches) takes the tensor-core kernel too: the SIMT kernel
     * reads K/V once per query head and waits on one load round trip per 32
     * positions (bench/results: 8 x 4096 decode at 5.7 % of the copy
     * ceiling). */
    const bool use_mma = mma_ok && (i8 || rows_hint > 1 || S > 1 || m->max_ctx_len > AM_MIN_CHUNK ||
                                    g_kernel_policy == FL_CUDA_ATTN_MMA);
    /* Of what is left, decode of short contexts with 16-byte rows takes the
     * GQA decode kernel: a block per (KV head, sequence) instead of per
     * query head, two dependent global round trips instead of ~8 (the SIMT
     * kernel spent ~7.9 us on the Llama-3-8B decode at batch 1, ctx 48).
     * Its shared memory is sized from the host-known max_ctx_len
     * (graph-safe: a bucket's limit stages that many rows whatever the
     * step's contexts). */
    if (!use_mma && g_kernel_policy != FL_CUDA_ATTN_SIMT &&
        (g_kernel_policy == FL_CUDA_ATTN_DECODE || attn_decode_on()) && rows_hint == 1 &&
        m->max_ctx_len <= AD_MAX_T &&
        head_dim % 8 == 0 && aligned && (uintptr_t)out % 16 == 0) {
        size_t max_dyn = 0;
        FL_TRY(dec_prepare(c, &max_dyn));
        attn_dec_args d;
        d.T = (m->max_ctx_len + 7) / 8 * 8;
        d.prewait = attn_prewait_on();
        const size_t smem = ad_smem_bytes(d.T, head_dim);
        if (smem <= max_dyn) {
            d.q = (const bf16 *)q;
            d.q_stride = q_stride;
            d.q_start = m->q_start;
            d.ctx_len = m->ctx_len;
            d.block_tables = m->block_tables;
            d.max_blocks = m->max_blocks;
            d.block_size = m->block_size;
            d.n_heads = n_heads;
            d.group = group;
            const int hpb = attn_dec_heads(c, n_kv_heads, group, m->n_seqs);
            d.hsplit = (group + hpb - 1) / hpb;
            d.head_dim = head_dim;
            d.scale = scale;
            d.kv_dim = (int64_t)n_kv_heads * head_dim;
            d.kc = (const bf16 *)k_cache;
            d.vc = (const bf16 *)v_cache;
            d.out = (bf16 *)out;
            const int64_t gx = (int64_t)n_kv_heads * d.hsplit;
            if (gx > INT32_MAX)
                return FL_ERR(FL_ERR_UNSUPPORTED, "cuda attention: %d KV heads x %d head slices", n_kv_heads,
                              d.hsplit);
            /* PDL (see launch_pdl): the output projection's GEMV requests
             * its weights while this runs */
            return launch_pdl(attn_decode_kernel, dim3((unsigned)gx, (unsigned)m->n_seqs), dim3(AD_THREADS), smem,
                              c->stream, d);
        }
    }
    if (!use_mma) {
        const int z = rows_hint < 64 ? rows_hint : 64;
        dim3 grid((unsigned)n_heads, (unsigned)m->n_seqs, (unsigned)z);
        return launch_pdl(attention_kernel<false>, grid, dim3(ATT_WARPS * 32), 0, c->stream, (const bf16 *)q,
                          q_stride, m->n_seqs, (const int32_t *)m->q_start, (const int32_t *)m->ctx_len,
                          (const int32_t *)m->block_tables, m->max_blocks, m->block_size, n_heads, group,
                          head_dim, (int64_t)n_kv_heads * head_dim, scale, k_cache, v_cache, (int64_t)0, 0,
                          (bf16 *)out);
    }
    if (n_kv_heads > 65535 || rows64 > INT32_MAX)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda attention: %d KV heads, %lld packed rows", n_kv_heads,
                      (long long)rows64);
    attn_args a = attn_args_of(q, q_stride, m, n_heads, n_kv_heads, head_dim, rows_hint, scale, k_cache, v_cache, out);
    a.S = S;
    a.rb = rb8;
    a.vals = (int)(((int64_t)n_kv_heads * head_dim + 3) & ~3);
    a.fp8 = rb8 > 0 && b->kv_fp8_codes;
    if (S > 1) FL_TRY(attn_partials(b, a, m->n_seqs, head_dim));
    const int64_t zt = ntiles < 65535 / S ? ntiles : 65535 / S;
    const dim3 grid((unsigned)n_kv_heads, (unsigned)m->n_seqs, (unsigned)(zt * S));
    typedef fl_status (*launch_fn)(fl_cuda *, const attn_args &, dim3);
    static const launch_fn fns[2][2][2][2] = { /* [int8][head_dim 128][WM 4][two stages] */
        {{{launch_mma<64, 1, 1, false>, launch_mma<64, 1, 2, false>},
          {launch_mma<64, 4, 1, false>, launch_mma<64, 4, 2, false>}},
         {{launch_mma<128, 1, 1, false>, launch_mma<128, 1, 2, false>},
          {launch_mma<128, 4, 1, false>, launch_mma<128, 4, 2, false>}}},
        {{{launch_mma<64, 1, 1, true>, launch_mma<64, 1, 2, true>},
          {launch_mma<64, 4, 1, true>, launch_mma<64, 4, 2, true>}},
         {{launch_mma<128, 1, 1, true>, launch_mma<128, 1, 2, true>},
          {launch_mma<128, 4, 1, true>, launch_mma<128, 4, 2, true>}}}};
    const launch_fn launch = fns[i8][head_dim == 128][WM == 4][two];
    FL_TRY(launch(c, a, grid));
    return S > 1 ? attn_merge(c, a, m->n_seqs, head_dim) : FL_OK;
}
