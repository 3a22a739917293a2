/*
 * test_cpu_ops.c — every CPU backend op against a naive formulation written
 * independently here (double accumulation, explicit softmax, contiguous
 * K/V instead of paged), on awkward shapes (19 rows, 111 columns, block
 * size 4, GQA 6/2, head_dim 20).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/cpu_stream.h"
#include "kernels/cpu/cpu_vec.h"
#include "kernels/pool.h"
#include "core/option.h"
#include "core/sampler.h"

static uint64_t rng_state = 88172645463325252ull;
static float frand(void) { /* xorshift64, uniform in [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static void fill(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = frand();
}
static double max_rel_err(const float *a, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(a[i] - ref[i]);
        num = d > num ? d : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / (den > 0 ? den : 1);
}

static fl_tensor f32_tensor(float *data, int64_t rows, int64_t cols) {
    fl_tensor t = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {rows, cols}, .data = data};
    return t;
}

/* Naive reference: y = x W^T + b with W given as explicit f32 values. */
static void ref_matmul(const float *x, int n, const float *w, const float *b, int out, int in,
                       double *y) {
    for (int i = 0; i < n; i++)
        for (int r = 0; r < out; r++) {
            double s = b ? b[r] : 0;
            for (int c = 0; c < in; c++) s += (double)x[i * in + c] * w[r * in + c];
            y[i * out + r] = s;
        }
}

static void test_matmul_f32_bf16_f16(void **state) {
    (void)state;
    enum { N = 19, IN = 111, OUT = 53 };
    float *x = malloc(sizeof(float) * N * IN), *w = malloc(sizeof(float) * OUT * IN);
    float bias[OUT], *y = malloc(sizeof(float) * N * OUT);
    double *ref = malloc(sizeof(double) * N * OUT);
    uint16_t *wb = malloc(2 * OUT * IN), *wh = malloc(2 * OUT * IN);
    fill(x, N * IN);
    fill(w, OUT * IN);
    fill(bias, OUT);
    /* round w to bf16-representable values so every dtype encodes the same matrix */
    for (int i = 0; i < OUT * IN; i++) {
        uint32_t u;
        memcpy(&u, &w[i], 4);
        u &= 0xffff0000u;
        memcpy(&w[i], &u, 4);
        wb[i] = (uint16_t)(u >> 16);
        wh[i] = fl_f32_to_f16(w[i]);
    }
    fl_tensor tb = f32_tensor(bias, OUT, 1);
    tb.ndim = 1;
    tb.shape[0] = OUT;
    ref_matmul(x, N, w, bias, OUT, IN, ref);
    fl_tensor t = f32_tensor(w, OUT, IN);
    assert_int_equal(fl_cpu_matmul(NULL, x, N, &t, &tb, y), FL_OK);
    assert_true(max_rel_err(y, ref, N * OUT) < 1e-6);
    t.dtype = FL_DTYPE_BF16;
    t.data = wb;
    assert_int_equal(fl_cpu_matmul(NULL, x, N, &t, &tb, y), FL_OK);
    assert_true(max_rel_err(y, ref, N * OUT) < 1e-6);
    /* f16 has fewer exponent bits; values in [-1, 1) keep 11-bit mantissas
     * of bf16's 8, so the encoding is exact here too */
    t.dtype = FL_DTYPE_F16;
    t.data = wh;
    assert_int_equal(fl_cpu_matmul(NULL, x, N, &t, NULL, y), FL_OK);
    ref_matmul(x, N, w, NULL, OUT, IN, ref);
    assert_true(max_rel_err(y, ref, N * OUT) < 1e-6);
    free(x); free(w); free(y); free(ref); free(wb); free(wh);
}

static void test_matmul_w4(void **state) {
    (void)state;
    enum { N = 7, IN = 96, OUT = 37, G = 32 };
    uint8_t *codes = malloc(OUT * IN / 2);
    float scales[OUT * IN / G], biases[OUT * IN / G];
    float *wf = malloc(sizeof(float) * OUT * IN), *x = malloc(sizeof(float) * N * IN);
    float *y = malloc(sizeof(float) * N * OUT);
    double *ref = malloc(sizeof(double) * N * OUT);
    fill(x, N * IN);
    for (int i = 0; i < OUT * IN / G; i++) {
        scales[i] = 0.01f + fabsf(frand()) * 0.1f;
        biases[i] = frand();
    }
    for (int r = 0; r < OUT; r++)
        for (int c = 0; c < IN; c += 2) {
            int q0 = (int)((frand() + 1) * 8) & 15, q1 = (int)((frand() + 1) * 8) & 15;
            codes[(r * IN + c) / 2] = (uint8_t)(q0 | q1 << 4);
            int g = r * (IN / G) + c / G;
            wf[r * IN + c] = q0 * scales[g] + biases[g];
            wf[r * IN + c + 1] = q1 * scales[g] + biases[g];
        }
    fl_tensor t = {.dtype = FL_DTYPE_W4, .ndim = 2, .shape = {OUT, IN}, .data = codes,
                   .scales = scales, .bias = biases, .group = G};
    /* n < 4 takes the fused group-dot path, n >= 4 the expand-then-dot path */
    for (int n = 1; n <= N; n += N - 1) {
        ref_matmul(x, n, wf, NULL, OUT, IN, ref);
        assert_int_equal(fl_cpu_matmul(NULL, x, n, &t, NULL, y), FL_OK);
        assert_true(max_rel_err(y, ref, (size_t)n * OUT) < 1e-5);
    }
    free(codes); free(wf); free(x); free(y); free(ref);
}

