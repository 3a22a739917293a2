/*
 * plan.c — the flat step-plan buffer (see plan.h).
 */
#include "runtime/engine/plan.h"

#include <stdlib.h>
#include <string.h>

static size_t words_for(int n_tokens, int n_seqs, int max_blocks, int n_logits) {
    return FL_PLAN_HEADER + 3 * (size_t)n_tokens + (size_t)n_seqs + 1 + (size_t)n_seqs +
           (size_t)n_seqs * (size_t)max_blocks + (size_t)n_logits + (size_t)n_seqs;
}

static size_t swap_words(const fl_step_plan *p) { return 2 * ((size_t)p->n_swap_out + (size_t)p->n_swap_in); }

static size_t disk_words(const fl_step_plan *p) {
    return (size_t)p->n_persist * FL_PLAN_PERSIST_WORDS(p->block_size) + (size_t)p->n_disk_in * FL_PLAN_DISK_IN_WORDS;
}

static void set_views(fl_step_plan *p) {
    int32_t *w = p->buf + FL_PLAN_HEADER;
    p->tokens = w; w += p->n_tokens;
    p->positions = w; w += p->n_tokens;
    p->slots = w; w += p->n_tokens;
    p->q_start = w; w += p->n_seqs + 1;
    p->ctx_len = w; w += p->n_seqs;
    p->block_tables = w; w += (size_t)p->n_seqs * p->max_blocks;
    p->logit_rows = w; w += p->n_logits;
    p->rope_len = w; w += p->n_seqs;
    p->swap_out = w; w += 2 * (size_t)p->n_swap_out;
    p->swap_in = w; w += 2 * (size_t)p->n_swap_in;
    p->persist = w; w += (size_t)p->n_persist * FL_PLAN_PERSIST_WORDS(p->block_size);
    p->disk_in = w;
}

static fl_status grow(fl_step_plan *p, size_t need) {
    if (need <= p->cap) return FL_OK;
    int32_t *nb = realloc(p->buf, need * sizeof *nb);
    if (!nb) return FL_ERR(FL_ERR_OOM, "out of memory for the step plan");
    p->buf = nb;
    p->cap = need;
    return FL_OK;
}

fl_status fl_step_plan_resize(fl_step_plan *p, int n_tokens, int n_seqs, int max_blocks,
                              int n_logits, int block_size) {
    if (n_tokens < 0 || n_seqs < 0 || max_blocks < 0 || n_logits < 0 || block_size <= 0)
        return FL_ERR(FL_ERR_INTERNAL, "step plan: bad counts");
    FL_TRY(grow(p, words_for(n_tokens, n_seqs, max_blocks, n_logits)));
    p->n_tokens = n_tokens;
    p->n_seqs = n_seqs;
    p->max_blocks = max_blocks;
    p->n_logits = n_logits;
    p->block_size = block_size;
    p->n_swap_out = p->n_swap_in = 0;
    p->n_persist = p->n_disk_in = 0;
    int32_t hdr[FL_PLAN_HEADER] = {0x504c414e /* "PLAN" */, n_tokens, n_seqs, max_blocks, n_logits,
                                   block_size, 0, 0, 0, 0, 0, 0};
    memcpy(p->buf, hdr, sizeof hdr);
    set_views(p);
    return FL_OK;
}

fl_status fl_step_plan_set_swaps(fl_step_plan *p, int n_swap_out, int n_swap_in) {
    if (n_swap_out < 0 || n_swap_in < 0 || n_swap_out > (1 << 28) || n_swap_in > (1 << 28))
        return FL_ERR(FL_ERR_INTERNAL, "step plan: %d swap-outs, %d swap-ins", n_swap_out, n_swap_in);
    if (p->n_persist || p->n_disk_in) return FL_ERR(FL_ERR_INTERNAL, "step plan: swaps set after the disk lists");
    FL_TRY(grow(p, fl_step_plan_forward_words(p) + 2 * ((size_t)n_swap_out + (size_t)n_swap_in)));
    p->n_swap_out = n_swap_out;
    p->n_swap_in = n_swap_in;
    p->buf[8] = n_swap_out;
    p->buf[9] = n_swap_in;
    set_views(p);
    return FL_OK;
}

