/*
 * test_decode_steps.c — every decode position of every golden fixture
 * against float64 references, through the real decode path: a prefill step,
 * then one token per step over the paged KV cache (block size 16, blocks in
 * scattered order), each step a plan run by fl_forward_run as the engine
 * runs it (CUDA: graph replays of decode steps when graphs are on).
 *
 * References (tests/golden/make_decode_refs.py, transformers in float64
 * with its KV cache): decode_ref.json + decode_logits.f32 in each fixture,
 * the greedy continuation of 32 tokens and the logits after the prompt and
 * after each continuation token; and for llama a 520-token prompt
 * (decode_long.*), prefilled in chunks of 256 as a chunked prefill would.
 * The test feeds the reference tokens (teacher forcing), so one near-tie
 * that flips a greedy token cannot cascade: every position is checked
 * against its own reference row.
 *
 * Checks, per fixture (tolerances in the table below):
 *  - every row's max |ours - ref| / max |ref| <= tol (f32 CPU: 2e-5; bf16
 *    CUDA: 5e-2, a few positions of the MoE fixtures over it allowed where
 *    bf16 can flip an expert choice, the median under tol / 2, as
 *    test_cuda_golden.c argues);
 *  - the greedy token equals the reference's wherever the reference's top-2
 *    margin exceeds twice that row's measured max abs error; where it does
 *    not (a near tie at this precision), a different token is reported, not
 *    failed. A decode bug (wrong KV slot, rope position, cache layout, graph
 *    table) shows as a logit error far over tol, not as a tie.
 *
 * --kv int8: the same over an int8 KV cache (kernels/backend.h,
 * kv_int8_head_dim; MLA fixtures where the backend reads MLA records in
 * int8, kv_int8_mla), every row within
 * INT8_TOL of the reference: the per-head, per-token absmax / 127 step
 * moves logits by a few percent of the row's largest on these fixtures'
 * random weights (tests/test_kv_int8.c measures the prompt rows); MoE rows
 * at routing near-ties are reported, not asserted, as on bf16. --kv fp8: the
 * same records with e4m3 codes (kv_fp8_codes, absmax / 448), within FP8_TOL:
 * 3 mantissa bits round each value by up to 1/16 of itself. --kv bf16: a
 * 16-bit cache under f32 activations (kernels/backend.h, kv_bf16), within
 * the fixture's bf16 tolerance (its cached values round as a bf16
 * backend's do, its arithmetic stays f32).
 *
 * --vs-plain: the same steps also through the plain op sequence
 * (FL_DECODE_LAYER=0, its own cache) on the same backend, each decode row
 * of the backend's decode_layer within the row tolerance of the plain
 * row (rows at routing near-ties reported): the op against its reference.
 * A backend without decode_layer has nothing to compare.
 *
 *   test_decode_steps [--backend cpu|cuda] [--graphs on|off|emulate] [--kv int8|fp8|bf16] [--vs-plain] [fixture...]
 * The backend also comes from FL_TEST_BACKEND. --graphs: CUDA graph
 * replays of the decode steps (default on, where the backend has graphs);
 * emulate: the CPU backend's emulated replays (fl_forward_graph_emulate).
 * A CUDA run that cannot start a CUDA backend skips, or fails under
 * FL_REQUIRE_GPU=1.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/test_util.h"

#include "core/option.h"
#include "kernels/backend.h"
#include "runtime/engine/kv_cache.h"
#include "runtime/engine/mem_plan.h"
#include "runtime/engine/plan.h"
#include "runtime/load/checkpoint.h"
#include "runtime/model/forward.h"
#include "runtime/model/forward_graph.h"
#include "runtime/model/model.h"

#define GOLDEN FL_TEST_DATA "/golden/"
#define BS 16

#define OK(call)                                                                               \
    do {                                                                                       \
        fl_status st_ = (call);                                                                \
        if (st_ != FL_OK) fail_msg("%s -> %s: %s", #call, fl_status_str(st_), fl_error_msg()); \
    } while (0)

/* One fixture's reference: the file stem in the fixture folder, the
 * relative tolerance on f32 (CPU) and bf16 (CUDA) backends, and how many
 * rows a bf16 run may have over its tolerance. On bf16, MoE rows at a
 * routing near-tie (the reference's top-k router margin under ROUTE_TIE of
 * the router's largest |logit|: bf16 hidden states are that far off after a
 * few layers) are reported, not asserted, and the rows after one get twice
 * the tolerance (the other expert's output went into the KV cache). */
