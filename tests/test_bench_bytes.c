/*
 * test_bench_bytes.c — the weight bytes `flotilla bench` says a decode step
 * reads (fl_synth_step_weight_bytes, runtime/load/synth.h): exact values for
 * real shapes, worked out by hand below, and the same count as the tensors
 * a built synthetic model of test sizes actually holds.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "kernels/backend.h"
#include "runtime/load/synth.h"

static double step_bytes(const char *preset, const fl_shard *sh, fl_load_quant q, double active) {
    fl_model_config c;
    assert_int_equal(fl_synth_preset(preset, &c), FL_OK);
    double b = -1;
    assert_int_equal(fl_synth_step_weight_bytes(&c, sh, q, active, &b), FL_OK);
    return b;
}

/* Llama-3-8B: hidden 4096, 32 query heads and 8 KV heads of 128, MLP 14336,
 * vocabulary 128256, 32 layers. Weights of one layer:
 *   q, o      4096 x 4096  = 16,777,216 each
 *   k, v      1024 x 4096  =  4,194,304 each
 *   gate, up 14336 x 4096  = 58,720,256 each; down the same
 *   together                218,103,808 weights
 * bf16: 2 bytes a weight = 436,207,616 a layer, x 32 = 13,958,643,712;
 *   lm_head 128256 x 4096 x 2 = 1,050,673,152; final norm 4096 x 4 (f32)
 *   = 16,384: 15,009,333,248.
 * w4 (group 128): half a byte a weight + a bf16 scale and bias (4 bytes)
 *   per 128 = 0.53125 bytes a weight = 115,867,648 a layer, x 32 =
 *   3,707,764,736; lm_head stays bf16, so + 1,050,673,152 + 16,384 =
 *   4,758,454,272.
 * fp8: a byte a weight + an f32 scale a row; rows of a layer: q 4096, k
 *   and v 1024 each, o 4096, gate and up 14336 each, down 4096 = 43,008
 *   rows x 4 = 172,032 bytes; 218,103,808 + 172,032 = 218,275,840 a layer,
 *   x 32 = 6,984,826,880 + 1,050,673,152 + 16,384 = 8,035,516,416. */
static void test_llama_3_8b(void **state) {
    (void)state;
    assert_true(step_bytes("llama-3-8b", NULL, FL_LOAD_AS_STORED, 0) == 15009333248.0);
    assert_true(step_bytes("llama-3-8b", NULL, FL_LOAD_W4, 0) == 4758454272.0);
    assert_true(step_bytes("llama-3-8b", NULL, FL_LOAD_FP8, 0) == 8035516416.0);
}

/* tp 2: each rank holds 16 query heads, 4 KV heads, 7168 MLP columns (a
 * multiple of 128: o and down stay W4) and 64128 lm_head rows, so exactly
 * half of every sharded weight; the final norm is replicated.
 * bf16: 436,207,616 / 2 x 32 = 6,979,321,856 + 525,336,576 + 16,384 =
 *   7,504,674,816 a rank.
 * w4:   115,867,648 / 2 x 32 = 1,853,882,368 + 525,336,576 + 16,384 =
 *   2,379,235,328 a rank. */
static void test_llama_3_8b_tp2(void **state) {
    (void)state;
    for (int r = 0; r < 2; r++) {
        const fl_shard sh = {.tp_rank = r, .tp_size = 2, .ep_size = 1, .ex_size = 1};
        assert_true(step_bytes("llama-3-8b", &sh, FL_LOAD_AS_STORED, 0) == 7504674816.0);
        assert_true(step_bytes("llama-3-8b", &sh, FL_LOAD_W4, 0) == 2379235328.0);
    }
    /* the two ranks together: the whole model plus one more final norm */
    const fl_shard sh = {.tp_size = 2, .ep_size = 1, .ex_size = 1};
    assert_true(2 * step_bytes("llama-3-8b", &sh, FL_LOAD_AS_STORED, 0) == 15009333248.0 + 16384);
}

/* Mixtral-8x7B: Llama-3-8B's attention, 8 experts of 14336 columns, top-2,
 * vocabulary 32000. A layer reads:
 *   attention  33,554,432 + 16,777,216 + 33,554,432 = 83,886,080 bytes bf16
 *              (41,943,040 weights)
 *   router     8 x 4096 x 2 = 65,536 (bf16 always)
 *   an expert  176,160,768 weights = 352,321,536 bytes bf16,
 *              93,585,408 w4 (x 0.53125)
 * k = 2 experts, bf16: 83,886,080 + 65,536 + 704,643,072 = 788,594,688 a
 *   layer, x 32 = 25,235,030,016, + lm_head 32000 x 4096 x 2 = 262,144,000
 *   + 16,384 = 25,497,190,400.
 * w4: 22,282,240 + 65,536 + 187,170,816 = 209,518,592 a layer, x 32 =
 *   6,704,594,944 + 262,144,000 + 16,384 = 6,966,755,328.
 * Each further expert a layer reads adds 32 of its size. */
static void test_mixtral(void **state) {
    (void)state;
    assert_true(step_bytes("mixtral-8x7b", NULL, FL_LOAD_AS_STORED, 2) == 25497190400.0);
    assert_true(step_bytes("mixtral-8x7b", NULL, FL_LOAD_W4, 2) == 6966755328.0);
    assert_true(step_bytes("mixtral-8x7b", NULL, FL_LOAD_W4, 3.5) == 6966755328.0 + 1.5 * 32 * 93585408.0);
    assert_true(step_bytes("mixtral-8x7b", NULL, FL_LOAD_AS_STORED, 0) == 25497190400.0 - 64 * 352321536.0);
}

