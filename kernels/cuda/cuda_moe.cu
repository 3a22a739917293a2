/*
 * cuda_moe.cu — experts routed on the device (moe_group, moe_matmul,
 * moe_combine; contracts in kernels/backend.h, reference kernels/cpu/
 * cpu_moe.c, caller runtime/model/forward_moe_dev.c).
 *
 * Why: with the top-k downloaded every MoE layer, a decode step waits on
 * the host once per layer and cannot be a CUDA graph (Mixtral w4 batch 1
 * measured 29 % of the copy ceiling, Qwen3-30B-A3B 4 %). These kernels keep
 * the pairs on the device; every launch is sized from the host-known row
 * count, never from the routing, so a decode step records as one graph.
 *
 *  - moe_group: one block (moe_group_block, cuda_moe_route.cuh). Thread j
 *    (a local expert) counts its pairs, a block-wide scan turns the counts
 *    into offsets, then thread j writes its pairs in ascending order:
 *    O(n_local x pairs) compares, a few microseconds at decode sizes, and
 *    deterministic (no atomics).
 *  - moe_matmul: packed W4 goes to the tensor-core GEMV's routed mode
 *    (cuda_gemv.cu, gv_route: blocks walk the active experts' items, one
 *    wave); bf16 to moe_bf16_kernel below, a block row per local expert
 *    whose blocks exit when the expert has no pairs (bf16 MoE is not a
 *    decode target: simple, correct, reads only active experts).
 *  - moe_combine: thread per (token, column); a token's local pairs are
 *    added from zero in ascending expert order with a bf16 rounding after
 *    each add, exactly as scatter_add_rows does one expert at a time into
 *    the host path's zeroed buffer (so no memset before it).
 */
#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/layer.h"
#include "kernels/cuda/cuda_moe_route.cuh"
#include "kernels/cuda/cuda_norm.cuh"

extern "C" fl_status fl_cuda_w4_gemv_routed(fl_backend *b, const bf16 *x, int x_per_pair, int n, int k,
                                            const int32_t *list, int n_local, const fl_tensor *table,
                                            const fl_tensor *table2, int up_tile0, const fl_tensor *w0,
                                            bf16 *y);
extern "C" int fl_cuda_glu_fuse_on(int which);

#define MOE_GROUP_THREADS 1024

static __global__ void __launch_bounds__(MOE_GROUP_THREADS)
    moe_group_kernel(const int32_t *ids, int P, int e_lo, int n_local, int32_t *list) {
    pdl_enter(); /* before any global access: see launch_pdl */
    extern __shared__ int32_t cnt[]; /* [n_local + 1] */
    moe_group_block(ids, P, e_lo, n_local, list, cnt);
}

extern "C" fl_status fl_cuda_moe_group(fl_backend *b, const int32_t *ids, int n, int k, int e_lo, int n_local,
                                       int32_t *list) {
    if (n < 0 || k < 1 || n_local < 1 || n_local > 8192)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_group: %d rows, top-%d, %d local experts (at most 8192)", n, k,
                      n_local);
    const int threads = n_local < MOE_GROUP_THREADS ? ((n_local + 31) / 32) * 32 : MOE_GROUP_THREADS;
    return launch_pdl(moe_group_kernel, 1, threads, ((size_t)n_local + 1) * sizeof(int32_t), cuda_impl(b)->stream,
        ids, n * k, e_lo, n_local, list);
}

/* bf16 experts: block (64 rows, expert j, chunk z of 8 pairs); warp w takes
 * rows w, w + 8, ... of the block's 64; lanes split the columns in 16-byte
 * pieces (8 weights) and keep one f32 sum per pair. in % 8 == 0 (probe). */
#define MOE_BF16_ROWS 64
#define MOE_BF16_PAIRS 8
static __global__ void __launch_bounds__(256)
    moe_bf16_kernel(const bf16 *x, int x_per_pair, int k, const int32_t *list, int n_local,
                    const fl_tensor *table, int rows, int in, bf16 *y) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int j = blockIdx.y, lo = list[j] + (int)blockIdx.z * MOE_BF16_PAIRS, hi = list[j + 1];
    if (lo >= hi) return;
    const int np = min(MOE_BF16_PAIRS, hi - lo);
    const int32_t *pairs = list + n_local + 1 + lo;
    const bf16 *w = (const bf16 *)table[j].data;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bf16 *xr[MOE_BF16_PAIRS];
