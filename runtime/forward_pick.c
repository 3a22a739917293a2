/*
 * forward_pick.c — greedy steps: the argmax token of each projected row,
 * found where the logits are.
 *
 * A greedy step needs one id per row, not the vocabulary: on one GPU
 * downloading 16 rows of a 128k vocabulary (4 MB of bf16, converted to f32
 * and scanned on one host core) costs milliseconds, more than the argmax
 * kernel by far. Each rank takes the argmax of its vocabulary shard
 * (argmax_rows: value and global id per row), the (value, id) pairs are
 * all-gathered over the tensor-parallel group (8 bytes per row per rank
 * instead of the whole shard), and the host picks per row the largest
 * value, the lowest id on ties: exactly the sampler's greedy choice over the
 * same logits (shards are in id order, each shard's pick is its lowest id).
 * A NaN anywhere in a row is reported as the sampler reports it.
 */
#include <math.h>
#include <stdlib.h>

#include "runtime/forward_impl.h"

fl_status fl_forward_pick_init(fl_forward *f) {
    fl_backend *be = f->m->be;
    const int size = f->comm ? fl_comm_size(f->comm) : 1;
    const size_t pairs = (size_t)f->lim.max_logits * 2;
    FL_TRY(be->ops->alloc(be, pairs * sizeof(float), (void **)&f->d_pick));
    if (f->comm && fl_comm_backend_of(f->comm) != FL_COMM_BACKEND_MPI)
        FL_TRY(be->ops->alloc(be, pairs * size * sizeof(float), (void **)&f->d_pick_all));
    f->h_pick = malloc(pairs * (size + 1) * sizeof(float));
    if (!f->h_pick) return FL_ERR(FL_ERR_OOM, "out of memory");
    return FL_OK;
}

void fl_forward_pick_free(fl_forward *f) {
    fl_backend *be = f->m->be;
    if (f->d_pick) be->ops->free(be, f->d_pick);
    if (f->d_pick_all) be->ops->free(be, f->d_pick_all);
    free(f->h_pick);
}

fl_status fl_forward_pick_greedy(fl_forward *f, int rows, int32_t *ids) {
    fl_backend *be = f->m->be;
    const int V = f->m->cfg.vocab_size, Vl = f->m->dims.vocab;
    const int size = f->comm ? fl_comm_size(f->comm) : 1;
    if (!be->ops->argmax_rows)
        return FL_ERR(FL_ERR_UNSUPPORTED, "backend %s has no argmax_rows for greedy steps", be->name);
    FL_TRY(be->ops->argmax_rows(be, f->logits, rows, Vl, f->m->dims.vocab_lo, f->d_pick));
    const size_t n2 = (size_t)rows * 2;
    float *all = f->h_pick;
    if (!f->comm || size == 1) {
        if (!ids) return be->ops->sync(be);
        FL_TRY(be->ops->download(be, all, f->d_pick, n2 * sizeof(float)));
    } else {
        for (int r = 0; r < size; r++) f->gather_counts[r] = n2;
        if (fl_comm_backend_of(f->comm) == FL_COMM_BACKEND_MPI) {
            float *mine = f->h_pick + (size_t)size * f->lim.max_logits * 2;
            FL_TRY(be->ops->download(be, mine, f->d_pick, n2 * sizeof(float)));
            FL_TRY(fl_comm_all_gather(f->comm, mine, all, f->gather_counts, FL_COMM_F32));
        } else {
            if (!f->comm_inline) FL_TRY(be->ops->sync(be));
            FL_TRY(fl_comm_all_gather(f->comm, f->d_pick, f->d_pick_all, f->gather_counts, FL_COMM_F32));
            if (!f->comm_inline) FL_TRY(fl_comm_sync(f->comm));
            if (!ids) return be->ops->sync(be);
            FL_TRY(be->ops->download(be, all, f->d_pick_all, n2 * size * sizeof(float)));
        }
    }
    if (!ids) return FL_OK;
    for (int i = 0; i < rows; i++) {
        float best = -INFINITY;
        int id = -1;
        for (int r = 0; r < size; r++) {
            const float v = all[(size_t)r * n2 + 2 * (size_t)i], at = all[(size_t)r * n2 + 2 * (size_t)i + 1];
            if (isnan(v))
                return FL_ERR(FL_ERR_INVALID_ARG, "logits contain NaN (row %d, vocabulary shard %d of %d)", i,
                              r, size);
            if (id < 0 || v > best) best = v, id = (int)at; /* equal: the earlier shard's lower id stays */
        }
        if (id < 0 || id >= V) return FL_ERR(FL_ERR_INTERNAL, "greedy pick: token %d of %d", id, V);
        ids[i] = id;
    }
    return FL_OK;
}
