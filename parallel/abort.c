/*
 * abort.c — fl_par_abort: print once, abort NCCL, MPI_Abort (see abort.h).
 */
#include "parallel/abort.h"

#include <mpi.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "parallel/comm_impl.h"

static atomic_flag g_aborting = ATOMIC_FLAG_INIT;

void fl_par_abort(const char *msg) {
    if (atomic_flag_test_and_set(&g_aborting)) {
        /* Another thread is already ending the job. */
        for (;;) pause();
    }
    int init = 0, fini = 0, rank = -1;
    MPI_Initialized(&init);
    MPI_Finalized(&fini);
    int mpi_up = init && !fini;
    if (mpi_up) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank >= 0)
        fprintf(stderr, "flotilla: rank %d: %s\n", rank, msg ? msg : "fatal error");
    else
        fprintf(stderr, "flotilla: %s\n", msg ? msg : "fatal error");
    fflush(stderr);
    fflush(stdout);
    fl_comm_abort_all();
    if (mpi_up) MPI_Abort(MPI_COMM_WORLD, 1);
    _Exit(1); /* MPI_Abort does not return; this covers MPI being down */
}

void fl_par_abort_status(fl_status st) {
    char buf[1400];
    const char *where = fl_error_where();
    snprintf(buf, sizeof buf, "%s: %s%s%s%s", fl_status_str(st), fl_error_msg(),
             *where ? " (" : "", where, *where ? ")" : "");
    fl_par_abort(buf);
}
