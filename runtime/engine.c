/*
 * engine.c — the engine step loop (see engine.h).
 */
#include "runtime/engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct fl_engine {
    fl_model *m;
    fl_engine_config cfg;
    fl_kv_cache kv;
    fl_forward *fwd;
    fl_scheduler sched;
    fl_step_plan plan;
    float *logits;       /* [max_logits, vocab] host */
    int max_logits;      /* rows projected per forward */
    void *sample_ws;
    fl_gen **updated;    /* [max_num_seqs] */
    int32_t eos[FL_MAX_EOS + 8];
    int n_eos;
    fl_engine_stats stats;
};

const char *fl_finish_reason_str(fl_finish_reason r) {
    switch (r) {
    case FL_FINISH_STOP: return "stop";
    case FL_FINISH_LENGTH: return "length";
    case FL_FINISH_ERROR: return "error";
    default: return "none";
    }
}

double fl_engine_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

fl_status fl_gen_init(fl_gen *g, int64_t id, const int32_t *prompt, int n_prompt,
                      const fl_sampling_params *sp, int max_new_tokens) {
    memset(g, 0, sizeof *g);
    FL_TRY(fl_seq_init(&g->seq, id, prompt, n_prompt));
    if (sp)
        g->sp = *sp;
    else
        fl_sampling_params_default(&g->sp);
    fl_rng_seed(&g->rng, g->sp.seed);
    g->max_new_tokens = max_new_tokens;
    return FL_OK;
}

void fl_gen_free(fl_gen *g) {
    if (g) fl_seq_free(&g->seq);
}

void fl_engine_config_default(fl_engine_config *c) {
    memset(c, 0, sizeof *c);
    c->block_size = 16;
    c->kv_cache_bytes = (size_t)1 << 30;
    c->max_num_seqs = 16;
    c->max_num_batched_tokens = 512;
}

/* The longest context the model was made for: max_position_embeddings,
 * stretched by the RoPE scaling factor for the kinds whose configs keep the
 * original length there (as vLLM derives max_model_len). */
static int derived_max_len(const fl_model_config *mc) {
    double len = mc->max_position_embeddings;
    const fl_rope_config *r = &mc->rope;
    if ((r->kind == FL_ROPE_LINEAR || r->kind == FL_ROPE_DYNAMIC) && r->factor > 1) len *= r->factor;
    if (r->kind == FL_ROPE_YARN && r->factor > 1 && r->original_max_pos > 0 &&
        r->original_max_pos * r->factor > len)
        len = r->original_max_pos * r->factor;
    return len > 1 << 30 ? 1 << 30 : (int)len;
}

fl_status fl_engine_init(fl_model *m, const fl_engine_config *cfg_in, fl_engine **out) {
    fl_status st = FL_OK;
    fl_engine *e = calloc(1, sizeof *e);
    if (!e) return FL_ERR(FL_ERR_OOM, "out of memory");
    e->m = m;
    e->cfg = *cfg_in;
    fl_engine_config *cfg = &e->cfg;
    const fl_model_config *mc = &m->cfg;
    const int kv_dim = m->dims.n_kv_heads * mc->head_dim; /* this rank's KV heads */
    if (cfg->n_blocks <= 0) {
        size_t per_block = fl_kv_cache_token_bytes(m->be, mc->n_layers, kv_dim) * cfg->block_size;
        cfg->n_blocks = (int)(cfg->kv_cache_bytes / per_block);
        if (cfg->n_blocks < 1) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "the KV cache budget (%zu bytes) holds no block of "
                        "%d tokens (%zu bytes)", cfg->kv_cache_bytes, cfg->block_size, per_block);
            goto fail;
        }
    }
    int cache_tokens = cfg->n_blocks * cfg->block_size;
    if (cfg->max_model_len <= 0) cfg->max_model_len = derived_max_len(mc);
    if (cfg->max_model_len <= 0 || cfg->max_model_len > cache_tokens) cfg->max_model_len = cache_tokens;
    FL_TRY_GOTO(fl_kv_cache_init(m->be, mc->n_layers, cfg->n_blocks, cfg->block_size, kv_dim, &e->kv),
                st, fail);
    fl_forward_limits lim = {
        .max_tokens = cfg->max_num_batched_tokens,
        .max_seqs = cfg->max_num_seqs,
        .max_blocks = (cfg->max_model_len + cfg->block_size - 1) / cfg->block_size,
        .max_logits = cfg->max_num_seqs > 64 ? cfg->max_num_seqs : 64,
    };
    e->max_logits = lim.max_logits;
    FL_TRY_GOTO(fl_forward_init(m, &e->kv, &lim, cfg->comm, &e->fwd), st, fail);
    fl_sched_config sc = {
        .block_size = cfg->block_size, .n_blocks = cfg->n_blocks,
        .max_num_seqs = cfg->max_num_seqs, .max_num_batched_tokens = cfg->max_num_batched_tokens,
        .max_model_len = cfg->max_model_len,
    };
    FL_TRY_GOTO(fl_scheduler_init(&e->sched, &sc), st, fail);
    e->logits = malloc((size_t)e->max_logits * mc->vocab_size * sizeof(float));
    e->sample_ws = malloc(fl_sampler_workspace_size(mc->vocab_size));
    e->updated = calloc((size_t)cfg->max_num_seqs, sizeof *e->updated);
    FL_CHECK_ALLOC(e->logits, st, fail);
    FL_CHECK_ALLOC(e->sample_ws, st, fail);
    FL_CHECK_ALLOC(e->updated, st, fail);
    for (int i = 0; i < mc->n_eos; i++) e->eos[e->n_eos++] = mc->eos_token_ids[i];
    for (int i = 0; i < cfg->n_extra_eos && e->n_eos < (int)(sizeof e->eos / sizeof e->eos[0]); i++)
        if (cfg->extra_eos[i] >= 0) e->eos[e->n_eos++] = cfg->extra_eos[i];
    cfg->extra_eos = NULL;
    cfg->n_extra_eos = 0;
    *out = e;
    return FL_OK;
