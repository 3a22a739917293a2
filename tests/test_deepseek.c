/*
 * test_deepseek.c — DeepSeek-V2 pieces below the golden test: config.json
 * parsing of the MLA / DeepSeekMoE keys (both committed fixtures, and
 * malformed or unsupported values, each naming the file and key), the YaRN
 * mscale / mscale_all_dim attention factor, and the CPU mla_attention op
 * against a plain reference: expand every cached latent into per-head K/V
 * with kv_b_proj and run the ordinary paged attention op on them.
 */
#define _GNU_SOURCE
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kernels/backend.h"
#include "loader/fixture_util.h"
#include "runtime/load/model_config.h"
#include "runtime/model/rope.h"

#define GOLDEN FL_TEST_DATA "/golden/"

static void test_fixture_configs(void **state) {
    (void)state;
    fl_model_config c;
    ASSERT_STATUS(fl_model_config_from_json(GOLDEN "deepseek_v2/config.json", &c), FL_OK);
    assert_int_equal(c.arch, FL_ARCH_DEEPSEEK_V2);
    assert_string_equal(fl_arch_name(c.arch), "DeepseekV2ForCausalLM");
    assert_int_equal(c.mla.q_lora_rank, 24);
    assert_int_equal(c.mla.kv_lora_rank, 32);
    assert_int_equal(c.mla.qk_nope_head_dim, 16);
    assert_int_equal(c.mla.qk_rope_head_dim, 16);
    assert_int_equal(c.mla.v_head_dim, 16);
    /* one latent record (32 + 16) per token, half in each cache array */
    assert_int_equal(c.n_kv_heads, 1);
    assert_int_equal(c.head_dim, 24);
    assert_int_equal(fl_rope_dim(&c), 16);
    assert_int_equal(c.n_heads, 4);
    assert_int_equal(c.n_experts, 8);
    assert_int_equal(c.n_experts_per_tok, 2);
    assert_int_equal(c.moe_intermediate_size, 24);
    assert_int_equal(c.shared_expert_intermediate_size, 24);
    assert_int_equal(c.intermediate_size, 96);
    assert_int_equal(c.topk_method, FL_TOPK_GROUP_LIMITED);
    assert_int_equal(c.n_group, 4);
    assert_int_equal(c.topk_group, 2);
    assert_true(c.routed_scaling_factor == 1.5f);
    assert_false(c.norm_topk_prob);
    assert_false(fl_model_config_layer_is_moe(&c, 0));
    assert_true(fl_model_config_layer_is_moe(&c, 1));
    assert_true(fl_model_config_layer_is_moe(&c, 2));
    assert_int_equal(c.rope.kind, FL_ROPE_DEFAULT);

    ASSERT_STATUS(fl_model_config_from_json(GOLDEN "deepseek_v2_lite/config.json", &c), FL_OK);
    assert_int_equal(c.mla.q_lora_rank, 0); /* null: q_proj */
    assert_int_equal(c.topk_method, FL_TOPK_GREEDY);
    assert_int_equal(c.rope.kind, FL_ROPE_YARN);
    assert_true(c.rope.mscale == 0.707f);
    assert_true(c.rope.mscale_all_dim == 1.0f);
    double inv[8], ms;
    fl_rope_inv_freq(&c, 40, inv, &ms);
    /* (0.1 * 0.707 ln 4 + 1) / (0.1 ln 4 + 1), what transformers prints */
    assert_true(fabs(ms - 0.964326914892074) < 1e-7); /* mscale is read as float */
    assert_true(fabs(inv[0] - 1.0) < 1e-12);           /* extrapolated */
    assert_true(fabs(inv[7] - pow(1e4, -14.0 / 16) / 4) < 1e-12); /* interpolated */
}

static fl_status parse_text(const char *text, fl_model_config *c, char **dir) {
    *dir = fx_mkdtemp();
    fx_write_text(fx_path(*dir, "config.json"), text);
    return fl_model_config_from_json(fx_path(*dir, "config.json"), c);
}