static void test_rmsnorm_embed_silu_add(void **state) {
    (void)state;
    enum { N = 5, D = 111, V = 13 };
    float x[N * D], w[D], out[N * D], table[V * D], emb[3 * D];
    double ref[N * D];
    fill(x, N * D);
    fill(w, D);
    fill(table, V * D);
    fl_tensor tw = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {D}, .data = w};
    assert_int_equal(fl_cpu_rmsnorm(NULL, x, &tw, 1e-6f, N, D, out), FL_OK);
    for (int i = 0; i < N; i++) {
        double ss = 0;
        for (int j = 0; j < D; j++) ss += (double)x[i * D + j] * x[i * D + j];
        for (int j = 0; j < D; j++) ref[i * D + j] = w[j] * x[i * D + j] / sqrt(ss / D + 1e-6);
    }
    assert_true(max_rel_err(out, ref, N * D) < 1e-6);

    fl_tensor tt = f32_tensor(table, V, D);
    int32_t ids[3] = {12, 0, 7};
    assert_int_equal(fl_cpu_embed(NULL, &tt, ids, 3, emb), FL_OK);
    assert_memory_equal(emb + D, table, D * sizeof(float));
    assert_memory_equal(emb + 2 * D, table + 7 * D, D * sizeof(float));
    int32_t bad = V;
    assert_int_equal(fl_cpu_embed(NULL, &tt, &bad, 1, emb), FL_ERR_INVALID_ARG);

    float g[N * D], u[N * D], o[N * D];
    fill(g, N * D);
    fill(u, N * D);
    assert_int_equal(fl_cpu_silu_mul(NULL, g, u, N, D, D, o), FL_OK);
    for (int i = 0; i < N * D; i++) ref[i] = g[i] / (1 + exp(-(double)g[i])) * u[i];
    assert_true(max_rel_err(o, ref, N * D) < 1e-6);
    /* fused gate|up rows (stride 2 D) give the same as separate buffers */
    float gu[N * 2 * D], o2[N * D];
    for (int i = 0; i < N; i++) {
        memcpy(gu + i * 2 * D, g + i * D, D * sizeof(float));
        memcpy(gu + i * 2 * D + D, u + i * D, D * sizeof(float));
    }
    assert_int_equal(fl_cpu_silu_mul(NULL, gu, gu + D, N, D, 2 * D, o2), FL_OK);
    assert_memory_equal(o, o2, sizeof o);
    assert_int_equal(fl_cpu_silu_mul(NULL, gu, gu + D, N, D, D - 1, o2), FL_ERR_INVALID_ARG);
    float a[7] = {1, 2, 3, 4, 5, 6, 7}, b[7] = {7, 6, 5, 4, 3, 2, 1};
    assert_int_equal(fl_cpu_add(NULL, a, b, 7), FL_OK);
    for (int i = 0; i < 7; i++) assert_true(a[i] == 8.0f);
}

static void test_rope_both_layouts(void **state) {
    (void)state;
    enum { T = 3, H = 2, HD = 10, ROT = 6 };
    float x[T * H * HD], y[T * H * HD], c[T * ROT / 2], s[T * ROT / 2];
    fill(x, T * H * HD);
    for (int i = 0; i < T * ROT / 2; i++) {
        double ang = frand() * 3;
        c[i] = (float)cos(ang);
        s[i] = (float)sin(ang);
    }
    for (int inter = 0; inter < 2; inter++) {
        memcpy(y, x, sizeof x);
        assert_int_equal(fl_cpu_rope(NULL, y, T, H, HD, H * HD, c, s, ROT, inter), FL_OK);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                const float *a = x + (t * H + h) * HD;
                const float *b = y + (t * H + h) * HD;
                for (int i = 0; i < ROT / 2; i++) {
                    int i0 = inter ? 2 * i : i, i1 = inter ? 2 * i + 1 : i + ROT / 2;
                    /* (a0 + i a1) * (c + i s): complex rotation */
                    double re = (double)a[i0] * c[t * 3 + i] - (double)a[i1] * s[t * 3 + i];
                    double im = (double)a[i0] * s[t * 3 + i] + (double)a[i1] * c[t * 3 + i];
                    assert_true(fabs(b[i0] - re) < 1e-6 && fabs(b[i1] - im) < 1e-6);
                }
                for (int i = ROT; i < HD; i++) assert_true(a[i] == b[i]); /* not rotated */
            }
    }
}

/* Paged attention against dense attention over contiguous K/V. */
static void test_paged_attention(void **state) {
    (void)state;
    enum { NH = 6, NKV = 2, HD = 20, BS = 4, NB = 16, S = 3, MAXB = 5 };
    const int nq[S] = {5, 1, 3}, ctx[S] = {5, 17, 11};
    const int kvd = NKV * HD;
    float *kc = calloc(NB * BS * kvd, 4), *vc = calloc(NB * BS * kvd, 4);
    /* dense per-sequence K/V, written into scattered blocks */
    float kd[S][20 * NKV * HD], vd[S][20 * NKV * HD];
    int32_t bt[S * MAXB];
    const int32_t perm[NB] = {9, 3, 14, 0, 7, 12, 5, 1, 15, 10, 2, 8, 13, 4, 11, 6};
    int used = 0;
    for (int s = 0; s < S; s++) {
        for (int j = 0; j < MAXB; j++) bt[s * MAXB + j] = j * BS < ctx[s] ? perm[used++] : -1;
        fill(kd[s], ctx[s] * kvd);
        fill(vd[s], ctx[s] * kvd);
        for (int p = 0; p < ctx[s]; p++) {
            int slot = bt[s * MAXB + p / BS] * BS + p % BS;
            memcpy(kc + slot * kvd, kd[s] + p * kvd, kvd * 4);
            memcpy(vc + slot * kvd, vd[s] + p * kvd, kvd * 4);
        }
    }
    int32_t q_start[S + 1] = {0, 5, 6, 9};
    const int rows = 9;
    float q[9 * NH * HD], out[9 * NH * HD];
    double ref[9 * NH * HD];
    fill(q, rows * NH * HD);
    const float scale = 1.0f / sqrtf(HD);
    for (int s = 0; s < S; s++)
        for (int i = 0; i < nq[s]; i++) {
            int row = q_start[s] + i, pos = ctx[s] - nq[s] + i;
            for (int h = 0; h < NH; h++) {
                int kh = h / (NH / NKV);
                double sc[32], mx = -1e300, sum = 0;
                for (int t = 0; t <= pos; t++) {
                    double d = 0;
                    for (int j = 0; j < HD; j++)
                        d += (double)q[(row * NH + h) * HD + j] * kd[s][t * kvd + kh * HD + j];
                    sc[t] = d * scale;
                    mx = sc[t] > mx ? sc[t] : mx;
                }
                for (int t = 0; t <= pos; t++) sum += sc[t] = exp(sc[t] - mx);
                for (int j = 0; j < HD; j++) {
                    double o = 0;
                    for (int t = 0; t <= pos; t++) o += sc[t] / sum * vd[s][t * kvd + kh * HD + j];
                    ref[(row * NH + h) * HD + j] = o;
                }
            }
        }
    int32_t ctx_len[S] = {5, 17, 11};
    fl_attn_meta m = {.n_seqs = S, .q_start = q_start, .ctx_len = ctx_len, .block_tables = bt,
                      .max_blocks = MAXB, .block_size = BS, .max_ctx_len = 17};
    assert_int_equal(fl_cpu_attention(NULL, q, NH * HD, &m, NH, NKV, HD, scale, kc, vc, out), FL_OK);
    assert_true(max_rel_err(out, ref, rows * NH * HD) < 1e-5);
    /* the AVX2 loops (cpu_vec.h) where the CPU has them, to the same bound */
    fl_backend *b = NULL;
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, "avx2"), FL_OK);
    if (fl_backend_cpu_init(&b) == FL_OK) {
        memset(out, 0, sizeof out);
        assert_int_equal(fl_cpu_attention(b, q, NH * HD, &m, NH, NKV, HD, scale, kc, vc, out), FL_OK);
        assert_true(max_rel_err(out, ref, rows * NH * HD) < 1e-5);
        fl_backend_free(b);
    }
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, NULL), FL_OK);
    /* kv_store writes rows to the named slots */
    float k2[2 * kvd], v2[2 * kvd];
    fill(k2, 2 * kvd);
    fill(v2, 2 * kvd);
    int32_t slots[2] = {61, 2};
    assert_int_equal(fl_cpu_kv_store(NULL, k2, v2, 2, kvd, kvd, slots, kc, vc), FL_OK);
    assert_memory_equal(kc + 61 * kvd, k2, kvd * 4);
    assert_memory_equal(vc + 2 * kvd, v2 + kvd, kvd * 4);
    free(kc);
    free(vc);
}