#pragma unroll
    for (int i = 0; i < MOE_BF16_PAIRS; i++) {
        const int p = pairs[min(i, np - 1)];
        xr[i] = x + (size_t)(x_per_pair ? p : p / k) * in;
    }
    for (int r = blockIdx.x * MOE_BF16_ROWS + warp; r < min(rows, (int)(blockIdx.x + 1) * MOE_BF16_ROWS); r += 8) {
        const bf16 *wr = w + (size_t)r * in;
        float acc[MOE_BF16_PAIRS];
#pragma unroll
        for (int i = 0; i < MOE_BF16_PAIRS; i++) acc[i] = 0.0f;
        for (int c = lane * 8; c < in; c += 32 * 8) {
            const uint4 wv = *(const uint4 *)(wr + c);
            const bf16 *wp = (const bf16 *)&wv;
            float wf[8];
#pragma unroll
            for (int e = 0; e < 8; e++) wf[e] = bf2f(wp[e]);
#pragma unroll
            for (int i = 0; i < MOE_BF16_PAIRS; i++) {
                if (i >= np) break;
                const uint4 xv = *(const uint4 *)(xr[i] + c);
                const bf16 *xp = (const bf16 *)&xv;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[i] = fmaf(wf[e], bf2f(xp[e]), acc[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < MOE_BF16_PAIRS; i++) {
            if (i >= np) break;
            const float s = warp_sum(acc[i]);
            if (lane == 0) y[(size_t)pairs[i] * rows + r] = f2bf(s);
        }
    }
}

extern "C" fl_status fl_cuda_moe_matmul(fl_backend *b, const void *x, int x_per_pair, int n, int k,
                                        const int32_t *list, int n_local, const fl_tensor *table,
                                        const fl_tensor *w0, void *out) {
    if (!w0 || w0->ndim != 2 || w0->shape[0] <= 0 || w0->shape[0] > INT32_MAX || w0->shape[1] > INT32_MAX)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda moe_matmul: the expert weight must be 2-D");
    const int64_t rows = w0->shape[0], in = w0->shape[1];
    const bool w4 = w0->dtype == FL_DTYPE_W4 && w4_packed(rows, in, w0->group);
    const bool bf = w0->dtype == FL_DTYPE_BF16 && in % 8 == 0;
    if (!w4 && !bf)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda moe_matmul: expert weight %s [%lld, %lld] (runs packed W4 "
                      "and BF16 with columns a multiple of 8)", fl_dtype_name(w0->dtype), (long long)rows,
                      (long long)in);
    if (n <= 0) return FL_OK; /* probe, or nothing to do */
    if (n_local < 1 || n_local > 65535 || k < 1)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda moe_matmul: %d local experts, top-%d", n_local, k);
    if (w4)
        return fl_cuda_w4_gemv_routed(b, (const bf16 *)x, x_per_pair, n, k, list, n_local, table, NULL, 0, w0,
                                      (bf16 *)out);
    if (((uintptr_t)x & 15) != 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda moe_matmul: x must be 16-byte aligned");
    dim3 grid(cdiv_u(rows, MOE_BF16_ROWS), (unsigned)n_local, cdiv_u(n, MOE_BF16_PAIRS));
    return launch_pdl(moe_bf16_kernel, grid, 256, 0, cuda_impl(b)->stream, (const bf16 *)x, x_per_pair, k, list, n_local, table,
                                                            (int)rows, (int)in, (bf16 *)out);
}

#define MOE_MAX_K 64
static __global__ void moe_combine_kernel(bf16 *acc, const bf16 *src, const int32_t *ids, const float *weights,
                                          int n, int k, int e_lo, int n_local, int d) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int i = blockIdx.y;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= d) return;
    int slot[MOE_MAX_K], m = 0;
    for (int j = 0; j < k; j++) { /* this token's local pairs, by ascending expert */
        const int e = ids[i * k + j];
        if (e < e_lo || e >= e_lo + n_local) continue;
        int at = m++;
        while (at > 0 && ids[i * k + slot[at - 1]] > e) {
            slot[at] = slot[at - 1];
            at--;
        }
        slot[at] = j;
    }
    bf16 o = f2bf(0.0f);
    for (int s = 0; s < m; s++) {
        const int p = i * k + slot[s];
        o = f2bf(fmaf(weights[p], bf2f(src[(size_t)p * d + t]), bf2f(o)));
    }
    acc[(size_t)i * d + t] = o;
}

extern "C" fl_status fl_cuda_moe_combine(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                                         const float *weights, int n, int k, int e_lo, int n_local, int d) {
    if (k < 1 || k > MOE_MAX_K || n > 65535)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_combine: %d rows, top-%d (at most 65535 rows, top-%d)", n, k,
                      MOE_MAX_K);
    if (n <= 0 || d <= 0) return FL_OK;
    dim3 grid(cdiv_u(d, 256), (unsigned)n);
    return launch_pdl(moe_combine_kernel, grid, 256, 0, cuda_impl(b)->stream, (bf16 *)acc, (const bf16 *)src, ids, weights, n,
                                                               k, e_lo, n_local, d);
}

