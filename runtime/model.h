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
#include "runtime/checkpoint.h"
#include "runtime/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_mlp_weights {
    fl_tensor gate; /* [inter, hidden] */
    fl_tensor up;   /* [inter, hidden] */
    fl_tensor down; /* [hidden, inter] */
} fl_mlp_weights;

typedef struct fl_layer_weights {
    fl_tensor attn_norm;        /* [hidden] */
    fl_tensor wq;               /* [n_heads * head_dim, hidden] */
    fl_tensor wk;               /* [n_kv_heads * head_dim, hidden] */
    fl_tensor wv;               /* [n_kv_heads * head_dim, hidden] */
    fl_tensor wo;               /* [hidden, n_heads * head_dim] */
    fl_tensor bq, bk, bv;       /* [q_dim], [kv_dim], [kv_dim] when attention_bias */
    fl_tensor bo;               /* [hidden] when the checkpoint has o_proj.bias (Llama attention_bias) */
    fl_tensor q_norm, k_norm;   /* [head_dim] when qk_norm */
    fl_tensor mlp_norm;         /* [hidden] */
    bool is_moe;
    fl_mlp_weights mlp;         /* dense layers */
    fl_tensor router;           /* [n_experts, hidden] (MoE) */
    fl_mlp_weights *experts;    /* [n_experts] (MoE) */
    bool has_shared;
    fl_mlp_weights shared;      /* shared expert (Qwen2-MoE) */
    fl_tensor shared_gate;      /* [1, hidden] sigmoid gate of the shared expert */
} fl_layer_weights;

typedef struct fl_model {
    fl_model_config cfg;
    fl_backend *be;             /* borrowed */
    fl_tensor embed;            /* [vocab, hidden] */
    fl_tensor final_norm;       /* [hidden] */
    fl_tensor lm_head;          /* [vocab, hidden] (may share data with embed) */
    fl_layer_weights *layers;   /* [n_layers] */
    float *rope_freq_factors;   /* [rot_dim/2] host, or NULL: GGUF llama-3 rope_freqs divisors */
    fl_tensor *host_owned;      /* host tensors converted at load (freed with the model) */
    size_t n_host_owned, cap_host_owned;
    size_t weight_bytes;        /* bytes of weights as held by the backend */
} fl_model;

typedef struct fl_model_load_opts {
    fl_load_quant quant;        /* FL_LOAD_AS_STORED or FL_LOAD_W4 */
} fl_model_load_opts;

/* Loads every weight of the checkpoint's model onto the backend. Errors
 * name the tensor (missing, wrong shape, unsupported dtype). */
fl_status fl_model_load(const fl_ckpt *ck, fl_backend *be, const fl_model_load_opts *opts,
                        fl_model **out);
void fl_model_free(fl_model *m);

/* Total parameter count (codes of W4 weights counted as parameters). */
int64_t fl_model_n_params(const fl_model *m);

#ifdef __cplusplus
}
#endif
#endif /* FL_MODEL_H */
