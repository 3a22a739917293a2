/*
 * test_prefix_cache.c — the prefix cache's allocator and scheduler (no
 * model): blocks are shared by reference across sequences with a common
 * prefix, cached blocks are evicted least recently used under pressure, a
 * diverging sequence gets its own blocks from the divergence on, a hash
 * collision (forced through the scheduler's block_hash hook) never shares,
 * the hit rate of a constructed workload is the expected number, and on
 * random workloads with preemption and eviction every sequence only ever
 * reads K/V that its own tokens produced (a simulated cache records, per
 * slot, the prefix that wrote it).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "runtime/engine/scheduler.h"

enum { BS = 4 };

static uint64_t chain(int n_blocks, const int32_t *tok) {
    uint64_t h = 0;
    for (int b = 0; b < n_blocks; b++) h = fl_kv_block_hash(7, h, tok + b * BS, BS);
    return h;
}

/* Allocates and publishes the n blocks of tok[n * BS] like the scheduler. */
static void put_seq(fl_kv_blocks *a, const int32_t *tok, int n, int32_t *ids) {
    for (int b = 0; b < n; b++) {
        ids[b] = fl_kv_blocks_alloc(a);
        assert_true(ids[b] >= 0);
        assert_true(fl_kv_blocks_publish(a, ids[b], chain(b + 1, tok), b ? ids[b - 1] : -1, tok + b * BS));
    }
}

/* Looks up the chain of tok[n * BS]; returns the blocks matched. */
static int get_seq(fl_kv_blocks *a, const int32_t *tok, int n, int32_t *ids) {
    int b = 0;
    for (; b < n; b++) {
        ids[b] = fl_kv_blocks_lookup(a, chain(b + 1, tok), b ? ids[b - 1] : -1, tok + b * BS);
        if (ids[b] < 0) break;
    }
    return b;
}

static void test_blocks_shared_refcounted(void **state) {
    (void)state;
    fl_kv_blocks a;
    assert_int_equal(fl_kv_blocks_init(&a, 8, BS), FL_OK);
    int32_t tok[12], ida[3], idb[3];
    for (int i = 0; i < 12; i++) tok[i] = 100 + i;
    put_seq(&a, tok, 3, ida);
    assert_int_equal(a.n_free, 5);
    /* a second sequence with the same prefix shares all three blocks */
    assert_int_equal(get_seq(&a, tok, 3, idb), 3);
    assert_memory_equal(ida, idb, sizeof ida);
    for (int b = 0; b < 3; b++) assert_int_equal(a.ref[ida[b]], 2);
    /* publishing an equal block again keeps the first copy the shared one */
    int32_t dup = fl_kv_blocks_alloc(&a);
    assert_false(fl_kv_blocks_publish(&a, dup, chain(1, tok), -1, tok));
    fl_kv_blocks_release(&a, &dup, 1);
    assert_int_equal(a.n_free, 5); /* unpublished: straight back to the free stack */
    fl_kv_blocks_release(&a, ida, 3);
    for (int b = 0; b < 3; b++) assert_int_equal(a.ref[ida[b]], 1);
    assert_int_equal(a.n_cached, 0);
    fl_kv_blocks_release(&a, idb, 3);
    /* refcount 0: kept with their content, evictable */
    assert_int_equal(a.n_cached, 3);
    assert_int_equal(a.n_free, 5);
    assert_int_equal(fl_kv_blocks_n_available(&a), 8);
    assert_int_equal(get_seq(&a, tok, 3, idb), 3);
    assert_int_equal(a.n_cached, 0);
    fl_kv_blocks_release(&a, idb, 3);
    fl_kv_blocks_free(&a);
}

