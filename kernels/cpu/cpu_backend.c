/*
 * cpu_backend.c — the CPU reference backend: memory management and the op
 * table. Device memory is host memory; activations are f32. The ops live in
 * cpu_ops.c (math) and cpu_attention.c (paged attention).
 *
 * This backend is the reference every other backend is tested against, so
 * it favours obviously-right code over speed; the concessions are that
 * matmuls are spread over cores by the thread pool (kernels/pool.h;
 * weights are read once per call) and that W4 / Q8_0 matmuls run SIMD integer kernels where the CPU has
 * them (cpu_qdot.c), as do the attention's per-position loops (cpu_vec.c);
 * FL_CPU_KERNELS=c keeps the plain C reference for both.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/layer.h"

static fl_status cpu_alloc(fl_backend *b, size_t bytes, void **ptr) {
    (void)b;
    /* 64-byte alignment keeps SIMD loads aligned; never return NULL for 0. */
    size_t sz = (bytes + 63) & ~(size_t)63;
    *ptr = aligned_alloc(64, sz ? sz : 64);
    if (!*ptr) return FL_ERR(FL_ERR_OOM, "cpu backend: cannot allocate %zu bytes", bytes);
    return FL_OK;
}

static void cpu_free(fl_backend *b, void *ptr) {
    (void)b;
    free(ptr);
}

static fl_status cpu_copy(fl_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    if (bytes) memmove(dst, src, bytes);
    return FL_OK;
}

/* Host memory on both sides: the direction does not matter. */
static fl_status cpu_copy_blocks(fl_backend *b, void *dst, const void *src, const int32_t *dst_ids,
                                 const int32_t *src_ids, int n, size_t block_bytes, bool to_host) {
    (void)b, (void)to_host;
    for (int i = 0; i < n; i++)
        memcpy((char *)dst + (size_t)dst_ids[i] * block_bytes, (const char *)src + (size_t)src_ids[i] * block_bytes,
               block_bytes);
    return FL_OK;
}

static fl_status cpu_memset0(fl_backend *b, void *dst, size_t bytes) {
    (void)b;
    memset(dst, 0, bytes);
    return FL_OK;
}

static fl_status cpu_sync(fl_backend *b) {
    (void)b;
    return FL_OK;
}

/* Weights are used in place: the descriptor is copied, not the data. */
static fl_status cpu_upload_weight(fl_backend *b, const fl_tensor *host, fl_tensor *dev) {
    (void)b;
    switch (host->dtype) {
    case FL_DTYPE_F32: case FL_DTYPE_F16: case FL_DTYPE_BF16: case FL_DTYPE_W4: case FL_DTYPE_Q8_0:
        break;
    case FL_DTYPE_F8_E4M3:
        if (host->ndim == 2 && host->scales) break; /* an FP8 linear; bare codes are a file kind */
        /* fall through */
    default:
        return FL_ERR(FL_ERR_UNSUPPORTED, "cpu backend: weights of dtype %s are not supported",
                      fl_dtype_name(host->dtype));
    }
    *dev = *host;
    dev->owned = 0;
    return FL_OK;
}

static void cpu_free_weight(fl_backend *b, fl_tensor *dev) {
    (void)b;
    if (dev) memset(dev, 0, sizeof *dev);
}

static fl_status cpu_upload_act(fl_backend *b, void *dst, const float *src, size_t n) {
    return cpu_copy(b, dst, src, n * sizeof(float));
}

static fl_status cpu_download_act(fl_backend *b, float *dst, const void *src, size_t n) {
    return cpu_copy(b, dst, src, n * sizeof(float));
}

/* The backend's own state: what cpuid and FL_CPU_KERNELS chose at init. */
typedef struct cpu_impl {
    fl_cpu_isa isa;
    char detail[96];
} cpu_impl;

fl_cpu_isa fl_cpu_backend_isa(const fl_backend *b) {
    return b && b->impl ? ((const cpu_impl *)b->impl)->isa : FL_CPU_ISA_C;
}

static void cpu_destroy(fl_backend *b) {
    if (b) free(b->impl);
    free(b);
}

static const fl_backend_ops cpu_ops = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .memset0 = cpu_memset0,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .upload_weight = cpu_upload_weight,
    .free_weight = cpu_free_weight,
    .upload_act = cpu_upload_act,
    .download_act = cpu_download_act,
    .destroy = cpu_destroy,
    .embed = fl_cpu_embed,
    .rmsnorm = fl_cpu_rmsnorm,
    .matmul = fl_cpu_matmul,
    .rope = fl_cpu_rope,
    .rope_kv_store = fl_cpu_rope_kv_store,
    .kv_store = fl_cpu_kv_store,
    .attention = fl_cpu_attention,
    .silu_mul = fl_cpu_silu_mul,
    .add = fl_cpu_add,
    .add_rmsnorm = fl_cpu_add_rmsnorm,
    .moe_topk = fl_cpu_moe_topk,
    .gather_rows = fl_cpu_gather_rows,
    .scatter_add_rows = fl_cpu_scatter_add_rows,
    .sigmoid_scale_rows = fl_cpu_sigmoid_scale_rows,
    .mla_attention = fl_cpu_mla_attention,
    .argmax_rows = fl_cpu_argmax_rows,
    .copy_2d = fl_cpu_copy_2d,
    .sample_rows_ws = fl_cpu_sample_rows_ws,
    .sample_rows = fl_cpu_sample_rows,
    .moe_group = fl_cpu_moe_group,
    .moe_matmul = fl_cpu_moe_matmul,
    .moe_combine = fl_cpu_moe_combine,
    .moe_gate_up_silu = fl_layer_moe_gate_up, /* the plain ops */
    .moe_combine_add_rmsnorm = fl_cpu_moe_combine_add_rmsnorm,
    .qknorm_rope_kv_store = fl_cpu_qknorm_rope_kv_store,
    .mla_rope_norm_store = fl_cpu_mla_rope_norm_store,
    .copy_blocks = cpu_copy_blocks,
    .kv_int8 = true,
    .kv_int8_mla = true,
    .kv_fp8 = true,
    .kv_bf16 = true,
    .kv_blocked = true,
};

fl_status fl_backend_cpu_init(fl_backend **out) {
    fl_cpu_isa isa;
    FL_TRY(fl_cpu_isa_choose(&isa));
    fl_backend *b = calloc(1, sizeof *b);
    cpu_impl *im = calloc(1, sizeof *im);
    if (!b || !im) {
        free(b);
        free(im);
        return FL_ERR(FL_ERR_OOM, "out of memory creating the cpu backend");
    }
    im->isa = isa;
    snprintf(im->detail, sizeof im->detail, "matmul kernels %s%s", fl_cpu_isa_name(isa),
             fl_cpu_isa_has_avx2(isa) ? " (int16 activations for W4 and Q8_0 weights)" : " (f32 reference)");
    b->impl = im;
    b->detail = im->detail;
    b->ops = &cpu_ops;
    b->name = "cpu";
    b->act_dtype = FL_DTYPE_F32;
    *out = b;
    return FL_OK;
}
