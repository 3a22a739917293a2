/*
 * synth.h — synthetic models of real shapes with random weights, for
 * benchmarks (flotilla bench): no download, any quantization. Presets
 * carry the published configs of the models they are named after.
 */
#ifndef FL_SYNTH_H
#define FL_SYNTH_H

#include "runtime/model.h"

/* Fills cfg with a preset: "llama-3-8b", "qwen2-7b", "mixtral-8x7b",
 * "qwen3-30b-a3b". Unknown names: FL_ERR_INVALID_ARG listing the known
 * ones; "deepseek-v2-lite" is FL_ERR_UNSUPPORTED until MLA exists. */
fl_status fl_synth_preset(const char *name, fl_model_config *cfg);

/* Builds a whole model (one rank) of cfg's shapes with random weights:
 * linears uniform in +-1/sqrt(in) (bf16, or W4 with group 128 codes, scales
 * and biases chosen to give the same range), norms near 1. Deterministic
 * for a seed. */
fl_status fl_synth_model(const fl_model_config *cfg, fl_backend *be, fl_load_quant quant,
                         uint64_t seed, fl_model **out);

/* Weight bytes one decode step must read for a batch whose tokens activate
 * `active_experts` distinct experts per MoE layer (all of them for large
 * batches): attention, router, active experts, shared experts, lm_head. */
double fl_synth_step_weight_bytes(const fl_model *m, int active_experts);

#endif /* FL_SYNTH_H */
