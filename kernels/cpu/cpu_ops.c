/*
 * cpu_ops.c — the CPU reference ops (contracts in kernels/backend.h): plain
 * C, f32 activations, f32 math. Weights of any dtype are expanded one row
 * at a time through fl_tensor_row_f32, the single dequantization point, so
 * every weight kind gets the same arithmetic. Matmuls split the weight rows
 * over the pool's threads (kernels/pool.h), so each weight byte is read once per call whatever
 * the number of tokens.
 */
#include <float.h>
#include <stdbool.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/pool.h"

/* Hot loops are compiled for AVX2+FMA and for baseline x86-64, chosen at
 * load time (GCC function multi-versioning), so one binary runs anywhere
 * and still uses the vector units where they exist. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FL_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FL_HOT
#endif

/* Dot product with 8 independent partial sums: lets the compiler vectorize
 * without -ffast-math and keeps rounding error low for long rows. */
static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Row r of weight w as f32: a pointer into w for aligned F32 data, else
 * expanded into buf (safetensors data in a mapping need not be aligned). */
static const float *weight_row(const fl_tensor *w, int64_t r, float *buf) {
    if (w->dtype == FL_DTYPE_F32 && ((uintptr_t)w->data & 3) == 0)
        return (const float *)w->data + r * w->shape[w->ndim - 1];
    fl_tensor_row_f32(w, r, buf);
    return buf;
}

static fl_status check_float_weight(const fl_tensor *w, const char *what) {
    switch (w->dtype) {
    case FL_DTYPE_F32: case FL_DTYPE_F16: case FL_DTYPE_BF16: case FL_DTYPE_W4: case FL_DTYPE_Q8_0:
        return FL_OK;
    default:
        return FL_ERR(FL_ERR_UNSUPPORTED, "cpu %s: weight dtype %s is not supported", what,
                      fl_dtype_name(w->dtype));
    }
}

/* A 1-D weight (norm scale, bias) as f32: pointer for F32, else expanded. */
static const float *vector_f32(const fl_tensor *w, float *buf) {
    if (w->dtype == FL_DTYPE_F32 && ((uintptr_t)w->data & 3) == 0) return (const float *)w->data;
    fl_tensor t = *w;
    t.ndim = 2;
    t.shape[0] = 1;
    t.shape[1] = fl_tensor_numel(w);
    fl_tensor_row_f32(&t, 0, buf);
    return buf;
}

fl_status fl_cpu_embed(fl_backend *b, const fl_tensor *table, const int32_t *ids, int n, void *out) {
    (void)b;
    FL_TRY(check_float_weight(table, "embed"));
    int64_t vocab = table->shape[0], d = table->shape[1];
    float *o = out;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= vocab)
            return FL_ERR(FL_ERR_INVALID_ARG, "token id %d is outside the vocabulary (size %lld)",
                          ids[i], (long long)vocab);
        const float *row = weight_row(table, ids[i], o + (int64_t)i * d);
        if (row != o + (int64_t)i * d) memcpy(o + (int64_t)i * d, row, (size_t)d * sizeof(float));
    }
    return FL_OK;
}

fl_status fl_cpu_rmsnorm(fl_backend *b, const void *x, const fl_tensor *w, float eps, int n, int d,
                         void *out) {
    (void)b;
    FL_TRY(check_float_weight(w, "rmsnorm"));
    if (fl_tensor_numel(w) != d)
        return FL_ERR(FL_ERR_INVALID_ARG, "rmsnorm: weight has %lld elements, rows have %d",
                      (long long)fl_tensor_numel(w), d);
    float *wbuf = malloc((size_t)d * sizeof(float));
    if (!wbuf) return FL_ERR(FL_ERR_OOM, "out of memory in rmsnorm");
    const float *wv = vector_f32(w, wbuf);
    const float *xi = x;
    float *oi = out;
    for (int i = 0; i < n; i++, xi += d, oi += d) {
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)xi[j] * xi[j];
        float inv = (float)(1.0 / sqrt(ss / d + eps));
        for (int j = 0; j < d; j++) oi[j] = wv[j] * (xi[j] * inv);
    }
    free(wbuf);
    return FL_OK;
}

