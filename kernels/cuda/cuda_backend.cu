/*
 * cuda_backend.cu — the CUDA backend on one GPU: device memory, the stream,
 * weight upload (conversion and W4 repacking) and the op table.
 *
 * Choices, and why:
 *  - One cudaStream_t (non-blocking) per backend; every op and copy is
 *    enqueued on it, so the op order of forward.c is the execution order.
 *    download/download_act synchronize the stream (they return host data).
 *  - Activations are bf16 (half the bytes of f32, the range of f32);
 *    arithmetic is f32 in every kernel.
 *  - 2-D float weights (linear layers, embedding tables) become bf16 device
 *    matrices, the input cuBLAS' tensor-core GEMM wants. 1-D weights (norm
 *    scales, biases) become f32 vectors: they are tiny and their precision
 *    multiplies every activation.
 *  - W4 shapes the tensor-core GEMV takes (w4_packed: rows % 16, cols % 64,
 *    power-of-two group >= 64) are repacked on the device into its layout
 *    (cuda_matmul.cu, "W4 packed layout"): each lane's 16-byte load is its
 *    mma fragments, so the decode is a few LOP3s and no shuffles. Other
 *    shapes keep the row-major code bytes. Scale and bias become one __half2
 *    per (row, group): 4 bytes per group instead of 8, and one load; f16
 *    keeps 11 bits, more than bf16 activations carry. In the packed layout
 *    the pairs of rows g and g + 8 of a 16-row tile sit side by side.
 *  - Graph capture (graph_begin/end/launch): stream capture of the ops
 *    enqueued in between, instantiated once and replayed with
 *    cudaGraphLaunch (runtime/model/forward_graph.c captures decode steps).
 *    Capture runs in thread-local mode (another thread's unrelated CUDA
 *    calls are not disturbed); cuBLAS gets an explicit workspace at init,
 *    since a GEMM recorded in a graph must not allocate one, and the W4
 *    GEMV's programmatic dependent launch is recorded as a programmatic
 *    edge (allowed in graphs since CUDA 12.3).
 * Host-side conversions happen here at load time, never in the hot path.
 */
#include <cuda_profiler_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"

static fl_status cuda_alloc(fl_backend *b, size_t bytes, void **ptr) {
    *ptr = NULL;
    /* cudaMalloc(0) returns NULL; callers expect a valid pointer. */
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 256);
    if (e != cudaSuccess) {
        *ptr = NULL;
        return FL_ERR(e == cudaErrorMemoryAllocation ? FL_ERR_OOM : FL_ERR_CUDA,
                      "cuda backend: cudaMalloc of %zu bytes on device %d failed: %s", bytes,
                      cuda_impl(b)->device, cudaGetErrorString(e));
    }
    return FL_OK;
}

static void cuda_free(fl_backend *b, void *ptr) {
    (void)b;
    if (ptr) cudaFree(ptr);
}

/* Host -> device. From pageable memory cudaMemcpyAsync returns once the
 * source has been staged, so the caller may reuse `src` immediately. */
static fl_status cuda_upload(fl_backend *b, void *dst, const void *src, size_t bytes) {
    if (!bytes) return FL_OK;
    FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_impl(b)->stream));
    return FL_OK;
}

static fl_status cuda_download(fl_backend *b, void *dst, const void *src, size_t bytes) {
    fl_cuda *c = cuda_impl(b);
    if (bytes) FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    FL_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return FL_OK;
}

static fl_status cuda_memset0(fl_backend *b, void *dst, size_t bytes) {
    if (bytes) FL_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda_impl(b)->stream));
    return FL_OK;
}

static fl_status cuda_copy(fl_backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_impl(b)->stream));
    return FL_OK;
}

static fl_status cuda_sync(fl_backend *b) {
    FL_CUDA_CHECK(cudaStreamSynchronize(cuda_impl(b)->stream));
    return FL_OK;
}

/* Synchronous host -> device copy of a temporary host buffer. */
static fl_status copy_in(fl_cuda *c, void *dst, const void *src, size_t bytes) {
    FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    FL_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return FL_OK;
}

