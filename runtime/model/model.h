/*
 * model.h — a loaded model: its config plus backend-resident weights.
 *
 * The model is plain data; only the forward pass (forward.h) and the
 * backend change per device. Weight names and shapes follow Hugging Face
 * (the loaders map other formats onto them). Shapes are given per field.
 */
#ifndef FL_MODEL_H
#define FL_MODEL_H

#include "kernels/backend.h"
#include "runtime/load/checkpoint.h"
#include "runtime/load/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_mlp_weights {
    fl_tensor gate;    /* [inter, hidden] */
    fl_tensor up;      /* [inter, hidden] */
    fl_tensor gate_up; /* [2 inter, hidden]: gate rows then up rows, when fused at load
                          (runtime/model/model_fuse.c); gate and up are then empty */
    fl_tensor down;    /* [hidden, inter] */
} fl_mlp_weights;

typedef struct fl_layer_weights {
    fl_tensor attn_norm;        /* [hidden] */
    fl_tensor wq;               /* [n_heads * head_dim, hidden] */
    fl_tensor wk;               /* [n_kv_heads * head_dim, hidden] */
    fl_tensor wv;               /* [n_kv_heads * head_dim, hidden] */
    fl_tensor wo;               /* [hidden, n_heads * head_dim] */
    fl_tensor bq, bk, bv;       /* [q_dim], [kv_dim], [kv_dim] when attention_bias */
    fl_tensor bo;               /* [hidden] when the checkpoint has o_proj.bias (Llama attention_bias) */
    fl_tensor wqkv, bqkv;       /* q|k|v rows (and biases) stacked when fused at load (not with
                                   qk_norm, whose per-head norms want q and k contiguous);
                                   wq, wk, wv, bq, bk, bv are then empty */
    fl_tensor q_norm, k_norm;   /* [head_dim] when qk_norm */
    /* MLA (DeepSeek-V2); wq is q_proj [n_heads * (nope + rope), hidden] when q_lora_rank is 0 */
    fl_tensor wq_a;             /* q_a_proj [q_lora_rank, hidden] */
    fl_tensor q_a_norm;         /* q_a_layernorm [q_lora_rank] */
    fl_tensor wq_b;             /* q_b_proj [n_heads * (nope + rope), q_lora_rank] */
    fl_tensor bq_a;             /* q_a_proj bias when attention_bias */
    fl_tensor wkv_a;            /* kv_a_proj_with_mqa [kv_lora_rank + rope, hidden] (replicated) */
    fl_tensor bkv_a;            /* its bias when attention_bias */
    fl_tensor kv_a_norm;        /* kv_a_layernorm [kv_lora_rank] */
    fl_tensor wkv_b;            /* kv_b_proj [n_heads * (nope + v), kv_lora_rank] (local heads) */
    fl_tensor mlp_norm;         /* [hidden] */
    bool is_moe;
    fl_mlp_weights mlp;         /* dense layers */
    fl_tensor router;           /* [n_experts, hidden] (MoE) */
    fl_mlp_weights *experts;    /* [dims.n_experts] local experts (MoE) */
    bool has_shared;
    fl_mlp_weights shared;      /* shared expert (Qwen2-MoE), shared experts (DeepSeek-V2) */
    fl_tensor shared_gate;      /* [1, hidden] sigmoid gate of the shared expert (Qwen2-MoE only) */
} fl_layer_weights;

/* Which part of the model this rank holds (all zeros/ones: everything).
 * Attention heads, the dense MLP, shared experts and lm_head rows are split
 * over tp ranks (Megatron column/row parallel). Routed experts are
 * partitioned over ep ranks, and each local expert's inner dimension is split
 * again over ex ranks (ex = world / ep when dp = 1), so every rank holds a
 * 1/world share of the MoE weights and one all-reduce completes the layer. */
typedef struct fl_shard {
    int tp_rank, tp_size;
    int ep_rank, ep_size;
    int ex_rank, ex_size;
} fl_shard;

/* The local sizes that follow from a shard. */
typedef struct fl_model_dims {
    int n_heads, q_head_lo;       /* local query heads, first global one */
    int n_kv_heads, kv_head_lo;   /* local KV heads (1 when replicated), first global one */
    int inter, inter_lo;          /* dense MLP columns */
    int moe_inter, moe_inter_lo;  /* each routed expert's columns */
    int shared_inter, shared_inter_lo;
    int expert_lo, n_experts;     /* local routed experts */
    int vocab_lo, vocab;          /* lm_head rows */
} fl_model_dims;

/* Derives the local sizes and checks that the split divides: names the
 * numbers that do not ("12 attention heads are not divisible by tp 5"). */
/* The checkpoint (HF) names of one MLP's gate, up and down projections in
 * layer `layer`: the dense MLP (FL_MLP_DENSE), the shared expert
 * (FL_MLP_SHARED) or routed expert `expert`. The loader and the memory
 * planner both name tensors through here, so the plan reads what loads. */
enum { FL_MLP_DENSE = -1, FL_MLP_SHARED = -2 };
typedef struct fl_mlp_names {
    char gate[128], up[128], down[128];
} fl_mlp_names;
void fl_model_mlp_names(const fl_model_config *c, int layer, int expert, fl_mlp_names *out);
/* The router of MoE layer `layer` (Mixtral's block_sparse_moe.gate, else mlp.gate). */
void fl_model_router_name(const fl_model_config *c, int layer, char out[128]);