/* Decode rows at long contexts with fewer (row, KV head) tasks than twice
 * the threads: the vector path cuts each row's positions into spans and
 * merges them (cpu_attention.c, attn_split); against the plain, unsplit
 * loops, rows of 3, 2 and 1 spans (one ends a span exactly), GQA 4:1. */
static void test_attention_split(void **state) {
    (void)state;
    enum { NH = 4, NKV = 1, HD = 64, BS = 16, S = 3, MAXB = 96 };
    const int ctx[S] = {1500, 1024, 7};
    const int kvd = NKV * HD, nblk = S * MAXB;
    float *kc = malloc(sizeof(float) * (size_t)nblk * BS * kvd), *vc = malloc(sizeof(float) * (size_t)nblk * BS * kvd);
    fill(kc, (size_t)nblk * BS * kvd);
    fill(vc, (size_t)nblk * BS * kvd);
    int32_t bt[S * MAXB];
    for (int i = 0; i < S * MAXB; i++) bt[i] = (i * 37) % nblk; /* scattered, each block once */
    int32_t q_start[S + 1] = {0, 1, 2, 3}, ctx_len[S] = {1500, 1024, 7};
    fl_attn_meta m = {.n_seqs = S, .q_start = q_start, .ctx_len = ctx_len, .block_tables = bt,
                      .max_blocks = MAXB, .block_size = BS, .max_ctx_len = ctx[0]};
    float q[S * NH * HD], ref[S * NH * HD], out[S * NH * HD];
    fill(q, S * NH * HD);
    const float scale = 1.0f / sqrtf(HD);
    assert_int_equal(fl_cpu_attention(NULL, q, NH * HD, &m, NH, NKV, HD, scale, kc, vc, ref), FL_OK);
    const int threads = fl_pool_threads();
    assert_int_equal(fl_pool_set_threads(2), FL_OK);
    fl_backend *b = NULL;
    if (fl_backend_cpu_init(&b) == FL_OK && fl_cpu_isa_has_avx2(fl_cpu_backend_isa(b))) {
        assert_int_equal(fl_cpu_attention(b, q, NH * HD, &m, NH, NKV, HD, scale, kc, vc, out), FL_OK);
        double worst = 0;
        for (int i = 0; i < S * NH * HD; i++) worst = fmax(worst, fabs((double)out[i] - ref[i]));
        double mag = 0;
        for (int i = 0; i < S * NH * HD; i++) mag = fmax(mag, fabs((double)ref[i]));
        printf("  split attention: worst %.2g of the largest output %.2g\n", worst, mag);
        assert_true(worst <= 1e-5 * mag);
    } else {
        printf("  split attention: no AVX2, skipped\n");
    }
    fl_backend_free(b);
    assert_int_equal(fl_pool_set_threads(threads), FL_OK);
    free(kc);
    free(vc);
}

/* The cache's layouts and element types (kernels/backend.h, kv_bf16 and
 * kv_block_size): K/V stored through kv_store slot by slot or head by head
 * within blocks, in f32 or bf16, then read by attention on the plain and
 * the vector loops (prefill rows, decode rows, and one decode row long
 * enough to be split over spans on 2 threads). Each must equal, bit for
 * bit, attention over the slot-by-slot f32 cache of the same values (for
 * bf16: the values rounded to bf16, which the reads widen exactly). */
