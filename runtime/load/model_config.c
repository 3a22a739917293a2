/*
 * model_config.c — Hugging Face config.json -> fl_model_config.
 *
 * Written against what transformers 5.x save_pretrained emits for the
 * supported classes and what older (4.x) checkpoints on the Hub contain:
 *  - RoPE: v5 writes a `rope_parameters` object {rope_type, rope_theta,
 *    factor, ...}; v4 wrote top-level `rope_theta` plus an optional
 *    `rope_scaling` {type|rope_type, factor, ...}. Both are read.
 *  - experts: Mixtral says num_local_experts; Qwen2-MoE says num_experts;
 *    Qwen3-MoE's v5 config serializes num_local_experts (attribute_map
 *    aliases num_experts). Both keys are accepted for every MoE class.
 *  - Qwen2 always has q/k/v bias; Qwen2-MoE has it unless `qkv_bias` is
 *    false (a v5 key, default true); Llama and Qwen3-MoE follow
 *    `attention_bias` (default false).
 *  - norm_topk_prob: Mixtral always renormalizes the top-k router weights;
 *    the Qwen MoE classes default to false.
 * Every error names the file and the key; unsupported values are
 * FL_ERR_UNSUPPORTED, malformed ones FL_ERR_FORMAT.
 */
#include "runtime/load/model_config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "runtime/load/json_file.h"

static const char *const g_arch_names[FL_ARCH_COUNT] = {
    [FL_ARCH_LLAMA] = "LlamaForCausalLM",
    [FL_ARCH_QWEN2] = "Qwen2ForCausalLM",
    [FL_ARCH_MIXTRAL] = "MixtralForCausalLM",
    [FL_ARCH_QWEN2_MOE] = "Qwen2MoeForCausalLM",
    [FL_ARCH_QWEN3_MOE] = "Qwen3MoeForCausalLM",
    [FL_ARCH_DEEPSEEK_V2] = "DeepseekV2ForCausalLM",
};

const char *fl_arch_name(fl_arch a) {
    if ((unsigned)a >= FL_ARCH_COUNT) return "unknown";
    return g_arch_names[a];
}

bool fl_model_config_layer_is_moe(const fl_model_config *cfg, int l) {
    if (!cfg || cfg->n_experts <= 0 || l < 0) return false;
    if (cfg->arch == FL_ARCH_DEEPSEEK_V2) /* DeepSeek's modeling code */
        return l >= cfg->first_k_dense_replace && l % (cfg->moe_layer_freq > 0 ? cfg->moe_layer_freq : 1) == 0;
    int step = cfg->decoder_sparse_step > 0 ? cfg->decoder_sparse_step : 1;
    if ((l + 1) % step != 0) return false;
    if (l < 256 && (cfg->mlp_only_layers_mask[l / 64] >> (l % 64) & 1u)) return false;
    return true;
}

/* ---- typed key access ---------------------------------------------------- */

/* Absent and JSON null both mean "not given" (transformers writes null for
 * unset optional fields such as head_dim). */
static const cJSON *get(const cJSON *obj, const char *key) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(obj, key);
    return (j && !cJSON_IsNull(j)) ? j : NULL;
}

static const char *jtype(const cJSON *j) {
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsNumber(j)) return "a number";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsArray(j)) return "an array";
    if (cJSON_IsObject(j)) return "an object";
    return "null";
}

static fl_status as_int(const char *path, const char *key, const cJSON *j, int *v) {
    double d = j->valuedouble;
    if (!cJSON_IsNumber(j) || floor(d) != d || d < -2147483648.0 || d > 2147483647.0)
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\" must be an integer, got %s", path, key, jtype(j));
    *v = (int)d;
    return FL_OK;
}

/* The getters below read key `key` of object `obj`; `pfx` (NULL at top
 * level) is the object's own key path, so messages say
 * "rope_parameters.factor" rather than just "factor". */
#define QUALIFY(buf, pfx, key) (snprintf((buf), sizeof(buf), "%s%s%s", (pfx) ? (pfx) : "", (pfx) ? "." : "", (key)), (buf))

static fl_status get_int(const char *path, const char *pfx, const cJSON *obj, const char *key, bool required,
                         int dflt, int *v) {
    char name[128];
    const cJSON *j = get(obj, key);
    if (!j) {
        if (required)
            return FL_ERR(FL_ERR_FORMAT, "%s: required key \"%s\" is missing", path, QUALIFY(name, pfx, key));
        *v = dflt;
        return FL_OK;
    }
    return as_int(path, QUALIFY(name, pfx, key), j, v);
}

/* Like get_int, and the value must be > 0. */
static fl_status get_pos_int(const char *path, const char *pfx, const cJSON *obj, const char *key, bool required,
                             int dflt, int *v) {
    char name[128];
    FL_TRY(get_int(path, pfx, obj, key, required, dflt, v));
    if (*v <= 0 && (get(obj, key) || required))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\" must be positive, got %d", path, QUALIFY(name, pfx, key), *v);
    return FL_OK;
}

