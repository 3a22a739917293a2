/*
 * test_par_pure.c — the pure parts of parallel/, without mpirun: launcher
 * environment parsing (local rank, CUDA_VISIBLE_DEVICES, GPU index; whether
 * mpirun/PMIx/srun started us and srun's task count vs MPI's world), layout
 * divisibility checks and their messages, rank → group coordinates and
 * expert ownership, PCI bus id normalization, and hwloc binding plans on
 * this machine (disjoint cpusets for 2 local ranks; --bind none changes
 * nothing; the sysfs fallback on a fake tree).
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <hwloc.h>

#include "parallel/bind.h"
#include "parallel/check.h"
#include "parallel/comm.h"
#include "parallel/groups.h"
#include "parallel/rank.h"

/* ---- local rank from the environment ---------------------------------- */

static void test_local_rank_env_order(void **state) {
    int lr;
    fl_par_local_src src;
    fl_par_rank_env env = {0};
    assert_int_equal(fl_par_local_rank_from_env(&env, &lr, &src), FL_OK);
    assert_int_equal(lr, -1);
    assert_int_equal(src, FL_PAR_LOCAL_SRC_NONE);

    env.mpich_local_rank = "5";
    assert_int_equal(fl_par_local_rank_from_env(&env, &lr, &src), FL_OK);
    assert_int_equal(lr, 5);
    assert_int_equal(src, FL_PAR_LOCAL_SRC_MPICH);

    env.slurm_localid = "2";
    assert_int_equal(fl_par_local_rank_from_env(&env, &lr, &src), FL_OK);
    assert_int_equal(lr, 2);
    assert_int_equal(src, FL_PAR_LOCAL_SRC_SLURM);

    env.ompi_local_rank = "3";  /* Open MPI's mpirun wins over Slurm */
    assert_int_equal(fl_par_local_rank_from_env(&env, &lr, &src), FL_OK);
    assert_int_equal(lr, 3);
    assert_int_equal(src, FL_PAR_LOCAL_SRC_OMPI);
    assert_string_equal(fl_par_local_src_name(src), "OMPI_COMM_WORLD_LOCAL_RANK");
}

static void test_local_rank_env_malformed(void **state) {
    const char *bad[] = {"", "x", "-1", "3a", " 3", "99999999999", "+1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int lr = 7;
        fl_par_local_src src;
        fl_par_rank_env env = {.slurm_localid = bad[i]};
        fl_error_clear();
        assert_int_equal(fl_par_local_rank_from_env(&env, &lr, &src), FL_ERR_INVALID_ARG);
        assert_int_equal(lr, -1);
        assert_non_null(strstr(fl_error_msg(), "SLURM_LOCALID"));
    }
}

static void test_visible_gpus(void **state) {
    int n;
    assert_int_equal(fl_par_visible_gpus_count(NULL, &n), FL_OK);
    assert_int_equal(n, -1);
    assert_int_equal(fl_par_visible_gpus_count("", &n), FL_OK);
    assert_int_equal(n, 0);
    assert_int_equal(fl_par_visible_gpus_count("3", &n), FL_OK);
    assert_int_equal(n, 1);
    assert_int_equal(fl_par_visible_gpus_count("0,2,4,6", &n), FL_OK);
    assert_int_equal(n, 4);
    assert_int_equal(fl_par_visible_gpus_count("GPU-8c5a1d2e-aaaa-bbbb-cccc-0123456789ab,1", &n),
                     FL_OK);
    assert_int_equal(n, 2);
    assert_int_equal(fl_par_visible_gpus_count("MIG-0f2e3d4c-1111-2222-3333-444455556666", &n),
                     FL_OK);
    assert_int_equal(n, 1);
    const char *bad[] = {"0,,1", ",", "0,", "a", "1;2", "GPU-", "GPU-zz"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fl_error_clear();
        assert_int_equal(fl_par_visible_gpus_count(bad[i], &n), FL_ERR_INVALID_ARG);
        assert_non_null(strstr(fl_error_msg(), "CUDA_VISIBLE_DEVICES"));
    }
}

