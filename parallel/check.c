/*
 * check.c — message formatting for the MPI and hwloc checking macros of
 * check.h (the NCCL/CUDA ones live with the NCCL code in comm_nccl.c).
 */
#include "parallel/check.h"

#include <string.h>

fl_status fl_par_mpi_error(int rc, const char *call, const char *file, int line) {
    char reason[MPI_MAX_ERROR_STRING] = "unknown MPI error";
    int len = 0;
    if (MPI_Error_string(rc, reason, &len) != MPI_SUCCESS)
        strcpy(reason, "unknown MPI error");
    return fl_error_set(FL_ERR_MPI, file, line, "%s failed: %s (MPI error %d)", call, reason, rc);
}

fl_status fl_par_hwloc_error(int err, const char *call, const char *file, int line) {
    return fl_error_set(FL_ERR_HWLOC, file, line, "%s failed: %s", call,
                        err ? strerror(err) : "unknown hwloc error");
}
