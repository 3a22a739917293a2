/*
 * comm_nccl.c — the NCCL implementation of fl_comm: device buffers, work
 * enqueued on the communicator's own stream (see comm.h for the contract).
 *
 * Bootstrap: every rank selects its device and creates its stream, rank 0
 * creates the ncclUniqueId; an MPI_Allreduce of "did it work" lets every
 * rank fail together (instead of some waiting forever in ncclCommInitRank),
 * then the id goes out with MPI_Bcast.
 *
 * NCCL has no variable-count all-gather / reduce-scatter: with equal counts
 * we call ncclAllGather / ncclReduceScatter; with uneven counts one grouped
 * ncclBroadcast (resp. ncclReduce) per rank with a non-zero part, which NCCL
 * fuses into one launch. all_to_all_v is grouped ncclSend/ncclRecv pairs
 * (zero-length parts skipped; a send to self is allowed by NCCL).
 *
 * Small bf16 all-reduces go through the one-shot peer-memory all-reduce
 * instead (comm_p2p.c) when every rank asked for it (fl_comm_config) and
 * could set it up.
 *
 * Built only when CMake found CUDA and NCCL (FL_HAVE_NCCL); otherwise the
 * constructor reports FL_ERR_UNSUPPORTED.
 */
#include "parallel/comm_impl.h"

#ifdef FL_HAVE_NCCL

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel/check.h"
#include "parallel/comm_p2p.h"

typedef struct nccl_impl {
    ncclComm_t nccl;
    cudaStream_t stream;     /* where collectives go: own_stream or the caller's */
    cudaStream_t own_stream;
    int device;
    fl_p2p_ar *p2p;          /* one-shot all-reduce for small bf16 messages, or NULL */
} nccl_impl;

fl_status fl_par_nccl_error(ncclResult_t rc, const char *call, const char *file, int line) {
    const char *last = ncclGetLastError(NULL);
    return fl_error_set(FL_ERR_NCCL, file, line, "%s failed: %s%s%s", call,
                        ncclGetErrorString(rc), last && *last ? " — " : "", last ? last : "");
}

fl_status fl_par_cuda_error(cudaError_t rc, const char *call, const char *file, int line) {
    return fl_error_set(FL_ERR_CUDA, file, line, "%s failed: %s (%s)", call,
                        cudaGetErrorString(rc), cudaGetErrorName(rc));
}

static ncclDataType_t nccl_type(fl_comm_dtype dt) {
    switch (dt) {
    case FL_COMM_BF16: return ncclBfloat16;
    case FL_COMM_I32: return ncclInt32;
    case FL_COMM_F32:
    case FL_COMM_DTYPE_COUNT: break;
    }
    return ncclFloat32;
}

static const char *at(const void *p, size_t off, fl_comm_dtype dt) {
    return (const char *)p + off * fl_comm_dtype_size(dt);
}

static int all_equal(const size_t *counts, int n) {
    for (int r = 1; r < n; r++)
        if (counts[r] != counts[0]) return 0;
    return 1;
}

static fl_status nccl_all_reduce_sum(fl_comm *c, const void *send, void *recv, size_t count,
                                     fl_comm_dtype dt) {
    nccl_impl *m = c->impl;
    if (fl_p2p_ar_takes(m->p2p, count, dt)) return fl_p2p_ar_run(m->p2p, send, recv, count, m->stream);
    FL_NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(dt), ncclSum, m->nccl, m->stream));
    return FL_OK;
}

static fl_status nccl_all_gather(fl_comm *c, const void *send, void *recv, const size_t *counts,
                                 const size_t *displs, size_t total, fl_comm_dtype dt) {
    nccl_impl *m = c->impl;
    if (all_equal(counts, c->size)) {
        FL_NCCL_CHECK(ncclAllGather(send, recv, counts[0], nccl_type(dt), m->nccl, m->stream));
        return FL_OK;
    }
    fl_status st = FL_OK;
    FL_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < c->size; r++) {
        if (!counts[r]) continue;
        FL_NCCL_CHECK_GOTO(ncclBroadcast(send, (void *)at(recv, displs[r], dt), counts[r],
                                         nccl_type(dt), r, m->nccl, m->stream),
                           st, end);
    }