static void test_gpu_index(void **state) {
    int gpu;
    /* unset: local rank = device */
    assert_int_equal(fl_par_gpu_index(5, -1, &gpu), FL_OK);
    assert_int_equal(gpu, 5);
    /* narrowed to 4 visible ids: devices are renumbered 0..3 */
    assert_int_equal(fl_par_gpu_index(5, 4, &gpu), FL_OK);
    assert_int_equal(gpu, 1);
    assert_int_equal(fl_par_gpu_index(3, 4, &gpu), FL_OK);
    assert_int_equal(gpu, 3);
    assert_int_equal(fl_par_gpu_index(0, 1, &gpu), FL_OK);
    assert_int_equal(gpu, 0);
    /* CUDA_VISIBLE_DEVICES="": no GPU */
    assert_int_equal(fl_par_gpu_index(2, 0, &gpu), FL_OK);
    assert_int_equal(gpu, -1);
    assert_int_equal(fl_par_gpu_index(-1, 4, &gpu), FL_ERR_INVALID_ARG);
}

static void test_local_ranks_valid(void **state) {
    int perm[] = {2, 0, 1, 3}, stale[] = {0, 0, 0}, gap[] = {0, 2}, neg[] = {-1, 0};
    assert_true(fl_par_local_ranks_valid(perm, 4));
    assert_false(fl_par_local_ranks_valid(stale, 3));
    assert_false(fl_par_local_ranks_valid(gap, 2));
    assert_false(fl_par_local_ranks_valid(neg, 2));
    assert_false(fl_par_local_ranks_valid(perm, 0));
}

/* ---- launch detection: MPI or not, srun's tasks ------------------------ */

static fl_par_launch launch_of(fl_par_launch_env env) {
    fl_par_launch l = {7, 7, 7};
    fl_error_clear();
    assert_int_equal(fl_par_launch_from_env(&env, &l), FL_OK);
    return l;
}

static void test_launch_plain_and_mpirun(void **state) {
    fl_par_launch l = launch_of((fl_par_launch_env){0});
    assert_false(l.use_mpi);
    assert_int_equal(l.slurm_rank, -1);
    assert_int_equal(l.slurm_size, -1);
    assert_int_equal(fl_par_launch_check(&l, 0, 1), FL_OK);
    /* mpirun / a PMIx launcher / Hydra */
    assert_true(launch_of((fl_par_launch_env){.ompi_world_size = "4"}).use_mpi);
    assert_true(launch_of((fl_par_launch_env){.pmix_rank = "0", .pmix_namespace = "prterun-x"}).use_mpi);
    assert_true(launch_of((fl_par_launch_env){.pmi_rank = "1"}).use_mpi);
    /* the batch script itself: the job's task count, but no step */
    l = launch_of((fl_par_launch_env){.slurm_procid = "0", .slurm_step_ntasks = "8"});
    assert_false(l.use_mpi);
    assert_int_equal(l.slurm_size, -1);
}

static void test_launch_srun(void **state) {
    /* srun --mpi=pmix -n 2: task 1 */
    fl_par_launch l = launch_of((fl_par_launch_env){
        .pmix_rank = "1", .pmix_namespace = "slurm.pmix.12.0", .slurm_step_id = "0",
        .slurm_procid = "1", .slurm_step_ntasks = "2"});
    assert_true(l.use_mpi);
    assert_int_equal(l.slurm_rank, 1);
    assert_int_equal(l.slurm_size, 2);
    assert_int_equal(fl_par_launch_check(&l, 1, 2), FL_OK);
    /* srun --mpi=none -n 2: still MPI, so a missing PMI fails loudly */
    l = launch_of((fl_par_launch_env){.slurm_step_id = "3", .slurm_procid = "0",
                                      .slurm_step_ntasks = "2"});
    assert_true(l.use_mpi);
    fl_error_clear();
    assert_int_equal(fl_par_launch_check(&l, 0, 1), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "srun started 2 tasks"));
    assert_non_null(strstr(fl_error_msg(), "--mpi=pmix"));
    fl_error_clear();
    assert_int_equal(fl_par_launch_check(&l, 1, 2), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "MPI rank 1 of 2 disagrees with srun's SLURM_PROCID=0 of 2"));
    fl_error_clear();
    assert_int_equal(fl_par_launch_check(&l, 0, 3), FL_ERR_INVALID_ARG);
    /* one task, no PMI: a plain process (the stand-in srun of test_slurm_script.sh) */
    l = launch_of((fl_par_launch_env){.slurm_step_id = "0", .slurm_procid = "0",
                                      .slurm_step_ntasks = "1"});
    assert_false(l.use_mpi);
    assert_int_equal(l.slurm_size, 1);
    assert_int_equal(fl_par_launch_check(&l, 0, 1), FL_OK);
    /* srun --mpi=pmi2 sets PMI_RANK = SLURM_PROCID, PMI_SIZE = the task count */
    l = launch_of((fl_par_launch_env){.pmi_rank = "1", .pmi_size = "4", .slurm_step_id = "0",
                                      .slurm_procid = "1", .slurm_step_ntasks = "4"});
    assert_int_equal(l.slurm_rank, 1);
    assert_int_equal(l.slurm_size, 4);
}