static fl_status get_float(const char *path, const char *pfx, const cJSON *obj, const char *key, float dflt,
                           float *v) {
    char name[128];
    const cJSON *j = get(obj, key);
    if (!j) {
        *v = dflt;
        return FL_OK;
    }
    if (!cJSON_IsNumber(j))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\" must be a number, got %s", path, QUALIFY(name, pfx, key),
                      jtype(j));
    *v = (float)j->valuedouble;
    return FL_OK;
}

static fl_status get_bool(const char *path, const char *pfx, const cJSON *obj, const char *key, bool dflt,
                          bool *v) {
    char name[128];
    const cJSON *j = get(obj, key);
    if (!j) {
        *v = dflt;
        return FL_OK;
    }
    if (!cJSON_IsBool(j))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\" must be true or false, got %s", path,
                      QUALIFY(name, pfx, key), jtype(j));
    *v = cJSON_IsTrue(j);
    return FL_OK;
}

/* ---- sections ------------------------------------------------------------ */

static fl_status parse_arch(const char *path, const cJSON *root, fl_arch *arch) {
    const cJSON *a = get(root, "architectures");
    if (!a) return FL_ERR(FL_ERR_FORMAT, "%s: required key \"architectures\" is missing", path);
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) < 1 || !cJSON_IsString(cJSON_GetArrayItem(a, 0)))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"architectures\" must be a non-empty list of strings", path);
    const char *name = cJSON_GetArrayItem(a, 0)->valuestring;
    if (strcmp(name, "MistralForCausalLM") == 0) {
        *arch = FL_ARCH_LLAMA;
        return FL_OK;
    }
    for (int i = 0; i < FL_ARCH_COUNT; i++) {
        if (strcmp(name, g_arch_names[i]) == 0) {
            *arch = (fl_arch)i;
            return FL_OK;
        }
    }
    return FL_ERR(FL_ERR_UNSUPPORTED,
                  "%s: architecture %s is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
                  "Qwen2ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, "
                  "DeepseekV2ForCausalLM)",
                  path, name);
}

/* Reads the RoPE fields of `rp` (a rope_parameters or rope_scaling object;
 * NULL = none). `pfx` names the object in messages. */
static fl_status parse_rope_obj(const char *path, const cJSON *rp, const char *pfx, int max_pos,
                                fl_rope_config *r) {
    char key[96];
#define KEY(k) (snprintf(key, sizeof key, "%s.%s", pfx, k), key)
    const cJSON *jt = get(rp, "rope_type");
    if (!jt) jt = get(rp, "type");
    const char *type = "default";
    if (jt) {
        if (!cJSON_IsString(jt))
            return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\" must be a string, got %s", path, KEY("rope_type"),
                          jtype(jt));
        type = jt->valuestring;
    }
    if (strcmp(type, "default") == 0) r->kind = FL_ROPE_DEFAULT;
    else if (strcmp(type, "linear") == 0) r->kind = FL_ROPE_LINEAR;
    else if (strcmp(type, "dynamic") == 0) r->kind = FL_ROPE_DYNAMIC;
    else if (strcmp(type, "yarn") == 0) r->kind = FL_ROPE_YARN;
    else if (strcmp(type, "llama3") == 0) r->kind = FL_ROPE_LLAMA3;
    else
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: key \"%s\": RoPE type \"%s\" is not supported (supported: default, linear, dynamic, "
                      "yarn, llama3)",
                      path, KEY("rope_type"), type);

    FL_TRY(get_float(path, pfx, rp, "rope_theta", r->theta, &r->theta));
    FL_TRY(get_float(path, pfx, rp, "partial_rotary_factor", r->partial_rotary_factor, &r->partial_rotary_factor));
    if (r->kind == FL_ROPE_DEFAULT) return FL_OK;

    if (!get(rp, "factor"))
        return FL_ERR(FL_ERR_FORMAT, "%s: RoPE type \"%s\" needs key \"%s\"", path, type, KEY("factor"));
    FL_TRY(get_float(path, pfx, rp, "factor", 1.0f, &r->factor));
    if (!(r->factor > 0.0f))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\" must be positive", path, KEY("factor"));
    FL_TRY(get_int(path, pfx, rp, "original_max_position_embeddings", r->kind == FL_ROPE_LLAMA3, max_pos,
                   &r->original_max_pos));
    if (r->kind == FL_ROPE_LLAMA3) {
        if (!get(rp, "low_freq_factor") || !get(rp, "high_freq_factor"))
            return FL_ERR(FL_ERR_FORMAT, "%s: RoPE type llama3 needs keys \"%s\" and \"%s.high_freq_factor\"",
                          path, KEY("low_freq_factor"), pfx);
        FL_TRY(get_float(path, pfx, rp, "low_freq_factor", 1.0f, &r->low_freq_factor));
        FL_TRY(get_float(path, pfx, rp, "high_freq_factor", 4.0f, &r->high_freq_factor));
    }
    if (r->kind == FL_ROPE_YARN) {
        FL_TRY(get_float(path, pfx, rp, "beta_fast", 32.0f, &r->beta_fast));
        FL_TRY(get_float(path, pfx, rp, "beta_slow", 1.0f, &r->beta_slow));
        FL_TRY(get_float(path, pfx, rp, "attention_factor", 0.0f, &r->attention_factor));
        FL_TRY(get_float(path, pfx, rp, "mscale", 0.0f, &r->mscale));
        FL_TRY(get_float(path, pfx, rp, "mscale_all_dim", 0.0f, &r->mscale_all_dim));
    }
