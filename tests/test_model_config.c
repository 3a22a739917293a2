/*
 * test_model_config.c — config.json parsing for every supported
 * architecture, on files written by transformers 5.x save_pretrained
 * (rope_parameters form) and by hand in the 4.x form (rope_theta +
 * rope_scaling); and malformed / unsupported inputs, each asserting the
 * status and that the message names the file and the key.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "loader/fixture_util.h"
#include "runtime/load/model_config.h"

#define CFG(name) FL_TEST_DATA "/loader/configs/" name ".json"

static fl_model_config load(const char *path) {
    fl_model_config c;
    ASSERT_STATUS(fl_model_config_from_json(path, &c), FL_OK);
    return c;
}

static void test_llama3_v5(void **state) {
    (void)state;
    fl_model_config c = load(CFG("llama3"));
    assert_int_equal(c.arch, FL_ARCH_LLAMA);
    assert_string_equal(fl_arch_name(c.arch), "LlamaForCausalLM");
    assert_int_equal(c.vocab_size, 1000);
    assert_int_equal(c.hidden_size, 64);
    assert_int_equal(c.n_layers, 4);
    assert_int_equal(c.n_heads, 4);
    assert_int_equal(c.n_kv_heads, 2);
    assert_int_equal(c.head_dim, 16);
    assert_int_equal(c.intermediate_size, 128);
    assert_int_equal(c.max_position_embeddings, 4096);
    assert_true(c.rms_norm_eps == 1e-6f);
    assert_true(c.tie_word_embeddings);
    assert_false(c.attention_bias);
    assert_false(c.qk_norm);
    assert_int_equal(c.rope.kind, FL_ROPE_LLAMA3);
    assert_true(c.rope.theta == 500000.0f);
    assert_true(c.rope.factor == 8.0f);
    assert_true(c.rope.low_freq_factor == 1.0f);
    assert_true(c.rope.high_freq_factor == 4.0f);
    assert_int_equal(c.rope.original_max_pos, 2048);
    assert_true(c.rope.partial_rotary_factor == 1.0f);
    assert_false(c.rope.interleaved);
    assert_int_equal(c.bos_token_id, 128000);
    assert_int_equal(c.n_eos, 3);
    assert_int_equal(c.eos_token_ids[0], 128001);
    assert_int_equal(c.eos_token_ids[2], 128009);
    assert_int_equal(c.n_experts, 0);
    assert_false(fl_model_config_layer_is_moe(&c, 0));
    assert_int_equal(c.quant, FL_QUANT_NONE);
}

static void test_mistral_and_qwen2(void **state) {
    (void)state;
    fl_model_config c = load(CFG("mistral"));
    assert_int_equal(c.arch, FL_ARCH_LLAMA);
    assert_int_equal(c.intermediate_size, 160);
    assert_int_equal(c.rope.kind, FL_ROPE_DEFAULT);
    assert_true(c.rope.theta == 10000.0f);
    assert_int_equal(c.bos_token_id, 1);
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_token_ids[0], 2);

    c = load(CFG("qwen2"));
    assert_int_equal(c.arch, FL_ARCH_QWEN2);
    assert_true(c.attention_bias);
    assert_int_equal(c.rope.kind, FL_ROPE_YARN);
    assert_true(c.rope.theta == 1000000.0f);
    assert_true(c.rope.factor == 4.0f);
    assert_int_equal(c.rope.original_max_pos, 1024);
    assert_true(c.rope.beta_fast == 32.0f);
    assert_true(c.rope.beta_slow == 1.0f);
    assert_true(c.rope.attention_factor == 0.0f);
    assert_int_equal(c.bos_token_id, -1); /* null in the file */
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_token_ids[0], 7);
}