/* mpirun inside an allocation starts its daemons with srun: the ranks see
 * that step's SLURM_* variables, which say nothing about MPI's world. */
static void test_launch_nested(void **state) {
    fl_par_launch_env base = {.slurm_step_id = "0", .slurm_procid = "1", .slurm_step_ntasks = "2"};
    fl_par_launch_env e = base;
    e.ompi_world_size = "16";
    e.pmix_rank = "9";
    e.pmix_namespace = "1403715585";
    fl_par_launch l = launch_of(e);
    assert_true(l.use_mpi);
    assert_int_equal(l.slurm_size, -1);
    assert_int_equal(fl_par_launch_check(&l, 9, 16), FL_OK);
    e = base; /* a PMIx launcher that is not Slurm's */
    e.pmix_rank = "5";
    e.pmix_namespace = "prterun-node1-1234@1";
    assert_int_equal(launch_of(e).slurm_size, -1);
    e = base; /* Hydra's proxies under srun: 8 ranks on the 2 nodes of the step */
    e.pmi_rank = "6";
    e.pmi_size = "8";
    assert_int_equal(launch_of(e).slurm_size, -1);
    /* ... including the rank whose PMI_RANK equals its node's SLURM_PROCID:
     * every rank must decide alike */
    e.pmi_rank = "1";
    assert_int_equal(launch_of(e).slurm_size, -1);
    e.pmi_size = NULL; /* PMI without a size: not srun's pmi2 */
    assert_int_equal(launch_of(e).slurm_size, -1);
    /* malformed variables inside a nested launch are not ours to judge */
    e.slurm_procid = "x";
    assert_int_equal(launch_of(e).slurm_size, -1);
}

