/*
 * rank.h — who am I: world rank/size from MPI, the local (per-node) rank and
 * the GPU this rank drives.
 *
 * The local rank comes from the launcher's environment when it sets one
 * (OMPI_COMM_WORLD_LOCAL_RANK for Open MPI's mpirun, SLURM_LOCALID for srun,
 * MPI_LOCALRANKID for MPICH/Hydra), otherwise from the rank's position in
 * MPI_Comm_split_type(MPI_COMM_TYPE_SHARED). The environment is read into a
 * plain struct first so the parsing is a pure function that tests can call
 * without MPI.
 *
 * Whether to start MPI at all is decided before MPI_Init, from the same kind
 * of variables (fl_par_launch_from_env): Open MPI's mpirun and PMIx launchers
 * say so directly; an srun step with more than one task (SLURM_STEP_ID set,
 * SLURM_STEP_NUM_TASKS > 1) means MPI too, even when the step was started
 * without --mpi=pmix, so that a misconfigured launch fails in MPI_Init (or in
 * fl_par_launch_check) instead of running N independent copies of the job
 * that all write the same output. The batch script itself (SLURM_NTASKS set,
 * no SLURM_STEP_ID) is not a launch. A launcher nested in a step (mpirun
 * inside an allocation starts its daemons with srun, so the ranks inherit
 * that step's SLURM_* variables) is recognized and the Slurm variables are
 * then ignored: OMPI_COMM_WORLD_SIZE set, a PMIx namespace not Slurm's, or a
 * PMI_RANK other than SLURM_PROCID.
 *
 * GPU choice: without CUDA_VISIBLE_DEVICES, local rank L drives device L.
 * When CUDA_VISIBLE_DEVICES lists n ids, the CUDA runtime renumbers them
 * 0..n-1, so L drives device L % n (several ranks share a GPU when a node has
 * more ranks than visible GPUs). CUDA_VISIBLE_DEVICES="" means no GPU (-1).
 */
#ifndef FL_PAR_RANK_H
#define FL_PAR_RANK_H

#include <mpi.h>

#include "core/status.h"

/* The launcher variables rank discovery reads; NULL = unset. The strings are
 * borrowed (from the environment or a test), never freed. */
typedef struct fl_par_rank_env {
    const char *ompi_local_rank;       /* OMPI_COMM_WORLD_LOCAL_RANK */
    const char *slurm_localid;         /* SLURM_LOCALID */
    const char *mpich_local_rank;      /* MPI_LOCALRANKID */
    const char *cuda_visible_devices;  /* CUDA_VISIBLE_DEVICES */
} fl_par_rank_env;

/* Where the local rank came from. */
typedef enum fl_par_local_src {
    FL_PAR_LOCAL_SRC_NONE = 0,   /* no variable set */
    FL_PAR_LOCAL_SRC_OMPI,
    FL_PAR_LOCAL_SRC_SLURM,
    FL_PAR_LOCAL_SRC_MPICH,
    FL_PAR_LOCAL_SRC_MPI_SHARED, /* MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) */
} fl_par_local_src;

/* Name of a source for messages ("OMPI_COMM_WORLD_LOCAL_RANK"). Never NULL. */
const char *fl_par_local_src_name(fl_par_local_src src);

typedef struct fl_par_rank_info {
    int world_rank, world_size;
    int local_rank, local_size;  /* on this node */
    int node_index, n_nodes;     /* nodes numbered by their lowest world rank */
    fl_par_local_src local_src;
    int n_visible_gpus;          /* entries of CUDA_VISIBLE_DEVICES; -1 when unset */
    int gpu;                     /* CUDA device index to use; -1 = none visible */
} fl_par_rank_info;

/* Fills env from the process environment (fl_opt_external, core/option.h).
 * Pure apart from that read. */
void fl_par_rank_env_read(fl_par_rank_env *env);

/* Pure: the local rank the launcher variables give, in the order OMPI, SLURM,
 * MPICH. *src = FL_PAR_LOCAL_SRC_NONE and *local_rank = -1 when none is set
 * (not an error). A set but malformed value ("", "x", "-1", "3a") is
 * FL_ERR_INVALID_ARG naming the variable and its value. */
