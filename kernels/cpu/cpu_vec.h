/*
 * cpu_vec.h — AVX2 versions of the attention's inner loops (per cached
 * position: the query-key dot and the running value sum) over an f32 KV
 * cache, for the CPU backend when it chose FL_CPU_ISA_AVX2. The plain C
 * loops in cpu_attention.c stay the reference (FL_CPU_KERNELS=c, a NULL
 * backend, and int8 / fp8 records).
 * They sum in another order and fuse multiply-adds, so results move by f32
 * rounding only. Call them only where fl_cpu_isa_choose said avx2.
 */
#ifndef FL_CPU_VEC_H
#define FL_CPU_VEC_H

#include <stdint.h>

/* sum_j a[j] * b[j] over n values. */
float fl_cpu_vec_dot(const float *a, const float *b, int n);
/* acc[j] = acc[j] * c + p * v[j] over n values. */
void fl_cpu_vec_scale_add(float *acc, float c, float p, const float *v, int n);

#endif /* FL_CPU_VEC_H */
