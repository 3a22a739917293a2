/*
 * scheduler.c — continuous batching over paged KV blocks (see scheduler.h).
 */
#include "runtime/engine/scheduler.h"

#include <stdlib.h>
#include <string.h>

fl_status fl_seq_init(fl_seq *s, int64_t id, const int32_t *prompt, int n_prompt) {
    memset(s, 0, sizeof *s);
    s->id = id;
    s->cap = n_prompt + 16;
    s->tokens = malloc((size_t)s->cap * sizeof(int32_t));
    if (!s->tokens) return FL_ERR(FL_ERR_OOM, "out of memory for a sequence");
    memcpy(s->tokens, prompt, (size_t)n_prompt * sizeof(int32_t));
    s->n_tokens = s->n_prompt = n_prompt;
    return FL_OK;
}

fl_status fl_seq_append(fl_seq *s, int32_t token) {
    if (s->n_tokens == s->cap) {
        int cap = s->cap * 2;
        int32_t *t = realloc(s->tokens, (size_t)cap * sizeof *t);
        if (!t) return FL_ERR(FL_ERR_OOM, "out of memory growing a sequence");
        s->tokens = t;
        s->cap = cap;
    }
    s->tokens[s->n_tokens++] = token;
    return FL_OK;
}

void fl_seq_free(fl_seq *s) {
    if (!s) return;
    free(s->tokens);
    free(s->blocks);
    free(s->hashes);
    memset(s, 0, sizeof *s);
}

fl_status fl_scheduler_init(fl_scheduler *s, const fl_sched_config *cfg) {
    memset(s, 0, sizeof *s);
    if (cfg->block_size <= 0 || cfg->n_blocks <= 0 || cfg->max_num_seqs <= 0 ||
        cfg->max_num_batched_tokens <= 0 || cfg->max_model_len <= 1)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "scheduler: block_size %d, blocks %d, max_num_seqs %d, "
                      "max_num_batched_tokens %d, max_model_len %d must all be positive",
                      cfg->block_size, cfg->n_blocks, cfg->max_num_seqs,
                      cfg->max_num_batched_tokens, cfg->max_model_len);
    s->cfg = *cfg;
    FL_TRY(fl_kv_blocks_init(&s->blocks, cfg->n_blocks, cfg->prefix_caching ? cfg->block_size : 0));
    s->block_hash = fl_kv_block_hash;
    s->r_cap = cfg->max_num_seqs;
    s->running = calloc((size_t)s->r_cap, sizeof *s->running);
    s->step = calloc((size_t)s->r_cap, sizeof *s->step);
    if (!s->running || !s->step) {
        fl_scheduler_free(s);
        return FL_ERR(FL_ERR_OOM, "out of memory for the scheduler");
    }
    return FL_OK;
}

void fl_scheduler_free(fl_scheduler *s) {
    if (!s) return;
    fl_kv_blocks_free(&s->blocks);
    free(s->waiting);
    free(s->running);
    free(s->step);
    memset(s, 0, sizeof *s);
}

static fl_status push_waiting(fl_scheduler *s, fl_seq *q, bool front) {
    if (s->w_len == s->w_cap) {
        int cap = s->w_cap ? 2 * s->w_cap : 64;
        fl_seq **nw = malloc((size_t)cap * sizeof *nw);
        if (!nw) return FL_ERR(FL_ERR_OOM, "out of memory for the waiting queue");
        for (int i = 0; i < s->w_len; i++) nw[i] = s->waiting[(s->w_head + i) % s->w_cap];
        free(s->waiting);
        s->waiting = nw;
        s->w_cap = cap;
        s->w_head = 0;
    }
    if (front) {
        s->w_head = (s->w_head + s->w_cap - 1) % s->w_cap;
        s->waiting[s->w_head] = q;
    } else {
        s->waiting[(s->w_head + s->w_len) % s->w_cap] = q;
    }
    s->w_len++;
    q->state = FL_SEQ_WAITING;
    return FL_OK;
}

fl_status fl_scheduler_add(fl_scheduler *s, fl_seq *q) {
    if (q->n_tokens < 1) return FL_ERR(FL_ERR_INVALID_ARG, "empty prompt");
    if (q->n_tokens >= s->cfg.max_model_len)
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "prompt of %d tokens does not fit max_model_len %d (room is needed for at "
                      "least one generated token)", q->n_tokens, s->cfg.max_model_len);
    int need = (q->n_tokens + 1 + s->cfg.block_size - 1) / s->cfg.block_size;
    if (need > s->cfg.n_blocks)
        return FL_ERR(FL_ERR_INVALID_ARG, "prompt of %d tokens needs %d KV blocks; the cache has %d",
                      q->n_tokens, need, s->cfg.n_blocks);
    return push_waiting(s, q, false);
}

