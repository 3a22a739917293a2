/*
 * cpu_ops.h — the CPU backend's ops (contracts in kernels/backend.h).
 * Exposed so tests can call them directly as the reference.
 */
#ifndef FL_CPU_OPS_H
#define FL_CPU_OPS_H

#include "kernels/backend.h"
#include "kernels/cpu/cpu_qdot.h"

/* The matmul kernels b chose when it started (cpu_qdot.h); a NULL b (tests
 * calling the ops directly) runs the C reference. */
fl_cpu_isa fl_cpu_backend_isa(const fl_backend *b);

fl_status fl_cpu_embed(fl_backend *b, const fl_tensor *table, const int32_t *ids, int n, void *out);
fl_status fl_cpu_rmsnorm(fl_backend *b, const void *x, const fl_tensor *w, float eps, int n, int d,
                         void *out);
/* W4 and Q8_0 weights on an AVX2 backend go through cpu_qdot.c (int8
 * activations); everything else, and a NULL b, through the f32 reference. */
fl_status fl_cpu_matmul(fl_backend *b, const void *x, int n, const fl_tensor *w,
                        const fl_tensor *bias, void *y);
fl_status fl_cpu_rope(fl_backend *b, void *x, int n_tok, int n_heads, int head_dim, int stride,
                      const float *cos, const float *sin, int rot_dim, bool interleaved);
fl_status fl_cpu_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                               int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                               const float *cos, const float *sin, int rot_dim, bool interleaved,
                               const int32_t *slots, void *k_cache, void *v_cache);
/* The f32 value of each of the 256 codes of a quantized KV record
 * (backend.h): e4m3 when fp8, else int8; the scale is applied apart. */
const float *fl_cpu_kv_code_table(bool fp8);
fl_status fl_cpu_kv_store(fl_backend *b, const void *k, const void *v, int n_tok, int kv_dim,
                          int stride, const int32_t *slots, void *k_cache, void *v_cache);
fl_status fl_cpu_attention(fl_backend *b, const void *q, int q_stride, const fl_attn_meta *m,
                           int n_heads, int n_kv_heads, int head_dim, float scale,
                           const void *k_cache, const void *v_cache, void *out);
fl_status fl_cpu_silu_mul(fl_backend *b, const void *gate, const void *up, int n, int d, int stride,
                          void *out);
fl_status fl_cpu_add(fl_backend *b, void *x, const void *y, size_t n);
fl_status fl_cpu_add_rmsnorm(fl_backend *b, void *x, const void *y, const fl_tensor *w, float eps,
                             int n, int d, void *out);
fl_status fl_cpu_moe_topk(fl_backend *b, const void *logits, int n, int n_experts, int k,
                          const fl_moe_route *r, int32_t *ids, float *weights);
fl_status fl_cpu_gather_rows(fl_backend *b, const void *src, const int32_t *idx, int n_idx, int d,
                             void *dst);
fl_status fl_cpu_scatter_add_rows(fl_backend *b, void *dst, const void *src, const int32_t *idx,
                                  const float *scale, int n_idx, int d);
fl_status fl_cpu_sigmoid_scale_rows(fl_backend *b, void *x, const void *g, int n, int d);
fl_status fl_cpu_moe_group(fl_backend *b, const int32_t *ids, int n, int k, int e_lo, int n_local,
                           int32_t *list);
fl_status fl_cpu_moe_matmul(fl_backend *b, const void *x, int x_per_pair, int n, int k, const int32_t *list,
                            int n_local, const fl_tensor *table, const fl_tensor *w0, void *out);
fl_status fl_cpu_moe_combine(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                             const float *weights, int n, int k, int e_lo, int n_local, int d);
fl_status fl_cpu_mla_rope_norm_store(fl_backend *b, void *q, int q_stride, void *ckv, int n_tok, int n_heads,
                                     int nope, int rope, int kvl, const float *cos, const float *sin,
                                     const fl_tensor *kv_norm, float eps, const int32_t *slots, void *k_cache,
                                     void *v_cache);
fl_status fl_cpu_qknorm_rope_kv_store(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                                      int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                                      const fl_tensor *q_norm, const fl_tensor *k_norm, float eps,
                                      const float *cos, const float *sin, int rot_dim, bool interleaved,
                                      const int32_t *slots, void *k_cache, void *v_cache);
fl_status fl_cpu_moe_combine_add_rmsnorm(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                                         const float *weights, int n, int k, int e_lo, int n_local, int d,
                                         const void *extra, void *x, const fl_tensor *w, float eps, void *out);
fl_status fl_cpu_argmax_rows(fl_backend *b, const void *x, int n, int d, int offset, float *out);
fl_status fl_cpu_copy_2d(fl_backend *b, void *dst, int dst_stride, const void *src, int src_stride, int n,
                         int w);
size_t fl_cpu_sample_rows_ws(fl_backend *b, int n, int d);
fl_status fl_cpu_sample_rows(fl_backend *b, const void *x, int n, int d, const fl_sample_row *rows,
                             const int32_t *hist, bool any_top_p, void *ws, int32_t *out);
fl_status fl_cpu_mla_attention(fl_backend *b, const void *q, const fl_attn_meta *m, int n_heads, int nope,
                               int rope, int v_dim, int kv_lora, float scale, const fl_tensor *wkv_b,
                               const void *k_cache, const void *v_cache, void *out);

#endif /* FL_CPU_OPS_H */