/* --- moe_combine + add + add_rmsnorm in one launch ----------------------------
 * The end of a MoE layer at decode sizes was three or four dependent
 * launches of a few microseconds each (moe_combine, the shared expert's add,
 * add_rmsnorm), all latency under Nsight Compute (Qwen3-30B-A3B's top-8
 * combine walked one expert row after another). Here a block
 * is a token and a thread CH chunks of 8 columns: the token's local pairs
 * are ranked by expert in parallel (the first k threads; one barrier that
 * also counts them), every pair's chunks are requested at once (up to
 * MCN_BATCH pairs a round), and the sums are moe_combine_kernel's (an fma
 * and a bf16 rounding per pair in ascending expert order), then add_kernel's
 * (+ extra), then add_rmsnorm_vec_kernel's add and rounding. The residual
 * and acc are those ops' bits; out differs from add_rmsnorm's only in the
 * order the squares are summed (a thread per chunk here). The norm weight
 * is loaded before the PDL wait. */
#define MCN_BATCH 8
template <int CH, int WF32>
static __global__ void __launch_bounds__(512) moe_combine_norm_kernel(bf16 *acc, const bf16 *src, const int32_t *ids,
                                                                      const float *weights, int k, int e_lo,
                                                                      int n_local, int d, const bf16 *extra, bf16 *x,
                                                                      const void *w, float eps, bf16 *out) {
    if (FL_PDL_EARLY) pdl_trigger();
    const int nv = d >> 3, i = blockIdx.x, T = blockDim.x;
    uint4 wr[CH][2];
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int j = threadIdx.x + c * T;
        if (j < nv) norm_load_w<WF32>(w, j, wr[c]);
    }
    pdl_wait(); /* ids, weights, src, extra and x come from the previous kernels */
    if (!FL_PDL_EARLY) pdl_trigger();
    __shared__ int sp[MOE_MAX_K];
    __shared__ float red[32];
    int local = 0;
    if ((int)threadIdx.x < k) { /* pair j's rank among the token's local pairs (ascending expert, then j) */
        const int j = threadIdx.x, e = ids[i * k + j];
        local = e >= e_lo && e < e_lo + n_local;
        if (local) {
            int r = 0;
            for (int q = 0; q < k; q++) {
                const int eq = ids[i * k + q];
                r += eq >= e_lo && eq < e_lo + n_local && (eq < e || (eq == e && q < j));
            }
            sp[r] = i * k + j;
        }
    }
    const int m = __syncthreads_count(local);
    float o[CH][8];
#pragma unroll
    for (int c = 0; c < CH; c++)
#pragma unroll
        for (int e = 0; e < 8; e++) o[c][e] = 0.0f;
    for (int s0 = 0; s0 < m; s0 += MCN_BATCH) {
        uint4 v[MCN_BATCH][CH];
#pragma unroll
        for (int u = 0; u < MCN_BATCH; u++)
#pragma unroll
            for (int c = 0; c < CH; c++) {
                const int j = threadIdx.x + c * T;
                if (s0 + u < m && j < nv) v[u][c] = ((const uint4 *)src)[(size_t)sp[s0 + u] * nv + j];
            }
#pragma unroll
        for (int u = 0; u < MCN_BATCH; u++) {
            if (s0 + u >= m) break;
            const float wt = weights[sp[s0 + u]];
#pragma unroll
            for (int c = 0; c < CH; c++) {
                float f[8];
                bf16x8_unpack(v[u][c], f);
#pragma unroll
                for (int e = 0; e < 8; e++) o[c][e] = bf2f(f2bf(fmaf(wt, f[e], o[c][e])));
            }
        }
    }
    float ss = 0.0f;
    uint4 sr[CH];
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int j = threadIdx.x + c * T;
        if (j >= nv) continue;
        const size_t at = (size_t)i * nv + j;
        if (extra) {
            float f[8];
            bf16x8_unpack(((const uint4 *)extra)[at], f);
#pragma unroll
            for (int e = 0; e < 8; e++) o[c][e] += f[e];
        }
        const uint4 a = bf16x8_pack(o[c]); /* the layer's sum, rounded as moe_combine / add store it */
        ((uint4 *)acc)[at] = a;
        sr[c] = norm_add_chunk(((const uint4 *)x)[at], a, ss);
        ((uint4 *)x)[at] = sr[c];
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int q = 0; q < (int)(T >> 5); q++) tot += red[q];
    const float inv = norm_inv(tot, d, eps);
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int j = threadIdx.x + c * T;
        if (j < nv) ((uint4 *)out)[(size_t)i * nv + j] = norm_scale_chunk<WF32>(sr[c], wr[c], inv);
    }
}

/* The moe_norm_fuse override at 0 runs moe_combine, add and add_rmsnorm as
 * three launches (the A/B); else one. */
static bool moe_norm_fuse_on(void) { return cuda_tune_on(FL_CUDA_TUNE_MOE_NORM_FUSE); }

