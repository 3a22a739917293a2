/*
 * comm.h — the one collectives API of flotilla.
 *
 * An fl_comm is a communicator over a group of ranks (usually one of the
 * process groups of groups.h) with one of two implementations behind a
 * vtable:
 *
 *   MPI   host buffers; every call is blocking: when it returns, the receive
 *         buffer holds the result and the send buffer may be reused. Used by
 *         the CPU backend (and in CI).
 *   NCCL  device buffers on the communicator's CUDA device; every call is
 *         enqueued on the communicator's own stream (fl_comm_stream) and
 *         returns before the data moved. The buffers must stay valid and
 *         untouched until the work is complete: order compute against it
 *         with CUDA events on fl_comm_stream, or call fl_comm_sync. Built
 *         only with CUDA + NCCL (FL_HAVE_NCCL); otherwise fl_comm_init_nccl
 *         returns FL_ERR_UNSUPPORTED.
 *
 * Common contract of the collectives:
 *  - Collective over the communicator: every rank calls the same sequence of
 *    collectives with matching counts/root/dtype, from one thread at a time
 *    per fl_comm.
 *  - Counts and displacements are in elements of dtype. Buffers are owned by
 *    the caller; a buffer whose count is 0 may be NULL. Count arrays
 *    (size() entries) are host memory for both implementations and may be
 *    reused as soon as the call returns.
 *  - Only all_reduce_sum may run in place (send == recv); the other calls'
 *    send and receive regions must not overlap.
 *  - Sums of bf16 are accumulated in f32 and rounded once to bf16 (MPI), or
 *    as NCCL does it (NCCL); results can differ from an f32 sum in the last
 *    bf16 bit. int32 sums wrap like two's complement.
 *  - A failure is returned as a status with a message naming the call
 *    (FL_ERR_MPI / FL_ERR_NCCL / FL_ERR_CUDA). After a failed collective the
 *    communicator is in an undefined state: the caller should abort the job
 *    (fl_par_abort), since the other ranks may be waiting in the collective.
 */
#ifndef FL_PAR_COMM_H
#define FL_PAR_COMM_H

#include <stddef.h>
#include <stdint.h>

#include <mpi.h>
#include <stdbool.h>

#include "core/status.h"

typedef struct fl_comm fl_comm;

typedef enum fl_comm_dtype {
    FL_COMM_F32 = 0,
    FL_COMM_BF16,   /* raw bfloat16 bits (uint16) */
    FL_COMM_I32,
    FL_COMM_DTYPE_COUNT
} fl_comm_dtype;

typedef enum fl_comm_backend {
    FL_COMM_BACKEND_MPI = 0,
    FL_COMM_BACKEND_NCCL,
} fl_comm_backend;

/* Bytes per element (4, 2, 4); 0 for an invalid dtype. */
size_t fl_comm_dtype_size(fl_comm_dtype dt);
const char *fl_comm_dtype_name(fl_comm_dtype dt);   /* "f32", "bf16", "i32" */
const char *fl_comm_backend_name(fl_comm_backend b); /* "mpi", "nccl" */

/* Collective over comm: creates a host-buffer communicator over the ranks of
 * comm. comm is duplicated (the caller keeps and frees its own). */
fl_status fl_comm_init_mpi(MPI_Comm comm, fl_comm **out);

/* The NCCL communicator's settings (user-facing: the launcher fills them
 * from --nccl-own-stream, --p2p-allreduce, --p2p-allreduce-max-bytes, their
 * --config keys and the FL_ variables of core/option_list.h). */
typedef struct fl_comm_config {
    bool own_stream;            /* keep NCCL on the communicator's own stream:
                                   fl_comm_use_stream then leaves it there (host syncs
                                   around each collective instead of stream order) */
    bool p2p_allreduce;         /* small bf16 all-reduces through peer GPU memory
                                   (comm_p2p.h); used only if every rank asks */
    long p2p_allreduce_max_bytes; /* the largest such all-reduce (the group's smallest holds) */
} fl_comm_config;

/* The registry's declared defaults (own stream off, p2p off, 64 KiB); reads
 * no environment. */
void fl_comm_config_default(fl_comm_config *c);

/* Collective over comm: creates an NCCL communicator over the ranks of comm,
 * bound to CUDA device cuda_device (cudaSetDevice is called on the calling
 * thread), with its own non-blocking stream. cfg NULL: the defaults. Rank 0
 * of comm creates the ncclUniqueId and sends it with MPI_Bcast over comm,
 * which is duplicated and kept for the host side (fl_comm_barrier,
 * fl_comm_exchange_counts). Without NCCL in the build: FL_ERR_UNSUPPORTED
 * (collectively, on every rank, with no communication). */
fl_status fl_comm_init_nccl(MPI_Comm comm, int cuda_device, const fl_comm_config *cfg, fl_comm **out);