#undef KEY
    return FL_OK;
}

static fl_status parse_rope(const char *path, const cJSON *root, int max_pos, fl_rope_config *r) {
    memset(r, 0, sizeof *r);
    r->kind = FL_ROPE_DEFAULT;
    r->factor = 1.0f;
    r->beta_fast = 32.0f;
    r->beta_slow = 1.0f;
    r->original_max_pos = max_pos;
    FL_TRY(get_float(path, NULL, root, "rope_theta", 10000.0f, &r->theta));
    FL_TRY(get_float(path, NULL, root, "partial_rotary_factor", 1.0f, &r->partial_rotary_factor));

    const cJSON *rp = get(root, "rope_parameters");
    const char *pfx = "rope_parameters";
    if (rp) {
        if (!cJSON_IsObject(rp))
            return FL_ERR(FL_ERR_FORMAT, "%s: key \"rope_parameters\" must be an object, got %s", path, jtype(rp));
        /* Models with several attention kinds nest one object per layer
         * type; the supported classes use full attention everywhere. */
        const cJSON *full = get(rp, "full_attention");
        if (full && cJSON_IsObject(full)) {
            rp = full;
            pfx = "rope_parameters.full_attention";
        }
    } else {
        rp = get(root, "rope_scaling");
        pfx = "rope_scaling";
        if (rp && !cJSON_IsObject(rp))
            return FL_ERR(FL_ERR_FORMAT, "%s: key \"rope_scaling\" must be an object, got %s", path, jtype(rp));
    }
    if (rp) FL_TRY(parse_rope_obj(path, rp, pfx, max_pos, r));
    if (!(r->theta > 0.0f))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"rope_theta\" must be positive", path);
    if (!(r->partial_rotary_factor > 0.0f && r->partial_rotary_factor <= 1.0f))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"partial_rotary_factor\" must be in (0, 1]", path);
    return FL_OK;
}

static bool str_is(const cJSON *j, const char *v) { return j && cJSON_IsString(j) && !strcmp(j->valuestring, v); }

/* An FP8 block shape: two positive integers (key names it in errors). */
static fl_status get_block(const char *path, const char *key, const cJSON *j, int block[2]) {
    if (!cJSON_IsArray(j) || cJSON_GetArraySize(j) != 2)
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\" must be [rows, cols], got %s", path, key, jtype(j));
    for (int i = 0; i < 2; i++) {
        const cJSON *e = cJSON_GetArrayItem(j, i);
        if (!cJSON_IsNumber(e) || e->valuedouble != (double)(int)e->valuedouble || e->valueint <= 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: key \"%s\"[%d] must be a positive integer", path, key, i);
        block[i] = e->valueint;
    }
    return FL_OK;
}

/* compressed-tensors FP8 (llm-compressor's FP8, FP8_DYNAMIC, FP8_BLOCK
 * schemes): format "float-quantized" or "naive-quantized", 8-bit float
 * weights scaled per tensor, channel or block. Input activation settings
 * (static input_scale or dynamic) are accepted and ignored: flotilla
 * multiplies in bf16 / f32, never in FP8. */
static fl_status parse_ct_fp8(const char *path, const cJSON *grp, fl_model_config *cfg) {
    const cJSON *w = get(grp, "weights");
    if (!w || !cJSON_IsObject(w))
        return FL_ERR(FL_ERR_FORMAT, "%s: quantization_config.config_groups.%s.weights is missing", path,
                      grp->string);
    if (get(grp, "output_activations"))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.config_groups.%s quantizes output "
                      "activations, which is not supported", path, grp->string);
    char pfx[160];
    snprintf(pfx, sizeof pfx, "quantization_config.config_groups.%s.weights", grp->string);
    int bits;
    bool dyn;
    FL_TRY(get_int(path, pfx, w, "num_bits", true, 0, &bits));
    FL_TRY(get_bool(path, pfx, w, "dynamic", false, &dyn));
    const cJSON *type = get(w, "type"), *strat = get(w, "strategy");
    if (bits != 8 || !str_is(type, "float") || dyn)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s: only static 8-bit float weights are supported in this format "
                      "(num_bits %d, type %s)", path, pfx, bits,
                      type && cJSON_IsString(type) ? type->valuestring : "?");
    cfg->quant_block[0] = cfg->quant_block[1] = 0;
    if (str_is(strat, "tensor")) {
        cfg->quant_fp8 = FL_FP8_TENSOR;
    } else if (str_is(strat, "channel")) {
        cfg->quant_fp8 = FL_FP8_CHANNEL;
    } else if (str_is(strat, "block")) {
        char key[192];
        snprintf(key, sizeof key, "%s.block_structure", pfx);
        FL_TRY(get_block(path, key, get(w, "block_structure"), cfg->quant_block));
        cfg->quant_fp8 = FL_FP8_BLOCK;
    } else {
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s.strategy %s is not supported for FP8 (supported: tensor, "
                      "channel, block)", path, pfx, strat && cJSON_IsString(strat) ? strat->valuestring : "(missing)");
    }
    cfg->quant = FL_QUANT_FP8;
    cfg->quant_scale_inv = false;
    return FL_OK;
}

