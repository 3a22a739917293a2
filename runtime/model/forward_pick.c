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
 *
 * Sampled steps on one rank go the same way: the backend's sample_rows
 * computes the host sampler's token for each row with the draw the engine
 * took from the sequence's rng (fl_sampler_sample_u's contract), and only
 * the tokens come back. Under tensor parallelism the vocabulary shards are
 * gathered first (on the devices with NCCL, 2 bytes a logit, the same
 * gather the logits route makes), laid out as rows (copy_2d), and the
 * group's rank 0 samples them. Its buffers (a workspace of ~16 bytes per
 * logit of max_logits rows) are allocated at the first sampled step on the
 * rank that samples, so greedy jobs and the other ranks never hold them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/model/forward_impl.h"

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
    if (f->d_smp_rows) be->ops->free(be, f->d_smp_rows);
    if (f->d_smp_hist) be->ops->free(be, f->d_smp_hist);
    if (f->d_smp_out) be->ops->free(be, f->d_smp_out);
    if (f->d_smp_ws) be->ops->free(be, f->d_smp_ws);
    if (f->d_smp_x) be->ops->free(be, f->d_smp_x);
    free(f->h_smp_out);
    free(f->h_smp_x);
}

static fl_status sampled_buffers(fl_forward *f, size_t n_hist);

bool fl_forward_can_sample(fl_forward *f) {
    fl_backend *be = f->m->be;
    if (f->smp_can >= 0) return f->smp_can > 0; /* asked once: CUB's storage query is not free */
    f->smp_can = be->ops->sample_rows && be->ops->sample_rows_ws && be->ops->copy_2d &&
                 be->ops->sample_rows_ws(be, f->lim.max_logits, f->m->cfg.vocab_size) > 0;
    /* The buffers now, on the rank that asks (the one that samples), so
     * that a device without room for them keeps the logits route instead
     * of failing a step. */
    if (f->smp_can && sampled_buffers(f, 0) != FL_OK) {
        fprintf(stderr, "flotilla: sampling stays on the host: %s\n", fl_error_msg());
        fl_error_clear();
        f->smp_can = 0;
    }
    return f->smp_can > 0;
}

void fl_forward_set_sampling(fl_forward *f, const fl_sample_row *rows, int n, const int32_t *hist,
                             size_t n_hist) {
    f->smp_rows = rows;
    f->smp_n = n;
    f->smp_hist = hist;
    f->smp_n_hist = n_hist;
}

/* The sampling rank's buffers, all or none (a failed step leaves nothing
 * half made for the next). */
static fl_status sampled_buffers(fl_forward *f, size_t n_hist) {
    fl_backend *be = f->m->be;
    const size_t rows = (size_t)f->lim.max_logits;
    if (!f->d_smp_rows) {
        const int V = f->m->cfg.vocab_size;
        const bool tp = f->comm && fl_comm_size(f->comm) > 1;
        const bool mpi = tp && fl_comm_backend_of(f->comm) == FL_COMM_BACKEND_MPI;
        void *rw = NULL, *out = NULL, *ws = NULL, *x = NULL;
        int32_t *h_out = malloc(rows * 2 * sizeof(int32_t));
        float *h_x = mpi ? malloc(rows * V * sizeof(float)) : NULL;
        fl_status st = !h_out || (mpi && !h_x) ? FL_ERR(FL_ERR_OOM, "out of memory for the sampled rows") : FL_OK;
        if (st == FL_OK) st = be->ops->alloc(be, rows * sizeof(fl_sample_row), &rw);
        if (st == FL_OK) st = be->ops->alloc(be, rows * 2 * sizeof(int32_t), &out);
        if (st == FL_OK) st = be->ops->alloc(be, be->ops->sample_rows_ws(be, (int)rows, V), &ws);
        if (st == FL_OK && tp) st = be->ops->alloc(be, fl_backend_act_bytes(be, rows * V), &x);
        if (st != FL_OK) {
            if (rw) be->ops->free(be, rw);
            if (out) be->ops->free(be, out);
            if (ws) be->ops->free(be, ws);
            if (x) be->ops->free(be, x);
            free(h_out);
            free(h_x);
            return st;
        }
        f->d_smp_rows = rw, f->d_smp_out = out, f->d_smp_ws = ws, f->d_smp_x = x;
        f->h_smp_out = h_out, f->h_smp_x = h_x;
    }
    if (n_hist > f->smp_hist_cap) {
        size_t cap = f->smp_hist_cap ? f->smp_hist_cap : 4096;
        while (cap < n_hist) cap *= 2;
        if (f->d_smp_hist) be->ops->free(be, f->d_smp_hist);
        f->d_smp_hist = NULL, f->smp_hist_cap = 0;
        FL_TRY(be->ops->alloc(be, cap * sizeof(int32_t), (void **)&f->d_smp_hist));
        f->smp_hist_cap = cap;
    }
    return FL_OK;
}

