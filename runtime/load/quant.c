/*
 * quant.c — builds FL_DTYPE_W4 tensors (see quant.h) from AutoAWQ GEMM,
 * compressed-tensors and GPTQ tensors, from float weights (RTN), and from
 * GGUF Q4_0 / Q4_1 / Q4_K blocks; GPTQ act-order linears become F32.
 *
 * W4 stores value = code * scale + bias per (row, group), which is the
 * common form of all three sources, so backends need one 4-bit kernel.
 * These conversions run once at load time; they favour clarity over speed.
 */
#include "runtime/load/quant.h"

#include "core/gguf_kquant.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

const int FL_AWQ_ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};
const int FL_AWQ_REVERSE_ORDER[8] = {0, 4, 1, 5, 2, 6, 3, 7};

fl_status fl_quant_w4_alloc(int64_t rows, int64_t cols, int group, fl_tensor *w4) {
    fl_status st = FL_OK;
    memset(w4, 0, sizeof *w4);
    if (rows <= 0 || cols <= 0 || group <= 0 || cols % group != 0 || cols % 2 != 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "W4 tensor [%lld, %lld] with group %d: cols must be even and a "
                      "multiple of the group", (long long)rows, (long long)cols, group);
    size_t ng = (size_t)rows * (size_t)(cols / group);
    w4->dtype = FL_DTYPE_W4;
    w4->ndim = 2;
    w4->shape[0] = rows;
    w4->shape[1] = cols;
    w4->group = group;
    w4->owned = 1;
    w4->data = calloc((size_t)rows * (size_t)cols / 2, 1);
    FL_CHECK_ALLOC(w4->data, st, fail);
    w4->scales = calloc(ng, sizeof(float));
    FL_CHECK_ALLOC(w4->scales, st, fail);
    w4->bias = calloc(ng, sizeof(float));
    FL_CHECK_ALLOC(w4->bias, st, fail);
    return FL_OK;
fail:
    fl_tensor_free(w4);
    return st;
}

static void set_code(uint8_t *codes, int64_t cols, int64_t r, int64_t c, unsigned q) {
    uint8_t *b = &codes[(size_t)r * (size_t)(cols / 2) + (size_t)(c / 2)];
    if (c & 1) *b = (uint8_t)((*b & 0x0f) | (q << 4));
    else *b = (uint8_t)((*b & 0xf0) | (q & 0x0f));
}

static uint32_t load_u32(const void *base, size_t i) {
    uint32_t v;
    memcpy(&v, (const uint8_t *)base + 4 * i, 4);
    return v;
}

static float load_scalar(const void *base, fl_dtype dt, size_t i) {
    const uint8_t *p = base;
    uint16_t h;
    float f;
    switch (dt) {
    case FL_DTYPE_F16: memcpy(&h, p + 2 * i, 2); return fl_f16_to_f32(h);
    case FL_DTYPE_BF16: memcpy(&h, p + 2 * i, 2); return fl_bf16_to_f32(h);
    default: memcpy(&f, p + 4 * i, 4); return f;
    }
}

/* The scale dtypes the 4-bit loaders read (load_scalar). */
static fl_status check_scales(const char *name, const char *what, fl_dtype dt) {
    if (dt != FL_DTYPE_F16 && dt != FL_DTYPE_BF16 && dt != FL_DTYPE_F32)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %s of dtype %s are not supported (F16, BF16, F32)", name, what,
                      fl_dtype_name(dt));
    return FL_OK;
}

