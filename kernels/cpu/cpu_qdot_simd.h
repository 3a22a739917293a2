/*
 * cpu_qdot_simd.h — what cpu_qdot.c and its kernel files share (private to
 * kernels/cpu): the target attributes, the block and tile sizes, two
 * reductions and the tile loop that runs a kernel pair over rows and tokens.
 */
#ifndef FL_CPU_QDOT_SIMD_H
#define FL_CPU_QDOT_SIMD_H

#include <stdbool.h>
#include <stdint.h>

#include "core/tensor.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QDOT_X86 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define AVX512 __attribute__((target(AVX512_TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))
#else
#define QDOT_X86 0
#endif

#define QK 32          /* values per activation block */
#define Q8_0_BYTES 34  /* f16 d, int8 q[32] */
#define TILE 4         /* tokens sharing one pass over a weight row */
/* Weight bytes requested ahead of the dot product, per row stream: a core's
 * hardware prefetcher alone kept 6-10 GB/s of a 20+ GB/s read ceiling on a
 * Zen 4 (bench/RESULTS.md); 2048 was the distance that held across shapes. */
#define PF_BYTES 2048

#if QDOT_X86

AVX2_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8-wide dot of a[n] and b[n]: the W4 bias term sum_g b_g * gsum_g, which
 * as a scalar loop was one dependent chain as long as the row's own. */
AVX2_INLINE float dot_ps(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum_ps(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* R weight rows against every token, TILE tokens a pass (the rows' bytes
 * stay in L1 across tiles). R and nt are constants in each call of the
 * kernels below, so the compiler keeps the accumulators in registers.
 * ROWS_FN(name, attr, w4k, q8k) defines the loop over one kernel set. */
#define ROWS_TILE(R, nt)                                                                 \
    do {                                                                                 \
        if (w4)                                                                          \
            W4K(w, r, R, qx + t * in, in, dx + t * nb, gs + t * ng, nt, res);            \
        else                                                                             \
            Q8K(w, r, R, qx + t * in, in, dx + t * nb, nt, res);                         \
    } while (0)
#define ROWS_FN(NAME, ATTR)                                                                                  \
    ATTR void NAME(const fl_tensor *w, int64_t r0, int64_t r1, const int16_t *qx, const float *dx,   \
                          const float *gs, int n, const float *bias, float *y) {                             \
        const bool w4 = w->dtype == FL_DTYPE_W4;                                                            \
        const int64_t out = w->shape[0], in = w->shape[1], nb = in / QK, ng = w4 ? in / w->group : 0;     \
        float res[2][TILE];                                                                                 \
        /* Q8_0 rows one at a time below a tile of tokens: one sequential stream                           \
         * read twice as fast as two interleaved ones (a Zen 4, bench/RESULTS.md),                          \
         * and at one token a second row has no activation loads to share. */                             \
        const int step = !w4 && n < TILE ? 1 : 2;                                                           \
        for (int64_t r = r0; r < r1; r += step) {                                                           \
            const int R = r1 - r >= step ? step : 1;                                                        \
            for (int t = 0; t < n; t += TILE) {                                                             \
                const int nt = n - t < TILE ? n - t : TILE;                                                 \
                if (R == 2) {                                                                               \
                    switch (nt) {                                                                           \
                    case 1: ROWS_TILE(2, 1); break;                                                         \
                    case 2: ROWS_TILE(2, 2); break;                                                         \
                    case 3: ROWS_TILE(2, 3); break;                                                         \
                    default: ROWS_TILE(2, 4); break;                                                        \
                    }                                                                                       \
                } else {                                                                                    \
                    switch (nt) {                                                                           \
                    case 1: ROWS_TILE(1, 1); break;                                                         \
                    case 2: ROWS_TILE(1, 2); break;                                                         \
                    case 3: ROWS_TILE(1, 3); break;                                                         \
                    default: ROWS_TILE(1, 4); break;                                                        \
                    }                                                                                       \
                }                                                                                           \
                for (int i = 0; i < R; i++)                                                                 \
                    for (int j = 0; j < nt; j++)                                                            \
                        y[(int64_t)(t + j) * out + r + i] = res[i][j] + (bias ? bias[r + i] : 0.0f);       \
            }                                                                                               \
        }                                                                                                   \
    }

/* Rows [r0, r1) (r0 even) of w against n tokens quantized by
 * fl_cpu_qmatmul (qx, dx, gs as quantize_row leaves them; for the AVX-512
 * set regrouped by block pairs): y[t, r] = dot + bias[r]. */
void fl_cpu_qrows_avx2(const fl_tensor *w, int64_t r0, int64_t r1, const int16_t *qx, const float *dx,
                       const float *gs, int n, const float *bias, float *y);
void fl_cpu_qrows_avx512(const fl_tensor *w, int64_t r0, int64_t r1, const int16_t *qx, const float *dx,
                         const float *gs, int n, const float *bias, float *y);

#endif /* QDOT_X86 */
#endif /* FL_CPU_QDOT_SIMD_H */
