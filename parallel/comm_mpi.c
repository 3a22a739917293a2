/*
 * comm_mpi.c — the MPI implementation of fl_comm: host buffers, blocking
 * calls (see comm.h for the contract).
 *
 * Counts are size_t in the API but int in MPI-3 (Open MPI 4 has no large-
 * count calls), so counts above INT_MAX are refused with FL_ERR_UNSUPPORTED
 * rather than silently truncated. bf16 sums go through f32: the operands
 * are widened into a scratch buffer, summed with MPI_SUM on MPI_FLOAT and
 * rounded once at the end, which is more accurate than a user MPI_Op that
 * would round every partial sum to bf16.
 */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel/check.h"
#include "parallel/comm_impl.h"
#include "core/tensor.h"

typedef struct mpi_impl {
    int *icounts, *idispls, *icounts2, *idispls2;  /* [size] int copies for MPI */
    float *scratch;                                /* bf16 sums: f32 staging */
    size_t scratch_cap;                            /* floats */
} mpi_impl;

static MPI_Datatype mpi_type(fl_comm_dtype dt) {
    switch (dt) {
    case FL_COMM_F32: return MPI_FLOAT;
    case FL_COMM_BF16: return MPI_UINT16_T; /* moved, never summed as such */
    case FL_COMM_I32: return MPI_INT32_T;
    case FL_COMM_DTYPE_COUNT: break;
    }
    return MPI_DATATYPE_NULL;
}

static fl_status to_int(size_t v, int *out, const char *op, const char *what) {
    if (v > INT_MAX)
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s (MPI): %s %zu exceeds INT_MAX elements; split the transfer", op, what,
                      v);
    *out = (int)v;
    return FL_OK;
}

static fl_status int_arrays(fl_comm *c, const size_t *counts, const size_t *displs, int *ic,
                            int *id, const char *op) {
    for (int r = 0; r < c->size; r++) {
        FL_TRY(to_int(counts[r], &ic[r], op, "count"));
        FL_TRY(to_int(displs[r], &id[r], op, "displacement"));
    }
    return FL_OK;
}

static fl_status scratch(mpi_impl *m, size_t n) {
    if (n <= m->scratch_cap) return FL_OK;
    float *p = realloc(m->scratch, n * sizeof *p);
    if (!p) return FL_ERR(FL_ERR_OOM, "out of memory for a %zu-float bf16 reduction buffer", n);
    m->scratch = p;
    m->scratch_cap = n;
    return FL_OK;
}

static void widen(const uint16_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = fl_bf16_to_f32(src[i]);
}

static void narrow(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = fl_f32_to_bf16(src[i]);
}

static fl_status mpi_all_reduce_sum(fl_comm *c, const void *send, void *recv, size_t count,
                                    fl_comm_dtype dt) {
    mpi_impl *m = c->impl;
    int n = 0;
    FL_TRY(to_int(count, &n, "all_reduce_sum", "count"));
    if (dt == FL_COMM_BF16) {
        FL_TRY(scratch(m, count));
        widen(send, m->scratch, count);
        FL_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, m->scratch, n, MPI_FLOAT, MPI_SUM, c->mpi));
        narrow(m->scratch, recv, count);
        return FL_OK;
    }
    FL_MPI_CHECK(MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, n, mpi_type(dt), MPI_SUM,
                               c->mpi));
    return FL_OK;
}

static fl_status mpi_all_gather(fl_comm *c, const void *send, void *recv, const size_t *counts,
                                const size_t *displs, size_t total, fl_comm_dtype dt) {
    mpi_impl *m = c->impl;
    int dummy;
    FL_TRY(to_int(total, &dummy, "all_gather", "total count"));
    FL_TRY(int_arrays(c, counts, displs, m->icounts, m->idispls, "all_gather"));
    FL_MPI_CHECK(MPI_Allgatherv(send, m->icounts[c->rank], mpi_type(dt), recv, m->icounts,
                                m->idispls, mpi_type(dt), c->mpi));
    return FL_OK;
}