static void test_launch_malformed(void **state) {
    struct { fl_par_launch_env env; const char *msg; } bad[] = {
        {{.slurm_step_id = "0", .slurm_procid = "x", .slurm_step_ntasks = "2"}, "SLURM_PROCID='x'"},
        {{.slurm_step_id = "0", .slurm_procid = "-1", .slurm_step_ntasks = "2"}, "SLURM_PROCID='-1'"},
        {{.slurm_step_id = "0", .slurm_procid = "0"}, "'(unset)'"},
        {{.slurm_step_id = "0", .slurm_procid = "0", .slurm_step_ntasks = "0"}, "SLURM_NTASKS='0'"},
        {{.slurm_step_id = "0", .slurm_procid = "0", .slurm_step_ntasks = "2x"}, "SLURM_NTASKS='2x'"},
        {{.slurm_step_id = "0", .slurm_procid = "2", .slurm_step_ntasks = "2"},
         "SLURM_PROCID=2 is not below the step's task count 2"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fl_par_launch l = {7, 7, 7};
        fl_error_clear();
        assert_int_equal(fl_par_launch_from_env(&bad[i].env, &l), FL_ERR_INVALID_ARG);
        if (!strstr(fl_error_msg(), bad[i].msg)) fail_msg("expected '%s' in '%s'", bad[i].msg, fl_error_msg());
        assert_false(l.use_mpi);
        assert_int_equal(l.slurm_rank, -1);
    }
}

/* ---- layout checks ------------------------------------------------------ */

static void expect_refused(fl_par_layout l, const fl_par_shape *s, const char *msg) {
    fl_error_clear();
    if (fl_par_layout_check(&l, s) != FL_ERR_INVALID_ARG)
        fail_msg("layout world %d tp %d dp %d ep %d accepted; expected '%s'", l.world, l.tp, l.dp,
                 l.ep, msg);
    if (!strstr(fl_error_msg(), msg))
        fail_msg("expected '%s' in '%s'", msg, fl_error_msg());
}

static void test_layout_ok(void **state) {
    fl_par_layout l = {.world = 8, .tp = 2};
    fl_par_shape s = {.n_heads = 32, .n_kv_heads = 8, .n_experts = 8, .intermediate = 1024};
    assert_int_equal(fl_par_layout_check(&l, &s), FL_OK);
    assert_int_equal(l.dp, 4);
    assert_int_equal(l.ep, 1);
    /* tp > n_kv_heads: KV heads replicated (tp a multiple of them) */
    fl_par_layout l2 = {.world = 8, .tp = 8, .dp = 1, .ep = 8};
    fl_par_shape s2 = {.n_heads = 32, .n_kv_heads = 2, .n_experts = 64};
    assert_int_equal(fl_par_layout_check(&l2, &s2), FL_OK);
    /* dense model, ep 1; no shape at all */
    fl_par_layout l3 = {.world = 1, .tp = 1};
    fl_par_shape s3 = {.n_heads = 9, .n_kv_heads = 3};
    assert_int_equal(fl_par_layout_check(&l3, &s3), FL_OK);
    fl_par_layout l4 = {.world = 6, .tp = 3, .dp = 2, .ep = 6};
    assert_int_equal(fl_par_layout_check(&l4, NULL), FL_OK);
}

static void test_layout_refused(void **state) {
    fl_par_shape s = {.n_heads = 32, .n_kv_heads = 8, .n_experts = 8, .intermediate = 1024};
    expect_refused((fl_par_layout){.world = 6, .tp = 4}, &s,
                   "world size 6 is not divisible by tp 4");
    expect_refused((fl_par_layout){.world = 8, .tp = 2, .dp = 2}, &s,
                   "tp 2 x dp 2 = 4 does not equal world size 8");
    expect_refused((fl_par_layout){.world = 6, .tp = 1, .ep = 4}, &s,
                   "world size 6 is not divisible by ep 4");
    expect_refused((fl_par_layout){.world = 0, .tp = 1}, &s, "world size 0");
    expect_refused((fl_par_layout){.world = 4, .tp = 0}, &s, "tp 0");
    expect_refused((fl_par_layout){.world = 4, .tp = 1, .dp = -1}, &s, "dp -1");
    fl_par_shape heads = {.n_heads = 14, .n_kv_heads = 2};
    expect_refused((fl_par_layout){.world = 4, .tp = 4}, &heads,
                   "n_heads 14 is not divisible by tp 4");
    fl_par_shape kv = {.n_heads = 24, .n_kv_heads = 6};
    expect_refused((fl_par_layout){.world = 4, .tp = 4}, &kv, "n_kv_heads 6 is not divisible by tp 4");
    fl_par_shape ex = {.n_heads = 8, .n_kv_heads = 8, .n_experts = 6};
    expect_refused((fl_par_layout){.world = 4, .tp = 1, .ep = 4}, &ex,
                   "n_experts 6 is not divisible by ep 4");
    fl_par_shape dense = {.n_heads = 8, .n_kv_heads = 8};
    expect_refused((fl_par_layout){.world = 2, .tp = 1, .ep = 2}, &dense,
                   "ep 2 > 1 but the model has no experts");
    fl_par_shape mlp = {.n_heads = 8, .n_kv_heads = 8, .intermediate = 1004};
    expect_refused((fl_par_layout){.world = 16, .tp = 16}, &mlp, "n_heads 8 is not divisible by tp 16");
    expect_refused((fl_par_layout){.world = 8, .tp = 8}, &mlp,
                   "intermediate size 1004 is not divisible by tp 8");
    fl_par_shape neg = {.n_heads = -2};
    expect_refused((fl_par_layout){.world = 1, .tp = 1}, &neg, "negative model size");
}

/* ---- group membership math -------------------------------------------- */

static void test_coords(void **state) {
    fl_par_layout l = {.world = 12, .tp = 3, .ep = 4};
    assert_int_equal(fl_par_layout_check(&l, NULL), FL_OK);
    assert_int_equal(l.dp, 4);
    int tp_count[4] = {0}, ep_count[3] = {0};
    for (int r = 0; r < 12; r++) {
        fl_par_coords c = fl_par_coords_of(&l, r);
        assert_int_equal(c.rank, r);
        assert_int_equal(c.dp_rank * 3 + c.tp_rank, r);
        assert_int_equal(c.ep_group * 4 + c.ep_rank, r);
        assert_int_equal(fl_par_tp_peer(&l, c.dp_rank, c.tp_rank), r);
        tp_count[c.dp_rank]++;
        ep_count[c.ep_group]++;
    }
    /* ranks 0..tp-1 are dp group 0's TP group */
    for (int r = 0; r < 3; r++) assert_int_equal(fl_par_coords_of(&l, r).dp_rank, 0);
    assert_int_equal(fl_par_coords_of(&l, 3).dp_rank, 1);
    for (int d = 0; d < 4; d++) assert_int_equal(tp_count[d], 3);
    for (int g = 0; g < 3; g++) assert_int_equal(ep_count[g], 4);
    fl_par_coords c = fl_par_coords_of(&l, 7);
    assert_int_equal(c.tp_rank, 1);
    assert_int_equal(c.dp_rank, 2);
    assert_int_equal(c.ep_rank, 3);
    assert_int_equal(c.ep_group, 1);
}

static void test_experts(void **state) {
    int first, count, seen[60] = {0};
    for (int r = 0; r < 4; r++) {
        fl_par_expert_range(60, 4, r, &first, &count);
        assert_int_equal(count, 15);
        assert_int_equal(first, 15 * r);
        for (int e = first; e < first + count; e++) {
            seen[e]++;
            assert_int_equal(fl_par_expert_owner(60, 4, e), r);
        }
    }
    for (int e = 0; e < 60; e++) assert_int_equal(seen[e], 1);
    fl_par_expert_range(8, 1, 0, &first, &count);
    assert_int_equal(first, 0);
    assert_int_equal(count, 8);
}

static void test_dtype(void **state) {
    assert_int_equal(fl_comm_dtype_size(FL_COMM_F32), 4);
    assert_int_equal(fl_comm_dtype_size(FL_COMM_BF16), 2);
    assert_int_equal(fl_comm_dtype_size(FL_COMM_I32), 4);
    assert_int_equal(fl_comm_dtype_size(FL_COMM_DTYPE_COUNT), 0);
    assert_string_equal(fl_comm_dtype_name(FL_COMM_BF16), "bf16");
    assert_string_equal(fl_comm_backend_name(FL_COMM_BACKEND_NCCL), "nccl");
}

/* ---- binding ------------------------------------------------------------ */

static void test_busid(void **state) {
    char out[16];
    assert_int_equal(fl_par_busid_normalize("0000:3B:00.0", out, sizeof out), FL_OK);
    assert_string_equal(out, "0000:3b:00.0");
    assert_int_equal(fl_par_busid_normalize("00000000:DB:1F.7", out, sizeof out), FL_OK);
    assert_string_equal(out, "0000:db:1f.7");
    assert_int_equal(fl_par_busid_normalize("3b:0.1", out, sizeof out), FL_OK);
    assert_string_equal(out, "0000:3b:00.1");
    const char *bad[] = {"", "3b", "0000:3b:00", "0000:3b:00.8", "0000:3b:20.0", "x:3b:00.0",
                         "0000:3b:00.0 ", "1:2:3:4.0", "100000:3b:00.0", "0000:123:00.0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fl_error_clear();
        if (fl_par_busid_normalize(bad[i], out, sizeof out) != FL_ERR_INVALID_ARG)
            fail_msg("bus id '%s' was accepted as '%s'", bad[i], out);
        assert_non_null(strstr(fl_error_msg(), "PCI bus id"));
    }
    assert_int_equal(fl_par_busid_normalize("0000:3b:00.0", out, 8), FL_ERR_INVALID_ARG);
}

static void test_bind_mode(void **state) {
    fl_par_bind_mode m;
    assert_int_equal(fl_par_bind_mode_parse("auto", &m), FL_OK);
    assert_int_equal(m, FL_PAR_BIND_AUTO);
    assert_int_equal(fl_par_bind_mode_parse("none", &m), FL_OK);
    assert_int_equal(m, FL_PAR_BIND_NONE);
    assert_string_equal(fl_par_bind_mode_name(m), "none");
    fl_error_clear();
    assert_int_equal(fl_par_bind_mode_parse("core", &m), FL_ERR_INVALID_ARG);
    assert_non_null(strstr(fl_error_msg(), "'core'"));
    assert_int_equal(fl_par_bind_mode_parse(NULL, &m), FL_ERR_INVALID_ARG);
}

static hwloc_bitmap_t parse_list(const char *s) {
    hwloc_bitmap_t b = hwloc_bitmap_alloc();
    assert_non_null(b);
    assert_int_equal(hwloc_bitmap_list_sscanf(b, s), 0);
    return b;
}

/* Two local ranks without a GPU get disjoint, non-empty cpusets that cover
 * what one rank alone would get — on this 2-core machine one core each. */
static void test_bind_plan_disjoint(void **state) {
    char all[256], a[256], b[256], how[256];
    fl_par_bind_req r1 = {.mode = FL_PAR_BIND_AUTO, .local_rank = 0, .local_size = 1};
    assert_int_equal(fl_par_bind_plan(&r1, all, sizeof all, how, sizeof how), FL_OK);
    fl_par_bind_req r0 = {.mode = FL_PAR_BIND_AUTO, .local_rank = 0, .local_size = 2};
    fl_par_bind_req rb = {.mode = FL_PAR_BIND_AUTO, .local_rank = 1, .local_size = 2};
    assert_int_equal(fl_par_bind_plan(&r0, a, sizeof a, how, sizeof how), FL_OK);
    assert_non_null(strstr(how, "hwloc_distrib"));
    assert_int_equal(fl_par_bind_plan(&rb, b, sizeof b, NULL, 0), FL_OK);
    hwloc_bitmap_t ba = parse_list(a), bb = parse_list(b), ball = parse_list(all);
    assert_false(hwloc_bitmap_iszero(ba));
    assert_false(hwloc_bitmap_iszero(bb));
    hwloc_topology_t topo;
    assert_int_equal(hwloc_topology_init(&topo), 0);
    assert_int_equal(hwloc_topology_load(topo), 0);
    int cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    hwloc_topology_destroy(topo);
    if (cores >= 2) {
        if (hwloc_bitmap_intersects(ba, bb)) fail_msg("cpusets %s and %s overlap", a, b);
    }
    hwloc_bitmap_or(ba, ba, bb);
    assert_true(hwloc_bitmap_isincluded(ba, ball));
    hwloc_bitmap_free(ba);
    hwloc_bitmap_free(bb);
    hwloc_bitmap_free(ball);

    fl_par_bind_req out = {.mode = FL_PAR_BIND_AUTO, .local_rank = 2, .local_size = 2};
    assert_int_equal(fl_par_bind_plan(&out, a, sizeof a, NULL, 0), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_par_bind_plan(&r0, a, 1, NULL, 0), FL_ERR_INVALID_ARG);
}

/* Applying binds the process to the plan; --bind none leaves it alone. */
static void test_bind_apply_and_none(void **state) {
    char before[256], after[256], plan[256], desc[512];
    assert_int_equal(fl_par_bind_current(before, sizeof before), FL_OK);

    fl_par_bind_req none = {.mode = FL_PAR_BIND_NONE, .local_rank = 1, .local_size = 2};
    assert_int_equal(fl_par_bind_apply(&none, desc, sizeof desc), FL_OK);
    assert_int_equal(fl_par_bind_current(after, sizeof after), FL_OK);
    assert_string_equal(before, after);
    assert_non_null(strstr(desc, "not bound"));
    assert_non_null(strstr(desc, before));

    fl_par_bind_req r = {.mode = FL_PAR_BIND_AUTO, .local_rank = 1, .local_size = 2};
    assert_int_equal(fl_par_bind_plan(&r, plan, sizeof plan, NULL, 0), FL_OK);
    assert_int_equal(fl_par_bind_apply(&r, desc, sizeof desc), FL_OK);
    assert_int_equal(fl_par_bind_current(after, sizeof after), FL_OK);
    assert_string_equal(after, plan);
    assert_non_null(strstr(desc, "bound to cpus"));
    assert_non_null(strstr(desc, plan));

    /* restore the original binding for the rest of the process */
    hwloc_topology_t topo;
    assert_int_equal(hwloc_topology_init(&topo), 0);
    assert_int_equal(hwloc_topology_load(topo), 0);
    hwloc_bitmap_t b = parse_list(before);
    assert_int_equal(hwloc_set_cpubind(topo, b, HWLOC_CPUBIND_PROCESS), 0);
    hwloc_bitmap_free(b);
    hwloc_topology_destroy(topo);
}

/* A GPU hwloc cannot see: the sysfs local_cpulist fallback, then errors. */
static void test_bind_gpu_sysfs(void **state) {
    char root[] = "/tmp/fl_sysfs_XXXXXX", path[512], list[256], how[256], cur[256];
    assert_non_null(mkdtemp(root));
    const char *busid = "00ab:cd:1f.7"; /* not a device of any real machine */
    snprintf(path, sizeof path, "%s/bus", root);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/bus/pci", root);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/bus/pci/devices", root);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/bus/pci/devices/%s", root, busid);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/bus/pci/devices/%s/local_cpulist", root, busid);

    /* the GPU's CPUs: the first allowed one (so the test works anywhere) */
    assert_int_equal(fl_par_bind_current(cur, sizeof cur), FL_OK);
    hwloc_bitmap_t b = parse_list(cur);
    char first[16];
    snprintf(first, sizeof first, "%d", hwloc_bitmap_first(b));
    hwloc_bitmap_free(b);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", first);
    fclose(f);

    fl_par_bind_req r = {.mode = FL_PAR_BIND_AUTO, .local_rank = 0, .local_size = 4,
                         .gpu_busid = "00AB:CD:1F.7", .sysfs_root = root};
    assert_int_equal(fl_par_bind_plan(&r, list, sizeof list, how, sizeof how), FL_OK);
    assert_string_equal(list, first);
    assert_non_null(strstr(how, "sysfs"));

    /* malformed local_cpulist */
    f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "garbage\n");
    fclose(f);
    fl_error_clear();
    assert_int_equal(fl_par_bind_plan(&r, list, sizeof list, NULL, 0), FL_ERR_FORMAT);
    assert_non_null(strstr(fl_error_msg(), "local_cpulist"));

    /* a GPU neither hwloc nor sysfs knows */
    unlink(path);
    fl_error_clear();
    assert_int_equal(fl_par_bind_plan(&r, list, sizeof list, NULL, 0), FL_ERR_NOT_FOUND);
    assert_non_null(strstr(fl_error_msg(), "00ab:cd:1f.7"));
    r.gpu_busid = "not-a-bus-id";
    assert_int_equal(fl_par_bind_plan(&r, list, sizeof list, NULL, 0), FL_ERR_INVALID_ARG);

    snprintf(path, sizeof path, "rm -rf '%s'", root);
    assert_int_equal(system(path), 0);
}

