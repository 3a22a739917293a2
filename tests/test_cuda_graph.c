/*
 * test_cuda_graph.c — decode steps replayed as CUDA graphs (forward_graph.c)
 * against the same steps run eagerly, on the CUDA backend.
 *
 * Two forwards over one model, each with its own KV cache: graphs on and
 * graphs off. Both get the same hand-built plans: a prefill of three
 * sequences of different lengths, then greedy decode steps of the three
 * (batch bucket 4: one padding row), then of two (bucket 2), then of the
 * three again (replaying the bucket-4 graph captured earlier). Block size 4
 * with scattered block ids, so decode crosses block boundaries and the block
 * tables change between replays of one graph. Each step the greedy token of
 * both forwards must be the same, and the logits must agree within bf16
 * resolution (max |graph - eager| / max |eager| per row <= 2e-2; the padded
 * bucket may route a GEMV through another kernel variant than the eager
 * step's row count, so bit equality is not promised). The graph forward must
 * actually have captured and replayed (stats), the eager one never.
 *
 * Models: the golden llama fixture (bf16 weights: cuBLAS GEMMs inside the
 * graph) and a small synthetic llama quantized to W4 with packable shapes
 * (the tensor-core GEMV with programmatic dependent launch inside the graph).
 * MoE fixtures route their experts on the device (forward_moe_dev.c) and
 * are graphs too: mixtral (bf16 experts), and a synthetic Qwen3-MoE shape in
 * W4 (the routed tensor-core GEMV inside the graph); with FL_MOE_DEVICE=0
 * (routing on the host) mixtral must refuse graphs and still decode.
 *
 * test_emulated_on_cpu runs the same schedule on the CPU backend with
 * emulated replays, so CI (no GPU) covers everything but the capture; the
 * other tests skip cleanly (cmocka skip()) when no GPU is usable. The
 * context buckets (graphs keyed by the step's longest context too) have a
 * schedule of their own, on the GPU and emulated on the CPU.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_gpu.h"
#include "core/option.h"
#include "runtime/load/checkpoint.h"
#include "runtime/model/forward_graph.h"
#include "runtime/load/synth.h"

#define GOLDEN FL_TEST_DATA "/golden/"
#define BS 4      /* block size */
#define MAXB 16   /* blocks per sequence */
#define NSEQ 3
#define TOL 2e-2



typedef struct seq {
    int32_t toks[MAXB * BS];
    int n;        /* tokens so far */
    int cached;   /* tokens whose K/V are in the cache */
} seq;

/* Block j of sequence s: scattered, distinct over sequences. */
static int32_t block_of(int s, int j) { return (int32_t)((j * NSEQ + s) * 5 % (NSEQ * MAXB)); }

/* One step over the sequences in ids[0..k): each runs its uncached tokens,
 * logits of its last row. */
static void build_plan(fl_step_plan *p, seq *sq, const int *ids, int k) {
    int n_tok = 0;
    for (int i = 0; i < k; i++) n_tok += sq[ids[i]].n - sq[ids[i]].cached;
    OK(fl_step_plan_resize(p, n_tok, k, MAXB, k, BS));
    int row = 0;
    for (int i = 0; i < k; i++) {
        seq *s = &sq[ids[i]];
        p->q_start[i] = row;
        p->ctx_len[i] = s->n;
        p->rope_len[i] = s->n;
        for (int j = 0; j < MAXB; j++) p->block_tables[i * MAXB + j] = block_of(ids[i], j);
        for (int t = s->cached; t < s->n; t++, row++) {
            p->tokens[row] = s->toks[t];
            p->positions[row] = t;
            p->slots[row] = block_of(ids[i], t / BS) * BS + t % BS;
        }
        p->logit_rows[i] = row - 1;
    }
    p->q_start[k] = row;
    OK(fl_step_plan_validate(p, NSEQ * MAXB * BS));
}

static int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

static double row_rel_err(const float *a, const float *ref, int V) {
    double num = 0, den = 0;
    for (int v = 0; v < V; v++) {
        if (isnan(a[v]) || isnan(ref[v])) return INFINITY;
        double d = fabs((double)a[v] - ref[v]);
        num = d > num ? d : num;
        den = fabs(ref[v]) > den ? fabs(ref[v]) : den;
    }
    return den > 0 ? num / den : num;
}