static void test_attention_layouts(void **state) {
    (void)state;
    enum { NH = 6, NKV = 2, HD = 36, BS = 5, S = 3, MAXB = 240, NBLK = S * MAXB, ROWS = 6 };
    const int kvd = NKV * HD, ctx[S] = {9, 13, 1100}; /* 4, 1 and 1 query rows */
    const size_t n_slots = (size_t)NBLK * BS;
    int32_t bt[S * MAXB];
    for (int i = 0; i < S * MAXB; i++) bt[i] = (int32_t)((i * 37) % NBLK); /* scattered, each block once */
    int32_t q_start[S + 1] = {0, 4, 5, 6}, ctx_len[S] = {9, 13, 1100};
    fl_attn_meta m = {.n_seqs = S, .q_start = q_start, .ctx_len = ctx_len, .block_tables = bt,
                      .max_blocks = MAXB, .block_size = BS, .max_ctx_len = 1100, .max_q_len = 4};
    /* every position's K and V rows, and the slots they go to */
    const int n_tok = ctx[0] + ctx[1] + ctx[2];
    float *k = malloc(sizeof(float) * (size_t)n_tok * kvd), *v = malloc(sizeof(float) * (size_t)n_tok * kvd);
    float *kr = malloc(sizeof(float) * (size_t)n_tok * kvd), *vr = malloc(sizeof(float) * (size_t)n_tok * kvd);
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)n_tok);
    fill(k, (size_t)n_tok * kvd);
    fill(v, (size_t)n_tok * kvd);
    for (size_t i = 0; i < (size_t)n_tok * kvd; i++) kr[i] = fl_bf16_to_f32(fl_f32_to_bf16(k[i])),
                                                     vr[i] = fl_bf16_to_f32(fl_f32_to_bf16(v[i]));
    for (int s = 0, t = 0; s < S; s++)
        for (int p = 0; p < ctx[s]; p++, t++) slots[t] = bt[s * MAXB + p / BS] * BS + p % BS;
    float q[ROWS * NH * HD], want[2][ROWS * NH * HD], got[ROWS * NH * HD];
    fill(q, ROWS * NH * HD);
    const float scale = 1.0f / sqrtf(HD);
    float *kc = calloc(n_slots * kvd, sizeof(float)), *vc = calloc(n_slots * kvd, sizeof(float));
    const int threads = fl_pool_threads();
    assert_int_equal(fl_pool_set_threads(2), FL_OK);
    static const char *isas[] = {"c", "avx2"};
    for (int ii = 0; ii < 2; ii++) {
        fl_backend *b = NULL;
        assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, isas[ii]), FL_OK);
        if (fl_backend_cpu_init(&b) != FL_OK) { /* no AVX2 here */
            printf("  attention layouts: no %s kernels, skipped\n", isas[ii]);
            continue;
        }
        /* the references: slot by slot, f32, exact values and bf16-rounded ones */
        for (int r = 0; r < 2; r++) {
            assert_int_equal(fl_cpu_kv_store(b, r ? kr : k, r ? vr : v, n_tok, kvd, kvd, slots, kc, vc), FL_OK);
            assert_int_equal(fl_cpu_attention(b, q, NH * HD, &m, NH, NKV, HD, scale, kc, vc, want[r]), FL_OK);
        }
        for (int bf = 0; bf < 2; bf++)
            for (int blocked = 0; blocked < 2; blocked++) {
                if (!bf && !blocked) continue; /* the reference itself */
                b->kv_bf16 = bf;
                b->kv_block_size = blocked ? BS : 0;
                b->kv_head_dim = blocked ? HD : 0;
                memset(kc, 0xff, n_slots * kvd * sizeof(float)); /* NaNs wherever the store did not write */
                memset(vc, 0xff, n_slots * kvd * sizeof(float));
                assert_int_equal(fl_cpu_kv_store(b, k, v, n_tok, kvd, kvd, slots, kc, vc), FL_OK);
                memset(got, 0, sizeof got);
                assert_int_equal(fl_cpu_attention(b, q, NH * HD, &m, NH, NKV, HD, scale, kc, vc, got), FL_OK);
                assert_memory_equal(got, want[bf], sizeof got);
                if (blocked) { /* a cache of another geometry is refused, not misread */
                    m.block_size = BS + 1;
                    assert_int_equal(fl_cpu_attention(b, q, NH * HD, &m, NH, NKV, HD, scale, kc, vc, got),
                                     FL_ERR_INVALID_ARG);
                    m.block_size = BS;
                }
            }
        b->kv_bf16 = false;
        b->kv_block_size = b->kv_head_dim = 0;
        fl_backend_free(b);
    }
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, NULL), FL_OK);
    assert_int_equal(fl_pool_set_threads(threads), FL_OK);
    free(kc), free(vc), free(k), free(v), free(kr), free(vr), free(slots);
}

static void test_moe_ops(void **state) {
    (void)state;
    enum { N = 4, E = 7, K = 3, D = 5 };
    float logits[N * E], w[N * K];
    int32_t ids[N * K];
    fill(logits, N * E);
    for (int renorm = 0; renorm < 2; renorm++) {
        const fl_moe_route r = {1, 1, renorm, 1.0f};
        assert_int_equal(fl_cpu_moe_topk(NULL, logits, N, E, K, &r, ids, w), FL_OK);
        for (int i = 0; i < N; i++) {
            double z = 0, p[E];
            for (int e = 0; e < E; e++) z += p[e] = exp(logits[i * E + e]);
            double picked = 0;
            for (int j = 0; j < K; j++) {
                int e = ids[i * K + j];
                picked += p[e] / z;
                /* exactly j experts have a larger probability */
                int larger = 0;
                for (int f = 0; f < E; f++) larger += p[f] > p[e];
                assert_int_equal(larger, j);
            }
            for (int j = 0; j < K; j++) {
                double want = p[ids[i * K + j]] / z / (renorm ? picked : 1.0);
                assert_true(fabs(w[i * K + j] - want) < 1e-6);
            }
        }
    }
    /* a NaN router row (a diverged model): ids stay in range, weights NaN */
    {
        float ln[E];
        for (int e = 0; e < E; e++) ln[e] = NAN;
        int32_t in_[K];
        float wn[K];
        const fl_moe_route r = {1, 1, true, 1.0f};
        assert_int_equal(fl_cpu_moe_topk(NULL, ln, 1, E, K, &r, in_, wn), FL_OK);
        for (int j = 0; j < K; j++) {
            assert_true(in_[j] >= 0 && in_[j] < E);
            assert_true(isnan(wn[j]));
        }
    }
    /* group-limited (DeepSeek-V2): 12 experts in 4 groups, the 2 groups with
     * the largest max-prob compete, top 3 of them, weights scaled by 2.5 */
    {
        enum { EG = 12, G = 4, TG = 2 };
        float lg[N * EG], wg[N * 3];
        int32_t ig[N * 3];
        fill(lg, N * EG);
        const fl_moe_route r = {G, TG, false, 2.5f};
        assert_int_equal(fl_cpu_moe_topk(NULL, lg, N, EG, 3, &r, ig, wg), FL_OK);
        for (int i = 0; i < N; i++) {
            double z = 0, p[EG], gm[G] = {0};
            for (int e = 0; e < EG; e++) z += p[e] = exp(lg[i * EG + e]);
            for (int e = 0; e < EG; e++) gm[e / (EG / G)] = fmax(gm[e / (EG / G)], p[e]);
            for (int j = 0; j < 3; j++) {
                const int e = ig[i * 3 + j], ge = e / (EG / G);
                int better_groups = 0, larger = 0;
                for (int g2 = 0; g2 < G; g2++) better_groups += gm[g2] > gm[ge];
                assert_true(better_groups < TG); /* its group is kept */
                for (int f = 0; f < EG; f++) {
                    int gf = f / (EG / G), gb = 0;
                    for (int g2 = 0; g2 < G; g2++) gb += gm[g2] > gm[gf];
                    larger += gb < TG && p[f] > p[e];
                }
                assert_int_equal(larger, j); /* j kept experts beat it */
                assert_true(fabs(wg[i * 3 + j] - 2.5 * p[e] / z) < 1e-6);
            }
        }
    }
    float src[N * D], dst[3 * D], acc[N * D] = {0}, g[N];
    fill(src, N * D);
    int32_t idx[3] = {3, 0, 2};
    assert_int_equal(fl_cpu_gather_rows(NULL, src, idx, 3, D, dst), FL_OK);
    assert_memory_equal(dst, src + 3 * D, D * 4);
    float sc[3] = {0.5f, 2.0f, -1.0f};
    assert_int_equal(fl_cpu_scatter_add_rows(NULL, acc, dst, idx, sc, 3, D), FL_OK);
    for (int j = 0; j < D; j++) {
        assert_true(fabsf(acc[3 * D + j] - 0.5f * src[3 * D + j]) < 1e-7f);
        assert_true(acc[1 * D + j] == 0.0f);
    }
    fill(g, N);
    memcpy(acc, src, sizeof src);
    assert_int_equal(fl_cpu_sigmoid_scale_rows(NULL, acc, g, N, D), FL_OK);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < D; j++)
            assert_true(fabs(acc[i * D + j] - src[i * D + j] / (1 + exp(-(double)g[i]))) < 1e-6);
}

