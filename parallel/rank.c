/*
 * rank.c — rank discovery: world rank/size, local rank (launcher variables
 * cross-checked against the node's shared-memory communicator), the GPU
 * index, and whether the launcher wants MPI at all (mpirun, PMIx, srun).
 * See rank.h for the rules and why they are what they are.
 */
#include "parallel/rank.h"

#include <ctype.h>
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "parallel/check.h"

const char *fl_par_local_src_name(fl_par_local_src src) {
    switch (src) {
    case FL_PAR_LOCAL_SRC_OMPI: return "OMPI_COMM_WORLD_LOCAL_RANK";
    case FL_PAR_LOCAL_SRC_SLURM: return "SLURM_LOCALID";
    case FL_PAR_LOCAL_SRC_MPICH: return "MPI_LOCALRANKID";
    case FL_PAR_LOCAL_SRC_MPI_SHARED: return "MPI_COMM_TYPE_SHARED";
    case FL_PAR_LOCAL_SRC_NONE: break;
    }
    return "none";
}

void fl_par_rank_env_read(fl_par_rank_env *env) {
    env->ompi_local_rank = fl_opt_external("OMPI_COMM_WORLD_LOCAL_RANK");
    env->slurm_localid = fl_opt_external("SLURM_LOCALID");
    env->mpich_local_rank = fl_opt_external("MPI_LOCALRANKID");
    env->cuda_visible_devices = fl_opt_external("CUDA_VISIBLE_DEVICES");
}

/* Strict decimal parse of a whole string into [0, INT_MAX]: no sign, no
 * spaces, no trailing junk (strtol alone accepts " 3" and "3a"). */
static int parse_nonneg(const char *s, int *out) {
    if (!s || !*s) return 0;
    long v = 0;
    for (const char *p = s; *p; p++) {
        if (!isdigit((unsigned char)*p)) return 0;
        v = v * 10 + (*p - '0');
        if (v > INT_MAX) return 0;
    }
    *out = (int)v;
    return 1;
}

fl_status fl_par_local_rank_from_env(const fl_par_rank_env *env, int *local_rank,
                                     fl_par_local_src *src) {
    struct { const char *value; fl_par_local_src src; } order[] = {
        {env->ompi_local_rank, FL_PAR_LOCAL_SRC_OMPI},
        {env->slurm_localid, FL_PAR_LOCAL_SRC_SLURM},
        {env->mpich_local_rank, FL_PAR_LOCAL_SRC_MPICH},
    };
    *local_rank = -1;
    *src = FL_PAR_LOCAL_SRC_NONE;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        if (!order[i].value) continue;
        if (!parse_nonneg(order[i].value, local_rank)) {
            *local_rank = -1;
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "environment variable %s='%s' is not a non-negative integer local rank",
                          fl_par_local_src_name(order[i].src), order[i].value);
        }
        *src = order[i].src;
        return FL_OK;
    }
    return FL_OK;
}

/* One CUDA_VISIBLE_DEVICES entry: an ordinal, or a GPU-/MIG- UUID form. */
static int cvd_entry_ok(const char *s, size_t n) {
    if (n == 0) return 0;
    if ((n > 4 && !strncmp(s, "GPU-", 4)) || (n > 4 && !strncmp(s, "MIG-", 4))) {
        for (size_t i = 4; i < n; i++)
            if (!isxdigit((unsigned char)s[i]) && s[i] != '-' && s[i] != '/') return 0;
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        if (!isdigit((unsigned char)s[i])) return 0;
    return 1;
}

fl_status fl_par_visible_gpus_count(const char *cvd, int *count) {
    *count = -1;
    if (!cvd) return FL_OK;
    if (!*cvd) {
        *count = 0;
        return FL_OK;
    }
    int n = 0;
    const char *p = cvd;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (!cvd_entry_ok(p, len))
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "CUDA_VISIBLE_DEVICES='%s': entry %d is not a device ordinal or a "
                          "GPU-/MIG- UUID",
                          cvd, n + 1);
        n++;
        if (!comma) break;
        p = comma + 1;
    }
    *count = n;
    return FL_OK;
}

