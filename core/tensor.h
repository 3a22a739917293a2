/*
 * tensor.h — dtypes and the weight tensor descriptor shared by loaders,
 * the model builder and every backend.
 *
 * Shapes are row-major like PyTorch: shape[0] is the outermost dimension.
 * A linear layer's weight is [out, in] (nn.Linear convention) whatever the
 * file format stored; loaders reorder dims (GGUF lists them innermost-first).
 *
 * The internal 4-bit kind FL_DTYPE_W4 stores, for a weight [rows, cols]:
 *   codes  uint8  [rows, cols/2]   two 4-bit codes per byte, element 2j in the
 *                                  low nibble, 2j+1 in the high nibble;
 *   scales float  [rows, cols/group]
 *   bias   float  [rows, cols/group]
 *   value(r, c) = code(r, c) * scales[r, c/group] + bias[r, c/group]
 * This covers AWQ ((q - z) * s: bias = -z*s), GGUF Q4_0 (bias = -8*d),
 * Q4_1 (bias = m) and round-to-nearest min/max quantization. Backends may
 * repack it into their own layout at upload time.
 *
 * An FP8 linear (FL_DTYPE_F8_E4M3 with scales set, --quantize fp8) stores:
 *   codes  uint8  [rows, cols]     float8_e4m3fn
 *   scales float  [rows]           value(r, c) = e4m3(code(r, c)) * scales[r]
 * and its matmul quantizes each token's activations to e4m3 too
 * (kernels/backend.h, "FP8 linears").
 */
#ifndef FL_TENSOR_H
#define FL_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fl_dtype {
    FL_DTYPE_F32 = 0,
    FL_DTYPE_F16,
    FL_DTYPE_BF16,
    FL_DTYPE_W4,   /* internal 4-bit, see above */
    /* file-only kinds: loaders convert them before the model sees them */
    FL_DTYPE_I32,
    FL_DTYPE_Q8_0, /* GGUF: blocks of 32: f16 d, int8 q[32] */
    FL_DTYPE_Q4_0, /* GGUF: blocks of 32: f16 d, uint8 qs[16] */
    FL_DTYPE_Q4_1, /* GGUF: blocks of 32: f16 d, f16 m, uint8 qs[16] */
    /* GGUF super-block kinds, layouts in gguf_kquant.h */
    FL_DTYPE_Q2_K,
    FL_DTYPE_Q3_K,
    FL_DTYPE_Q4_K,
    FL_DTYPE_Q5_K,
    FL_DTYPE_Q6_K,
    FL_DTYPE_Q8_K,
    FL_DTYPE_IQ4_NL,
    FL_DTYPE_IQ4_XS,
    FL_DTYPE_I64,  /* file-only: metadata tensors (compressed-tensors' weight_shape) */
    FL_DTYPE_F8_E4M3, /* float8_e4m3fn (sign, 4 exponent bits bias 7, 3 mantissa bits; no
                         infinities, 0x7f / 0xff are NaN), one byte: file codes, or with scales
                         an FP8 linear (above) */
    FL_DTYPE_COUNT
} fl_dtype;

const char *fl_dtype_name(fl_dtype dt);

/* Bytes of `n` consecutive elements of a row of dtype dt (n must be a whole
 * number of blocks for block kinds). For FL_DTYPE_W4 this counts codes only. */
size_t fl_dtype_row_bytes(fl_dtype dt, int64_t n);

#define FL_MAX_DIMS 4

/* A weight tensor in host memory. `data` may point into an mmap'd file
 * (owned == 0) or into a malloc'd buffer (owned == 1, freed by
 * fl_tensor_free). For W4 (and an FP8 linear's scales), `scales` and
 * `bias` are malloc'd when owned. */
typedef struct fl_tensor {
    fl_dtype dtype;
    int ndim;
    int64_t shape[FL_MAX_DIMS];
    void *data;
    float *scales;   /* W4: [rows, cols/group]; an FP8 linear: [rows] */
    float *bias;     /* W4 only: [rows, cols/group] */
    int group;       /* W4 only: 32, 64 or 128 */
    int owned;
} fl_tensor;

int64_t fl_tensor_numel(const fl_tensor *t);
/* Releases owned buffers and zeroes the descriptor. NULL is a no-op. */
void fl_tensor_free(fl_tensor *t);

/* Scalar conversions (round-to-nearest-even for the narrowing ones). */
float fl_bf16_to_f32(uint16_t h);
uint16_t fl_f32_to_bf16(float f);
float fl_f16_to_f32(uint16_t h);
uint16_t fl_f32_to_f16(float f);
/* float8_e4m3fn, exact: subnormals m * 2^-9, normals (8 + m) * 2^(e - 10),
 * 0x7f / 0xff (the only NaN codes; the format has no infinities) -> NaN. */
float fl_f8e4m3_to_f32(uint8_t b);
/* f32 -> float8_e4m3fn, ties to even, saturating to +-448 (as CUDA's
 * __NV_SATFINITE conversion); NaN -> 0x7f with the sign. */
uint8_t fl_f32_to_f8e4m3(float f);

/* Dequantizes row r of a 2-D tensor of any dtype into out[cols] (f32).
 * Used by the CPU backend and by tests; not a hot path on GPUs. */
void fl_tensor_row_f32(const fl_tensor *t, int64_t r, float *out);

#ifdef __cplusplus
}
#endif
#endif /* FL_TENSOR_H */
