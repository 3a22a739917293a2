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
    free(s->host_blocks);
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
    const size_t nh = cfg->n_host_blocks > 0 ? (size_t)cfg->n_host_blocks : 1;
    s->host_free = malloc(nh * sizeof *s->host_free);
    s->host_pending = malloc(nh * sizeof *s->host_pending);
    s->swap_out = malloc(2 * nh * sizeof *s->swap_out);
    s->swap_in = malloc(2 * nh * sizeof *s->swap_in);
    if (!s->running || !s->step || !s->host_free || !s->host_pending || !s->swap_out || !s->swap_in) {
        fl_scheduler_free(s);
        return FL_ERR(FL_ERR_OOM, "out of memory for the scheduler");
    }
    /* low host blocks first, like the device's */
    for (int i = 0; i < cfg->n_host_blocks; i++) s->host_free[s->n_host_free++] = cfg->n_host_blocks - 1 - i;
    return FL_OK;
}

void fl_scheduler_free(fl_scheduler *s) {
    if (!s) return;
    fl_kv_blocks_free(&s->blocks);
    free(s->waiting);
    free(s->running);
    free(s->step);
    free(s->host_free);
    free(s->host_pending);
    free(s->swap_out);
    free(s->swap_in);
    free(s->persist_new);
    free(s->persist_now);
    free(s->disk_in);
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

/* Drops q's blocks: device ones (last to first, see fl_kv_blocks_release)
 * and, when swapped out, its host ones (free from the next step: this
 * step's plan may still move them). */
static void release_blocks(fl_scheduler *s, fl_seq *q) {
    for (int b = q->n_blocks - 1; b >= 0; b--) {
        if (q->n_swapped && q->blocks[b] < 0) {
            s->host_pending[s->n_host_pending++] = q->host_blocks[b];
            continue;
        }
        fl_kv_blocks_release(&s->blocks, &q->blocks[b], 1);
    }
    q->n_blocks = 0;
    q->n_published = 0;
    q->n_swapped = 0;
}

static bool reserve_blocks(fl_seq *q, int need) {
    if (need <= q->blocks_cap) return true;
    int cap = need + 4;
    int32_t *b = realloc(q->blocks, (size_t)cap * sizeof *b);
    if (!b) return false;
    q->blocks = b;
    int32_t *h = realloc(q->host_blocks, (size_t)cap * sizeof *h);
    if (!h) return false; /* blocks grew: harmless, the capacity stays */
    q->host_blocks = h;
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

int fl_scheduler_prompt_hashes(fl_scheduler *s, fl_seq *q) {
    const int n = (q->n_tokens - 1) / s->cfg.block_size; /* match_prefix's blocks */
    if (!s->cfg.prefix_caching || n < 1 || !hash_blocks(s, q, n)) return 0;
    return n;
}

int fl_scheduler_cached_prefix(const fl_scheduler *s, const fl_seq *q, int n) {
    const int bs = s->cfg.block_size;
    int32_t parent = -1;
    int b = 0;
    for (; b < n && b < q->n_hashes; b++) {
        parent = fl_kv_blocks_peek(&s->blocks, q->hashes[b], parent, q->tokens + (size_t)b * bs);
        if (parent < 0) break;
    }
    return b;
}

/* Room for one more entry of `words` words in a growing list. */
static bool list_room(int32_t **buf, int *cap, int n, size_t words) {
    if (n < *cap) return true;
    int c = *cap ? 2 * *cap : 64;
    int32_t *b = realloc(*buf, (size_t)c * words * sizeof *b);
    if (!b) return false;
    *buf = b;
    *cap = c;
    return true;
}

/* Publishes q's block b (held in block id); a block new to the disk tier
 * waits for the next step's persist list (when its K/V exist). Without
 * memory for the entry the block is only not written. */
static void publish(fl_scheduler *s, fl_seq *q, int b, int32_t id) {
    const int bs = s->cfg.block_size;
    const int32_t *tok = q->tokens + (size_t)b * bs;
    if (!fl_kv_blocks_publish(&s->blocks, id, q->hashes[b], b ? q->blocks[b - 1] : -1, tok) || !s->disk) return;
    const uint64_t parent = b ? q->hashes[b - 1] : 0;
    const size_t words = FL_PLAN_PERSIST_WORDS(bs) + 1;
    if (!list_room(&s->persist_new, &s->cap_persist_new, s->n_persist_new, words) ||
        !fl_kv_disk_note(s->disk, q->hashes[b], parent, tok))
        return;
    int32_t *w = s->persist_new + (size_t)s->n_persist_new++ * words;
    w[0] = id;
    fl_plan_put_u64(w + 1, q->hashes[b]);
    fl_plan_put_u64(w + 3, parent);
    memcpy(w + 5, tok, (size_t)bs * sizeof(int32_t));
    w[words - 1] = (int32_t)s->blocks.gen[id];
}

/* The disk tier's copy of q's block b, when the disk index has it: a fresh
 * block, published, filled from disk before the step's forward; -1 when
 * there is none (or no block, or no memory for the entry). */
static int32_t disk_block(fl_scheduler *s, fl_seq *q, int b) {
    const int bs = s->cfg.block_size;
    const int32_t *tok = q->tokens + (size_t)b * bs;
    if (!s->disk || !fl_kv_disk_find(s->disk, q->hashes[b], b ? q->hashes[b - 1] : 0, tok) ||
        !list_room(&s->disk_in, &s->cap_disk_in, s->n_disk_in, FL_PLAN_DISK_IN_WORDS))
        return -1;
    const int32_t id = fl_kv_blocks_alloc(&s->blocks);
    if (id < 0) return -1;
    fl_kv_blocks_publish(&s->blocks, id, q->hashes[b], b ? q->blocks[b - 1] : -1, tok);
    int32_t *w = s->disk_in + (size_t)s->n_disk_in++ * FL_PLAN_DISK_IN_WORDS;
    w[0] = id;
    fl_plan_put_u64(w + 1, q->hashes[b]);
    s->disk_hit_blocks++;
    return id;
}

/* Block id was reallocated to a swap-in this step: an earlier disk-in to it
 * is dead (swap-ins run first, kv_disk.h), so it must not overwrite it. */
static void drop_disk_in(fl_scheduler *s, int32_t id) {
    int k = 0;
    for (int i = 0; i < s->n_disk_in; i++) {
        const int32_t *w = s->disk_in + (size_t)i * FL_PLAN_DISK_IN_WORDS;
        if (w[0] == id) continue;
        memmove(s->disk_in + (size_t)k++ * FL_PLAN_DISK_IN_WORDS, w, FL_PLAN_DISK_IN_WORDS * sizeof(int32_t));
    }
    s->n_disk_in = k;
}

/* A sequence without blocks takes the cached blocks of its longest cached
 * prefix (device first, then the disk tier), leaving at least its last
 * token to compute. */
static void match_prefix(fl_scheduler *s, fl_seq *q) {
    if (!s->cfg.prefix_caching || q->n_blocks > 0) return;
    const int bs = s->cfg.block_size, n = (q->n_tokens - 1) / bs;
    if (n < 1 || !reserve_blocks(q, n) || !hash_blocks(s, q, n)) return; /* no memory: no sharing */
    while (q->n_blocks < n) {
        const int b = q->n_blocks;
        int32_t id = fl_kv_blocks_lookup(&s->blocks, q->hashes[b], b ? q->blocks[b - 1] : -1,
                                         q->tokens + (size_t)b * bs);
        if (id < 0) id = disk_block(s, q, b);
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
    for (int b = q->n_published; b < n; b++) publish(s, q, b, q->blocks[b]);
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

bool fl_sched_swap_pays(int n_blocks, int n_tokens, double block_copy_seconds, double prefill_tok_per_s) {
    if (n_blocks <= 0) return false; /* nothing to keep */
    if (prefill_tok_per_s <= 0) return true;
    return 2.0 * n_blocks * block_copy_seconds < n_tokens / prefill_tok_per_s;
}

/* Preempts q by swap when the pool has room and the cost model agrees:
 * its private blocks holding computed tokens go to the host (listed in
 * this step's swap-outs), shared ones stay referenced, blocks past its
 * computed tokens are freed. False (nothing changed): recompute it. */
static bool swap_out(fl_scheduler *s, fl_seq *q) {
    const int bs = s->cfg.block_size;
    if (s->cfg.n_host_blocks <= 0 || q->n_computed <= 0) return false;
    const int n_full = (q->n_computed + bs - 1) / bs; /* blocks holding computed tokens */
    int n_priv = 0;
    for (int b = 0; b < n_full; b++) n_priv += s->blocks.ref[q->blocks[b]] == 1;
    if (n_priv > s->n_host_free) return false;
    /* shared blocks stay cached either way: a recompute finds them again */
    const int n_tokens = q->n_computed - (n_full - n_priv) * bs;
    if (!fl_sched_swap_pays(n_priv, n_tokens, s->cfg.block_copy_seconds, s->prefill_tok_per_s)) return false;
    fl_kv_blocks_release(&s->blocks, q->blocks + n_full, q->n_blocks - n_full);
    q->n_blocks = n_full;
    for (int b = n_full - 1; b >= 0; b--) { /* last to first, as release_blocks does */
        int32_t id = q->blocks[b];
        if (s->blocks.ref[id] != 1) continue;
        int32_t h = s->host_free[--s->n_host_free];
        s->swap_out[2 * s->n_swap_out] = id;
        s->swap_out[2 * s->n_swap_out + 1] = h;
        s->n_swap_out++;
        q->host_blocks[b] = h;
        q->blocks[b] = -1;
        fl_kv_blocks_release(&s->blocks, &id, 1);
    }
    q->n_swapped = n_priv;
    q->n_swaps++;
    s->n_swap_preemptions++;
    s->blocks_swapped_out += n_priv;
    return true;
}

/* Brings a swapped-out q's blocks back into fresh device blocks (listed in
 * this step's swap-ins); the caller checked that enough blocks are
 * available. A block whose prefix-cached copy is still on the device is
 * taken from there instead of the host. */
static void swap_in(fl_scheduler *s, fl_seq *q) {
    const int bs = s->cfg.block_size;
    for (int b = 0; b < q->n_blocks; b++) {
        if (q->blocks[b] >= 0) continue;
        const int32_t h = q->host_blocks[b], parent = b ? q->blocks[b - 1] : -1;
        const int32_t *tok = q->tokens + (size_t)b * bs;
        int32_t id = b < q->n_published ? fl_kv_blocks_lookup(&s->blocks, q->hashes[b], parent, tok) : -1;
        if (id < 0) {
            id = fl_kv_blocks_alloc(&s->blocks);
            FL_ASSERT(id >= 0);
            s->swap_in[2 * s->n_swap_in] = h;
            s->swap_in[2 * s->n_swap_in + 1] = id;
            s->n_swap_in++;
            s->blocks_swapped_in++;
            drop_disk_in(s, id);
            q->blocks[b] = id;
            if (b < q->n_published) publish(s, q, b, id);
        }
        q->blocks[b] = id;
        s->host_pending[s->n_host_pending++] = h;
    }
    q->n_swapped = 0;
}

static fl_status preempt(fl_scheduler *s, int i) {
    fl_seq *q = s->running[i];
    if (!swap_out(s, q)) {
        release_blocks(s, q);
        q->n_computed = 0;
    }
    q->n_preempted++;
    s->n_preemptions++;
    remove_running(s, i);
    return push_waiting(s, q, true);
}

/* Admits waiting sequences in arrival order while the limits allow. */
static void admit(fl_scheduler *s, int *budget) {
    const int bs = s->cfg.block_size;
    while (s->w_len > 0 && s->n_running < s->cfg.max_num_seqs && *budget > 0) {
        fl_seq *q = s->waiting[s->w_head];
        match_prefix(s, q);
        int take = q->n_tokens - q->n_computed;
        if (take > *budget) take = *budget;
        if (q->n_swapped) {
            const int need = q->n_swapped + (q->n_computed + take + bs - 1) / bs - q->n_blocks;
            if (fl_kv_blocks_n_available(&s->blocks) < need) break; /* it stays swapped out */
            swap_in(s, q);
        }
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
        *budget -= take;
    }
}

/* The blocks published by the previous step become this step's persist
 * list (their K/V exist now), less those reallocated since. */
static void take_persists(fl_scheduler *s) {
    int32_t *t = s->persist_now;
    int tc = s->cap_persist_now;
    s->persist_now = s->persist_new, s->cap_persist_now = s->cap_persist_new;
    s->persist_new = t, s->cap_persist_new = tc;
    const size_t words = FL_PLAN_PERSIST_WORDS(s->cfg.block_size) + 1;
    int k = 0;
    for (int i = 0; i < s->n_persist_new; i++) {
        const int32_t *w = s->persist_now + (size_t)i * words;
        const int32_t id = w[0];
        if (!s->blocks.published[id] || s->blocks.hash[id] != fl_plan_get_u64(w + 1) ||
            s->blocks.gen[id] != (uint32_t)w[words - 1])
            continue;
        memmove(s->persist_now + (size_t)k++ * words, w, words * sizeof(int32_t));
    }
    s->n_persist_now = k;
    s->n_persist_new = 0;
}

/* The disk lists into the plan (after its swap lists). */
static fl_status plan_disk(fl_scheduler *s, fl_step_plan *plan) {
    FL_TRY(fl_step_plan_set_disk(plan, s->n_persist_now, s->n_disk_in));
    const size_t pw = FL_PLAN_PERSIST_WORDS(s->cfg.block_size);
    for (int i = 0; i < s->n_persist_now; i++)
        memcpy(plan->persist + (size_t)i * pw, s->persist_now + (size_t)i * (pw + 1), pw * sizeof(int32_t));
    if (s->n_disk_in) memcpy(plan->disk_in, s->disk_in, (size_t)s->n_disk_in * FL_PLAN_DISK_IN_WORDS * sizeof(int32_t));
    return FL_OK;
}

fl_status fl_scheduler_flush_persist(fl_scheduler *s, fl_step_plan *plan, int *n_persist) {
    s->n_disk_in = 0;
    take_persists(s);
    *n_persist = s->n_persist_now;
    FL_TRY(fl_step_plan_resize(plan, 0, 0, 1, 0, s->cfg.block_size));
    FL_TRY(fl_step_plan_set_swaps(plan, 0, 0));
    return plan_disk(s, plan);
}

fl_status fl_scheduler_schedule(fl_scheduler *s, fl_step_plan *plan) {
    int budget = s->cfg.max_num_batched_tokens;
    s->n_step = 0;
    s->n_swap_out = s->n_swap_in = 0;
    s->n_disk_in = 0;
    if (s->disk) take_persists(s);
    while (s->n_host_pending > 0) s->host_free[s->n_host_free++] = s->host_pending[--s->n_host_pending];
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
    admit(s, &budget);
    if (s->n_step == 0 && s->w_len > 0) {
        /* Nothing runs: the blocks that swapped-out sequences keep (shared
         * ones) may be what the head needs. Recompute them all instead. */
        bool dropped = false;
        for (int i = 0; i < s->w_len; i++) {
            fl_seq *q = s->waiting[(s->w_head + i) % s->w_cap];
            if (!q->n_swapped) continue;
            release_blocks(s, q);
            q->n_computed = 0;
            dropped = true;
        }
        if (dropped) admit(s, &budget);
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
    FL_TRY(fl_step_plan_set_swaps(plan, s->n_swap_out, s->n_swap_in));
    memcpy(plan->swap_out, s->swap_out, 2 * (size_t)s->n_swap_out * sizeof(int32_t));
    memcpy(plan->swap_in, s->swap_in, 2 * (size_t)s->n_swap_in * sizeof(int32_t));
    return plan_disk(s, plan);
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
