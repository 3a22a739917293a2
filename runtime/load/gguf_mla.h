/*
 * gguf_mla.h — llama.cpp's DeepSeek-V2 ("deepseek2") tensors as the model
 * builder wants them (internal to the GGUF reader).
 *
 * For the MLA absorption trick, convert_hf_to_gguf.py splits HF's kv_b_proj
 * ([n_head * (nope + v), kv_lora]) per head into
 *   blk.N.attn_k_b.weight  ne = [nope, kv_lora, n_head]  (the k rows, transposed)
 *   blk.N.attn_v_b.weight  ne = [kv_lora, v, n_head]     (the v rows as stored)
 * The model builder's MLA attention reads the joined kv_b_proj, so the two
 * are stitched back into one owned [n_head * (nope + v), kv_lora] tensor:
 * in their own dtype when both share a float one (an exact copy), else in
 * F32 (every value of a GGUF block kind is exact in f32). Older converters
 * write attn_kv_b directly, which needs nothing here.
 */
#ifndef FL_GGUF_MLA_H
#define FL_GGUF_MLA_H

#include <stddef.h>

#include "runtime/load/checkpoint.h"

/* For every layer of cfg (arch FL_ARCH_DEEPSEEK_V2): renames the shared
 * expert tensors to DeepSeek's HF names (mlp.shared_expert.* ->
 * mlp.shared_experts.*) and, where a layer has k_b_proj / v_b_proj instead
 * of kv_b_proj, replaces the pair by the joined kv_b_proj. *tensors,
 * *gguf_names and *n are replaced as by fl_gguf_split_experts; the joined
 * weights live in *owned, *owned_size bytes (one malloc'd block for the
 * caller to free with the checkpoint; NULL and 0 when nothing was joined).
 * Errors name the file and the GGUF tensor. */
fl_status fl_gguf_deepseek_tensors(const char *path, const fl_model_config *cfg, fl_ckpt_tensor **tensors,
                                   char ***gguf_names, size_t *n, void **owned, size_t *owned_size);

#endif /* FL_GGUF_MLA_H */
