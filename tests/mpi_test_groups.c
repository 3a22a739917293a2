/*
 * mpi_test_groups.c — rank discovery, process groups and binding under
 * mpirun (2, 3 and 4 ranks on one node):
 *  - fl_par_rank_discover: Open MPI's local rank is used; a stale launcher
 *    variable (every rank claiming local rank 0) falls back to the shared-
 *    memory communicator; a malformed one is an error on every rank;
 *  - fl_par_groups_init for every tp x dp and ep that divides the world:
 *    group sizes, ranks, and membership (an all-gather of world ranks over
 *    each group equals the set the layout math predicts); a layout that
 *    does not divide is refused on every rank, with no rank left waiting;
 *  - fl_par_bind_apply on every rank: while ranks <= cores the cpusets are
 *    pairwise disjoint; the binding is undone afterwards.
 */
#include "mpi_harness.h"

#include <hwloc.h>

#include "parallel/bind.h"
#include "parallel/check.h"
#include "parallel/groups.h"
#include "parallel/rank.h"

#define OK(call)                                                                           \
    do {                                                                                   \
        fl_status st_ = (call);                                                            \
        if (st_ != FL_OK)                                                                  \
            fail_msg("rank %d: %s: %s: %s", g_rank, #call, fl_status_str(st_), fl_error_msg()); \
    } while (0)

static void test_discover(void **state) {
    fl_par_rank_info info;
    OK(fl_par_rank_discover(MPI_COMM_WORLD, NULL, &info));
    assert_int_equal(info.world_rank, g_rank);
    assert_int_equal(info.world_size, g_size);
    /* one node: local = world */
    assert_int_equal(info.local_size, g_size);
    assert_int_equal(info.local_rank, g_rank);
    assert_int_equal(info.n_nodes, 1);
    assert_int_equal(info.node_index, 0);
    if (getenv("OMPI_COMM_WORLD_LOCAL_RANK"))
        assert_int_equal(info.local_src, FL_PAR_LOCAL_SRC_OMPI);

    /* every rank sees SLURM_LOCALID=0 (a nested launch): not usable */
    fl_par_rank_env stale = {.slurm_localid = "0", .cuda_visible_devices = "0,1,2"};
    OK(fl_par_rank_discover(MPI_COMM_WORLD, &stale, &info));
    assert_int_equal(info.local_src, FL_PAR_LOCAL_SRC_MPI_SHARED);
    assert_int_equal(info.local_rank, g_rank);
    assert_int_equal(info.n_visible_gpus, 3);
    assert_int_equal(info.gpu, g_rank % 3);

    /* a consistent permutation from the environment is used as given */
    char lr[16];
    snprintf(lr, sizeof lr, "%d", g_size - 1 - g_rank);
    fl_par_rank_env rev = {.mpich_local_rank = lr, .cuda_visible_devices = ""};
    OK(fl_par_rank_discover(MPI_COMM_WORLD, &rev, &info));
    assert_int_equal(info.local_src, FL_PAR_LOCAL_SRC_MPICH);
    assert_int_equal(info.local_rank, g_size - 1 - g_rank);
    assert_int_equal(info.gpu, -1);

    /* malformed on every rank: every rank returns the error (no hang) */
    fl_par_rank_env bad = {.ompi_local_rank = "one"};
    fl_error_clear();
    assert_int_equal(fl_par_rank_discover(MPI_COMM_WORLD, &bad, &info), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "OMPI_COMM_WORLD_LOCAL_RANK='one'"));
    MPI_TEST_DONE();
}

/* All-gathers the world ranks of comm's members in comm rank order. */
static void members(MPI_Comm comm, int *out, int *n) {
    assert_int_equal(MPI_Comm_size(comm, n), MPI_SUCCESS);
    assert_int_equal(MPI_Allgather(&g_rank, 1, MPI_INT, out, 1, MPI_INT, comm), MPI_SUCCESS);
}

