/*
 * cuda_fused.h — the CUDA backend's fused decode ops, which its
 * decode_layer (cuda_layer.cu) composes into a layer: C linkage, for the
 * backend's sources, its tests and bench/bench_kernels.cu. Each does what
 * the plain ops it replaces do (kernels/backend.h), up to the rounding
 * noted; the *_max_n functions say up to how many tokens one takes a weight
 * (0: not at all).
 */
#ifndef FL_CUDA_FUSED_H
#define FL_CUDA_FUSED_H

#include <stdbool.h>

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A residual add + RMSNorm split over the two GEMVs around it (a deferred
 * norm): the GEMV before it (fl_cuda_matmul_add_rms) adds its output into the
 * residual, writes h = residual * w unnormalized (rounded to the activation
 * dtype) and partial sums of the residual's squares; the GEMV after it
 * (fl_cuda_gate_up_silu, fl_cuda_matmul_rope_kv given rd) reads h and scales its dot
 * products by 1 / rms of each token, 1 / sqrt(sum / d + eps). What
 * add_rmsnorm then the op give up to rounding (h is rounded before the
 * scaling, not after: bf16 tolerance, not the same bits), with the norm's
 * launch gone. ss: [n][slots rounded up to 4] floats of device memory,
 * FL_RMS_DEFER_SLOTS a token at most; slots is set by fl_cuda_matmul_add_rms. */
#define FL_RMS_DEFER_SLOTS 1024
#define FL_RMS_DEFER_MAX_N 16
#define FL_RMS_DEFER_GATE_UP 1
#define FL_RMS_DEFER_QKV 2
typedef struct fl_rms_defer {
    float *ss;
    int slots;
    float eps;
} fl_rms_defer;

/* y = x @ w^T (+ bias) added into the residual: resid[n, rows] += y (y
 * rounded as matmul stores it, the sum as add_rmsnorm does), then h = resid
 * * norm_w rounded, and rd->ss / rd->slots the partial sums of resid's
 * squares for the op after it (see fl_rms_defer). Taken for n <=
 * fl_cuda_matmul_add_rms_max_n(b, w) (packed W4 at decode sizes: the
 * GEMV's epilogue does it). */
int fl_cuda_matmul_add_rms_max_n(fl_backend *b, const fl_tensor *w);
fl_status fl_cuda_matmul_add_rms(fl_backend *b, const void *x, int n, const fl_tensor *w, const fl_tensor *bias,
                                 void *resid, const fl_tensor *norm_w, void *h, fl_rms_defer *rd);
/* Whether deferring the norm into op (FL_RMS_DEFER_GATE_UP:
 * fl_cuda_gate_up_silu of w, up; FL_RMS_DEFER_QKV: fl_cuda_matmul_rope_kv of
 * w, head_dim) at n tokens pays: the op takes rd in its own kernel, at token
 * counts where it measured faster than add_rmsnorm (up to 16 tokens). */
bool fl_cuda_rms_defer_pays(fl_backend *b, int op, const fl_tensor *w, const fl_tensor *up, int n, int head_dim);
/* The gated MLP's first half in one pass over the weights: out[n, d] =
 * silu(x @ gate^T) * (x @ up^T), what matmul (gate), matmul (up) and
 * silu_mul make (each product rounded to bf16 first, as they store it), up
 * to the dot products' summation order. up NULL: gate is the stacked [2 d,
 * in] gate|up weight. x 16-byte aligned. rd (NULL: none): x is h of a
 * fl_cuda_matmul_add_rms before it, scaled by each token's 1 / rms. Taken
 * for n <= fl_cuda_gate_up_silu_max_n(b, gate, up) (decode-sized n on packed
 * W4 and on bf16 weights the bf16 GEMV takes). */
int fl_cuda_gate_up_silu_max_n(fl_backend *b, const fl_tensor *gate, const fl_tensor *up);
fl_status fl_cuda_gate_up_silu(fl_backend *b, const void *x, int n, const fl_tensor *gate, const fl_tensor *up,
                               void *out, const fl_rms_defer *rd);
/* The stacked q|k|v projection with RoPE and the K/V store after it:
 * y[n, qd + 2 kvd] = x @ w^T (+ bias), rows [q | k | v] of n_heads,
 * n_kv_heads, n_kv_heads heads of head_dim; then exactly what
 * rope_kv_store(q = y, k = y + qd, v = y + qd + kvd, strides qd + 2 kvd,
 * rot_dim = head_dim, halves) does. rd as for fl_cuda_gate_up_silu. Taken
 * for n <= fl_cuda_matmul_rope_kv_max_n(b, w, head_dim, rot_dim,
 * interleaved) (decode-sized n on packed W4, rotation by halves over whole
 * heads: the GEMV's epilogue rotates). */
int fl_cuda_matmul_rope_kv_max_n(fl_backend *b, const fl_tensor *w, int head_dim, int rot_dim, bool interleaved);
fl_status fl_cuda_matmul_rope_kv(fl_backend *b, const void *x, int n, const fl_tensor *w, const fl_tensor *bias,
                                 void *y, int n_heads, int n_kv_heads, int head_dim, const float *cos,
                                 const float *sin, const int32_t *slots, void *k_cache, void *v_cache,
                                 const fl_rms_defer *rd);
/* The decode layer (cuda_layer.cu): kernels/backend.h's decode_layer. */
fl_status fl_cuda_decode_layer(fl_backend *b, const fl_layer_desc *L, const fl_layer_desc *next,
                               const fl_tensor *next_norm, const fl_layer_step *s, int *h_state);

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_FUSED_H */