/* Under tensor parallelism: the gathered shards (fl_forward_gather_shards,
 * already run) laid out in id order as one [rows, vocab] activation buffer. */
static fl_status shards_as_rows(fl_forward *f, int rows) {
    fl_backend *be = f->m->be;
    const int V = f->m->cfg.vocab_size;
    if (fl_comm_backend_of(f->comm) == FL_COMM_BACKEND_MPI) { /* host shards: the logits route's layout */
        fl_forward_shards_to_rows(f, rows, f->h_smp_x);
        return be->ops->upload_act(be, f->d_smp_x, f->h_smp_x, (size_t)rows * V);
    }
    size_t off = 0;
    for (int r = 0; r < fl_comm_size(f->comm); r++) {
        int lo, vr;
        fl_forward_vocab_shard(f, r, &lo, &vr);
        FL_TRY(be->ops->copy_2d(be, (char *)f->d_smp_x + fl_backend_act_bytes(be, (size_t)lo), V,
                                (const char *)f->d_logits_all + fl_backend_act_bytes(be, off), vr, rows, vr));
        off += (size_t)rows * vr;
    }
    return FL_OK;
}

fl_status fl_forward_pick_sampled(fl_forward *f, int rows, int32_t *ids) {
    fl_backend *be = f->m->be;
    const int V = f->m->cfg.vocab_size;
    const bool tp = f->comm && fl_comm_size(f->comm) > 1;
    const fl_sample_row *r = f->smp_rows;
    f->smp_rows = NULL; /* one plan's */
    /* The collective first, on every rank, so that a rank failing below
     * fails alone instead of leaving the others in the gather. */
    if (tp) FL_TRY(fl_forward_gather_shards(f, rows));
    if (!ids) return be->ops->sync(be); /* a rank that does not sample */
    if (!r || f->smp_n != rows)
        return FL_ERR(FL_ERR_INTERNAL, "sampled plan of %d rows without their sampling (%d given)", rows,
                      r ? f->smp_n : 0);
    if (!fl_forward_can_sample(f))
        return FL_ERR(FL_ERR_INTERNAL, "sampled plan on a backend or layout that cannot sample");
    FL_TRY(sampled_buffers(f, f->smp_n_hist));
    if (tp) FL_TRY(shards_as_rows(f, rows));
    bool any_top_p = false;
    for (int i = 0; i < rows; i++) any_top_p |= r[i].top_p < 1.0f;
    FL_TRY(be->ops->upload(be, f->d_smp_rows, r, (size_t)rows * sizeof *r));
    if (f->smp_n_hist)
        FL_TRY(be->ops->upload(be, f->d_smp_hist, f->smp_hist, f->smp_n_hist * sizeof(int32_t)));
    FL_TRY(be->ops->sample_rows(be, tp ? f->d_smp_x : f->logits, rows, V, f->d_smp_rows, f->d_smp_hist, any_top_p,
                                f->d_smp_ws, f->d_smp_out));
    FL_TRY(be->ops->download(be, f->h_smp_out, f->d_smp_out, (size_t)rows * 2 * sizeof(int32_t)));
    for (int i = 0; i < rows; i++) {
        const int32_t tok = f->h_smp_out[2 * i], what = f->h_smp_out[2 * i + 1];
        if (what == 1) return FL_ERR(FL_ERR_INVALID_ARG, "logits contain NaN at token id %d (row %d)", tok, i);
        if (what == 2) return FL_ERR(FL_ERR_INVALID_ARG, "every logit is -inf: nothing to sample (row %d)", i);
        if (what != 0 || tok < 0 || tok >= V)
            return FL_ERR(FL_ERR_INTERNAL, "sample_rows: row %d gave token %d (status %d)", i, tok, what);
        ids[i] = tok;
    }
    return FL_OK;
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