/* Runs the schedule described at the top on graph and eager forwards over
 * model m; expect_graphs: whether the graph forward must capture. */
static void run_schedule(fl_backend *be, fl_model *m, const char *name, bool expect_graphs, bool emulate,
                         double tol) {
    const int V = m->cfg.vocab_size, L = m->cfg.n_layers, kvd = m->dims.n_kv_heads * m->cfg.head_dim;
    fl_kv_cache kv[2];
    fl_forward *f[2];
    fl_forward_limits lim = {.max_tokens = 64, .max_seqs = 4, .max_blocks = MAXB, .max_logits = 4};
    for (int i = 0; i < 2; i++) {
        OK(fl_kv_cache_init(be, L, NSEQ * MAXB, BS, kvd, &kv[i]));
        OK(fl_forward_init(m, &kv[i], &lim, NULL, NULL, &f[i]));
    }
    if (emulate) OK(fl_forward_graph_emulate(f[0]));
    fl_forward_graph_enable(f[1], false);
    seq sq[NSEQ];
    memset(sq, 0, sizeof sq);
    static const int plen[NSEQ] = {5, 9, 3};
    for (int s = 0; s < NSEQ; s++) {
        sq[s].n = plen[s];
        for (int t = 0; t < plen[s]; t++) sq[s].toks[t] = (int32_t)((s * 131 + t * 37 + 1) % V);
    }
    fl_step_plan p = {0};
    float *lg[2] = {malloc(sizeof(float) * 4 * V), malloc(sizeof(float) * 4 * V)};
    static const int all[NSEQ] = {0, 1, 2}, two[2] = {2, 0};
    /* step 0: prefill all; then 6 decode steps of 3, 5 of 2, 6 of 3 */
    const int n_steps = 18;
    double worst = 0;
    for (int step = 0; step < n_steps; step++) {
        const int *ids = step >= 7 && step < 12 ? two : all;
        const int k = step >= 7 && step < 12 ? 2 : NSEQ;
        build_plan(&p, sq, ids, k);
        for (int i = 0; i < 2; i++) OK(fl_forward_run(f[i], &p, lg[i], NULL));
        for (int i = 0; i < k; i++) {
            seq *s = &sq[ids[i]];
            const float *a = lg[0] + (size_t)i * V, *b = lg[1] + (size_t)i * V;
            const double e = row_rel_err(a, b, V);
            worst = e > worst ? e : worst;
            if (!(e <= tol))
                fail_msg("%s step %d seq %d: graph vs eager logits differ by %.3e (> %.1e)", name, step,
                         ids[i], e, tol);
            const int ta = argmax(a, V), tb = argmax(b, V);
            if (ta != tb) fail_msg("%s step %d seq %d: greedy token %d with graphs, %d without", name, step,
                                   ids[i], ta, tb);
            s->cached = s->n;
            s->toks[s->n++] = ta;
        }
    }
    fl_forward_graph_stats gs[2];
    fl_forward_graph_get_stats(f[0], &gs[0]);
    fl_forward_graph_get_stats(f[1], &gs[1]);
    printf("  %-10s %d steps: worst graph-vs-eager logit error %.2e; graph forward %ld captures, "
           "%ld replays of %ld decode steps%s%s\n",
           name, n_steps, worst, gs[0].captures, gs[0].replays, gs[0].decode_steps,
           gs[0].why_off[0] ? "; off: " : "", gs[0].why_off);
    assert_int_equal(gs[0].decode_steps, n_steps - 1);
    assert_int_equal(gs[1].replays, 0);
    assert_int_equal(gs[1].captures, 0);
    if (expect_graphs) {
        assert_true(gs[0].enabled);
        assert_int_equal(gs[0].capture_failures, 0);
        assert_int_equal(gs[0].captures, 2); /* buckets 4 and 2 */
        assert_int_equal(gs[0].replays, n_steps - 1 - 2);
    } else {
        assert_false(gs[0].enabled);
        assert_int_equal(gs[0].replays, 0);
    }
    fl_step_plan_free(&p);
    for (int i = 0; i < 2; i++) {
        fl_forward_free(f[i]);
        fl_kv_cache_free(&kv[i]);
        free(lg[i]);
    }
}

