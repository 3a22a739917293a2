/*
 * quant.h — conversions into flotilla's internal 4-bit kind FL_DTYPE_W4
 * (layout in tensor.h): AutoAWQ GEMM, compressed-tensors and GPTQ
 * repacking (GPTQ act-order to F32), round-to-nearest (RTN) quantization
 * of float weights, and GGUF Q4_0 / Q4_1 / Q4_K repacking; and FP8
 * (float8_e4m3fn with scales) to F32, which no kernel reads as stored.
 *
 * All functions fill a fresh owned tensor (release with fl_tensor_free)
 * and leave it zeroed on failure. `name` is used in error messages only.
 */
#ifndef FL_QUANT_H
#define FL_QUANT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Allocates an owned W4 tensor [rows, cols] with zeroed codes/scales/bias.
 * cols must be a multiple of group (and even). */
fl_status fl_quant_w4_alloc(int64_t rows, int64_t cols, int group, fl_tensor *w4);

/* AutoAWQ GEMM -> W4 for a linear [out, in] with group size `group`:
 *   qweight int32 [in, out/8], qzeros int32 [in/group, out/8],
 *   scales  [in/group, out] of dtype scales_dt (F16 as AutoAWQ writes; BF16
 *   and F32 accepted).
 * Nibble k (bits 4k..4k+3) of a packed int32 holds output column
 * 8*j + FL_AWQ_ORDER[k] (AutoAWQ's pack order), so column c sits in nibble
 * FL_AWQ_REVERSE_ORDER[c % 8]. value = (q - z) * s becomes
 * code = q, scale = s, bias = -z * s. Pointers may be unaligned. */
extern const int FL_AWQ_ORDER[8];         /* {0, 2, 4, 6, 1, 3, 5, 7} */
extern const int FL_AWQ_REVERSE_ORDER[8]; /* {0, 4, 1, 5, 2, 6, 3, 7} */
fl_status fl_quant_awq_to_w4(const char *name, const void *qweight, const void *qzeros, const void *scales,
                             fl_dtype scales_dt, int64_t out, int64_t in, int group, fl_tensor *w4);

/* compressed-tensors "pack-quantized" int4 -> W4 for a linear [out, in]
 * with group size `group` (in for the channel strategy):
 *   packed [out, in/8] int32: element c of a row in word c/8, nibble c%8
 *     (bits 4(c%8)..), stored as q + 8 for the signed code q in [-8, 7];
 *   scales [out, in/group] of dtype scales_dt (BF16, F16 or F32);
 *   zeros  NULL (symmetric: zero point 0) or [ceil(out/8), in/group] int32,
 *     packed the same way along the output dim (row o in word row o/8).
 * value = (q - zp) * s = (stored - stored_zp) * s becomes code = stored,
 * scale = s, bias = -stored_zp * s (-8 s when symmetric): exact in f32. */
fl_status fl_quant_ct_pack_to_w4(const char *name, const void *packed, const void *zeros, const void *scales,
                                 fl_dtype scales_dt, int64_t out, int64_t in, int group, fl_tensor *w4);

/* One GPTQ linear [out, in] as stored (AutoGPTQ / GPTQModel, 4-bit, int32
 * words; pointers may be unaligned):
 *   qweight I32 [in/8, out]: input row i of column o in word (i/8, o),
 *     nibble i%8 (bits 4(i%8)..);
 *   qzeros  I32 [n_groups, out/8]: zero point of (group g, column o) in
 *     word (g, o/8), nibble o%8; with zeros_minus_one (checkpoint format
 *     "gptq") the writer subtracted 0x11111111 from each whole word, so
 *     0x11111111 is added back before the nibbles are read (a per-nibble +1
 *     would be wrong wherever the subtraction borrowed);
 *   scales  [n_groups, out] of scales_dt (F16 as written; BF16, F32 read);
 *   g_idx   I32 [in]: the group of each input row (NULL: i / group).
 * value[o][i] = (q - z) * s of group g_idx[i], exact in f32. */
typedef struct fl_quant_gptq {
    const void *qweight, *qzeros, *scales, *g_idx;
    fl_dtype scales_dt;
    int64_t out, in, n_groups;
    int group;                 /* in for one group per output channel */
    bool zeros_minus_one;
} fl_quant_gptq;

/* True when g_idx (I32 [in], may be unaligned; NULL counts as trivial) is
 * i / group for every i: groups are runs of `group` consecutive inputs. */
bool fl_quant_gptq_g_idx_trivial(const void *g_idx, int64_t in, int group);

