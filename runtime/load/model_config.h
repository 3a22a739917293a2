/*
 * model_config.h — the architecture-independent description of a model,
 * filled from a Hugging Face config.json or from GGUF metadata.
 *
 * Everything the forward pass needs to know about shapes and variants lives
 * here; the forward never looks at config.json or GGUF keys itself.
 */
#ifndef FL_MODEL_CONFIG_H
#define FL_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fl_arch {
    FL_ARCH_LLAMA = 0,  /* LlamaForCausalLM, MistralForCausalLM (Llama-2/3, Mistral, SmolLM2) */
    FL_ARCH_QWEN2,      /* Qwen2ForCausalLM: q/k/v bias */
    FL_ARCH_MIXTRAL,    /* MixtralForCausalLM: block_sparse_moe, w1/w2/w3 experts */
    FL_ARCH_QWEN2_MOE,  /* Qwen2MoeForCausalLM: qkv bias, shared expert with sigmoid gate */
    FL_ARCH_QWEN3_MOE,  /* Qwen3MoeForCausalLM: q/k RMSNorm per head, no qkv bias */
    FL_ARCH_DEEPSEEK_V2,/* DeepseekV2ForCausalLM: MLA attention, DeepSeekMoE (shared experts) */
    FL_ARCH_COUNT
} fl_arch;

const char *fl_arch_name(fl_arch a); /* HF class name, e.g. "LlamaForCausalLM" */

typedef enum fl_rope_kind {
    FL_ROPE_DEFAULT = 0,
    FL_ROPE_LINEAR,   /* positions divided by factor */
    FL_ROPE_DYNAMIC,  /* dynamic NTK: base grows once seq_len > original max */
    FL_ROPE_YARN,
    FL_ROPE_LLAMA3,
} fl_rope_kind;

typedef struct fl_rope_config {
    fl_rope_kind kind;
    float theta;              /* rope_theta (base) */
    float factor;             /* scaling factor (linear, dynamic, yarn, llama3) */
    float low_freq_factor;    /* llama3 */
    float high_freq_factor;   /* llama3 */
    int original_max_pos;     /* original_max_position_embeddings (llama3, yarn, dynamic) */
    float beta_fast, beta_slow; /* yarn (defaults 32, 1) */
    float attention_factor;   /* yarn mscale; 0 = derive from factor */
    float mscale, mscale_all_dim; /* yarn (DeepSeek): 0 = absent. Both set: attention_factor =
                                     m(factor, mscale) / m(factor, mscale_all_dim), with
                                     m(s, k) = 0.1 k ln s + 1 */
    float partial_rotary_factor; /* fraction of head_dim rotated (default 1) */
    bool interleaved;         /* rotate pairs (2i, 2i+1) (GGUF llama layout) instead of
                                 halves (i, i + d/2) (HF layout) */
} fl_rope_config;

/* DeepSeek-V2 router expert selection. */
typedef enum fl_topk_method {
    FL_TOPK_GREEDY = 0,          /* top-k of the softmax probabilities */
    FL_TOPK_GROUP_LIMITED,       /* group_limited_greedy: keep topk_group groups (group score =
                                    max prob in it), then top-k among their experts */
} fl_topk_method;

/* Multi-head latent attention (DeepSeek-V2). */
typedef struct fl_mla_config {
    int q_lora_rank;         /* 0: q_proj directly (config null) */
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
} fl_mla_config;

typedef enum fl_quant_kind {
    FL_QUANT_NONE = 0,
    FL_QUANT_AWQ,   /* AutoAWQ GEMM: qweight/qzeros/scales tensors */
    FL_QUANT_CT_PACK, /* compressed-tensors pack-quantized int4: weight_packed/weight_scale[/weight_zero_point] */
    FL_QUANT_GPTQ,    /* GPTQ int4: qweight/qzeros/scales/g_idx tensors */
    FL_QUANT_FP8,     /* float8_e4m3fn .weight times .weight_scale (compressed-tensors float-/naive-quantized)
                         or .weight_scale_inv (quant_method "fp8"): per tensor, channel or block */
} fl_quant_kind;