fl_status fl_par_local_rank_from_env(const fl_par_rank_env *env, int *local_rank,
                                     fl_par_local_src *src);

/* Pure: counts the entries of a CUDA_VISIBLE_DEVICES value: comma-separated
 * device ordinals ("0,3") or UUIDs ("GPU-…", "MIG-…"). cvd NULL → *count = -1
 * (unset); "" → 0. An empty or malformed entry ("0,,1", "x") is
 * FL_ERR_INVALID_ARG naming the value. */
fl_status fl_par_visible_gpus_count(const char *cvd, int *count);

/* Pure: the CUDA device index for local_rank (see the file comment).
 * n_visible: fl_par_visible_gpus_count's result (-1 = unset). *gpu = -1 when
 * no GPU is visible. local_rank < 0 is FL_ERR_INVALID_ARG. */
fl_status fl_par_gpu_index(int local_rank, int n_visible, int *gpu);

/* Pure: true when local_ranks[0..n) is a permutation of 0..n-1, i.e. the
 * environment's local ranks of the ranks of one node are usable. (A stale
 * SLURM_LOCALID=0 on every rank under a nested mpirun is not.) */
int fl_par_local_ranks_valid(const int *local_ranks, int n);

/* The variables that say how this process was started; NULL = unset.
 * Borrowed strings, as in fl_par_rank_env. */
typedef struct fl_par_launch_env {
    const char *ompi_world_size;   /* OMPI_COMM_WORLD_SIZE (mpirun) */
    const char *pmix_rank;         /* PMIX_RANK (a PMIx launcher: prterun, srun --mpi=pmix) */
    const char *pmix_namespace;    /* PMIX_NAMESPACE ("slurm.pmix.JOB.STEP" under srun) */
    const char *pmi_rank;          /* PMI_RANK (Hydra, srun --mpi=pmi2) */
    const char *pmi_size;          /* PMI_SIZE */
    const char *slurm_step_id;     /* SLURM_STEP_ID: set only in the tasks of an srun step */
    const char *slurm_procid;      /* SLURM_PROCID */
    const char *slurm_step_ntasks; /* SLURM_STEP_NUM_TASKS, else SLURM_NTASKS */
} fl_par_launch_env;

/* How the process was started. */
typedef struct fl_par_launch {
    int use_mpi;                  /* call MPI_Init */
    int slurm_rank, slurm_size;   /* from SLURM_PROCID and the step's task count when this
                                     is a task of an srun step; -1 otherwise */
} fl_par_launch;

/* Fills env from the process environment (fl_opt_external). */
void fl_par_launch_env_read(fl_par_launch_env *env);

/* Pure: whether to call MPI_Init (see the file comment). Outside an srun
 * step, or under a launcher nested in one, the Slurm variables are ignored. In a step, a malformed SLURM_PROCID
 * or task count, or SLURM_PROCID >= the task count, is FL_ERR_INVALID_ARG
 * naming the variable and its value; out is then use_mpi 0, -1, -1. */
fl_status fl_par_launch_from_env(const fl_par_launch_env *env, fl_par_launch *out);

/* Pure: after MPI_Init, checks that MPI's world agrees with srun's tasks
 * (nothing to check outside an srun step). A world of 1 in a step of N > 1
 * tasks means srun had no PMI plug-in Open MPI understands: the message says
 * to use srun --mpi=pmix. FL_ERR_INVALID_ARG on any mismatch. */
fl_status fl_par_launch_check(const fl_par_launch *l, int mpi_rank, int mpi_size);

/* Collective over world (every rank of it must call): fills *info. The local
 * rank from env is used when every rank of the node got a consistent one;
 * otherwise the rank's index within its MPI_COMM_TYPE_SHARED communicator.
 * env NULL reads the process environment. Synchronizes the node's ranks. */
fl_status fl_par_rank_discover(MPI_Comm world, const fl_par_rank_env *env,
                               fl_par_rank_info *info);

#endif /* FL_PAR_RANK_H */
