/*
 * cpu_qdot.h — the CPU backend's SIMD matmuls for quantized weights (W4 and
 * Q8_0), in the manner of llama.cpp's q8 path: each activation row is
 * rounded once per matmul to integer blocks of 32 values with one f32 scale
 * a block, then each weight row is an integer dot product a block, scaled
 * by the block's two scales. The plain C matmul in cpu_ops.c (f32
 * activations) stays the reference these paths are tested against.
 *
 * Activations round to int16, not llama.cpp's int8: on the demo model int8
 * moved logits by up to 7 % of a row's largest and flipped the greedy
 * answer of "What is the capital of France?" (a 0.3 % near-tie); int16
 * costs two madd a block instead of maddubs + madd.
 *
 * Error bound against the reference: rounding x to the int16 grid of its
 * block moves each value by at most d/2 = amax(block)/65534, so an output
 * moves by at most sum over blocks of amax(block)/65534 * sum |w| over the
 * block, plus f32 rounding. The W4 bias term takes the sums of the rounded
 * x (as ggml's q8_1 blocks do), so the bound holds with the weights' real
 * values.
 */
#ifndef FL_CPU_QDOT_H
#define FL_CPU_QDOT_H

#include <stdbool.h>

#include "core/tensor.h"
#include "core/status.h"

/* Which matmul kernels the CPU backend runs. */
typedef enum fl_cpu_isa {
    FL_CPU_ISA_C,    /* plain C, f32 activations: the reference */
    FL_CPU_ISA_AVX2, /* AVX2+FMA+F16C, int16 activations for W4 and Q8_0 */
    FL_CPU_ISA_AVX512, /* AVX2 and AVX-512 F/BW/VL+VNNI: the same int16 math, two blocks a vector */
} fl_cpu_isa;

/* The kernels for this CPU (cpuid) under FL_CPU_KERNELS (auto: the best it
 * has; c; avx2; avx512). FL_ERR_UNSUPPORTED when the option asks for instructions
 * the CPU or this build lacks. */
fl_status fl_cpu_isa_choose(fl_cpu_isa *out);
/* "c", "avx2", "avx512". */
const char *fl_cpu_isa_name(fl_cpu_isa isa);
/* Whether isa includes the AVX2 set (avx2, avx512). */
bool fl_cpu_isa_has_avx2(fl_cpu_isa isa);

/* Whether isa has an integer kernel for w: W4 with a group that is a whole
 * number of 32-value blocks, or Q8_0; the input width a multiple of 32. */
bool fl_cpu_qmatmul_supported(fl_cpu_isa isa, const fl_tensor *w);

/* y[n, out] = x[n, in] . w[out, in]^T (+ bias[out] when not NULL), for a w
 * that fl_cpu_qmatmul_supported accepts. Splits the weight rows over the
 * pool threads (kernels/pool.h); allocates its workspace (about n * in * 2.2 bytes). */
fl_status fl_cpu_qmatmul(fl_cpu_isa isa, const float *x, int n, const fl_tensor *w, const float *bias, float *y);

#endif /* FL_CPU_QDOT_H */