/* quant_method "fp8" (transformers' FineGrainedFP8Config, DeepSeek-V3
 * style): float8_e4m3fn weights with weight_scale_inv per
 * weight_block_size tile, or one per tensor when weight_block_size is null.
 * activation_scheme is ignored (activations stay bf16 / f32). */
static fl_status parse_hf_fp8(const char *path, const cJSON *q, fl_model_config *cfg) {
    const cJSON *fmt = get(q, "scale_fmt"), *ed = get(q, "expert_dtype"), *act = get(q, "activation_scheme");
    if (fmt && !str_is(fmt, "float"))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.scale_fmt %s is not supported for FP8 "
                      "(supported: \"float\")", path, cJSON_IsString(fmt) ? fmt->valuestring : jtype(fmt));
    if (ed && !str_is(ed, "fp8"))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.expert_dtype %s is not supported (supported: "
                      "\"fp8\")", path, cJSON_IsString(ed) ? ed->valuestring : jtype(ed));
    if (act && !str_is(act, "dynamic") && !str_is(act, "static"))
        return FL_ERR(FL_ERR_FORMAT, "%s: quantization_config.activation_scheme must be \"dynamic\" or "
                      "\"static\"", path);
    const cJSON *b = get(q, "weight_block_size");
    cfg->quant_block[0] = cfg->quant_block[1] = 0;
    cfg->quant_fp8 = FL_FP8_TENSOR;
    if (b) {
        FL_TRY(get_block(path, "quantization_config.weight_block_size", b, cfg->quant_block));
        cfg->quant_fp8 = FL_FP8_BLOCK;
    }
    cfg->quant = FL_QUANT_FP8;
    cfg->quant_scale_inv = true;
    return FL_OK;
}

/* compressed-tensors (llm-compressor) W4A16: format "pack-quantized", one
 * config group of 4-bit int weights, group or channel strategy, no
 * activation quantization and no column reordering (actorder "group" /
 * "weight" stores a g_idx permutation flotilla does not apply). */
static fl_status parse_ct(const char *path, const cJSON *q, fl_model_config *cfg) {
    const cJSON *groups = get(q, "config_groups"), *fmt = get(q, "format");
    if (!groups || !cJSON_IsObject(groups) || cJSON_GetArraySize(groups) != 1)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.config_groups must hold exactly one group "
                      "(compressed-tensors with several schemes is not supported)", path);
    const cJSON *grp = groups->child, *w = get(grp, "weights");
    const cJSON *gfmt = get(grp, "format");
    const char *f = gfmt && cJSON_IsString(gfmt) ? gfmt->valuestring
                    : fmt && cJSON_IsString(fmt) ? fmt->valuestring : "(none)";
    if (!strcmp(f, "float-quantized") || !strcmp(f, "naive-quantized")) return parse_ct_fp8(path, grp, cfg);
    if (strcmp(f, "pack-quantized") != 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: compressed-tensors format \"%s\" is not supported (supported: "
                      "pack-quantized, float-quantized, naive-quantized)", path, f);
    if (get(grp, "input_activations") || get(grp, "output_activations"))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.config_groups.%s quantizes activations; only "
                      "weight-only (W4A16) compressed-tensors checkpoints are supported", path, grp->string);
    if (!w || !cJSON_IsObject(w))
        return FL_ERR(FL_ERR_FORMAT, "%s: quantization_config.config_groups.%s.weights is missing", path,
                      grp->string);
    char pfx[160];
    snprintf(pfx, sizeof pfx, "quantization_config.config_groups.%s.weights", grp->string);
    int bits, group = 0;
    bool sym, dyn;
    FL_TRY(get_int(path, pfx, w, "num_bits", true, 0, &bits));
    FL_TRY(get_bool(path, pfx, w, "symmetric", true, &sym));
    FL_TRY(get_bool(path, pfx, w, "dynamic", false, &dyn));
    const cJSON *type = get(w, "type"), *strat = get(w, "strategy"), *act = get(w, "actorder");
    if (bits != 4 || (type && !str_is(type, "int")) || dyn)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s: only static 4-bit int weights are supported (num_bits %d, "
                      "type %s)", path, pfx, bits, type && cJSON_IsString(type) ? type->valuestring : "?");
    if (act && !(cJSON_IsFalse(act) || str_is(act, "static")))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s.actorder = %s reorders the columns by a g_idx permutation, "
                      "which flotilla does not apply (supported: null, false, \"static\")", path, pfx,
                      cJSON_IsString(act) ? act->valuestring : "true");
    if (str_is(strat, "group")) {
        FL_TRY(get_pos_int(path, pfx, w, "group_size", true, 0, &group));
        if (group % 2)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s.group_size = %d is not supported (must be even)", path,
                          pfx, group);
    } else if (!str_is(strat, "channel")) {
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s.strategy %s is not supported (supported: group, channel)", path,
                      pfx, strat && cJSON_IsString(strat) ? strat->valuestring : "(missing)");
    }
    cfg->quant = FL_QUANT_CT_PACK;
    cfg->quant_group_size = group;
    cfg->quant_symmetric = sym;
    return FL_OK;
}