bool fl_scheduler_has_work(const fl_scheduler *s) { return s->w_len > 0 || s->n_running > 0; }

static void release_blocks(fl_scheduler *s, fl_seq *q) {
    fl_kv_blocks_release(&s->blocks, q->blocks, q->n_blocks);
    q->n_blocks = 0;
    q->n_published = 0;
}

static bool reserve_blocks(fl_seq *q, int need) {
    if (need <= q->blocks_cap) return true;
    int cap = need + 4;
    int32_t *b = realloc(q->blocks, (size_t)cap * sizeof *b);
    if (!b) return false;
    q->blocks = b;
    q->blocks_cap = cap;
    return true;
}

/* Identities of q's first n full blocks (computed once: tokens never change). */
static bool hash_blocks(fl_scheduler *s, fl_seq *q, int n) {
    const int bs = s->cfg.block_size;
    if (n > q->hashes_cap) {
        int cap = n + 16;
        uint64_t *h = realloc(q->hashes, (size_t)cap * sizeof *h);
        if (!h) return false;
        q->hashes = h;
        q->hashes_cap = cap;
    }
    for (; q->n_hashes < n; q->n_hashes++) {
        const int b = q->n_hashes;
        q->hashes[b] = s->block_hash(s->cfg.prefix_seed, b ? q->hashes[b - 1] : 0, q->tokens + (size_t)b * bs, bs);
    }
    return true;
}

/* A sequence without blocks takes the cached blocks of its longest cached
 * prefix, leaving at least its last token to compute. */
static void match_prefix(fl_scheduler *s, fl_seq *q) {
    if (!s->cfg.prefix_caching || q->n_blocks > 0) return;
    const int bs = s->cfg.block_size, n = (q->n_tokens - 1) / bs;
    if (n < 1 || !reserve_blocks(q, n) || !hash_blocks(s, q, n)) return; /* no memory: no sharing */
    while (q->n_blocks < n) {
        const int b = q->n_blocks;
        int32_t id = fl_kv_blocks_lookup(&s->blocks, q->hashes[b], b ? q->blocks[b - 1] : -1,
                                         q->tokens + (size_t)b * bs);
        if (id < 0) break;
        q->blocks[q->n_blocks++] = id;
    }
    q->n_published = q->n_blocks;
    q->n_computed = q->n_blocks * bs;
}

/* Publishes q's full blocks that this step completes (their K/V are written
 * before any row of the step attends, so sharing them now is safe). */
static void publish_blocks(fl_scheduler *s, fl_seq *q) {
    if (!s->cfg.prefix_caching) return;
    const int bs = s->cfg.block_size, n = (q->n_computed + q->step_rows) / bs;
    if (n <= q->n_published || !hash_blocks(s, q, n)) return;
    for (int b = q->n_published; b < n; b++)
        fl_kv_blocks_publish(&s->blocks, q->blocks[b], q->hashes[b], b ? q->blocks[b - 1] : -1,
                             q->tokens + (size_t)b * bs);
    q->n_published = n;
}

/* Gives q enough blocks to hold n_tok tokens; false when the cache is short
 * (blocks taken so far stay with q). */
static bool grow_blocks(fl_scheduler *s, fl_seq *q, int n_tok) {
    int need = (n_tok + s->cfg.block_size - 1) / s->cfg.block_size;
    if (!reserve_blocks(q, need)) return false;
    while (q->n_blocks < need) {
        int32_t id = fl_kv_blocks_alloc(&s->blocks);
        if (id < 0) return false;
        q->blocks[q->n_blocks++] = id;
    }
    return true;
}

static void remove_running(fl_scheduler *s, int i) {
    memmove(&s->running[i], &s->running[i + 1], (size_t)(s->n_running - i - 1) * sizeof(fl_seq *));
    s->n_running--;
}

static fl_status preempt(fl_scheduler *s, int i) {
    fl_seq *q = s->running[i];
    release_blocks(s, q);
    q->n_computed = 0;
    q->n_preempted++;
    s->n_preemptions++;
    remove_running(s, i);
    return push_waiting(s, q, true);
}