/* The golden fixture `name` (tests/golden/) on backend be, as stored. */
static void load_golden(fl_backend *be, const char *name, fl_ckpt **ck, fl_model **m) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s%s", GOLDEN, name);
    OK(fl_ckpt_open(dir, ck));
    fl_model_load_opts lo = {.quant = FL_LOAD_AS_STORED};
    OK(fl_model_load(*ck, be, &lo, m));
}

/* moe_device: the FL_MOE_DEVICE value while the forwards are made (NULL:
 * the default), set through the registry (read once from the environment). */
static void run_fixture(const char *name, bool expect_graphs, const char *moe_device) {
    NEED_GPU();
    fl_ckpt *ck;
    fl_model *m;
    load_golden(g_be, name, &ck, &m);
    if (moe_device) OK(fl_opt_override(FL_OPT_MOE_DEVICE, moe_device));
    run_schedule(g_be, m, name, expect_graphs, false, TOL);
    OK(fl_opt_override(FL_OPT_MOE_DEVICE, NULL));
    fl_model_free(m);
    fl_ckpt_free(ck);
}

static void test_llama_bf16(void **state) {
    (void)state;
    run_fixture("llama", true, NULL);
}

static void test_mixtral(void **state) {
    (void)state;
    run_fixture("mixtral", true, NULL);
}

/* MLA attention (its split-context decode and workspace) and DeepSeek's
 * group-limited routing inside the graph. */
static void test_deepseek_v2_lite(void **state) {
    (void)state;
    run_fixture("deepseek_v2_lite", true, NULL);
}

static void test_mixtral_host_routed_refuses(void **state) {
    (void)state;
    run_fixture("mixtral", false, "0");
}

/* A small Qwen3-MoE shape in W4 with packable expert shapes (64 experts,
 * top 8, 256 columns each): the routed W4 GEMV inside the graph. */
static void test_synth_moe_w4(void **state) {
    (void)state;
    NEED_GPU();
    fl_model_config cfg;
    OK(fl_synth_preset("qwen3-30b-a3b", &cfg));
    cfg.n_layers = 2, cfg.hidden_size = 512, cfg.n_heads = 8, cfg.n_kv_heads = 2, cfg.head_dim = 64;
    cfg.n_experts = 64, cfg.moe_intermediate_size = 256, cfg.vocab_size = 2048;
    fl_model *m;
    OK(fl_synth_model(&cfg, NULL, g_be, FL_LOAD_W4, 11, &m));
    run_schedule(g_be, m, "synth-moe-w4", true, false, TOL);
    fl_model_free(m);
}

/* A synthetic llama with W4 shapes the packed tensor-core GEMV takes. */
static void test_synth_w4(void **state) {
    (void)state;
    NEED_GPU();
    fl_model *m;
    synth_small_llama(2, FL_LOAD_W4, 7, &m);
    run_schedule(g_be, m, "synth-w4", true, false, TOL);
    fl_model_free(m);
}

/* No GPU needed: the CPU backend (which cannot capture) with emulated
 * graphs (fl_forward_graph_emulate: a replay re-runs the step's ops on the
 * refreshed fixed tables). Covers, in CI, the bucket tables, padding rows
 * (slot -1, context 0) and the replay bookkeeping against plain eager
 * steps; f32 activations, so the only difference allowed is f32 rounding.
 * MoE models with device routing replay too (the mixtral, qwen2_moe,
 * qwen3_moe and deepseek_v2 (MLA) fixtures); with FL_MOE_DEVICE=0 mixtral
 * stays eager even when emulation is asked for. */