/* A shard that does not divide the model is refused, not counted. */
static void test_bad_shard(void **state) {
    (void)state;
    fl_model_config c;
    assert_int_equal(fl_synth_preset("llama-3-8b", &c), FL_OK);
    const fl_shard sh = {.tp_size = 5, .ep_size = 1, .ex_size = 1};
    double b = 0;
    assert_int_equal(fl_synth_step_weight_bytes(&c, &sh, FL_LOAD_AS_STORED, 0, &b), FL_ERR_INVALID_ARG);
    fl_error_clear();
}

/* The bytes of a tensor as built: rows x row bytes, W4 with its per-group
 * scale and bias at 2 bytes each, FP8 with an f32 scale a row. */
static double tensor_bytes(const fl_tensor *t) {
    if (!t->data) return 0;
    int64_t rows = t->ndim == 2 ? t->shape[0] : 1, cols = t->shape[t->ndim - 1];
    double b = (double)rows * (double)fl_dtype_row_bytes(t->dtype, cols);
    if (t->dtype == FL_DTYPE_W4) b += (double)rows * (double)(cols / t->group) * 4;
    if (t->dtype == FL_DTYPE_F8_E4M3) b += (double)rows * 4;
    return b;
}

static double mlp_bytes(const fl_mlp_weights *w) {
    return tensor_bytes(&w->gate) + tensor_bytes(&w->up) + tensor_bytes(&w->gate_up) + tensor_bytes(&w->down);
}

/* What the built model's tensors add up to, one expert standing for each
 * of `active` (all of a layer's experts are of one size). */
static double model_bytes(const fl_model *m, double active) {
    double b = tensor_bytes(&m->lm_head) + tensor_bytes(&m->final_norm);
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const fl_layer_weights *w = &m->layers[l];
        b += tensor_bytes(&w->wq) + tensor_bytes(&w->wk) + tensor_bytes(&w->wv) + tensor_bytes(&w->wqkv) +
             tensor_bytes(&w->wo) + tensor_bytes(&w->wq_a) + tensor_bytes(&w->wq_b) + tensor_bytes(&w->wkv_a) +
             tensor_bytes(&w->wkv_b);
        if (!w->is_moe) {
            b += mlp_bytes(&w->mlp);
            continue;
        }
        b += tensor_bytes(&w->router) + active * mlp_bytes(&w->experts[0]);
        if (w->has_shared) b += mlp_bytes(&w->shared);
    }
    return b;
}

/* The shapes-only count equals the built tensors' for every test preset,
 * quantization and a tp 2 / ep 2 shard (hidden 256: W4 where in % 128 == 0,
 * bf16 elsewhere, e.g. MLA's kv_b of 64 inputs). */
static void test_matches_built_model(void **state) {
    (void)state;
    fl_backend *be = NULL;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    const char *presets[] = {"tiny", "tiny-moe", "tiny-mla"};
    const fl_shard shards[] = {{.tp_size = 1, .ep_size = 1, .ex_size = 1},
                               {.tp_rank = 1, .tp_size = 2, .ep_size = 1, .ex_size = 1},
                               {.tp_rank = 1, .tp_size = 2, .ep_rank = 1, .ep_size = 2, .ex_size = 1}};
    for (int p = 0; p < 3; p++)
        for (int qi = 0; qi < 3 - (p > 0); qi++) /* fp8: the dense preset (MoE and MLA are refused) */
            for (int s = 0; s < 3 - !p; s++) { /* ep only for the MoE presets */
                const fl_load_quant q = qi == 2 ? FL_LOAD_FP8 : qi ? FL_LOAD_W4 : FL_LOAD_AS_STORED;
                fl_model_config c;
                assert_int_equal(fl_synth_preset(presets[p], &c), FL_OK);
                fl_model *m = NULL;
                const fl_status st = fl_synth_model(&c, &shards[s], be, q, 7, &m);
                if (st != FL_OK) print_error("%s shard %d: %s\n", presets[p], s, fl_error_msg());
                assert_int_equal(st, FL_OK);
                const double want = model_bytes(m, 1.5);
                double got = 0;
                assert_int_equal(fl_synth_step_weight_bytes(&c, &shards[s], q, 1.5, &got), FL_OK);
                if (got != want) print_error("%s %s shard %d: %.0f bytes counted, %.0f built\n", presets[p],
                                             qi == 2 ? "fp8" : qi ? "w4" : "bf16", s, got, want);
                assert_true(got == want);
                fl_model_free(m);
            }
    fl_backend_free(be);
}

/* --quantize fp8 covers dense models: MoE and MLA presets are refused by
 * name, before any weight is built. */
static void test_fp8_refused(void **state) {
    (void)state;
    fl_backend *be = NULL;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    const char *presets[] = {"tiny-moe", "tiny-mla"}, *what[] = {"MoE experts", "MLA projections"};
    for (int p = 0; p < 2; p++) {
        fl_model_config c;
        assert_int_equal(fl_synth_preset(presets[p], &c), FL_OK);
        fl_model *m = NULL;
        assert_int_equal(fl_synth_model(&c, NULL, be, FL_LOAD_FP8, 7, &m), FL_ERR_UNSUPPORTED);
        assert_null(m);
        assert_non_null(strstr(fl_error_msg(), what[p]));
    }
    fl_backend_free(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_3_8b),     cmocka_unit_test(test_llama_3_8b_tp2),
        cmocka_unit_test(test_mixtral),        cmocka_unit_test(test_bad_shard),
        cmocka_unit_test(test_matches_built_model), cmocka_unit_test(test_fp8_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
