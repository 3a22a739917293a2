/*
 * synth.h — synthetic models of real shapes with random weights, for
 * benchmarks (flotilla bench): no download, any quantization. Presets
 * carry the published configs of the models they are named after.
 */
#ifndef FL_SYNTH_H
#define FL_SYNTH_H

#include "runtime/model/model.h"

/* Fills cfg with a preset (the table in synth.c: fl_synth_preset_name(i)
 * for i < fl_synth_preset_count(), e.g. "llama-3-8b", "mixtral-8x7b",
 * "deepseek-v2-lite", and "tiny" / "tiny-moe" / "tiny-mla" of test sizes).
 * Unknown names: FL_ERR_INVALID_ARG listing the known ones. */
fl_status fl_synth_preset(const char *name, fl_model_config *cfg);
int fl_synth_preset_count(void);
/* The i-th preset's name and a one-line description; NULL out of range. */
const char *fl_synth_preset_name(int i);
const char *fl_synth_preset_about(int i);

/* Builds a model of cfg's shapes with random weights: linears uniform in
 * +-1/sqrt(in) (bf16, or W4 with group 128 codes, scales and biases chosen
 * to give the same range), norms near 1. shard (NULL: the whole model on one
 * rank) gives this rank's part, with the local shapes a checkpoint load
 * would give (fl_model_dims). Deterministic for a seed; replicated tensors
 * (norms, router, embedding) are the same on every rank, so every rank
 * routes tokens alike. */
fl_status fl_synth_model(const fl_model_config *cfg, const fl_shard *shard, fl_backend *be,
                         fl_load_quant quant, uint64_t seed, fl_model **out);

/* Weight bytes one decode step must read on the rank of `shard` (NULL: one
 * rank) of a model fl_synth_model builds from cfg with quantization q, for
 * a batch whose tokens activate `active_experts` of this rank's experts per
 * MoE layer (an average over layers and steps): attention, router, active
 * routed experts, shared experts, lm_head and the final norm. W4 counts a
 * bf16 scale and bias per group of 128 (the GPU's layout). A pure function
 * of the shapes: no model is built. FL_ERR_INVALID_ARG where the shard does
 * not divide the model (fl_model_dims_init's message). */
fl_status fl_synth_step_weight_bytes(const fl_model_config *cfg, const fl_shard *shard, fl_load_quant q,
                                     double active_experts, double *bytes);

#endif /* FL_SYNTH_H */