static void test_emulated_on_cpu(void **state) {
    (void)state;
    fl_backend *cpu;
    OK(fl_backend_cpu_init(&cpu));
    static const char *names[] = {"llama", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "mixtral"};
    for (int i = 0; i < 6; i++) {
        fl_ckpt *ck;
        fl_model *m;
        load_golden(cpu, names[i], &ck, &m);
        char what[64];
        snprintf(what, sizeof what, "%s-cpu%s", names[i], i == 5 ? "-host" : "");
        if (i == 5) OK(fl_opt_override(FL_OPT_MOE_DEVICE, "0")); /* routed on the host: no graphs */
        run_schedule(cpu, m, what, i != 5, true, 1e-5);
        OK(fl_opt_override(FL_OPT_MOE_DEVICE, NULL));
        fl_model_free(m);
        fl_ckpt_free(ck);
    }
    fl_backend_free(cpu);
}

/* --- context buckets --------------------------------------------------------------
 * A decode graph is keyed by (batch bucket, context bucket): the smallest of
 * 128, 256, ... (then the limit) holding the step's longest sequence, so
 * attention sizes its work for that, not for the forward's limit. Block size
 * 16, 24 blocks (a limit of 384: buckets 128, 256, 384). Sequence A (prompt
 * 124) decodes through 125..130 (buckets 128, then 256), then sequence B
 * (prompt 252) through 253..258 (256 again: a replay of A's graph, then
 * 384): 12 decode steps, 3 captures, every step's logits and greedy token
 * the eager forward's. With graph_ctx_buckets off one capture (the limit). */
enum { CB_BS = 16, CB_MAXB = 24, CB_STEPS = 6 };

static void run_ctx_buckets(fl_backend *be, fl_model *m, const char *name, bool emulate, double tol, bool buckets) {
    const int V = m->cfg.vocab_size, L = m->cfg.n_layers, kvd = m->dims.n_kv_heads * m->cfg.head_dim;
    fl_kv_cache kv[2];
    fl_forward *f[2];
    fl_forward_limits lim = {.max_tokens = 256, .max_seqs = 1, .max_blocks = CB_MAXB, .max_logits = 1};
    fl_forward_config fc;
    fl_forward_config_default(&fc);
    fc.graph_ctx_buckets = buckets;
    for (int i = 0; i < 2; i++) {
        OK(fl_kv_cache_init(be, L, 2 * CB_MAXB, CB_BS, kvd, &kv[i]));
        OK(fl_forward_init(m, &kv[i], &lim, NULL, &fc, &f[i]));
    }
    if (emulate) OK(fl_forward_graph_emulate(f[0]));
    fl_forward_graph_enable(f[1], false);
    fl_step_plan p = {0};
    float *lg[2] = {malloc(sizeof(float) * V), malloc(sizeof(float) * V)};
    int32_t toks[CB_MAXB * CB_BS];
    static const int plen[2] = {124, 252};
    double worst = 0;
    for (int sq = 0; sq < 2; sq++) {
        int n = plen[sq], cached = 0;
        for (int t = 0; t < n; t++) toks[t] = (int32_t)((sq * 131 + t * 37 + 1) % V);
        for (int step = 0; step <= CB_STEPS; step++) { /* the prefill, then CB_STEPS decode steps */
            OK(fl_step_plan_resize(&p, n - cached, 1, CB_MAXB, 1, CB_BS));
            p.q_start[0] = 0, p.q_start[1] = n - cached;
            p.ctx_len[0] = n, p.rope_len[0] = n;
            for (int j = 0; j < CB_MAXB; j++) p.block_tables[j] = sq * CB_MAXB + (j * 7) % CB_MAXB;
            for (int t = cached; t < n; t++) {
                p.tokens[t - cached] = toks[t];
                p.positions[t - cached] = t;
                p.slots[t - cached] = p.block_tables[t / CB_BS] * CB_BS + t % CB_BS;
            }
            p.logit_rows[0] = n - cached - 1;
            OK(fl_step_plan_validate(&p, 2 * CB_MAXB * CB_BS));
            for (int i = 0; i < 2; i++) OK(fl_forward_run(f[i], &p, lg[i], NULL));
            const double e = row_rel_err(lg[0], lg[1], V);
            worst = e > worst ? e : worst;
            if (!(e <= tol)) fail_msg("%s seq %d at %d: graph vs eager logits differ by %.3e", name, sq, n, e);
            const int ta = argmax(lg[0], V), tb = argmax(lg[1], V);
            if (ta != tb) fail_msg("%s seq %d at %d: greedy token %d with graphs, %d without", name, sq, n, ta, tb);
            cached = n;
            toks[n++] = ta;
        }
    }
    fl_forward_graph_stats gs;
    fl_forward_graph_get_stats(f[0], &gs);
    printf("  %-16s context buckets %s: worst graph-vs-eager logit error %.2e; %ld captures, %ld replays of %ld "
           "decode steps\n", name, buckets ? "on" : "off", worst, gs.captures, gs.replays, gs.decode_steps);
    assert_int_equal(gs.decode_steps, 2 * CB_STEPS);
    assert_int_equal(gs.captures, buckets ? 3 : 1);
    assert_int_equal(gs.replays, 2 * CB_STEPS - (buckets ? 3 : 1));
    fl_step_plan_free(&p);
    for (int i = 0; i < 2; i++) {
        fl_forward_free(f[i]);
        fl_kv_cache_free(&kv[i]);
        free(lg[i]);
    }
}