fl_status fl_par_gpu_index(int local_rank, int n_visible, int *gpu) {
    *gpu = -1;
    if (local_rank < 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "local rank %d is negative", local_rank);
    if (n_visible == 0) return FL_OK;
    *gpu = n_visible < 0 ? local_rank : local_rank % n_visible;
    return FL_OK;
}

int fl_par_local_ranks_valid(const int *local_ranks, int n) {
    if (n <= 0) return 0;
    unsigned char *seen = calloc((size_t)n, 1);
    if (!seen) return 0;
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
        int r = local_ranks[i];
        if (r < 0 || r >= n || seen[r]) ok = 0;
        else seen[r] = 1;
    }
    free(seen);
    return ok;
}

void fl_par_launch_env_read(fl_par_launch_env *env) {
    env->ompi_world_size = fl_opt_external("OMPI_COMM_WORLD_SIZE");
    env->pmix_rank = fl_opt_external("PMIX_RANK");
    env->pmix_namespace = fl_opt_external("PMIX_NAMESPACE");
    env->pmi_rank = fl_opt_external("PMI_RANK");
    env->pmi_size = fl_opt_external("PMI_SIZE");
    env->slurm_step_id = fl_opt_external("SLURM_STEP_ID");
    env->slurm_procid = fl_opt_external("SLURM_PROCID");
    env->slurm_step_ntasks = fl_opt_external("SLURM_STEP_NUM_TASKS");
    if (!env->slurm_step_ntasks) env->slurm_step_ntasks = fl_opt_external("SLURM_NTASKS");
}

fl_status fl_par_launch_from_env(const fl_par_launch_env *env, fl_par_launch *out) {
    out->use_mpi = 0;
    out->slurm_rank = out->slurm_size = -1;
    /* srun sets SLURM_STEP_ID in a step's tasks only; the batch script has
     * SLURM_PROCID=0 and the job's SLURM_NTASKS but is one process. Under a
     * nested launcher the SLURM_* variables describe its daemons' step.
     * The test uses values every rank shares (a world size against the
     * step's task count), so that all ranks decide alike: a per-rank test
     * (PMI_RANK == SLURM_PROCID) can hold on one rank of a Hydra job whose
     * proxies srun started and fail on the others. */
    const char *step_n = env->slurm_step_ntasks;
    bool nested = env->ompi_world_size ||
                  (env->pmix_rank && (!env->pmix_namespace ||
                                      strncmp(env->pmix_namespace, "slurm.pmix.", 11) != 0)) ||
                  (env->pmi_rank && (!env->pmi_size || !step_n || strcmp(env->pmi_size, step_n)));
    if (env->slurm_step_id && env->slurm_procid && !nested) {
        int rank = -1, size = -1;
        if (!parse_nonneg(env->slurm_procid, &rank))
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "environment variable SLURM_PROCID='%s' is not a non-negative integer",
                          env->slurm_procid);
        if (!env->slurm_step_ntasks || !parse_nonneg(env->slurm_step_ntasks, &size) || size < 1)
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "srun step (SLURM_STEP_ID=%s) without a valid task count: "
                          "SLURM_STEP_NUM_TASKS/SLURM_NTASKS='%s'",
                          env->slurm_step_id,
                          env->slurm_step_ntasks ? env->slurm_step_ntasks : "(unset)");
        if (rank >= size)
            return FL_ERR(FL_ERR_INVALID_ARG,
                          "SLURM_PROCID=%d is not below the step's task count %d", rank, size);
        out->slurm_rank = rank;
        out->slurm_size = size;
    }
    out->use_mpi = env->ompi_world_size || env->pmix_rank || env->pmi_rank || out->slurm_size > 1;
    return FL_OK;
}

