/*
 * quantize_share.c — the calibration samples of `flotilla quantize` spread
 * over the ranks (quantize_share.h). Rank 0 alone writes the output, so the
 * hidden states the resume state holds are gathered to it and scattered
 * back from it with all_to_all_v (the one collective that moves a part to
 * a single rank only), and doubles travel as pairs of int32 through
 * all_gather, which copies bits.
 */
#include "launcher/quantize_share.h"

#include <stdlib.h>
#include <string.h>

fl_status fl_qshare_init(fl_comm *comm, const int *len, int n_blk, fl_qshare *s) {
    memset(s, 0, sizeof *s);
    s->comm = comm;
    s->rank = comm ? fl_comm_rank(comm) : 0;
    s->ranks = comm ? fl_comm_size(comm) : 1;
    s->n_blk = n_blk;
    if (n_blk < s->ranks)
        return FL_ERR(FL_ERR_INVALID_ARG, "%d ranks but %d calibration sample(s): every rank needs one; run on "
                      "at most %d ranks, or give more calibration text or --n-samples", s->ranks, n_blk, n_blk);
    s->len = malloc((size_t)n_blk * sizeof *s->len);
    s->first = malloc((size_t)(s->ranks + 1) * sizeof *s->first);
    s->tok0 = malloc((size_t)(n_blk + 1) * sizeof *s->tok0);
    if (!s->len || !s->first || !s->tok0) {
        fl_qshare_free(s);
        return FL_ERR(FL_ERR_OOM, "out of memory");
    }
    memcpy(s->len, len, (size_t)n_blk * sizeof *len);
    s->tok0[0] = 0;
    for (int b = 0; b < n_blk; b++) s->tok0[b + 1] = s->tok0[b] + len[b];
    for (int r = 0; r <= s->ranks; r++) s->first[r] = (int)((int64_t)n_blk * r / s->ranks);
    return FL_OK;
}

void fl_qshare_free(fl_qshare *s) {
    if (!s) return;
    free(s->len);
    free(s->first);
    free(s->tok0);
    memset(s, 0, sizeof *s);
}

int64_t fl_qshare_tok_begin(const fl_qshare *s, int r) { return s->tok0[s->first[r]]; }

int64_t fl_qshare_tokens(const fl_qshare *s, int r) { return s->tok0[s->first[r + 1]] - s->tok0[s->first[r]]; }

void fl_qshare_split(const fl_qshare *s, int r, int64_t n, int64_t *lo, int64_t *hi) {
    *lo = n * r / s->ranks;
    *hi = n * (r + 1) / s->ranks;
}

fl_status fl_qshare_gather_blocks(const fl_qshare *s, const double *mine, size_t per_blk, double *all) {
    const size_t n_mine = (size_t)(s->first[s->rank + 1] - s->first[s->rank]) * per_blk;
    if (!s->comm) {
        memcpy(all, mine, n_mine * sizeof *all);
        return FL_OK;
    }
    size_t *counts = malloc((size_t)s->ranks * sizeof *counts);
    if (!counts) return FL_ERR(FL_ERR_OOM, "out of memory");
    for (int r = 0; r < s->ranks; r++) counts[r] = (size_t)(s->first[r + 1] - s->first[r]) * per_blk * 2;
    fl_status st = fl_comm_all_gather(s->comm, mine, all, counts, FL_COMM_I32);
    free(counts);
    return st;
}

/* Rank r's rows are [start[r], start[r + 1]) of width d. to_root: every
 * rank's rows to rank 0's recv; else rank 0's send to every rank's rows.
 * in_place (to_root only): rank 0's rows are already in recv, which is
 * send, and stay. */
static fl_status move_rows(const fl_qshare *s, const float *send, float *recv, const int64_t *start, int64_t d,
                           int to_root, int in_place) {
    const int R = s->ranks, me = s->rank;
    const size_t mine = (size_t)((start[me + 1] - start[me]) * d);
    if (!s->comm) {
        if (recv != send) memcpy(recv, send, mine * sizeof *recv);
        return FL_OK;
    }
    size_t *a = calloc((size_t)(4 * R), sizeof *a), *sc = a, *sd = a + R, *rc = a + 2 * R, *rd = a + 3 * R;
    if (!a) return FL_ERR(FL_ERR_OOM, "out of memory");
    size_t *root_c = to_root ? rc : sc, *root_d = to_root ? rd : sd; /* rank 0's side of the exchange */
    if (me == 0)
        for (int r = in_place ? 1 : 0; r < R; r++) {
            root_c[r] = (size_t)((start[r + 1] - start[r]) * d);
            root_d[r] = (size_t)(start[r] * d);
        }
    if (to_root && !(in_place && me == 0)) {
        sc[0] = mine;
        sd[0] = in_place ? (size_t)(start[me] * d) : 0;
    }
    if (!to_root) rc[0] = mine;
    /* in place, rank 0 sends nothing: no send buffer aliasing its receive buffer */
    fl_status st = fl_comm_all_to_all_v(s->comm, in_place && me == 0 ? NULL : send, sc, sd, recv, rc, rd, FL_COMM_F32);
    free(a);
    return st;
}

/* The first token of each rank (and the total): [ranks + 1]. */
static int64_t *token_starts(const fl_qshare *s) {
    int64_t *start = malloc((size_t)(s->ranks + 1) * sizeof *start);
    for (int r = 0; start && r <= s->ranks; r++) start[r] = s->tok0[s->first[r]];
    return start;
}

fl_status fl_qshare_gather_rows(const fl_qshare *s, const float *mine, int64_t d, float *all) {
    int64_t *start = token_starts(s);
    fl_status st = start ? move_rows(s, mine, all, start, d, 1, 0) : FL_ERR(FL_ERR_OOM, "out of memory");
    free(start);
    return st;
}

fl_status fl_qshare_scatter_rows(const fl_qshare *s, const float *all, int64_t d, float *mine) {
    int64_t *start = token_starts(s);
    fl_status st = start ? move_rows(s, all, mine, start, d, 0, 0) : FL_ERR(FL_ERR_OOM, "out of memory");
    free(start);
    return st;
}

fl_status fl_qshare_gather_split(const fl_qshare *s, float *w, int64_t n, int64_t d) {
    int64_t *start = malloc((size_t)(s->ranks + 1) * sizeof *start), hi;
    for (int r = 0; start && r < s->ranks; r++) fl_qshare_split(s, r, n, &start[r], &hi);
    if (start) start[s->ranks] = n;
    fl_status st = start ? move_rows(s, w, w, start, d, 1, 1) : FL_ERR(FL_ERR_OOM, "out of memory");
    free(start);
    return st;
}
