/*
 * cuda_ops.cu — the CUDA backend's small ops: embed, rmsnorm, add + rmsnorm, rope,
 * kv_store, silu_mul, add, moe_topk, gather/scatter rows, sigmoid scaling,
 * and the bias epilogue used after cuBLAS. Contracts in kernels/backend.h;
 * the CPU ops (kernels/cpu/cpu_ops.c) are the reference they are tested
 * against (tests/test_cuda_ops.c).
 *
 * All are memory bound and simple: bf16 in and out, f32 arithmetic, one
 * thread per element (or one block / warp per row where a row reduction is
 * needed). Launches are checked; arguments that the CPU op rejects are
 * rejected here too, before anything is enqueued.
 */
#include <float.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_moe_route.cuh"
#include "kernels/cuda/cuda_norm.cuh"

#define THREADS 256

static unsigned grid_1d(int64_t n) {
    int64_t g = (n + THREADS - 1) / THREADS;
    return (unsigned)(g < 1 ? 1 : (g > 65535 * 64 ? 65535 * 64 : g));
}

/* --- embed ---------------------------------------------------------------- */
/* An out-of-range id writes a NaN row: a kernel cannot return a status, and
 * NaN logits make the bug visible (the scheduler validates ids on the host). */
static __global__ void embed_kernel(const void *table, int f32, const int32_t *ids, int n,
                                    int64_t vocab, int64_t d, bf16 *out) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int64_t total = (int64_t)n * d;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / d, j = i % d;
        const int32_t id = ids[r];
        float v = (id < 0 || id >= vocab) ? __int_as_float(0x7fc00000) : vec_load(table, f32, id * d + j);
        out[i] = f2bf(v);
    }
}

extern "C" fl_status fl_cuda_embed(fl_backend *b, const fl_tensor *table, const int32_t *ids, int n,
                                   void *out) {
    if (table->ndim != 2 || (table->dtype != FL_DTYPE_BF16 && table->dtype != FL_DTYPE_F32))
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda embed: table must be a 2-D BF16/F32 device tensor, "
                      "got %d-D %s", table->ndim, fl_dtype_name(table->dtype));
    if (n <= 0) return FL_OK;
    const int64_t d = table->shape[1];
    return launch_pdl(embed_kernel, grid_1d((int64_t)n * d), THREADS, 0, cuda_impl(b)->stream,
        table->data, table->dtype == FL_DTYPE_F32, ids, n, table->shape[0], d, (bf16 *)out);
}

/* --- rmsnorm --------------------------------------------------------------- */
/* One block per row; the sum of squares is reduced in f32 (tree order keeps
 * the error far below bf16 resolution). Every thread reads x[j] before it
 * writes out[j], and all reads of the reduction finish at the barrier, so
 * out == x is safe. */
