/*
 * quantize_share.h — how `flotilla quantize` spreads its calibration
 * samples over the ranks of an MPI job (docs/quantize.md "Several ranks").
 *
 * The samples are blocks of tokens, each attending only to itself, so a
 * rank can run a layer's float forward on a contiguous run of whole blocks
 * alone. Every sum the AWQ scale search takes over tokens is kept as one
 * partial per block and the partials are summed in block order on every
 * rank (the clipping search gathers its few hundred tokens to every rank
 * and splits the weight rows instead), so the result does not depend on
 * how many ranks there are: a run on N ranks writes the bytes of the
 * one-rank run.
 *
 * Collectives take the share's communicator; every rank calls them in the
 * same order (comm.h). A NULL communicator is a one-rank run: the same
 * functions, no communication.
 */
#ifndef FL_QUANTIZE_SHARE_H
#define FL_QUANTIZE_SHARE_H

#include <stdint.h>

#include "core/status.h"
#include "parallel/comm.h"

typedef struct fl_qshare {
    fl_comm *comm;    /* NULL: one rank holds every block */
    int rank, ranks;
    int n_blk;        /* blocks over all ranks */
    int *len;         /* [n_blk] tokens of each block (copied) */
    int *first;       /* [ranks + 1]: rank r holds blocks [first[r], first[r + 1]) */
    int64_t *tok0;    /* [n_blk + 1]: the first token of each block, over all ranks */
} fl_qshare;

/* Splits n_blk blocks of the given lengths over comm's ranks (comm NULL:
 * one rank), as evenly as whole blocks allow. Each rank needs one block:
 * fewer blocks than ranks is FL_ERR_INVALID_ARG (alike on every rank). */
fl_status fl_qshare_init(fl_comm *comm, const int *len, int n_blk, fl_qshare *s);
void fl_qshare_free(fl_qshare *s); /* NULL is a no-op */

/* The first (global) token of rank r and how many tokens it holds. */
int64_t fl_qshare_tok_begin(const fl_qshare *s, int r);
int64_t fl_qshare_tokens(const fl_qshare *s, int r);

/* Collective: all[n_blk * per_blk] on every rank = every rank's per-block
 * partials (mine[blocks of this rank * per_blk]) in block order. */
fl_status fl_qshare_gather_blocks(const fl_qshare *s, const double *mine, size_t per_blk, double *all);

/* Collective: the rows (width d, one a token) every rank holds, into
 * all[tokens * d] on rank 0 (other ranks: all unused, may be NULL). */
fl_status fl_qshare_gather_rows(const fl_qshare *s, const float *mine, int64_t d, float *all);
/* Collective, the reverse: rank 0's all[tokens * d] to each rank's rows. */
fl_status fl_qshare_scatter_rows(const fl_qshare *s, const float *all, int64_t d, float *mine);

/* Rows [*lo, *hi) of n that rank r takes when work over n rows is split. */
void fl_qshare_split(const fl_qshare *s, int r, int64_t n, int64_t *lo, int64_t *hi);
/* Collective: each rank's fl_qshare_split rows of w[n, d] to rank 0's w,
 * in place (the other ranks' w is left as it is). */
fl_status fl_qshare_gather_split(const fl_qshare *s, float *w, int64_t n, int64_t d);

#endif /* FL_QUANTIZE_SHARE_H */