fail:
    fl_engine_free(e);
    return st;
}

void fl_engine_free(fl_engine *e) {
    if (!e) return;
    fl_forward_free(e->fwd);
    fl_kv_cache_free(&e->kv);
    fl_scheduler_free(&e->sched);
    fl_step_plan_free(&e->plan);
    free(e->logits);
    free(e->sample_ws);
    free(e->updated);
    free(e);
}

int fl_engine_max_model_len(const fl_engine *e) { return e->cfg.max_model_len; }

fl_status fl_engine_add(fl_engine *e, fl_gen *g) {
    g->t_added = fl_engine_now();
    return fl_scheduler_add(&e->sched, &g->seq);
}

bool fl_engine_has_work(const fl_engine *e) { return fl_scheduler_has_work(&e->sched); }

void fl_engine_finish(fl_engine *e, fl_gen *g, fl_finish_reason r) {
    if (g->seq.state == FL_SEQ_FINISHED) return;
    fl_scheduler_finish(&e->sched, &g->seq);
    g->finish = r;
    g->t_finished = fl_engine_now();
}

static bool is_eos(const fl_engine *e, int32_t t) {
    for (int i = 0; i < e->n_eos; i++)
        if (e->eos[i] == t) return true;
    return false;
}

/* fl_seq is the first member of fl_gen, so the scheduler's pointers map back. */
static fl_gen *gen_of(fl_seq *s) { return (fl_gen *)s; }

bool fl_engine_is_leader(const fl_engine *e) { return !e->cfg.comm || fl_comm_rank(e->cfg.comm) == 0; }

enum { PLAN_RUN = 0, PLAN_STOP = 1 };

/* Rank 0 sends the plan it is about to run (header, then body) so every rank
 * runs the same step (DESIGN.md: "no rank decides anything on its own").
 * The plan is host data: it goes over MPI even when the communicator's
 * collectives are NCCL's. */
static fl_status share_plan(fl_engine *e, int cmd) {
    if (!e->cfg.comm) return FL_OK;
    e->plan.buf[6] = cmd;
    FL_TRY(fl_comm_broadcast_host(e->cfg.comm, e->plan.buf, FL_PLAN_HEADER, 0, FL_COMM_I32));
    if (cmd == PLAN_STOP) return FL_OK;
    return fl_comm_broadcast_host(e->cfg.comm, e->plan.buf + FL_PLAN_HEADER,
                             fl_step_plan_words(&e->plan) - FL_PLAN_HEADER, 0, FL_COMM_I32);
}

fl_status fl_engine_follow(fl_engine *e) {
    if (!e->cfg.comm || fl_engine_is_leader(e)) return FL_OK;
    int32_t hdr[FL_PLAN_HEADER];
    for (;;) {
        FL_TRY(fl_comm_broadcast_host(e->cfg.comm, hdr, FL_PLAN_HEADER, 0, FL_COMM_I32));
        if (hdr[6] == PLAN_STOP) return FL_OK;
        FL_TRY(fl_step_plan_from_header(&e->plan, hdr));
        FL_TRY(fl_comm_broadcast_host(e->cfg.comm, e->plan.buf + FL_PLAN_HEADER,
                                 fl_step_plan_words(&e->plan) - FL_PLAN_HEADER, 0, FL_COMM_I32));
        FL_TRY(fl_forward_run(e->fwd, &e->plan, NULL));
    }
}

fl_status fl_engine_release_followers(fl_engine *e) {
    if (!e->cfg.comm || !fl_engine_is_leader(e)) return FL_OK;
    FL_TRY(fl_step_plan_resize(&e->plan, 0, 0, 0, 0, 1));
    return share_plan(e, PLAN_STOP);
}