/* GPTQ with a trivial g_idx -> W4 with the same group: code = q, scale = s,
 * bias = -z * s; the qweight word's bytes already are W4's. Needs in and out
 * multiples of 8 and in a multiple of the group. */
fl_status fl_quant_gptq_to_w4(const char *name, const fl_quant_gptq *src, fl_tensor *w4);

/* Any GPTQ linear (act-order included) -> an owned F32 [out, in] tensor
 * holding (q - z) * s exactly. g_idx entries outside [0, n_groups) are
 * FL_ERR_FORMAT. */
fl_status fl_quant_gptq_to_f32(const char *name, const fl_quant_gptq *src, fl_tensor *f32);

/* One float8_e4m3fn linear [out, in] as stored (pointers may be unaligned):
 *   weight [out, in] bytes, row-major;
 *   scales [ceil(out / block_rows), ceil(in / block_cols)] of scales_dt
 *     (F32, BF16 or F16): weight (r, c) is scaled by entry
 *     (r / block_rows, c / block_cols). Per tensor: block = [out, in];
 *     per channel: block = [1, in]; the last tiles of a block grid may be
 *     partial. */
typedef struct fl_quant_fp8 {
    const void *weight, *scales;
    fl_dtype scales_dt;
    int64_t out, in;
    int64_t block_rows, block_cols;
} fl_quant_fp8;

/* Rows [row_lo, row_lo + n_rows) and columns [col_lo, col_lo + n_cols) of
 * an FP8 linear -> an owned F32 [n_rows, n_cols] tensor holding
 * e4m3(code) * scale, rounded once to f32 (as torch's f32 product). Only
 * the block's weight bytes and the scales over it are read; *bytes_read
 * (may be NULL) gets their count. A NaN code (0x7f, 0xff) or a scale that
 * is not finite is FL_ERR_FORMAT naming the tensor and the element. */
fl_status fl_quant_fp8_to_f32(const char *name, const fl_quant_fp8 *src, int64_t row_lo, int64_t n_rows,
                              int64_t col_lo, int64_t n_cols, fl_tensor *f32, size_t *bytes_read);

/* Round-to-nearest asymmetric quantization of a 2-D float tensor (F32, F16,
 * BF16) to W4 with the given group: per row and group, scale =
 * (max - min) / 15, code = clamp(round((x - min) / scale), 0, 15),
 * bias = min (a constant group gets scale 0 and is exact). */
fl_status fl_quant_rtn_to_w4(const char *name, const fl_tensor *src, int group, fl_tensor *w4);

/* A 2-D float tensor (F32, F16, BF16, Q8_0) to an FP8 linear (core/tensor.h):
 * per row, scale = max(absmax / 448, FLT_MIN) (an all-zero row: 1), code =
 * e4m3(x / scale) rounded to nearest even. absmax: each row's largest
 * magnitude when src is a column block of a wider weight (the whole row's,
 * so a block gets the codes of the whole), or NULL: the row's own. A weight
 * that is not finite is FL_ERR_FORMAT naming the tensor, row and column. */
fl_status fl_quant_to_fp8(const char *name, const fl_tensor *src, const float *absmax, fl_tensor *fp8);
/* Whether fl_quant_to_fp8 takes weights of this dtype (F32, F16, BF16, Q8_0). */
bool fl_quant_fp8_source(fl_dtype dt);
/* Each row's largest magnitude of a 2-D float tensor (as fl_quant_to_fp8
 * reads it), into absmax[rows]; not-finite values as there. */
fl_status fl_quant_row_absmax(const char *name, const fl_tensor *src, float *absmax);

/* GGUF Q4_0 (value = d * (q - 8)) or Q4_1 (value = d * q + m) -> W4 with
 * group 32: scale = d, bias = -8d resp. m; nibbles are reordered from
 * ggml's (j, j + 16) pairing to W4's (2j, 2j + 1). Exact. */
fl_status fl_quant_gguf_q4_to_w4(const char *name, const fl_tensor *src, fl_tensor *w4);

/* GGUF Q4_K (super-blocks of 256 = 8 sub-blocks of 32; value =
 * (d * sc) * q - (dmin * m) with 6-bit sc, m per sub-block) -> W4 with
 * group 32: scale = d * sc, bias = -(dmin * m), both computed in f32 as
 * ggml does, so code * scale + bias is bit-identical to ggml's decode. */
fl_status fl_quant_gguf_q4k_to_w4(const char *name, const fl_tensor *src, fl_tensor *w4);

#ifdef __cplusplus
}
#endif
#endif /* FL_QUANT_H */