extern "C" fl_status fl_cuda_moe_combine_add_rmsnorm(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                                                     const float *weights, int n, int k, int e_lo, int n_local,
                                                     int d, const void *extra, void *x, const fl_tensor *w,
                                                     float eps, void *out) {
    FL_TRY(cuda_norm_weight_ok(w, d, "moe_combine_add_rmsnorm"));
    if (k < 1 || k > MOE_MAX_K || n > 65535)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_combine_add_rmsnorm: %d rows, top-%d (at most 65535 rows, top-%d)",
                      n, k, MOE_MAX_K);
    if (out == x || out == acc || x == acc)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_combine_add_rmsnorm: out, x and acc must not alias");
    if (n <= 0 || d <= 0) return FL_OK;
    const bool vec = d % 8 == 0 && d <= 8192 && ((uintptr_t)acc & 15) == 0 && ((uintptr_t)src & 15) == 0 &&
                     ((uintptr_t)x & 15) == 0 && ((uintptr_t)out & 15) == 0 && ((uintptr_t)extra & 15) == 0 &&
                     ((uintptr_t)w->data & 15) == 0;
    if (!moe_norm_fuse_on() || !vec) {
        FL_TRY(fl_cuda_moe_combine(b, acc, src, ids, weights, n, k, e_lo, n_local, d));
        if (extra) FL_TRY(fl_cuda_add(b, acc, extra, (size_t)n * (size_t)d));
        return fl_cuda_add_rmsnorm(b, x, acc, w, eps, n, d, out);
    }
    /* a chunk a thread up to 512 threads (d 4096), two beyond; at least k threads for the ranking */
    const int nv = d / 8, ch = nv > 512 ? 2 : 1;
    int threads = ((nv + ch - 1) / ch + 31) / 32 * 32;
    threads = std::max(threads, (k + 31) / 32 * 32);
    cudaStream_t st = cuda_impl(b)->stream;
    const bool wf32 = w->dtype == FL_DTYPE_F32;
#define MCN_LAUNCH(CH, WF)                                                                                          \
    launch_pdl(moe_combine_norm_kernel<CH, WF>, dim3((unsigned)n), dim3((unsigned)threads), 0, st, (bf16 *)acc,    \
               (const bf16 *)src, ids, weights, k, e_lo, n_local, d, (const bf16 *)extra, (bf16 *)x, w->data, eps, \
               (bf16 *)out)
    const fl_status r = ch == 1 ? (wf32 ? MCN_LAUNCH(1, 1) : MCN_LAUNCH(1, 0)) : (wf32 ? MCN_LAUNCH(2, 1) : MCN_LAUNCH(2, 0));
#undef MCN_LAUNCH
    return r;
}

/* The experts' gate and up with SiLU in one pass (the routed W4 GEMV's DUAL
 * mode) on packed W4 experts; others run the plain ops (fl_layer_moe_gate_up). */
extern "C" fl_status fl_cuda_moe_gate_up_silu(fl_backend *b, const void *x, int n, int k, const int32_t *list,
                                              int n_local, const fl_tensor *gate_table, const fl_tensor *up_table,
                                              const fl_tensor *gate0, const fl_tensor *up0, void *gu, void *out) {
    const fl_tensor *w0 = gate0; /* expert 0's gate (or stacked gate|up) */
    if (!w0 || w0->ndim != 2 || w0->shape[0] <= 0 || w0->shape[0] > INT32_MAX || w0->shape[1] > INT32_MAX ||
        (up_table && !up0))
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda moe_gate_up_silu: the expert weights must be 2-D");
    if (n <= 0) return FL_OK;
    if (n_local < 1 || n_local > 65535 || k < 1)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda moe_gate_up_silu: %d local experts, top-%d", n_local, k);
    const int64_t rows = up_table ? w0->shape[0] : w0->shape[0] / 2, in = w0->shape[1];
    /* the routed GEMV reads up with gate's layout: apart, they must match */
    const bool same = !up_table || (up0->dtype == w0->dtype && up0->group == w0->group &&
                                    up0->shape[0] == w0->shape[0] && up0->shape[1] == w0->shape[1]);
    if (!same || !fl_cuda_glu_fuse_on(2) || w0->dtype != FL_DTYPE_W4 || !w4_packed(rows, in, w0->group) ||
        (!up_table && w0->shape[0] != 2 * rows))
        return fl_layer_moe_gate_up(b, x, n, k, list, n_local, gate_table, up_table, gate0, up0, gu, out);
    fl_tensor g0 = *w0;
    g0.shape[0] = rows;
    return fl_cuda_w4_gemv_routed(b, (const bf16 *)x, 0, n, k, list, n_local, gate_table, up_table,
                                  up_table ? 0 : (int)(rows / 16), &g0, (bf16 *)out);
}
