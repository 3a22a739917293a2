/*
 * cpu_moe.c — the CPU backend's device-routed expert ops (moe_group,
 * moe_matmul, moe_combine; contracts in kernels/backend.h). They are the
 * reference the CUDA kernels are tested against, and let the CI run the
 * device-routed MoE path (runtime/model/forward_moe_dev.c) end to end.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

fl_status fl_cpu_moe_group(fl_backend *b, const int32_t *ids, int n, int k, int e_lo, int n_local,
                           int32_t *list) {
    (void)b;
    if (n < 0 || k < 1 || n_local < 1)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_group: %d rows, top-%d, %d local experts", n, k, n_local);
    int32_t *start = list, *pairs = list + n_local + 1;
    memset(start, 0, ((size_t)n_local + 1) * sizeof *start);
    for (int p = 0; p < n * k; p++) {
        const int j = ids[p] - e_lo;
        if (j >= 0 && j < n_local) start[j + 1]++;
    }
    for (int j = 0; j < n_local; j++) start[j + 1] += start[j]; /* start[j]: where j's pairs begin */
    /* place in pair order: ascending within each expert */
    int *at = malloc((size_t)n_local * sizeof *at);
    if (!at) return FL_ERR(FL_ERR_OOM, "moe_group: out of memory");
    memcpy(at, start, (size_t)n_local * sizeof *at);
    for (int p = 0; p < n * k; p++) {
        const int j = ids[p] - e_lo;
        if (j >= 0 && j < n_local) pairs[at[j]++] = p;
    }
    free(at);
    return FL_OK;
}

fl_status fl_cpu_moe_matmul(fl_backend *b, const void *x, int x_per_pair, int n, int k, const int32_t *list,
                            int n_local, const fl_tensor *table, const fl_tensor *w0, void *out) {
    if (!w0 || w0->ndim != 2)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_matmul: the expert weight must be 2-D");
    if (n == 0) return FL_OK; /* probe: the CPU matmul runs every weight dtype */
    const int64_t rows = w0->shape[0], in = w0->shape[1];
    const int32_t *pairs = list + n_local + 1;
    int max_ne = 0;
    for (int j = 0; j < n_local; j++)
        if (list[j + 1] - list[j] > max_ne) max_ne = list[j + 1] - list[j];
    if (max_ne == 0) return FL_OK;
    fl_status st = FL_OK;
    float *xs = malloc((size_t)max_ne * in * sizeof(float));
    float *ys = malloc((size_t)max_ne * rows * sizeof(float));
    FL_CHECK_ALLOC(xs, st, done);
    FL_CHECK_ALLOC(ys, st, done);
    for (int j = 0; j < n_local; j++) {
        const int lo = list[j], ne = list[j + 1] - lo;
        if (ne == 0) continue;
        for (int i = 0; i < ne; i++) {
            const int p = pairs[lo + i], r = x_per_pair ? p : p / k;
            memcpy(xs + (int64_t)i * in, (const float *)x + (int64_t)r * in, (size_t)in * sizeof(float));
        }
        FL_TRY_GOTO(fl_cpu_matmul(b, xs, ne, &table[j], NULL, ys), st, done);
        for (int i = 0; i < ne; i++)
            memcpy((float *)out + (int64_t)pairs[lo + i] * rows, ys + (int64_t)i * rows,
                   (size_t)rows * sizeof(float));
    }
done:
    free(xs);
    free(ys);
    return st;
}

fl_status fl_cpu_moe_combine(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                             const float *weights, int n, int k, int e_lo, int n_local, int d) {
    (void)b;
    if (k < 1 || k > 64) return FL_ERR(FL_ERR_INVALID_ARG, "moe_combine: top-%d (at most 64)", k);
    for (int i = 0; i < n; i++) {
        int slot[64], m = 0;
        for (int j = 0; j < k; j++) { /* this token's local pairs, by ascending expert */
            const int e = ids[i * k + j];
            if (e < e_lo || e >= e_lo + n_local) continue;
            int at = m++;
            while (at > 0 && ids[i * k + slot[at - 1]] > e) {
                slot[at] = slot[at - 1];
                at--;
            }
            slot[at] = j;
        }
        float *o = (float *)acc + (int64_t)i * d;
        memset(o, 0, (size_t)d * sizeof *o);
        for (int s = 0; s < m; s++) {
            const int p = i * k + slot[s];
            const float c = weights[p], *r = (const float *)src + (int64_t)p * d;
            for (int t = 0; t < d; t++) o[t] += c * r[t];
        }
    }
    return FL_OK;
}

/* The three ops in order: the reference for the fused GPU kernel. */
fl_status fl_cpu_moe_combine_add_rmsnorm(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                                         const float *weights, int n, int k, int e_lo, int n_local, int d,
                                         const void *extra, void *x, const fl_tensor *w, float eps, void *out) {
    FL_TRY(fl_cpu_moe_combine(b, acc, src, ids, weights, n, k, e_lo, n_local, d));
    if (extra) FL_TRY(fl_cpu_add(b, acc, extra, (size_t)n * (size_t)d));
    return fl_cpu_add_rmsnorm(b, x, acc, w, eps, n, d, out);
}