#define ROUTE_TIE 3e-2
typedef struct fixture {
    const char *name, *stem;
    double tol_f32, tol_bf16;
    int bf16_over;
    bool dense; /* no MoE / MLA: CUDA graphs must replay its decode steps */
} fixture;

static const fixture FIXTURES[] = {
    {"llama", "decode_ref", 2e-5, 5e-2, 0, true},
    {"llama", "decode_long", 2e-5, 5e-2, 0, true},
    {"llama_awq", "decode_ref", 2e-5, 5e-2, 0, true},
    {"llama_tied_rope3", "decode_ref", 2e-5, 5e-2, 0, true},
    {"llama_linear", "decode_ref", 2e-5, 5e-2, 0, true},
    {"llama_dynamic", "decode_ref", 2e-5, 5e-2, 0, true},
    {"llama_yarn", "decode_ref", 2e-5, 5e-2, 0, true},
    {"qwen2", "decode_ref", 2e-5, 5e-2, 0, true},
    {"mixtral", "decode_ref", 2e-5, 5e-2, 2, false},
    {"qwen2_moe", "decode_ref", 2e-5, 5e-2, 2, false},
    {"qwen3_moe", "decode_ref", 2e-5, 5e-2, 2, false},
    {"deepseek_v2", "decode_ref", 2e-5, 5e-2, 4, false},
    {"deepseek_v2_lite", "decode_ref", 2e-5, 5e-2, 4, false},
};
#define N_FIXTURES (sizeof FIXTURES / sizeof FIXTURES[0])

#define INT8_TOL 6e-2
#define FP8_TOL 1.5e-1

static fl_backend *g_be;
static bool g_kv_int8; /* --kv int8 or fp8 */
static bool g_kv_fp8;  /* --kv fp8 */
static bool g_kv_bf16; /* --kv bf16 */
static bool g_vs_plain; /* --vs-plain: the backend's decode_layer against its plain ops, row by row */
/* Checks that fail are counted and the other fixtures still run, so one
 * GPU run shows every fixture's state. */
static int g_failed;
#define FX_FAIL(...)                   \
    do {                               \
        printf("  FAILED: " __VA_ARGS__); \
        printf("\n");                  \
        g_failed++;                    \
    } while (0)
static char g_why[512];
static const char *g_backend = "cpu";
static const char *g_graphs = "on";
static char **g_only;
static int g_n_only;

typedef struct dref {
    cJSON *json;
    char *text;
    int32_t *prompt, *tokens;
    int T, N, V;
    float *rows;   /* [N + 1, V] */
    double *margin; /* [N + 1] MoE fixtures: the row's smallest routing margin (make_decode_refs.py), else NULL */
} dref;

static void dref_load(const fixture *fx, dref *r) {
    char path[700];
    memset(r, 0, sizeof *r);
    snprintf(path, sizeof path, "%s%s/%s.json", GOLDEN, fx->name,
             strcmp(fx->stem, "decode_ref") ? fx->stem : "decode_ref");
    r->text = fl_test_slurp(path, NULL);
    r->json = cJSON_Parse(r->text);
    if (!r->json) fail_msg("%s: not JSON", path);
    r->prompt = fl_test_int_array(cJSON_GetObjectItem(r->json, "prompt_ids"), &r->T);
    r->tokens = fl_test_int_array(cJSON_GetObjectItem(r->json, "tokens"), &r->N);
    r->V = cJSON_GetObjectItem(r->json, "vocab_size")->valueint;
    const int n_rows = cJSON_GetObjectItem(r->json, "n_rows")->valueint;
    assert_int_equal(n_rows, r->N + 1);
    snprintf(path, sizeof path, "%s%s/%s", GOLDEN, fx->name,
             cJSON_GetObjectItem(r->json, "logits_file")->valuestring);
    size_t nbytes;
    r->rows = (float *)fl_test_slurp(path, &nbytes);
    assert_int_equal(nbytes, sizeof(float) * (size_t)n_rows * r->V);
    const cJSON *mg = cJSON_GetObjectItem(r->json, "router_margin");
    if (mg) {
        assert_int_equal(cJSON_GetArraySize(mg), n_rows);
        r->margin = malloc(sizeof(double) * (size_t)n_rows);
        for (int i = 0; i < n_rows; i++) r->margin[i] = cJSON_GetArrayItem(mg, i)->valuedouble;
    }
}
static void dref_free(dref *r) {
    free(r->prompt);
    free(r->tokens);
    free(r->rows);
    free(r->margin);
    cJSON_Delete(r->json);
    free(r->text);
}

