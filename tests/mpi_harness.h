/*
 * mpi_harness.h — cmocka inside every rank of an mpirun job (tests/mpi_*.c).
 *
 * Every rank runs the same cmocka group and prints its own report, named
 * after the rank. A failed assertion on one rank must end the whole job at
 * once: the other ranks may already be blocked in the collective the failed
 * rank will never reach. So each test runs with fixtures that mark the test
 * finished only when its body returned; the teardown of a test whose body
 * did not return (cmocka longjmp'd out of a failed assert) calls
 * MPI_Abort(MPI_COMM_WORLD, 1): mpirun then kills every rank and exits
 * non-zero, instead of hanging until ctest's timeout.
 *
 * Tests declare themselves with MPI_TEST(fn) and end with MPI_TEST_DONE()
 * (also right before cmocka's skip(), which leaves the body like a failure).
 * FL_TEST_FAIL_RANK=r (environment) makes rank r fail the first test that
 * calls mpi_injected_failure(), to prove the mechanism (test_par_abort.sh).
 *
 * Buffers: the collectives are run on host buffers (the MPI communicator)
 * by default; FL_TEST_COMM=nccl (builds with NCCL, on a GPU machine) runs
 * the same checks through the NCCL communicator with device buffers, staged
 * through the tbuf_* helpers.
 */
#ifndef FL_TEST_MPI_HARNESS_H
#define FL_TEST_MPI_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <mpi.h>

#include "core/option.h"
#include "parallel/comm.h"
#ifdef FL_HAVE_NCCL
#include <cuda_runtime_api.h>
#endif

/* Not every test file uses every helper. */
#define HARNESS static __attribute__((unused))

static int g_rank, g_size;
static volatile int g_test_done;

HARNESS int mpi_test_setup(void **state) {
    g_test_done = 0;
    return 0;
}

HARNESS int mpi_test_teardown(void **state) {
    if (!g_test_done) {
        fprintf(stderr, "rank %d: test failed; aborting the whole job\n", g_rank);
        fflush(stdout);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return 0;
}

#define MPI_TEST(fn) cmocka_unit_test_setup_teardown(fn, mpi_test_setup, mpi_test_teardown)
#define MPI_TEST_DONE() (g_test_done = 1)

HARNESS void mpi_injected_failure(void) {
    const char *s = getenv("FL_TEST_FAIL_RANK");
    static int fired;
    if (s && atoi(s) == g_rank && !fired) {
        fired = 1;
        fail_msg("rank %d: injected failure (FL_TEST_FAIL_RANK)", g_rank);
    }
}

static CMFixtureFunction g_group_setup;

/* A group fixture that fails on one rank would leave the others in its
 * collectives: abort the job instead. */
HARNESS int group_setup_or_abort(void **state) {
    if (g_group_setup && g_group_setup(state) != 0) {
        fprintf(stderr, "rank %d: group setup failed; aborting the whole job\n", g_rank);
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return 0;
}

/* Runs the group on every rank; returns the exit code for main (non-zero
 * when a test failed on any rank). setup/teardown: group fixtures or NULL. */
HARNESS int mpi_run_tests_fixture(int *argc, char ***argv, const char *name,
                                 const struct CMUnitTest *tests, size_t n,
                                 CMFixtureFunction setup, CMFixtureFunction teardown) {
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    char group[128];
    snprintf(group, sizeof group, "%s rank %d/%d", name, g_rank, g_size);
    g_group_setup = setup;
    int failed = _cmocka_run_group_tests(group, tests, n, group_setup_or_abort, teardown);
    int any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return any ? 1 : 0;
}

/* ---- test buffers: host (MPI) or device (NCCL) --------------------------- */

HARNESS int use_nccl(void) {
    const char *s = getenv("FL_TEST_COMM");
    return s && !strcmp(s, "nccl");
}

HARNESS void *tbuf_new(size_t bytes) {
    void *p = NULL;
#ifdef FL_HAVE_NCCL
    if (use_nccl()) {
        if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) return NULL;
        return p;
    }
#endif
    p = malloc(bytes ? bytes : 1);
    return p;
}

HARNESS void tbuf_free(void *p) {
#ifdef FL_HAVE_NCCL
    if (use_nccl()) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

HARNESS void tbuf_put(void *dst, const void *host, size_t bytes) {
#ifdef FL_HAVE_NCCL
    if (use_nccl()) {
        assert_int_equal(cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
        return;
    }
#endif
    memcpy(dst, host, bytes);
}

HARNESS void tbuf_get(void *host, const void *src, size_t bytes) {
#ifdef FL_HAVE_NCCL
    if (use_nccl()) {
        assert_int_equal(cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
        return;
    }
#endif
    memcpy(host, src, bytes);
}

/* The communicator under test over comm. */
HARNESS fl_comm *test_comm_new(MPI_Comm comm) {
    fl_comm *c = NULL;
    fl_status st;
    if (use_nccl()) {
        int local = 0;
        const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        if (lr) local = atoi(lr);
        int n = 1;
#ifdef FL_HAVE_NCCL
        if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) n = 1;
#endif
        /* the flotilla command's settings: the environment over the
         * defaults (FL_P2P_AR=1 runs these tests through the p2p path) */
        fl_comm_config cc;
        fl_comm_config_default(&cc);
        cc.p2p_allreduce = fl_opt_bool(FL_OPT_P2P_AR);
        cc.p2p_allreduce_max_bytes = fl_opt_int(FL_OPT_P2P_AR_MAX_BYTES);
        st = fl_comm_init_nccl(comm, local % n, &cc, &c);
    } else {
        st = fl_comm_init_mpi(comm, &c);
    }
    if (st != FL_OK) {
        /* collective construction: one rank failing strands the others */
        fprintf(stderr, "rank %d: communicator: %s: %s\n", g_rank, fl_status_str(st),
                fl_error_msg());
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return c;
}

#endif /* FL_TEST_MPI_HARNESS_H */
