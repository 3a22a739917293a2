/*
 * comm_impl.h — what the fl_comm implementations (comm_mpi.c, comm_nccl.c)
 * share with the dispatcher (comm.c): the vtable and the handle body.
 * Private to parallel/.
 *
 * comm.c validates arguments (dtype, NULL buffers with non-zero counts, root
 * range, total sizes) and computes the all_gather / reduce_scatter
 * displacements, so the implementations only translate calls.
 */
#ifndef FL_PAR_COMM_IMPL_H
#define FL_PAR_COMM_IMPL_H

#include "parallel/comm.h"

typedef struct fl_comm_ops {
    fl_status (*all_reduce_sum)(fl_comm *c, const void *send, void *recv, size_t count,
                                fl_comm_dtype dt);
    /* displs[size]: offsets computed by comm.c from counts */
    fl_status (*all_gather)(fl_comm *c, const void *send, void *recv, const size_t *counts,
                            const size_t *displs, size_t total, fl_comm_dtype dt);
    fl_status (*reduce_scatter)(fl_comm *c, const void *send, void *recv, const size_t *counts,
                                const size_t *displs, size_t total, fl_comm_dtype dt);
    fl_status (*all_to_all_v)(fl_comm *c, const void *send, const size_t *send_counts,
                              const size_t *send_displs, void *recv, const size_t *recv_counts,
                              const size_t *recv_displs, fl_comm_dtype dt);
    fl_status (*broadcast)(fl_comm *c, void *buf, size_t count, int root, fl_comm_dtype dt);
    fl_status (*barrier)(fl_comm *c);
    fl_status (*sync)(fl_comm *c);
    /* NCCL: enqueue later collectives on this stream; NULL for MPI. */
    fl_status (*use_stream)(fl_comm *c, void *stream);
    /* Best effort, from fl_par_abort: unblock pending device work. May be
     * NULL (nothing to do: MPI_Abort ends blocked MPI calls). */
    void (*abort)(fl_comm *c);
    /* Releases impl (not c itself, not c->mpi). */
    void (*destroy)(fl_comm *c);
} fl_comm_ops;

struct fl_comm {
    const fl_comm_ops *ops;
    fl_comm_backend backend;
    MPI_Comm mpi;        /* owned duplicate: host-side traffic and bootstrap */
    int rank, size;
    size_t *displs;      /* [size] scratch for all_gather / reduce_scatter */
    void *impl;          /* the implementation's state */
    void *stream;        /* NCCL: its cudaStream_t; MPI: NULL */
    bool own_stream;     /* fl_comm_config.own_stream: fl_comm_use_stream is a no-op */
    fl_comm *next_live;  /* registry of live comms, for fl_comm_abort_all */
};

/* comm.c: allocates c, duplicates comm (errors returned, not fatal) and
 * fills rank/size/displs; the implementation then sets ops/impl and calls
 * fl_comm_register. */
fl_status fl_comm_alloc(MPI_Comm comm, fl_comm_backend backend, fl_comm **out);
void fl_comm_register(fl_comm *c);
/* For fl_par_abort: calls ops->abort on every live communicator. */
void fl_comm_abort_all(void);

#endif /* FL_PAR_COMM_IMPL_H */
