/*
 * tensor.c — dtype names and sizes, scalar float conversions, and the
 * reference row dequantizer for every dtype flotilla can hold or read.
 *
 * fl_tensor_row_f32 is the single definition of what the bits of each
 * dtype mean (W4, GGUF blocks, half floats); the CPU backend and the tests
 * use it, and the GPU kernels are tested against it. It is written for
 * clarity, not speed. All loads go through memcpy because tensor data may
 * point into an mmap'd file at an offset that is not aligned to the element
 * size (safetensors headers have arbitrary length).
 */
#include "core/tensor.h"

#include "core/gguf_kquant.h"
#include "core/status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define QK 32 /* elements per GGUF block */

const char *fl_dtype_name(fl_dtype dt) {
    static const char *const names[FL_DTYPE_COUNT] = {
        [FL_DTYPE_F32] = "F32",   [FL_DTYPE_F16] = "F16",   [FL_DTYPE_BF16] = "BF16",
        [FL_DTYPE_W4] = "W4",     [FL_DTYPE_I32] = "I32",   [FL_DTYPE_Q8_0] = "Q8_0",
        [FL_DTYPE_Q4_0] = "Q4_0", [FL_DTYPE_Q4_1] = "Q4_1", [FL_DTYPE_Q2_K] = "Q2_K",
        [FL_DTYPE_Q3_K] = "Q3_K", [FL_DTYPE_Q4_K] = "Q4_K", [FL_DTYPE_Q5_K] = "Q5_K",
        [FL_DTYPE_Q6_K] = "Q6_K", [FL_DTYPE_Q8_K] = "Q8_K", [FL_DTYPE_IQ4_NL] = "IQ4_NL",
        [FL_DTYPE_IQ4_XS] = "IQ4_XS", [FL_DTYPE_I64] = "I64", [FL_DTYPE_F8_E4M3] = "F8_E4M3",
    };
    if ((unsigned)dt >= FL_DTYPE_COUNT) return "UNKNOWN";
    return names[dt];
}

float fl_f8e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 0xf, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    const float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return (b & 0x80) ? -v : v;
}

size_t fl_dtype_row_bytes(fl_dtype dt, int64_t n) {
    if (n < 0) return 0;
    size_t un = (size_t)n;
    switch (dt) {
    case FL_DTYPE_F32: return un * 4;
    case FL_DTYPE_F16: return un * 2;
    case FL_DTYPE_BF16: return un * 2;
    case FL_DTYPE_W4: return (un + 1) / 2;
    case FL_DTYPE_I32: return un * 4;
    case FL_DTYPE_I64: return un * 8;
    case FL_DTYPE_F8_E4M3: return un;
    case FL_DTYPE_Q8_0: return un / QK * (2 + QK);
    case FL_DTYPE_Q4_0: return un / QK * (2 + QK / 2);
    case FL_DTYPE_Q4_1: return un / QK * (4 + QK / 2);
    default: {
        int64_t be;
        size_t bb;
        return fl_kquant_block(dt, &be, &bb) ? un / (size_t)be * bb : 0;
    }
    }
}