static void ctx_buckets_on(fl_backend *be, const char *tag, bool emulate, double tol) {
    fl_ckpt *ck;
    fl_model *m;
    load_golden(be, "llama", &ck, &m);
    run_ctx_buckets(be, m, tag, emulate, tol, true);
    run_ctx_buckets(be, m, tag, emulate, tol, false);
    fl_model_free(m);
    fl_ckpt_free(ck);
}

static void test_ctx_buckets(void **state) {
    (void)state;
    NEED_GPU();
    ctx_buckets_on(g_be, "llama", false, TOL);
}

static void test_ctx_buckets_emulated_on_cpu(void **state) {
    (void)state;
    fl_backend *cpu;
    OK(fl_backend_cpu_init(&cpu));
    ctx_buckets_on(cpu, "llama-cpu", true, 1e-5);
    fl_backend_free(cpu);
}

/* cuda_graphs off (--cuda-graphs off, FL_CUDA_GRAPHS=0; read when the
 * forward is created) keeps graphs off, and the reason says how to turn
 * them back on. */
static void test_env_off(void **state) {
    (void)state;
    NEED_GPU();
    fl_ckpt *ck;
    fl_model *m;
    load_golden(g_be, "llama", &ck, &m);
    fl_kv_cache kv;
    fl_forward *f;
    fl_forward_limits lim = {.max_tokens = 64, .max_seqs = 4, .max_blocks = MAXB, .max_logits = 4};
    OK(fl_kv_cache_init(g_be, m->cfg.n_layers, NSEQ * MAXB, BS, m->dims.n_kv_heads * m->cfg.head_dim, &kv));
    fl_forward_config fc;
    fl_forward_config_default(&fc);
    fc.cuda_graphs = false;
    OK(fl_forward_init(m, &kv, &lim, NULL, &fc, &f));
    fl_forward_graph_stats gs;
    fl_forward_graph_get_stats(f, &gs);
    assert_false(gs.enabled);
    assert_non_null(strstr(gs.why_off, "--cuda-graphs off"));
    assert_non_null(strstr(gs.why_off, "FL_CUDA_GRAPHS"));
    fl_forward_free(f);
    fl_kv_cache_free(&kv);
    fl_model_free(m);
    fl_ckpt_free(ck);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_bf16),
        cmocka_unit_test(test_synth_w4),
        cmocka_unit_test(test_mixtral),
        cmocka_unit_test(test_deepseek_v2_lite),
        cmocka_unit_test(test_mixtral_host_routed_refuses),
        cmocka_unit_test(test_synth_moe_w4),
        cmocka_unit_test(test_env_off),
        cmocka_unit_test(test_emulated_on_cpu),
        cmocka_unit_test(test_ctx_buckets),
        cmocka_unit_test(test_ctx_buckets_emulated_on_cpu),
    };
    return cmocka_run_group_tests(tests, gpu_group_setup, gpu_group_teardown);
}
