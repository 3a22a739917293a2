/*
 * cpu_qdot.c — int16-activation matmuls for W4 and Q8_0 weights in AVX2 and
 * AVX-512 VNNI intrinsics (contracts and error bound in cpu_qdot.h). The
 * functions carry their own target attribute, so the file builds for
 * baseline x86-64 and runs them only where cpuid said yes.
 *
 * W4 codes sit two a byte, element 2j in the low nibble: rather than
 * interleaving nibbles for every weight row, each activation block is
 * stored permuted once (its even elements, then its odd ones), so a block
 * of 16 code bytes gives [low nibbles] and [high nibbles] with one shift.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "kernels/cpu/cpu_qdot.h"
#include "kernels/pool.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QDOT_X86 1
#include <cpuid.h>
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
#define QMAX 32767.0f  /* activations round to int16 */
#define QUANT_PAR_TOKENS 8 /* fewer tokens quantize on one thread */
/* Weight bytes requested ahead of the dot product, per row stream: a core's
 * hardware prefetcher alone kept 6-10 GB/s of a 20+ GB/s read ceiling on a
 * Zen 4 (bench/RESULTS.md); 2048 was the distance that held across shapes. */
#define PF_BYTES 2048

const char *fl_cpu_isa_name(fl_cpu_isa isa) {
    return isa == FL_CPU_ISA_AVX512 ? "avx512" : isa == FL_CPU_ISA_AVX2 ? "avx2" : "c";
}

static bool cpu_has_avx2(void) {
#if QDOT_X86
    unsigned a, b, c, d;
    /* __builtin_cpu_supports also checks that the OS saves the YMM state */
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    return (c & bit_F16C) != 0;
#else
    return false;
#endif
}

