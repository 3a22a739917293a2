/*
 * cuda_prefetch.cu — the weight prefetch into L2 (backend op
 * prefetch_weight): the first part of a W4 GEMV's weights requested while
 * the short kernels before that GEMV run, from a side stream.
 *
 * Why. At batch 1 a dense layer is q|k|v GEMV, attention, o GEMV, gate|up
 * GEMV, down GEMV. The chain of short stages (attention, the o GEMV, the
 * release between dependent kernels) keeps HBM mostly idle for ~10 us a
 * layer (docs/cuda.md, "what each op costs inside the step"), and the big
 * GEMVs after it are latency bound (67-78 % of the copy ceiling in the
 * step). Bytes already in L2 come back faster, so the GEMV whose first part
 * is in L2 when it starts spends less time on it, and HBM does that part's
 * reading in time that was idle. The L2 (50 MB on the H200) holds the o
 * projection and ~40 % of Llama-3-8B's gate|up beside what streams through.
 *
 * How. Each 16-row tile of a packed W4 weight is read in slices, each
 * front to back (fl_cuda_w4_stream_slices: the bulk kernel's warps, the
 * register ring's block), so "the first part" is the first pct % of every
 * slice, codes and their scales: a GEMV whose blocks all start on L2 bytes.
 * The requests are cp.async.bulk.prefetch.L2 (one instruction a range, no
 * registers or shared memory held while the bytes arrive), issued by a small
 * kernel on the backend's side stream, forked from the compute stream where
 * the op is called: it starts once the kernel enqueued before the call has
 * completed and runs beside the ones after it, off their dependency chain
 * (a prefetch never changes a result, so nothing waits for it). Inside a
 * recording the fork is captured as a branch of the graph and joined back
 * before the capture ends (fl_cuda_prefetch_join, called by graph_end).
 *
 * FL_L2_PF=GU[,O] (read once): the percent of a fused gate|up+SiLU's
 * weights (GU) and of a plain projection's (O, the o projection) to
 * prefetch; 0 or unset: off.
 */
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_bulk.cuh"
#include "kernels/cuda/cuda_common.cuh"

/* Bulk prefetch of `bytes` (multiple of 16, 16-byte aligned) into L2, in
 * pieces of at most 64 KB. */
static __device__ __forceinline__ void pf_l2(const unsigned char *p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (unsigned o = 0; o < bytes; o += 65536u) {
        const unsigned b = bytes - o < 65536u ? bytes - o : 65536u;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + o), "r"(b) : "memory");
    }
#else
    (void)p, (void)bytes;
#endif
}

/* Item i = (tile t, slice s): column blocks [u0, u0 + len) of tile t, len
 * the first pct % of the slice rounded up to whole column blocks, and the
 * scale groups they touch. Packed layout (cuda_common.cuh): tile t's codes
 * at t nkb 512 bytes (512 a column block), its scales at t ngrp 64 bytes (64
 * a group). */
static __global__ void l2_prefetch_kernel(const unsigned char *codes, const unsigned char *scales, int ntile,
                                          int nkb, int gshift, int slices, int align, int pct) {
    const int nal = nkb / align, ngrp = nkb >> gshift;
    const int64_t items = (int64_t)ntile * slices;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < items; i += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / slices), s = (int)(i % slices);
        const int u0 = (int)((int64_t)s * nal / slices) * align, u1 = (int)((int64_t)(s + 1) * nal / slices) * align;
        const int len = (int)(((int64_t)(u1 - u0) * pct + 99) / 100);
        if (len <= 0) continue;
        pf_l2(codes + ((size_t)t * nkb + u0) * 512u, (unsigned)len * 512u);
        const int g0 = u0 >> gshift, g1 = ((u0 + len - 1) >> gshift) + 1;
        pf_l2(scales + ((size_t)t * ngrp + g0) * 64u, (unsigned)(g1 - g0) * 64u);
    }
}

/* FL_L2_PF=GU[,O] (see the top): percents by op, read once. */
static int pf_pct(int op) {
    static int gu = -1, o;
    if (gu < 0) {
        const char *e = getenv("FL_L2_PF");
        gu = o = 0;
        if (e && *e && sscanf(e, "%d,%d", &gu, &o) < 1) {
            fprintf(stderr, "flotilla: FL_L2_PF=%s is not GU[,O] (percents); prefetch off\n", e);
            gu = o = 0;
        }
        gu = gu < 0 ? 0 : gu > 100 ? 100 : gu;
        o = o < 0 ? 0 : o > 100 ? 100 : o;
    }
    return op == FL_PREFETCH_GATE_UP ? gu : op == FL_PREFETCH_MATMUL ? o : 0;
}

extern "C" fl_status fl_cuda_prefetch_weight(fl_backend *b, const fl_tensor *w, const fl_tensor *up, int op, int n) {
    fl_cuda *c = cuda_impl(b);
    const int pct = pf_pct(op);
    /* a hint: what the W4 GEMVs do not read (other dtypes and layouts,
     * prefill sizes), or a device without bulk copies, is skipped */
    if (pct <= 0 || n < 1 || n > 16 || !c->pf_stream || !fl_cuda_bulk_device_ok(c)) return FL_OK;
    if (w->dtype != FL_DTYPE_W4 || w->ndim != 2) return FL_OK;
    const int64_t rows = w->shape[0], in = w->shape[1];
    if (!w4_packed(rows, in, w->group)) return FL_OK;
    int slices = 1, align = 1;
    if (op == FL_PREFETCH_GATE_UP) {
        if (n > fl_cuda_gate_up_silu_max_n(b, w, up)) return FL_OK;
        FL_TRY(fl_cuda_w4_stream_slices(c, n, (int)in, (int)(up ? rows : rows / 2), w->group, true, &slices,
                                        &align));
    } else {
        FL_TRY(fl_cuda_w4_stream_slices(c, n, (int)in, (int)rows, w->group, false, &slices, &align));
    }
    int gshift = 0;
    while ((64 << gshift) < w->group) gshift++;
    const int nkb = (int)(in / 64);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    FL_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cs));
    FL_CUDA_CHECK(cudaEventRecord(c->pf_fork, c->stream));
    FL_CUDA_CHECK(cudaStreamWaitEvent(c->pf_stream, c->pf_fork, 0));
    /* a few warps spread over SMs: the requests are what matters, and the
     * blocks must fit beside a GEMV's (64 threads, no shared memory) */
    const fl_tensor *ws[2] = {w, up};
    for (int i = 0; i < 2 && ws[i]; i++) {
        const int ntile = (int)(ws[i]->shape[0] / 16);
        const int64_t items = (int64_t)ntile * slices;
        const unsigned blocks = (unsigned)(items / 64 + 1 < 32 ? items / 64 + 1 : 32);
        l2_prefetch_kernel<<<blocks, 64, 0, c->pf_stream>>>((const unsigned char *)ws[i]->data,
                                                           (const unsigned char *)ws[i]->scales, ntile, nkb, gshift,
                                                           slices, align, pct);
        FL_CUDA_LAUNCH_CHECK("l2_prefetch");
    }
    if (cs == cudaStreamCaptureStatusActive) c->pf_join = true;
    return FL_OK;
}

extern "C" fl_status fl_cuda_prefetch_join(fl_cuda *c) {
    if (!c->pf_join) return FL_OK;
    c->pf_join = false;
    FL_CUDA_CHECK(cudaEventRecord(c->pf_done, c->pf_stream));
    FL_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->pf_done, 0));
    return FL_OK;
}