static void test_mixtral(void **state) {
    (void)state;
    fl_model_config c = load(CFG("mixtral"));
    assert_int_equal(c.arch, FL_ARCH_MIXTRAL);
    assert_int_equal(c.head_dim, 16); /* head_dim: null */
    assert_int_equal(c.n_experts, 4);
    assert_int_equal(c.n_experts_per_tok, 2);
    assert_int_equal(c.moe_intermediate_size, 112);
    assert_true(c.norm_topk_prob);
    assert_int_equal(c.shared_expert_intermediate_size, 0);
    assert_true(c.rms_norm_eps == 1e-5f);
    assert_true(c.rope.theta == 1000000.0f);
    assert_false(c.attention_bias);
    for (int l = 0; l < c.n_layers; l++) assert_true(fl_model_config_layer_is_moe(&c, l));
}

static void test_qwen_moe(void **state) {
    (void)state;
    fl_model_config c = load(CFG("qwen2_moe"));
    assert_int_equal(c.arch, FL_ARCH_QWEN2_MOE);
    assert_true(c.attention_bias);
    assert_false(c.qk_norm);
    assert_int_equal(c.n_experts, 6);
    assert_int_equal(c.n_experts_per_tok, 2);
    assert_int_equal(c.moe_intermediate_size, 32);
    assert_int_equal(c.shared_expert_intermediate_size, 80);
    assert_int_equal(c.intermediate_size, 96);
    assert_false(c.norm_topk_prob);
    assert_int_equal(c.decoder_sparse_step, 2);
    /* step 2 -> layers 1, 3 sparse; 3 is in mlp_only_layers */
    assert_false(fl_model_config_layer_is_moe(&c, 0));
    assert_true(fl_model_config_layer_is_moe(&c, 1));
    assert_false(fl_model_config_layer_is_moe(&c, 2));
    assert_false(fl_model_config_layer_is_moe(&c, 3));

    c = load(CFG("qwen3_moe"));
    assert_int_equal(c.arch, FL_ARCH_QWEN3_MOE);
    assert_int_equal(c.n_experts, 8); /* v5 writes num_local_experts */
    assert_int_equal(c.head_dim, 32); /* explicit, != hidden / heads */
    assert_true(c.qk_norm);
    assert_false(c.attention_bias);
    assert_true(c.norm_topk_prob);
    assert_int_equal(c.moe_intermediate_size, 48);
    assert_int_equal(c.shared_expert_intermediate_size, 0);
    for (int l = 0; l < c.n_layers; l++) assert_true(fl_model_config_layer_is_moe(&c, l));
}

static void test_v4_forms(void **state) {
    (void)state;
    fl_model_config c = load(CFG("llama_v4_linear"));
    assert_int_equal(c.head_dim, 128);
    assert_true(c.attention_bias);
    assert_int_equal(c.rope.kind, FL_ROPE_LINEAR);
    assert_true(c.rope.factor == 2.0f);
    assert_true(c.rope.theta == 500000.0f);
    assert_int_equal(c.n_eos, 2);
    assert_false(c.tie_word_embeddings);

    c = load(CFG("qwen2_v4_awq"));
    assert_int_equal(c.arch, FL_ARCH_QWEN2);
    assert_int_equal(c.quant, FL_QUANT_AWQ);
    assert_int_equal(c.quant_group_size, 128);
    assert_int_equal(c.rope.kind, FL_ROPE_DEFAULT); /* rope_scaling: null */
    assert_true(c.rope.theta == 1000000.0f);
    assert_true(c.tie_word_embeddings);
    assert_int_equal(c.head_dim, 64);
}

/* ---- hand-written variants ----------------------------------------------- */

#define BASE                                                                                  \
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 64,\n" \
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 128"

/* Writes `text` as config.json in a fresh temp dir and parses it. */
static fl_status parse_text(const char *text, fl_model_config *c, char **dir) {
    *dir = fx_mkdtemp();
    fx_write_text(fx_path(*dir, "config.json"), text);
    fl_error_clear();
    return fl_model_config_from_json(fx_path(*dir, "config.json"), c);
}