static void test_gpu_busid_without_cuda(void **state) {
#ifndef FL_HAVE_NCCL
    char busid[16];
    assert_int_equal(fl_par_gpu_busid(0, busid, sizeof busid), FL_ERR_UNSUPPORTED);
    fl_comm *c = (fl_comm *)1;
    assert_int_equal(fl_comm_init_nccl(MPI_COMM_NULL, 0, NULL, &c), FL_ERR_UNSUPPORTED);
    assert_null(c);
#else
    skip();
#endif
}

static void test_hwloc_check_message(void **state) {
    fl_error_clear();
    assert_int_equal(fl_par_hwloc_error(EINVAL, "hwloc_set_cpubind(t, s, 0)", "x.c", 7),
                     FL_ERR_HWLOC);
    assert_string_equal(fl_error_msg(), "hwloc_set_cpubind(t, s, 0) failed: Invalid argument");
    assert_string_equal(fl_error_where(), "x.c:7");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_local_rank_env_order),
        cmocka_unit_test(test_local_rank_env_malformed),
        cmocka_unit_test(test_visible_gpus),
        cmocka_unit_test(test_gpu_index),
        cmocka_unit_test(test_local_ranks_valid),
        cmocka_unit_test(test_launch_plain_and_mpirun),
        cmocka_unit_test(test_launch_srun),
        cmocka_unit_test(test_launch_nested),
        cmocka_unit_test(test_launch_malformed),
        cmocka_unit_test(test_layout_ok),
        cmocka_unit_test(test_layout_refused),
        cmocka_unit_test(test_coords),
        cmocka_unit_test(test_experts),
        cmocka_unit_test(test_dtype),
        cmocka_unit_test(test_busid),
        cmocka_unit_test(test_bind_mode),
        cmocka_unit_test(test_bind_plan_disjoint),
        cmocka_unit_test(test_bind_apply_and_none),
        cmocka_unit_test(test_bind_gpu_sysfs),
        cmocka_unit_test(test_gpu_busid_without_cuda),
        cmocka_unit_test(test_hwloc_check_message),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