/* W4 rows, fused: for token x and group g with codes q, scale s, bias b,
 * sum_j (q_j s + b) x_j = s * sum_j q_j x_j + b * sum_j x_j. Codes are
 * expanded to floats once per row (no scale/bias pass) and the per-group x
 * sums are computed once per call, so a row costs one pass over its bytes. */
FL_HOT static void w4_row_dots(const fl_tensor *w, int64_t r, const float *x, int n, const float *xsum,
                        float *codes, float *out, int64_t out_stride) {
    const int64_t in = w->shape[1], G = w->group, ng = in / G;
    const uint8_t *q = (const uint8_t *)w->data + r * (in / 2);
    for (int64_t c = 0; c < in / 2; c++) {
        codes[2 * c] = (float)(q[c] & 15);
        codes[2 * c + 1] = (float)(q[c] >> 4);
    }
    const float *s = w->scales + r * ng, *b = w->bias + r * ng;
    if (n >= 4) {
        /* Many tokens: expand the row once, then plain vectorized dots. */
        for (int64_t g = 0; g < ng; g++)
            for (int64_t j = 0; j < G; j++) codes[g * G + j] = codes[g * G + j] * s[g] + b[g];
        for (int i = 0; i < n; i++) out[(int64_t)i * out_stride] = dot_f32(x + (int64_t)i * in, codes, (int)in);
        return;
    }
    for (int i = 0; i < n; i++) {
        const float *xi = x + (int64_t)i * in, *xs = xsum + (int64_t)i * ng;
        double acc = 0;
        for (int64_t g = 0; g < ng; g++)
            acc += (double)s[g] * dot_f32(codes + g * G, xi + g * G, (int)G) + (double)b[g] * xs[g];
        out[(int64_t)i * out_stride] = (float)acc;
    }
}

FL_HOT static void bf16_row(const fl_tensor *w, int64_t r, float *buf) {
    const int64_t in = w->shape[w->ndim - 1];
    const uint8_t *p = (const uint8_t *)w->data + r * in * 2;
    for (int64_t c = 0; c < in; c++) {
        uint32_t u = (uint32_t)(p[2 * c] | p[2 * c + 1] << 8) << 16; /* LE, any alignment */
        memcpy(&buf[c], &u, 4);
    }
}

/* One weight row against n tokens: y[i, r] = x[i] . w[r] + bias. */
FL_HOT static void dense_row_dots(const float *wr, const float *x, int n, int64_t in, float bias,
                                  float *out, int64_t out_stride) {
    for (int i = 0; i < n; i++) out[(int64_t)i * out_stride] = dot_f32(x + (int64_t)i * in, wr, (int)in) + bias;
}

/* FP8 linears (backend.h): the tokens' e4m3 codes as floats and their
 * scales, then each row's codes against them; every product is exact. */
static void fp8_quant_tokens(const float *x, int n, int64_t in, float *xq, float *sx) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (int64_t)i * in;
        float mx = 0.0f;
        for (int64_t c = 0; c < in; c++) mx = fmaxf(mx, fabsf(xi[c]));
        const float s = mx > 0.0f ? fmaxf(mx / 448.0f, FLT_MIN) : 1.0f, inv = 1.0f / s;
        for (int64_t c = 0; c < in; c++) xq[(int64_t)i * in + c] = fl_f8e4m3_to_f32(fl_f32_to_f8e4m3(xi[c] * inv));
        sx[i] = s;
    }
}

static float fp8_lut[256];
static pthread_once_t fp8_lut_once = PTHREAD_ONCE_INIT;
static void fp8_lut_init(void) {
    for (int v = 0; v < 256; v++) fp8_lut[v] = fl_f8e4m3_to_f32((uint8_t)v);
}