static void test_lru_eviction(void **state) {
    (void)state;
    fl_kv_blocks a;
    assert_int_equal(fl_kv_blocks_init(&a, 4, BS), FL_OK);
    int32_t ta[8], tb[8], ida[2], idb[2], got[2];
    for (int i = 0; i < 8; i++) ta[i] = i, tb[i] = 50 + i;
    put_seq(&a, ta, 2, ida);
    put_seq(&a, tb, 2, idb);
    fl_kv_blocks_release(&a, ida, 2); /* LRU: a1, a0 (tails go first) */
    fl_kv_blocks_release(&a, idb, 2); /* ... b1, b0 */
    assert_int_equal(a.n_free, 0);
    assert_int_equal(a.n_cached, 4);
    assert_int_equal(a.lru_head, ida[1]);
    /* touching a's first block makes it the most recently used */
    assert_int_equal(get_seq(&a, ta, 1, got), 1);
    fl_kv_blocks_release(&a, got, 1);
    /* pressure: the least recently used block goes, the others stay */
    int32_t x = fl_kv_blocks_alloc(&a);
    assert_int_equal(x, ida[1]);
    assert_int_equal(a.n_evicted, 1);
    assert_int_equal(get_seq(&a, ta, 2, got), 1); /* a0 still cached, a1 gone */
    assert_int_equal(got[0], ida[0]);
    fl_kv_blocks_release(&a, got, 1);
    int32_t y = fl_kv_blocks_alloc(&a);
    assert_int_equal(y, idb[1]);
    assert_int_equal(get_seq(&a, tb, 2, got), 1);
    fl_kv_blocks_release(&a, got, 1);
    /* every block referenced: no room */
    int32_t z[2] = {fl_kv_blocks_alloc(&a), fl_kv_blocks_alloc(&a)};
    assert_true(z[0] >= 0 && z[1] >= 0);
    assert_int_equal(fl_kv_blocks_alloc(&a), -1);
    fl_kv_blocks_release(&a, z, 2);
    fl_kv_blocks_release(&a, &x, 1);
    fl_kv_blocks_release(&a, &y, 1);
    assert_int_equal(a.n_free, 4);
    fl_kv_blocks_free(&a);
}

/* Equal hashes, different tokens or a different parent: never a hit; both
 * blocks stay findable by their own content. A parent that was reused for
 * other content orphans its old children. */
static void test_collision_in_allocator(void **state) {
    (void)state;
    fl_kv_blocks a;
    assert_int_equal(fl_kv_blocks_init(&a, 6, BS), FL_OK);
    const int32_t t1[BS] = {1, 2, 3, 4}, t2[BS] = {1, 2, 3, 5};
    int32_t b1 = fl_kv_blocks_alloc(&a), b2 = fl_kv_blocks_alloc(&a);
    assert_true(fl_kv_blocks_publish(&a, b1, 42, -1, t1));
    assert_int_equal(fl_kv_blocks_lookup(&a, 42, -1, t2), -1);
    assert_true(fl_kv_blocks_publish(&a, b2, 42, -1, t2)); /* coexists under the same hash */
    int32_t h1 = fl_kv_blocks_lookup(&a, 42, -1, t1), h2 = fl_kv_blocks_lookup(&a, 42, -1, t2);
    assert_int_equal(h1, b1);
    assert_int_equal(h2, b2);
    /* same hash and tokens after another parent: a miss */
    int32_t c = fl_kv_blocks_alloc(&a);
    assert_true(fl_kv_blocks_publish(&a, c, 43, b1, t1));
    assert_int_equal(fl_kv_blocks_lookup(&a, 43, b2, t1), -1);
    int32_t hc = fl_kv_blocks_lookup(&a, 43, b1, t1);
    assert_int_equal(hc, c);
    int32_t rel[] = {b1, b2, c, h1, h2, hc};
    fl_kv_blocks_release(&a, rel, 6);
    assert_int_equal(a.n_cached, 3);
    fl_kv_blocks_free(&a);

    /* a parent evicted and reused orphans the children published after its
     * old content, even when the new content looks the same */
    assert_int_equal(fl_kv_blocks_init(&a, 2, BS), FL_OK);
    int32_t p = fl_kv_blocks_alloc(&a), ch = fl_kv_blocks_alloc(&a);
    assert_true(fl_kv_blocks_publish(&a, p, 1, -1, t1));
    assert_true(fl_kv_blocks_publish(&a, ch, 2, p, t2));
    fl_kv_blocks_release(&a, &p, 1);
    assert_int_equal(fl_kv_blocks_alloc(&a), p); /* evicts p, the only cached block */
    assert_true(fl_kv_blocks_publish(&a, p, 1, -1, t1));
    assert_int_equal(fl_kv_blocks_lookup(&a, 2, p, t2), -1);
    int32_t both[] = {p, ch};
    fl_kv_blocks_release(&a, both, 2);
    fl_kv_blocks_free(&a);
}

static fl_sched_config sched_cfg(int n_blocks, int seqs, int budget) {
    return (fl_sched_config){.block_size = BS, .n_blocks = n_blocks, .max_num_seqs = seqs,
                             .max_num_batched_tokens = budget, .max_model_len = 256,
                             .prefix_caching = true, .prefix_seed = 99};
}