/* GPTQ (AutoGPTQ, GPTQModel, transformers/optimum): 4-bit, group or per
 * channel (group_size -1), symmetric or not, with or without act-order
 * (desc_act; the loader reads g_idx). "checkpoint_format" (transformers) or
 * "format" (GPTQModel) "gptq" stores zero points minus one, "gptq_v2" as
 * they are; the other layouts of the family (marlin, planar) are refused. */
static fl_status parse_gptq(const char *path, const cJSON *q, fl_model_config *cfg) {
    static const char *const P = "quantization_config";
    int bits, group;
    bool sym, desc_act, marlin;
    FL_TRY(get_int(path, P, q, "bits", true, 0, &bits));
    FL_TRY(get_int(path, P, q, "group_size", false, 128, &group));
    FL_TRY(get_bool(path, P, q, "sym", true, &sym));
    FL_TRY(get_bool(path, P, q, "desc_act", false, &desc_act));
    FL_TRY(get_bool(path, P, q, "is_marlin_format", false, &marlin));
    if (bits != 4)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.bits = %d is not supported for GPTQ "
                      "(supported: 4)", path, bits);
    if (group != -1 && (group <= 0 || group % 2))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.group_size = %d is not supported for GPTQ "
                      "(a positive even number, or -1 for one group per output channel)", path, group);
    const char *fmt = "gptq", *key = NULL;
    static const char *const fmt_keys[2] = {"checkpoint_format", "format"};
    for (int i = 0; i < 2; i++) {
        const cJSON *f = get(q, fmt_keys[i]);
        if (!f || cJSON_IsNull(f)) continue;
        if (!cJSON_IsString(f))
            return FL_ERR(FL_ERR_FORMAT, "%s: key \"quantization_config.%s\" must be a string, got %s", path,
                          fmt_keys[i], jtype(f));
        if (key && strcasecmp(fmt, f->valuestring) != 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: quantization_config.%s \"%s\" contradicts quantization_config.%s "
                          "\"%s\"", path, fmt_keys[i], f->valuestring, key, fmt);
        fmt = f->valuestring;
        key = fmt_keys[i];
    }
    const bool v1 = !strcasecmp(fmt, "gptq");
    if ((!v1 && strcasecmp(fmt, "gptq_v2") != 0) || marlin)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.%s \"%s\" is not supported for GPTQ "
                      "(supported: gptq, gptq_v2)", path, marlin ? "is_marlin_format" : key ? key : "format",
                      marlin ? "true" : fmt);
    const cJSON *pd = get(q, "pack_dtype");
    if (pd && !str_is(pd, "int32"))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.pack_dtype %s is not supported for GPTQ "
                      "(supported: \"int32\")", path, cJSON_IsString(pd) ? pd->valuestring : jtype(pd));
    const cJSON *dyn = get(q, "dynamic");
    if (dyn && !cJSON_IsNull(dyn) && !(cJSON_IsObject(dyn) && !dyn->child))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.dynamic (per-module bits / group sizes) is "
                      "not supported", path);
    cfg->quant = FL_QUANT_GPTQ;
    cfg->quant_group_size = group == -1 ? 0 : group;
    cfg->quant_symmetric = sym;
    cfg->quant_act_order = desc_act;
    cfg->quant_zeros_minus_one = v1;
    return FL_OK;
}