fl_status fl_quant_awq_to_w4(const char *name, const void *qweight, const void *qzeros, const void *scales,
                             fl_dtype scales_dt, int64_t out, int64_t in, int group, fl_tensor *w4) {
    memset(w4, 0, sizeof *w4);
    if (out % 8 != 0 || group <= 0 || in % group != 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: AWQ weight [%lld, %lld] with group %d: out must be a multiple of 8 "
                      "and in a multiple of the group", name, (long long)out, (long long)in, group);
    FL_TRY(check_scales(name, "AWQ scales", scales_dt));
    /* W4 is [out, in]; AWQ stores the transpose, grouped along `in`. */
    FL_TRY(fl_quant_w4_alloc(out, in, group, w4));
    uint8_t *codes = w4->data;
    int64_t ng = in / group, packed = out / 8;
    for (int64_t i = 0; i < in; i++) {
        for (int64_t j = 0; j < packed; j++) {
            uint32_t word = load_u32(qweight, (size_t)(i * packed + j));
            for (int k = 0; k < 8; k++) {
                int64_t o = 8 * j + FL_AWQ_ORDER[k];
                set_code(codes, in, o, i, (word >> (4 * k)) & 0xfu);
            }
        }
    }
    for (int64_t g = 0; g < ng; g++) {
        for (int64_t j = 0; j < packed; j++) {
            uint32_t word = load_u32(qzeros, (size_t)(g * packed + j));
            for (int k = 0; k < 8; k++) {
                int64_t o = 8 * j + FL_AWQ_ORDER[k];
                float z = (float)((word >> (4 * k)) & 0xfu);
                float s = load_scalar(scales, scales_dt, (size_t)(g * out + o));
                w4->scales[o * ng + g] = s;
                w4->bias[o * ng + g] = -z * s;
            }
        }
    }
    return FL_OK;
}

fl_status fl_quant_ct_pack_to_w4(const char *name, const void *packed, const void *zeros, const void *scales,
                                 fl_dtype scales_dt, int64_t out, int64_t in, int group, fl_tensor *w4) {
    memset(w4, 0, sizeof *w4);
    if (in % 8 != 0 || group <= 0 || in % group != 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: compressed-tensors weight [%lld, %lld] with group %d: in must be a "
                      "multiple of 8 and of the group", name, (long long)out, (long long)in, group);
    FL_TRY(check_scales(name, "weight_scale values", scales_dt));
    FL_TRY(fl_quant_w4_alloc(out, in, group, w4));
    uint8_t *codes = w4->data;
    const int64_t ng = in / group, words = in / 8;
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < words; j++) {
            /* 8 nibbles in element order, lowest first: W4's byte order already */
            uint32_t word = load_u32(packed, (size_t)(o * words + j));
            for (int k = 0; k < 4; k++) codes[o * (in / 2) + 4 * j + k] = (uint8_t)(word >> (8 * k));
        }
    for (int64_t o = 0; o < out; o++)
        for (int64_t g = 0; g < ng; g++) {
            float z = 8.0f;
            if (zeros) z = (float)((load_u32(zeros, (size_t)((o / 8) * ng + g)) >> (4 * (o % 8))) & 0xfu);
            float sc = load_scalar(scales, scales_dt, (size_t)(o * ng + g));
            w4->scales[o * ng + g] = sc;
            w4->bias[o * ng + g] = -z * sc;
        }
    return FL_OK;
}

bool fl_quant_gptq_g_idx_trivial(const void *g_idx, int64_t in, int group) {
    if (!g_idx) return true;
    for (int64_t i = 0; i < in; i++)
        if ((int64_t)(int32_t)load_u32(g_idx, (size_t)i) != i / group) return false;
    return true;
}

static unsigned gptq_zero(const fl_quant_gptq *s, int64_t g, int64_t o) {
    uint32_t w = load_u32(s->qzeros, (size_t)(g * (s->out / 8) + o / 8));
    if (s->zeros_minus_one) w += 0x11111111u; /* undoes the writer's whole-word subtraction, borrows included */
    return (w >> (4 * (o % 8))) & 0xfu;
}

static fl_status gptq_check(const char *name, const fl_quant_gptq *s) {
    /* with a g_idx, any group count: the entries are checked against it */
    if (s->out % 8 || s->in % 8 || s->group <= 0 || s->n_groups <= 0 ||
        (!s->g_idx && s->n_groups != (s->in + s->group - 1) / s->group))
        return FL_ERR(FL_ERR_FORMAT, "%s: GPTQ weight [%lld, %lld] with group %d and %lld groups: in and out must "
                      "be multiples of 8 and the groups ceil(in / group)", name, (long long)s->out,
                      (long long)s->in, s->group, (long long)s->n_groups);
    return check_scales(name, "GPTQ scales", s->scales_dt);
}