static __global__ void rmsnorm_kernel(const bf16 *x, const void *w, int wf32, float eps, int d,
                                      bf16 *out) {
    pdl_enter(); /* before any global access: see launch_pdl */
    __shared__ float red[32];
    const bf16 *xr = x + (int64_t)blockIdx.x * d;
    bf16 *orow = out + (int64_t)blockIdx.x * d;
    float ss = 0;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float v = bf2f(xr[j]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float inv = 1.0f / sqrtf(red[0] / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x)
        orow[j] = f2bf(vec_load(w, wf32, j) * (bf2f(xr[j]) * inv));
}

extern "C" fl_status fl_cuda_rmsnorm(fl_backend *b, const void *x, const fl_tensor *w, float eps, int n,
                                     int d, void *out) {
    FL_TRY(cuda_norm_weight_ok(w, d, "rmsnorm"));
    if (n <= 0) return FL_OK;
    const int threads = d >= 1024 ? 1024 : (d >= 256 ? 256 : 64);
    return launch_pdl(rmsnorm_kernel, n, threads, 0, cuda_impl(b)->stream, (const bf16 *)x, w->data,
                                                           w->dtype == FL_DTYPE_F32, eps, d, (bf16 *)out);
}

/* --- add + rmsnorm ------------------------------------------------------------
 * The residual add fused with the norm that follows it (two launches and one
 * pass over x fewer per use; decode runs it twice per layer). One block per
 * row: each thread rounds x + y to bf16 exactly as add_kernel does, stores
 * it, sums the squares of the stored values (what rmsnorm_kernel would read)
 * and, after the block reduction, normalizes them. At batch 1 this is pure
 * latency (measured 5.6 us for one 4096 row), so when a row fits in PER
 * values per thread the sums stay in registers and the weight is loaded
 * before the reduction instead of after it; PER = 0 is the general loop. */
template <int PER>
static __global__ void add_rmsnorm_kernel(bf16 *x, const bf16 *y, const void *w, int wf32, float eps,
                                          int d, bf16 *out) {
    pdl_enter(); /* before any global access: see launch_pdl */
    __shared__ float red[32];
    bf16 *xr = x + (int64_t)blockIdx.x * d;
    const bf16 *yr = y + (int64_t)blockIdx.x * d;
    bf16 *orow = out + (int64_t)blockIdx.x * d;
    float ss = 0;
    float xv[PER > 0 ? PER : 1], wv[PER > 0 ? PER : 1];
    if (PER > 0) {
#pragma unroll
        for (int e = 0; e < (PER > 0 ? PER : 1); e++) {
            const int j = threadIdx.x + e * blockDim.x;
            if (j < d) {
                const bf16 s = f2bf(bf2f(xr[j]) + bf2f(yr[j]));
                xr[j] = s;
                xv[e] = bf2f(s);
                wv[e] = vec_load(w, wf32, j);
                ss += xv[e] * xv[e];
            }
        }
    } else {
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            const bf16 s = f2bf(bf2f(xr[j]) + bf2f(yr[j]));
            xr[j] = s;
            const float v = bf2f(s);
            ss += v * v;
        }
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float inv = 1.0f / sqrtf(red[0] / (float)d + eps);
    if (PER > 0) {
#pragma unroll
        for (int e = 0; e < (PER > 0 ? PER : 1); e++) {
            const int j = threadIdx.x + e * blockDim.x;
            if (j < d) orow[j] = f2bf(wv[e] * (xv[e] * inv));
        }
    } else {
        for (int j = threadIdx.x; j < d; j += blockDim.x)
            orow[j] = f2bf(vec_load(w, wf32, j) * (bf2f(xr[j]) * inv));
    }
}

/* The vector form, for 16-byte aligned rows with d % 8 == 0 and d <=
 * NORM_MAX_D: a thread holds NORM_CHUNKS chunks of 8 values (chunk j =
 * threadIdx.x + c blockDim.x), blockDim = norm_vec_threads(d). Why: the
 * decode step pays this kernel twice a layer as pure latency (timed with
 * FL_DIAG_SKIP), and the 1024-thread form above spends it on 32 warps of
 * 2-byte loads, two block barriers across 32 warps, and a footprint (32
 * warps, ~22K registers) that cannot sit beside a W4 GEMV's 16-warp block,
 * so it waits for an SM to drain. Here a 4096 row is 4 warps of 16-byte
 * loads, and the norm weight is requested before the wait (it never depends
 * on the previous kernel). Same arithmetic as add_rmsnorm_kernel: x + y
 * rounded to bf16 and stored, squares of the stored values summed (in
 * another order: cuda_norm.cuh's), w * (x * inv). Out of place: xin + y goes to xout (xin == xout: in
 * place). */
/* (256, 4): at most 64 registers, so a 4-warp block (8K registers) fits
 * beside a 16-warp W4 GEMV block at 112 registers (57K of the 64K). The
 * state a chunk carries is kept packed for that: the weight as loaded, the
 * rounded sum as stored. */
template <int WF32>
static __global__ void __launch_bounds__(256, 4) add_rmsnorm_vec_kernel(const bf16 *xin, const bf16 *y, bf16 *xout,
                                                                        const void *w, float eps, int d, bf16 *out) {
    if (FL_PDL_EARLY) pdl_trigger();
    const int nv = d >> 3;
    uint4 wr[NORM_CHUNKS][2];
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; c++) {
        const int j = threadIdx.x + c * blockDim.x;
        if (j < nv) norm_load_w<WF32>(w, j, wr[c]);
    }
    pdl_wait(); /* x and y come from the previous kernels */
    if (!FL_PDL_EARLY) pdl_trigger();
    __shared__ float red[32];
    const uint4 *xr = (const uint4 *)(xin + (int64_t)blockIdx.x * d);
    uint4 *xo = (uint4 *)(xout + (int64_t)blockIdx.x * d);
    const uint4 *yr = (const uint4 *)(y + (int64_t)blockIdx.x * d);
    uint4 *orow = (uint4 *)(out + (int64_t)blockIdx.x * d);
    uint4 sr[NORM_CHUNKS], yv[NORM_CHUNKS];
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; c++) { /* every load in flight before the first store (xo may be xr) */
        const int j = threadIdx.x + c * blockDim.x;
        if (j < nv) sr[c] = xr[j], yv[c] = yr[j];
    }
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; c++) {
        const int j = threadIdx.x + c * blockDim.x;
        if (j >= nv) continue;
        sr[c] = norm_add_chunk(sr[c], yv[c], ss);
        xo[j] = sr[c];
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) tot += red[i]; /* every thread: no second barrier */
    const float inv = norm_inv(tot, d, eps);
