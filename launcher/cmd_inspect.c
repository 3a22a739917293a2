/*
 * cmd_inspect.c — `flotilla inspect`: what a checkpoint holds, read from
 * its headers only (no weights are touched): architecture and shapes from
 * the config, parameter count, and tensors / bytes by dtype. The config is
 * checked against the tensors first (fl_ckpt_validate, in
 * fl_cli_bundle_open), so what is printed is what a run would load.
 */
#include <stdlib.h>
#include <string.h>

#include "launcher/cli.h"

static void print_config(const fl_model_config *c) {
    static const char *rope[] = {"default", "linear", "dynamic", "yarn", "llama3"};
    printf("architecture      %s\n", fl_arch_name(c->arch));
    printf("layers            %d\n", c->n_layers);
    printf("hidden            %d\n", c->hidden_size);
    printf("heads             %d (kv %d, head_dim %d)\n", c->n_heads, c->n_kv_heads, c->head_dim);
    printf("intermediate      %d\n", c->intermediate_size);
    printf("vocab             %d\n", c->vocab_size);
    printf("max positions     %d\n", c->max_position_embeddings);
    printf("rope              %s, theta %g%s\n", rope[c->rope.kind], c->rope.theta,
           c->rope.interleaved ? ", interleaved" : "");
    printf("tied embeddings   %s\n", c->tie_word_embeddings ? "yes" : "no");
    if (c->n_experts)
        printf("experts           %d, top-%d, expert intermediate %d, shared %d\n", c->n_experts,
               c->n_experts_per_tok, c->moe_intermediate_size, c->shared_expert_intermediate_size);
    if (c->quant == FL_QUANT_AWQ) printf("quantization      AWQ 4-bit, group %d\n", c->quant_group_size);
    if (c->quant == FL_QUANT_CT_PACK) {
        if (c->quant_group_size)
            printf("quantization      compressed-tensors 4-bit %s, group %d\n",
                   c->quant_symmetric ? "symmetric" : "asymmetric", c->quant_group_size);
        else
            printf("quantization      compressed-tensors 4-bit %s, per channel\n",
                   c->quant_symmetric ? "symmetric" : "asymmetric");
    }
    if (c->quant == FL_QUANT_FP8) {
        char how[64] = "per tensor";
        if (c->quant_fp8 == FL_FP8_CHANNEL) snprintf(how, sizeof how, "per channel");
        if (c->quant_fp8 == FL_FP8_BLOCK)
            snprintf(how, sizeof how, "per %dx%d block", c->quant_block[0], c->quant_block[1]);
        printf("quantization      FP8 e4m3 %s (%s), dequantized at load\n", how,
               c->quant_scale_inv ? "fp8, weight_scale_inv" : "compressed-tensors, weight_scale");
    }
    if (c->quant == FL_QUANT_GPTQ) {
        char g[32] = "per channel";
        if (c->quant_group_size) snprintf(g, sizeof g, "group %d", c->quant_group_size);
        printf("quantization      GPTQ 4-bit %s, %s%s, format %s\n", c->quant_symmetric ? "symmetric" : "asymmetric",
               g, c->quant_act_order ? ", act-order" : "", c->quant_zeros_minus_one ? "gptq" : "gptq_v2");
    }
}