FL_HOT static void fp8_row_dots(const fl_tensor *w, int64_t r, const float *xq, const float *sx, int n,
                                float *codes, float *out, int64_t out_stride) {
    const float *lut = fp8_lut;
    const int64_t in = w->shape[1];
    const uint8_t *q = (const uint8_t *)w->data + r * in;
    for (int64_t c = 0; c < in; c++) codes[c] = lut[q[c]];
    for (int i = 0; i < n; i++)
        out[(int64_t)i * out_stride] = sx[i] * w->scales[r] * dot_f32(xq + (int64_t)i * in, codes, (int)in);
}

typedef struct matmul_job {
    const fl_tensor *w;
    const float *xf, *xsum, *bv;
    const float *xq, *sx; /* FP8: the tokens' codes and scales */
    float *yf;
    int n;
    atomic_int oom;
} matmul_job;

/* Weight rows [lo, hi) against every token (a pool task). */
static void matmul_rows(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    matmul_job *j = ctx;
    const fl_tensor *w = j->w;
    const int64_t n_out = w->shape[0], n_in = w->shape[1];
    const bool w4 = w->dtype == FL_DTYPE_W4;
    const int n = j->n;
    float *rowbuf = malloc((size_t)n_in * sizeof(float));
    if (!rowbuf) {
        atomic_store(&j->oom, 1);
        return;
    }
    for (int64_t r = lo; r < hi; r++) {
        float bb = j->bv ? j->bv[r] : 0.0f;
        if (j->xq) {
            fp8_row_dots(w, r, j->xq, j->sx, n, rowbuf, j->yf + r, n_out);
            if (j->bv)
                for (int i = 0; i < n; i++) j->yf[(int64_t)i * n_out + r] += bb;
            continue;
        }
        if (w4) {
            w4_row_dots(w, r, j->xf, n, j->xsum, rowbuf, j->yf + r, n_out);
            if (j->bv)
                for (int i = 0; i < n; i++) j->yf[(int64_t)i * n_out + r] += bb;
            continue;
        }
        const float *wr;
        if (w->dtype == FL_DTYPE_BF16) {
            bf16_row(w, r, rowbuf);
            wr = rowbuf;
        } else {
            wr = weight_row(w, r, rowbuf);
        }
        dense_row_dots(wr, j->xf, n, n_in, bb, j->yf + r, n_out);
    }
    free(rowbuf);
}

fl_status fl_cpu_matmul(fl_backend *b, const void *x, int n, const fl_tensor *w,
                        const fl_tensor *bias, void *y) {
    if (!(w->dtype == FL_DTYPE_F8_E4M3 && w->scales)) /* FP8 linears: matmul only */
        FL_TRY(check_float_weight(w, "matmul"));
    if (w->ndim != 2) return FL_ERR(FL_ERR_INVALID_ARG, "matmul: weight must be 2-D");
    const int64_t n_out = w->shape[0], n_in = w->shape[1];
    const bool w4 = w->dtype == FL_DTYPE_W4;
    if (w4 && (w->group <= 0 || n_in % w->group || n_in % 2))
        return FL_ERR(FL_ERR_INVALID_ARG, "matmul: W4 weight [%lld, %lld] with group %d",
                      (long long)n_out, (long long)n_in, w->group);
    const float *xf = x;
    float *yf = y;
    float *bbuf = NULL, *xsum = NULL, *xq = NULL;
    const float *bv = NULL;
    fl_status st = FL_OK;
    if (bias) {
        if (fl_tensor_numel(bias) != n_out)
            return FL_ERR(FL_ERR_INVALID_ARG, "matmul: bias has %lld elements, weight has %lld rows",
                          (long long)fl_tensor_numel(bias), (long long)n_out);
        bbuf = malloc((size_t)n_out * sizeof(float));
        FL_CHECK_ALLOC(bbuf, st, done);
        bv = vector_f32(bias, bbuf);
    }
    const fl_cpu_isa isa = fl_cpu_backend_isa(b);
    if (fl_cpu_qmatmul_supported(isa, w)) {
        st = fl_cpu_qmatmul(isa, xf, n, w, bv, yf);
        goto done;
    }
    if (w4) {
        const int64_t ng = n_in / w->group;
        xsum = malloc((size_t)(n * ng) * sizeof(float) + 4);
        FL_CHECK_ALLOC(xsum, st, done);
        for (int64_t i = 0; i < n * ng; i++) {
            float sum = 0;
            for (int64_t j = 0; j < w->group; j++) sum += xf[i * w->group + j];
            xsum[i] = sum;
        }
    }
    if (w->dtype == FL_DTYPE_F8_E4M3) {
        xq = malloc((size_t)(n * n_in + n) * sizeof(float) + 4);
        FL_CHECK_ALLOC(xq, st, done);
        fp8_quant_tokens(xf, n, n_in, xq, xq + (int64_t)n * n_in);
        pthread_once(&fp8_lut_once, fp8_lut_init);
    }
    matmul_job job = {.w = w, .xf = xf, .xsum = xsum, .bv = bv, .yf = yf, .n = n, .xq = xq,
                      .sx = xq ? xq + (int64_t)n * n_in : NULL};
    FL_TRY_GOTO(fl_pool_for(n_out, 0, matmul_rows, &job), st, done);
    if (atomic_load(&job.oom)) st = FL_ERR(FL_ERR_OOM, "out of memory in matmul");
done:
    free(bbuf);
    free(xsum);
    free(xq);
    return st;
}