static fl_status parse_quant(const char *path, const cJSON *root, fl_model_config *cfg) {
    const cJSON *q = get(root, "quantization_config");
    if (!q) return FL_OK;
    if (!cJSON_IsObject(q))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"quantization_config\" must be an object, got %s", path, jtype(q));
    const cJSON *m = get(q, "quant_method");
    if (!m || !cJSON_IsString(m))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"quantization_config.quant_method\" is missing or not a string",
                      path);
    if (!strcasecmp(m->valuestring, "compressed-tensors")) return parse_ct(path, q, cfg);
    if (!strcasecmp(m->valuestring, "gptq")) return parse_gptq(path, q, cfg);
    if (!strcasecmp(m->valuestring, "fp8")) return parse_hf_fp8(path, q, cfg);
    if (strcasecmp(m->valuestring, "awq") != 0)
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: quantization_config.quant_method \"%s\" is not supported (supported: awq, "
                      "compressed-tensors, fp8, gptq)", path, m->valuestring);
    const cJSON *v = get(q, "version");
    if (v && !cJSON_IsString(v))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"quantization_config.version\" must be a string", path);
    if (v && strcasecmp(v->valuestring, "gemm") != 0)
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: quantization_config.version \"%s\" is not supported (supported: gemm)", path,
                      v->valuestring);
    /* config.json says bits/group_size; AutoAWQ's own quant_config says
     * w_bit/q_group_size. */
    int bits, group;
    bool zp;
    FL_TRY(get_int(path, "quantization_config", q, get(q, "bits") ? "bits" : "w_bit", false, 4, &bits));
    FL_TRY(get_int(path, "quantization_config", q, get(q, "group_size") ? "group_size" : "q_group_size", true, 0, &group));
    FL_TRY(get_bool(path, "quantization_config", q, "zero_point", true, &zp));
    if (bits != 4)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: quantization_config.bits = %d is not supported (supported: 4)",
                      path, bits);
    if (group != 32 && group != 64 && group != 128)
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: quantization_config.group_size = %d is not supported (supported: 32, 64, 128)", path,
                      group);
    if (!zp)
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: quantization_config.zero_point = false is not supported (AWQ GEMM with zero points "
                      "only)",
                      path);
    cfg->quant = FL_QUANT_AWQ;
    cfg->quant_group_size = group;
    return FL_OK;
}

static fl_status parse_tokens(const char *path, const cJSON *root, fl_model_config *cfg) {
    FL_TRY(get_int(path, NULL, root, "bos_token_id", false, -1, &cfg->bos_token_id));
    cfg->n_eos = 0;
    const cJSON *e = get(root, "eos_token_id");
    if (!e) return FL_OK;
    if (cJSON_IsArray(e)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, e) {
            if (cfg->n_eos == FL_MAX_EOS)
                return FL_ERR(FL_ERR_UNSUPPORTED, "%s: key \"eos_token_id\" lists more than %d ids", path,
                              FL_MAX_EOS);
            FL_TRY(as_int(path, "eos_token_id", it, &cfg->eos_token_ids[cfg->n_eos]));
            cfg->n_eos++;
        }
        return FL_OK;
    }
    FL_TRY(as_int(path, "eos_token_id", e, &cfg->eos_token_ids[0]));
    cfg->n_eos = 1;
    return FL_OK;
}

static fl_status parse_moe(const char *path, const cJSON *root, fl_model_config *cfg) {
    const char *ekey = get(root, "num_local_experts") ? "num_local_experts" : "num_experts";
    FL_TRY(get_pos_int(path, NULL, root, ekey, true, 0, &cfg->n_experts));
    FL_TRY(get_pos_int(path, NULL, root, "num_experts_per_tok", true, 0, &cfg->n_experts_per_tok));
    if (cfg->n_experts_per_tok > cfg->n_experts)
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"num_experts_per_tok\" (%d) exceeds \"%s\" (%d)", path,
                      cfg->n_experts_per_tok, ekey, cfg->n_experts);
    if (cfg->arch == FL_ARCH_MIXTRAL) {
        cfg->moe_intermediate_size = cfg->intermediate_size;
        cfg->norm_topk_prob = true;
        cfg->decoder_sparse_step = 1;
        return FL_OK;
    }
    FL_TRY(get_pos_int(path, NULL, root, "moe_intermediate_size", true, 0, &cfg->moe_intermediate_size));
    FL_TRY(get_bool(path, NULL, root, "norm_topk_prob", false, &cfg->norm_topk_prob));
    FL_TRY(get_pos_int(path, NULL, root, "decoder_sparse_step", false, 1, &cfg->decoder_sparse_step));
    if (cfg->arch == FL_ARCH_QWEN2_MOE) {
        FL_TRY(get_int(path, NULL, root, "shared_expert_intermediate_size", false, 0,
                       &cfg->shared_expert_intermediate_size));
        if (cfg->shared_expert_intermediate_size < 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: key \"shared_expert_intermediate_size\" must not be negative", path);
    }
    const cJSON *mo = get(root, "mlp_only_layers");
    if (mo) {
        if (!cJSON_IsArray(mo))
            return FL_ERR(FL_ERR_FORMAT, "%s: key \"mlp_only_layers\" must be a list of integers, got %s", path,
                          jtype(mo));
        const cJSON *it;
        cJSON_ArrayForEach(it, mo) {
            int l = 0; /* as_int sets it on success; GCC -O3 cannot see that */
            FL_TRY(as_int(path, "mlp_only_layers", it, &l));
            if (l < 0 || l >= cfg->n_layers)
                return FL_ERR(FL_ERR_FORMAT, "%s: key \"mlp_only_layers\" names layer %d, outside 0..%d", path, l,
                              cfg->n_layers - 1);
            if (l >= 256)
                return FL_ERR(FL_ERR_UNSUPPORTED, "%s: key \"mlp_only_layers\": layer %d >= 256 is not supported",
                              path, l);
            cfg->mlp_only_layers_mask[l / 64] |= UINT64_C(1) << (l % 64);
        }
    }
    return FL_OK;
}

