/*
 * rope.h — rotary position embedding tables for every RoPE variant
 * (default, linear, dynamic NTK, YaRN, llama3), computed on the host as
 * Hugging Face transformers computes them (modeling_rope_utils.py).
 */
#ifndef FL_ROPE_H
#define FL_ROPE_H

#include <stdint.h>

#include "runtime/load/model_config.h"

/* Rotated dims per head: head_dim * partial_rotary_factor (even). */
int fl_rope_dim(const fl_model_config *cfg);

/* Inverse frequencies [rot_dim/2] and the cos/sin multiplier for a
 * sequence whose current length is seq_len (only dynamic NTK depends on it). */
void fl_rope_inv_freq(const fl_model_config *cfg, int seq_len, double *inv_freq, double *mscale);

/* cos/sin [n, rot_dim/2] for positions pos[n] of one sequence of length
 * seq_len. freq_factors [rot_dim/2] (or NULL) divide the frequencies
 * (llama.cpp's rope_freqs tensor). */
void fl_rope_fill(const fl_model_config *cfg, const float *freq_factors, int seq_len,
                  const int32_t *pos, int n, float *cos, float *sin);

#endif /* FL_ROPE_H */