/* W4: codes copied (and repacked on the device where w4_packed), scales/bias
 * packed as __half2 pairs. */
static fl_status upload_w4(fl_backend *b, const fl_tensor *host, fl_tensor *dev) {
    fl_cuda *c = cuda_impl(b);
    fl_status st = FL_OK;
    const int64_t rows = host->shape[0], cols = host->shape[1];
    if (host->ndim != 2 || host->group <= 0 || cols % host->group || cols % 2 || !host->scales ||
        !host->bias)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda upload_weight: W4 tensor [%lld, %lld] group %d is "
                      "malformed (needs 2-D, cols a multiple of the group, scales and bias)",
                      (long long)rows, (long long)cols, host->group);
    const int64_t ng = rows * (cols / host->group);
    const size_t code_bytes = (size_t)rows * (size_t)(cols / 2);
    __half2 *sb = (__half2 *)malloc((size_t)ng * sizeof(__half2));
    void *d_codes = NULL, *d_sb = NULL, *d_raw = NULL;
    const bool packed = w4_packed(rows, cols, host->group);
    FL_CHECK_ALLOC(sb, st, fail);
    if (packed) {
        /* [tile][group][g][2]: rows 16 T + g and 16 T + g + 8 side by side */
        const int64_t gpr = cols / host->group;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t gi = 0; gi < gpr; gi++) {
                const int64_t tile = r / 16, g = r % 8, h = (r % 16) / 8;
                sb[((tile * gpr + gi) * 8 + g) * 2 + h] =
                    __floats2half2_rn(host->scales[r * gpr + gi], host->bias[r * gpr + gi]);
            }
    } else {
        for (int64_t i = 0; i < ng; i++) sb[i] = __floats2half2_rn(host->scales[i], host->bias[i]);
    }
    FL_TRY_GOTO(cuda_alloc(b, code_bytes, &d_codes), st, fail);
    FL_TRY_GOTO(cuda_alloc(b, (size_t)ng * sizeof(__half2), &d_sb), st, fail);
    if (packed) {
        FL_TRY_GOTO(cuda_alloc(b, code_bytes, &d_raw), st, fail);
        FL_TRY_GOTO(copy_in(c, d_raw, host->data, code_bytes), st, fail);
        FL_TRY_GOTO(fl_cuda_w4_repack(b, d_raw, d_codes, (int)rows, (int)cols), st, fail);
        FL_CUDA_CHECK_GOTO(cudaStreamSynchronize(c->stream), st, fail);
        cuda_free(b, d_raw);
        d_raw = NULL;
    } else {
        FL_TRY_GOTO(copy_in(c, d_codes, host->data, code_bytes), st, fail);
    }
    FL_TRY_GOTO(copy_in(c, d_sb, sb, (size_t)ng * sizeof(__half2)), st, fail);
    if (packed) FL_TRY_GOTO(fl_cuda_w4_deq_reserve(b, rows, cols), st, fail);
    free(sb);
    *dev = *host;
    dev->data = d_codes;
    dev->scales = (float *)d_sb; /* __half2 [rows, cols/group], see cuda_common.cuh */
    dev->bias = NULL;
    dev->owned = 0;
    return FL_OK;
fail:
    free(sb);
    cuda_free(b, d_raw);
    cuda_free(b, d_codes);
    cuda_free(b, d_sb);
    return st;
}