static fl_status mpi_reduce_scatter(fl_comm *c, const void *send, void *recv,
                                    const size_t *counts, const size_t *displs, size_t total,
                                    fl_comm_dtype dt) {
    mpi_impl *m = c->impl;
    int dummy;
    FL_TRY(to_int(total, &dummy, "reduce_scatter", "total count"));
    FL_TRY(int_arrays(c, counts, displs, m->icounts, m->idispls, "reduce_scatter"));
    if (dt == FL_COMM_BF16) {
        size_t mine = counts[c->rank];
        FL_TRY(scratch(m, total + mine));
        widen(send, m->scratch, total);
        FL_MPI_CHECK(MPI_Reduce_scatter(m->scratch, m->scratch + total, m->icounts, MPI_FLOAT,
                                        MPI_SUM, c->mpi));
        narrow(m->scratch + total, recv, mine);
        return FL_OK;
    }
    FL_MPI_CHECK(MPI_Reduce_scatter(send, recv, m->icounts, mpi_type(dt), MPI_SUM, c->mpi));
    return FL_OK;
}

static fl_status mpi_all_to_all_v(fl_comm *c, const void *send, const size_t *send_counts,
                                  const size_t *send_displs, void *recv, const size_t *recv_counts,
                                  const size_t *recv_displs, fl_comm_dtype dt) {
    mpi_impl *m = c->impl;
    FL_TRY(int_arrays(c, send_counts, send_displs, m->icounts, m->idispls, "all_to_all_v"));
    FL_TRY(int_arrays(c, recv_counts, recv_displs, m->icounts2, m->idispls2, "all_to_all_v"));
    FL_MPI_CHECK(MPI_Alltoallv(send, m->icounts, m->idispls, mpi_type(dt), recv, m->icounts2,
                               m->idispls2, mpi_type(dt), c->mpi));
    return FL_OK;
}

static fl_status mpi_broadcast(fl_comm *c, void *buf, size_t count, int root, fl_comm_dtype dt) {
    int n = 0;
    FL_TRY(to_int(count, &n, "broadcast", "count"));
    FL_MPI_CHECK(MPI_Bcast(buf, n, mpi_type(dt), root, c->mpi));
    return FL_OK;
}

static fl_status mpi_barrier(fl_comm *c) {
    FL_MPI_CHECK(MPI_Barrier(c->mpi));
    return FL_OK;
}

/* MPI calls complete before they return: nothing is ever pending. */
static fl_status mpi_sync(fl_comm *c) { return FL_OK; }

static void mpi_destroy(fl_comm *c) {
    mpi_impl *m = c->impl;
    if (!m) return;
    free(m->icounts);
    free(m->idispls);
    free(m->icounts2);
    free(m->idispls2);
    free(m->scratch);
    free(m);
    c->impl = NULL;
}

static const fl_comm_ops mpi_ops = {
    .all_reduce_sum = mpi_all_reduce_sum,
    .all_gather = mpi_all_gather,
    .reduce_scatter = mpi_reduce_scatter,
    .all_to_all_v = mpi_all_to_all_v,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .sync = mpi_sync,
    .abort = NULL, /* MPI_Abort itself ends blocked MPI calls */
    .destroy = mpi_destroy,
};

fl_status fl_comm_init_mpi(MPI_Comm comm, fl_comm **out) {
    fl_status st = FL_OK;
    fl_comm *c = NULL;
    *out = NULL;
    FL_TRY(fl_comm_alloc(comm, FL_COMM_BACKEND_MPI, &c));
    c->ops = &mpi_ops;
    mpi_impl *m = calloc(1, sizeof *m);
    FL_CHECK_ALLOC(m, st, fail);
    c->impl = m;
    size_t n = (size_t)c->size;
    m->icounts = malloc(n * sizeof(int));
    m->idispls = malloc(n * sizeof(int));
    m->icounts2 = malloc(n * sizeof(int));
    m->idispls2 = malloc(n * sizeof(int));
    if (!m->icounts || !m->idispls || !m->icounts2 || !m->idispls2) {
        st = FL_ERR(FL_ERR_OOM, "out of memory for a %d-rank MPI communicator", c->size);
        goto fail;
    }
    fl_comm_register(c);
    *out = c;
    return FL_OK;
fail:
    fl_comm_free(c);
    return st;
}