static void check_layout(int tp, int ep) {
    fl_par_layout lay = {.world = g_size, .tp = tp, .ep = ep};
    fl_par_shape shape = {.n_heads = 12 * tp, .n_kv_heads = tp, .n_experts = 4 * ep};
    fl_par_groups *g = NULL;
    OK(fl_par_groups_init(MPI_COMM_WORLD, &lay, &shape, &g));
    const fl_par_layout *l = fl_par_groups_layout(g);
    const fl_par_coords *c = fl_par_groups_coords(g);
    assert_int_equal(l->dp, g_size / tp);
    assert_int_equal(c->rank, g_rank);
    int m[8], n;

    members(fl_par_groups_comm(g, FL_PAR_GROUP_TP), m, &n);
    assert_int_equal(n, tp);
    for (int t = 0; t < tp; t++)
        assert_int_equal(m[t], fl_par_tp_peer(l, c->dp_rank, t));
    assert_int_equal(m[c->tp_rank], g_rank);

    members(fl_par_groups_comm(g, FL_PAR_GROUP_DP), m, &n);
    assert_int_equal(n, l->dp);
    for (int d = 0; d < l->dp; d++) assert_int_equal(m[d], d * tp + c->tp_rank);

    members(fl_par_groups_comm(g, FL_PAR_GROUP_EP), m, &n);
    assert_int_equal(n, ep);
    for (int e = 0; e < ep; e++) assert_int_equal(m[e], c->ep_group * ep + e);

    members(fl_par_groups_comm(g, FL_PAR_GROUP_WORLD), m, &n);
    assert_int_equal(n, g_size);
    for (int r = 0; r < g_size; r++) assert_int_equal(m[r], r);
    assert_true(fl_par_groups_comm(g, FL_PAR_GROUP_COUNT) == MPI_COMM_NULL);

    /* a collective over the TP group through the comm API */
    fl_comm *tc = test_comm_new(fl_par_groups_comm(g, FL_PAR_GROUP_TP));
    int32_t one = 1, sum = 0;
    void *b = tbuf_new(4);
    tbuf_put(b, &one, 4);
    OK(fl_comm_all_reduce_sum(tc, b, b, 1, FL_COMM_I32));
    OK(fl_comm_sync(tc));
    tbuf_get(&sum, b, 4);
    assert_int_equal(sum, tp);
    tbuf_free(b);
    fl_comm_free(tc);
    fl_par_groups_free(g);
}

static void test_groups_all_layouts(void **state) {
    for (int tp = 1; tp <= g_size; tp++) {
        if (g_size % tp) continue;
        for (int ep = 1; ep <= g_size; ep++)
            if (g_size % ep == 0) check_layout(tp, ep);
    }
    fl_par_groups_free(NULL);
    MPI_TEST_DONE();
}

static void test_groups_refused(void **state) {
    fl_par_groups *g = (fl_par_groups *)1;
    /* tp does not divide the world (every size 2..4 has one such tp) */
    int tp = g_size == 4 ? 3 : g_size + 1;
    fl_par_layout lay = {.world = g_size, .tp = tp};
    char want[64];
    snprintf(want, sizeof want, "world size %d is not divisible by tp %d", g_size, tp);
    fl_error_clear();
    assert_int_equal(fl_par_groups_init(MPI_COMM_WORLD, &lay, NULL, &g), FL_ERR_INVALID_ARG);
    assert_null(g);
    assert_non_null(strstr(fl_error_msg(), want));
    /* heads not divisible by tp */
    fl_par_layout lay2 = {.world = g_size, .tp = g_size};
    fl_par_shape odd = {.n_heads = 2 * g_size + 1, .n_kv_heads = 1};
    assert_int_equal(fl_par_groups_init(MPI_COMM_WORLD, &lay2, &odd, &g), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "n_heads"));
    /* a layout for another world size */
    fl_par_layout lay3 = {.world = g_size + 1, .tp = 1};
    assert_int_equal(fl_par_groups_init(MPI_COMM_WORLD, &lay3, NULL, &g), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "ranks"));
    /* every rank is still in step */
    assert_int_equal(MPI_Barrier(MPI_COMM_WORLD), MPI_SUCCESS);
    MPI_TEST_DONE();
}