/* DeepSeek-V2: MLA shapes and DeepSeekMoE routing. Key names and defaults are
 * those of DeepseekV2Config (transformers 5.24) and of the hub configs
 * (which add moe_layer_freq and scoring_func). norm_topk_prob: transformers
 * 5.24 ignores it; DeepSeek's own modeling code renormalizes the top-k
 * weights (and then skips routed_scaling_factor) when it is true and k > 1,
 * and that is what the forward does. Every released V2 config has it false. */
static fl_status parse_deepseek(const char *path, const cJSON *root, fl_model_config *cfg) {
    fl_mla_config *a = &cfg->mla;
    FL_TRY(get_pos_int(path, NULL, root, "q_lora_rank", false, 0, &a->q_lora_rank));
    FL_TRY(get_pos_int(path, NULL, root, "kv_lora_rank", false, 512, &a->kv_lora_rank));
    FL_TRY(get_pos_int(path, NULL, root, "qk_nope_head_dim", false, 128, &a->qk_nope_head_dim));
    FL_TRY(get_pos_int(path, NULL, root, "qk_rope_head_dim", false, 64, &a->qk_rope_head_dim));
    FL_TRY(get_pos_int(path, NULL, root, "v_head_dim", false, 128, &a->v_head_dim));
    if (a->qk_rope_head_dim % 2 || (a->kv_lora_rank + a->qk_rope_head_dim) % 2)
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: qk_rope_head_dim (%d) and kv_lora_rank + qk_rope_head_dim (%d) must be even", path,
                      a->qk_rope_head_dim, a->kv_lora_rank + a->qk_rope_head_dim);
    if (a->kv_lora_rank > 4096 || a->qk_nope_head_dim + a->qk_rope_head_dim > 1024 || a->v_head_dim > 1024)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: MLA sizes kv_lora_rank %d / qk head dim %d / v_head_dim %d are "
                      "too large (at most 4096 / 1024 / 1024)", path, a->kv_lora_rank,
                      a->qk_nope_head_dim + a->qk_rope_head_dim, a->v_head_dim);
    /* The cache holds one latent record per token (see model_config.h). */
    cfg->n_kv_heads = 1;
    cfg->head_dim = (a->kv_lora_rank + a->qk_rope_head_dim) / 2;

    FL_TRY(get_int(path, NULL, root, "n_routed_experts", false, 0, &cfg->n_experts));
    if (cfg->n_experts < 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"n_routed_experts\" must not be negative", path);
    cfg->decoder_sparse_step = 1;
    if (cfg->n_experts == 0) return FL_OK; /* null: a dense model */
    FL_TRY(get_pos_int(path, NULL, root, "num_experts_per_tok", true, 0, &cfg->n_experts_per_tok));
    if (cfg->n_experts_per_tok > cfg->n_experts)
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"num_experts_per_tok\" (%d) exceeds \"n_routed_experts\" (%d)",
                      path, cfg->n_experts_per_tok, cfg->n_experts);
    FL_TRY(get_pos_int(path, NULL, root, "moe_intermediate_size", true, 0, &cfg->moe_intermediate_size));
    FL_TRY(get_int(path, NULL, root, "n_shared_experts", false, 0, &cfg->n_shared_experts));
    if (cfg->n_shared_experts < 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"n_shared_experts\" must not be negative", path);
    cfg->shared_expert_intermediate_size = cfg->moe_intermediate_size * cfg->n_shared_experts;
    FL_TRY(get_int(path, NULL, root, "first_k_dense_replace", false, 0, &cfg->first_k_dense_replace));
    if (cfg->first_k_dense_replace < 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"first_k_dense_replace\" must not be negative", path);
    FL_TRY(get_pos_int(path, NULL, root, "moe_layer_freq", false, 1, &cfg->moe_layer_freq));
    FL_TRY(get_float(path, NULL, root, "routed_scaling_factor", 1.0f, &cfg->routed_scaling_factor));
    if (!(cfg->routed_scaling_factor > 0.0f))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"routed_scaling_factor\" must be positive", path);
    FL_TRY(get_bool(path, NULL, root, "norm_topk_prob", false, &cfg->norm_topk_prob));
    const cJSON *sf = get(root, "scoring_func");
    if (sf && (!cJSON_IsString(sf) || strcmp(sf->valuestring, "softmax") != 0))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: key \"scoring_func\": only \"softmax\" is supported", path);
    const cJSON *tm = get(root, "topk_method");
    if (tm && !cJSON_IsString(tm))
        return FL_ERR(FL_ERR_FORMAT, "%s: key \"topk_method\" must be a string, got %s", path, jtype(tm));
    const char *method = tm ? tm->valuestring : "greedy";
    cfg->n_group = cfg->topk_group = 1;
    if (strcmp(method, "greedy") == 0) {
        cfg->topk_method = FL_TOPK_GREEDY;
    } else if (strcmp(method, "group_limited_greedy") == 0) {
        cfg->topk_method = FL_TOPK_GROUP_LIMITED;
        FL_TRY(get_pos_int(path, NULL, root, "n_group", true, 1, &cfg->n_group));
        FL_TRY(get_pos_int(path, NULL, root, "topk_group", true, 1, &cfg->topk_group));
        if (cfg->n_experts % cfg->n_group || cfg->topk_group > cfg->n_group ||
            cfg->topk_group * (cfg->n_experts / cfg->n_group) < cfg->n_experts_per_tok)
            return FL_ERR(FL_ERR_FORMAT,
                          "%s: n_group %d / topk_group %d do not fit n_routed_experts %d with num_experts_per_tok %d",
                          path, cfg->n_group, cfg->topk_group, cfg->n_experts, cfg->n_experts_per_tok);
    } else {
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: key \"topk_method\": \"%s\" is not supported (supported: greedy, group_limited_greedy)",
                      path, method);
    }
    return FL_OK;
}