end:
    /* The group must be closed even after a failed enqueue. */
    if (st == FL_OK) FL_NCCL_CHECK(ncclGroupEnd());
    else ncclGroupEnd();
    return st;
}

static fl_status nccl_reduce_scatter(fl_comm *c, const void *send, void *recv,
                                     const size_t *counts, const size_t *displs, size_t total,
                                     fl_comm_dtype dt) {
    nccl_impl *m = c->impl;
    if (all_equal(counts, c->size)) {
        FL_NCCL_CHECK(ncclReduceScatter(send, recv, counts[0], nccl_type(dt), ncclSum, m->nccl,
                                        m->stream));
        return FL_OK;
    }
    fl_status st = FL_OK;
    FL_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < c->size; r++) {
        if (!counts[r]) continue;
        FL_NCCL_CHECK_GOTO(ncclReduce(at(send, displs[r], dt), recv, counts[r], nccl_type(dt),
                                      ncclSum, r, m->nccl, m->stream),
                           st, end);
    }
end:
    if (st == FL_OK) FL_NCCL_CHECK(ncclGroupEnd());
    else ncclGroupEnd();
    return st;
}

static fl_status nccl_all_to_all_v(fl_comm *c, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv, const size_t *recv_counts,
                                   const size_t *recv_displs, fl_comm_dtype dt) {
    nccl_impl *m = c->impl;
    fl_status st = FL_OK;
    FL_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < c->size; r++) {
        if (send_counts[r])
            FL_NCCL_CHECK_GOTO(ncclSend(at(send, send_displs[r], dt), send_counts[r],
                                        nccl_type(dt), r, m->nccl, m->stream),
                               st, end);
        if (recv_counts[r])
            FL_NCCL_CHECK_GOTO(ncclRecv((void *)at(recv, recv_displs[r], dt), recv_counts[r],
                                        nccl_type(dt), r, m->nccl, m->stream),
                               st, end);
    }
end:
    if (st == FL_OK) FL_NCCL_CHECK(ncclGroupEnd());
    else ncclGroupEnd();
    return st;
}

static fl_status nccl_broadcast(fl_comm *c, void *buf, size_t count, int root, fl_comm_dtype dt) {
    nccl_impl *m = c->impl;
    FL_NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(dt), root, m->nccl, m->stream));
    return FL_OK;
}

static fl_status nccl_sync(fl_comm *c) {
    nccl_impl *m = c->impl;
    FL_CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return FL_OK;
}

static fl_status nccl_use_stream(fl_comm *c, void *stream) {
    nccl_impl *m = c->impl;
    /* work already on the old stream must not be overtaken */
    FL_CUDA_CHECK(cudaStreamSynchronize(m->stream));
    m->stream = (cudaStream_t)stream;
    c->stream = stream;
    return FL_OK;
}

static fl_status nccl_barrier(fl_comm *c) {
    FL_TRY(nccl_sync(c));
    FL_MPI_CHECK(MPI_Barrier(c->mpi));
    return FL_OK;
}

static void nccl_abort(fl_comm *c) {
    nccl_impl *m = c->impl;
    if (m && m->nccl) {
        ncclCommAbort(m->nccl);
        m->nccl = NULL;
    }
}

static void nccl_destroy(fl_comm *c) {
    nccl_impl *m = c->impl;
    if (!m) return;
    if (m->nccl) {
        /* ncclCommDestroy waits for peers; after a failed collective (a
         * device fault, a peer gone) that wait never ends: abort instead. */
        ncclResult_t async = ncclSuccess;
        bool failed = cudaStreamSynchronize(m->stream) != cudaSuccess ||
                      ncclCommGetAsyncError(m->nccl, &async) != ncclSuccess || async != ncclSuccess;
        if (failed)
            ncclCommAbort(m->nccl);
        else
            ncclCommDestroy(m->nccl);
    }
    fl_p2p_ar_free(m->p2p);
    if (m->own_stream) cudaStreamDestroy(m->own_stream);
    free(m);
    c->impl = NULL;
    c->stream = NULL;
}

