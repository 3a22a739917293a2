/*
 * cpu_vec.c — AVX2 attention loops (contracts in cpu_vec.h). Each function
 * carries its own target attribute, as in cpu_qdot.c, so the file builds
 * for baseline x86-64; elsewhere they are the plain loops.
 */
#include <math.h>

#include "kernels/cpu/cpu_vec.h"

#include "core/tensor.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 cache values as f32: as stored, or bf16 widened (the 16 bits become
 * the top half of an f32, exact). */
AVX2 static inline __m256 ld8_f32(const float *p) { return _mm256_loadu_ps(p); }
AVX2 static inline __m256 ld8_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline float ld1_f32(const float *p) { return *p; }
static inline float ld1_bf16(const uint16_t *p) { return fl_bf16_to_f32(*p); }

/* Scores: q . k[i] for 4 cached positions at once: four running sums,
 * reduced together by three horizontal adds (one hsum a position cost as
 * much as its 64-value dot). Acc: 32 values of acc at a time stay in
 * registers across the block's positions: one load and one fma per 8
 * values a position. T is the cache's element type, LD8 / LD1 its loads. */
#define VEC_KV_FNS(SFX, T, LD8, LD1)                                                                            \
    AVX2 void fl_cpu_vec_scores##SFX(const float *q, const T *const *k, int nb, int n, float scale, float *sc) { \
        const int n8 = n & ~7;                                                                                 \
        int i = 0;                                                                                             \
        for (; i + 4 <= nb; i += 4) {                                                                          \
            __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                                        \
            for (int j = 0; j < n8; j += 8) {                                                                  \
                const __m256 qv = _mm256_loadu_ps(q + j);                                                      \
                s0 = _mm256_fmadd_ps(qv, LD8(k[i] + j), s0);                                                   \
                s1 = _mm256_fmadd_ps(qv, LD8(k[i + 1] + j), s1);                                               \
                s2 = _mm256_fmadd_ps(qv, LD8(k[i + 2] + j), s2);                                               \
                s3 = _mm256_fmadd_ps(qv, LD8(k[i + 3] + j), s3);                                               \
            }                                                                                                  \
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));                   \
            __m128 d = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));                     \
            float t[4];                                                                                        \
            _mm_storeu_ps(t, d);                                                                               \
            for (int u = 0; u < 4; u++) {                                                                      \
                for (int j = n8; j < n; j++) t[u] += q[j] * LD1(k[i + u] + j);                                 \
                sc[i + u] = t[u] * scale;                                                                      \
            }                                                                                                  \
        }                                                                                                      \
        for (; i < nb; i++) {                                                                                  \
            __m256 s0 = _mm256_setzero_ps();                                                                   \
            for (int j = 0; j < n8; j += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), LD8(k[i] + j), s0);   \
            float t = hsum(s0);                                                                                \
            for (int j = n8; j < n; j++) t += q[j] * LD1(k[i] + j);                                            \
            sc[i] = t * scale;                                                                                 \
        }                                                                                                      \
    }                                                                                                          \
    AVX2 void fl_cpu_vec_acc##SFX(float *acc, float c, const float *p, const T *const *v, int nb, int n) {    \
        const __m256 vc = _mm256_set1_ps(c);                                                                   \
        int j = 0;                                                                                             \
        for (; j + 32 <= n; j += 32) {                                                                         \
            __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + j), vc);                                           \
            __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + j + 8), vc);                                       \
            __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + j + 16), vc);                                      \
            __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + j + 24), vc);                                      \
            for (int i = 0; i < nb; i++) {                                                                     \
                const __m256 pi = _mm256_set1_ps(p[i]);                                                        \
                const T *vi = v[i] + j;                                                                        \
                a0 = _mm256_fmadd_ps(pi, LD8(vi), a0);                                                         \
                a1 = _mm256_fmadd_ps(pi, LD8(vi + 8), a1);                                                     \
                a2 = _mm256_fmadd_ps(pi, LD8(vi + 16), a2);                                                    \
                a3 = _mm256_fmadd_ps(pi, LD8(vi + 24), a3);                                                    \
            }                                                                                                  \
            _mm256_storeu_ps(acc + j, a0);                                                                     \
            _mm256_storeu_ps(acc + j + 8, a1);                                                                 \
            _mm256_storeu_ps(acc + j + 16, a2);                                                                \
            _mm256_storeu_ps(acc + j + 24, a3);                                                                \
        }                                                                                                      \
        for (; j + 8 <= n; j += 8) {                                                                           \
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + j), vc);                                            \
            for (int i = 0; i < nb; i++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), LD8(v[i] + j), a);          \
            _mm256_storeu_ps(acc + j, a);                                                                      \
        }                                                                                                      \
        for (; j < n; j++) {                                                                                   \
            float a = acc[j] * c;                                                                              \
            for (int i = 0; i < nb; i++) a += p[i] * LD1(v[i] + j);                                            \
            acc[j] = a;                                                                                        \
        }                                                                                                      \
    }

VEC_KV_FNS(, float, ld8_f32, ld1_f32)
VEC_KV_FNS(_bf16, uint16_t, ld8_bf16, ld1_bf16)

/* exp(x) for x <= 0, 8 at a time: Cephes' expf (x = n ln 2 + r, a degree-5
 * polynomial in r, times 2^n), within 2 ulp of expf; below -87.3 it gives 0
 * (expf's results there are subnormal or 0). */
AVX2 static __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

AVX2 float fl_cpu_vec_exp_sub(float *p, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
        _mm256_storeu_ps(p + i, e);
        s = _mm256_add_ps(s, e);
    }
    float t = hsum(s);
    for (; i < n; i++) {
        p[i] = expf(p[i] - m);
        t += p[i];
    }
    return t;
}

#else /* no x86: the plain loops (never chosen: fl_cpu_isa_choose says c) */

#define VEC_KV_FNS(SFX, T, LD1)                                                                                 \
    void fl_cpu_vec_scores##SFX(const float *q, const T *const *k, int nb, int n, float scale, float *sc) {    \
        for (int i = 0; i < nb; i++) {                                                                         \
            float s = 0;                                                                                       \
            for (int j = 0; j < n; j++) s += q[j] * LD1(k[i] + j);                                             \
            sc[i] = s * scale;                                                                                 \
        }                                                                                                      \
    }                                                                                                          \
    void fl_cpu_vec_acc##SFX(float *acc, float c, const float *p, const T *const *v, int nb, int n) {         \
        for (int j = 0; j < n; j++) {                                                                          \
            float a = acc[j] * c;                                                                              \
            for (int i = 0; i < nb; i++) a += p[i] * LD1(v[i] + j);                                            \
            acc[j] = a;                                                                                        \
        }                                                                                                      \
    }
static inline float ld1_f32(const float *p) { return *p; }
static inline float ld1_bf16(const uint16_t *p) { return fl_bf16_to_f32(*p); }
VEC_KV_FNS(, float, ld1_f32)
VEC_KV_FNS(_bf16, uint16_t, ld1_bf16)

float fl_cpu_vec_exp_sub(float *p, int n, float m) {
    float t = 0;
    for (int i = 0; i < n; i++) {
        p[i] = expf(p[i] - m);
        t += p[i];
    }
    return t;
}

#endif
