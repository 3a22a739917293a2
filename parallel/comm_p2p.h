/*
 * comm_p2p.h — a one-shot all-reduce through peer GPU memory for the small
 * bf16 reductions of tensor-parallel decode (kernels/cuda/cuda_allreduce.cu),
 * used by the NCCL communicator in place of ncclAllReduce when every rank
 * of the group set it up. Private to parallel/.
 */
#ifndef FL_PAR_COMM_P2P_H
#define FL_PAR_COMM_P2P_H

#include <stdbool.h>
#include <stddef.h>

#include "parallel/comm.h"

typedef struct fl_p2p_ar fl_p2p_ar;

/* Collective over mpi (the communicator's ranks, one GPU each). Sets *out
 * to NULL (and returns FL_OK) when it is off (cfg->p2p_allreduce false on
 * any rank), when the group spans nodes or more than 8 ranks, or when any
 * rank cannot map its peers' memory: then every rank keeps NCCL. verbose:
 * say which. */
fl_status fl_p2p_ar_init(MPI_Comm mpi, int rank, int size, const fl_comm_config *cfg, bool verbose,
                         fl_p2p_ar **out);
/* Whether an all-reduce of count elements of dt goes through it (the same
 * answer on every rank: it depends on count and dt only). */
bool fl_p2p_ar_takes(const fl_p2p_ar *p, size_t count, fl_comm_dtype dt);
fl_status fl_p2p_ar_run(fl_p2p_ar *p, const void *send, void *recv, size_t count, void *stream);
void fl_p2p_ar_free(fl_p2p_ar *p);

#endif /* FL_PAR_COMM_P2P_H */