fl_status fl_scheduler_schedule(fl_scheduler *s, fl_step_plan *plan) {
    int budget = s->cfg.max_num_batched_tokens;
    s->n_step = 0;
    /* 1. running sequences, oldest first; preempt the newest when short. */
    for (int i = 0; i < s->n_running && budget > 0;) {
        fl_seq *q = s->running[i];
        int take = q->n_tokens - q->n_computed;
        if (take > budget) take = budget;
        if (!grow_blocks(s, q, q->n_computed + take)) {
            FL_TRY(preempt(s, s->n_running - 1));
            continue; /* retry q, unless q itself was preempted */
        }
        q->step_rows = take;
        q->step_sample = q->n_computed + take == q->n_tokens;
        s->step[s->n_step++] = q;
        publish_blocks(s, q);
        budget -= take;
        i++;
    }
    /* 2. admit waiting sequences in arrival order. */
    while (s->w_len > 0 && s->n_running < s->cfg.max_num_seqs && budget > 0) {
        fl_seq *q = s->waiting[s->w_head];
        match_prefix(s, q);
        int take = q->n_tokens - q->n_computed;
        if (take > budget) take = budget;
        if (!grow_blocks(s, q, q->n_computed + take)) {
            release_blocks(s, q);
            q->n_computed = 0;
            break;
        }
        if (q->n_preempted == 0) { /* count each request once */
            q->n_cached = q->n_computed < q->n_prompt ? q->n_computed : q->n_prompt;
            s->prompt_tokens += q->n_prompt;
            s->cached_prompt_tokens += q->n_cached;
        }
        s->w_head = (s->w_head + 1) % s->w_cap;
        s->w_len--;
        q->state = FL_SEQ_RUNNING;
        s->running[s->n_running++] = q;
        q->step_rows = take;
        q->step_sample = q->n_computed + take == q->n_tokens;
        s->step[s->n_step++] = q;
        publish_blocks(s, q);
        budget -= take;
    }
    /* 3. the plan */
    int n_tok = 0, max_blocks = 1, n_logits = 0;
    for (int i = 0; i < s->n_step; i++) {
        n_tok += s->step[i]->step_rows;
        if (s->step[i]->n_blocks > max_blocks) max_blocks = s->step[i]->n_blocks;
        n_logits += s->step[i]->step_sample;
    }
    FL_TRY(fl_step_plan_resize(plan, n_tok, s->n_step, max_blocks, n_logits, s->cfg.block_size));
    int row = 0, lg = 0;
    plan->q_start[0] = 0;
    for (int i = 0; i < s->n_step; i++) {
        fl_seq *q = s->step[i];
        int32_t *bt = plan->block_tables + (size_t)i * max_blocks;
        memcpy(bt, q->blocks, (size_t)q->n_blocks * sizeof *bt);
        for (int j = q->n_blocks; j < max_blocks; j++) bt[j] = -1;
        for (int j = 0; j < q->step_rows; j++, row++) {
            int pos = q->n_computed + j;
            plan->tokens[row] = q->tokens[pos];
            plan->positions[row] = pos;
            plan->slots[row] = bt[pos / s->cfg.block_size] * s->cfg.block_size + pos % s->cfg.block_size;
        }
        plan->q_start[i + 1] = row;
        plan->ctx_len[i] = q->n_computed + q->step_rows;
        plan->rope_len[i] = plan->ctx_len[i] > q->n_prompt ? plan->ctx_len[i] : q->n_prompt;
        if (q->step_sample) plan->logit_rows[lg++] = row - 1;
    }
    return FL_OK;
}

void fl_scheduler_step_done(fl_scheduler *s) {
    for (int i = 0; i < s->n_step; i++) s->step[i]->n_computed += s->step[i]->step_rows;
}

void fl_scheduler_finish(fl_scheduler *s, fl_seq *q) {
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i] == q) {
            remove_running(s, i);
            break;
        }
    /* a finished sequence could still sit in the queue if it was preempted */
    for (int i = 0; i < s->w_len; i++) {
        int at = (s->w_head + i) % s->w_cap;
        if (s->waiting[at] == q) {
            for (int j = i; j < s->w_len - 1; j++)
                s->waiting[(s->w_head + j) % s->w_cap] = s->waiting[(s->w_head + j + 1) % s->w_cap];
            s->w_len--;
            break;
        }
    }
    release_blocks(s, q);
    q->state = FL_SEQ_FINISHED;
}