static void test_variants(void **state) {
    (void)state;
    fl_model_config c;
    char *dir;
    ASSERT_STATUS(parse_text(BASE "}", &c, &dir), FL_OK);
    assert_int_equal(c.n_kv_heads, 4); /* default = heads */
    assert_int_equal(c.head_dim, 16);
    assert_true(c.rope.theta == 10000.0f);
    assert_int_equal(c.rope.kind, FL_ROPE_DEFAULT);
    assert_int_equal(c.bos_token_id, -1);
    assert_int_equal(c.n_eos, 0);
    assert_false(c.tie_word_embeddings);
    fx_rmtree(dir);

    ASSERT_STATUS(parse_text(BASE ", \"rope_parameters\": {\"rope_type\": \"dynamic\", \"factor\": 2.0,"
                                  " \"rope_theta\": 20000, \"partial_rotary_factor\": 0.5},"
                                  " \"max_position_embeddings\": 1000}",
                             &c, &dir),
                  FL_OK);
    assert_int_equal(c.rope.kind, FL_ROPE_DYNAMIC);
    assert_true(c.rope.theta == 20000.0f);
    assert_true(c.rope.partial_rotary_factor == 0.5f);
    assert_int_equal(c.rope.original_max_pos, 1000); /* defaults to max_position_embeddings */
    fx_rmtree(dir);

    ASSERT_STATUS(parse_text(BASE ", \"rope_theta\": 1e6, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4,"
                                  " \"beta_fast\": 16, \"beta_slow\": 2, \"attention_factor\": 1.2,"
                                  " \"original_max_position_embeddings\": 4096}}",
                             &c, &dir),
                  FL_OK);
    assert_int_equal(c.rope.kind, FL_ROPE_YARN);
    assert_true(c.rope.theta == 1e6f);
    assert_true(c.rope.beta_fast == 16.0f && c.rope.beta_slow == 2.0f);
    assert_true(c.rope.attention_factor == 1.2f);
    assert_int_equal(c.rope.original_max_pos, 4096);
    fx_rmtree(dir);

    /* AutoAWQ's own key names, lower-case version */
    ASSERT_STATUS(parse_text(BASE ", \"quantization_config\": {\"quant_method\": \"awq\", \"version\": \"gemm\","
                                  " \"w_bit\": 4, \"q_group_size\": 32, \"zero_point\": true}}",
                             &c, &dir),
                  FL_OK);
    assert_int_equal(c.quant, FL_QUANT_AWQ);
    assert_int_equal(c.quant_group_size, 32);
    fx_rmtree(dir);
}

struct bad {
    const char *what;
    const char *text;
    fl_status want;
    const char *needle;
};

