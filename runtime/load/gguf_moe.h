/*
 * gguf_moe.h — llama.cpp's Mixture-of-Experts tensors as the model builder
 * wants them (internal to the GGUF reader).
 *
 * llama.cpp stores all experts of a projection as one 3-D tensor
 * (blk.N.ffn_gate_exps.weight, ne = [in, out, n_expert]); the model builder
 * asks for Hugging Face per-expert 2-D weights. Each expert's slab is
 * contiguous, so it becomes a view (no copy) named
 * model.layers.N.mlp.experts.E.gate_proj.weight. The shared expert's
 * sigmoid gate (ffn_gate_inp_shexp, 1-D [hidden]) becomes the [1, hidden]
 * linear HF stores.
 */
#ifndef FL_GGUF_MOE_H
#define FL_GGUF_MOE_H

#include <stddef.h>

#include "runtime/load/checkpoint.h"

/* *tensors (HF names, as map_tensor_name left them: stacked experts named
 * "...mlp.experts.<proj>.weight") and the parallel *gguf_names are replaced
 * by arrays with every stacked expert tensor expanded; *n is updated. On
 * failure the arrays are left valid (possibly unchanged) for the caller to
 * free. */
fl_status fl_gguf_split_experts(const char *path, fl_ckpt_tensor **tensors, char ***gguf_names, size_t *n);

/* Renames the (split) MoE tensors of a llama-architecture file to Mixtral's
 * HF names: mlp.gate -> block_sparse_moe.gate, mlp.experts.E.gate_proj /
 * up_proj / down_proj -> block_sparse_moe.experts.E.w1 / w3 / w2. */
fl_status fl_gguf_mixtral_names(const char *path, fl_ckpt_tensor *tensors, size_t n);

#endif /* FL_GGUF_MOE_H */