/* AVX-512 F/BW/VL with VNNI (vpdpwssd), on top of the AVX2 set. */
static bool cpu_has_avx512(void) {
#if QDOT_X86
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

fl_status fl_cpu_isa_choose(fl_cpu_isa *out) {
    const char *want = fl_opt_str(FL_OPT_CPU_KERNELS);
    const bool avx2 = cpu_has_avx2(), avx512 = cpu_has_avx512();
    *out = FL_CPU_ISA_C;
    if (!strcmp(want, "c")) return FL_OK;
    if (!strcmp(want, "avx2") && !avx2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "FL_CPU_KERNELS=avx2: this CPU (or build) has no AVX2+FMA+F16C");
    if (!strcmp(want, "avx512") && !avx512)
        return FL_ERR(FL_ERR_UNSUPPORTED, "FL_CPU_KERNELS=avx512: this CPU (or build) has no AVX-512 F/BW/VL+VNNI");
    if (avx2) *out = FL_CPU_ISA_AVX2;
    if (avx512 && strcmp(want, "avx2")) *out = FL_CPU_ISA_AVX512;
    return FL_OK;
}

bool fl_cpu_isa_has_avx2(fl_cpu_isa isa) { return isa == FL_CPU_ISA_AVX2 || isa == FL_CPU_ISA_AVX512; }

bool fl_cpu_qmatmul_supported(fl_cpu_isa isa, const fl_tensor *w) {
    if (!fl_cpu_isa_has_avx2(isa) || w->ndim != 2 || w->shape[1] % QK) return false;
    if (w->dtype == FL_DTYPE_Q8_0) return true;
    return w->dtype == FL_DTYPE_W4 && w->group > 0 && w->group % QK == 0 && w->shape[1] % w->group == 0;
}

#if QDOT_X86

AVX2_INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_INLINE int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One activation row to int16 blocks: q[in] (each block permuted to
 * evens-then-odds when w4), d[in / 32] its scales (amax / 32767), and for
 * W4 gsum[in / G] the sums of the rounded x over each weight group: the
 * bias term must see the same x as the codes, or the rounding error meets
 * the codes (0..15, all positive) instead of the centred weights. */
AVX2 static void quantize_row(const float *x, int64_t in, bool w4, int G, int16_t *q, float *d, float *gsum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    float gacc = 0;
    for (int64_t k = 0; k < in / QK; k++) {
        const float *xb = x + k * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        if (w4) { /* evens of the block, then odds: [0 2 .. 30 | 1 3 .. 31] */
            __m256 e0 = _mm256_shuffle_ps(v0, v1, 0x88), e1 = _mm256_shuffle_ps(v2, v3, 0x88);
            __m256 o0 = _mm256_shuffle_ps(v0, v1, 0xDD), o1 = _mm256_shuffle_ps(v2, v3, 0xDD);
            v0 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e0), 0xD8));
            v1 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e1), 0xD8));
            v2 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o0), 0xD8));
            v3 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o1), 0xD8));
        }
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                  _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float amax = _mm_cvtss_f32(m), dk = amax / QMAX;
        const __m256 id = _mm256_set1_ps(dk > 0 ? 1.0f / dk : 0.0f);
        d[k] = dk;
        /* round to nearest even (MXCSR default), |value| <= 32767 */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        /* packs interleaves the 128-bit lanes; 0xD8 puts them back in order */
        _mm256_storeu_si256((__m256i *)(q + k * QK), _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
        _mm256_storeu_si256((__m256i *)(q + k * QK + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
        if (w4) {
            const __m256i si = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            gacc += dk * (float)hsum_epi32(si);
            if ((k + 1) * QK % G == 0) {
                gsum[(k + 1) * QK / G - 1] = gacc;
                gacc = 0;
            }
        }
    }
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
    ATTR static void NAME(const fl_tensor *w, int64_t r0, int64_t r1, const int16_t *qx, const float *dx,   \
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

#define W4K w4_rows
#define Q8K q8_rows
ROWS_FN(rows_avx2, AVX2)
#undef W4K
#undef Q8K

/* The AVX-512 kernels take two 32-value blocks k, k+1 a vector. Each
 * token's int16 blocks, [A_k | B_k] as quantize_row stores them (A the even
 * elements for W4, the first 16 for Q8_0; B the rest), are regrouped a pair
 * at a time to [A_k A_k+1 | B_k B_k+1], so that one vpdpwssd over
 * [w(A_k) w(A_k+1)] and one over the B halves leave block k's sums in lanes
 * 0-7 and block k+1's in lanes 8-15: one convert and one fma for both
 * blocks, with a vector of their two scales. */
static void pairs_regroup(int16_t *q, int64_t in) {
    for (int64_t k = 0; k + 1 < in / QK; k += 2) {
        int16_t t[16];
        int16_t *b = q + k * QK;
        memcpy(t, b + 16, sizeof t);       /* B_k */
        memcpy(b + 16, b + 32, sizeof t);  /* A_k+1 */
        memcpy(b + 32, t, sizeof t);
    }
}

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
ROWS_FN(rows_avx512, AVX512)
#undef W4K
#undef Q8K
#undef ROWS_FN
#undef ROWS_TILE

typedef struct qmm_job {
    const fl_tensor *w;
    const float *x;
    int16_t *qx;
    float *dx, *gs;
    const float *bias;
    float *y;
    int n;
    bool pairs; /* the AVX-512 kernels: activations regrouped by block pairs */
} qmm_job;

/* Tokens [lo, hi) to int8/int16 codes (a pool task). */
static void qmm_quantize(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const qmm_job *j = ctx;
    const bool w4 = j->w->dtype == FL_DTYPE_W4;
    const int64_t in = j->w->shape[1], nb = in / QK, ng = w4 ? in / j->w->group : 0;
    for (int64_t t = lo; t < hi; t++) {
        quantize_row(j->x + t * in, in, w4, j->w->group, j->qx + t * in, j->dx + t * nb, j->gs + t * ng);
        if (j->pairs) pairs_regroup(j->qx + t * in, in);
    }
}

/* Row pairs [lo, hi) against every token (a pool task). */
static void qmm_pairs(void *ctx, int64_t lo, int64_t hi, int thread) {
    (void)thread;
    const qmm_job *j = ctx;
    const int64_t out = j->w->shape[0];
    (j->pairs ? rows_avx512 : rows_avx2)(j->w, 2 * lo, 2 * hi < out ? 2 * hi : out, j->qx, j->dx, j->gs, j->n,
                                         j->bias, j->y);
}

fl_status fl_cpu_qmatmul(fl_cpu_isa isa, const float *x, int n, const fl_tensor *w, const float *bias, float *y) {
    if (!fl_cpu_qmatmul_supported(isa, w))
        return FL_ERR(FL_ERR_INTERNAL, "cpu qmatmul: no %s kernel for %s [%lld, %lld] group %d", fl_cpu_isa_name(isa),
                      fl_dtype_name(w->dtype), (long long)w->shape[0], (long long)w->shape[1], w->group);
    if (n <= 0) return FL_OK;
    const bool w4 = w->dtype == FL_DTYPE_W4;
    const int64_t out = w->shape[0], in = w->shape[1], nb = in / QK, ng = w4 ? in / w->group : 0;
    int16_t *qx = aligned_alloc(64, (size_t)(n * in) * sizeof(int16_t));
    float *dx = malloc((size_t)(n * nb) * sizeof(float));
    float *gs = malloc((size_t)(n * ng + 1) * sizeof(float));
    fl_status st = FL_OK;
    if (!qx || !dx || !gs) {
        st = FL_ERR(FL_ERR_OOM, "out of memory in cpu qmatmul (%d tokens of %lld)", n, (long long)in);
        goto done;
    }
    /* AVX-512 where the row is a whole number of block pairs, AVX2 for the rest */
    qmm_job j = {.w = w, .x = x, .qx = qx, .dx = dx, .gs = gs, .bias = bias, .y = y, .n = n,
                 .pairs = isa == FL_CPU_ISA_AVX512 && nb % 2 == 0};
    /* A few tokens quantize in microseconds: on the calling thread, so a
     * decode step's matmul is one fork and one join with no barrier between. */
    if (n >= QUANT_PAR_TOKENS)
        FL_TRY_GOTO(fl_pool_for(n, 0, qmm_quantize, &j), st, done);
    else
        qmm_quantize(&j, 0, n, 0);
    /* pairs of rows in chunks of about an eighth of a thread's share,
     * claimed as threads come free: a thread the OS takes away (a shared
     * machine) holds up one chunk, not a whole share */
    const int64_t pairs = (out + 1) / 2, nt = fl_pool_threads();
    FL_TRY_GOTO(fl_pool_for(pairs, (pairs + 8 * nt - 1) / (8 * nt), qmm_pairs, &j), st, done);
done:
    free(qx);
    free(dx);
    free(gs);
    return st;
}

#else /* no x86: only the C reference exists */

fl_status fl_cpu_qmatmul(fl_cpu_isa isa, const float *x, int n, const fl_tensor *w, const float *bias, float *y) {
    (void)x, (void)n, (void)bias, (void)y;
    return FL_ERR(FL_ERR_UNSUPPORTED, "cpu qmatmul: no %s kernels in this build for %s", fl_cpu_isa_name(isa),
                  fl_dtype_name(w->dtype));
}

#endif
