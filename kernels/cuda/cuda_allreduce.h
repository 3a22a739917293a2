/*
 * cuda_allreduce.h — the one-shot all-reduce kernel over peer memory (CUDA
 * IPC, NVLink) that parallel/comm_p2p.c sets up. Callable from C.
 *
 * Each rank owns one buffer of FL_P2P_SIG_BYTES of flags followed by
 * FL_P2P_DATA_BYTES of data, opened by every peer; bufs[r] is rank r's
 * buffer as this rank sees it.
 */
#ifndef FL_CUDA_ALLREDUCE_H
#define FL_CUDA_ALLREDUCE_H

#include <stddef.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_P2P_MAX_RANKS 8
#define FL_P2P_MAX_BLOCKS 32
#define FL_P2P_SIG_BYTES 8192 /* start/end flags [blocks][ranks] and the block epochs */
#define FL_P2P_CHUNK 4096 /* elements per block, fixed */
#define FL_P2P_MAX_ELEMS (FL_P2P_MAX_BLOCKS * FL_P2P_CHUNK)
#define FL_P2P_DATA_BYTES ((size_t)FL_P2P_MAX_ELEMS * 2)

/* out[i] = sum over ranks of in[i] (bf16, summed in f32 in rank order:
 * every rank computes the same bits), for n <= FL_P2P_MAX_ELEMS (in ==
 * out allowed; 16-byte aligned pointers take the vector path). Enqueued on
 * stream (a cudaStream_t); every rank must call it with the same n, in the
 * same order of collectives. */
fl_status fl_cuda_p2p_allreduce_bf16(void *const *bufs, int rank, int size, const void *in, void *out,
                                     size_t n, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_ALLREDUCE_H */
