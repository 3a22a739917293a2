/*
 * perplexity.c — windows and per-token negative log-likelihood for
 * `flotilla perplexity` (see perplexity.h).
 */
#include "launcher/perplexity.h"

#include <math.h>
#include <stdint.h>

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

bool fl_ppl_window_at(int n, int ctx, int stride, int k, fl_ppl_window *w) {
    const int64_t begin = (int64_t)k * stride;
    /* the previous window's end: the text ended there, or scoring starts there */
    const int64_t prev_end = k == 0 ? 0 : min64(begin - stride + ctx, n);
    if (k > 0 && prev_end >= n) return false;
    w->begin = (int)begin;
    w->end = (int)min64(begin + ctx, n);
    w->score_from = (int)(prev_end > begin + 1 ? prev_end : begin + 1);
    return true;
}

double fl_ppl_nll(const float *row, int vocab, int target) {
    double mx = row[0];
    for (int i = 1; i < vocab; i++)
        if (row[i] > mx) mx = row[i];
    double sum = 0.0;
    for (int i = 0; i < vocab; i++) sum += exp((double)row[i] - mx);
    return mx + log(sum) - (double)row[target];
}
