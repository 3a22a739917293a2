/*
 * awq_calib.h — the math of activation-aware weight quantization (AWQ,
 * Lin et al. 2023) as AutoAWQ implements it, on f32 host arrays:
 * asymmetric 4-bit group quantization, the per-input-channel scale search
 * and the clipping search. `flotilla quantize` (cmd_quantize.c) drives it
 * layer by layer; nothing here knows about models or files.
 *
 * Layouts: activations x [n, in] row-major (one token a row); weights
 * w [out, in] (nn.Linear); groups are runs of `group` inputs of a row.
 * The functions run their loops on the host thread pool (kernels/pool.h);
 * its errors are theirs.
 *
 * The searches take this rank's tokens x [n, in] and a share (sh) saying
 * which calibration blocks they are (quantize_share.h; NULL: one rank, one
 * block of n tokens) and are collective over its communicator: every sum
 * over tokens is a sum of per-block partials in block order, so any number
 * of ranks finds the same scales and clips, bit for bit.
 */
#ifndef FL_AWQ_CALIB_H
#define FL_AWQ_CALIB_H

#include <stdint.h>

#include "core/status.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "launcher/quantize_share.h"

/* y[n, out] = x[n, in] @ w[out, in]^T (+ bias[out] when not NULL). */
fl_status fl_awq_matmul(const float *x, int64_t n, const float *w, int64_t out, int64_t in, const float *bias,
                        float *y);

/* fl_awq_matmul block by block (n_blk blocks of blk_len tokens, back to
 * back in x and y): a token's result never depends on which tokens share
 * its call, so a block gives the same bits on whichever rank runs it.
 * be NULL: on the host in f32 (fl_awq_matmul); else on that backend: the
 * weight uploaded once (CUDA holds it in bf16), each block one matmul of
 * its tokens, so a block's bits still do not depend on the rank; on CUDA
 * inputs, weights and outputs are bf16 and the sums f32 (AutoAWQ too
 * searches in half precision on the GPU). */
fl_status fl_awq_matmul_blocks(fl_backend *be, const float *x, const int *blk_len, int n_blk, const float *w,
                               int64_t out, int64_t in, const float *bias, float *y);

/* AutoAWQ's zero-point quantization of one group of values, 4 bits:
 * scale = max(max - min, 1e-5) / 15, zero = clamp(-round(min / scale), 0, 15),
 * q = clamp(round(v / scale) + zero, 0, 15), value (q - zero) * scale.
 * The scale is first rounded to scale_dt (F16 or BF16: the dtype a
 * checkpoint stores it in, so codes and the stored scale agree; F32: kept
 * as computed, as the searches use it). codes may be NULL; v is replaced by
 * the dequantized values when deq is set. */
void fl_awq_quant_group(float *v, int n, fl_dtype scale_dt, int deq, uint8_t *codes, float *scale,
                        uint8_t *zero);

/* Fake-quantizes w [rows, cols] in place, group by group (the search's Q). */
fl_status fl_awq_fake_quant(float *w, int64_t rows, int64_t cols, int group);

/* One linear of a group that shares its input (q|k|v, gate|up, o, down). */
typedef struct fl_awq_linear {
    const float *w;   /* [out, in] */
    int64_t out;
} fl_awq_linear;

/* What a scale search found. */
typedef struct fl_awq_search {
    float alpha;      /* the chosen exponent */
    double err;       /* output MSE with the chosen scales */
    double err_plain; /* output MSE at alpha 0 (s = 1: plain group quantization) */
} fl_awq_search;

/* The AWQ scale search for linears sharing input x [n, in]: for alpha =
 * k / n_grid, k = 0 .. n_grid - 1, s = mean_t |x[t, c]|^alpha (clamped to
 * >= 1e-4, then divided by sqrt(max s * min s)); the loss is the mean
 * squared difference between x @ w^T and (x / s) @ Q(w * s)^T over all the
 * linears' outputs. Writes the best s into scales[in] (all ones when alpha
 * 0 wins). The caller folds 1/s into the op before and s into the weights.
 * The matmuls run on be (fl_awq_matmul_blocks). */
fl_status fl_awq_search_scale(fl_backend *be, const float *x, int64_t n, const fl_qshare *sh, int64_t in,
                              const fl_awq_linear *lins, int n_lins, int group, int n_grid, float *scales,
                              fl_awq_search *res);

/* AutoAWQ's clipping search for one linear w [out, in] with input x [n, in]
 * (already divided by the chosen scales; at most max_tokens evenly spaced
 * tokens are used): per (row, group), max |w| is shrunk by k / n_grid for
 * k = 0 .. n_grid * max_shrink - 1 and the shrink giving the lowest mean
 * squared group output error after quantization is kept; w is clamped to
 * +-that value in place. The tokens are picked over all ranks' blocks and
 * gathered to every rank (at most 2 * max_tokens rows), which then searches
 * its share of the rows; the clipped rows are gathered to rank 0 (another
 * rank's w has only its own rows clipped). */
fl_status fl_awq_search_clip(const float *x, int64_t n, const fl_qshare *sh, int64_t in, float *w, int64_t out,
                             int group, int n_grid, float max_shrink, int64_t max_tokens);

/* Quantizes w [out, in] (out % 8 == 0, in % group == 0) with
 * fl_awq_quant_group (f16 scales) and packs it as AutoAWQ's GEMM layout:
 *   qweight int32 [in, out/8]: nibble k of word (i, j) holds the code of
 *     output 8j + {0, 2, 4, 6, 1, 3, 5, 7}[k] at input i;
 *   qzeros  int32 [in/group, out/8]: the zero points, packed the same way;
 *   scales  f16   [in/group, out].
 * value = (q - zero) * scale. */
fl_status fl_awq_pack_gemm(const float *w, int64_t out, int64_t in, int group, uint32_t *qweight, uint32_t *qzeros,
                           uint16_t *scales);

/* The same quantization packed as compressed-tensors' "pack-quantized"
 * (pack_to_int32 of llm-compressor's W4A16 asymmetric group scheme), with
 * the scales rounded to round_dt (F16 or BF16) and stored as scale_dt (F32,
 * F16 or BF16, able to hold round_dt's values):
 *   packed int32 [out, in/8]: nibble k of word (o, j) holds the code of
 *     input 8j + k of output o, lowest nibble first;
 *   zeros  int32 [ceil(out/8), in/group]: nibble k of word (j, g) holds the
 *     zero point of output 8j + k in group g (packed along the outputs);
 *   scales scale_dt [out, in/group].
 * Codes and zero points are stored as unsigned nibbles: the package's
 * signed values q - 8 and zero - 8 plus its offset 8, so value =
 * (q - zero) * scale as above. Any out (a last partial word is padded with
 * zeros). */
fl_status fl_awq_pack_ct(const float *w, int64_t out, int64_t in, int group, fl_dtype round_dt, fl_dtype scale_dt,
                         uint32_t *packed, uint32_t *zeros, void *scales);

#endif /* FL_AWQ_CALIB_H */