fl_status fl_quant_gptq_to_w4(const char *name, const fl_quant_gptq *s, fl_tensor *w4) {
    memset(w4, 0, sizeof *w4);
    FL_TRY(gptq_check(name, s));
    if (s->in % s->group || !fl_quant_gptq_g_idx_trivial(s->g_idx, s->in, s->group))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: GPTQ groups are not runs of %d consecutive inputs: not W4", name,
                      s->group);
    FL_TRY(fl_quant_w4_alloc(s->out, s->in, s->group, w4));
    uint8_t *codes = w4->data;
    const int64_t ng = s->n_groups;
    for (int64_t j = 0; j < s->in / 8; j++)
        for (int64_t o = 0; o < s->out; o++) {
            /* inputs 8j..8j+7, lowest nibble first: the word's bytes are W4's */
            uint32_t word = load_u32(s->qweight, (size_t)(j * s->out + o));
            for (int k = 0; k < 4; k++) codes[o * (s->in / 2) + 4 * j + k] = (uint8_t)(word >> (8 * k));
        }
    for (int64_t g = 0; g < ng; g++)
        for (int64_t o = 0; o < s->out; o++) {
            float sc = load_scalar(s->scales, s->scales_dt, (size_t)(g * s->out + o));
            w4->scales[o * ng + g] = sc;
            w4->bias[o * ng + g] = -(float)gptq_zero(s, g, o) * sc;
        }
    return FL_OK;
}

fl_status fl_quant_gptq_to_f32(const char *name, const fl_quant_gptq *s, fl_tensor *f32) {
    memset(f32, 0, sizeof *f32);
    FL_TRY(gptq_check(name, s));
    float *v = malloc((size_t)s->out * (size_t)s->in * sizeof(float));
    if (!v) return FL_ERR(FL_ERR_OOM, "out of memory dequantizing GPTQ weight %s", name);
    for (int64_t i = 0; i < s->in; i++) {
        const int64_t g = s->g_idx ? (int32_t)load_u32(s->g_idx, (size_t)i) : i / s->group;
        if (g < 0 || g >= s->n_groups) {
            free(v);
            return FL_ERR(FL_ERR_FORMAT, "%s: g_idx[%lld] = %lld is not a group (0..%lld)", name, (long long)i,
                          (long long)g, (long long)s->n_groups - 1);
        }
        for (int64_t o = 0; o < s->out; o++) {
            unsigned q = (load_u32(s->qweight, (size_t)((i / 8) * s->out + o)) >> (4 * (i % 8))) & 0xfu;
            float sc = load_scalar(s->scales, s->scales_dt, (size_t)(g * s->out + o));
            v[o * s->in + i] = (float)((int)q - (int)gptq_zero(s, g, o)) * sc;
        }
    }
    f32->dtype = FL_DTYPE_F32;
    f32->ndim = 2;
    f32->shape[0] = s->out;
    f32->shape[1] = s->in;
    f32->data = v;
    f32->owned = 1;
    return FL_OK;
}

