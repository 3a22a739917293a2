/*
 * checkpoint.h — a read-only directory of named tensors backed by mmap'd
 * files: a Hugging Face folder (model.safetensors, or shards listed in
 * model.safetensors.index.json) or one GGUF file.
 *
 * Tensor names are always Hugging Face names ("model.layers.0.self_attn.q_proj.weight");
 * the GGUF reader maps llama.cpp names ("blk.0.attn_q.weight") onto them and
 * reverses GGUF's innermost-first dim order, so the model builder sees one
 * naming and one shape convention.
 *
 * Ownership: the fl_ckpt owns the mappings; tensor data pointers stay valid
 * until fl_ckpt_free. Not thread-safe for concurrent open/free; lookups are
 * read-only and may run concurrently.
 */
#ifndef FL_CHECKPOINT_H
#define FL_CHECKPOINT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "runtime/load/model_config.h"
#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_ckpt fl_ckpt;

typedef struct fl_ckpt_tensor {
    const char *name;      /* HF name */
    fl_dtype dtype;        /* file dtype: F32/F16/BF16/I32, GGUF Q8_0/Q4_0/Q4_1, K-quants, IQ4 */
    int ndim;
    int64_t shape[FL_MAX_DIMS]; /* row-major, outermost first */
    const void *data;      /* points into the mapping */
    size_t nbytes;
    const char *file;      /* path of the file holding it (for messages) */
} fl_ckpt_tensor;

/* Opens `path`: a folder with config.json + safetensors, or a .gguf file.
 * Validates every header (offsets in range, sizes consistent with dtype and
 * shape) up front, so later lookups cannot read out of bounds. */
fl_status fl_ckpt_open(const char *path, fl_ckpt **out);
void fl_ckpt_free(fl_ckpt *ck);

/* "safetensors" or "gguf". */
const char *fl_ckpt_format(const fl_ckpt *ck);
/* The folder (HF) or the file (GGUF) that was opened. */
const char *fl_ckpt_path(const fl_ckpt *ck);

/* Looks up a tensor. Missing: FL_ERR_NOT_FOUND naming the tensor and the
 * checkpoint path. */
fl_status fl_ckpt_get(const fl_ckpt *ck, const char *name, const fl_ckpt_tensor **out);
bool fl_ckpt_has(const fl_ckpt *ck, const char *name);
size_t fl_ckpt_count(const fl_ckpt *ck);
const fl_ckpt_tensor *fl_ckpt_at(const fl_ckpt *ck, size_t i);

/* The model description: config.json for HF folders (through
 * fl_model_config_from_json), GGUF metadata for GGUF files. */
fl_status fl_ckpt_model_config(const fl_ckpt *ck, fl_model_config *cfg);

/* How a linear weight is to be held in memory. */
typedef enum fl_load_quant {
    FL_LOAD_AS_STORED = 0, /* f32/f16/bf16/Q8_0 as stored; GGUF Q4_0/Q4_1/Q4_K -> W4 (group 32);
                              GGUF Q2_K/Q3_K/Q5_K/Q6_K/Q8_K/IQ4_NL/IQ4_XS -> f32 (exact);
                              AWQ, compressed-tensors, GPTQ -> W4 (GPTQ act-order -> f32,
                              exact, under either value); FP8 -> f32 (e4m3 * scale) */
    FL_LOAD_W4,            /* additionally quantize float weights to W4 (RTN, group 128
                              when cols % 128 == 0, else the largest of 64/32 dividing) */
    FL_LOAD_FP8,           /* float linears to FP8 (core/tensor.h), by the model loader
                              (runtime/model/model.c); to the checkpoint loader, AS_STORED */
} fl_load_quant;