static uint64_t all_collide(uint64_t seed, uint64_t parent, const int32_t *tokens, int n) {
    (void)seed, (void)parent, (void)tokens, (void)n;
    return 0x1234;
}

/* Schedules a step and checks its writes: no slot is written twice, and no
 * row writes into a block that held published (shareable) content before
 * the step. A block published by this very step may already be shared by a
 * sequence admitted after its writer: it reads the block only after the
 * step's writes. */
static void schedule_checked(fl_scheduler *s, fl_step_plan *p) {
    const int nb = s->cfg.n_blocks, bs = s->cfg.block_size;
    const bool on = s->blocks.published != NULL;
    bool *before = calloc((size_t)nb, sizeof *before);
    uint32_t *gen = calloc((size_t)nb, sizeof *gen);
    char *written = calloc((size_t)nb * bs, 1);
    if (on) {
        memcpy(before, s->blocks.published, (size_t)nb * sizeof *before);
        memcpy(gen, s->blocks.gen, (size_t)nb * sizeof *gen);
    }
    assert_int_equal(fl_scheduler_schedule(s, p), FL_OK);
    assert_int_equal(fl_step_plan_validate(p, (int64_t)nb * bs), FL_OK);
    for (int r = 0; r < p->n_tokens; r++) {
        const int b = p->slots[r] / bs;
        /* published content is only overwritten after its eviction (a new allocation) */
        if (on) assert_false(before[b] && gen[b] == s->blocks.gen[b]);
        assert_int_equal(written[p->slots[r]]++, 0);
    }
    free(before);
    free(gen);
    free(written);
}

/* One step (schedule_checked, done); sampled sequences get a token. */
static void step(fl_scheduler *s, fl_step_plan *p) {
    schedule_checked(s, p);
    fl_scheduler_step_done(s);
    for (int i = 0; i < s->n_step; i++)
        if (s->step[i]->step_sample) assert_int_equal(fl_seq_append(s->step[i], 1), FL_OK);
}

/* A shares 2 blocks with B, which diverges in its third block; C collides
 * with A under a constant hash (hook) and must not share. */
static void run_diverge(bool collide) {
    fl_scheduler s;
    fl_sched_config c = sched_cfg(32, 4, 64);
    assert_int_equal(fl_scheduler_init(&s, &c), FL_OK);
    if (collide) s.block_hash = all_collide;
    int32_t pa[14], pb[14], pc[14];
    for (int i = 0; i < 14; i++) pa[i] = pb[i] = i + 10, pc[i] = i + 500;
    pb[9] = 999; /* divergence inside block 2 */
    fl_seq a, b, cq;
    fl_step_plan plan = {0};
    assert_int_equal(fl_seq_init(&a, 0, pa, 14), FL_OK);
    assert_int_equal(fl_scheduler_add(&s, &a), FL_OK);
    step(&s, &plan);
    assert_int_equal(a.n_computed, 14);
    assert_int_equal(fl_seq_init(&b, 1, pb, 14), FL_OK);
    assert_int_equal(fl_seq_init(&cq, 2, pc, 14), FL_OK);
    assert_int_equal(fl_scheduler_add(&s, &cq), FL_OK);
    assert_int_equal(fl_scheduler_add(&s, &b), FL_OK);
    step(&s, &plan);
    /* C: nothing shared, though every hash is equal under the hook */
    for (int i = 0; i < cq.n_blocks; i++)
        for (int j = 0; j < a.n_blocks; j++) assert_int_not_equal(cq.blocks[i], a.blocks[j]);
    assert_int_equal(cq.n_cached, 0);
    /* B: A's first two blocks, its own from the divergence on */
    assert_int_equal(b.n_cached, 2 * BS);
    assert_int_equal(b.blocks[0], a.blocks[0]);
    assert_int_equal(b.blocks[1], a.blocks[1]);
    for (int i = 2; i < b.n_blocks; i++)
        for (int j = 0; j < a.n_blocks; j++) assert_int_not_equal(b.blocks[i], a.blocks[j]);
    assert_int_equal(s.blocks.ref[a.blocks[0]], 2);
    assert_int_equal(s.blocks.ref[a.blocks[2]], 1);
    /* the same prompt as A again: three full blocks, of which at most
     * (14 - 1) / 4 = 3 come from the cache */
    fl_seq d;
    assert_int_equal(fl_seq_init(&d, 3, pa, 14), FL_OK);
    assert_int_equal(fl_scheduler_add(&s, &d), FL_OK);
    step(&s, &plan);
    assert_int_equal(d.n_cached, 3 * BS);
    for (int i = 0; i < 3; i++) assert_int_equal(d.blocks[i], a.blocks[i]);
    assert_int_not_equal(d.blocks[3], a.blocks[3]); /* partial blocks are never shared */
    fl_seq *all[] = {&a, &b, &cq, &d};
    for (int i = 0; i < 4; i++) fl_scheduler_finish(&s, all[i]);
    assert_int_equal(fl_kv_blocks_n_available(&s.blocks), 32);
    for (int i = 0; i < 32; i++) assert_int_equal(s.blocks.ref[i], 0);
    for (int i = 0; i < 4; i++) fl_seq_free(all[i]);
    fl_step_plan_free(&plan);
    fl_scheduler_free(&s);
}