#pragma unroll
    for (int c = 0; c < NORM_CHUNKS; c++) {
        const int j = threadIdx.x + c * blockDim.x;
        if (j < nv) orow[j] = norm_scale_chunk<WF32>(sr[c], wr[c], inv);
    }
}

/* The norm_vec override at 0 keeps every add_rmsnorm on the 1024-thread
 * form (the A/B); else the vector form where it fits. */
static bool norm_vec_on(void) { return cuda_tune_on(FL_CUDA_TUNE_NORM_VEC); }

extern "C" fl_status fl_cuda_add_rmsnorm(fl_backend *b, void *x, const void *y, const fl_tensor *w,
                                         float eps, int n, int d, void *out) {
    return fl_cuda_add_rmsnorm_to(b, x, y, x, w, eps, n, d, out);
}

/* Whether the vector kernel takes these rows. */
static bool norm_vec_takes(const void *x, const void *y, const void *x_out, const fl_tensor *w, int d,
                           const void *out) {
    return norm_vec_on() && d % 8 == 0 && d <= NORM_MAX_D && ((uintptr_t)x & 15) == 0 &&
           ((uintptr_t)y & 15) == 0 && ((uintptr_t)x_out & 15) == 0 && ((uintptr_t)out & 15) == 0 &&
           ((uintptr_t)w->data & 15) == 0 && (w->dtype == FL_DTYPE_F32 || w->dtype == FL_DTYPE_BF16);
}

extern "C" fl_status fl_cuda_add_rmsnorm_to(fl_backend *b, const void *x, const void *y, void *x_out,
                                            const fl_tensor *w, float eps, int n, int d, void *out) {
    FL_TRY(cuda_norm_weight_ok(w, d, "add_rmsnorm"));
    if (out == x || out == y || out == x_out || (x_out != x && x_out == y))
        return FL_ERR(FL_ERR_INVALID_ARG, "add_rmsnorm: out must not alias x or y");
    if (n <= 0) return FL_OK;
    const int wf32 = w->dtype == FL_DTYPE_F32;
    cudaStream_t st = cuda_impl(b)->stream;
    if (norm_vec_takes(x, y, x_out, w, d, out)) {
        const int threads = norm_vec_threads(d);
        return wf32 ? launch_pdl(add_rmsnorm_vec_kernel<1>, dim3(n), dim3(threads), 0, st, (const bf16 *)x,
                                 (const bf16 *)y, (bf16 *)x_out, w->data, eps, d, (bf16 *)out)
                    : launch_pdl(add_rmsnorm_vec_kernel<0>, dim3(n), dim3(threads), 0, st, (const bf16 *)x,
                                 (const bf16 *)y, (bf16 *)x_out, w->data, eps, d, (bf16 *)out);
    }
    if (x_out != x) /* the general form is in place: copy, then add in place */
        FL_CUDA_CHECK(cudaMemcpyAsync(x_out, x, (size_t)n * d * sizeof(bf16), cudaMemcpyDeviceToDevice, st));
    const int threads = d >= 1024 ? 1024 : (d >= 256 ? 256 : 64);
    const int per = (d + threads - 1) / threads;
    fl_status st_;
#define ADD_RMSNORM(P)                                                                                        \
    st_ = launch_pdl(add_rmsnorm_kernel<P>, dim3(n), dim3(threads), 0, st, (bf16 *)x_out, (const bf16 *)y, w->data, wf32, \
                     eps, d, (bf16 *)out)
    if (per <= 1)
        ADD_RMSNORM(1);
    else if (per <= 2)
        ADD_RMSNORM(2);
    else if (per <= 4)
        ADD_RMSNORM(4);
    else if (per <= 8)
        ADD_RMSNORM(8);
    else
        ADD_RMSNORM(0);
#undef ADD_RMSNORM
    return st_;
}