/* argmax_rows: the lowest index among equal maxima (torch.argmax), the
 * shard offset added, a NaN anywhere reported as a NaN value, a row of -inf
 * giving its first id; ids beyond 2^24 refused. */
/* The device-routed expert ops (cpu_moe.c) against naive loops: 5 tokens,
 * top 2 of 6 experts, this rank holding experts 2..4 (pairs of experts 0, 1
 * and 5 belong to other ranks). */
static void test_moe_routed_ops(void **state) {
    (void)state;
    enum { N = 5, K = 2, E = 6, LO = 2, NL = 3, IN = 8, OUT = 4, P = N * K };
    static const int32_t ids[P] = {2, 0, 4, 3, 5, 1, 3, 2, 0, 5};
    const float w[P] = {0.7f, 0.3f, 0.6f, 0.4f, 0.9f, 0.1f, 0.5f, 0.5f, 0.2f, 0.8f};
    int32_t list[NL + 1 + P];
    assert_int_equal(fl_cpu_moe_group(NULL, ids, N, K, LO, NL, list), FL_OK);
    /* expert 2: pairs 0, 7; expert 3: pairs 3, 6; expert 4: pair 2 */
    static const int32_t want[NL + 1 + 5] = {0, 2, 4, 5, 0, 7, 3, 6, 2};
    assert_memory_equal(list, want, sizeof want);
    /* weights of the 3 local experts; x per token */
    float wt[NL][OUT * IN], x[N * IN], y[P * OUT];
    fl_tensor tab[NL];
    for (int j = 0; j < NL; j++) {
        fill(wt[j], OUT * IN);
        fl_tensor t = {.dtype = FL_DTYPE_F32, .ndim = 2, .shape = {OUT, IN}, .data = wt[j]};
        tab[j] = t;
    }
    fill(x, N * IN);
    for (int i = 0; i < P * OUT; i++) y[i] = 12345.0f; /* rows not routed here stay */
    assert_int_equal(fl_cpu_moe_matmul(NULL, x, 0, N, K, list, NL, tab, &tab[0], y), FL_OK);
    for (int p = 0; p < P; p++) {
        const int j = ids[p] - LO;
        for (int r = 0; r < OUT; r++) {
            if (j < 0 || j >= NL) {
                assert_true(y[p * OUT + r] == 12345.0f);
                continue;
            }
            double s = 0;
            for (int c = 0; c < IN; c++) s += (double)wt[j][r * IN + c] * x[(p / K) * IN + c];
            assert_true(fabs(y[p * OUT + r] - s) < 1e-5);
        }
    }
    /* combine: a token's local pairs in ascending expert order, from zero */
    float acc[N * OUT];
    for (int i = 0; i < N * OUT; i++) acc[i] = -7.0f; /* overwritten */
    assert_int_equal(fl_cpu_moe_combine(NULL, acc, y, ids, w, N, K, LO, NL, OUT), FL_OK);
    for (int i = 0; i < N; i++)
        for (int r = 0; r < OUT; r++) {
            float s = 0;
            int order[K], m = 0;
            for (int j = 0; j < K; j++)
                if (ids[i * K + j] >= LO && ids[i * K + j] < LO + NL) order[m++] = j;
            if (m == 2 && ids[i * K + order[0]] > ids[i * K + order[1]]) {
                int t = order[0];
                order[0] = order[1];
                order[1] = t;
            }
            for (int a = 0; a < m; a++) s += w[i * K + order[a]] * y[(i * K + order[a]) * OUT + r];
            assert_true(acc[i * OUT + r] == s); /* the same adds in the same order: exact */
        }
    /* token 4 has no local expert: zeros */
    for (int r = 0; r < OUT; r++) assert_true(acc[4 * OUT + r] == 0.0f);
    /* bad arguments are refused, not crashed on */
    assert_int_equal(fl_cpu_moe_group(NULL, ids, N, K, LO, 0, list), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_cpu_moe_combine(NULL, acc, y, ids, w, N, 65, LO, NL, OUT), FL_ERR_INVALID_ARG);
    fl_tensor bad = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {4}};
    assert_int_equal(fl_cpu_moe_matmul(NULL, x, 0, N, K, list, NL, tab, &bad, y), FL_ERR_INVALID_ARG);
    assert_int_equal(fl_cpu_moe_matmul(NULL, NULL, 0, 0, K, NULL, NL, NULL, &tab[0], NULL), FL_OK); /* probe */
}