static void test_diverging_sequence(void **state) {
    (void)state;
    run_diverge(false);
}

static void test_forced_collision_does_not_share(void **state) {
    (void)state;
    run_diverge(true);
}

/* 8 requests behind one 64-token prefix, admitted in the same step: the
 * first computes the prefix, the 7 others share it (blocks are published
 * when planned). With a 64-token prompt and nothing after it, only
 * (64 - 1) / 16 = 3 whole blocks can come from the cache. */
static void run_hit_rate(int suffix, int64_t want_cached) {
    fl_scheduler s;
    fl_sched_config c = {.block_size = 16, .n_blocks = 256, .max_num_seqs = 16,
                         .max_num_batched_tokens = 2048, .max_model_len = 512, .prefix_caching = true};
    assert_int_equal(fl_scheduler_init(&s, &c), FL_OK);
    fl_seq q[8];
    int32_t p[64 + 16];
    for (int i = 0; i < 8; i++) {
        for (int j = 0; j < 64; j++) p[j] = 7 + j;
        for (int j = 0; j < suffix; j++) p[64 + j] = 1000 * (i + 1) + j;
        assert_int_equal(fl_seq_init(&q[i], i, p, 64 + suffix), FL_OK);
        assert_int_equal(fl_scheduler_add(&s, &q[i]), FL_OK);
    }
    fl_step_plan plan = {0};
    step(&s, &plan);
    assert_int_equal(s.n_step, 8); /* one step: sharing within it */
    assert_int_equal(s.prompt_tokens, 8 * (64 + suffix));
    assert_int_equal(s.cached_prompt_tokens, want_cached);
    assert_int_equal(plan.n_tokens, 8 * (64 + suffix) - want_cached);
    for (int i = 0; i < 8; i++) {
        fl_scheduler_finish(&s, &q[i]);
        fl_seq_free(&q[i]);
    }
    fl_step_plan_free(&plan);
    fl_scheduler_free(&s);
}

static void test_hit_rate(void **state) {
    (void)state;
    run_hit_rate(10, 7 * 64);
    run_hit_rate(0, 7 * 48);
}

/* Random workloads over a few shared prefixes, in a cache small enough to
 * force preemption and eviction. A simulated cache keeps, per slot, the
 * identity of the prefix whose last token wrote it; at every step each
 * sequence of the step must find its own prefixes at every position it
 * attends to. */
static uint32_t lcg = 777;
static int rnd(int n) {
    lcg = lcg * 1103515245u + 12345u;
    return (int)((lcg >> 8) % (uint32_t)n);
}

static uint64_t prefix_id(const int32_t *t, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)t[i]) * 1099511628211ull;
    return h;
}

