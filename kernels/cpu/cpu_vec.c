/*
 * cpu_vec.c — AVX2 attention loops (contracts in cpu_vec.h). Each function
 * carries its own target attribute, as in cpu_qdot.c, so the file builds
 * for baseline x86-64; elsewhere they are the plain loops.
 */
#include "kernels/cpu/cpu_vec.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Two accumulators: one dependent chain of fused adds would bound a
 * 64-value head at 8 x the add latency. */
AVX2 float fl_cpu_vec_dot(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), s1);
    }
    for (; j + 8 <= n; j += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

AVX2 void fl_cpu_vec_scale_add(float *acc, float c, float p, const float *v, int n) {
    const __m256 vc = _mm256_set1_ps(c), vp = _mm256_set1_ps(p);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(_mm256_loadu_ps(acc + j), vc,
                                                  _mm256_mul_ps(vp, _mm256_loadu_ps(v + j))));
    for (; j < n; j++) acc[j] = acc[j] * c + p * v[j];
}

#else /* no x86: the plain loops (never chosen: fl_cpu_isa_choose says c) */

float fl_cpu_vec_dot(const float *a, const float *b, int n) {
    float s = 0;
    for (int j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

void fl_cpu_vec_scale_add(float *acc, float c, float p, const float *v, int n) {
    for (int j = 0; j < n; j++) acc[j] = acc[j] * c + p * v[j];
}

#endif
