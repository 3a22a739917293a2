/*
 * moe_dispatch.c — counts, displacements and permutations of the MoE
 * all-to-all exchange (see moe_dispatch.h for the order contract and why).
 */
#include "runtime/model/moe_dispatch.h"

#include <string.h>

fl_status fl_moe_dispatch_plan(int n, int k, const int32_t *ids, const float *weights,
                               int n_experts, int ep, int32_t *slot_row, int32_t *slot_expert,
                               float *slot_w, size_t *send_counts, size_t *send_displs,
                               int32_t *scratch) {
    if (n < 0 || k < 1 || n_experts < 1 || ep < 1 || n_experts % ep)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe dispatch: %d rows, top-%d, %d experts over ep %d",
                      n, k, n_experts, ep);
    const int per = n_experts / ep, pairs = n * k;
    /* counting sort by expert: scratch[e + 1] counts, then prefix sums */
    memset(scratch, 0, ((size_t)n_experts + 1) * sizeof *scratch);
    for (int i = 0; i < pairs; i++) {
        if (ids[i] < 0 || ids[i] >= n_experts)
            return FL_ERR(FL_ERR_INVALID_ARG, "moe dispatch: row %d picked expert %d of %d", i / k,
                          ids[i], n_experts);
        scratch[ids[i] + 1]++;
    }
    for (int p = 0; p < ep; p++) {
        size_t c = 0;
        for (int e = p * per; e < (p + 1) * per; e++) c += (size_t)scratch[e + 1];
        send_counts[p] = c;
    }
    fl_moe_displs(send_counts, ep, send_displs);
    for (int e = 0; e < n_experts; e++) scratch[e + 1] += scratch[e];
    for (int i = 0; i < pairs; i++) {
        int at = scratch[ids[i]]++;
        slot_row[at] = i / k;
        slot_expert[at] = ids[i];
        if (weights) slot_w[at] = weights[i];
    }
    return FL_OK;
}

size_t fl_moe_displs(const size_t *counts, int n, size_t *displs) {
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        displs[i] = total;
        total += counts[i];
    }
    return total;
}

fl_status fl_moe_dispatch_local(int n_recv, const int32_t *recv_expert, int expert_lo, int n_local,
                                int32_t *order, int32_t *expert_start) {
    if (n_recv < 0 || n_local < 1)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe dispatch: %d rows received for %d local experts",
                      n_recv, n_local);
    memset(expert_start, 0, ((size_t)n_local + 1) * sizeof *expert_start);
    for (int i = 0; i < n_recv; i++) {
        int j = recv_expert[i] - expert_lo;
        if (j < 0 || j >= n_local)
            return FL_ERR(FL_ERR_INVALID_ARG, "moe dispatch: received row %d for expert %d, but "
                          "this rank holds experts %d..%d", i, recv_expert[i], expert_lo,
                          expert_lo + n_local - 1);
        expert_start[j + 1]++;
    }
    for (int j = 0; j < n_local; j++) expert_start[j + 1] += expert_start[j];
    /* place rows using expert_start[j] as a cursor, then shift the cursors back */
    for (int i = 0; i < n_recv; i++) order[expert_start[recv_expert[i] - expert_lo]++] = i;
    for (int j = n_local; j > 0; j--) expert_start[j] = expert_start[j - 1];
    expert_start[0] = 0;
    return FL_OK;
}

void fl_moe_row_slice(int n, int tp, int tp_rank, int *lo, int *count) {
    int base = n / tp, extra = n % tp;
    *count = base + (tp_rank < extra);
    *lo = tp_rank * base + (tp_rank < extra ? tp_rank : extra);
}