fl_status fl_par_launch_check(const fl_par_launch *l, int mpi_rank, int mpi_size) {
    if (l->slurm_size < 0) return FL_OK;
    if (mpi_size == 1 && l->slurm_size > 1)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "srun started %d tasks but MPI sees each as a job of its own (world size 1): "
                      "launch with srun --mpi=pmix (see `srun --mpi=list`)",
                      l->slurm_size);
    if (mpi_size != l->slurm_size || mpi_rank != l->slurm_rank)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "MPI rank %d of %d disagrees with srun's SLURM_PROCID=%d of %d tasks",
                      mpi_rank, mpi_size, l->slurm_rank, l->slurm_size);
    return FL_OK;
}

fl_status fl_par_rank_discover(MPI_Comm world, const fl_par_rank_env *env_in,
                               fl_par_rank_info *info) {
    fl_status st = FL_OK;
    MPI_Comm node = MPI_COMM_NULL, leaders = MPI_COMM_NULL;
    int *all = NULL;
    fl_par_rank_env env_buf;
    const fl_par_rank_env *env = env_in;
    if (!env) {
        fl_par_rank_env_read(&env_buf);
        env = &env_buf;
    }
    memset(info, 0, sizeof *info);
    FL_MPI_CHECK_GOTO(MPI_Comm_rank(world, &info->world_rank), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_size(world, &info->world_size), st, fail);

    /* A malformed variable is reported, but only after the collective calls
     * below, so that one rank's bad environment cannot leave the others
     * waiting in MPI_Comm_split_type. */
    int env_local = -1;
    fl_par_local_src env_src = FL_PAR_LOCAL_SRC_NONE;
    fl_status env_st = fl_par_local_rank_from_env(env, &env_local, &env_src);

    FL_MPI_CHECK_GOTO(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, info->world_rank,
                                          MPI_INFO_NULL, &node),
                      st, fail);
    int node_rank = 0, node_size = 1;
    FL_MPI_CHECK_GOTO(MPI_Comm_rank(node, &node_rank), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_size(node, &node_size), st, fail);
    all = malloc((size_t)node_size * sizeof *all);
    FL_CHECK_ALLOC(all, st, fail);
    FL_MPI_CHECK_GOTO(MPI_Allgather(&env_local, 1, MPI_INT, all, 1, MPI_INT, node), st, fail);
    info->local_size = node_size;
    if (env_src != FL_PAR_LOCAL_SRC_NONE && fl_par_local_ranks_valid(all, node_size)) {
        info->local_rank = env_local;
        info->local_src = env_src;
    } else {
        info->local_rank = node_rank;
        info->local_src = FL_PAR_LOCAL_SRC_MPI_SHARED;
    }

    /* Node numbering: one leader per node (node rank 0), numbered in world
     * rank order; each node's leader tells its ranks. */
    FL_MPI_CHECK_GOTO(MPI_Comm_split(world, node_rank == 0 ? 0 : MPI_UNDEFINED,
                                     info->world_rank, &leaders),
                      st, fail);
    int ids[2] = {0, 1};
    if (leaders != MPI_COMM_NULL) {
        FL_MPI_CHECK_GOTO(MPI_Comm_rank(leaders, &ids[0]), st, fail);
        FL_MPI_CHECK_GOTO(MPI_Comm_size(leaders, &ids[1]), st, fail);
    }
    FL_MPI_CHECK_GOTO(MPI_Bcast(ids, 2, MPI_INT, 0, node), st, fail);
    info->node_index = ids[0];
    info->n_nodes = ids[1];

    if (env_st != FL_OK) {
        st = env_st;
        goto fail;
    }
    FL_TRY_GOTO(fl_par_visible_gpus_count(env->cuda_visible_devices, &info->n_visible_gpus), st,
                fail);
    FL_TRY_GOTO(fl_par_gpu_index(info->local_rank, info->n_visible_gpus, &info->gpu), st, fail);
fail:
    free(all);
    if (leaders != MPI_COMM_NULL) MPI_Comm_free(&leaders);
    if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
    return st;
}
