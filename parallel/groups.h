/*
 * groups.h — the parallel layout (world = tp x dp, plus ep for MoE layers),
 * its divisibility checks, the rank → group coordinates, and the MPI process
 * groups built once from the world communicator.
 *
 * Rank order: tp varies fastest. World rank r has tp_rank = r % tp and
 * dp_rank = r / tp, so ranks 0..tp-1 form data-parallel replica 0's
 * tensor-parallel group (tensor-parallel peers sit on the same node when a
 * node's GPU count is a multiple of tp, which keeps the per-block reductions
 * on NVLink). Expert-parallel groups are likewise blocks of ep consecutive
 * ranks: ep_rank = r % ep, ep_group = r / ep; each of the world/ep groups
 * holds one full copy of the experts, partitioned over its ep ranks in
 * contiguous ranges.
 *
 * The layout and shape checks are pure (no MPI) so tests and the launcher can
 * refuse a layout before anything is loaded.
 */
#ifndef FL_PAR_GROUPS_H
#define FL_PAR_GROUPS_H

#include <mpi.h>

#include "core/status.h"

typedef struct fl_par_layout {
    int world;  /* number of ranks */
    int tp;     /* tensor-parallel group size */
    int dp;     /* data-parallel replicas; 0 = world / tp */
    int ep;     /* expert-parallel group size; 0 = 1 */
} fl_par_layout;

/* The model sizes that a layout must divide. 0 = not applicable (e.g.
 * n_experts 0 for a dense model, intermediate 0 to skip the MLP check). */
typedef struct fl_par_shape {
    int n_heads;       /* attention (query) heads: split over tp */
    int n_kv_heads;    /* split over tp, or replicated when tp > n_kv_heads
                          (then tp must be a multiple of n_kv_heads) */
    int n_experts;     /* routed experts: partitioned over ep */
    int intermediate;  /* dense MLP inner size: columns split over tp */
} fl_par_shape;

/* Pure. Fills dp (0 → world / tp) and ep (0 → 1) and checks every
 * divisibility rule; on failure FL_ERR_INVALID_ARG with a message naming the
 * numbers, e.g. "world size 6 is not divisible by tp 4". shape may be NULL
 * (layout-only check). Rules: all sizes >= 1; world % tp == 0;
 * tp * dp == world; world % ep == 0; n_heads % tp == 0; n_kv_heads % tp == 0
 * or tp % n_kv_heads == 0; n_experts % ep == 0; ep == 1 for dense models;
 * intermediate % tp == 0. */
fl_status fl_par_layout_check(fl_par_layout *layout, const fl_par_shape *shape);

/* A rank's coordinates in a (checked) layout. */
typedef struct fl_par_coords {
    int rank;
    int tp_rank, dp_rank;   /* rank == dp_rank * tp + tp_rank */
    int ep_rank, ep_group;  /* rank == ep_group * ep + ep_rank */
} fl_par_coords;

/* Pure: coordinates of rank in layout (checked; rank in [0, world)). */
fl_par_coords fl_par_coords_of(const fl_par_layout *layout, int rank);
/* Pure: world rank of the member tp_rank of data-parallel replica dp_rank. */
int fl_par_tp_peer(const fl_par_layout *layout, int dp_rank, int tp_rank);

/* Pure: the contiguous range of experts [*first, *first + *count) owned by
 * ep_rank when n_experts (divisible by ep) are split over ep ranks. */
void fl_par_expert_range(int n_experts, int ep, int ep_rank, int *first, int *count);
/* Pure: the ep_rank that owns expert e. */
int fl_par_expert_owner(int n_experts, int ep, int e);

/* Process groups: communicators built once. Opaque. */
typedef struct fl_par_groups fl_par_groups;

typedef enum fl_par_group_kind {
    FL_PAR_GROUP_WORLD = 0, /* a duplicate of the world communicator */
    FL_PAR_GROUP_TP,        /* this rank's tensor-parallel group (tp ranks) */
    FL_PAR_GROUP_DP,        /* same tp_rank across replicas (dp ranks) */
    FL_PAR_GROUP_EP,        /* this rank's expert-parallel group (ep ranks) */
    FL_PAR_GROUP_COUNT
} fl_par_group_kind;

/* Collective over world: checks the layout (layout->world must equal the
 * communicator's size) and builds the groups with MPI_Cart_create (dims
 * {dp, tp}, no reordering) / MPI_Cart_sub and MPI_Comm_split. Every rank
 * must pass the same layout. The communicators return errors
 * (MPI_ERRORS_RETURN) instead of aborting, so failures become statuses. */
fl_status fl_par_groups_init(MPI_Comm world, const fl_par_layout *layout,
                             const fl_par_shape *shape, fl_par_groups **out);
/* Collective (MPI_Comm_free on each group). NULL is a no-op. */
void fl_par_groups_free(fl_par_groups *g);

/* The checked layout (dp, ep filled) and this rank's coordinates. */
const fl_par_layout *fl_par_groups_layout(const fl_par_groups *g);
const fl_par_coords *fl_par_groups_coords(const fl_par_groups *g);
/* A group's communicator; owned by g (do not free). Rank numbering inside
 * it: tp group by tp_rank, dp group by dp_rank, ep group by ep_rank. */
MPI_Comm fl_par_groups_comm(const fl_par_groups *g, fl_par_group_kind kind);

#endif /* FL_PAR_GROUPS_H */
