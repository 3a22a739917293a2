/*
 * cuda_allreduce.cu — one-shot all-reduce of a small bf16 buffer through
 * peer memory, for the two reductions per layer of a tensor-parallel decode
 * step (one token's hidden state is 8 KB).
 *
 * NCCL's ring all-reduce of 8 KB costs ~10 us on 4 H200s back to back:
 * 2 (W - 1) dependent steps, each a kernel-to-kernel handshake over NVLink.
 * One-shot: every rank copies its input into its own peer-visible buffer,
 * raises a flag in every peer, waits for every peer's flag, then reads all
 * W inputs over NVLink and sums them, itself; a second flag round ("done
 * reading") keeps a fast rank from overwriting its buffer while a slow one
 * still reads it. Two flag round trips instead of 2 (W - 1) steps. The sum
 * runs in f32 in rank order 0..W-1 on every rank, so all ranks get the same
 * bits and the result does not depend on message size (a ring's chunking
 * does: see scripts/gpu-multi-check.sh).
 *
 * Flags: block b of rank r writes start[b][r] (then end[b][r]) in every
 * peer's buffer with a release store at system scope; block b of each rank
 * waits on its own buffer's start[b][*] with acquire loads. The value is a
 * per-block epoch kept in device memory, incremented every call, so the
 * kernel replays correctly from a CUDA graph. Peer data is read with
 * .cv loads (never served from a stale L1 line: the same addresses are
 * read every call). Block b always handles elements [b C, (b + 1) C) with
 * the same C whatever n is, on every rank: so block b only needs the peers'
 * block b, and a region is always written and read by the same block
 * number, whose "done reading" flag then protects it (with a chunk size
 * that varied with n, a fast rank could overwrite data a slow rank's other
 * block still reads).
 */
#include <stdint.h>

#include "kernels/cuda/cuda_allreduce.h"
#include "kernels/cuda/cuda_common.cuh"

typedef struct p2p_sig {
    uint32_t start[FL_P2P_MAX_BLOCKS][FL_P2P_MAX_RANKS];
    uint32_t end[FL_P2P_MAX_BLOCKS][FL_P2P_MAX_RANKS];
    uint32_t epoch[FL_P2P_MAX_BLOCKS];
} p2p_sig;
static_assert(sizeof(p2p_sig) <= FL_P2P_SIG_BYTES, "flags overflow their region");

typedef struct p2p_bufs {
    char *b[FL_P2P_MAX_RANKS];
} p2p_bufs;

static __device__ __forceinline__ void st_release_sys(uint32_t *p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

#define P2P_THREADS 256
#define P2P_VEC 8 /* bf16 per 16-byte load */

static __global__ void __launch_bounds__(P2P_THREADS)
    p2p_allreduce_kernel(p2p_bufs bufs, int rank, int size, const bf16 *__restrict__ in, bf16 *out, int n,
                         int aligned) {
    p2p_sig *mine = (p2p_sig *)bufs.b[rank];
    const int b = blockIdx.x, tid = threadIdx.x;
    const int lo = b * FL_P2P_CHUNK, hi = min(n, lo + FL_P2P_CHUNK);
    __shared__ uint32_t ep;
    if (tid == 0) ep = mine->epoch[b] = mine->epoch[b] + 1;
    bf16 *my_data = (bf16 *)(bufs.b[rank] + FL_P2P_SIG_BYTES);
    /* 1. this block's chunk of the input into this rank's buffer */
    for (int i = lo + tid * P2P_VEC; i < hi; i += P2P_THREADS * P2P_VEC) {
        if (aligned && i + P2P_VEC <= hi) {
            *(uint4 *)(my_data + i) = *(const uint4 *)(in + i);
        } else {
            for (int j = i; j < hi; j++) my_data[j] = in[j];
        }
    }
    __syncthreads();
    /* 2. tell every peer the chunk is there; wait until every peer's is */
    if (tid < size) {
        __threadfence_system();
        st_release_sys(&((p2p_sig *)bufs.b[tid])->start[b][rank], ep);
        while (ld_acquire_sys(&mine->start[b][tid]) != ep) {
        }
    }
    __syncthreads();
    /* 3. the sum, in rank order */
    for (int i = lo + tid * P2P_VEC; i < hi; i += P2P_THREADS * P2P_VEC) {
        float acc[P2P_VEC] = {0, 0, 0, 0, 0, 0, 0, 0};
        const int cnt = min(P2P_VEC, hi - i);
        for (int r = 0; r < size; r++) {
            const bf16 *src = (const bf16 *)(bufs.b[r] + FL_P2P_SIG_BYTES) + i;
            if (cnt == P2P_VEC) {
                const uint4 q = __ldcv((const uint4 *)src);
                const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    acc[2 * k] += __uint_as_float(w[k] << 16);
                    acc[2 * k + 1] += __uint_as_float(w[k] & 0xffff0000u);
                }
            } else {
                for (int j = 0; j < cnt; j++) {
                    const unsigned short u = __ldcv((const unsigned short *)(src + j));
                    acc[j] += __uint_as_float((uint32_t)u << 16);
                }
            }
        }
        if (aligned && cnt == P2P_VEC) {
            uint32_t o[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const uint32_t lo16 = __bfloat16_as_ushort(f2bf(acc[2 * k]));
                const uint32_t hi16 = __bfloat16_as_ushort(f2bf(acc[2 * k + 1]));
                o[k] = lo16 | (hi16 << 16);
            }
            *(uint4 *)(out + i) = make_uint4(o[0], o[1], o[2], o[3]);
        } else {
            for (int j = 0; j < cnt; j++) out[i + j] = f2bf(acc[j]);
        }
    }
    __syncthreads();
    /* 3. tell every peer this rank is done reading its buffer; wait for all */
    if (tid < size) {
        st_release_sys(&((p2p_sig *)bufs.b[tid])->end[b][rank], ep);
        while (ld_acquire_sys(&mine->end[b][tid]) != ep) {
        }
    }
}

extern "C" fl_status fl_cuda_p2p_allreduce_bf16(void *const *bufs, int rank, int size, const void *in, void *out,
                                                size_t n, void *stream) {
    if (size < 1 || size > FL_P2P_MAX_RANKS || rank < 0 || rank >= size || n > FL_P2P_MAX_ELEMS)
        return FL_ERR(FL_ERR_INVALID_ARG, "p2p all-reduce: rank %d of %d, %zu elements", rank, size, n);
    if (n == 0) return FL_OK;
    p2p_bufs pb;
    for (int r = 0; r < FL_P2P_MAX_RANKS; r++) pb.b[r] = r < size ? (char *)bufs[r] : NULL;
    const int blocks = (int)((n + FL_P2P_CHUNK - 1) / FL_P2P_CHUNK);
    p2p_allreduce_kernel<<<blocks, P2P_THREADS, 0, (cudaStream_t)stream>>>(pb, rank, size, (const bf16 *)in,
                                                                            (bf16 *)out, (int)n,
                                                                            ((uintptr_t)in | (uintptr_t)out) % 16 == 0);
    FL_CUDA_LAUNCH_CHECK("p2p_allreduce_kernel");
    return FL_OK;
}