fl_status fl_model_dims_init(const fl_model_config *c, const fl_shard *sh, fl_model_dims *d);

typedef struct fl_model {
    fl_model_config cfg;
    fl_shard shard;
    fl_model_dims dims;
    fl_backend *be;             /* borrowed */
    fl_tensor embed;            /* [vocab, hidden] */
    fl_tensor final_norm;       /* [hidden] */
    fl_tensor lm_head;          /* [vocab, hidden] (may share data with embed) */
    fl_layer_weights *layers;   /* [n_layers] */
    float *rope_freq_factors;   /* [rot_dim/2] host, or NULL: GGUF llama-3 rope_freqs divisors */
    fl_tensor *host_owned;      /* host tensors converted at load (freed with the model) */
    size_t n_host_owned, cap_host_owned;
    size_t weight_bytes;        /* bytes of weights as held by the backend */
    const fl_ckpt *ck;          /* the checkpoint it was loaded from (borrowed: the caller keeps it
                                   open while the model lives), NULL for synthetic models; the
                                   memory planner reads its headers */
    fl_load_quant quant;        /* how it was loaded */
    size_t mem_before_load;     /* measured around fl_model_load: the resident set (CPU backend)
                                   or the device memory in use (backends with mem_info), bytes */
    size_t mem_after_load;
} fl_model;

/* What the start-up logs measure: the backend's device memory in use
 * (total - free) when it has mem_info, else this process's resident set
 * (/proc/self/statm); 0 when unknown. */
size_t fl_model_mem_in_use(fl_backend *be);

typedef struct fl_model_load_opts {
    fl_load_quant quant;        /* FL_LOAD_AS_STORED, FL_LOAD_W4 or FL_LOAD_FP8 */
    fl_shard shard;             /* zeroed = the whole model */
} fl_model_load_opts;

/* Loads every weight of the checkpoint's model onto the backend. Errors
 * name the tensor (missing, wrong shape, unsupported dtype). */
fl_status fl_model_load(const fl_ckpt *ck, fl_backend *be, const fl_model_load_opts *opts,
                        fl_model **out);
void fl_model_free(fl_model *m);

/* For model builders (loaders, synthetic models): takes ownership of the
 * host tensor (kept until fl_model_free: the CPU backend aliases it) and
 * uploads it into *dev, counting its bytes in weight_bytes. */
fl_status fl_model_keep_weight(fl_model *m, fl_tensor *host, fl_tensor *dev);
/* Takes the n host tensors: when allowed and their rows can follow one
 * another (same dtype; matrices of one width and W4 group; vectors of any
 * length), keeps and uploads them stacked into *fused (model_fuse.c);
 * otherwise each into *devs[i] and *fused stays empty. */
fl_status fl_model_keep_fused(fl_model *m, fl_tensor *parts, int n, bool allow, fl_tensor *fused,
                              fl_tensor *const *devs);
/* Whether to stack q|k|v (gate_up false) or gate|up (true) weights of this
 * dtype into a stack of `rows` rows: by default q|k|v always and gate|up
 * unless W4 with more than 8192 rows (measured: model_fuse.c); FL_FUSE=0
 * neither, qkv q|k|v only, all both (for measurements). */
bool fl_model_fuse_wanted(bool gate_up, fl_dtype dt, int64_t rows);
/* FL_ERR_UNSUPPORTED for --quantize fp8 on a model it does not cover yet:
 * FP8 linears are the attention and dense MLP projections; MoE experts and
 * MLA's projections have no FP8 path in the backends. */
fl_status fl_model_fp8_supported(const fl_model_config *c, fl_load_quant q);
/* Whether Qwen3's per-head q and k norms are fused with the rotation and
 * the K/V store (the backend's qknorm_rope_kv_store), which also lets its
 * q|k|v weights be stacked: the backend has the op and FL_QKNORM_FUSE is
 * not 0 (read once; the A/B). The loader and the forward pass ask the same. */
bool fl_model_qknorm_fused(const fl_backend *be);

/* What one decode step reads from the weights as the backend holds them
 * (model_reads.c): every layer tensor, lm_head and the final norm (the
 * embedding is a lookup, left out); MoE layers' routed experts weigh
 * active_experts / local experts (the distinct experts a step routes to on
 * this rank). w4_group_bytes: a W4 group's scale + bias as the backend keeps
 * them (8 on the CPU: two f32; 4 on CUDA: a half2). */
typedef struct fl_model_step_reads {
    double bytes;        /* bytes a decode step reads */
    double params;       /* weights it multiplies (per token), lm_head included */
    double layer_params; /* the same without lm_head and the final norm: a prefill
                            token's, whose logits are not computed */
} fl_model_step_reads;
fl_status fl_model_step_reads_count(const fl_model *m, double w4_group_bytes, double active_experts,
                                    fl_model_step_reads *out);

/* Total parameter count (codes of W4 weights counted as parameters). */
int64_t fl_model_n_params(const fl_model *m);

#ifdef __cplusplus
}
#endif
#endif /* FL_MODEL_H */