/* A plan of rows [t0, t1) of the sequence ids (one sequence), logits of the last row. */
static void build_step(fl_step_plan *p, const int32_t *ids, int t0, int t1, int rope_len, int max_blocks,
                       const int32_t *bt) {
    OK(fl_step_plan_resize(p, t1 - t0, 1, max_blocks, 1, BS));
    p->q_start[0] = 0, p->q_start[1] = t1 - t0;
    p->ctx_len[0] = t1;
    p->rope_len[0] = rope_len;
    for (int j = 0; j < max_blocks; j++) p->block_tables[j] = bt[j];
    for (int t = t0; t < t1; t++) {
        p->tokens[t - t0] = ids[t];
        p->positions[t - t0] = t;
        p->slots[t - t0] = bt[t / BS] * BS + t % BS;
    }
    p->logit_rows[0] = t1 - t0 - 1;
    fl_step_plan_set_output(p, FL_PLAN_LOGITS);
    OK(fl_step_plan_validate(p, (int64_t)max_blocks * 2 * BS));
}

static int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}
static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void run_fixture(const fixture *fx) {
    dref r;
    dref_load(fx, &r);
    char dir[512];
    snprintf(dir, sizeof dir, "%s%s", GOLDEN, fx->name);
    fl_ckpt *ck;
    fl_model *m;
    OK(fl_ckpt_open(dir, &ck));
    fl_model_load_opts lo = {.quant = FL_LOAD_AS_STORED};
    OK(fl_model_load(ck, g_be, &lo, &m));
    assert_int_equal(m->cfg.vocab_size, r.V);
    const bool bf16 = g_be->act_dtype != FL_DTYPE_F32;
    double tol = bf16 ? fx->tol_bf16 : fx->tol_f32;
    if (g_kv_int8) {
        if ((m->cfg.arch == FL_ARCH_DEEPSEEK_V2 && !g_be->ops->kv_int8_mla) || (g_kv_fp8 && !g_be->ops->kv_fp8)) {
            printf("  %-17s skipped: no %s KV for this model on this backend\n", fx->name, g_kv_fp8 ? "fp8" : "int8");
            fl_model_free(m);
            fl_ckpt_free(ck);
            dref_free(&r);
            return;
        }
        tol = fmax(tol, g_kv_fp8 ? FP8_TOL : INT8_TOL);
    }
    if (g_kv_bf16) {
        if (!bf16 && !g_be->ops->kv_bf16) {
            printf("  %-17s skipped: no bf16 KV on this backend\n", fx->name);
            fl_model_free(m);
            fl_ckpt_free(ck);
            dref_free(&r);
            return;
        }
        tol = fx->tol_bf16;
    }

    /* the sequence's blocks, scattered over twice as many as it needs */
    const int len = r.T + r.N, max_blocks = (len + BS - 1) / BS, n_blocks = 2 * max_blocks;
    int32_t *bt = malloc(sizeof(int32_t) * max_blocks);
    for (int j = 0; j < max_blocks; j++) bt[j] = (int32_t)(n_blocks - 1 - 2 * j); /* distinct, descending */
    const int chunk = r.T > 256 ? 256 : r.T;
    fl_kv_cache kv;
    fl_forward *f;
    /* the engine's cache: head by head within blocks where the backend lays it out so */
    const fl_kv_dtype kvd = g_kv_fp8 ? FL_KV_DTYPE_FP8 : g_kv_int8 ? FL_KV_DTYPE_INT8 : g_kv_bf16 ? FL_KV_DTYPE_BF16
                            : bf16 ? FL_KV_DTYPE_BF16 : FL_KV_DTYPE_F32;
    OK(fl_kv_cache_init_dtype(g_be, m->cfg.n_layers, n_blocks, BS, m->dims.n_kv_heads * m->cfg.head_dim, kvd,
                              m->cfg.arch == FL_ARCH_DEEPSEEK_V2 ? 0 : m->cfg.head_dim, fl_kv_int8_group(&m->cfg),
                              &kv));
    fl_forward_limits lim = {.max_tokens = chunk, .max_seqs = 1, .max_blocks = max_blocks, .max_logits = 1};
    OK(fl_forward_init(m, &kv, &lim, NULL, NULL, &f));
    if (!strcmp(g_graphs, "emulate")) OK(fl_forward_graph_emulate(f));
    else fl_forward_graph_enable(f, !strcmp(g_graphs, "on"));
    /* --vs-plain: the same steps through the plain op sequence (FL_DECODE_LAYER=0), its own cache */
    fl_kv_cache kv2;
    fl_forward *f2 = NULL;
    const bool vs = g_vs_plain && g_be->ops->decode_layer;
    if (vs) {
        OK(fl_kv_cache_init_dtype(g_be, m->cfg.n_layers, n_blocks, BS, m->dims.n_kv_heads * m->cfg.head_dim, kvd,
                                  m->cfg.arch == FL_ARCH_DEEPSEEK_V2 ? 0 : m->cfg.head_dim,
                                  fl_kv_int8_group(&m->cfg), &kv2));
        OK(fl_opt_override(FL_OPT_DECODE_LAYER, "0"));
        OK(fl_forward_init(m, &kv2, &lim, NULL, NULL, &f2));
        OK(fl_opt_override(FL_OPT_DECODE_LAYER, NULL));
        fl_forward_graph_enable(f2, !strcmp(g_graphs, "on"));
    }
    float *got2 = malloc(sizeof(float) * r.V);
    double vs_worst = 0;
    int vs_same = 0, vs_over = 0, vs_route = 0;

    int32_t *ids = malloc(sizeof(int32_t) * len);
    memcpy(ids, r.prompt, sizeof(int32_t) * r.T);
    memcpy(ids + r.T, r.tokens, sizeof(int32_t) * r.N);
    float *got = malloc(sizeof(float) * r.V);
    double *rel = malloc(sizeof(double) * (r.N + 1));
    fl_step_plan p = {0};
    int n_over = 0, n_checked = 0, n_ties = 0, n_tie_flips = 0, n_route = 0;
    bool after_tie = false;
    double worst = 0, worst_abs = 0;
    int worst_row = 0;
    for (int row = 0; row <= r.N; row++) {
        if (row == 0) { /* the prefill, in chunks; every chunk's RoPE length is the whole prompt */
            for (int t0 = 0; t0 < r.T; t0 += chunk) {
                const int t1 = t0 + chunk < r.T ? t0 + chunk : r.T;
                build_step(&p, ids, t0, t1, r.T, max_blocks, bt);
                OK(fl_forward_run(f, &p, got, NULL));
                if (vs) OK(fl_forward_run(f2, &p, got2, NULL));
            }
        } else { /* one decode step: the reference's token row - 1 at position T + row - 1 */
            const int t = r.T + row - 1;
            build_step(&p, ids, t, t + 1, t + 1, max_blocks, bt);
            OK(fl_forward_run(f, &p, got, NULL));
            if (vs) OK(fl_forward_run(f2, &p, got2, NULL));
        }
        if (vs && row > 0) { /* decode rows: the op against the plain ops, at the row's tolerance */
            double dn = 0, dd = 0;
            for (int v = 0; v < r.V; v++) {
                dn = fmax(dn, fabs((double)got[v] - got2[v]));
                dd = fmax(dd, fabs((double)got2[v]));
            }
            const double e = dn / (dd > 0 ? dd : 1);
            vs_same += dn == 0;
            vs_worst = fmax(vs_worst, e);
            if (r.margin && r.margin[row] < ROUTE_TIE && !(e <= tol)) vs_route++;
            else if (!(e <= tol)) {
                vs_over++;
                printf("  %s row %d: decode_layer vs the plain ops: relative difference %.3e > %.1e\n", fx->name,
                       row, e, tol);
            }
        }
        const float *ref = r.rows + (size_t)row * r.V;
        double num = 0, den = 0;
        for (int v = 0; v < r.V; v++) {
            if (!isfinite(got[v])) fail_msg("%s row %d: logit %d is %f", fx->name, row, v, got[v]);
            const double d = fabs((double)got[v] - ref[v]);
            num = d > num ? d : num;
            den = fabs(ref[v]) > den ? fabs(ref[v]) : den;
        }
        rel[row] = num / den;
        if (rel[row] > worst) worst = rel[row], worst_row = row;
        worst_abs = num > worst_abs ? num : worst_abs;
        /* bf16, or int8 / bf16 KV, MoE: at a routing near-tie the backend may take
         * the other expert, and the KV it then stores perturbs every later
         * row */
        const bool route_tie = (bf16 || g_kv_int8 || g_kv_bf16) && r.margin && r.margin[row] < ROUTE_TIE;
        after_tie |= route_tie;
        const double row_tol = after_tie && !route_tie ? 2 * tol : tol;
        if (route_tie && !(rel[row] <= tol)) {
            n_route++;
            printf("  %s row %d (position %d): relative error %.3e at a routing near-tie (margin %.1e)\n", fx->name,
                   row, r.T + row - 1, rel[row], r.margin[row]);
        } else if (!(rel[row] <= row_tol)) {
            n_over++;
            printf("  %s row %d (position %d): relative error %.3e > %.1e\n", fx->name, row, r.T + row - 1,
                   rel[row], row_tol);
        }
        /* greedy: asserted where the reference's top-2 margin exceeds twice this row's error */
        const int top = argmax(ref, r.V);
        double second = -INFINITY;
        for (int v = 0; v < r.V; v++)
            if (v != top && ref[v] > second) second = ref[v];
        const int mine = argmax(got, r.V);
        if (row < r.N) assert_int_equal(top, r.tokens[row]); /* the reference is greedy */
        if (ref[top] - second > 2 * num) {
            n_checked++;
            if (mine != top)
                FX_FAIL("%s row %d: greedy token %d, reference %d (margin %.3e, max abs error %.3e)", fx->name, row,
                         mine, top, ref[top] - second, num);
        } else {
            n_ties++;
            if (mine != top) {
                n_tie_flips++;
                printf("  %s row %d: near tie (margin %.2e <= 2 x error %.2e): token %d, reference %d\n", fx->name,
                       row, ref[top] - second, num, mine, top);
            }
        }
    }
    qsort(rel, (size_t)r.N + 1, sizeof(double), cmp_double);
    const double median = rel[r.N / 2];
    fl_forward_graph_stats gs;
    fl_forward_graph_get_stats(f, &gs);
    printf("  %-17s %-11s T=%3d +%d steps: worst rel err %.2e (row %d, tol %.2g), max abs %.2e, median %.2e; "
           "greedy asserted at %d/%d rows, %d near ties (%d flipped); %d rows off at routing near-ties; "
           "graphs: %ld captures, %ld replays%s%s\n",
           fx->name, fx->stem, r.T, r.N, worst, worst_row, tol, worst_abs, median, n_checked, r.N + 1, n_ties,
           n_tie_flips, n_route, gs.captures, gs.replays, gs.why_off[0] ? ", off: " : "", gs.why_off);
    if (vs) {
        printf("  %-17s decode_layer vs the plain ops: worst relative difference %.2e over %d decode rows, %d "
               "identical, %d off at routing near-ties\n", fx->name, vs_worst, r.N, vs_same, vs_route);
        if (vs_over > (bf16 ? fx->bf16_over : 0))
            FX_FAIL("%s: %d decode rows differ from the plain ops by more than %.1e (worst %.3e)", fx->name, vs_over,
                    tol, vs_worst);
    }
    const int allowed = bf16 ? fx->bf16_over : 0;
    if (n_over > allowed)
        FX_FAIL("%s (%s): %d rows over the relative tolerance %.1e (allowed %d), worst %.3e at row %d", fx->name,
                 fx->stem, n_over, tol, allowed, worst, worst_row);
    if (!(median <= tol / 2)) FX_FAIL("%s: median relative error %.3e > %.1e", fx->name, median, tol / 2);
    /* f32: the margins of these models are far above its errors; bf16 rows
     * (and fp8 KV's) may be ties at that precision, which the row tolerance
     * already bounds */
    if (!bf16 && !g_kv_fp8 && n_checked < (r.N + 1) / 2)
        FX_FAIL("%s: greedy checkable at only %d of %d rows (errors too large for the margins)", fx->name,
                 n_checked, r.N + 1);
    if (!strcmp(g_graphs, "on") && g_be->ops->graph_begin && fx->dense) {
        assert_true(gs.enabled);
        assert_true(gs.replays > 0);
    }
    if (!strcmp(g_graphs, "off")) assert_int_equal(gs.replays, 0);

    fl_step_plan_free(&p);
    fl_forward_free(f);
    fl_kv_cache_free(&kv);
    if (vs) {
        fl_forward_free(f2);
        fl_kv_cache_free(&kv2);
    }
    free(got2);
    fl_model_free(m);
    fl_ckpt_free(ck);
    free(bt);
    free(ids);
    free(got);
    free(rel);
    dref_free(&r);
}