fl_status fl_engine_step(fl_engine *e, fl_gen ***updated, int *n_updated) {
    *n_updated = 0;
    *updated = e->updated;
    FL_TRY(fl_scheduler_schedule(&e->sched, &e->plan));
    if (e->plan.n_tokens == 0) {
        /* Nothing fits: the head of the queue can never run in this cache. */
        if (e->sched.w_len > 0) {
            fl_gen *g = gen_of(e->sched.waiting[e->sched.w_head]);
            snprintf(g->error, sizeof g->error, "request needs more KV cache than is available");
            fl_engine_finish(e, g, FL_FINISH_ERROR);
            e->updated[(*n_updated)++] = g;
        }
        return FL_OK;
    }
    double t0 = fl_engine_now();
    FL_TRY(share_plan(e, PLAN_RUN));
    FL_TRY(fl_forward_run(e->fwd, &e->plan, e->logits));
    e->stats.forward_seconds += fl_engine_now() - t0;
    e->stats.steps++;
    fl_scheduler_step_done(&e->sched);
    e->stats.preemptions = e->sched.n_preemptions;
    const int V = e->m->cfg.vocab_size;
    int lg = 0, n_step = e->sched.n_step;
    for (int i = 0; i < n_step; i++) {
        fl_seq *s = e->sched.step[i];
        if (s->step_rows == 1 && s->n_computed > s->n_prompt)
            e->stats.decode_tokens++;
        else
            e->stats.prefill_tokens += s->step_rows;
    }
    /* Sample after the loop above: finishing mutates the scheduler's lists,
     * but sched.step stays valid for this step. */
    for (int i = 0; i < n_step; i++) {
        fl_seq *s = e->sched.step[i];
        if (!s->step_sample) continue;
        fl_gen *g = gen_of(s);
        int32_t tok;
        FL_TRY(fl_sampler_sample(&g->sp, e->logits + (size_t)lg++ * V, V, s->tokens, s->n_tokens,
                                 &g->rng, e->sample_ws, &tok));
        FL_TRY(fl_seq_append(s, tok));
        if (g->t_first_token == 0) g->t_first_token = fl_engine_now();
        e->updated[(*n_updated)++] = g;
        if (is_eos(e, tok))
            fl_engine_finish(e, g, FL_FINISH_STOP);
        else if (fl_gen_n_generated(g) >= g->max_new_tokens || s->n_tokens >= e->cfg.max_model_len)
            fl_engine_finish(e, g, FL_FINISH_LENGTH);
    }
    return FL_OK;
}

fl_status fl_engine_prompt_logits(fl_engine *e, const int32_t *ids, int n, float *out) {
    if (fl_engine_has_work(e))
        return FL_ERR(FL_ERR_INTERNAL, "prompt_logits needs an idle engine");
    if (n < 1 || n > e->cfg.max_model_len)
        return FL_ERR(FL_ERR_INVALID_ARG, "prompt of %d tokens; this engine takes 1..%d", n,
                      e->cfg.max_model_len);
    fl_status st = FL_OK;
    fl_seq s;
    FL_TRY(fl_seq_init(&s, -1, ids, n));
    const int V = e->m->cfg.vocab_size, bs = e->cfg.block_size, nb = (n + bs - 1) / bs;
    s.blocks = malloc((size_t)nb * sizeof(int32_t));
    FL_CHECK_ALLOC(s.blocks, st, done);
    for (; s.n_blocks < nb; s.n_blocks++) {
        s.blocks[s.n_blocks] = fl_kv_blocks_alloc(&e->sched.blocks);
        if (s.blocks[s.n_blocks] < 0) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "prompt of %d tokens does not fit the KV cache", n);
            goto done;
        }
    }
    /* Chunks small enough for the rows and the logits buffers, every row projected. */
    int chunk = e->cfg.max_num_batched_tokens < e->max_logits ? e->cfg.max_num_batched_tokens
                                                              : e->max_logits;
    for (int lo = 0; lo < n; lo += chunk) {
        int cnt = n - lo < chunk ? n - lo : chunk;
        FL_TRY_GOTO(fl_step_plan_resize(&e->plan, cnt, 1, nb, cnt, bs), st, done);
        memcpy(e->plan.block_tables, s.blocks, (size_t)nb * sizeof(int32_t));
        e->plan.q_start[0] = 0;
        e->plan.q_start[1] = cnt;
        e->plan.ctx_len[0] = lo + cnt;
        e->plan.rope_len[0] = n;
        for (int j = 0; j < cnt; j++) {
            int pos = lo + j;
            e->plan.tokens[j] = ids[pos];
            e->plan.positions[j] = pos;
            e->plan.slots[j] = s.blocks[pos / bs] * bs + pos % bs;
            e->plan.logit_rows[j] = j;
        }
        FL_TRY_GOTO(share_plan(e, PLAN_RUN), st, done);
        FL_TRY_GOTO(fl_forward_run(e->fwd, &e->plan, out + (size_t)lo * V), st, done);
    }
done:
    fl_kv_blocks_release(&e->sched.blocks, s.blocks, s.n_blocks);
    fl_seq_free(&s);
    return st;
}

void fl_engine_get_stats(const fl_engine *e, fl_engine_stats *s) { *s = e->stats; }