static void run_random(bool collide, int n_blocks) {
    enum { N = 40 };
    fl_scheduler s;
    fl_sched_config c = sched_cfg(n_blocks, 5, 24);
    assert_int_equal(fl_scheduler_init(&s, &c), FL_OK);
    if (collide) s.block_hash = all_collide;
    const int slots = n_blocks * BS;
    uint64_t *sim = calloc((size_t)slots, sizeof *sim);
    fl_seq *q = calloc(N, sizeof *q);
    int max_new[N];
    int32_t p[64];
    for (int i = 0; i < N; i++) {
        int base = rnd(3), lp = rnd(3) == 0 ? 0 : 4 + rnd(20), n = lp + 1 + rnd(10);
        for (int j = 0; j < n; j++) p[j] = j < lp ? base * 100 + j : 5000 + i * 50 + j;
        assert_int_equal(fl_seq_init(&q[i], i, p, n), FL_OK);
        max_new[i] = 1 + rnd(12);
        assert_int_equal(fl_scheduler_add(&s, &q[i]), FL_OK);
    }
    fl_step_plan plan = {0};
    int done = 0, steps = 0;
    while (fl_scheduler_has_work(&s)) {
        assert_true(++steps < 100000);
        schedule_checked(&s, &plan);
        assert_true(plan.n_tokens > 0);
        for (int i = 0; i < s.n_step; i++) {
            fl_seq *x = s.step[i];
            for (int r = plan.q_start[i]; r < plan.q_start[i + 1]; r++)
                sim[plan.slots[r]] = prefix_id(x->tokens, plan.positions[r] + 1);
        }
        /* after the step's writes, each row attends to positions 0..its own */
        for (int i = 0; i < s.n_step; i++) {
            fl_seq *x = s.step[i];
            for (int pos = 0; pos < plan.ctx_len[i]; pos++) {
                int slot = x->blocks[pos / BS] * BS + pos % BS;
                assert_true(sim[slot] == prefix_id(x->tokens, pos + 1));
            }
        }
        fl_scheduler_step_done(&s);
        for (int i = 0; i < s.n_step; i++) {
            fl_seq *x = s.step[i];
            if (!x->step_sample) continue;
            int id = (int)x->id;
            /* generated tokens repeat across sequences now and then, so
             * decode blocks get shared too */
            assert_int_equal(fl_seq_append(x, x->n_tokens % 3), FL_OK);
            if (x->n_tokens - x->n_prompt >= max_new[id] || x->n_tokens >= c.max_model_len) {
                fl_scheduler_finish(&s, x);
                done++;
            }
        }
    }
    assert_int_equal(done, N);
    printf("  random workload (collide %d, %d blocks): %lld of %lld prompt tokens cached, %lld preemptions, %lld evictions\n", collide, n_blocks, (long long)s.cached_prompt_tokens, (long long)s.prompt_tokens, (long long)s.n_preemptions, (long long)s.blocks.n_evicted);
    assert_int_equal(fl_kv_blocks_n_available(&s.blocks), n_blocks);
    assert_true(s.cached_prompt_tokens > 0); /* under collisions too: tokens decide */
    if (n_blocks < 40) assert_true(s.n_preemptions > 0 || s.blocks.n_evicted > 0);
    for (int i = 0; i < N; i++) fl_seq_free(&q[i]);
    free(q);
    free(sim);
    fl_step_plan_free(&plan);
    fl_scheduler_free(&s);
}

static void test_random_workloads_read_own_kv(void **state) {
    (void)state;
    run_random(false, 200);
    run_random(false, 14);
    run_random(true, 200);
    run_random(true, 14);
}

/* Off: a plain free list, nothing cached, nothing counted as a hit. */
static void test_off(void **state) {
    (void)state;
    fl_scheduler s;
    fl_sched_config c = sched_cfg(16, 4, 64);
    c.prefix_caching = false;
    assert_int_equal(fl_scheduler_init(&s, &c), FL_OK);
    int32_t p[12];
    for (int i = 0; i < 12; i++) p[i] = i;
    fl_seq a, b;
    fl_step_plan plan = {0};
    assert_int_equal(fl_seq_init(&a, 0, p, 12), FL_OK);
    assert_int_equal(fl_seq_init(&b, 1, p, 12), FL_OK);
    assert_int_equal(fl_scheduler_add(&s, &a), FL_OK);
    step(&s, &plan);
    assert_int_equal(fl_scheduler_add(&s, &b), FL_OK);
    step(&s, &plan);
    assert_int_equal(b.n_cached, 0);
    assert_int_equal(s.cached_prompt_tokens, 0);
    fl_scheduler_finish(&s, &a);
    fl_scheduler_finish(&s, &b);
    assert_int_equal(s.blocks.n_free, 16);
    assert_int_equal(s.blocks.n_cached, 0);
    fl_seq_free(&a);
    fl_seq_free(&b);
    fl_step_plan_free(&plan);
    fl_scheduler_free(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_blocks_shared_refcounted),
        cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_collision_in_allocator),
        cmocka_unit_test(test_diverging_sequence),
        cmocka_unit_test(test_forced_collision_does_not_share),
        cmocka_unit_test(test_hit_rate),
        cmocka_unit_test(test_random_workloads_read_own_kv),
        cmocka_unit_test(test_off),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
