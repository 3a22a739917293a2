/*
 * quantize_layer.h — one dense decoder layer (llama / qwen2) in plain f32
 * on the host, for `flotilla quantize`: the calibration forward that
 * captures the inputs of each group of linears. Tokens are a concatenation
 * of independent blocks (calibration samples), each attending causally to
 * itself from position 0.
 */
#ifndef FL_QUANTIZE_LAYER_H
#define FL_QUANTIZE_LAYER_H

#include <stdint.h>

#include "core/status.h"
#include "kernels/backend.h"
#include "runtime/load/checkpoint.h"

/* The linears of a layer, in the order of FL_QLAYER_NAMES. */
enum { FL_QLIN_Q, FL_QLIN_K, FL_QLIN_V, FL_QLIN_O, FL_QLIN_GATE, FL_QLIN_UP, FL_QLIN_DOWN, FL_QLIN_COUNT };
extern const char *const FL_QLAYER_NAMES[FL_QLIN_COUNT]; /* "self_attn.q_proj", ... */

/* A layer's float weights (owned, f32). */
typedef struct fl_qlayer {
    float *in_norm, *post_norm;   /* [d] */
    float *w[FL_QLIN_COUNT];      /* [out, in] */
    int64_t out[FL_QLIN_COUNT], in[FL_QLIN_COUNT];
    float *bias[3];               /* q, k, v biases [out] (qwen2), else NULL */
} fl_qlayer;

/* The inputs of the linear groups for all n tokens. */
typedef struct fl_qlayer_capture {
    float *qkv;   /* [n, d]: input norm output */
    float *o;     /* [n, heads * head_dim]: attention output */
    float *gu;    /* [n, d]: post-attention norm output */
    float *down;  /* [n, intermediate]: silu(gate) * up */
} fl_qlayer_capture;

/* Reads layer l of ck as f32. */
fl_status fl_qlayer_load(const fl_ckpt *ck, const fl_model_config *cfg, int l, fl_qlayer *L);
void fl_qlayer_free(fl_qlayer *L);

fl_status fl_qlayer_capture_alloc(const fl_model_config *cfg, int64_t n, fl_qlayer_capture *c);
void fl_qlayer_capture_free(fl_qlayer_capture *c);

/* h_out[n, d] = layer(h_in[n, d]) over blocks of the given lengths (their
 * sum is n); c (or NULL) receives the linears' inputs. h_out may not alias
 * h_in. The linears run on be (NULL: the host; awq_calib.h), the rest on
 * the host. */
fl_status fl_qlayer_forward(fl_backend *be, const fl_model_config *cfg, const fl_qlayer *L, const float *h_in,
                            const int *blk_len, int n_blk, float *h_out, fl_qlayer_capture *c);

/* RMSNorm of n rows of d: out = x / rms(x) * w, on the pool's threads
 * (errors: kernels/pool.h). */
fl_status fl_qlayer_rmsnorm(const float *x, const float *w, int64_t n, int d, float eps, float *out);

#endif /* FL_QUANTIZE_LAYER_H */
