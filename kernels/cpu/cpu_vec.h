/*
 * cpu_vec.h — AVX2 versions of the attention's inner loops (per cached
 * position: the query-key dot and the running value sum), for the CPU
 * backend when it chose FL_CPU_ISA_AVX2. The plain C loops in
 * cpu_attention.c stay the reference (FL_CPU_KERNELS=c, a NULL backend).
 * They sum in another order and fuse multiply-adds, so results move by f32
 * rounding only. Call them only where fl_cpu_isa_choose said avx2.
 */
#ifndef FL_CPU_VEC_H
#define FL_CPU_VEC_H

#include <stdint.h>

/* sum_j a[j] * b[j] over n values. */
float fl_cpu_vec_dot(const float *a, const float *b, int n);
/* sum_j a[j] * table[codes[j]] over n values: an int8 or fp8 KV record's
 * codes read through its 256-value table (fl_cpu_kv_code_table). */
float fl_cpu_vec_dot_codes(const float *a, const uint8_t *codes, const float *table, int n);
/* acc[j] = acc[j] * c + p * v[j] over n values. */
void fl_cpu_vec_scale_add(float *acc, float c, float p, const float *v, int n);
/* acc[j] = acc[j] * c + p * table[codes[j]] over n values. */
void fl_cpu_vec_scale_add_codes(float *acc, float c, float p, const uint8_t *codes, const float *table, int n);

#endif /* FL_CPU_VEC_H */