int fl_cmd_inspect(int argc, char **argv) {
    fl_cli_model_opts mo = {0};
    const char *help = NULL;
    fl_cli_opt opts[FL_CLI_MAX_OPTS] = {{"help", false, &help, "show this help"}};
    int n = 1;
    fl_cli_model_opts_add(&mo, opts, &n);
    if (fl_cli_world_rank() != 0) return 0; /* one rank is enough */
    fl_status st = fl_cli_parse("inspect", argc, argv, opts);
    if (st != FL_OK) return fl_cli_fail("inspect", st);
    if (help) {
        /* only what inspect uses; the engine options are parsed (a job's
         * --config file may hold them) but change nothing here */
        const fl_cli_opt shown[] = {
            {"model", true, &mo.model, "Hugging Face model folder or .gguf file (required)"},
            {"config", true, &mo.config, "YAML file of options (engine options in it are ignored)"},
            {"help", false, &help, "show this help"},
            {0},
        };
        fl_cli_usage(stdout, "inspect", "--model PATH", shown);
        printf("\nThe checkpoint's metadata is checked against its tensors and vocabulary; a\n"
               "contradiction is an error (exit status 1).\n");
        return 0;
    }
    fl_cli_bundle b;
    st = fl_cli_bundle_open(&mo, 0, &b);
    if (st != FL_OK) return fl_cli_fail("inspect", st);
    fl_model_config c;
    st = fl_ckpt_model_config(b.ck, &c);
    if (st != FL_OK) {
        fl_cli_bundle_close(&b);
        return fl_cli_fail("inspect", st);
    }
    printf("model             %s (%s)\n", fl_ckpt_path(b.ck), fl_ckpt_format(b.ck));
    print_config(&c);
    int64_t count[FL_DTYPE_COUNT] = {0}, bytes[FL_DTYPE_COUNT] = {0}, params = 0;
    size_t nt = fl_ckpt_count(b.ck);
    for (size_t i = 0; i < nt; i++) {
        const fl_ckpt_tensor *t = fl_ckpt_at(b.ck, i);
        int64_t ne = 1;
        for (int d = 0; d < t->ndim; d++) ne *= t->shape[d];
        /* AWQ / GPTQ qweight and compressed-tensors weight_packed pack 8 weights per int32 */
        size_t nl = strlen(t->name);
        if (nl > 8 && !strcmp(t->name + nl - 8, ".qweight")) ne *= 8;
        else if (nl > 14 && !strcmp(t->name + nl - 14, ".weight_packed")) ne *= 8;
        else if (c.quant == FL_QUANT_CT_PACK &&
                 ((nl > 13 && !strcmp(t->name + nl - 13, ".weight_scale")) ||
                  (nl > 18 && !strcmp(t->name + nl - 18, ".weight_zero_point")) ||
                  (nl > 13 && !strcmp(t->name + nl - 13, ".weight_shape"))))
            ne = 0;
        else if (nl > 7 && !strcmp(t->name + nl - 7, ".qzeros")) ne = 0;
        else if ((c.quant == FL_QUANT_AWQ || c.quant == FL_QUANT_GPTQ) && nl > 7 &&
                 !strcmp(t->name + nl - 7, ".scales"))
            ne = 0;
        else if (c.quant == FL_QUANT_GPTQ && nl > 6 && !strcmp(t->name + nl - 6, ".g_idx")) ne = 0;
        else if (c.quant == FL_QUANT_FP8 && (strstr(t->name, ".weight_scale") || strstr(t->name, ".input_scale")))
            ne = 0;
        params += ne;
        count[t->dtype]++;
        bytes[t->dtype] += (int64_t)t->nbytes;
    }
    printf("parameters        %lld (%.1f M)\n", (long long)params, params / 1e6);
    printf("tensors           %zu\n", nt);
    for (int d = 0; d < FL_DTYPE_COUNT; d++)
        if (count[d])
            printf("  %-6s %6lld tensors %12.1f MB\n", fl_dtype_name((fl_dtype)d), (long long)count[d],
                   bytes[d] / 1e6);
    printf("layer 0 tensors:\n");
    for (size_t i = 0; i < nt; i++) {
        const fl_ckpt_tensor *t = fl_ckpt_at(b.ck, i);
        if (strncmp(t->name, "model.layers.0.", 15)) continue;
        printf("  %-56s %-5s [", t->name, fl_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) printf("%s%lld", d ? ", " : "", (long long)t->shape[d]);
        printf("]\n");
    }
    fl_cli_bundle_close(&b);
    return 0;
}