fl_status fl_quant_fp8_to_f32(const char *name, const fl_quant_fp8 *s, int64_t row_lo, int64_t n_rows,
                              int64_t col_lo, int64_t n_cols, fl_tensor *f32, size_t *bytes_read) {
    memset(f32, 0, sizeof *f32);
    FL_TRY(check_scales(name, "FP8 weight scales", s->scales_dt));
    if (s->block_rows <= 0 || s->block_cols <= 0 || row_lo < 0 || n_rows <= 0 || row_lo + n_rows > s->out ||
        col_lo < 0 || n_cols <= 0 || col_lo + n_cols > s->in)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: FP8 block rows %lld+%lld, cols %lld+%lld of [%lld, %lld] (scale "
                      "tiles %lldx%lld)", name, (long long)row_lo, (long long)n_rows, (long long)col_lo,
                      (long long)n_cols, (long long)s->out, (long long)s->in, (long long)s->block_rows,
                      (long long)s->block_cols);
    const int64_t s_cols = (s->in + s->block_cols - 1) / s->block_cols;
    const int64_t t_r0 = row_lo / s->block_rows, t_r1 = (row_lo + n_rows - 1) / s->block_rows;
    const int64_t t_c0 = col_lo / s->block_cols, t_c1 = (col_lo + n_cols - 1) / s->block_cols;
    for (int64_t tr = t_r0; tr <= t_r1; tr++)
        for (int64_t tc = t_c0; tc <= t_c1; tc++) {
            const float sc = load_scalar(s->scales, s->scales_dt, (size_t)(tr * s_cols + tc));
            if (!isfinite(sc))
                return FL_ERR(FL_ERR_FORMAT, "%s: FP8 weight scale [%lld, %lld] is %g", name, (long long)tr,
                              (long long)tc, (double)sc);
        }
    float *v = malloc((size_t)n_rows * (size_t)n_cols * sizeof(float));
    if (!v) return FL_ERR(FL_ERR_OOM, "out of memory dequantizing FP8 weight %s", name);
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t gr = row_lo + r, tr = gr / s->block_rows;
        const uint8_t *w = (const uint8_t *)s->weight + (size_t)gr * (size_t)s->in;
        float sc = 0;
        for (int64_t c = 0; c < n_cols; c++) {
            const int64_t gc = col_lo + c;
            if (c == 0 || gc % s->block_cols == 0)
                sc = load_scalar(s->scales, s->scales_dt, (size_t)(tr * s_cols + gc / s->block_cols));
            const uint8_t b = w[gc];
            if ((b & 0x7f) == 0x7f) {
                free(v);
                return FL_ERR(FL_ERR_FORMAT, "%s: FP8 weight [%lld, %lld] is NaN (code 0x%02x)", name,
                              (long long)gr, (long long)gc, b);
            }
            v[r * n_cols + c] = fl_f8e4m3_to_f32(b) * sc;
        }
    }
    if (bytes_read)
        *bytes_read = (size_t)n_rows * (size_t)n_cols +
                      (size_t)((t_r1 - t_r0 + 1) * (t_c1 - t_c0 + 1)) * fl_dtype_row_bytes(s->scales_dt, 1);
    f32->dtype = FL_DTYPE_F32;
    f32->ndim = 2;
    f32->shape[0] = n_rows;
    f32->shape[1] = n_cols;
    f32->data = v;
    f32->owned = 1;
    return FL_OK;
}

fl_status fl_quant_rtn_to_w4(const char *name, const fl_tensor *src, int group, fl_tensor *w4) {
    fl_status st = FL_OK;
    float *row = NULL;
    memset(w4, 0, sizeof *w4);
    if (src->ndim != 2 ||
        (src->dtype != FL_DTYPE_F32 && src->dtype != FL_DTYPE_F16 && src->dtype != FL_DTYPE_BF16))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: RTN quantization needs a 2-D F32/F16/BF16 tensor, got %d-D %s",
                      name, src->ndim, fl_dtype_name(src->dtype));
    int64_t rows = src->shape[0], cols = src->shape[1];
    if (group <= 0 || cols % group != 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: %lld columns are not a multiple of the W4 group %d", name,
                      (long long)cols, group);
    FL_TRY(fl_quant_w4_alloc(rows, cols, group, w4));
    row = malloc((size_t)cols * sizeof(float));
    FL_CHECK_ALLOC(row, st, fail);
    int64_t ng = cols / group;
    for (int64_t r = 0; r < rows; r++) {
        fl_tensor_row_f32(src, r, row);
        for (int64_t g = 0; g < ng; g++) {
            const float *x = row + g * group;
            float mn = x[0], mx = x[0];
            for (int c = 1; c < group; c++) {
                mn = fminf(mn, x[c]);
                mx = fmaxf(mx, x[c]);
            }
            float scale = (mx - mn) / 15.0f;
            for (int c = 0; c < group; c++) {
                /* constant group (max == min): scale 0, all codes 0, exact */
                float q = scale > 0.0f ? roundf((x[c] - mn) / scale) : 0.0f;
                q = q < 0.0f ? 0.0f : (q > 15.0f ? 15.0f : q);
                set_code(w4->data, cols, r, g * group + c, (unsigned)q);
            }
            w4->scales[r * ng + g] = scale;
            w4->bias[r * ng + g] = mn;
        }
    }
    free(row);
    return FL_OK;