fl_status fl_cpu_rope(fl_backend *b, void *x, int n_tok, int n_heads, int head_dim, int stride,
                      const float *cos, const float *sin, int rot_dim, bool interleaved) {
    (void)b;
    if (rot_dim > head_dim || rot_dim % 2)
        return FL_ERR(FL_ERR_INVALID_ARG, "rope: rot_dim %d invalid for head_dim %d", rot_dim, head_dim);
    const int half = rot_dim / 2;
    for (int t = 0; t < n_tok; t++) {
        const float *c = cos + (int64_t)t * half, *s = sin + (int64_t)t * half;
        for (int h = 0; h < n_heads; h++) {
            float *v = (float *)x + (int64_t)t * stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                int i0 = interleaved ? 2 * i : i;
                int i1 = interleaved ? 2 * i + 1 : i + half;
                float a = v[i0], bb = v[i1];
                v[i0] = a * c[i] - bb * s[i];
                v[i1] = bb * c[i] + a * s[i];
            }
        }
    }
    return FL_OK;
}

static float code_table[2][256];
static pthread_once_t code_once = PTHREAD_ONCE_INIT;
static void code_init(void) {
    for (int c = 0; c < 256; c++) {
        code_table[0][c] = (float)(int8_t)c;
        code_table[1][c] = fl_f8e4m3_to_f32((uint8_t)c);
    }
}
const float *fl_cpu_kv_code_table(bool fp8) {
    pthread_once(&code_once, code_init);
    return code_table[fp8 ? 1 : 0];
}

/* One token's K or V into a quantized record (backend.h, kv_int8_head_dim),
 * per head: int8, scale = absmax / 127 and q = round(x / scale); fp8,
 * scale = absmax / 448 and q = e4m3(x / scale). */
static void store_q(const float *x, int kv_dim, int hd, bool fp8, uint8_t *rec) {
    float *sc = (float *)(rec + ((kv_dim + 3) & ~3));
    for (int h = 0; h < kv_dim / hd; h++) {
        const float *xh = x + (int64_t)h * hd;
        float mx = 0;
        for (int j = 0; j < hd; j++) mx = fabsf(xh[j]) > mx ? fabsf(xh[j]) : mx;
        const float s = mx / (fp8 ? 448.0f : 127.0f), inv = s > 0 ? 1.0f / s : 0.0f;
        sc[h] = s;
        uint8_t *q = rec + (size_t)h * hd;
        if (fp8)
            for (int j = 0; j < hd; j++) q[j] = fl_f32_to_f8e4m3(xh[j] * inv);
        else
            for (int j = 0; j < hd; j++) q[j] = (uint8_t)(int8_t)lrintf(xh[j] * inv);
    }
}

