/*
 * cpu_qdot_avx512.c — the AVX-512 VNNI W4 and Q8_0 kernels of
 * fl_cpu_qmatmul: two 32-value blocks a vector over activations regrouped
 * by block pairs (cpu_qdot.c, pairs_regroup).
 */
#include <string.h>

#include "kernels/cpu/cpu_qdot_simd.h"

#if QDOT_X86

/* [v0 x8 | v1 x8] from two consecutive floats at p. */
AVX512_INLINE __m512 two_scales(const float *p) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)p))));
}

/* w4_rows over block pairs (regrouped activations; in % 64 == 0). */
AVX512_INLINE void w4_rows512(const fl_tensor *w, int64_t r, int R, const int16_t *qx, int64_t in, const float *dx,
                              const float *gsum, int nt, float res[2][TILE]) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const int64_t nb = in / QK, ng = in / w->group, G = w->group;
    const uint8_t *q[2];
    const float *s[2], *bs[2];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
        q[i] = (const uint8_t *)w->data + (r + i) * (in / 2);
        s[i] = w->scales + (r + i) * ng;
        bs[i] = w->bias + (r + i) * ng;
    }
    __m512 acc[2][TILE];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nb; k += 2) {
        const int64_t g = k * QK / G;
        if ((k & 3) == 0)
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) _mm_prefetch((const char *)(q[i] + k * (QK / 2) + PF_BYTES), _MM_HINT_T0);
        if (k * QK % G == 0 && (g & 15) == 0)
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
                _mm_prefetch((const char *)(s[i] + g + PF_BYTES * 2 / G), _MM_HINT_T0);
                _mm_prefetch((const char *)(bs[i] + g + PF_BYTES * 2 / G), _MM_HINT_T0);
            }
        __m512i lo[2], hi[2];
        __m512 sv[2];
        _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(q[i] + k * (QK / 2)));
            lo[i] = _mm512_cvtepu8_epi16(_mm256_and_si256(c, m4));
            hi[i] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4));
            sv[i] = G == QK ? two_scales(s[i] + k) : _mm512_set1_ps(s[i][g]);
        }
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) {
            const int16_t *xb = qx + j * in + k * QK;
            const __m512i xa = _mm512_loadu_si512(xb), xbh = _mm512_loadu_si512(xb + 32);
            const __m512 dv = two_scales(dx + j * nb + k);
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
                const __m512i p = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), lo[i], xa), hi[i], xbh);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv[i], dv), acc[i][j]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) res[i][j] = _mm512_reduce_add_ps(acc[i][j]) + dot_ps(bs[i], gsum + j * ng, ng);
}

/* q8_rows over block pairs (regrouped activations; in % 64 == 0). */
AVX512_INLINE void q8_rows512(const fl_tensor *w, int64_t r, int R, const int16_t *qx, int64_t in, const float *dx,
                              int nt, float res[2][TILE]) {
    const int64_t nb = in / QK;
    const uint8_t *row[2];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) row[i] = (const uint8_t *)w->data + (r + i) * nb * Q8_0_BYTES;
    __m512 acc[2][TILE];
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nb; k += 2) {
        __m512i wa[2], wb[2];
        __m512 sv[2];
        _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
            const uint8_t *b0 = row[i] + k * Q8_0_BYTES, *b1 = b0 + Q8_0_BYTES;
            _mm_prefetch((const char *)(b0 + PF_BYTES), _MM_HINT_T0);
            uint16_t h0, h1;
            memcpy(&h0, b0, 2);
            memcpy(&h1, b1, 2);
            const float d[2] = {_cvtsh_ss(h0), _cvtsh_ss(h1)};
            sv[i] = two_scales(d);
            wa[i] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b1 + 2)),
                                                          _mm_loadu_si128((const __m128i *)(b0 + 2))));
            wb[i] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b1 + 18)),
                                                          _mm_loadu_si128((const __m128i *)(b0 + 18))));
        }
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) {
            const int16_t *xb = qx + j * in + k * QK;
            const __m512i xa = _mm512_loadu_si512(xb), xbh = _mm512_loadu_si512(xb + 32);
            const __m512 dv = two_scales(dx + j * nb + k);
            _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {
                const __m512i p = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), wa[i], xa), wb[i], xbh);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv[i], dv), acc[i][j]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < nt; j++) res[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

#define W4K w4_rows512
#define Q8K q8_rows512
ROWS_FN(fl_cpu_qrows_avx512, AVX512)

#endif