static const fl_comm_ops nccl_ops = {
    .all_reduce_sum = nccl_all_reduce_sum,
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .all_to_all_v = nccl_all_to_all_v,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .sync = nccl_sync,
    .use_stream = nccl_use_stream,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};

fl_status fl_comm_init_nccl(MPI_Comm comm, int cuda_device, const fl_comm_config *cfg, fl_comm **out) {
    fl_status st = FL_OK;
    fl_comm *c = NULL;
    fl_comm_config dflt;
    *out = NULL;
    if (!cfg) {
        fl_comm_config_default(&dflt);
        cfg = &dflt;
    }
    FL_TRY(fl_comm_alloc(comm, FL_COMM_BACKEND_NCCL, &c));
    c->own_stream = cfg->own_stream;
    c->ops = &nccl_ops;
    nccl_impl *m = calloc(1, sizeof *m);
    FL_CHECK_ALLOC(m, st, fail);
    c->impl = m;
    m->device = cuda_device;

    /* Each rank sets up its device and stream, and rank 0 makes the id;
     * then one all-reduce tells every rank whether all of them succeeded,
     * so that a rank that failed cannot leave the others waiting in
     * ncclCommInitRank. */
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    fl_status local = FL_OK;
    cudaError_t ce = cudaSetDevice(cuda_device);
    if (ce != cudaSuccess)
        local = fl_par_cuda_error(ce, "cudaSetDevice(cuda_device)", __FILE__, __LINE__);
    if (local == FL_OK) {
        ce = cudaStreamCreateWithFlags(&m->own_stream, cudaStreamNonBlocking);
        m->stream = m->own_stream;
        if (ce != cudaSuccess)
            local = fl_par_cuda_error(ce, "cudaStreamCreateWithFlags(&m->stream, ...)", __FILE__,
                                      __LINE__);
        else
            c->stream = m->stream;
    }
    if (local == FL_OK && c->rank == 0) {
        ncclResult_t rc = ncclGetUniqueId(&id);
        if (rc != ncclSuccess) local = fl_par_nccl_error(rc, "ncclGetUniqueId(&id)", __FILE__, __LINE__);
    }
    int ok = local == FL_OK, all_ok = 0;
    FL_MPI_CHECK_GOTO(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, c->mpi), st, fail);
    if (!all_ok) {
        st = local != FL_OK ? local
                            : FL_ERR(FL_ERR_NCCL,
                                     "NCCL communicator of %d ranks not created: another rank "
                                     "failed to set up its GPU",
                                     c->size);
        goto fail;
    }
    FL_MPI_CHECK_GOTO(MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, c->mpi), st, fail);
    FL_NCCL_CHECK_GOTO(ncclCommInitRank(&m->nccl, c->size, id, c->rank), st, fail);
    FL_TRY_GOTO(fl_p2p_ar_init(c->mpi, c->rank, c->size, cfg, true, &m->p2p), st, fail);
    fl_comm_register(c);
    *out = c;
    return FL_OK;
fail:
    fl_comm_free(c);
    return st;
}

#else /* !FL_HAVE_NCCL */

fl_status fl_comm_init_nccl(MPI_Comm comm, int cuda_device, const fl_comm_config *cfg, fl_comm **out) {
    (void)cfg;
    *out = NULL;
    return FL_ERR(FL_ERR_UNSUPPORTED,
                  "this flotilla was built without CUDA/NCCL: the NCCL communicator for device "
                  "%d is not available (use the MPI communicator with the CPU backend)",
                  cuda_device);
}

#endif /* FL_HAVE_NCCL */