/* --- rope ------------------------------------------------------------------ */
static __global__ void rope_kernel(bf16 *x, int n_tok, int n_heads, int head_dim, int stride,
                                   const float *cos, const float *sin, int half, int interleaved) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int64_t total = (int64_t)n_tok * n_heads * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int p = (int)(i % half);
        const int64_t th = i / half;
        const int h = (int)(th % n_heads);
        const int64_t t = th / n_heads;
        bf16 *v = x + t * stride + (int64_t)h * head_dim;
        const int i0 = interleaved ? 2 * p : p, i1 = interleaved ? 2 * p + 1 : p + half;
        const float c = cos[t * half + p], s = sin[t * half + p];
        const float a = bf2f(v[i0]), bb = bf2f(v[i1]);
        v[i0] = f2bf(a * c - bb * s);
        v[i1] = f2bf(bb * c + a * s);
    }
}

extern "C" fl_status fl_cuda_rope(fl_backend *b, void *x, int n_tok, int n_heads, int head_dim,
                                  int stride, const float *cos, const float *sin, int rot_dim,
                                  bool interleaved) {
    if (rot_dim > head_dim || rot_dim % 2)
        return FL_ERR(FL_ERR_INVALID_ARG, "rope: rot_dim %d invalid for head_dim %d", rot_dim, head_dim);
    const int64_t total = (int64_t)n_tok * n_heads * (rot_dim / 2);
    if (total <= 0) return FL_OK;
    return launch_pdl(rope_kernel, grid_1d(total), THREADS, 0, cuda_impl(b)->stream,
        (bf16 *)x, n_tok, n_heads, head_dim, stride, cos, sin, rot_dim / 2, interleaved ? 1 : 0);
}

/* --- rope + kv_store ----------------------------------------------------------
 * q's heads rotated in place, k's heads rotated in place and stored with v
 * into the token's cache slot, in one launch instead of three. Grid
 * (tokens, chunks): one token's work is a flat list of items (rotation
 * pairs of q then k, k dims past rot_dim, v dims) spread over `chunks`
 * blocks, so a decode step's single token is not one block walking ~3.5k
 * items (measured 8.7 us as one block per token on the H200, Llama-3-8B
 * shapes). Each thread owns whole rotation pairs (reads both elements,
 * writes both), so the in-place update needs no barrier; the values written
 * are rope_pair's (cuda_common.cuh), which the q|k|v GEMV's rope epilogue
 * (matmul_rope_kv) gives bit for bit. */
static __global__ void rope_kv_store_kernel(bf16 *q, bf16 *k, const bf16 *v, int n_heads, int n_kv,
                                            int head_dim, int q_stride, int kv_stride, const float *cos,
                                            const float *sin, int half, int interleaved,
                                            const int32_t *slots, bf16 *kc, bf16 *vc) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int t = blockIdx.x;
    const float *ct = cos + (int64_t)t * half, *st = sin + (int64_t)t * half;
    const int32_t slot = slots ? slots[t] : -1; /* NULL: rotate only (an int8 cache is stored after) */
    const int kv_dim = n_kv * head_dim, rot = 2 * half, rest = head_dim - rot;
    bf16 *kco = slot >= 0 ? kc + (int64_t)slot * kv_dim : NULL;
    bf16 *vco = slot >= 0 ? vc + (int64_t)slot * kv_dim : NULL;
    bf16 *qt = q + (int64_t)t * q_stride, *kt = k + (int64_t)t * kv_stride;
    const bf16 *vt = v + (int64_t)t * kv_stride;
    const int pairs_q = n_heads * half, pairs = (n_heads + n_kv) * half;
    const int n_rest = n_kv * rest, total = pairs + n_rest + kv_dim;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < total; i += gridDim.y * blockDim.x) {
        if (i < pairs) {
            const bool isq = i < pairs_q;
            const int ii = isq ? i : i - pairs_q, h = ii / half, p = ii % half;
            bf16 *x = (isq ? qt : kt) + (int64_t)h * head_dim;
            const int i0 = interleaved ? 2 * p : p, i1 = interleaved ? 2 * p + 1 : p + half;
            bf16 r0, r1;
            rope_pair(bf2f(x[i0]), bf2f(x[i1]), ct[p], st[p], r0, r1);
            x[i0] = r0;
            x[i1] = r1;
            if (!isq && kco) {
                kco[h * head_dim + i0] = r0;
                kco[h * head_dim + i1] = r1;
            }
        } else if (!kco) {
            return; /* padding row: nothing else to do (items only grow from here) */
        } else if (i < pairs + n_rest) {
            /* k dims past rot_dim are stored as they are */
            const int r = i - pairs, j = (r / rest) * head_dim + rot + r % rest;
            kco[j] = kt[j];
        } else {
            const int j = i - pairs - n_rest;
            vco[j] = vt[j];
        }
    }
}

