/*
 * cuda_bulk.cuh — Hopper's bulk copies (cp.async.bulk global -> shared,
 * completion counted in bytes on an mbarrier) and the barrier operations
 * the streaming GEMVs use (cuda_gemv_bulk.cu: W4; cuda_gemv_bf16.cu: bf16;
 * cuda_gemv_fp8.cu: FP8), and the ldmatrix the last two read stages with.
 * FL_BULK_DEVICE_OK says whether the device code being compiled has them
 * (sm_90+); kernels built for older targets trap instead (their launchers
 * refuse such devices).
 */
#ifndef FL_CUDA_BULK_CUH
#define FL_CUDA_BULK_CUH

#include <stdint.h>

#include "kernels/cuda/cuda_common.cuh"

/* Whether this device has bulk copies and the build carries sm_90 code for
 * them (host; asked once per process: one rank drives one GPU). */
extern "C" bool fl_cuda_bulk_device_ok(fl_cuda *c);

/* The warps a block's 16-row tile gets in a streaming GEMV (bf16, FP8)
 * for a weight of `rows` rows: ~16 resident warps an SM over the one wave
 * of blocks there is (4096 rows on 132 SMs: 256 blocks, 8 warps; 28672
 * rows: 1), at most max_ks and one per chunk of ck columns, within shared
 * memory (warp_b bytes a warp) and the blocks an SM holds (kern's
 * occupancy, asked once per warp count into occ[max_ks + 1]). Host. */
static inline fl_status fl_gemv_ring_warps(fl_cuda *c, const void *kern, int in, int64_t rows, int ck, int max_ks,
                                           size_t warp_b, int *occ, int *ks_out) {
    const int64_t blocks = rows / 16, bpsm = (blocks + c->n_sm - 1) / c->n_sm;
    const int nck = (in / 16 + ck / 16 - 1) / (ck / 16);
    int ks = bpsm >= 16 ? 1 : bpsm < 1 ? 16 : (int)(16 / bpsm);
    if (ks > max_ks) ks = max_ks;
    if (ks > nck) ks = nck;
    while (ks > 1 && (size_t)ks * warp_b > c->smem_optin) ks--;
    for (; ks > 1; ks--) { /* the wave must fit, when it can */
        if (!occ[ks]) {
            int bps = 0;
            FL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, kern, ks * 32, (size_t)ks * warp_b));
            occ[ks] = bps < 1 ? 1 : bps;
        }
        if (occ[ks] >= bpsm) break;
    }
    *ks_out = ks;
    return FL_OK;
}

/* Opts kern in to all the dynamic shared memory the device allows (the
 * opt-in less the kernel's static shared memory), on its first launch
 * (*set); *dyn_max: that size. Host. */
template <typename K>
static inline fl_status fl_gemv_smem_optin(fl_cuda *c, K kern, int *set, size_t *dyn_max) {
    if (*set) return FL_OK;
    cudaFuncAttributes fa;
    FL_CUDA_CHECK(cudaFuncGetAttributes(&fa, kern));
    *dyn_max = c->smem_optin > fa.sharedSizeBytes ? c->smem_optin - fa.sharedSizeBytes : 0;
    FL_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)*dyn_max));
    *set = 1;
    return FL_OK;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FL_BULK_DEVICE_OK 1
#else
#define FL_BULK_DEVICE_OK 0
#endif

#if FL_BULK_DEVICE_OK
static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
static __device__ __forceinline__ void mbar_init(uint64_t *b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
/* makes the initialized barriers visible to the async proxy (the copies) */
static __device__ __forceinline__ void mbar_fence_init(void) {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
/* `bytes` more of copies expected in the current phase, no arrival */
static __device__ __forceinline__ void mbar_expect_tx_only(uint64_t *b, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes)
                 : "memory");
}
/* one arrival (the barrier's count is 1) that also expects `bytes` of
 * copies to complete before the phase flips */
static __device__ __forceinline__ void mbar_expect_tx(uint64_t *b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void mbar_wait(uint64_t *b, unsigned parity) {
    uint32_t done;
    do {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(smem_u32(b)), "r"(parity)
                     : "memory");
    } while (!done);
}
/* global -> this block's shared memory, `bytes` (multiple of 16, both ends
 * 16-byte aligned), completion counted on barrier b */
static __device__ __forceinline__ void bulk_g2s(void *dst, const void *src, unsigned bytes, uint64_t *b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(b))
                 : "memory");
}
/* orders this warp's generic-proxy reads of a stage before the async-proxy
 * write that refills it */
static __device__ __forceinline__ void fence_proxy_async(void) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
/* Four 8x8 b16 matrices from shared memory; lane l addresses row l & 7 of
 * matrix l >> 3 (not transposed: the mma's row-major A fragment). How the
 * bf16 and FP8 GEMVs read a stage's 16 rows: lane l gives row l & 15, bytes
 * 16 (l >> 4) .. + 15 of a 32-byte k-step, and gets the A fragment of
 * mma.m16n8k16 bf16 or, byte for byte the same layout, of mma.m16n8k32
 * e4m3. */
static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}
/* A warp's ring of NS stages: lane 0 initializes the stages' mbarriers
 * (one arrival each) and makes them visible to the copies; the warp waits
 * for it. */
template <int NS>
static __device__ __forceinline__ void bulk_ring_init(uint64_t *bar, int lane) {
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < NS; s++) mbar_init(&bar[s], 1);
        mbar_fence_init();
    }
    __syncwarp();
}
#endif

#endif /* FL_CUDA_BULK_CUH */