static fl_status cuda_upload_weight(fl_backend *b, const fl_tensor *host, fl_tensor *dev) {
    fl_cuda *c = cuda_impl(b);
    fl_status st = FL_OK;
    switch (host->dtype) {
    case FL_DTYPE_F32: case FL_DTYPE_F16: case FL_DTYPE_BF16: case FL_DTYPE_Q8_0: break; /* -> bf16 */
    case FL_DTYPE_W4: return upload_w4(b, host, dev);
    case FL_DTYPE_F8_E4M3:
        if (fl_cuda_fp8_takes(host)) return fl_cuda_fp8_upload(b, host, dev);
        if (!host->scales || host->ndim != 2)
            return FL_ERR(FL_ERR_UNSUPPORTED, "cuda backend: F8_E4M3 weights without a scale a row are not "
                          "supported (loaders convert FP8 checkpoints before upload)");
        break; /* a shape cuBLASLt's FP8 GEMMs refuse: as bf16 */
    default:
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda backend: weights of dtype %s are not supported "
                      "(loaders convert GGUF block kinds before upload)", fl_dtype_name(host->dtype));
    }
    if (host->ndim < 1 || host->ndim > 2 || !host->data)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda upload_weight: %d-D %s tensor is not supported",
                      host->ndim, fl_dtype_name(host->dtype));
    const int64_t cols = host->shape[host->ndim - 1];
    const int64_t rows = host->ndim == 2 ? host->shape[0] : 1;
    const int vec = host->ndim == 1;
    const size_t esz = vec ? 4 : 2;
    const size_t bytes = (size_t)rows * (size_t)cols * esz;
    void *d = NULL, *hbuf = NULL;
    float *row = NULL;
    FL_TRY_GOTO(cuda_alloc(b, bytes, &d), st, fail);
    if (!vec && host->dtype == FL_DTYPE_BF16) {
        FL_TRY_GOTO(copy_in(c, d, host->data, bytes), st, fail); /* already the device format */
    } else {
        hbuf = malloc(bytes ? bytes : 1);
        row = (float *)malloc((size_t)cols * sizeof(float) + 4);
        FL_CHECK_ALLOC(hbuf, st, fail);
        FL_CHECK_ALLOC(row, st, fail);
        for (int64_t r = 0; r < rows; r++) {
            fl_tensor_row_f32(host, r, row);
            if (vec) {
                memcpy((float *)hbuf + r * cols, row, (size_t)cols * 4);
            } else {
                uint16_t *o = (uint16_t *)hbuf + r * cols;
                for (int64_t j = 0; j < cols; j++) o[j] = fl_f32_to_bf16(row[j]);
            }
        }
        FL_TRY_GOTO(copy_in(c, d, hbuf, bytes), st, fail);
    }
    free(hbuf);
    free(row);
    *dev = *host;
    dev->dtype = vec ? FL_DTYPE_F32 : FL_DTYPE_BF16;
    dev->data = d;
    dev->scales = NULL;
    dev->bias = NULL;
    dev->owned = 0;
    return FL_OK;
fail:
    free(hbuf);
    free(row);
    cuda_free(b, d);
    return st;
}

static void cuda_free_weight(fl_backend *b, fl_tensor *dev) {
    if (!dev) return;
    cuda_free(b, dev->data);
    if (dev->dtype == FL_DTYPE_W4 || dev->dtype == FL_DTYPE_F8_E4M3) cuda_free(b, dev->scales);
    memset(dev, 0, sizeof *dev);
}

/* f32 host <-> bf16 device: converted on the host (round to nearest even). */
static fl_status cuda_upload_act(fl_backend *b, void *dst, const float *src, size_t n) {
    if (!n) return FL_OK;
    uint16_t *h = (uint16_t *)malloc(n * 2);
    if (!h) return FL_ERR(FL_ERR_OOM, "out of memory converting %zu activations", n);
    for (size_t i = 0; i < n; i++) h[i] = fl_f32_to_bf16(src[i]);
    fl_status st = copy_in(cuda_impl(b), dst, h, n * 2);
    free(h);
    return st;
}

static fl_status cuda_download_act(fl_backend *b, float *dst, const void *src, size_t n) {
    if (!n) return cuda_sync(b);
    uint16_t *h = (uint16_t *)malloc(n * 2);
    if (!h) return FL_ERR(FL_ERR_OOM, "out of memory converting %zu activations", n);
    fl_status st = cuda_download(b, h, src, n * 2);
    if (st == FL_OK)
        for (size_t i = 0; i < n; i++) dst[i] = fl_bf16_to_f32(h[i]);
    free(h);
    return st;
}

static void cuda_destroy(fl_backend *b) {
    if (!b) return;
    fl_cuda *c = cuda_impl(b);
    if (c) {
        if (c->stream) cudaStreamSynchronize(c->stream);
        if (c->cublas) cublasDestroy(c->cublas);
        if (c->cublas_ws) cudaFree(c->cublas_ws);
        if (c->w4_deq) cudaFree(c->w4_deq);
        if (c->w4g_ws) cudaFree(c->w4g_ws);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c);
    }
    free(b);
}