fail:
    free(row);
    fl_tensor_free(w4);
    return st;
}

bool fl_quant_fp8_source(fl_dtype dt) {
    return dt == FL_DTYPE_F32 || dt == FL_DTYPE_F16 || dt == FL_DTYPE_BF16 || dt == FL_DTYPE_Q8_0;
}

static bool fp8_source(const fl_tensor *src) { return src->ndim == 2 && fl_quant_fp8_source(src->dtype); }

/* Row r's largest magnitude, or FL_ERR_FORMAT at its first value that is not finite. */
static fl_status row_absmax(const char *name, const float *row, int64_t r, int64_t cols, float *mx) {
    *mx = 0.0f;
    for (int64_t c = 0; c < cols; c++) {
        if (!isfinite(row[c]))
            return FL_ERR(FL_ERR_FORMAT, "%s: weight [%lld, %lld] is %g: cannot quantize to FP8", name, (long long)r,
                          (long long)c, (double)row[c]);
        *mx = fmaxf(*mx, fabsf(row[c]));
    }
    return FL_OK;
}

fl_status fl_quant_row_absmax(const char *name, const fl_tensor *src, float *absmax) {
    if (!fp8_source(src))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: FP8 quantization needs a 2-D F32/F16/BF16/Q8_0 tensor, got %d-D %s",
                      name, src->ndim, fl_dtype_name(src->dtype));
    const int64_t rows = src->shape[0], cols = src->shape[1];
    float *row = malloc((size_t)cols * sizeof(float) + 4);
    if (!row) return FL_ERR(FL_ERR_OOM, "out of memory quantizing %s", name);
    fl_status st = FL_OK;
    for (int64_t r = 0; r < rows && st == FL_OK; r++) {
        fl_tensor_row_f32(src, r, row);
        st = row_absmax(name, row, r, cols, &absmax[r]);
    }
    free(row);
    return st;
}

fl_status fl_quant_to_fp8(const char *name, const fl_tensor *src, const float *absmax, fl_tensor *fp8) {
    fl_status st = FL_OK;
    float *row = NULL;
    memset(fp8, 0, sizeof *fp8);
    if (!fp8_source(src))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: FP8 quantization needs a 2-D F32/F16/BF16/Q8_0 tensor, got %d-D %s",
                      name, src->ndim, fl_dtype_name(src->dtype));
    const int64_t rows = src->shape[0], cols = src->shape[1];
    fp8->dtype = FL_DTYPE_F8_E4M3;
    fp8->ndim = 2;
    fp8->shape[0] = rows;
    fp8->shape[1] = cols;
    fp8->owned = 1;
    fp8->data = malloc((size_t)(rows * cols) + 1);
    fp8->scales = malloc((size_t)rows * sizeof(float) + 4);
    row = malloc((size_t)cols * sizeof(float) + 4);
    FL_CHECK_ALLOC(fp8->data, st, fail);
    FL_CHECK_ALLOC(fp8->scales, st, fail);
    FL_CHECK_ALLOC(row, st, fail);
    for (int64_t r = 0; r < rows; r++) {
        fl_tensor_row_f32(src, r, row);
        float mx;
        FL_TRY_GOTO(row_absmax(name, row, r, cols, &mx), st, fail);
        if (absmax) mx = fmaxf(mx, absmax[r]); /* the whole row's (a block's own is never larger) */
        const float scale = mx > 0.0f ? fmaxf(mx / 448.0f, FLT_MIN) : 1.0f; /* FLT_MIN: see backend.h */
        uint8_t *q = (uint8_t *)fp8->data + r * cols;
        for (int64_t c = 0; c < cols; c++) q[c] = fl_f32_to_f8e4m3(row[c] / scale);
        fp8->scales[r] = scale;
    }
    free(row);
    return FL_OK;