#define DS "{\"architectures\": [\"DeepseekV2ForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 64," \
           " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 96," \
           " \"qk_nope_head_dim\": 16, \"v_head_dim\": 16, \"moe_intermediate_size\": 24"

static void test_malformed(void **state) {
    (void)state;
    static const struct {
        const char *what, *text;
        fl_status want;
        const char *needle;
    } cases[] = {
        {"noaux_tc", DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"topk_method\": \"noaux_tc\"}",
         FL_ERR_UNSUPPORTED, "\"noaux_tc\""},
        {"sigmoid scoring", DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"scoring_func\": \"sigmoid\"}",
         FL_ERR_UNSUPPORTED, "\"scoring_func\""},
        {"topk_method type", DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"topk_method\": 3}",
         FL_ERR_FORMAT, "\"topk_method\""},
        {"groups do not divide",
         DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"topk_method\": \"group_limited_greedy\","
            " \"n_group\": 3, \"topk_group\": 2}",
         FL_ERR_FORMAT, "n_group 3"},
        {"group method without n_group",
         DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"topk_method\": \"group_limited_greedy\","
            " \"topk_group\": 2}",
         FL_ERR_FORMAT, "\"n_group\""},
        {"kept groups too small",
         DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 3, \"topk_method\": \"group_limited_greedy\","
            " \"n_group\": 4, \"topk_group\": 1}",
         FL_ERR_FORMAT, "num_experts_per_tok 3"},
        {"k > experts", DS ", \"n_routed_experts\": 4, \"num_experts_per_tok\": 5}", FL_ERR_FORMAT,
         "\"num_experts_per_tok\""},
        {"odd rope", DS ", \"qk_rope_head_dim\": 15}", FL_ERR_UNSUPPORTED, "qk_rope_head_dim"},
        {"zero kv_lora", DS ", \"kv_lora_rank\": 0}", FL_ERR_FORMAT, "\"kv_lora_rank\""},
        {"negative dense prefix", DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"first_k_dense_replace\": -1}",
         FL_ERR_FORMAT, "\"first_k_dense_replace\""},
        {"bad scaling", DS ", \"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"routed_scaling_factor\": 0}",
         FL_ERR_FORMAT, "\"routed_scaling_factor\""},
        {"string rank", DS ", \"q_lora_rank\": \"1536\"}", FL_ERR_FORMAT, "\"q_lora_rank\""},
        {"mscale type", DS ", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4, \"mscale\": \"x\"}}",
         FL_ERR_FORMAT, "rope_scaling.mscale"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_model_config c;
        char *dir;
        fl_status st = parse_text(cases[i].text, &c, &dir);
        if (st != cases[i].want)
            fail_msg("%s: got %s, want %s (%s)", cases[i].what, fl_status_str(st), fl_status_str(cases[i].want),
                     fl_error_msg());
        if (!strstr(fl_error_msg(), cases[i].needle) || !strstr(fl_error_msg(), "config.json"))
            fail_msg("%s: message \"%s\" should name config.json and %s", cases[i].what, fl_error_msg(),
                     cases[i].needle);
        fx_rmtree(dir);
    }
    /* a dense DeepSeek (n_routed_experts null) parses, with no MoE layer */
    fl_model_config c;
    char *dir;
    ASSERT_STATUS(parse_text(DS ", \"n_routed_experts\": null, \"q_lora_rank\": null}", &c, &dir), FL_OK);
    assert_int_equal(c.n_experts, 0);
    assert_false(fl_model_config_layer_is_moe(&c, 1));
    fx_rmtree(dir);
}

static float frand(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return ((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* mla_attention on a paged cache of latent records equals ordinary
 * attention over K/V expanded from them (two sequences, chunked queries,
 * scattered blocks). */
static void test_mla_op(void **state) {
    (void)state;
    enum { H = 3, NOPE = 8, ROPE = 8, QK = 16, V = 16, KVL = 12, REC = KVL + ROPE, BS = 2, NBLK = 8, MAXB = 3 };
    fl_backend *be;
    assert_int_equal(fl_backend_cpu_init(&be), FL_OK);
    unsigned seed = 7;
    static float w[H * (NOPE + V) * KVL], kc[NBLK * BS * REC / 2], vc[NBLK * BS * REC / 2];
    static float ek[NBLK * BS * H * QK], ev[NBLK * BS * H * V];
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) w[i] = 0.4f * frand(&seed);
    for (size_t i = 0; i < sizeof kc / sizeof kc[0]; i++) kc[i] = frand(&seed), vc[i] = frand(&seed);
    fl_tensor wt = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {H * (NOPE + V), KVL}, .data = w};
    /* expanded reference caches */
    for (int slot = 0; slot < NBLK * BS; slot++) {
        float r[REC];
        for (int j = 0; j < REC / 2; j++) r[j] = kc[slot * REC / 2 + j], r[REC / 2 + j] = vc[slot * REC / 2 + j];
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < NOPE + V; i++) {
                double s = 0;
                for (int j = 0; j < KVL; j++) s += (double)w[(h * (NOPE + V) + i) * KVL + j] * r[j];
                if (i < NOPE) ek[(slot * H + h) * QK + i] = (float)s;
                else ev[(slot * H + h) * V + i - NOPE] = (float)s;
            }
            for (int j = 0; j < ROPE; j++) ek[(slot * H + h) * QK + NOPE + j] = r[KVL + j];
        }
    }
    /* seq 0: 5 cached, last 3 are queries; seq 1: 4 cached, all 4 queries */
    int32_t q_start[] = {0, 3, 7}, ctx_len[] = {5, 4}, bt[] = {6, 1, 4, 3, 0, 7};
    fl_attn_meta meta = {.n_seqs = 2, .q_start = q_start, .ctx_len = ctx_len, .block_tables = bt,
                         .max_blocks = MAXB, .block_size = BS, .max_ctx_len = 5};
    float q[7 * H * QK], got[7 * H * V], want[7 * H * V];
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = frand(&seed);
    const float scale = 0.3f;
    assert_int_equal(be->ops->mla_attention(be, q, &meta, H, NOPE, ROPE, V, KVL, scale, &wt, kc, vc, got), FL_OK);
    assert_int_equal(be->ops->attention(be, q, H * QK, &meta, H, H, QK, scale, ek, ev, want), FL_OK);
    double worst = 0;
    for (int i = 0; i < 7 * H * V; i++) worst = fmax(worst, fabs(got[i] - want[i]));
    if (!(worst < 1e-5)) fail_msg("mla_attention differs from expanded attention by %.3e", worst);
    /* a padding sequence (context 0: a captured step's unused row) outputs
     * zeros, as backend.h says, not 0/0 */
    int32_t ctx0[] = {5, 0}, qs1[] = {0, 3, 4};
    fl_attn_meta pad = meta;
    pad.ctx_len = ctx0;
    pad.q_start = qs1;
    for (size_t i = 0; i < sizeof got / sizeof got[0]; i++) got[i] = NAN;
    assert_int_equal(be->ops->mla_attention(be, q, &pad, H, NOPE, ROPE, V, KVL, scale, &wt, kc, vc, got), FL_OK);
    for (int i = 3 * H * V; i < 4 * H * V; i++) assert_true(got[i] == 0.0f);
    /* a kv_b_proj of the wrong shape is refused */
    wt.shape[0] = H * (NOPE + V) - 1;
    assert_int_equal(be->ops->mla_attention(be, q, &meta, H, NOPE, ROPE, V, KVL, scale, &wt, kc, vc, got),
                     FL_ERR_INVALID_ARG);
    ASSERT_MSG_HAS("kv_b_proj");
    fl_backend_free(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_configs),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_mla_op),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