/* --- graph capture ------------------------------------------------------------ */
static fl_status cuda_graph_begin(fl_backend *b) {
    FL_CUDA_CHECK(cudaStreamBeginCapture(cuda_impl(b)->stream, cudaStreamCaptureModeThreadLocal));
    return FL_OK;
}

static fl_status cuda_graph_end(fl_backend *b, bool keep, void **graph) {
    fl_cuda *c = cuda_impl(b);
    cudaGraph_t g = NULL;
    cudaGraphExec_t ex = NULL;
    *graph = NULL;
    /* Ends the capture even when an op failed inside it (the stream would
     * otherwise stay in capture mode and refuse every later op). */
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess || !keep) {
        (void)cudaGetLastError();
        if (g) cudaGraphDestroy(g);
        if (!keep) return FL_OK;
        return FL_ERR(FL_ERR_CUDA, "cuda backend: ending the stream capture failed: %s (%s)",
                      cudaGetErrorString(e), cudaGetErrorName(e));
    }
    e = cudaGraphInstantiateWithFlags(&ex, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return FL_ERR(FL_ERR_CUDA, "cuda backend: instantiating the captured graph failed: %s (%s)",
                      cudaGetErrorString(e), cudaGetErrorName(e));
    }
    /* the executable graph's upload now, not in the first replay's launch */
    if (cudaGraphUpload(ex, c->stream) != cudaSuccess) (void)cudaGetLastError(); /* not fatal: the launch uploads */
    *graph = (void *)ex;
    return FL_OK;
}

static fl_status cuda_graph_launch(fl_backend *b, void *graph) {
    FL_CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, cuda_impl(b)->stream));
    return FL_OK;
}

static void cuda_graph_free(fl_backend *b, void *graph) {
    (void)b;
    if (graph) cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

/* --- page-locked host memory ----------------------------------------------------- */
static fl_status cuda_host_alloc(fl_backend *b, size_t bytes, void **ptr) {
    *ptr = NULL;
    cudaError_t e = cudaMallocHost(ptr, bytes ? bytes : 256);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *ptr = NULL;
        return FL_ERR(e == cudaErrorMemoryAllocation ? FL_ERR_OOM : FL_ERR_CUDA,
                      "cuda backend: cudaMallocHost of %zu bytes (device %d) failed: %s", bytes,
                      cuda_impl(b)->device, cudaGetErrorString(e));
    }
    return FL_OK;
}

static void cuda_host_free(fl_backend *b, void *ptr) {
    (void)b;
    if (ptr) cudaFreeHost(ptr);
}

/* --- KV block moves --------------------------------------------------------------- */
/* One cudaMemcpyAsync per run of blocks consecutive on both sides (a
 * swapped sequence's blocks often are), on the backend's stream. */
static fl_status cuda_copy_blocks(fl_backend *b, void *dst, const void *src, const int32_t *dst_ids,
                                  const int32_t *src_ids, int n, size_t block_bytes, bool to_host) {
    cudaStream_t st = cuda_impl(b)->stream;
    const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    for (int i = 0; i < n;) {
        int run = 1;
        while (i + run < n && dst_ids[i + run] == dst_ids[i] + run && src_ids[i + run] == src_ids[i] + run) run++;
        FL_CUDA_CHECK(cudaMemcpyAsync((char *)dst + (size_t)dst_ids[i] * block_bytes,
                                      (const char *)src + (size_t)src_ids[i] * block_bytes, (size_t)run * block_bytes,
                                      kind, st));
        i += run;
    }
    return FL_OK;
}

static fl_status cuda_mem_info(fl_backend *b, size_t *free_bytes, size_t *total_bytes) {
    FL_CUDA_CHECK(cudaSetDevice(cuda_impl(b)->device));
    FL_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    return FL_OK;
}