extern "C" fl_status fl_cuda_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok,
                                           int n_heads, int n_kv_heads, int head_dim, int q_stride,
                                           int kv_stride, const float *cos, const float *sin, int rot_dim,
                                           bool interleaved, const int32_t *slots, void *k_cache,
                                           void *v_cache) {
    if (rot_dim > head_dim || rot_dim % 2 || rot_dim < 0 || n_heads < 0 || n_kv_heads < 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "rope_kv_store: rot_dim %d invalid for head_dim %d", rot_dim,
                      head_dim);
    if (n_tok <= 0 || n_kv_heads == 0) return FL_OK;
    const int64_t items = (int64_t)(n_heads + n_kv_heads) * (rot_dim / 2) +
                          (int64_t)n_kv_heads * (head_dim - rot_dim) + (int64_t)n_kv_heads * head_dim;
    if (items > INT32_MAX)
        return FL_ERR(FL_ERR_UNSUPPORTED, "rope_kv_store: %lld items per token", (long long)items);
    const unsigned per_tok = cdiv_u(items, 256), chunks = per_tok < 32 ? per_tok : 32;
    const bool i8 = b->kv_int8_head_dim > 0; /* rotate here, quantize into the records after */
    FL_TRY(launch_pdl(rope_kv_store_kernel, dim3((unsigned)n_tok, chunks), 256, 0, cuda_impl(b)->stream,
        (bf16 *)q, (bf16 *)k, (const bf16 *)v, n_heads, n_kv_heads, head_dim, q_stride, kv_stride, cos,
        sin, rot_dim / 2, interleaved ? 1 : 0, i8 ? (const int32_t *)NULL : slots, (bf16 *)k_cache,
        (bf16 *)v_cache));
    return i8 ? fl_cuda_kv_store(b, k, v, n_tok, n_kv_heads * head_dim, kv_stride, slots, k_cache, v_cache) : FL_OK;
}



/* --- kv_store ---------------------------------------------------------------- */
static __global__ void kv_store_kernel(const bf16 *k, const bf16 *v, int n_tok, int kv_dim, int stride,
                                       const int32_t *slots, bf16 *kc, bf16 *vc) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int64_t total = (int64_t)n_tok * kv_dim;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / kv_dim, j = i % kv_dim;
        if (slots[t] < 0) continue; /* padding row of a captured step */
        const int64_t dst = (int64_t)slots[t] * kv_dim + j;
        kc[dst] = k[t * stride + j];
        vc[dst] = v[t * stride + j];
    }
}

/* int8 records (backend.h, kv_int8_head_dim): a warp per (token, K or V,
 * head) takes the head's absmax, scale = absmax / 127, codes round(x /
 * scale) to nearest even: the CPU store's arithmetic (f32 division, then
 * the product), so both backends write the same records from the same
 * values. Grid (tokens, ceil(2 n_kv / 8)), 8 warps a block. */
#define KVQ_WARPS 8
#define KVQ_MAX_HD 256
static __global__ void __launch_bounds__(KVQ_WARPS * 32)
    kv_store_i8_kernel(const bf16 *k, const bf16 *v, int n_kv, int hd, int stride, const int32_t *slots,
                       int64_t rb, int vals, int fp8, uint8_t *kc, uint8_t *vc) {
    pdl_enter(); /* before any global access: see launch_pdl */
    constexpr int PER = KVQ_MAX_HD / 32;
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const int w = blockIdx.y * KVQ_WARPS + (threadIdx.x >> 5); /* K heads, then V heads */
    const int32_t slot = slots[t];
    if (w >= 2 * n_kv || slot < 0) return; /* past the heads, or a padding row */
    const int h = w % n_kv;
    const bf16 *x = (w < n_kv ? k : v) + (int64_t)t * stride + (int64_t)h * hd;
    uint8_t *rec = (w < n_kv ? kc : vc) + (int64_t)slot * rb;
    float xv[PER], mx = 0.0f;
#pragma unroll
    for (int m = 0; m < PER; m++) {
        const int j = lane + 32 * m;
        xv[m] = j < hd ? bf2f(x[j]) : 0.0f;
        mx = fmaxf(mx, fabsf(xv[m]));
    }
    mx = warp_max(mx);
    const float sc = mx / (fp8 ? 448.0f : 127.0f), inv = sc > 0.0f ? 1.0f / sc : 0.0f;
    uint8_t *qo = rec + (int64_t)h * hd;
#pragma unroll
    for (int m = 0; m < PER; m++) {
        const int j = lane + 32 * m;
        /* e4m3: ties to even, saturating, as the CPU's fl_f32_to_f8e4m3 */
        if (j < hd)
            qo[j] = fp8 ? (uint8_t)__nv_cvt_float_to_fp8(xv[m] * inv, __NV_SATFINITE, __NV_E4M3)
                        : (uint8_t)(int8_t)__float2int_rn(xv[m] * inv);
    }
    if (lane == 0) ((float *)(rec + vals))[h] = sc;
}