static void test_argmax_rows(void **state) {
    (void)state;
    fl_backend *b;
    assert_int_equal(fl_backend_cpu_init(&b), FL_OK);
    enum { D = 9 };
    float x[4][D] = {
        {0, 1, 5, -2, 5, 0, 0, 5, 1},
        {-3, -2, -1, -4, -5, -6, -7, -8, -1.5f},
        {0, 1, 2, 3, NAN, 5, 6, 7, 8},
        {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
         -INFINITY},
    };
    float out[8];
    assert_int_equal(b->ops->argmax_rows(b, x, 4, D, 1000, out), FL_OK);
    assert_true(out[0] == 5 && out[1] == 1002);
    assert_true(out[2] == -1 && out[3] == 1002);
    assert_true(isnan(out[4]));
    assert_true(out[6] == -INFINITY && out[7] == 1000);
    assert_int_equal(b->ops->argmax_rows(b, x, 1, D, (1 << 24) - 4, out), FL_ERR_INVALID_ARG);
    fl_backend_free(b);
}

/* sample_rows on the CPU: fl_sampler_sample_u's token for each row, and
 * status words where the sampler would fail: the first NaN, and every
 * logit -inf after the penalty (a finite logit the penalty takes to -inf
 * counts). */
static void test_sample_rows(void **state) {
    (void)state;
    enum { D = 8 };
    float x[3 * D];
    for (int j = 0; j < D; j++) x[j] = (float)j * 0.5f - 1.0f, x[D + j] = x[j], x[2 * D + j] = -INFINITY;
    x[D + 6] = NAN, x[D + 3] = NAN;
    x[2 * D + 5] = -3e38f;
    const int32_t hist[1] = {5};
    fl_sample_row rows[3];
    for (int i = 0; i < 3; i++)
        rows[i] = (fl_sample_row){.u = 0.7, .temperature = 1.0f, .top_p = 0.9f, .penalty = 2.0f, .hist_n = 1};
    void *ws = malloc(fl_cpu_sample_rows_ws(NULL, 3, D));
    assert_non_null(ws);
    int32_t out[6];
    assert_int_equal(fl_cpu_sample_rows(NULL, x, 3, D, rows, hist, true, ws, out), FL_OK);
    /* row 0 by the sampler's contract (core/sampler.h), written out here
     * rather than by calling the sampler the op is built on: the penalty
     * halves the positive logit of token 5, softmax, top-p 0.9 keeps the
     * most probable tokens while the mass above each is < 0.9, then the
     * survivors renormalized and walked in id order to the draw 0.7 */
    double l[D], p[D], sum = 0;
    int order[D];
    for (int j = 0; j < D; j++) l[j] = j == 5 ? x[j] / 2.0 : x[j], order[j] = j;
    for (int j = 0; j < D; j++) sum += (p[j] = exp(l[j]));
    for (int j = 0; j < D; j++) p[j] /= sum;
    for (int i = 1; i < D; i++) /* descending probability */
        for (int j = i; j > 0 && p[order[j]] > p[order[j - 1]]; j--) {
            const int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    bool keep[D] = {false};
    double above = 0, kept = 0;
    for (int i = 0; i < D && (i == 0 || above < 0.9); i++) keep[order[i]] = true, above += p[order[i]];
    for (int j = 0; j < D; j++) kept += keep[j] ? p[j] : 0;
    int tok = -1;
    double cum = 0;
    for (int j = 0; j < D && tok < 0; j++)
        if (keep[j] && 0.7 < (cum += p[j] / kept)) tok = j;
    assert_int_equal(tok, 7); /* survivors 3..7; the draw lands in the last */
    assert_int_equal(out[0], tok);
    assert_int_equal(out[1], 0);
    assert_int_equal(out[2], 3); /* the first NaN */
    assert_int_equal(out[3], 1);
    assert_int_equal(out[5], 2); /* -3e38 * 2 = -inf: nothing to sample */
    free(ws);
}


/* --- SIMD matmuls (cpu_qdot.h) against the C reference ------------------ */

/* A W4 or Q8_0 weight [out, in] of random codes, and its values as f32. */
typedef struct qweight {
    fl_tensor t;
    float *wf;
} qweight;

static qweight make_qweight(fl_dtype dt, int out, int in, int G) {
    qweight q = {.wf = malloc(sizeof(float) * out * in)};
    q.t = (fl_tensor){.dtype = dt, .ndim = 2, .shape = {out, in}, .group = dt == FL_DTYPE_W4 ? G : 0};
    if (dt == FL_DTYPE_W4) {
        uint8_t *codes = malloc((size_t)out * in / 2);
        q.t.scales = malloc(sizeof(float) * out * (in / G));
        q.t.bias = malloc(sizeof(float) * out * (in / G));
        for (int i = 0; i < out * (in / G); i++) {
            /* centred like real checkpoints (Q4_1's m, AWQ's -z * s): codes around 8 */
            q.t.scales[i] = 0.01f + fabsf(frand()) * 0.1f;
            q.t.bias[i] = -q.t.scales[i] * (7.5f + frand());
        }
        for (int r = 0; r < out; r++)
            for (int c = 0; c < in; c += 2) {
                int q0 = (int)((frand() + 1) * 8) & 15, q1 = (int)((frand() + 1) * 8) & 15;
                codes[((size_t)r * in + c) / 2] = (uint8_t)(q0 | q1 << 4);
                int g = r * (in / G) + c / G;
                q.wf[r * in + c] = q0 * q.t.scales[g] + q.t.bias[g];
                q.wf[r * in + c + 1] = q1 * q.t.scales[g] + q.t.bias[g];
            }
        q.t.data = codes;
    } else { /* Q8_0: blocks of f16 d, int8 q[32]; -128 included on purpose */
        uint8_t *blocks = malloc((size_t)out * (in / 32) * 34);
        for (int r = 0; r < out; r++)
            for (int k = 0; k < in / 32; k++) {
                uint8_t *b = blocks + ((size_t)r * (in / 32) + k) * 34;
                uint16_t h = fl_f32_to_f16(0.001f + fabsf(frand()) * 0.02f);
                memcpy(b, &h, 2);
                for (int j = 0; j < 32; j++) {
                    int8_t v = j == 5 ? -128 : (int8_t)lrintf(frand() * 127);
                    b[2 + j] = (uint8_t)v;
                    q.wf[r * in + k * 32 + j] = fl_f16_to_f32(h) * v;
                }
            }
        q.t.data = blocks;
    }
    return q;
}

static void free_qweight(qweight *q) {
    free(q->t.data);
    free(q->t.scales);
    free(q->t.bias);
    free(q->wf);
}

/* The bound of cpu_qdot.h for output (t, r): each x moved by at most
 * amax(block) / 65534, plus f32 rounding of the sums (1e-5 of sum |w x|). */
static double qdot_bound(const float *x, const float *w, const float *bias, int r, int in) {
    double moved = 0, mag = bias ? fabs(bias[r]) : 0;
    for (int k = 0; k < in / 32; k++) {
        double amax = 0, wabs = 0;
        for (int j = k * 32; j < k * 32 + 32; j++) {
            amax = fmax(amax, fabs(x[j]));
            wabs += fabs(w[(size_t)r * in + j]);
            mag += fabs((double)x[j] * w[(size_t)r * in + j]);
        }
        moved += amax / 65534 * wabs;
    }
    return moved + 1e-5 * mag;
}

/* Every SIMD kernel set this CPU runs, on awkward shapes: rows 1, 2, 3, 17 (pairs and a lone last row);
 * input widths of one block, three blocks and 4096 + one group; groups of
 * 32, 64 and 128; 1 to 9 tokens (tiles of 4 and their remainders). Each
 * output must sit within the bound of its activation rounding. */
static void test_qmatmul_vs_reference(void **state) {
    (void)state;
    static const struct { fl_dtype dt; int group, in; } KINDS[] = {
        {FL_DTYPE_W4, 32, 32},   {FL_DTYPE_W4, 32, 96},    {FL_DTYPE_W4, 32, 4096 + 32},
        {FL_DTYPE_W4, 64, 128},  {FL_DTYPE_W4, 64, 4096 + 64}, {FL_DTYPE_W4, 128, 384},
        {FL_DTYPE_W4, 128, 4096 + 128}, {FL_DTYPE_Q8_0, 0, 32}, {FL_DTYPE_Q8_0, 0, 96},
        {FL_DTYPE_Q8_0, 0, 4096 + 32},
        /* whole block pairs: what the AVX-512 kernels take (odd counts run AVX2) */
        {FL_DTYPE_W4, 32, 64},   {FL_DTYPE_W4, 32, 4096 + 64}, {FL_DTYPE_Q8_0, 0, 64}, {FL_DTYPE_Q8_0, 0, 4096 + 64},
    };
    static const int ROWS[] = {1, 2, 3, 17}, TOKENS[] = {1, 3, 4, 9};
    static const char *const ISAS[] = {"avx2", "avx512"};
    for (size_t ii = 0; ii < sizeof ISAS / sizeof *ISAS; ii++) {
        fl_cpu_isa isa;
        assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, ISAS[ii]), FL_OK);
        if (fl_cpu_isa_choose(&isa) != FL_OK) {
            printf("  %s: not on this CPU, skipped\n", ISAS[ii]);
            continue;
        }
        int cases = 0;
        double worst_frac = 0; /* largest error as a fraction of its bound */
        for (size_t ki = 0; ki < sizeof KINDS / sizeof *KINDS; ki++)
            for (size_t ri = 0; ri < sizeof ROWS / sizeof *ROWS; ri++) {
                const int in = KINDS[ki].in, out = ROWS[ri], N = 9;
                qweight q = make_qweight(KINDS[ki].dt, out, in, KINDS[ki].group);
                assert_true(fl_cpu_qmatmul_supported(isa, &q.t));
                float *x = malloc(sizeof(float) * N * in), *bias = malloc(sizeof(float) * out);
                float *y = malloc(sizeof(float) * N * out), *yref = malloc(sizeof(float) * N * out);
                fill(x, (size_t)N * in);
                fill(bias, out);
                memset(x, 0, 32 * sizeof(float)); /* an all-zero block: scale 0 */
                for (int i = 1; i < N * in; i += 97) x[i] *= 40; /* outliers */
                fl_tensor tb = f32_tensor(bias, 1, out);
                tb.ndim = 1;
                tb.shape[0] = out;
                for (size_t ti = 0; ti < sizeof TOKENS / sizeof *TOKENS; ti++) {
                    const int n = TOKENS[ti];
                    assert_int_equal(fl_cpu_matmul(NULL, x, n, &q.t, &tb, yref), FL_OK);
                    assert_int_equal(fl_cpu_qmatmul(isa, x, n, &q.t, bias, y), FL_OK);
                    for (int t = 0; t < n; t++)
                        for (int r = 0; r < out; r++) {
                            const double err = fabs((double)y[t * out + r] - yref[t * out + r]);
                            const double bound = qdot_bound(x + (size_t)t * in, q.wf, bias, r, in);
                            if (!(err <= bound))
                                fail_msg("%s %s g%d [%d, %d] n %d: y[%d, %d] = %.7g, reference %.7g, "
                                         "error %.3g > bound %.3g", ISAS[ii], fl_dtype_name(KINDS[ki].dt),
                                         KINDS[ki].group, out, in, n, t, r, y[t * out + r], yref[t * out + r],
                                         err, bound);
                            worst_frac = fmax(worst_frac, err / bound);
                        }
                    cases++;
                }
                free(x); free(bias); free(y); free(yref);
                free_qweight(&q);
            }
        printf("  %s: %d cases within the int16 rounding bound (worst at %.0f %% of it)\n", ISAS[ii], cases,
               100 * worst_frac);
        /* the bound is not vacuous: the rounding shows, inside it */
        assert_true(worst_frac > 1e-3);
    }
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, NULL), FL_OK);
}

