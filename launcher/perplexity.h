/*
 * perplexity.h — the arithmetic of `flotilla perplexity`, apart from the
 * engine so it can be tested alone: which tokens each window runs and which
 * it scores, and the negative log-likelihood of one target under one row of
 * logits.
 *
 * Windows follow the Hugging Face perplexity guide: window k runs tokens
 * [k*stride, k*stride + ctx) and scores the targets not scored by an
 * earlier window, so every token after the first is scored exactly once
 * when stride < ctx; with stride == ctx (the default) windows do not
 * overlap and each window's first token, having no context inside the
 * window, is not scored.
 */
#ifndef FL_PERPLEXITY_H
#define FL_PERPLEXITY_H

#include <stdbool.h>

typedef struct fl_ppl_window {
    int begin, end;  /* tokens [begin, end) run through the model */
    int score_from;  /* targets [score_from, end) scored; target t uses row t - 1 - begin */
} fl_ppl_window;

/* Window k of a text of n tokens (n >= 2, 2 <= ctx, 1 <= stride <= ctx);
 * false when the text ended before window k. */
bool fl_ppl_window_at(int n, int ctx, int stride, int k, fl_ppl_window *w);

/* -log softmax(row)[target], in double: the row's log-sum-exp minus the
 * target's logit. */
double fl_ppl_nll(const float *row, int vocab, int target);

#endif /* FL_PERPLEXITY_H */