/* Collective: completes pending work (NCCL: synchronizes the stream), then
 * destroys the communicator. NULL is a no-op. */
void fl_comm_free(fl_comm *c);

int fl_comm_rank(const fl_comm *c);
int fl_comm_size(const fl_comm *c);
fl_comm_backend fl_comm_backend_of(const fl_comm *c);
/* The cudaStream_t (as void *) NCCL work is enqueued on; NULL for MPI. */
void *fl_comm_stream(const fl_comm *c);

/* recv[i] = sum over ranks of send[i], i < count, on every rank.
 * send == recv (in place) is allowed. */
fl_status fl_comm_all_reduce_sum(fl_comm *c, const void *send, void *recv, size_t count,
                                 fl_comm_dtype dt);

/* Variable-count all-gather. counts[size] (identical on every rank): rank r
 * contributes counts[r] elements from send; recv (sum(counts) elements, on
 * every rank) receives rank r's elements at offset counts[0] + … +
 * counts[r-1]. Zero counts are allowed. */
fl_status fl_comm_all_gather(fl_comm *c, const void *send, void *recv, const size_t *counts,
                             fl_comm_dtype dt);

/* Variable-count reduce-scatter (sum). counts[size] (identical on every
 * rank): send holds sum(counts) elements on every rank; rank r receives in
 * recv (counts[r] elements) the element-wise sum over ranks of the segment
 * at offset counts[0] + … + counts[r-1]. Zero counts are allowed. */
fl_status fl_comm_reduce_scatter(fl_comm *c, const void *send, void *recv, const size_t *counts,
                                 fl_comm_dtype dt);

/* All-to-all with variable counts (MoE dispatch/combine). Rank i sends
 * send_counts[j] elements from send + send_displs[j] to rank j, and receives
 * recv_counts[j] elements from rank j at recv + recv_displs[j]. The counts
 * must agree pairwise (send_counts[j] on rank i == recv_counts[i] on rank j;
 * fl_comm_exchange_counts gets them). Zero-length parts are allowed; every
 * array has size() entries. */
fl_status fl_comm_all_to_all_v(fl_comm *c, const void *send, const size_t *send_counts,
                               const size_t *send_displs, void *recv, const size_t *recv_counts,
                               const size_t *recv_displs, fl_comm_dtype dt);

/* Host-side helper for all_to_all_v: given this rank's send_counts[size]
 * (host), fills recv_counts[size] (host) with what each rank will send here.
 * Blocking, over MPI for both implementations (counts are small and needed
 * on the host to size buffers). */
fl_status fl_comm_exchange_counts(fl_comm *c, const size_t *send_counts, size_t *recv_counts);

/* buf[0..count) of rank root is copied to buf on every rank (in place). */
fl_status fl_comm_broadcast(fl_comm *c, void *buf, size_t count, int root, fl_comm_dtype dt);

/* Like fl_comm_broadcast, but buf is host memory for both implementations:
 * control data (the step plan) goes over the communicator's MPI side, never
 * through NCCL, which would read a host pointer as device memory. */
fl_status fl_comm_broadcast_host(fl_comm *c, void *buf, size_t count, int root, fl_comm_dtype dt);

/* Collective, host-side (over MPI for both implementations): *all_ok =
 * whether ok is true on every rank. For decisions every rank must take
 * alike (e.g. whether decode steps are CUDA graphs: a graph reduces its
 * padded bucket, an eager step only its rows). */
fl_status fl_comm_agree(fl_comm *c, bool ok, bool *all_ok);
/* The same for a number: *least = the smallest `mine` of the group (e.g.
 * the largest decode-graph bucket, which every rank must share). */
fl_status fl_comm_agree_min(fl_comm *c, int mine, int *least);
/* The same element by element, in place: flags[i] = the smallest flags[i]
 * of the group (1/0 flags: whether every rank has item i). */
fl_status fl_comm_agree_each(fl_comm *c, int32_t *flags, size_t n);

/* Returns once every rank has called it and this rank's earlier collectives
 * on c have completed (NCCL: synchronizes the stream, then MPI_Barrier). */
fl_status fl_comm_barrier(fl_comm *c);

/* NCCL: enqueue every later collective on `stream` (a cudaStream_t of the
 * communicator's device, owned by the caller, alive until fl_comm_free)
 * instead of the communicator's own: put on the compute stream, the
 * collectives are ordered with the kernels around them and the host never
 * waits between a layer's matmul and its reduction. MPI, and NCCL made
 * with fl_comm_config.own_stream: no-op. */
fl_status fl_comm_use_stream(fl_comm *c, void *stream);

/* Waits for this rank's enqueued collectives on c to finish (NCCL: the
 * stream; MPI: nothing is ever pending, returns FL_OK). Not collective. */
fl_status fl_comm_sync(fl_comm *c);

#endif /* FL_PAR_COMM_H */
