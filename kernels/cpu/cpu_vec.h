/*
 * cpu_vec.h — AVX2 versions of the attention's inner loops (per block of
 * cached positions: the query-key dots and the running value sum) over an
 * f32 or bf16 KV cache, for the CPU backend when its kernels include AVX2. The plain C
 * loops in cpu_attention.c stay the reference (FL_CPU_KERNELS=c, a NULL
 * backend, and int8 / fp8 records).
 * They sum in another order and fuse multiply-adds, so results move by f32
 * rounding only. Call them only where fl_cpu_isa_choose said avx2 or avx512.
 */
#ifndef FL_CPU_VEC_H
#define FL_CPU_VEC_H

#include <stdint.h>

/* sc[i] = scale * sum_j q[j] * k[i][j] for the nb positions' keys k[i] of
 * n values. */
void fl_cpu_vec_scores(const float *q, const float *const *k, int nb, int n, float scale, float *sc);
/* p[i] = exp(p[i] - m) for n values, each p[i] <= m; returns their sum
 * (within 2 ulp of expf a value). */
float fl_cpu_vec_exp_sub(float *p, int n, float m);
/* acc[j] = acc[j] * c + sum_i p[i] * v[i][j] over n values, for the nb
 * positions' values v[i]. */
void fl_cpu_vec_acc(float *acc, float c, const float *p, const float *const *v, int nb, int n);
/* The same two over a bf16 cache (backend.h, kv_bf16): each value widened
 * exactly, so the results equal the f32 versions' over the widened rows. */
void fl_cpu_vec_scores_bf16(const float *q, const uint16_t *const *k, int nb, int n, float scale, float *sc);
void fl_cpu_vec_acc_bf16(float *acc, float c, const float *p, const uint16_t *const *v, int nb, int n);

#endif /* FL_CPU_VEC_H */
