/*
 * check.h — the checking macros of parallel/ for MPI, NCCL, CUDA and hwloc
 * calls, in the one error model of core/status.h.
 *
 * Each macro evaluates the call once; on failure it records one message that
 * names the call's source text, the library's own error string and the
 * file:line (through fl_error_set), and then either returns the status
 * (FL_*_CHECK) or stores it and jumps to a cleanup label (FL_*_CHECK_GOTO),
 * like NCCL's NCCLCHECK / NCCLCHECKGOTO.
 *
 * The NCCL and CUDA forms exist only in builds with NCCL (FL_HAVE_NCCL); the
 * functions that format their messages live in comm_nccl.c.
 */
#ifndef FL_PAR_CHECK_H
#define FL_PAR_CHECK_H

#include <mpi.h>

#include "core/status.h"

/* Records FL_ERR_MPI for MPI return code rc of `call` (its source text);
 * returns FL_ERR_MPI. Uses MPI_Error_string for the reason. */
fl_status fl_par_mpi_error(int rc, const char *call, const char *file, int line);
/* Records FL_ERR_HWLOC for a failed hwloc call (hwloc reports through errno);
 * returns FL_ERR_HWLOC. */
fl_status fl_par_hwloc_error(int err, const char *call, const char *file, int line);

#define FL_MPI_CHECK(call)                                                            \
    do {                                                                              \
        int fl_mpi_rc_ = (call);                                                      \
        if (fl_mpi_rc_ != MPI_SUCCESS)                                                \
            return fl_par_mpi_error(fl_mpi_rc_, #call, __FILE__, __LINE__);           \
    } while (0)

#define FL_MPI_CHECK_GOTO(call, st, label)                                            \
    do {                                                                              \
        int fl_mpi_rc_ = (call);                                                      \
        if (fl_mpi_rc_ != MPI_SUCCESS) {                                              \
            (st) = fl_par_mpi_error(fl_mpi_rc_, #call, __FILE__, __LINE__);           \
            goto label;                                                               \
        }                                                                             \
    } while (0)

/* hwloc functions return -1 (or NULL) and set errno on failure. */
#define FL_HWLOC_CHECK_GOTO(call, st, label)                                          \
    do {                                                                              \
        if ((call) < 0) {                                                             \
            (st) = fl_par_hwloc_error(errno, #call, __FILE__, __LINE__);              \
            goto label;                                                               \
        }                                                                             \
    } while (0)

#ifdef FL_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

fl_status fl_par_nccl_error(ncclResult_t rc, const char *call, const char *file, int line);
fl_status fl_par_cuda_error(cudaError_t rc, const char *call, const char *file, int line);

#define FL_NCCL_CHECK_GOTO(call, st, label)                                           \
    do {                                                                              \
        ncclResult_t fl_nccl_rc_ = (call);                                            \
        if (fl_nccl_rc_ != ncclSuccess) {                                             \
            (st) = fl_par_nccl_error(fl_nccl_rc_, #call, __FILE__, __LINE__);         \
            goto label;                                                               \
        }                                                                             \
    } while (0)

#define FL_NCCL_CHECK(call)                                                           \
    do {                                                                              \
        ncclResult_t fl_nccl_rc_ = (call);                                            \
        if (fl_nccl_rc_ != ncclSuccess)                                               \
            return fl_par_nccl_error(fl_nccl_rc_, #call, __FILE__, __LINE__);         \
    } while (0)

#define FL_CUDA_CHECK_GOTO(call, st, label)                                           \
    do {                                                                              \
        cudaError_t fl_cuda_rc_ = (call);                                             \
        if (fl_cuda_rc_ != cudaSuccess) {                                             \
            (st) = fl_par_cuda_error(fl_cuda_rc_, #call, __FILE__, __LINE__);         \
            goto label;                                                               \
        }                                                                             \
    } while (0)

#define FL_CUDA_CHECK(call)                                                           \
    do {                                                                              \
        cudaError_t fl_cuda_rc_ = (call);                                             \
        if (fl_cuda_rc_ != cudaSuccess)                                               \
            return fl_par_cuda_error(fl_cuda_rc_, #call, __FILE__, __LINE__);         \
    } while (0)
#endif /* FL_HAVE_NCCL */

#endif /* FL_PAR_CHECK_H */
