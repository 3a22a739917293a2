/*
 * cuda_gemv_rows.cu — bf16 matmuls of a few rows at decode sizes (a MoE
 * router: Mixtral's is 8 x 4096), y[n, rows] = x[n, in] @ W^T (+ bias).
 *
 * Why: the bulk-copy bf16 GEMV (cuda_gemv_bf16.cu) streams 16-row tiles and
 * refuses row counts that are not a multiple of 16, so Mixtral's router
 * went to cuBLAS, which ran it as a split-K GEMV plus a reduce: two more
 * launches a layer, neither with programmatic dependent launch, so each
 * waited for the kernel before it to drain (a visible cost a layer under
 * Nsight Compute). Here a block is one row: its
 * threads load the row (16 bytes a chunk, a few chunks a thread) before the
 * PDL wait, since weights never depend on the previous kernel, then x's
 * chunks of up to four tokens at a time, f32 dot products, a warp sum and
 * one block-wide add in warp order, rounded to bf16 as matmul stores.
 */
#include "kernels/cuda/cuda_common.cuh"

#define GR_THREADS 256
#define GR_MAX_CH 4   /* 16-byte chunks of the row a thread holds: in <= 8192 */
#define GR_MAX_N 16   /* tokens a launch */
#define GR_MAX_ROWS 64

template <int NCH>
static __global__ void __launch_bounds__(GR_THREADS)
    gemv_rows_kernel(const bf16 *__restrict__ w, const bf16 *x, int n, int in, const void *bias, int bf32, bf16 *y,
                     int rows) {
    if (FL_PDL_EARLY) pdl_trigger();
    const int r = blockIdx.x, tid = threadIdx.x, nv = in >> 3;
    const uint4 *wr4 = (const uint4 *)(w + (int64_t)r * in);
    uint4 wv[NCH];
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        const int j = tid + c * GR_THREADS;
        if (j < nv) wv[c] = wr4[j];
    }
    pdl_wait(); /* x comes from the previous kernel */
    if (!FL_PDL_EARLY) pdl_trigger();
    __shared__ float red[GR_THREADS / 32][GR_MAX_N];
    const uint4 *x4 = (const uint4 *)x;
    for (int t0 = 0; t0 < n; t0 += 4) { /* four tokens' x chunks in flight together */
        uint4 xv[4][NCH];
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int c = 0; c < NCH; c++) {
                const int j = tid + c * GR_THREADS;
                if (t0 + u < n && j < nv) xv[u][c] = x4[(int64_t)(t0 + u) * nv + j];
            }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float acc = 0.0f;
#pragma unroll
            for (int c = 0; c < NCH; c++) {
                const int j = tid + c * GR_THREADS;
                if (t0 + u >= n || j >= nv) continue;
                float a[8], b[8];
                bf16x8_unpack(wv[c], a);
                bf16x8_unpack(xv[u][c], b);
#pragma unroll
                for (int e = 0; e < 8; e++) acc = fmaf(a[e], b[e], acc);
            }
            acc = warp_sum(acc);
            if ((tid & 31) == 0 && t0 + u < n) red[tid >> 5][t0 + u] = acc;
        }
    }
    __syncthreads();
    if (tid < n) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < GR_THREADS / 32; i++) s += red[i][tid];
        if (bias) s += vec_load(bias, bf32, r);
        y[(int64_t)tid * rows + r] = f2bf(s);
    }
}

extern "C" bool fl_cuda_gemv_rows_takes(const void *x, int n, const fl_tensor *w) {
    return n >= 1 && n <= GR_MAX_N && w->dtype == FL_DTYPE_BF16 && w->ndim == 2 && w->shape[0] >= 1 &&
           w->shape[0] <= GR_MAX_ROWS && w->shape[1] % 8 == 0 && w->shape[1] <= 8 * GR_THREADS * GR_MAX_CH &&
           ((uintptr_t)w->data & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

/* The caller checked fl_cuda_gemv_rows_takes. */
extern "C" fl_status fl_cuda_gemv_rows(fl_backend *b, const void *x, int n, const fl_tensor *w, const fl_tensor *bias,
                                       void *y) {
    const int rows = (int)w->shape[0], in = (int)w->shape[1];
    const int nch = (in / 8 + GR_THREADS - 1) / GR_THREADS;
    const void *bp = bias ? bias->data : NULL;
    const int bf32 = bias && bias->dtype == FL_DTYPE_F32;
    cudaStream_t st = cuda_impl(b)->stream;
    const bf16 *wd = (const bf16 *)w->data, *xd = (const bf16 *)x;
    if (nch <= 1) return launch_pdl(gemv_rows_kernel<1>, dim3(rows), GR_THREADS, 0, st, wd, xd, n, in, bp, bf32, (bf16 *)y, rows);
    if (nch <= 2) return launch_pdl(gemv_rows_kernel<2>, dim3(rows), GR_THREADS, 0, st, wd, xd, n, in, bp, bf32, (bf16 *)y, rows);
    return launch_pdl(gemv_rows_kernel<4>, dim3(rows), GR_THREADS, 0, st, wd, xd, n, in, bp, bf32, (bf16 *)y, rows);
}