int64_t fl_tensor_numel(const fl_tensor *t) {
    if (!t) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

void fl_tensor_free(fl_tensor *t) {
    if (!t) return;
    if (t->owned) {
        free(t->data);
        free(t->scales);
        free(t->bias);
    }
    memset(t, 0, sizeof *t);
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float fl_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t fl_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    /* round to nearest, ties to even: add 0x7fff plus the lowest kept bit */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float fl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13)); /* inf / NaN */
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t fl_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
    if (a >= 0x47800000u) {
        /* >= 65536 (or inf): overflows even before rounding */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (a < 0x38800000u) {
        /* below the smallest normal half (2^-14): subnormal or zero.
         * value / 2^-24 rounded to nearest even gives the mantissa; the
         * FPU does the rounding exactly because the scaled value is exact. */
        float v = bits_f32(a) * 0x1p24f;
        float r = nearbyintf(v); /* default rounding mode: ties to even */
        return (uint16_t)(sign | (uint16_t)r); /* r == 1024 becomes the smallest normal */
    }
    /* normal: rebias exponent, round 13 dropped bits to nearest even. A
     * carry out of the mantissa correctly bumps the exponent (up to inf). */
    uint32_t h = ((a >> 13) - (112u << 10));
    uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

uint8_t fl_f32_to_f8e4m3(float f) {
    const uint8_t sign = (uint8_t)((f32_bits(f) >> 24) & 0x80u);
    if (isnan(f)) return (uint8_t)(sign | 0x7f);
    const float a = fabsf(f);
    if (a >= 448.0f) return (uint8_t)(sign | 0x7e); /* satfinite: no code above 448 (0x7f is NaN) */
    if (a < 0x1p-6f) /* subnormal: m * 2^-9, exact scaling; m == 8 is the smallest normal's code */
        return (uint8_t)(sign | (uint8_t)nearbyintf(a * 0x1p9f));
    int ex;
    const float fr = frexpf(a, &ex); /* a = fr * 2^ex, fr in [0.5, 1) */
    /* 3 mantissa bits, ties to even; fr * 16 - 8 is exact, and m == 8
     * carries into the exponent by the addition below */
    const int m = (int)nearbyintf(fr * 16.0f - 8.0f);
    return (uint8_t)(sign | (((ex - 1 + 7) << 3) + m));
}

static uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

void fl_tensor_row_f32(const fl_tensor *t, int64_t r, float *out) {
    FL_ASSERT(t && t->ndim >= 1 && t->data);
    int64_t cols = t->shape[t->ndim - 1];
    const uint8_t *row = (const uint8_t *)t->data + (size_t)r * fl_dtype_row_bytes(t->dtype, cols);
    switch (t->dtype) {
    case FL_DTYPE_F32:
        memcpy(out, row, (size_t)cols * 4);
        break;
    case FL_DTYPE_F16:
        for (int64_t c = 0; c < cols; c++) out[c] = fl_f16_to_f32(load_u16(row + 2 * c));
        break;
    case FL_DTYPE_BF16:
        for (int64_t c = 0; c < cols; c++) out[c] = fl_bf16_to_f32(load_u16(row + 2 * c));
        break;
    case FL_DTYPE_I32:
        for (int64_t c = 0; c < cols; c++) {
            int32_t v;
            memcpy(&v, row + 4 * c, 4);
            out[c] = (float)v;
        }
        break;
    case FL_DTYPE_F8_E4M3: { /* a linear's codes times its row's scale, or bare file codes */
        const float s = t->scales ? t->scales[r] : 1.0f;
        for (int64_t c = 0; c < cols; c++) out[c] = fl_f8e4m3_to_f32(row[c]) * s;
        break;
    }
    case FL_DTYPE_I64:
        for (int64_t c = 0; c < cols; c++) {
            int64_t v;
            memcpy(&v, row + 8 * c, 8);
            out[c] = (float)v;
        }
        break;
    case FL_DTYPE_W4: {
        FL_ASSERT(t->group > 0 && cols % t->group == 0 && t->scales && t->bias);
        int64_t ng = cols / t->group;
        const float *s = t->scales + r * ng;
        const float *b = t->bias + r * ng;
        for (int64_t c = 0; c < cols; c++) {
            uint8_t byte = row[c / 2];
            int code = (c & 1) ? (byte >> 4) : (byte & 0x0f);
            out[c] = (float)code * s[c / t->group] + b[c / t->group];
        }
        break;
    }
    case FL_DTYPE_Q8_0:
        FL_ASSERT(cols % QK == 0);
        for (int64_t blk = 0; blk < cols / QK; blk++) {
            const uint8_t *p = row + blk * (2 + QK);
            float d = fl_f16_to_f32(load_u16(p));
            const int8_t *qs = (const int8_t *)(p + 2);
            for (int j = 0; j < QK; j++) out[blk * QK + j] = d * (float)qs[j];
        }
        break;
    case FL_DTYPE_Q4_0:
        FL_ASSERT(cols % QK == 0);
        for (int64_t blk = 0; blk < cols / QK; blk++) {
            const uint8_t *p = row + blk * (2 + QK / 2);
            float d = fl_f16_to_f32(load_u16(p));
            const uint8_t *qs = p + 2;
            for (int j = 0; j < QK / 2; j++) {
                out[blk * QK + j] = d * (float)((qs[j] & 0x0f) - 8);
                out[blk * QK + j + QK / 2] = d * (float)((qs[j] >> 4) - 8);
            }
        }
        break;
    case FL_DTYPE_Q4_1:
        FL_ASSERT(cols % QK == 0);
        for (int64_t blk = 0; blk < cols / QK; blk++) {
            const uint8_t *p = row + blk * (4 + QK / 2);
            float d = fl_f16_to_f32(load_u16(p));
            float m = fl_f16_to_f32(load_u16(p + 2));
            const uint8_t *qs = p + 4;
            for (int j = 0; j < QK / 2; j++) {
                out[blk * QK + j] = d * (float)(qs[j] & 0x0f) + m;
                out[blk * QK + j + QK / 2] = d * (float)(qs[j] >> 4) + m;
            }
        }
        break;
    default:
        FL_ASSERT(fl_kquant_block(t->dtype, NULL, NULL));
        fl_kquant_row_f32(t->dtype, row, cols, out);
    }
}