/* --- cross-stream ordering ------------------------------------------------------- */
/* A fresh event per fence: cudaStreamWaitEvent takes the event's state at
 * the call, and cudaEventDestroy of a pending event releases it once it has
 * completed, so nothing is kept between calls (a fence costs about two
 * microseconds of host time; the MoE exchange uses four per layer). */
static fl_status cuda_profile_range(fl_backend *b, bool on) {
    FL_CUDA_CHECK(cudaSetDevice(cuda_impl(b)->device));
    FL_CUDA_CHECK(on ? cudaProfilerStart() : cudaProfilerStop());
    return FL_OK;
}

static fl_status cuda_stream_wait(fl_backend *b, void *waiter, void *signaler) {
    cudaStream_t own = cuda_impl(b)->stream;
    cudaStream_t w = waiter ? (cudaStream_t)waiter : own, s = signaler ? (cudaStream_t)signaler : own;
    if (w == s) return FL_OK; /* a stream is ordered with itself */
    cudaEvent_t ev;
    FL_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t e = cudaEventRecord(ev, s);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(w, ev, 0);
    cudaEventDestroy(ev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return FL_ERR(FL_ERR_CUDA, "cuda backend: ordering stream %p after stream %p (device %d) "
                      "failed: %s", (void *)w, (void *)s, cuda_impl(b)->device, cudaGetErrorString(e));
    }
    return FL_OK;
}

static void *cuda_native_stream(fl_backend *b);

static const fl_backend_ops cuda_ops = {
    /* .alloc = */ cuda_alloc,
    /* .free = */ cuda_free,
    /* .upload = */ cuda_upload,
    /* .download = */ cuda_download,
    /* .memset0 = */ cuda_memset0,
    /* .copy = */ cuda_copy,
    /* .sync = */ cuda_sync,
    /* .upload_weight = */ cuda_upload_weight,
    /* .free_weight = */ cuda_free_weight,
    /* .upload_act = */ cuda_upload_act,
    /* .download_act = */ cuda_download_act,
    /* .destroy = */ cuda_destroy,
    /* .embed = */ fl_cuda_embed,
    /* .rmsnorm = */ fl_cuda_rmsnorm,
    /* .matmul = */ fl_cuda_matmul,
    /* .rope = */ fl_cuda_rope,
    /* .rope_kv_store = */ fl_cuda_rope_kv_store,
    /* .kv_store = */ fl_cuda_kv_store,
    /* .attention = */ fl_cuda_attention,
    /* .silu_mul = */ fl_cuda_silu_mul,
    /* .add = */ fl_cuda_add,
    /* .add_rmsnorm = */ fl_cuda_add_rmsnorm,
    /* .moe_topk = */ fl_cuda_moe_topk,
    /* .gather_rows = */ fl_cuda_gather_rows,
    /* .scatter_add_rows = */ fl_cuda_scatter_add_rows,
    /* .sigmoid_scale_rows = */ fl_cuda_sigmoid_scale_rows,
    /* .mla_attention = */ fl_cuda_mla_attention,
    /* .argmax_rows = */ fl_cuda_argmax_rows,
    /* .copy_2d = */ fl_cuda_copy_2d,
    /* .sample_rows_ws = */ fl_cuda_sample_rows_ws,
    /* .sample_rows = */ fl_cuda_sample_rows,
    /* .moe_group = */ fl_cuda_moe_group,
    /* .moe_matmul = */ fl_cuda_moe_matmul,
    /* .moe_combine = */ fl_cuda_moe_combine,
    /* .graph_begin = */ cuda_graph_begin,
    /* .graph_end = */ cuda_graph_end,
    /* .graph_launch = */ cuda_graph_launch,
    /* .graph_free = */ cuda_graph_free,
    /* .host_alloc = */ cuda_host_alloc,
    /* .host_free = */ cuda_host_free,
    /* .stream_wait = */ cuda_stream_wait,
    /* .native_stream = */ cuda_native_stream,
    /* .decode_layer = */ fl_cuda_decode_layer,
    /* .moe_gate_up_silu = */ fl_cuda_moe_gate_up_silu,
    /* .moe_combine_add_rmsnorm = */ fl_cuda_moe_combine_add_rmsnorm,
    /* .qknorm_rope_kv_store = */ fl_cuda_qknorm_rope_kv_store,
    /* .mla_rope_norm_store = */ fl_cuda_mla_rope_norm_store,
    /* .profile_range = */ cuda_profile_range,
    /* .mem_info = */ cuda_mem_info,
    /* .copy_blocks = */ cuda_copy_blocks,
    /* .kv_int8 = */ true,
    /* .kv_int8_mla = */ true,
    /* .kv_fp8 = */ true,
    /* .kv_bf16 = */ false, /* bf16 is its activation dtype already */
    /* .kv_blocked = */ false,
};

