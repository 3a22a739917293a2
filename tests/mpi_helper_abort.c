/*
 * mpi_helper_abort.c — a job in which one rank hits a fatal error while the
 * others wait in a collective, for test_par_abort.sh.
 *
 *   mpi_helper_abort FAIL_RANK plain|status   under mpirun
 *   mpi_helper_abort -1 nompi                  without MPI: fl_par_abort
 *                                              before MPI_Init
 *
 * plain:  rank FAIL_RANK calls fl_par_abort("injected failure: ...").
 * status: rank FAIL_RANK records an FL_ERR_NOT_FOUND (a missing shard) and
 *         calls fl_par_abort_status, as the launcher does with a status.
 * Every other rank blocks in an all-reduce on a tensor-parallel group
 * communicator (fl_comm over MPI) that can never complete; only the abort
 * can end the job. Exit 0 would mean the failure was lost.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "parallel/abort.h"
#include "parallel/comm.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s FAIL_RANK plain|status|nompi\n", argv[0]);
        return 2;
    }
    int fail_rank = atoi(argv[1]);
    const char *mode = argv[2];
    if (!strcmp(mode, "nompi")) fl_par_abort("injected failure before MPI_Init");

    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    fl_comm *c = NULL;
    if (fl_comm_init_mpi(MPI_COMM_WORLD, &c) != FL_OK) fl_par_abort_status(FL_ERR_MPI);
    if (rank == fail_rank) {
        usleep(200 * 1000); /* let the others block first */
        if (!strcmp(mode, "status")) {
            fl_status st = FL_ERR(FL_ERR_NOT_FOUND,
                                  "shard model-00002-of-00002.safetensors is missing (rank %d)",
                                  rank);
            fl_par_abort_status(st);
        }
        char msg[128];
        snprintf(msg, sizeof msg, "injected failure on rank %d of %d", rank, size);
        fl_par_abort(msg);
    }
    float x = 1;
    fl_status st = fl_comm_all_reduce_sum(c, &x, &x, 1, FL_COMM_F32);
    /* Not reached while the abort works: the failing rank never joins. */
    printf("rank %d: all-reduce returned %s\n", rank, fl_status_str(st));
    fl_comm_free(c);
    MPI_Finalize();
    return 0;
}
