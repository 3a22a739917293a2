/*
 * gguf_kquant.h — dequantizers for ggml's super-block kinds: the K-quants
 * (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K: blocks of 256 elements with 16 or 8
 * sub-block scales) and the non-linear 4-bit kinds IQ4_NL (block 32) and
 * IQ4_XS (block 256).
 *
 * Each function decodes `n` consecutive elements (a whole number of blocks)
 * from possibly unaligned bytes into f32. The arithmetic follows ggml's
 * reference (ggml-quants.c dequantize_row_*) and gguf-py's quants.py
 * operation for operation in f32 — sub-block scale = d * sc first, then
 * scale * q - min — so the results are bit-identical to both.
 */
#ifndef FL_GGUF_KQUANT_H
#define FL_GGUF_KQUANT_H

#include <stddef.h>
#include <stdint.h>

#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FL_QK_K 256 /* elements per K-quant super-block */

/* Elements and bytes per block of a K-quant / IQ4 dtype; false for others. */
int fl_kquant_block(fl_dtype dt, int64_t *elems, size_t *bytes);

/* Decodes n elements (n % block elements == 0) of dtype dt into out. */
void fl_kquant_row_f32(fl_dtype dt, const uint8_t *src, int64_t n, float *out);

/* Q4_K / Q5_K sub-block j (0..7) scale and min codes from the 12 packed
 * bytes (6 bits each). Exposed so Q4_K can be repacked into W4 exactly. */
void fl_kquant_scale_min_k4(const uint8_t *scales12, int j, uint8_t *sc, uint8_t *m);

#ifdef __cplusplus
}
#endif
#endif /* FL_GGUF_KQUANT_H */
