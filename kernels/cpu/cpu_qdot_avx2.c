/*
 * cpu_qdot_avx2.c — the AVX2 W4 and Q8_0 kernels of fl_cpu_qmatmul: one
 * 32-value block a step, int16 products summed by vpmaddwd.
 */
#include <string.h>

#include "kernels/cpu/cpu_qdot_simd.h"

#if QDOT_X86

/* Dots of R W4 rows from row r (codes, group scales and biases) with nt
 * quantized tokens: sum_g s_g * sum_{k in g} d_k * (codes . xq)_k + b_g * gsum_g.
 * A block's 16 code bytes give its even elements (low nibbles) and odd
 * ones (high nibbles) as 16-bit lanes, matching the permuted activations.
 * Two rows a pass load each activation block once for both and give the
 * core two independent accumulator chains at one token. */
AVX2_INLINE void w4_rows(const fl_tensor *w, int64_t r, int R, const int16_t *qx, int64_t in, const float *dx,
                         const float *gsum, int nt, float res[2][TILE]) {
    const __m128i m4 = _mm_set1_epi8(15);
    const int64_t nb = in / QK, ng = in / w->group, bpg = w->group / QK;
    const uint8_t *q[2];
    const float *s[2], *bs[2];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
        q[i] = (const uint8_t *)w->data + (r + i) * (in / 2);
        s[i] = w->scales + (r + i) * ng;
        bs[i] = w->bias + (r + i) * ng;
    }
    __m256 acc[2][TILE];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0, k = 0; g < ng; g++) {
        float sg[2];
        _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) sg[i] = s[i][g];
        if ((g & 15) == 0) /* a cache line of scales and of biases, as far ahead as the codes */
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
                _mm_prefetch((const char *)(s[i] + g + PF_BYTES * 2 / w->group), _MM_HINT_T0);
                _mm_prefetch((const char *)(bs[i] + g + PF_BYTES * 2 / w->group), _MM_HINT_T0);
            }
        for (int64_t e = 0; e < bpg; e++, k++) {
            if ((k & 3) == 0) /* a cache line of codes every 4 blocks */
                _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) _mm_prefetch((const char *)(q[i] + k * (QK / 2) + PF_BYTES), _MM_HINT_T0);
            __m256i lo[2], hi[2];
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(q[i] + k * (QK / 2)));
                lo[i] = _mm256_cvtepu8_epi16(_mm_and_si128(b, m4));
                hi[i] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m4));
            }
            _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) {
                const int16_t *xb = qx + j * in + k * QK;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 16));
                const float dj = dx[j * nb + k];
                _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo[i], x0), _mm256_madd_epi16(hi[i], x1));
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sg[i] * dj), acc[i][j]);
                }
            }
        }
    }
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) res[i][j] = hsum_ps(acc[i][j]) + dot_ps(bs[i], gsum + j * ng, ng);
}

/* Dots of R Q8_0 rows from row r (blocks of f16 d, int8 q[32]) with nt
 * quantized tokens, the weights widened to 16 bits. */
AVX2_INLINE void q8_rows(const fl_tensor *w, int64_t r, int R, const int16_t *qx, int64_t in, const float *dx,
                         int nt, float res[2][TILE]) {
    const int64_t nb = in / QK;
    const uint8_t *row[2];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) row[i] = (const uint8_t *)w->data + (r + i) * nb * Q8_0_BYTES;
    __m256 acc[2][TILE];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb; k++) {
        __m256i w0[2], w1[2];
        float dw[2];
        if ((k & 1) == 0) /* a cache line every two 34-byte blocks */
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) _mm_prefetch((const char *)(row[i] + k * Q8_0_BYTES + PF_BYTES), _MM_HINT_T0);
        _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
            const uint8_t *blk = row[i] + k * Q8_0_BYTES;
            uint16_t h;
            memcpy(&h, blk, 2);
            dw[i] = _cvtsh_ss(h);
            w0[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
            w1[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        }
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) {
            const int16_t *xb = qx + j * in + k * QK;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 16));
            const float dj = dx[j * nb + k];
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[i], x0), _mm256_madd_epi16(w1[i], x1));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[i] * dj), acc[i][j]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) res[i][j] = hsum_ps(acc[i][j]);
}

#define W4K w4_rows
#define Q8K q8_rows
ROWS_FN(fl_cpu_qrows_avx2, AVX2)

#endif
