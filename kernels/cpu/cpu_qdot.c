/*
 * cpu_qdot.c — int16-activation matmuls for W4 and Q8_0 weights (contracts
 * and error bound in cpu_qdot.h): the kernel set cpuid allows, the rounding
 * of activations to int16 blocks, and the split of the rows over the pool.
 * The kernels are in cpu_qdot_avx2.c and cpu_qdot_avx512.c. The functions
 * carry their own target attribute, so the files build for baseline x86-64
 * and run them only where cpuid said yes.
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
#include "kernels/cpu/cpu_qdot_simd.h"
#include "kernels/pool.h"

#if QDOT_X86
#include <cpuid.h>
#endif

#define QMAX 32767.0f  /* activations round to int16 */
#define QUANT_PAR_TOKENS 8 /* fewer tokens quantize on one thread */

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
    (j->pairs ? fl_cpu_qrows_avx512 : fl_cpu_qrows_avx2)(j->w, 2 * lo, 2 * hi < out ? 2 * hi : out, j->qx, j->dx, j->gs, j->n,
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