static void test_fixtures(void **state) {
    (void)state;
    if (!g_be) {
        if (getenv("FL_REQUIRE_GPU") && !strcmp(getenv("FL_REQUIRE_GPU"), "1"))
            fail_msg("FL_REQUIRE_GPU=1 but the %s backend did not start: %s", g_backend, g_why);
        printf("  skipped (no GPU): %s\n", g_why);
        skip();
    }
    int ran = 0;
    for (size_t i = 0; i < N_FIXTURES; i++) {
        bool want = g_n_only == 0;
        for (int j = 0; j < g_n_only; j++) want |= !strcmp(g_only[j], FIXTURES[i].name);
        if (!want) continue;
        run_fixture(&FIXTURES[i]);
        ran++;
    }
    if (ran == 0) fail_msg("no fixture matched");
    if (g_failed) fail_msg("%d check(s) failed (FAILED lines above)", g_failed);
}

static int setup(void **state) {
    (void)state;
    fl_status st = !strcmp(g_backend, "cuda") ? fl_backend_cuda_init(0, &g_be) : fl_backend_cpu_init(&g_be);
    if (st != FL_OK) {
        snprintf(g_why, sizeof g_why, "%s", fl_error_msg());
        g_be = NULL;
        fl_error_clear();
    }
    return 0;
}
static int teardown(void **state) {
    (void)state;
    fl_backend_free(g_be);
    return 0;
}