fail:
    free(row);
    fl_tensor_free(fp8);
    return st;
}

fl_status fl_quant_gguf_q4_to_w4(const char *name, const fl_tensor *src, fl_tensor *w4) {
    memset(w4, 0, sizeof *w4);
    if (src->ndim != 2 || (src->dtype != FL_DTYPE_Q4_0 && src->dtype != FL_DTYPE_Q4_1))
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: expected a 2-D Q4_0/Q4_1 tensor, got %d-D %s", name, src->ndim,
                      fl_dtype_name(src->dtype));
    int64_t rows = src->shape[0], cols = src->shape[1];
    if (cols % 32 != 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: %lld columns are not a whole number of 32-element blocks", name,
                      (long long)cols);
    FL_TRY(fl_quant_w4_alloc(rows, cols, 32, w4));
    bool q41 = src->dtype == FL_DTYPE_Q4_1;
    size_t bsz = q41 ? 20 : 18;
    int64_t nb = cols / 32;
    const uint8_t *base = src->data;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = base + ((size_t)r * (size_t)nb + (size_t)b) * bsz;
            uint16_t h;
            memcpy(&h, p, 2);
            float d = fl_f16_to_f32(h);
            float bias = -8.0f * d;
            if (q41) {
                memcpy(&h, p + 2, 2);
                bias = fl_f16_to_f32(h);
            }
            const uint8_t *qs = p + (q41 ? 4 : 2);
            for (int j = 0; j < 16; j++) {
                set_code(w4->data, cols, r, b * 32 + j, qs[j] & 0x0fu);
                set_code(w4->data, cols, r, b * 32 + j + 16, qs[j] >> 4);
            }
            w4->scales[r * nb + b] = d;
            w4->bias[r * nb + b] = bias;
        }
    }
    return FL_OK;
}

fl_status fl_quant_gguf_q4k_to_w4(const char *name, const fl_tensor *src, fl_tensor *w4) {
    memset(w4, 0, sizeof *w4);
    if (src->ndim != 2 || src->dtype != FL_DTYPE_Q4_K)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: expected a 2-D Q4_K tensor, got %d-D %s", name, src->ndim,
                      fl_dtype_name(src->dtype));
    int64_t rows = src->shape[0], cols = src->shape[1];
    if (cols % FL_QK_K != 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: %lld columns are not a whole number of %d-element Q4_K blocks", name,
                      (long long)cols, FL_QK_K);
    FL_TRY(fl_quant_w4_alloc(rows, cols, 32, w4));
    const size_t bsz = fl_dtype_row_bytes(FL_DTYPE_Q4_K, FL_QK_K);
    const int64_t nb = cols / FL_QK_K, ng = cols / 32;
    const uint8_t *base = src->data;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = base + ((size_t)r * (size_t)nb + (size_t)b) * bsz;
            uint16_t h;
            memcpy(&h, p, 2);
            float d = fl_f16_to_f32(h);
            memcpy(&h, p + 2, 2);
            float dmin = fl_f16_to_f32(h);
            const uint8_t *qs = p + 16;
            for (int j = 0; j < 8; j++) {
                uint8_t sc, m;
                fl_kquant_scale_min_k4(p + 4, j, &sc, &m);
                w4->scales[r * ng + b * 8 + j] = d * (float)sc;
                w4->bias[r * ng + b * 8 + j] = -(dmin * (float)m);
                /* sub-block 2k holds the low nibbles of qs[32k..32k+31], 2k+1 the high ones */
                for (int l = 0; l < 32; l++) {
                    unsigned q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0fu;
                    set_code(w4->data, cols, r, b * FL_QK_K + 32 * j + l, q);
                }
            }
        }
    }
    return FL_OK;
}