static void *cuda_native_stream(fl_backend *b) {
    if (!b || b->ops != &cuda_ops) return NULL;
    return (void *)cuda_impl(b)->stream;
}

/* FL_CUDA_TUNE (core/option_list.h): the tuning overrides of an end-to-end
 * A/B run, applied once per process, before the first backend reads them. */
static fl_status apply_env_tune(void) {
    static char why[512];
    static const bool ok = [] {
        if (fl_cuda_tune_parse_list(fl_opt_str(FL_OPT_CUDA_TUNE)) == FL_OK) return true;
        snprintf(why, sizeof why, "%s", fl_error_msg());
        return false;
    }();
    return ok ? FL_OK : FL_ERR(FL_ERR_INVALID_ARG, "FL_CUDA_TUNE: %s", why);
}

extern "C" fl_status fl_backend_cuda_init(int device, fl_backend **out) {
    *out = NULL;
    FL_TRY(apply_env_tune());
    fl_status st = FL_OK;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "cuda backend: no CUDA GPU is visible (%s); use --backend cpu",
                      e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount returned 0");
    if (device < 0 || device >= count)
        return FL_ERR(FL_ERR_INVALID_ARG, "cuda backend: device %d requested, %d visible", device, count);
    fl_backend *b = (fl_backend *)calloc(1, sizeof *b);
    fl_cuda *c = (fl_cuda *)calloc(1, sizeof *c);
    cudaDeviceProp prop;
    if (!b || !c) {
        free(b);
        free(c);
        return FL_ERR(FL_ERR_OOM, "out of memory creating the cuda backend");
    }
    b->ops = &cuda_ops;
    b->name = "cuda";
    b->act_dtype = FL_DTYPE_BF16;
    b->impl = c;
    c->device = device;
    FL_CUDA_CHECK_GOTO(cudaSetDevice(device), st, fail);
    FL_CUDA_CHECK_GOTO(cudaGetDeviceProperties(&prop, device), st, fail);
    if (prop.major < 8) {
        st = FL_ERR(FL_ERR_UNSUPPORTED, "cuda backend: %s is compute capability %d.%d; bf16 kernels "
                    "need 8.0 or newer", prop.name, prop.major, prop.minor);
        goto fail;
    }
    c->n_sm = prop.multiProcessorCount;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    /* see cuda_matmul.cu; the w4_dequant_min_n override for measurements and tests */
    c->w4_deq_min_n = fl_cuda_tune(FL_CUDA_TUNE_W4_DEQUANT_MIN_N) > 0 ? (int)fl_cuda_tune(FL_CUDA_TUNE_W4_DEQUANT_MIN_N)
                                                                      : 128;
    FL_CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), st, fail);
    FL_CUBLAS_CHECK_GOTO(cublasCreate(&c->cublas), st, fail);
    FL_CUBLAS_CHECK_GOTO(cublasSetStream(c->cublas, c->stream), st, fail);
    /* 32 MiB: cuBLAS' own default on Hopper, so eager GEMMs pick the same
     * algorithms as before; explicit so that captured GEMMs use it. */
    c->cublas_ws_bytes = (size_t)32 << 20;
    FL_CUDA_CHECK_GOTO(cudaMalloc(&c->cublas_ws, c->cublas_ws_bytes), st, fail);
    FL_CUBLAS_CHECK_GOTO(cublasSetWorkspace(c->cublas, c->cublas_ws, c->cublas_ws_bytes), st, fail);
    *out = b;
    return FL_OK;
fail:
    cuda_destroy(b);
    return st;
}
