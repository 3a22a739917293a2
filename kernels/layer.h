/*
 * layer.h — a decoder layer as the plain sequence of backend ops: the
 * reference a backend's decode_layer is held to, what the forward pass runs
 * where a backend has no decode_layer (and for prompt rows), and the pieces
 * a decode_layer runs where it fuses nothing. Contracts: kernels/backend.h
 * (fl_layer_desc, fl_layer_step, decode_layer).
 */
#ifndef FL_LAYER_H
#define FL_LAYER_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* q, k and v of L from the normed rows s->h, q and k rotated (after L's
 * per-head norms where it has them), k and v stored into L's cache slots;
 * q stays in s->q, *q_stride elements a token. */
fl_status fl_layer_qkv(fl_backend *b, const fl_layer_desc *L, const fl_layer_step *s, int *q_stride);
/* The dense MLP's first half from the normed rows x: s->act =
 * silu(x gate^T) * (x up^T). */
fl_status fl_layer_gate_up(fl_backend *b, const fl_layer_desc *L, const fl_layer_step *s, const void *x);
/* moe_gate_up_silu as moe_matmul (gate, up, or the stacked pair into gu)
 * then silu_mul (kernels/backend.h). */
fl_status fl_layer_moe_gate_up(fl_backend *b, const void *x, int n, int k, const int32_t *list, int n_local,
                               const fl_tensor *gate_table, const fl_tensor *up_table, const fl_tensor *gate0,
                               const fl_tensor *up0, void *gu, void *out);
/* Sums buf (n x hidden activations) over the tensor-parallel group (s->reduce;
 * nothing without one). */
fl_status fl_layer_reduce(const fl_layer_step *s, void *buf);
/* The whole layer (decode_layer's contract; *h_state NONE or NORMED on
 * entry, NORMED on return), honouring s->skip. */
fl_status fl_layer_plain(fl_backend *b, const fl_layer_desc *L, const fl_tensor *next_norm, const fl_layer_step *s,
                         int *h_state);

#ifdef __cplusplus
}
#endif
#endif /* FL_LAYER_H */
