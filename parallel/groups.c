/*
 * groups.c — layout checks, group coordinate math and the MPI process
 * groups (see groups.h for the rank order and why).
 */
#include "parallel/groups.h"

#include <stdlib.h>

#include "parallel/check.h"

struct fl_par_groups {
    fl_par_layout layout;
    fl_par_coords coords;
    MPI_Comm comm[FL_PAR_GROUP_COUNT];
};

fl_status fl_par_layout_check(fl_par_layout *l, const fl_par_shape *s) {
    if (l->world < 1) return FL_ERR(FL_ERR_INVALID_ARG, "world size %d must be >= 1", l->world);
    if (l->tp < 1) return FL_ERR(FL_ERR_INVALID_ARG, "tp %d must be >= 1", l->tp);
    if (l->dp < 0) return FL_ERR(FL_ERR_INVALID_ARG, "dp %d must be >= 1 (or 0 for world / tp)", l->dp);
    if (l->ep < 0) return FL_ERR(FL_ERR_INVALID_ARG, "ep %d must be >= 1 (or 0 for 1)", l->ep);
    if (l->world % l->tp)
        return FL_ERR(FL_ERR_INVALID_ARG, "world size %d is not divisible by tp %d", l->world, l->tp);
    if (l->dp == 0) l->dp = l->world / l->tp;
    if (l->ep == 0) l->ep = 1;
    if ((long)l->tp * l->dp != l->world)
        return FL_ERR(FL_ERR_INVALID_ARG, "tp %d x dp %d = %ld does not equal world size %d",
                      l->tp, l->dp, (long)l->tp * l->dp, l->world);
    if (l->world % l->ep)
        return FL_ERR(FL_ERR_INVALID_ARG, "world size %d is not divisible by ep %d", l->world, l->ep);
    if (!s) return FL_OK;
    if (s->n_heads < 0 || s->n_kv_heads < 0 || s->n_experts < 0 || s->intermediate < 0)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "negative model size (n_heads %d, n_kv_heads %d, n_experts %d, "
                      "intermediate %d)",
                      s->n_heads, s->n_kv_heads, s->n_experts, s->intermediate);
    if (s->n_heads % l->tp)
        return FL_ERR(FL_ERR_INVALID_ARG, "n_heads %d is not divisible by tp %d", s->n_heads, l->tp);
    if (s->n_kv_heads > 0 && s->n_kv_heads % l->tp && l->tp % s->n_kv_heads)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "n_kv_heads %d is not divisible by tp %d, and tp %d is not a multiple of "
                      "n_kv_heads %d (KV heads can only be split or replicated evenly)",
                      s->n_kv_heads, l->tp, l->tp, s->n_kv_heads);
    if (s->intermediate % l->tp)
        return FL_ERR(FL_ERR_INVALID_ARG, "intermediate size %d is not divisible by tp %d",
                      s->intermediate, l->tp);
    if (s->n_experts == 0 && l->ep > 1)
        return FL_ERR(FL_ERR_INVALID_ARG, "ep %d > 1 but the model has no experts (dense model)",
                      l->ep);
    if (s->n_experts % l->ep)
        return FL_ERR(FL_ERR_INVALID_ARG, "n_experts %d is not divisible by ep %d", s->n_experts,
                      l->ep);
    return FL_OK;
}

fl_par_coords fl_par_coords_of(const fl_par_layout *l, int rank) {
    fl_par_coords c = {
        .rank = rank,
        .tp_rank = rank % l->tp,
        .dp_rank = rank / l->tp,
        .ep_rank = rank % l->ep,
        .ep_group = rank / l->ep,
    };
    return c;
}

int fl_par_tp_peer(const fl_par_layout *l, int dp_rank, int tp_rank) {
    return dp_rank * l->tp + tp_rank;
}

void fl_par_expert_range(int n_experts, int ep, int ep_rank, int *first, int *count) {
    *count = n_experts / ep;
    *first = ep_rank * *count;
}

int fl_par_expert_owner(int n_experts, int ep, int e) { return e / (n_experts / ep); }

