/*
 * test_moe_reads.c — the routed experts a decode step reads, as the forward
 * pass counts them for `flotilla bench` (fl_forward_moe_expert_reads,
 * runtime/model/forward_moe.h), on the CPU backend where the count is
 * exact: batch 1 reads exactly k experts a layer; a router that sends every
 * token to every expert (k = the expert count) reads them all, whatever the
 * batch; the device-routed path (moe_group's offsets, read in place or
 * downloaded after the step) and the host-routed path (the counting sort of
 * the downloaded top-k) count the same experts, step by step, over the same
 * greedy decode; and the bytes bench derives
 * from the count are the shapes' (fl_synth_step_weight_bytes).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/option.h"
#include "runtime/engine/engine.h"
#include "runtime/load/synth.h"
#include "runtime/model/forward_moe.h"

enum { PLEN = 5, GLEN = 7, MAXB = 8 };

/* Prefills `batch` prompts of tiny-moe with top-k routing, then decodes:
 * each decode step's reads into steps[GLEN - 1] (delta of the totals);
 * device: the device-routed MoE path (FL_MOE_DEVICE); download: its
 * groupings downloaded after the step (count_experts, as bench asks and a
 * GPU needs) rather than read in place. Returns the MoE layer count. */
static int decode_reads(int k, int batch, bool device, bool download, fl_moe_expert_reads *steps, int *n_steps) {
    assert_int_equal(fl_opt_override(FL_OPT_MOE_DEVICE, device ? "1" : "0"), FL_OK);
    fl_backend *be = NULL;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    fl_model_config c;
    assert_int_equal(fl_synth_preset("tiny-moe", &c), FL_OK);
    c.n_experts_per_tok = k;
    fl_model *m = NULL;
    assert_int_equal(fl_synth_model(&c, NULL, be, FL_LOAD_AS_STORED, 3, &m), FL_OK);
    fl_engine_config ec;
    fl_engine_config_default(&ec);
    ec.block_size = 4;
    ec.max_num_seqs = batch;
    ec.max_num_batched_tokens = batch * PLEN;
    ec.max_model_len = PLEN + GLEN + 1;
    ec.n_blocks = batch * MAXB;
    ec.fwd.count_experts = download;
    fl_engine *e = NULL;
    assert_int_equal(fl_engine_init(m, &ec, &e), FL_OK);
    fl_gen *gens = calloc((size_t)batch, sizeof *gens);
    assert_non_null(gens);
    for (int i = 0; i < batch; i++) {
        int32_t prompt[PLEN];
        for (int j = 0; j < PLEN; j++) prompt[j] = (int32_t)((i * 7919 + j * 104729) % c.vocab_size);
        assert_int_equal(fl_gen_init(&gens[i], i, prompt, PLEN, NULL, GLEN), FL_OK);
        assert_int_equal(fl_engine_add(e, &gens[i]), FL_OK);
    }
    fl_gen **up;
    int nu;
    for (int first = 0; first < batch;) {
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
        for (int i = 0; i < nu; i++) first += fl_gen_n_generated(up[i]) == 1;
    }
    fl_forward_moe_totals_reset();
    *n_steps = 0;
    fl_moe_expert_reads r0 = {0}, r1;
    while (fl_engine_has_work(e)) {
        assert_true(*n_steps < GLEN - 1);
        assert_int_equal(fl_engine_step(e, &up, &nu), FL_OK);
        fl_forward_moe_expert_reads(&r1);
        steps[*n_steps] = (fl_moe_expert_reads){r1.layers - r0.layers, r1.counted - r0.counted,
                                                r1.experts - r0.experts};
        (*n_steps)++;
        r0 = r1;
    }
    int moe_layers = 0;
    for (int l = 0; l < c.n_layers; l++) moe_layers += m->layers[l].is_moe;
    for (int i = 0; i < batch; i++) fl_gen_free(&gens[i]);
    free(gens);
    fl_engine_free(e);
    fl_model_free(m);
    fl_backend_free(be);
    return moe_layers;
}