fl_status fl_cpu_kv_store(fl_backend *b, const void *k, const void *v, int n_tok, int kv_dim,
                          int stride, const int32_t *slots, void *k_cache, void *v_cache) {
    const int hd = b ? b->kv_int8_head_dim : 0;
    if (hd > 0) {
        if (kv_dim % hd) return FL_ERR(FL_ERR_INVALID_ARG, "kv_store: kv_dim %d is not whole heads of %d", kv_dim, hd);
        const size_t rb = fl_kv_int8_record_bytes(kv_dim, hd);
        for (int t = 0; t < n_tok; t++) {
            if (slots[t] < 0) continue;
            store_q((const float *)k + (int64_t)t * stride, kv_dim, hd, b->kv_fp8_codes, (uint8_t *)k_cache + (size_t)slots[t] * rb);
            store_q((const float *)v + (int64_t)t * stride, kv_dim, hd, b->kv_fp8_codes, (uint8_t *)v_cache + (size_t)slots[t] * rb);
        }
        return FL_OK;
    }
    /* f32 or bf16 values (backend.h, kv_bf16: rounded to nearest even), slot
     * by slot or head by head within blocks (kv_block_size): a run of hd
     * values is one head's row either way */
    const bool bf = b && b->kv_bf16;
    const int bs = b ? b->kv_block_size : 0, hw = bs > 0 ? b->kv_head_dim : kv_dim;
    if (bs > 0 && (hw <= 0 || kv_dim % hw))
        return FL_ERR(FL_ERR_INVALID_ARG, "kv_store: kv_dim %d is not whole heads of %d", kv_dim, hw);
    const int n_kv = kv_dim / hw;
    const size_t eb = bf ? 2 : 4;
    for (int t = 0; t < n_tok; t++) {
        if (slots[t] < 0) continue; /* padding row (backend.h) */
        for (int h = 0; h < n_kv; h++) {
            const int64_t row = bs > 0 ? ((int64_t)(slots[t] / bs) * n_kv + h) * bs + slots[t] % bs
                                       : (int64_t)slots[t] * n_kv + h;
            const float *ks = (const float *)k + (int64_t)t * stride + (int64_t)h * hw;
            const float *vs = (const float *)v + (int64_t)t * stride + (int64_t)h * hw;
            char *kd = (char *)k_cache + row * hw * eb, *vd = (char *)v_cache + row * hw * eb;
            if (!bf) {
                memcpy(kd, ks, (size_t)hw * sizeof(float));
                memcpy(vd, vs, (size_t)hw * sizeof(float));
                continue;
            }
            for (int j = 0; j < hw; j++)
                ((uint16_t *)kd)[j] = fl_f32_to_bf16(ks[j]), ((uint16_t *)vd)[j] = fl_f32_to_bf16(vs[j]);
        }
    }
    return FL_OK;
}