extern "C" fl_status fl_cuda_kv_store(fl_backend *b, const void *k, const void *v, int n_tok, int kv_dim,
                                      int stride, const int32_t *slots, void *k_cache, void *v_cache) {
    const int64_t total = (int64_t)n_tok * kv_dim;
    if (total <= 0) return FL_OK;
    const int hd = b->kv_int8_head_dim;
    if (hd > 0) {
        if (kv_dim % hd || hd > KVQ_MAX_HD)
            return FL_ERR(FL_ERR_UNSUPPORTED, "kv_store: int8 records of %d-value heads, kv_dim %d (at most %d a "
                          "head, whole heads)", hd, kv_dim, KVQ_MAX_HD);
        const int n_kv = kv_dim / hd;
        const dim3 grid((unsigned)n_tok, cdiv_u(2 * (int64_t)n_kv, KVQ_WARPS));
        return launch_pdl(kv_store_i8_kernel, grid, dim3(KVQ_WARPS * 32), 0, cuda_impl(b)->stream,
                          (const bf16 *)k, (const bf16 *)v, n_kv, hd, stride, slots,
                          (int64_t)fl_kv_int8_record_bytes(kv_dim, hd), (kv_dim + 3) & ~3, (int)b->kv_fp8_codes,
                          (uint8_t *)k_cache, (uint8_t *)v_cache);
    }
    return launch_pdl(kv_store_kernel, grid_1d(total), THREADS, 0, cuda_impl(b)->stream,
        (const bf16 *)k, (const bf16 *)v, n_tok, kv_dim, stride, slots, (bf16 *)k_cache, (bf16 *)v_cache);
}

/* --- silu_mul, add ------------------------------------------------------------ */
static __global__ void silu_mul_kernel(const bf16 *g, const bf16 *u, int64_t n, int d, int stride, bf16 *o) {
    pdl_enter(); /* before any global access: see launch_pdl */
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t at = stride == d ? i : (i / d) * stride + i % d;
        const float gv = bf2f(g[at]);
        o[i] = f2bf(gv / (1.0f + expf(-gv)) * bf2f(u[at]));
    }
}

/* The same per element, 8 elements a thread in 16-byte loads and stores,
 * one division a vector for the row (widths and strides multiples of 8,
 * 16-byte aligned rows): the scalar kernel's 2-byte accesses and 64-bit
 * index division an element held it to a quarter of the copy rate. */
static __global__ void silu_mul8_kernel(const bf16 *g, const bf16 *u, unsigned nv, unsigned d8, int stride, bf16 *o) {
    pdl_enter(); /* before any global access: see launch_pdl */
    for (unsigned v = blockIdx.x * blockDim.x + threadIdx.x; v < nv; v += gridDim.x * blockDim.x) {
        const unsigned row = v / d8, c8 = v - row * d8;
        const int64_t at = (int64_t)row * stride + 8 * (int64_t)c8;
        const uint4 gw = *(const uint4 *)(g + at), uw = *(const uint4 *)(u + at);
        const bf16 *gv = (const bf16 *)&gw, *uv = (const bf16 *)&uw;
        uint4 ow;
        bf16 *ov = (bf16 *)&ow;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float x = bf2f(gv[e]);
            ov[e] = f2bf(x / (1.0f + expf(-x)) * bf2f(uv[e]));
        }
        *(uint4 *)(o + 8 * (int64_t)v) = ow;
    }
}