int main(int argc, char **argv) {
    fl_test_cpu_reference_kernels(); /* float64 references at 1e-4 and finer */
    if (getenv("FL_TEST_BACKEND") && *getenv("FL_TEST_BACKEND")) g_backend = getenv("FL_TEST_BACKEND");
    g_only = malloc(sizeof(char *) * (size_t)argc);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) g_backend = argv[++i];
        else if (!strcmp(argv[i], "--graphs") && i + 1 < argc) g_graphs = argv[++i];
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc && !strcmp(argv[i + 1], "int8")) g_kv_int8 = true, i++;
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc && !strcmp(argv[i + 1], "bf16")) g_kv_bf16 = true, i++;
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc && !strcmp(argv[i + 1], "fp8"))
            g_kv_int8 = g_kv_fp8 = true, i++;
        else if (!strcmp(argv[i], "--vs-plain")) g_vs_plain = true;
        else if (argv[i][0] != '-') g_only[g_n_only++] = argv[i];
        else {
            fprintf(stderr, "usage: %s [--backend cpu|cuda] [--graphs on|off|emulate] [--kv int8|fp8|bf16] [--vs-plain] "
                            "[fixture...]\n",
                    argv[0]);
            return 2;
        }
    }
    if (strcmp(g_backend, "cpu") && strcmp(g_backend, "cuda")) {
        fprintf(stderr, "--backend: cpu or cuda, not '%s'\n", g_backend);
        return 2;
    }
    if (strcmp(g_graphs, "on") && strcmp(g_graphs, "off") && strcmp(g_graphs, "emulate")) {
        fprintf(stderr, "--graphs: on, off or emulate, not '%s'\n", g_graphs);
        return 2;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fixtures)};
    const int rc = cmocka_run_group_tests(tests, setup, teardown);
    free(g_only);
    return rc;
}