fl_status fl_cpu_silu_mul(fl_backend *b, const void *gate, const void *up, int n, int d, int stride,
                          void *out) {
    (void)b;
    if (stride < d) return FL_ERR(FL_ERR_INVALID_ARG, "silu_mul: row stride %d < width %d", stride, d);
    float *o = out;
    for (int64_t r = 0; r < n; r++) {
        const float *g = (const float *)gate + r * stride, *u = (const float *)up + r * stride;
        for (int j = 0; j < d; j++) o[r * d + j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
    return FL_OK;
}

fl_status fl_cpu_add(fl_backend *b, void *x, const void *y, size_t n) {
    (void)b;
    float *xf = x;
    const float *yf = y;
    for (size_t i = 0; i < n; i++) xf[i] += yf[i];
    return FL_OK;
}

/* The three ops in order: the reference for the fused GPU kernel. */
fl_status fl_cpu_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                               int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                               const float *cos, const float *sin, int rot_dim, bool interleaved,
                               const int32_t *slots, void *k_cache, void *v_cache) {
    FL_TRY(fl_cpu_rope(b, q, n_tok, n_heads, head_dim, q_stride, cos, sin, rot_dim, interleaved));
    FL_TRY(fl_cpu_rope(b, k, n_tok, n_kv_heads, head_dim, kv_stride, cos, sin, rot_dim, interleaved));
    return fl_cpu_kv_store(b, k, v, n_tok, n_kv_heads * head_dim, kv_stride, slots, k_cache, v_cache);
}

/* The MLA input ops in order: the reference for the fused GPU kernel. */
fl_status fl_cpu_mla_rope_norm_store(fl_backend *b, void *q, int q_stride, void *ckv, int n_tok, int n_heads,
                                     int nope, int rope, int kvl, const float *cos, const float *sin,
                                     const fl_tensor *kv_norm, float eps, const int32_t *slots, void *k_cache,
                                     void *v_cache) {
    const int qk = nope + rope, rec = kvl + rope;
    FL_TRY(fl_cpu_rope(b, (float *)q + nope, n_tok, n_heads, qk, q_stride, cos, sin, rope, true));
    FL_TRY(fl_cpu_rope(b, (float *)ckv + kvl, n_tok, 1, rope, rec, cos, sin, rope, true));
    for (int t = 0; t < n_tok; t++) {
        float *lat = (float *)ckv + (int64_t)t * rec;
        FL_TRY(fl_cpu_rmsnorm(b, lat, kv_norm, eps, 1, kvl, lat));
    }
    return fl_cpu_kv_store(b, ckv, (float *)ckv + rec / 2, n_tok, rec / 2, rec, slots, k_cache, v_cache);
}

/* The per-head norms, then rope_kv_store: the reference for the fused GPU
 * kernel. Each token's heads are contiguous, so one rmsnorm a token. */
fl_status fl_cpu_qknorm_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                                      int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                                      const fl_tensor *q_norm, const fl_tensor *k_norm, float eps,
                                      const float *cos, const float *sin, int rot_dim, bool interleaved,
                                      const int32_t *slots, void *k_cache, void *v_cache) {
    for (int t = 0; t < n_tok; t++) {
        float *qt = (float *)q + (int64_t)t * q_stride, *kt = (float *)k + (int64_t)t * kv_stride;
        FL_TRY(fl_cpu_rmsnorm(b, qt, q_norm, eps, n_heads, head_dim, qt));
        FL_TRY(fl_cpu_rmsnorm(b, kt, k_norm, eps, n_kv_heads, head_dim, kt));
    }
    return fl_cpu_rope_kv_store(b, q, k, v, n_tok, n_heads, n_kv_heads, head_dim, q_stride, kv_stride, cos, sin,
                                rot_dim, interleaved, slots, k_cache, v_cache);
}

/* add then rmsnorm, as two passes: the reference the fused GPU kernel is
 * checked against. */
fl_status fl_cpu_add_rmsnorm(fl_backend *b, void *x, const void *y, const fl_tensor *w, float eps,
                             int n, int d, void *out) {
    if (out == x || out == y)
        return FL_ERR(FL_ERR_INVALID_ARG, "add_rmsnorm: out must not alias x or y");
    FL_TRY(check_float_weight(w, "add_rmsnorm"));
    if (fl_tensor_numel(w) != d)
        return FL_ERR(FL_ERR_INVALID_ARG, "add_rmsnorm: weight has %lld elements, rows have %d",
                      (long long)fl_tensor_numel(w), d);
    if (n <= 0) return FL_OK;
    FL_TRY(fl_cpu_add(b, x, y, (size_t)n * (size_t)d));
    return fl_cpu_rmsnorm(b, x, w, eps, n, d, out);
}