extern "C" fl_status fl_cuda_silu_mul(fl_backend *b, const void *gate, const void *up, int n, int d, int stride,
                                      void *out) {
    const int64_t total = (int64_t)n * d;
    if (stride < d) return FL_ERR(FL_ERR_INVALID_ARG, "silu_mul: row stride %d < width %d", stride, d);
    if (total <= 0) return FL_OK;
    if (d % 8 == 0 && stride % 8 == 0 && total / 8 <= 0x7fffffff &&
        (((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out) & 15) == 0)
        return launch_pdl(silu_mul8_kernel, grid_1d(total / 8), THREADS, 0, cuda_impl(b)->stream, (const bf16 *)gate,
                          (const bf16 *)up, (unsigned)(total / 8), (unsigned)(d / 8), stride, (bf16 *)out);
    return launch_pdl(silu_mul_kernel, grid_1d(total), THREADS, 0, cuda_impl(b)->stream,
        (const bf16 *)gate, (const bf16 *)up, total, d, stride, (bf16 *)out);
}

static __global__ void add_kernel(bf16 *x, const bf16 *y, int64_t n) {
    pdl_enter(); /* before any global access: see launch_pdl */
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

extern "C" fl_status fl_cuda_add(fl_backend *b, void *x, const void *y, size_t n) {
    if (!n) return FL_OK;
    return launch_pdl(add_kernel, grid_1d((int64_t)n), THREADS, 0, cuda_impl(b)->stream, (bf16 *)x, (const bf16 *)y,
                                                                          (int64_t)n);
}

static __global__ void add_bias_kernel(bf16 *y, int64_t total, int rows, const void *bias, int bf32) {
    pdl_enter(); /* before any global access: see launch_pdl */
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = f2bf(bf2f(y[i]) + vec_load(bias, bf32, i % rows));
}

extern "C" fl_status fl_cuda_add_bias(fl_backend *b, void *y, int n, int rows, const fl_tensor *bias) {
    if (bias->dtype != FL_DTYPE_F32 && bias->dtype != FL_DTYPE_BF16)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda matmul: bias dtype %s (expected an F32/BF16 device "
                      "vector)", fl_dtype_name(bias->dtype));
    const int64_t total = (int64_t)n * rows;
    if (total <= 0) return FL_OK;
    return launch_pdl(add_bias_kernel, grid_1d(total), THREADS, 0, cuda_impl(b)->stream,
        (bf16 *)y, total, rows, bias->data, bias->dtype == FL_DTYPE_F32);
}

/* --- moe_topk ----------------------------------------------------------------- */
/* One warp per row (moe_topk_row, cuda_moe_route.cuh). */
static __global__ void moe_topk_kernel(const bf16 *logits, int n_experts, int k, fl_moe_route r, int grouped,
                                       int32_t *ids, float *weights) {
    pdl_enter(); /* before any global access: see launch_pdl */
    __shared__ float probs[TOPK_MAX_EXPERTS], gmax[TOPK_MAX_EXPERTS];
    __shared__ bool keep[TOPK_MAX_EXPERTS];
    const int row = blockIdx.x;
    moe_topk_row(logits + (int64_t)row * n_experts, n_experts, k, r, grouped, probs, gmax, keep,
                 ids + (int64_t)row * k, weights + (int64_t)row * k, NULL);
}

extern "C" fl_status fl_cuda_moe_topk(fl_backend *b, const void *logits, int n, int n_experts, int k,
                                      const fl_moe_route *r, int32_t *ids, float *weights) {
    if (k < 1 || k > n_experts || n_experts > TOPK_MAX_EXPERTS)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_topk: k=%d with %d experts", k, n_experts);
    if (n <= 0) return FL_OK;
    return launch_pdl(moe_topk_kernel, n, 32, 0, cuda_impl(b)->stream, (const bf16 *)logits, n_experts, k, *r,
                                                        fl_moe_route_grouped(r, n_experts) ? 1 : 0, ids, weights);
}

/* --- gather / scatter-add / sigmoid scaling --------------------------------------- */
static __global__ void gather_rows_kernel(const bf16 *src, const int32_t *idx, int n_idx, int d,
                                          bf16 *dst) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int64_t total = (int64_t)n_idx * d;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / d, j = i % d;
        dst[i] = src[(int64_t)idx[r] * d + j];
    }
}

extern "C" fl_status fl_cuda_gather_rows(fl_backend *b, const void *src, const int32_t *idx, int n_idx,
                                         int d, void *dst) {
    const int64_t total = (int64_t)n_idx * d;
    if (total <= 0) return FL_OK;
    return launch_pdl(gather_rows_kernel, grid_1d(total), THREADS, 0, cuda_impl(b)->stream,
        (const bf16 *)src, idx, n_idx, d, (bf16 *)dst);
}

/* Indices do not repeat within one call (contract), so no atomics. */
static __global__ void scatter_add_rows_kernel(bf16 *dst, const bf16 *src, const int32_t *idx,
                                               const float *scale, int n_idx, int d) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int64_t total = (int64_t)n_idx * d;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / d, j = i % d;
        const float c = scale ? scale[r] : 1.0f;
        bf16 *o = dst + (int64_t)idx[r] * d + j;
        *o = f2bf(bf2f(*o) + c * bf2f(src[i]));
    }
}

