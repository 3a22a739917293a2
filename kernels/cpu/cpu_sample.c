/*
 * cpu_sample.c — sample_rows on the CPU backend: the reference for the
 * GPU's, and what lets the engine's device-sampling route run (and be
 * tested) on machines without a GPU. Each row is core/sampler.c's
 * fl_sampler_sample_u over the row as it is; the NaN and all -inf rows are
 * reported as status words instead of errors, as a GPU has to.
 */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "core/sampler.h"
#include "kernels/pool.h"

fl_status fl_cpu_copy_2d(fl_backend *b, void *dst, int dst_stride, const void *src, int src_stride, int n,
                         int w) {
    (void)b;
    for (int i = 0; i < n; i++)
        memcpy((float *)dst + (size_t)i * dst_stride, (const float *)src + (size_t)i * src_stride,
               (size_t)w * sizeof(float));
    return FL_OK;
}

/* Rows sampled side by side, each thread with its own sampler workspace
 * (a 150k vocabulary costs 1.5-4 ms a row on one core: the whole step at
 * batch 16 on one thread). */
#define CPU_SAMPLE_SLOTS 8

size_t fl_cpu_sample_rows_ws(fl_backend *b, int n, int d) {
    (void)b;
    return (size_t)(n < CPU_SAMPLE_SLOTS ? (n > 0 ? n : 1) : CPU_SAMPLE_SLOTS) * fl_sampler_workspace_size(d);
}

/* One row: out2 = (token, 0), or (first NaN id, 1), or (0, 2). */
static fl_status sample_one(const fl_sample_row *r, const float *row, int d, const int32_t *hist, void *ws,
                            int32_t *out2) {
    const int32_t *h = r->penalty != 1.0f ? hist + r->hist_lo : NULL;
    const size_t nh = h ? (size_t)r->hist_n : 0;
    /* The first NaN and the max after the penalty, as the sampler sees
     * them (a penalty can take a finite logit to -inf); ws is free until
     * the sampler runs. */
    const float *pen = row;
    if (nh) {
        float *cp = ws;
        memcpy(cp, row, (size_t)d * sizeof(float));
        for (size_t j = 0; j < nh; j++)
            if (h[j] >= 0 && h[j] < d)
                cp[h[j]] = fl_sampler_penalize(row[h[j]], r->penalty);
        pen = cp;
    }
    int nan_at = -1;
    float m = -INFINITY;
    for (int j = 0; j < d && nan_at < 0; j++) {
        if (isnan(pen[j])) nan_at = j;
        m = pen[j] > m ? pen[j] : m;
    }
    if (nan_at >= 0) {
        out2[0] = nan_at, out2[1] = 1;
        return FL_OK;
    }
    if (r->temperature > 0.0f && m == -INFINITY) {
        out2[0] = 0, out2[1] = 2;
        return FL_OK;
    }
    const fl_sampling_params p = {
        .temperature = r->temperature, .top_k = r->top_k, .top_p = r->top_p, .min_p = r->min_p,
        .repetition_penalty = r->penalty, .seed = 0,
    };
    out2[1] = 0;
    return fl_sampler_sample_u(&p, row, d, h, nh, r->u, ws, &out2[0]);
}

typedef struct sample_job {
    const fl_sample_row *rows;
    const void *x;
    const int32_t *hist;
    void *ws;
    int32_t *out;
    int n, d;
    size_t per;
    atomic_int next; /* the first unclaimed row */
    atomic_int bad;  /* the first row that failed (n: none) */
} sample_job;

/* Workspace slots [lo, hi): each samples rows until none are left (a pool task). */
static void sample_slots(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    sample_job *j = ctx;
    for (int64_t k = lo; k < hi; k++) {
        void *mine = (char *)j->ws + (size_t)k * j->per;
        for (int i; (i = atomic_fetch_add(&j->next, 1)) < j->n;) {
            if (sample_one(&j->rows[i], (const float *)j->x + (size_t)i * j->d, j->d, j->hist, mine,
                           &j->out[2 * i]) == FL_OK)
                continue;
            int b = atomic_load(&j->bad);
            while (i < b && !atomic_compare_exchange_weak(&j->bad, &b, i)) {
            }
        }
    }
}

fl_status fl_cpu_sample_rows(fl_backend *b, const void *x, int n, int d, const fl_sample_row *rows,
                             const int32_t *hist, bool any_top_p, void *ws, int32_t *out) {
    (void)b;
    (void)any_top_p;
    if (d <= 0) return FL_ERR(FL_ERR_INVALID_ARG, "sample_rows: %d columns", d);
    if (n <= 0) return FL_OK;
    const int slots = n < CPU_SAMPLE_SLOTS ? n : CPU_SAMPLE_SLOTS;
    const size_t per = fl_sampler_workspace_size(d);
    sample_job j = {.rows = rows, .x = x, .hist = hist, .ws = ws, .out = out, .n = n, .d = d, .per = per,
                    .bad = n};
    /* slot k's workspace is used by one piece at a time; rows are claimed one by one */
    FL_TRY(fl_pool_for(slots, 1, sample_slots, &j));
    const int bad = atomic_load(&j.bad);
    /* again on this thread, for the failure's message */
    if (bad < n) return sample_one(&rows[bad], (const float *)x + (size_t)bad * d, d, hist, ws, &out[2 * bad]);
    return FL_OK;
}