fl_status fl_cpu_moe_topk(fl_backend *b, const void *logits, int n, int n_experts, int k,
                          const fl_moe_route *r, int32_t *ids, float *weights) {
    (void)b;
    if (k < 1 || k > n_experts || n_experts > 1024)
        return FL_ERR(FL_ERR_INVALID_ARG, "moe_topk: k=%d with %d experts", k, n_experts);
    const bool grouped = fl_moe_route_grouped(r, n_experts);
    const int G = grouped ? r->n_group : 1, per = n_experts / G;
    float probs[1024];
    for (int i = 0; i < n; i++) {
        const float *l = (const float *)logits + (int64_t)i * n_experts;
        float mx = -FLT_MAX;
        for (int e = 0; e < n_experts; e++) mx = l[e] > mx ? l[e] : mx;
        double sum = 0;
        for (int e = 0; e < n_experts; e++) sum += probs[e] = expf(l[e] - mx);
        for (int e = 0; e < n_experts; e++) probs[e] = (float)(probs[e] / sum);
        if (grouped) { /* keep the topk_group groups with the largest max-prob */
            float gs[1024];
            bool keep[1024] = {false};
            for (int g = 0; g < G; g++) {
                gs[g] = -1;
                for (int e = g * per; e < (g + 1) * per; e++) gs[g] = probs[e] > gs[g] ? probs[e] : gs[g];
            }
            for (int j = 0; j < r->topk_group; j++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
                keep[best] = true;
            }
            for (int e = 0; e < n_experts; e++)
                if (!keep[e / per]) probs[e] = 0;
        }
        float wsum = 0;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < n_experts; e++)
                if (probs[e] >= 0 && (best < 0 || probs[e] > probs[best])) best = e;
            if (best < 0) { /* NaN probabilities (a diverged model): expert 0 with a NaN weight, so
                               the NaN reaches the logits instead of an out-of-range id */
                ids[(int64_t)i * k + j] = 0;
                weights[(int64_t)i * k + j] = NAN;
                wsum = NAN;
                continue;
            }
            ids[(int64_t)i * k + j] = best;
            weights[(int64_t)i * k + j] = probs[best];
            wsum += probs[best];
            probs[best] = -1; /* taken */
        }
        for (int j = 0; j < k; j++) {
            float *w = &weights[(int64_t)i * k + j];
            *w = r->renorm ? *w / wsum : *w * r->scale;
        }
    }
    return FL_OK;
}

fl_status fl_cpu_gather_rows(fl_backend *b, const void *src, const int32_t *idx, int n_idx, int d,
                             void *dst) {
    (void)b;
    for (int i = 0; i < n_idx; i++)
        memcpy((float *)dst + (int64_t)i * d, (const float *)src + (int64_t)idx[i] * d,
               (size_t)d * sizeof(float));
    return FL_OK;
}

fl_status fl_cpu_scatter_add_rows(fl_backend *b, void *dst, const void *src, const int32_t *idx,
                                  const float *scale, int n_idx, int d) {
    (void)b;
    for (int i = 0; i < n_idx; i++) {
        float *o = (float *)dst + (int64_t)idx[i] * d;
        const float *s = (const float *)src + (int64_t)i * d;
        float c = scale ? scale[i] : 1.0f;
        for (int j = 0; j < d; j++) o[j] += c * s[j];
    }
    return FL_OK;
}

fl_status fl_cpu_argmax_rows(fl_backend *b, const void *x, int n, int d, int offset, float *out) {
    (void)b;
    if (d <= 0 || offset < 0 || (int64_t)offset + d > (1 << 24))
        return FL_ERR(FL_ERR_INVALID_ARG, "argmax_rows: %d columns from %d (ids must stay below 2^24)", d,
                      offset);
    for (int i = 0; i < n; i++) {
        const float *r = (const float *)x + (int64_t)i * d;
        int best = 0;
        bool nan = false;
        for (int j = 0; j < d; j++) {
            nan |= r[j] != r[j];
            if (r[j] > r[best]) best = j;
        }
        out[2 * i] = nan ? NAN : r[best];
        out[2 * i + 1] = (float)(offset + best);
    }
    return FL_OK;
}

fl_status fl_cpu_sigmoid_scale_rows(fl_backend *b, void *x, const void *g, int n, int d) {
    (void)b;
    for (int i = 0; i < n; i++) {
        float s = 1.0f / (1.0f + expf(-((const float *)g)[i]));
        float *r = (float *)x + (int64_t)i * d;
        for (int j = 0; j < d; j++) r[j] *= s;
    }
    return FL_OK;
}
