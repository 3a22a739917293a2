/*
 * comm_p2p.c — sets up the one-shot peer-memory all-reduce
 * (kernels/cuda/cuda_allreduce.cu) for an NCCL communicator: each rank
 * allocates one buffer (flags + data), exports it with cudaIpcGetMemHandle,
 * the handles are all-gathered over MPI and every rank opens its peers'
 * (peer access enabled lazily by the driver). Off unless every rank asks
 * (fl_comm_config.p2p_allreduce: --p2p-allreduce on, FL_P2P_AR=1; it is new,
 * scripts/gpu-all.sh measures it against NCCL); any
 * rank that cannot set it up (not on one node, IPC refused) turns it off for
 * the whole group, decided by one MPI_Allreduce, since ranks must agree on
 * which all-reduce they run. Messages up to p2p_allreduce_max_bytes (default
 * 64 KB: 8 tokens of a 4096-wide hidden state) go through it; larger ones stay with NCCL, whose
 * ring moves each byte fewer times.
 */
#include "parallel/comm_p2p.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(FL_HAVE_NCCL) && defined(FL_HAVE_CUDA)

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_allreduce.h"
#include "parallel/check.h"

struct fl_p2p_ar {
    int rank, size;
    void *mine;                         /* this rank's buffer */
    void *bufs[FL_P2P_MAX_RANKS];       /* every rank's buffer, as mapped here */
    size_t max_elems;
};

void fl_p2p_ar_free(fl_p2p_ar *p) {
    if (!p) return;
    for (int r = 0; r < p->size; r++)
        if (r != p->rank && p->bufs[r]) cudaIpcCloseMemHandle(p->bufs[r]);
    if (p->mine) cudaFree(p->mine);
    free(p);
}

/* This rank's part of the set-up; returns a reason when it cannot. */
static const char *setup_local(fl_p2p_ar *p, MPI_Comm mpi, cudaIpcMemHandle_t *all) {
    const size_t bytes = FL_P2P_SIG_BYTES + FL_P2P_DATA_BYTES;
    if (cudaMalloc(&p->mine, bytes) != cudaSuccess) return "cudaMalloc of the exchange buffer failed";
    if (cudaMemset(p->mine, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
        return "cudaMemset of the exchange buffer failed";
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, p->mine) != cudaSuccess) return "cudaIpcGetMemHandle failed";
    if (MPI_Allgather(&h, (int)sizeof h, MPI_BYTE, all, (int)sizeof h, MPI_BYTE, mpi) != MPI_SUCCESS)
        return "MPI_Allgather of the IPC handles failed";
    for (int r = 0; r < p->size; r++) {
        if (r == p->rank) {
            p->bufs[r] = p->mine;
            continue;
        }
        if (cudaIpcOpenMemHandle(&p->bufs[r], all[r], cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
            p->bufs[r] = NULL;
            return "cudaIpcOpenMemHandle of a peer's buffer failed (no peer access?)";
        }
    }
    return NULL;
}

fl_status fl_p2p_ar_init(MPI_Comm mpi, int rank, int size, const fl_comm_config *cfg, bool verbose,
                         fl_p2p_ar **out) {
    *out = NULL;
    if (size < 2) return FL_OK;
    /* asked for by every rank? (a setting given on some ranks only must not
     * send the others into collectives they do not take) */
    int want = cfg->p2p_allreduce, all_want = 0;
    FL_MPI_CHECK(MPI_Allreduce(&want, &all_want, 1, MPI_INT, MPI_MIN, mpi));
    if (!all_want) {
        int any_want = 0;
        FL_MPI_CHECK(MPI_Allreduce(&want, &any_want, 1, MPI_INT, MPI_MAX, mpi));
        if (any_want && rank == 0 && verbose)
            fprintf(stderr, "flotilla: one-shot p2p all-reduce off: asked for (--p2p-allreduce, FL_P2P_AR) on "
                    "some ranks only\n");
        return FL_OK;
    }
    const char *why = NULL;
    MPI_Comm node = MPI_COMM_NULL;
    int node_size = 0;
    if (size > FL_P2P_MAX_RANKS) why = "more than 8 ranks";
    /* every rank must be on this node (collective: taken by all) */
    FL_MPI_CHECK(MPI_Comm_split_type(mpi, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    if (!why && node_size != size) why = "the group spans nodes";
    fl_p2p_ar *p = calloc(1, sizeof *p);
    cudaIpcMemHandle_t *all = calloc((size_t)size, sizeof *all);
    if (!p || !all) why = "out of memory";
    if (p) {
        p->rank = rank;
        p->size = size;
        const size_t max_bytes = cfg->p2p_allreduce_max_bytes > 0 ? (size_t)cfg->p2p_allreduce_max_bytes : 0;
        p->max_elems = max_bytes / 2 < FL_P2P_MAX_ELEMS ? max_bytes / 2 : FL_P2P_MAX_ELEMS;
    }
    /* the handle all-gather is collective: every rank takes it or none */
    int ok = why == NULL, all_ok = 0;
    FL_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mpi));
    if (all_ok) why = setup_local(p, mpi, all);
    ok = why == NULL;
    FL_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mpi));
    free(all);
    (void)cudaGetLastError(); /* a refused IPC call must not surface in a later launch check */
    if (all_ok) {
        /* which all-reduce a message takes must not depend on one rank's
         * p2p_allreduce_max_bytes: the group's smallest limit holds for all */
        unsigned long long mine = p->max_elems, least = 0;
        FL_MPI_CHECK(MPI_Allreduce(&mine, &least, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, mpi));
        p->max_elems = (size_t)least;
    }
    if (!all_ok) {
        if (verbose && rank == 0)
            fprintf(stderr, "flotilla: one-shot p2p all-reduce off: %s\n",
                    why ? why : "another rank could not set it up");
        fl_p2p_ar_free(p);
        return FL_OK;
    }
    if (verbose && rank == 0)
        fprintf(stderr, "flotilla: one-shot p2p all-reduce on %d GPUs, up to %zu bytes\n", size,
                p->max_elems * 2);
    *out = p;
    return FL_OK;
}

bool fl_p2p_ar_takes(const fl_p2p_ar *p, size_t count, fl_comm_dtype dt) {
    return p && dt == FL_COMM_BF16 && count > 0 && count <= p->max_elems;
}

fl_status fl_p2p_ar_run(fl_p2p_ar *p, const void *send, void *recv, size_t count, void *stream) {
    return fl_cuda_p2p_allreduce_bf16(p->bufs, p->rank, p->size, send, recv, count, stream);
}

#else /* no CUDA + NCCL: never on */

fl_status fl_p2p_ar_init(MPI_Comm mpi, int rank, int size, const fl_comm_config *cfg, bool verbose,
                         fl_p2p_ar **out) {
    (void)mpi, (void)rank, (void)size, (void)cfg, (void)verbose;
    *out = NULL;
    return FL_OK;
}
bool fl_p2p_ar_takes(const fl_p2p_ar *p, size_t count, fl_comm_dtype dt) {
    (void)p, (void)count, (void)dt;
    return false;
}
fl_status fl_p2p_ar_run(fl_p2p_ar *p, const void *send, void *recv, size_t count, void *stream) {
    (void)p, (void)send, (void)recv, (void)count, (void)stream;
    return FL_ERR(FL_ERR_UNSUPPORTED, "p2p all-reduce: built without CUDA and NCCL");
}
void fl_p2p_ar_free(fl_p2p_ar *p) { (void)p; }

#endif