/* What one FP8 weight scale covers. */
typedef enum fl_fp8_scaling {
    FL_FP8_TENSOR = 0, /* the whole linear */
    FL_FP8_CHANNEL,    /* one output row */
    FL_FP8_BLOCK,      /* a quant_block[0] x quant_block[1] tile (the last tiles may be partial) */
} fl_fp8_scaling;

#define FL_MAX_EOS 8

typedef struct fl_model_config {
    fl_arch arch;
    int vocab_size;
    int hidden_size;
    int n_layers;
    int n_heads;
    int n_kv_heads;
    int head_dim;            /* explicit head_dim or hidden_size / n_heads. MLA (DeepSeek-V2):
                                n_kv_heads is 1 and head_dim is HALF the cached latent record
                                (kv_lora_rank + qk_rope_head_dim): n_kv_heads * head_dim is the
                                per-array KV slot width everywhere, and MLA keeps the record's
                                first half in the K array and the second half in the V array,
                                so the cache holds exactly one record per token and layer. */
    int intermediate_size;   /* dense MLP */
    int max_position_embeddings;
    float rms_norm_eps;
    bool tie_word_embeddings;
    bool attention_bias;     /* q/k/v projections have a bias (Qwen2, Qwen2-MoE, or attention_bias) */
    bool qk_norm;            /* per-head RMSNorm on q and k (Qwen3-MoE) */
    fl_rope_config rope;

    /* Mixture of Experts (n_experts == 0 for dense models) */
    int n_experts;
    int n_experts_per_tok;
    int moe_intermediate_size;
    int shared_expert_intermediate_size; /* 0 = none */
    bool norm_topk_prob;
    int decoder_sparse_step;  /* layer l is MoE when (l + 1) % step == 0 ... */
    uint64_t mlp_only_layers_mask[4]; /* ... and bit l is clear (layers < 256) */

    /* DeepSeek-V2 (arch FL_ARCH_DEEPSEEK_V2 only) */
    fl_mla_config mla;
    int first_k_dense_replace;   /* layers < this are dense */
    int moe_layer_freq;          /* ... and MoE layers are those with l % freq == 0 */
    float routed_scaling_factor; /* routed expert weights are multiplied by it */
    fl_topk_method topk_method;
    int n_group, topk_group;
    int n_shared_experts;        /* shared_expert_intermediate_size = moe_inter * this */

    int bos_token_id;        /* -1 when unknown */
    int eos_token_ids[FL_MAX_EOS];
    int n_eos;

    fl_quant_kind quant;
    int quant_group_size;    /* AWQ / compressed-tensors / GPTQ group size; 0: one group per row (channel) */
    bool quant_symmetric;    /* compressed-tensors: no weight_zero_point (codes carry an offset of 8); GPTQ: sym */
    bool quant_act_order;    /* GPTQ desc_act (the g_idx tensors decide how each linear loads) */
    bool quant_zeros_minus_one; /* GPTQ checkpoint format "gptq": qzeros words hold zero points minus one */
    fl_fp8_scaling quant_fp8;   /* FP8: what one scale covers */
    int quant_block[2];         /* FP8 block scaling: [rows, cols] of weights per scale */
    bool quant_scale_inv;       /* FP8: scales are named weight_scale_inv (quant_method "fp8") */
} fl_model_config;

/* Parses a Hugging Face config.json. Understands both the older top-level
 * rope_theta / rope_scaling keys and the newer rope_parameters object.
 * Errors name the file and the key. */
fl_status fl_model_config_from_json(const char *path, fl_model_config *cfg);

/* True when layer l uses the MoE block rather than the dense MLP. */
bool fl_model_config_layer_is_moe(const fl_model_config *cfg, int l);

#ifdef __cplusplus
}
#endif
#endif /* FL_MODEL_CONFIG_H */