fl_status fl_model_config_from_json(const char *path, fl_model_config *cfg) {
    fl_status st = FL_OK;
    cJSON *root = NULL;
    memset(cfg, 0, sizeof *cfg);
    FL_TRY(fl_json_parse_file(path, &root));
    if (!cJSON_IsObject(root)) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: top-level JSON value is not an object", path);
        goto fail;
    }
    FL_TRY_GOTO(parse_arch(path, root, &cfg->arch), st, fail);
    bool qwen_moe = cfg->arch == FL_ARCH_QWEN2_MOE || cfg->arch == FL_ARCH_QWEN3_MOE;
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "vocab_size", true, 0, &cfg->vocab_size), st, fail);
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "hidden_size", true, 0, &cfg->hidden_size), st, fail);
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "num_hidden_layers", true, 0, &cfg->n_layers), st, fail);
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "num_attention_heads", true, 0, &cfg->n_heads), st, fail);
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "num_key_value_heads", false, cfg->n_heads, &cfg->n_kv_heads), st, fail);
    if (cfg->n_heads % cfg->n_kv_heads != 0) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                    path, cfg->n_heads, cfg->n_kv_heads);
        goto fail;
    }
    if (!get(root, "head_dim") && cfg->hidden_size % cfg->n_heads != 0) {
        st = FL_ERR(FL_ERR_FORMAT,
                    "%s: key \"head_dim\" is missing and hidden_size (%d) is not a multiple of "
                    "num_attention_heads (%d)",
                    path, cfg->hidden_size, cfg->n_heads);
        goto fail;
    }
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "head_dim", false, cfg->hidden_size / cfg->n_heads, &cfg->head_dim), st,
                fail);
    /* The Qwen MoE classes may have no dense layer at all, so their dense
     * intermediate_size is optional. */
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "intermediate_size", !qwen_moe, 0, &cfg->intermediate_size), st, fail);
    FL_TRY_GOTO(get_pos_int(path, NULL, root, "max_position_embeddings", false, 2048, &cfg->max_position_embeddings),
                st, fail);
    FL_TRY_GOTO(get_float(path, NULL, root, "rms_norm_eps", cfg->arch == FL_ARCH_MIXTRAL ? 1e-5f : 1e-6f,
                          &cfg->rms_norm_eps),
                st, fail);
    if (!(cfg->rms_norm_eps > 0.0f)) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: key \"rms_norm_eps\" must be positive", path);
        goto fail;
    }
    FL_TRY_GOTO(get_bool(path, NULL, root, "tie_word_embeddings", false, &cfg->tie_word_embeddings), st, fail);
    switch (cfg->arch) {
    case FL_ARCH_QWEN2: cfg->attention_bias = true; break;
    case FL_ARCH_QWEN2_MOE:
        FL_TRY_GOTO(get_bool(path, NULL, root, "qkv_bias", true, &cfg->attention_bias), st, fail);
        break;
    case FL_ARCH_MIXTRAL: cfg->attention_bias = false; break;
    default:
        FL_TRY_GOTO(get_bool(path, NULL, root, "attention_bias", false, &cfg->attention_bias), st, fail);
        break;
    }
    cfg->qk_norm = cfg->arch == FL_ARCH_QWEN3_MOE;
    FL_TRY_GOTO(parse_rope(path, root, cfg->max_position_embeddings, &cfg->rope), st, fail);
    cfg->decoder_sparse_step = 1;
    if (cfg->arch == FL_ARCH_MIXTRAL || qwen_moe) FL_TRY_GOTO(parse_moe(path, root, cfg), st, fail);
    if (cfg->arch == FL_ARCH_DEEPSEEK_V2) FL_TRY_GOTO(parse_deepseek(path, root, cfg), st, fail);
    FL_TRY_GOTO(parse_tokens(path, root, cfg), st, fail);
    FL_TRY_GOTO(parse_quant(path, root, cfg), st, fail);
    cJSON_Delete(root);
    return FL_OK;

fail:
    cJSON_Delete(root);
    return st;
}