static void test_bind_ranks(void **state) {
    fl_par_rank_info info;
    OK(fl_par_rank_discover(MPI_COMM_WORLD, NULL, &info));
    char before[256], desc[512], mine[256], all[4][256];
    OK(fl_par_bind_current(before, sizeof before));
    fl_par_bind_req req = {.mode = FL_PAR_BIND_AUTO, .local_rank = info.local_rank,
                           .local_size = info.local_size};
    OK(fl_par_bind_apply(&req, desc, sizeof desc));
    OK(fl_par_bind_current(mine, sizeof mine));
    assert_non_null(strstr(desc, mine));
    printf("rank %d: %s\n", g_rank, desc);
    assert_true(g_size <= 4);
    assert_int_equal(MPI_Allgather(mine, 256, MPI_CHAR, all, 256, MPI_CHAR, MPI_COMM_WORLD),
                     MPI_SUCCESS);
    hwloc_topology_t topo;
    assert_int_equal(hwloc_topology_init(&topo), 0);
    assert_int_equal(hwloc_topology_load(topo), 0);
    int cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    hwloc_bitmap_t a = hwloc_bitmap_alloc(), b = hwloc_bitmap_alloc();
    if (g_size <= cores) {
        for (int i = 0; i < g_size; i++)
            for (int j = i + 1; j < g_size; j++) {
                hwloc_bitmap_list_sscanf(a, all[i]);
                hwloc_bitmap_list_sscanf(b, all[j]);
                if (hwloc_bitmap_intersects(a, b))
                    fail_msg("ranks %d and %d share cpus: %s / %s", i, j, all[i], all[j]);
            }
    }
    /* undo */
    hwloc_bitmap_list_sscanf(a, before);
    assert_int_equal(hwloc_set_cpubind(topo, a, HWLOC_CPUBIND_PROCESS), 0);
    hwloc_bitmap_free(a);
    hwloc_bitmap_free(b);
    hwloc_topology_destroy(topo);
    MPI_TEST_DONE();
}

static fl_status bad_bcast(MPI_Comm comm) {
    fl_status st = FL_OK;
    int x = 0;
    FL_MPI_CHECK_GOTO(MPI_Bcast(&x, 1, MPI_INT, 99, comm), st, fail);
fail:
    return st;
}

/* The check macros turn an MPI error code into FL_ERR_MPI with the call's
 * text, MPI's reason and the file:line of the call. */
static void test_mpi_check_macro(void **state) {
    MPI_Comm dup;
    assert_int_equal(MPI_Comm_dup(MPI_COMM_WORLD, &dup), MPI_SUCCESS);
    assert_int_equal(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), MPI_SUCCESS);
    fl_error_clear();
    assert_int_equal(bad_bcast(dup), FL_ERR_MPI);
    assert_non_null(strstr(fl_error_msg(), "MPI_Bcast(&x, 1, MPI_INT, 99, comm) failed: "));
    assert_non_null(strstr(fl_error_where(), "mpi_test_groups.c:"));
    MPI_Comm_free(&dup);
    MPI_TEST_DONE();
}

/* With a GPU (builds with CUDA, on the GPU machine): its PCI bus id, and a
 * binding plan near it (hwloc's PCI locality or sysfs). Skipped elsewhere. */
static void test_bind_gpu(void **state) {
#ifdef FL_HAVE_NCCL
    int n = 0;
    if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
        char busid[16], list[256], how[256];
        OK(fl_par_gpu_busid(g_rank % n, busid, sizeof busid));
        assert_int_equal(strlen(busid), 12);
        fl_par_bind_req req = {.mode = FL_PAR_BIND_AUTO, .local_rank = g_rank,
                               .local_size = g_size, .gpu_busid = busid};
        OK(fl_par_bind_plan(&req, list, sizeof list, how, sizeof how));
        printf("rank %d: GPU %d at %s: would bind to cpus %s (%s)\n", g_rank, g_rank % n, busid,
               list, how);
        assert_true(strlen(list) > 0);
        MPI_TEST_DONE();
        return;
    }
#endif
    MPI_TEST_DONE();
    skip();
}

int main(int argc, char **argv) {
    const struct CMUnitTest tests[] = {
        MPI_TEST(test_discover),
        MPI_TEST(test_groups_all_layouts),
        MPI_TEST(test_groups_refused),
        MPI_TEST(test_bind_ranks),
        MPI_TEST(test_bind_gpu),
        MPI_TEST(test_mpi_check_macro),
    };
    return mpi_run_tests_fixture(&argc, &argv, "mpi_test_groups", tests,
                                 sizeof tests / sizeof tests[0], NULL, NULL);
}