/* The AVX2 attention loops against float64 on every width class (under
 * one vector, one, one plus a tail, the 32-wide body with and without tails,
 * a 64-value head) and block of positions (under, at and over the 4 the
 * scores take together). Sums reorder and fuse: within f32 rounding of
 * sum |a b|, never bit for bit. */
static void test_vec_vs_plain(void **state) {
    (void)state;
    fl_cpu_isa isa;
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, "avx2"), FL_OK);
    const bool avx2 = fl_cpu_isa_choose(&isa) == FL_OK;
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, NULL), FL_OK);
    if (!avx2) {
        printf("  avx2: not on this CPU, skipped\n");
        return;
    }
    static const int NS[] = {1, 7, 8, 15, 16, 20, 40, 64, 72, 129};
    static const int NBS[] = {1, 3, 4, 5, 9};
    enum { MAXN = 129, MAXB = 9 };
    float q[MAXN], kv[MAXB][MAXN], acc[MAXN], acc0[MAXN], p[MAXB], sc[MAXB];
    const float *rows[MAXB];
    fill(q, MAXN);
    fill(acc0, MAXN);
    for (int i = 0; i < MAXB; i++) {
        fill(kv[i], MAXN);
        rows[i] = kv[i];
        p[i] = 0.1f * (float)(i + 1);
    }
    for (size_t ni = 0; ni < sizeof NS / sizeof *NS; ni++)
        for (size_t bi = 0; bi < sizeof NBS / sizeof *NBS; bi++) {
            const int n = NS[ni], nb = NBS[bi];
            fl_cpu_vec_scores(q, rows, nb, n, 0.5f, sc);
            for (int i = 0; i < nb; i++) {
                double d = 0, mag = 0;
                for (int j = 0; j < n; j++) d += (double)q[j] * kv[i][j], mag += fabs((double)q[j] * kv[i][j]);
                assert_true(fabs(sc[i] - 0.5 * d) <= 1e-6 * mag);
            }
            memcpy(acc, acc0, sizeof acc);
            fl_cpu_vec_acc(acc, 0.75f, p, rows, nb, n);
            for (int j = 0; j < n; j++) {
                double ref = (double)acc0[j] * 0.75, mag = fabs(ref);
                for (int i = 0; i < nb; i++) ref += (double)p[i] * kv[i][j], mag += fabs((double)p[i] * kv[i][j]);
                assert_true(fabs(acc[j] - ref) <= 1e-6 * mag);
            }
            for (int j = n; j < MAXN; j++) assert_true(acc[j] == acc0[j]); /* nothing past n */
        }
    /* the block's weights exp(s - max): within 2 ulp of exp over the range a
     * softmax meets, 0 where expf is subnormal or 0, and their sum */
    enum { NE = 203 };
    float e[NE];
    for (int i = 0; i < NE; i++) e[i] = 3.0f - 0.5f * (float)i; /* 3 .. -98 */
    const float sum = fl_cpu_vec_exp_sub(e, NE, 3.0f);
    double ref_sum = 0;
    for (int i = 0; i < NE; i++) {
        const double ref = exp(-0.5 * i);
        ref_sum += ref;
        if (-0.5 * i > -87.0)
            assert_true(fabs(e[i] - ref) <= 2.4e-7 * ref);
        else
            assert_true(e[i] >= 0 && e[i] <= 1e-37);
    }
    assert_true(fabs(sum - ref_sum) <= 1e-6 * ref_sum);
}

