/*
 * abort.h — ending the whole job when one rank hits a fatal error.
 *
 * In a multi-rank job a rank that returns or exits on its own leaves the
 * other ranks blocked forever in their next collective. So the launcher
 * (never library code, which returns statuses) hands a fatal status to
 * fl_par_abort, which:
 *   1. prints the message once, on stderr, prefixed with the calling rank
 *      ("flotilla: rank 1: <msg>") — only the rank that saw the error
 *      prints it; the other ranks are killed silently by MPI_Abort;
 *   2. aborts every live NCCL communicator (ncclCommAbort), so GPU work
 *      waiting for a peer cannot block the process;
 *   3. calls MPI_Abort(MPI_COMM_WORLD, 1), which makes the launcher (mpirun,
 *      srun) kill every rank; the job exits non-zero.
 * If MPI was never initialized (or is finalized) it prints and calls
 * _Exit(1): there are no peers to stop.
 *
 * Thread-safe: if several threads of one rank call it, one prints and
 * aborts; the others block until the process dies.
 */
#ifndef FL_PAR_ABORT_H
#define FL_PAR_ABORT_H

#include "core/status.h"

/* Never returns. msg NULL prints "fatal error". */
void fl_par_abort(const char *msg) __attribute__((noreturn));

/* fl_par_abort with "<status name>: <last error message> (<file:line>)"
 * built from the calling thread's last recorded error. */
void fl_par_abort_status(fl_status st) __attribute__((noreturn));

#endif /* FL_PAR_ABORT_H */