fl_status fl_par_groups_init(MPI_Comm world, const fl_par_layout *layout_in,
                             const fl_par_shape *shape, fl_par_groups **out) {
    fl_status st = FL_OK;
    MPI_Comm cart = MPI_COMM_NULL;
    *out = NULL;
    fl_par_groups *g = calloc(1, sizeof *g);
    FL_CHECK_ALLOC(g, st, fail);
    for (int k = 0; k < FL_PAR_GROUP_COUNT; k++) g->comm[k] = MPI_COMM_NULL;
    g->layout = *layout_in;
    int size = 0, rank = 0;
    FL_MPI_CHECK_GOTO(MPI_Comm_size(world, &size), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_rank(world, &rank), st, fail);
    if (g->layout.world != size) {
        st = FL_ERR(FL_ERR_INVALID_ARG,
                    "the layout is for world size %d but the job has %d ranks", g->layout.world,
                    size);
        goto fail;
    }
    /* Every rank checks the same layout, so all fail or none do: no rank is
     * left alone in the collective calls below. */
    FL_TRY_GOTO(fl_par_layout_check(&g->layout, shape), st, fail);
    g->coords = fl_par_coords_of(&g->layout, rank);

    FL_MPI_CHECK_GOTO(MPI_Comm_dup(world, &g->comm[FL_PAR_GROUP_WORLD]), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_set_errhandler(g->comm[FL_PAR_GROUP_WORLD], MPI_ERRORS_RETURN),
                      st, fail);
    /* Row-major cart: the last dimension (tp) varies fastest, which is the
     * rank order of groups.h; reorder = 0 keeps world ranks. */
    int dims[2] = {g->layout.dp, g->layout.tp}, periods[2] = {0, 0};
    FL_MPI_CHECK_GOTO(MPI_Cart_create(g->comm[FL_PAR_GROUP_WORLD], 2, dims, periods, 0, &cart),
                      st, fail);
    int keep_tp[2] = {0, 1}, keep_dp[2] = {1, 0};
    FL_MPI_CHECK_GOTO(MPI_Cart_sub(cart, keep_tp, &g->comm[FL_PAR_GROUP_TP]), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Cart_sub(cart, keep_dp, &g->comm[FL_PAR_GROUP_DP]), st, fail);
    FL_MPI_CHECK_GOTO(MPI_Comm_split(g->comm[FL_PAR_GROUP_WORLD], g->coords.ep_group,
                                     g->coords.ep_rank, &g->comm[FL_PAR_GROUP_EP]),
                      st, fail);
    for (int k = FL_PAR_GROUP_TP; k < FL_PAR_GROUP_COUNT; k++)
        FL_MPI_CHECK_GOTO(MPI_Comm_set_errhandler(g->comm[k], MPI_ERRORS_RETURN), st, fail);

    /* The cart's rank order is the contract; check it rather than trust it. */
    int tp_rank = -1, dp_rank = -1, ep_rank = -1;
    MPI_Comm_rank(g->comm[FL_PAR_GROUP_TP], &tp_rank);
    MPI_Comm_rank(g->comm[FL_PAR_GROUP_DP], &dp_rank);
    MPI_Comm_rank(g->comm[FL_PAR_GROUP_EP], &ep_rank);
    if (tp_rank != g->coords.tp_rank || dp_rank != g->coords.dp_rank ||
        ep_rank != g->coords.ep_rank) {
        st = FL_ERR(FL_ERR_INTERNAL,
                    "rank %d: group ranks tp %d dp %d ep %d differ from the layout's %d %d %d",
                    rank, tp_rank, dp_rank, ep_rank, g->coords.tp_rank, g->coords.dp_rank,
                    g->coords.ep_rank);
        goto fail;
    }
    MPI_Comm_free(&cart);
    *out = g;
    return FL_OK;
fail:
    if (cart != MPI_COMM_NULL) MPI_Comm_free(&cart);
    fl_par_groups_free(g);
    return st;
}

void fl_par_groups_free(fl_par_groups *g) {
    if (!g) return;
    for (int k = 0; k < FL_PAR_GROUP_COUNT; k++)
        if (g->comm[k] != MPI_COMM_NULL) MPI_Comm_free(&g->comm[k]);
    free(g);
}

const fl_par_layout *fl_par_groups_layout(const fl_par_groups *g) { return &g->layout; }
const fl_par_coords *fl_par_groups_coords(const fl_par_groups *g) { return &g->coords; }

MPI_Comm fl_par_groups_comm(const fl_par_groups *g, fl_par_group_kind kind) {
    if ((unsigned)kind >= FL_PAR_GROUP_COUNT) return MPI_COMM_NULL;
    return g->comm[kind];
}