/* The backend takes its kernels from FL_CPU_KERNELS once, at init: c pins
 * the reference; avx2 (where the CPU has it) says so for --verbose; a W4
 * group that is not whole 32-value blocks falls back to the reference,
 * bit for bit. */
static void test_cpu_kernels_dispatch(void **state) {
    (void)state;
    fl_backend *b = NULL;
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, "c"), FL_OK);
    assert_int_equal(fl_backend_cpu_init(&b), FL_OK);
    assert_int_equal(fl_cpu_backend_isa(b), FL_CPU_ISA_C);
    assert_non_null(strstr(b->detail, "matmul kernels c"));
    fl_backend_free(b);
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, "avx2"), FL_OK);
    fl_status st = fl_backend_cpu_init(&b);
    if (st == FL_OK) {
        assert_int_equal(fl_cpu_backend_isa(b), FL_CPU_ISA_AVX2);
        assert_non_null(strstr(b->detail, "avx2"));
        qweight q = make_qweight(FL_DTYPE_W4, 5, 96, 48);
        assert_false(fl_cpu_qmatmul_supported(FL_CPU_ISA_AVX2, &q.t));
        float x[2 * 96], y[2 * 5], yref[2 * 5];
        fill(x, 2 * 96);
        assert_int_equal(fl_cpu_matmul(b, x, 2, &q.t, NULL, y), FL_OK);
        assert_int_equal(fl_cpu_matmul(NULL, x, 2, &q.t, NULL, yref), FL_OK);
        assert_memory_equal(y, yref, sizeof y);
        free_qweight(&q);
        fl_backend_free(b);
    } else {
        assert_int_equal(st, FL_ERR_UNSUPPORTED); /* asked for what the CPU lacks: said, not ignored */
    }
    assert_int_equal(fl_opt_override(FL_OPT_CPU_KERNELS, NULL), FL_OK);
}

/* The STREAM-like ceiling flotilla bench divides by: both bandwidths
 * measured (positive, finite), on the threads asked for, a small size
 * raised to the 1 MiB floor, and a NULL result refused. */
static void test_stream_measure(void **state) {
    (void)state;
    fl_cpu_stream_result r;
    assert_int_equal(fl_cpu_stream_measure(8 << 20, 2, 2, &r), FL_OK);
    assert_int_equal(r.threads, 2);
    assert_true(r.copy_Bps > 1e6 && isfinite(r.copy_Bps));
    assert_true(r.read_Bps > 1e6 && isfinite(r.read_Bps));
    assert_int_equal(fl_cpu_stream_measure(100, 1, 0, &r), FL_OK);
    assert_int_equal(r.threads, 1);
    assert_true(r.copy_Bps > 0 && r.read_Bps > 0);
    assert_int_equal(fl_cpu_stream_measure(1 << 20, 1, 1, NULL), FL_ERR_INVALID_ARG);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_measure),
        cmocka_unit_test(test_matmul_f32_bf16_f16),
        cmocka_unit_test(test_matmul_w4),
        cmocka_unit_test(test_qmatmul_vs_reference),
        cmocka_unit_test(test_cpu_kernels_dispatch),
        cmocka_unit_test(test_vec_vs_plain),
        cmocka_unit_test(test_rmsnorm_embed_silu_add),
        cmocka_unit_test(test_rope_both_layouts),
        cmocka_unit_test(test_paged_attention),
        cmocka_unit_test(test_attention_split),
        cmocka_unit_test(test_attention_layouts),
        cmocka_unit_test(test_moe_ops),
        cmocka_unit_test(test_moe_routed_ops),
        cmocka_unit_test(test_argmax_rows),
        cmocka_unit_test(test_sample_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