fl_status fl_step_plan_set_disk(fl_step_plan *p, int n_persist, int n_disk_in) {
    if (n_persist < 0 || n_disk_in < 0 || n_persist > (1 << 24) || n_disk_in > (1 << 24))
        return FL_ERR(FL_ERR_INTERNAL, "step plan: %d blocks to persist, %d to read from disk", n_persist, n_disk_in);
    FL_TRY(grow(p, fl_step_plan_forward_words(p) + swap_words(p) +
                       (size_t)n_persist * FL_PLAN_PERSIST_WORDS(p->block_size) +
                       (size_t)n_disk_in * FL_PLAN_DISK_IN_WORDS));
    p->n_persist = n_persist;
    p->n_disk_in = n_disk_in;
    p->buf[10] = n_persist;
    p->buf[11] = n_disk_in;
    set_views(p);
    return FL_OK;
}

size_t fl_step_plan_forward_words(const fl_step_plan *p) {
    return words_for(p->n_tokens, p->n_seqs, p->max_blocks, p->n_logits);
}

size_t fl_step_plan_words(const fl_step_plan *p) {
    return fl_step_plan_forward_words(p) + swap_words(p) + disk_words(p);
}

fl_status fl_step_plan_from_header(fl_step_plan *p, const int32_t *h) {
    if (h[0] != 0x504c414e) return FL_ERR(FL_ERR_INTERNAL, "step plan: bad magic");
    FL_TRY(fl_step_plan_resize(p, h[1], h[2], h[3], h[4], h[5]));
    FL_TRY(fl_step_plan_set_swaps(p, h[8], h[9]));
    return fl_step_plan_set_disk(p, h[10], h[11]);
}

fl_status fl_step_plan_validate(const fl_step_plan *p, int64_t n_slots) {
    if (p->q_start[0] != 0 || p->q_start[p->n_seqs] != p->n_tokens)
        return FL_ERR(FL_ERR_INTERNAL, "step plan: q_start does not cover the %d tokens", p->n_tokens);
    for (int s = 0; s < p->n_seqs; s++) {
        int nq = p->q_start[s + 1] - p->q_start[s];
        if (nq < 1 || p->ctx_len[s] < nq || p->ctx_len[s] > p->max_blocks * p->block_size)
            return FL_ERR(FL_ERR_INTERNAL, "step plan: sequence %d has %d rows, context %d", s, nq,
                          p->ctx_len[s]);
        for (int i = 0; i < nq; i++) {
            int row = p->q_start[s] + i, pos = p->ctx_len[s] - nq + i;
            if (p->positions[row] != pos)
                return FL_ERR(FL_ERR_INTERNAL, "step plan: row %d position %d, expected %d", row,
                              p->positions[row], pos);
            int32_t blk = p->block_tables[(size_t)s * p->max_blocks + pos / p->block_size];
            if (p->slots[row] != blk * p->block_size + pos % p->block_size || p->slots[row] < 0 ||
                p->slots[row] >= n_slots)
                return FL_ERR(FL_ERR_INTERNAL, "step plan: row %d slot %d inconsistent", row,
                              p->slots[row]);
        }
    }
    for (int s = 0; s < p->n_seqs; s++)
        if (p->rope_len[s] < p->ctx_len[s])
            return FL_ERR(FL_ERR_INTERNAL, "step plan: sequence %d rope_len %d < context %d", s,
                          p->rope_len[s], p->ctx_len[s]);
    for (int i = 0; i < p->n_logits; i++)
        if (p->logit_rows[i] < 0 || p->logit_rows[i] >= p->n_tokens)
            return FL_ERR(FL_ERR_INTERNAL, "step plan: logit row %d out of range", p->logit_rows[i]);
    return FL_OK;
}

void fl_step_plan_free(fl_step_plan *p) {
    if (!p) return;
    free(p->buf);
    memset(p, 0, sizeof *p);
}