extern "C" fl_status fl_cuda_scatter_add_rows(fl_backend *b, void *dst, const void *src,
                                              const int32_t *idx, const float *scale, int n_idx, int d) {
    const int64_t total = (int64_t)n_idx * d;
    if (total <= 0) return FL_OK;
    return launch_pdl(scatter_add_rows_kernel, grid_1d(total), THREADS, 0, cuda_impl(b)->stream,
        (bf16 *)dst, (const bf16 *)src, idx, scale, n_idx, d);
}

static __global__ void sigmoid_scale_rows_kernel(bf16 *x, const bf16 *g, int n, int d) {
    pdl_enter(); /* before any global access: see launch_pdl */
    const int64_t total = (int64_t)n * d;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float s = 1.0f / (1.0f + expf(-bf2f(g[i / d])));
        x[i] = f2bf(bf2f(x[i]) * s);
    }
}

extern "C" fl_status fl_cuda_sigmoid_scale_rows(fl_backend *b, void *x, const void *g, int n, int d) {
    const int64_t total = (int64_t)n * d;
    if (total <= 0) return FL_OK;
    return launch_pdl(sigmoid_scale_rows_kernel, grid_1d(total), THREADS, 0, cuda_impl(b)->stream,
        (bf16 *)x, (const bf16 *)g, n, d);
}

/* --- argmax_rows ------------------------------------------------------------ */
/* One block per row (a vocabulary of 128k-152k bf16 is 256-304 KB: 1024
 * threads each read 16 bytes per step, coalesced). Each thread keeps its
 * best (value, lowest index) and whether it saw a NaN; the block reduces
 * with the same order (larger value, then lower index), so the result is
 * exactly the host sampler's argmax over the same bf16 values. */
#define ARGMAX_THREADS 1024
static __device__ __forceinline__ void argmax_take(float &bv, int &bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows_kernel(const bf16 *x, int d, int offset, float *out) {
    pdl_enter(); /* before any global access: see launch_pdl */
    __shared__ float sv[32];
    __shared__ int si[32], snan[32];
    const bf16 *r = x + (int64_t)blockIdx.x * d;
    float bv = -INFINITY;
    int bi = INT_MAX, nan = 0;
    const bool vec = ((uintptr_t)r & 15) == 0;
    int j0 = 0;
    if (vec) {
        const int nv = d / 8;
        for (int v = threadIdx.x; v < nv; v += blockDim.x) {
            const uint4 q = __ldcs((const uint4 *)r + v);
            const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float lo = __uint_as_float(w[k] << 16), hi = __uint_as_float(w[k] & 0xffff0000u);
                nan |= (lo != lo) | (hi != hi);
                argmax_take(bv, bi, lo, 8 * v + 2 * k);
                argmax_take(bv, bi, hi, 8 * v + 2 * k + 1);
            }
        }
        j0 = nv * 8;
    }
    for (int j = j0 + threadIdx.x; j < d; j += blockDim.x) {
        const float v = bf2f(r[j]);
        nan |= v != v;
        argmax_take(bv, bi, v, j);
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
        argmax_take(bv, bi, ov, oi);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sv[warp] = bv, si[warp] = bi, snan[warp] = nan;
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : INT_MAX;
        nan = lane < nw ? snan[lane] : 0;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            nan |= __shfl_xor_sync(0xffffffffu, nan, o);
            argmax_take(bv, bi, ov, oi);
        }
        if (lane == 0) {
            /* a row of -inf only: index 0, as the host scan would give */
            if (bi == INT_MAX) bi = 0;
            out[2 * blockIdx.x] = nan ? __int_as_float(0x7fc00000) : bv;
            out[2 * blockIdx.x + 1] = (float)(offset + bi);
        }
    }
}

extern "C" fl_status fl_cuda_argmax_rows(fl_backend *b, const void *x, int n, int d, int offset, float *out) {
    if (d <= 0 || offset < 0 || (int64_t)offset + d > (1 << 24))
        return FL_ERR(FL_ERR_INVALID_ARG, "argmax_rows: %d columns from %d (ids must stay below 2^24)", d,
                      offset);
    if (n <= 0) return FL_OK;
    return launch_pdl(argmax_rows_kernel, n, ARGMAX_THREADS, 0, cuda_impl(b)->stream, (const bf16 *)x, d, offset, out);
}