/* Loads the linear weight `prefix` (e.g. "model.layers.0.mlp.down_proj") as
 * a [out, in] fl_tensor: reads prefix.weight, or for AWQ checkpoints
 * prefix.qweight / prefix.qzeros / prefix.scales, for compressed-tensors
 * pack-quantized ones prefix.weight_packed / .weight_scale
 * [/ .weight_zero_point], for GPTQ ones prefix.qweight / .qzeros / .scales
 * / .g_idx, and repacks them into W4 (GPTQ act-order linears, whose groups
 * are not runs of inputs, into F32, exactly). An F8_E4M3 prefix.weight is
 * scaled by prefix.weight_scale (compressed-tensors) or .weight_scale_inv
 * (quant_method "fp8") into F32.
 * Checks the shape against expect_out x expect_in (names the tensor and both
 * shapes on mismatch). The result may alias the mapping (owned == 0). */
fl_status fl_ckpt_load_linear(const fl_ckpt *ck, const char *prefix, int64_t expect_out,
                              int64_t expect_in, fl_load_quant q, fl_tensor *out);

/* A block of a linear weight [out, in]: rows [row_lo, row_lo + n_rows) and
 * columns [col_lo, col_lo + n_cols). Tensor parallelism loads the row block
 * of column-parallel layers (q/k/v, gate/up, lm_head) and the column block of
 * row-parallel ones (o_proj, down). */
typedef struct fl_ckpt_slice {
    int64_t row_lo, n_rows, col_lo, n_cols;
} fl_ckpt_slice;

/* fl_ckpt_load_linear for one block (slice NULL = the whole weight). Only the
 * block's bytes are read: row blocks are aliased in place, column blocks
 * copied row by row; AWQ, compressed-tensors and GPTQ blocks copy the int32
 * words (and scales, zero points) of their rows and groups and repack those,
 * unless the block's edges are not whole words of 8 or whole groups (then
 * the whole tensor is repacked and cut); FP8 blocks dequantize their own
 * codes with the scales over them. Column bounds must be whole blocks of the
 * stored kind (32 for Q8_0/Q4_0/Q4_1/IQ4_NL, 256 for the K-quants and
 * IQ4_XS, the W4 group). Bytes read are added to fl_ckpt_bytes_read. */
fl_status fl_ckpt_load_linear_part(const fl_ckpt *ck, const char *prefix, int64_t expect_out,
                                   int64_t expect_in, const fl_ckpt_slice *slice, fl_load_quant q,
                                   fl_tensor *out);

/* Bytes of tensor data the loaders have read from this checkpoint so far. */
size_t fl_ckpt_bytes_read(const fl_ckpt *ck);

/* Loads a non-linear tensor (embeddings, norms, biases, router gates) with
 * the expected shape (ndim entries of `expect`; -1 = any). F32/F16/BF16/I32
 * are returned as stored; every GGUF block kind is dequantized to F32. */
fl_status fl_ckpt_load_tensor(const fl_ckpt *ck, const char *name, int ndim,
                              const int64_t *expect, fl_tensor *out);

/* The chat template (Jinja source) found beside the weights
 * (tokenizer_config.json for HF folders, tokenizer.chat_template in GGUF),
 * or NULL. */
const char *fl_ckpt_chat_template(const fl_ckpt *ck);

struct fl_tokenizer;

/* What was loaded, checked against itself before anything runs (the one
 * check `inspect`, `logits` and `generate` share, through
 * fl_cli_bundle_open): every special-token id of the metadata (GGUF
 * tokenizer.ggml.*_token_id, config.json bos/eos) and, with tok, every
 * tokenizer id inside the model's vocabulary; the config against the tensors
 * (layers present, embedding and lm_head shape, q/k/v rows per head). A
 * contradiction is FL_ERR_FORMAT naming the key or tensor and both numbers.
 * tok may be NULL. */
fl_status fl_ckpt_validate(const fl_ckpt *ck, const fl_model_config *cfg,
                           const struct fl_tokenizer *tok);

/* The tokenizer that belongs to the checkpoint: tokenizer.json in the HF
 * folder, or the vocabulary stored in the GGUF file. */
fl_status fl_ckpt_tokenizer(const fl_ckpt *ck, struct fl_tokenizer **out);

#ifdef __cplusplus
}
#endif
#endif /* FL_CHECKPOINT_H */