static void test_malformed(void **state) {
    (void)state;
    static const struct bad cases[] = {
        {"bad JSON", "{\"architectures\": [\"LlamaForCausalLM\"],\n \"vocab_size\": 100,\n \"hidden_size\": ,}",
         FL_ERR_FORMAT, "line 3"},
        {"not an object", "[1]", FL_ERR_FORMAT, "not an object"},
        {"missing key",
         "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 100, \"num_hidden_layers\": 2,"
         " \"num_attention_heads\": 4, \"intermediate_size\": 128}",
         FL_ERR_FORMAT, "\"hidden_size\""},
        {"missing architectures", "{\"vocab_size\": 1}", FL_ERR_FORMAT, "\"architectures\""},
        {"string for int", BASE ", \"num_key_value_heads\": \"2\"}", FL_ERR_FORMAT, "\"num_key_value_heads\""},
        {"fraction for int", BASE ", \"max_position_embeddings\": 10.5}", FL_ERR_FORMAT,
         "\"max_position_embeddings\""},
        {"string for bool", BASE ", \"tie_word_embeddings\": \"yes\"}", FL_ERR_FORMAT, "\"tie_word_embeddings\""},
        {"string for float", BASE ", \"rms_norm_eps\": \"1e-6\"}", FL_ERR_FORMAT, "\"rms_norm_eps\""},
        {"zero heads",
         "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 64,"
         " \"num_hidden_layers\": 2, \"num_attention_heads\": 0, \"intermediate_size\": 128}",
         FL_ERR_FORMAT, "\"num_attention_heads\""},
        {"kv heads do not divide", BASE ", \"num_key_value_heads\": 3}", FL_ERR_FORMAT, "num_key_value_heads"},
        {"bad eos", BASE ", \"eos_token_id\": [1, \"x\"]}", FL_ERR_FORMAT, "\"eos_token_id\""},
        {"unsupported arch",
         "{\"architectures\": [\"GPT2LMHeadModel\"], \"vocab_size\": 100}", FL_ERR_UNSUPPORTED,
         "architecture GPT2LMHeadModel is not supported (supported: LlamaForCausalLM"},
        {"unsupported quant method", BASE ", \"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"bits\": 4}}",
         FL_ERR_UNSUPPORTED, "\"bitsandbytes\" is not supported (supported: awq, compressed-tensors, fp8, gptq)"},
        {"unsupported awq version",
         BASE ", \"quantization_config\": {\"quant_method\": \"awq\", \"version\": \"gemv\", \"bits\": 4,"
              " \"group_size\": 128}}",
         FL_ERR_UNSUPPORTED, "\"gemv\""},
        {"unsupported bits",
         BASE ", \"quantization_config\": {\"quant_method\": \"awq\", \"bits\": 3, \"group_size\": 128}}",
         FL_ERR_UNSUPPORTED, "quantization_config.bits = 3"},
        {"unsupported group",
         BASE ", \"quantization_config\": {\"quant_method\": \"awq\", \"bits\": 4, \"group_size\": 256}}",
         FL_ERR_UNSUPPORTED, "group_size = 256"},
        {"no zero point",
         BASE ", \"quantization_config\": {\"quant_method\": \"awq\", \"bits\": 4, \"group_size\": 128,"
              " \"zero_point\": false}}",
         FL_ERR_UNSUPPORTED, "zero_point"},
        {"unsupported rope", BASE ", \"rope_scaling\": {\"type\": \"longrope\", \"factor\": 2}}", FL_ERR_UNSUPPORTED,
         "\"longrope\""},
        {"llama3 rope incomplete", BASE ", \"rope_parameters\": {\"rope_type\": \"llama3\", \"factor\": 8}}",
         FL_ERR_FORMAT, "rope_parameters.original_max_position_embeddings"},
        {"linear rope without factor", BASE ", \"rope_scaling\": {\"type\": \"linear\"}}", FL_ERR_FORMAT,
         "rope_scaling.factor"},
        {"rope_parameters wrong type", BASE ", \"rope_parameters\": 5}", FL_ERR_FORMAT, "\"rope_parameters\""},
        {"moe without experts",
         "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 64,"
         " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
         " \"num_experts_per_tok\": 2}",
         FL_ERR_FORMAT, "\"num_experts\""},
        {"mlp_only_layers out of range",
         "{\"architectures\": [\"Qwen2MoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 64,"
         " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 4, \"num_experts_per_tok\": 2,"
         " \"moe_intermediate_size\": 32, \"mlp_only_layers\": [5]}",
         FL_ERR_FORMAT, "\"mlp_only_layers\""},
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
    fl_model_config c;
    ASSERT_STATUS(fl_model_config_from_json(FL_TEST_DATA "/loader/configs/nope.json", &c), FL_ERR_NOT_FOUND);
    ASSERT_MSG_HAS("nope.json");
    assert_string_equal(fl_arch_name(FL_ARCH_QWEN3_MOE), "Qwen3MoeForCausalLM");
    assert_string_equal(fl_arch_name(FL_ARCH_COUNT), "unknown");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama3_v5), cmocka_unit_test(test_mistral_and_qwen2),
        cmocka_unit_test(test_mixtral),   cmocka_unit_test(test_qwen_moe),
        cmocka_unit_test(test_v4_forms),  cmocka_unit_test(test_variants),
        cmocka_unit_test(test_malformed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
