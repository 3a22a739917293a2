/*
 * moe_dispatch.h — the bookkeeping of the MoE all-to-all exchange used when
 * data-parallel replicas (dp > 1) hold different tokens (docs/parallel.md,
 * "MoE all-to-all"): which routed (token, expert) pairs go to which
 * expert-parallel rank, in which order, and how a receiving rank groups what
 * it got by local expert.
 *
 * Pure functions on host arrays (no communication, no allocation), so the
 * counts, displacements and permutations are unit-tested on their own
 * (tests/test_moe_dispatch.c) and the forward pass (forward_moe.c) only
 * moves data along them.
 *
 * Order contract: the sender's slots are the (token, k) pairs sorted by
 * global expert id, stable in (token, k) order. Experts are owned in
 * contiguous ranges (parallel/groups.h, fl_par_expert_range), so this order
 * is also grouped by destination rank, and the weighted combine of the
 * returned rows adds each token's expert outputs in ascending expert order —
 * the order the single-rank path adds them in.
 */
#ifndef FL_MOE_DISPATCH_H
#define FL_MOE_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

/* Sender side. ids[n * k] are the router's picks (global expert ids in
 * [0, n_experts)), weights[n * k] their combine weights (may be NULL, then
 * slot_w is not written). n_experts must be divisible by ep. Writes, for the
 * n * k slots in send order: slot_row (the token, 0..n-1), slot_expert (the
 * global expert id), slot_w (the weight); send_counts[ep] and
 * send_displs[ep] in slots (rows) per destination ep rank. scratch holds
 * n_experts + 1 ints; on return scratch[e] is the end of expert e's slots
 * (its start is scratch[e - 1], or 0 for e = 0): within one expert's slots
 * every token appears at most once, so a scatter-add per expert never adds
 * twice into one row (the backends' scatter_add_rows contract). FL_ERR_INVALID_ARG when an id is out of range or the
 * sizes are inconsistent. n == 0 is allowed (all counts 0). */
fl_status fl_moe_dispatch_plan(int n, int k, const int32_t *ids, const float *weights,
                               int n_experts, int ep, int32_t *slot_row, int32_t *slot_expert,
                               float *slot_w, size_t *send_counts, size_t *send_displs,
                               int32_t *scratch);

/* displs[i] = counts[0] + ... + counts[i-1]; returns the total. */
size_t fl_moe_displs(const size_t *counts, int n, size_t *displs);

/* Receiver side. recv_expert[n_recv] are the global expert ids of the rows
 * received (in receive order); each must be one of this rank's experts
 * [expert_lo, expert_lo + n_local). Writes order[n_recv] (receive rows
 * grouped by local expert, stable) and expert_start[n_local + 1] (local
 * expert j's rows are order[expert_start[j] .. expert_start[j + 1])).
 * FL_ERR_INVALID_ARG names an expert this rank does not own. */
fl_status fl_moe_dispatch_local(int n_recv, const int32_t *recv_expert, int expert_lo, int n_local,
                                int32_t *order, int32_t *expert_start);

/* The rows [*lo, *lo + *count) of an n-row batch that tp rank tp_rank
 * dispatches: each token of a replica is sent by exactly one of its tp
 * ranks (balanced; the first n % tp ranks get one more row). */
void fl_moe_row_slice(int n, int tp, int tp_rank, int *lo, int *count);

#endif /* FL_MOE_DISPATCH_H */