/* batch 1: a token's top-k experts are distinct, k of them every layer */
static void test_batch_one_reads_k(void **state) {
    (void)state;
    fl_moe_expert_reads s[GLEN];
    int n = 0;
    for (int dev = 0; dev < 2; dev++) {
        const int L = decode_reads(2, 1, dev, dev, s, &n);
        assert_int_equal(L, 2);
        assert_int_equal(n, GLEN - 1);
        for (int i = 0; i < n; i++) {
            assert_int_equal(s[i].layers, L);
            assert_int_equal(s[i].counted, L);
            assert_int_equal(s[i].experts, 2 * L);
        }
    }
}

/* k = every expert: all tokens route to the same (all) experts, so a batch
 * of 5 reads 4 a layer, not min(5 k, 4) by assumption but by count */
static void test_all_tokens_same_experts(void **state) {
    (void)state;
    fl_moe_expert_reads s[GLEN];
    int n = 0;
    for (int dev = 0; dev < 2; dev++) {
        const int L = decode_reads(4, 5, dev, false, s, &n);
        assert_int_equal(n, GLEN - 1);
        for (int i = 0; i < n; i++) {
            assert_int_equal(s[i].counted, L);
            assert_int_equal(s[i].experts, 4 * L);
        }
    }
}

/* batch 3, top-2 of 4: the two paths count the same experts step by step
 * (independent implementations over the same routing: greedy decoding
 * gives the same tokens on both), each layer between k and the expert count */
static void test_paths_agree(void **state) {
    (void)state;
    fl_moe_expert_reads a[GLEN], b[GLEN], d[GLEN];
    int na = 0, nb = 0, nd = 0;
    const int L = decode_reads(2, 3, true, false, a, &na);
    decode_reads(2, 3, false, false, b, &nb);
    decode_reads(2, 3, true, true, d, &nd);
    assert_int_equal(na, nb);
    assert_int_equal(na, nd);
    long total = 0;
    for (int i = 0; i < na; i++) {
        assert_int_equal(a[i].counted, L);
        assert_int_equal(b[i].counted, L);
        assert_int_equal(d[i].counted, L);
        assert_int_equal(a[i].experts, b[i].experts);
        assert_int_equal(a[i].experts, d[i].experts);
        assert_in_range(a[i].experts, 2 * L, 4 * L);
        total += a[i].experts;
    }
    /* the bytes bench reports: the shapes' bytes with the counted mean */
    fl_model_config c;
    assert_int_equal(fl_synth_preset("tiny-moe", &c), FL_OK);
    double got = 0, k2 = 0, k4 = 0;
    const double mean = (double)total / (na * L);
    assert_int_equal(fl_synth_step_weight_bytes(&c, NULL, FL_LOAD_AS_STORED, mean, &got), FL_OK);
    assert_int_equal(fl_synth_step_weight_bytes(&c, NULL, FL_LOAD_AS_STORED, 2, &k2), FL_OK);
    assert_int_equal(fl_synth_step_weight_bytes(&c, NULL, FL_LOAD_AS_STORED, 4, &k4), FL_OK);
    /* tiny-moe bf16: an expert is 3 x 512 x 256 x 2 = 786,432 bytes, read
     * in each of the 2 layers; k = 2 gives 4,449,280 in all (lm_head
     * 512,000 + final norm 1,024 + 2 x (attention 393,216 + router 2,048 +
     * 2 experts 1,572,864)) */
    assert_true(k2 == 4449280.0);
    assert_true(k4 == k2 + 2 * 2 * 786432.0);
    assert_true(got == k2 + (mean - 2) * 2 * 786432.0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_one_reads_k),
        cmocka_unit_test(test_all_tokens_same_experts),
        cmocka_unit_test(test_paths_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
