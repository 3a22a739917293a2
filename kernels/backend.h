/*
 * backend.h — the backend interface: a table of ops plus buffer management.
 *
 * The model's forward pass (runtime/model/forward.c) is written once against this
 * table; a backend (kernels/cpu/, kernels/cuda/) supplies the ops. Contracts
 * shared by every op:
 *  - Activation buffers ("act") hold elements of the backend's activation
 *    dtype (b->act_dtype: F32 on the CPU backend, BF16 on CUDA); their size
 *    in bytes is fl_backend_act_bytes(b, n_elems). Pointers are device
 *    pointers of the backend (host pointers on the CPU backend).
 *  - Index buffers (int32) and small float tables (cos/sin, router weights)
 *    live in backend memory too; callers upload them.
 *  - Ops never allocate; callers pass every buffer. Ops are enqueued on the
 *    backend's stream and may run asynchronously: sync() waits for them.
 *    download() is synchronous.
 *  - Every op returns FL_OK or a status with a recorded message; an
 *    unsupported dtype/quant combination fails loudly (FL_ERR_UNSUPPORTED).
 *  - Weights are fl_tensor descriptors whose data the backend owns after
 *    upload_weight (the CPU backend aliases host memory). Linear weights
 *    arrive as F32, F16, BF16, W4, Q8_0 (GGUF 8-bit blocks) or FP8 linears;
 *    a backend may convert at upload (CUDA: floats and Q8_0 to bf16).
 *  - FP8 linears (core/tensor.h: e4m3 codes, an f32 scale a row) are
 *    W8A8: matmul quantizes each token's activations x to e4m3 first,
 *    scale sx = max(absmax(x) / 448, FLT_MIN) (an all-zero row: 1; FLT_MIN
 *    keeps 1 / sx finite), code = e4m3(x * (1 / sx)) rounded to nearest
 *    even and saturated at 448, then
 *    y[i, r] = sx[i] * scale[r] * sum_c code_x[i, c] * code_w[r, c] (+ bias),
 *    the products exact and the sums in f32. Only matmul takes them. The
 *    one exception: CUDA holds a weight whose rows or columns are not
 *    multiples of 16 (or any, before cuBLAS 12.9) as bf16 of its values and
 *    multiplies unquantized activations (W8A16).
 * Row-major everywhere: x[n, d] means n rows of d contiguous elements.
 *
 * Graph capture (optional, NULL on backends without it): between
 * graph_begin and graph_end the ops are recorded instead of run, and
 * graph_launch replays them with the same pointers and launch parameters.
 * Only ops whose sizes do not change between replays may be recorded: the
 * step-varying data (ids, slots, context lengths, angles) must be read from
 * device buffers the caller refreshes before each launch. Nothing that
 * synchronizes (download, sync) may run while recording.
 */
#ifndef FL_BACKEND_H
#define FL_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_backend fl_backend;

/* Per-step attention metadata (device-resident arrays). Sequence s owns
 * query rows [q_start[s], q_start[s+1]) of the step; those are its newest
 * tokens, so query row i of s sits at position ctx_len[s] - n_q(s) + i and
 * attends (causally) to cached positions 0..that position. Its cached
 * tokens live in blocks block_tables[s * max_blocks + j], block_size tokens
 * each. K and V of this step must already be stored (kv_store). */
typedef struct fl_attn_meta {
    int n_seqs;
    const int32_t *q_start;      /* [n_seqs + 1] */
    const int32_t *ctx_len;      /* [n_seqs] */
    const int32_t *block_tables; /* [n_seqs, max_blocks] */
    int max_blocks;
    int block_size;
    int max_ctx_len;             /* max over ctx_len (host-known, sizes workspaces) */
    int max_q_len;               /* max query rows of one sequence (host-known), or 0 if
                                    unknown; backends size per-row parallelism with it */
} fl_attn_meta;

/* How moe_topk turns a row's router probabilities into picked experts and
 * their weights. */
typedef struct fl_moe_route {
    int n_group, topk_group; /* group-limited greedy (DeepSeek-V2) when 1 < topk_group < n_group:
                                experts form n_group equal ranges, only the topk_group groups with
                                the largest max-prob (ties: lower group) keep their probs, the
                                others' are 0; otherwise every expert competes */
    bool renorm;             /* weights = picked probs / their sum */
    float scale;             /* else weights = picked probs * scale (DeepSeek's
                                routed_scaling_factor; 1 for the others) */
} fl_moe_route;

/* Whether r asks for group-limited routing for this many experts. */
static inline bool fl_moe_route_grouped(const fl_moe_route *r, int n_experts) {
    return r->n_group > 1 && r->topk_group >= 1 && r->topk_group < r->n_group && n_experts % r->n_group == 0;
}

/* One logit row's sampling for sample_rows: the sampler's parameters
 * (core/sampler.h, already validated) and the row's uniform draw. */
typedef struct fl_sample_row {
    double u;                 /* the draw, in [0, 1); not used when temperature is 0 */
    float temperature;        /* 0: greedy (argmax after the penalty, lowest id on ties) */
    float top_p, min_p;       /* 1, 0: off */
    float penalty;            /* repetition penalty; 1: off */
    int32_t top_k;            /* 0: off */
    int32_t hist_lo, hist_n;  /* the row's history: hist[hist_lo, hist_lo + hist_n), ids in
                                 [0, d), read only when penalty != 1 */
    int32_t pad_;
} fl_sample_row;

/* A transformer layer as decode_layer sees it: views of the model's
 * weights (NULL: the layer has no such tensor) and its shapes. Linear
 * weights are upload_weight's descriptors; the cache pointers are the
 * layer's K and V arrays (see kv_store). */
typedef struct fl_layer_desc {
    const fl_tensor *attn_norm, *mlp_norm;
    const fl_tensor *wqkv, *bqkv;         /* stacked [q | k | v] rows (NULL: wq, wk, wv) and its bias */
    const fl_tensor *wq, *wk, *wv, *bq, *bk, *bv;
    const fl_tensor *q_norm, *k_norm;     /* per-head norms of q and k before RoPE (Qwen3), or NULL */
    const fl_tensor *wo, *bo;
    const fl_tensor *gate_up;             /* stacked [gate | up] rows (NULL: gate, up) */
    const fl_tensor *gate, *up, *down;    /* down NULL: no dense MLP (a MoE layer; the caller runs it) */
    void *k_cache, *v_cache;
    int n_heads, n_kv_heads, head_dim, rot_dim;
    bool rope_interleaved;                /* pairs (2i, 2i+1), else halves (see rope) */
    float eps, attn_scale;                /* both norms' epsilon; the softmax scale */
} fl_layer_desc;

/* One step as decode_layer sees it: n tokens (row i of sequence s at the
 * position fl_attn_meta gives), RoPE angles [n, rot_dim / 2], cache slots
 * [n] (negative: not stored), and the caller's buffers, activations sized
 * for n tokens: x the residual stream [n, hidden]; h [n, hidden] the
 * layer's normed input (see decode_layer); q [n, q|k|v width], k, v [n,
 * kv width], attn [n, n_heads * head_dim], o [n, hidden], gate [n, 2 inter],
 * up and act [n, inter]; ws FL_DECODE_LAYER_WS_BYTES of backend memory.
 * reduce (NULL: the whole layer on this rank) sums a buffer of n elements
 * over the tensor-parallel group; it runs after each row-parallel
 * projection (o, down), before its residual add. */
#define FL_DECODE_LAYER_WS_BYTES ((size_t)16 * 1024 * sizeof(float))
/* Stages of a layer a timing diagnostic leaves out (fl_layer_step.skip,
 * FL_DIAG_SKIP): the outputs are wrong with any of them set. */
enum {
    FL_SKIP_NORM_ATTN = 1u << 0, /* the residual add + RMSNorm before attention */
    FL_SKIP_QKV = 1u << 1,       /* q|k|v projection, RoPE, K/V store */
    FL_SKIP_ATTN = 1u << 2,      /* attention itself */
    FL_SKIP_O = 1u << 3,         /* output projection */
    FL_SKIP_NORM_MLP = 1u << 4,  /* the residual add + RMSNorm before the MLP */
    FL_SKIP_GATE_UP = 1u << 5,   /* dense MLP gate|up (+ SiLU) */
    FL_SKIP_DOWN = 1u << 6,      /* dense MLP down projection */
    FL_SKIP_HEAD = 1u << 7,      /* final norm and lm_head (the caller's) */
};
typedef struct fl_layer_step {
    int n, hidden;
    unsigned skip; /* FL_SKIP_* */
    const fl_attn_meta *meta;
    const float *cos, *sin;
    const int32_t *slots;
    void *x, *h, *q, *k, *v, *attn, *o, *gate, *up, *act, *ws;
    fl_status (*reduce)(void *ctx, void *buf, size_t n);
    void *reduce_ctx;
} fl_layer_step;

/* What fl_layer_step.h holds between decode_layer calls (*h_state). */
enum {
    FL_LAYER_H_NONE = 0,     /* nothing yet: the layer norms x itself */
    FL_LAYER_H_NORMED = 1,   /* rmsnorm(x) by the layer's input norm */
    FL_LAYER_H_BACKEND = 2,  /* the backend's own form of that (e.g. a deferred norm), which only
                                its next decode_layer call reads */
};

typedef struct fl_backend_ops {
    /* --- memory ------------------------------------------------------- */
    fl_status (*alloc)(fl_backend *b, size_t bytes, void **ptr);
    void (*free)(fl_backend *b, void *ptr);
    fl_status (*upload)(fl_backend *b, void *dst, const void *src, size_t bytes);
    fl_status (*download)(fl_backend *b, void *dst, const void *src, size_t bytes);
    fl_status (*memset0)(fl_backend *b, void *dst, size_t bytes);
    /* Device-to-device copy (enqueued; benchmarks time it as the bandwidth ceiling). */
    fl_status (*copy)(fl_backend *b, void *dst, const void *src, size_t bytes);
    fl_status (*sync)(fl_backend *b);
    /* Makes a host weight usable by the ops (dev receives the descriptor).
     * May repack; host must stay valid for the CPU backend (aliasing). */
    fl_status (*upload_weight)(fl_backend *b, const fl_tensor *host, fl_tensor *dev);
    void (*free_weight)(fl_backend *b, fl_tensor *dev);
    /* Converts n f32 host values into activation dtype at dst (device) and back. */
    fl_status (*upload_act)(fl_backend *b, void *dst, const float *src, size_t n);
    fl_status (*download_act)(fl_backend *b, float *dst, const void *src, size_t n);
    void (*destroy)(fl_backend *b);

    /* --- ops ---------------------------------------------------------- */
    /* out[i, :] = table[ids[i], :]; table [vocab, d] any float dtype. */
    fl_status (*embed)(fl_backend *b, const fl_tensor *table, const int32_t *ids, int n, void *out);
    /* out[i] = x[i] / rms(x[i]) * w; x, out [n, d] (out may equal x). */
    fl_status (*rmsnorm)(fl_backend *b, const void *x, const fl_tensor *w, float eps, int n, int d,
                         void *out);
    /* y[n, out] = x[n, in] @ w[out, in]^T (+ bias[out] when bias != NULL). */
    fl_status (*matmul)(fl_backend *b, const void *x, int n, const fl_tensor *w,
                        const fl_tensor *bias, void *y);
    /* In place on x[n_tok, n_heads, head_dim] with row stride `stride`
     * elements between tokens: rotates the first rot_dim dims of every head
     * by angle table cos/sin [n_tok, rot_dim/2] (f32). interleaved pairs
     * (2i, 2i+1), else halves (i, i + rot_dim/2). */
    fl_status (*rope)(fl_backend *b, void *x, int n_tok, int n_heads, int head_dim, int stride,
                      const float *cos, const float *sin, int rot_dim, bool interleaved);
    /* rope(q) and rope(k) (as above, same angles) fused with kv_store(k, v):
     * q [n_tok, n_heads, head_dim] row stride q_stride and k [n_tok,
     * n_kv_heads, head_dim] row stride kv_stride are rotated in place, then
     * k and v (row stride kv_stride) go to cache slots (negative: skipped).
     * Exactly the three ops in that order. */
    fl_status (*rope_kv_store)(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                               int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                               const float *cos, const float *sin, int rot_dim, bool interleaved,
                               const int32_t *slots, void *k_cache, void *v_cache);
    /* Writes k, v [n_tok, kv_dim] (row stride `stride`) to cache slots
     * slots[i] (= block * block_size + offset); caches [n_slots, kv_dim].
     * A negative slot skips its row (padding rows of a captured step). */
    fl_status (*kv_store)(fl_backend *b, const void *k, const void *v, int n_tok, int kv_dim,
                          int stride, const int32_t *slots, void *k_cache, void *v_cache);
    /* out[n_tok, n_heads, head_dim] = softmax(q k^T * scale) v over the
     * paged cache (see fl_attn_meta), GQA: head h reads kv head
     * h / (n_heads / n_kv_heads). q has row stride q_stride. A query row
     * that sees no position (ctx_len 0: a padding sequence) outputs zeros. */
    fl_status (*attention)(fl_backend *b, const void *q, int q_stride, const fl_attn_meta *m,
                           int n_heads, int n_kv_heads, int head_dim, float scale,
                           const void *k_cache, const void *v_cache, void *out);
    /* out[n, d] = silu(gate[n, d]) * up[n, d]; gate and up rows are `stride`
     * elements apart (d: contiguous; 2 d: the halves of one fused gate|up
     * matmul output), out is contiguous. */
    fl_status (*silu_mul)(fl_backend *b, const void *gate, const void *up, int n, int d, int stride, void *out);
    /* x[n] += y[n]. */
    fl_status (*add)(fl_backend *b, void *x, const void *y, size_t n);
    /* Residual add fused with the next norm: x[n, d] += y[n, d] (rounded to
     * the activation dtype), then out[i] = x[i] / rms(x[i]) * w, exactly
     * add() followed by rmsnorm(x -> out). out must not alias x or y. */
    fl_status (*add_rmsnorm)(fl_backend *b, void *x, const void *y, const fl_tensor *w, float eps,
                             int n, int d, void *out);
    /* Router: probs = softmax(logits[n, n_experts]) (f32 math), masked by
     * group as r says; picks the k largest per row (ties: lower id first);
     * weights from the picked probs as r says (fl_moe_route). ids/weights
     * [n, k] device. */
    fl_status (*moe_topk)(fl_backend *b, const void *logits, int n, int n_experts, int k,
                          const fl_moe_route *r, int32_t *ids, float *weights);
    /* dst[i, :] = src[idx[i], :] for i < n_idx; rows of d elements. */
    fl_status (*gather_rows)(fl_backend *b, const void *src, const int32_t *idx, int n_idx, int d,
                             void *dst);
    /* dst[idx[i], :] += scale[i] * src[i, :] (scale NULL = 1); idx may repeat
     * only across separate calls. */
    fl_status (*scatter_add_rows)(fl_backend *b, void *dst, const void *src, const int32_t *idx,
                                  const float *scale, int n_idx, int d);
    /* x[i, :] *= sigmoid(g[i]) for i < n, g [n] activations. */
    fl_status (*sigmoid_scale_rows)(fl_backend *b, void *x, const void *g, int n, int d);
    /* Multi-head latent attention (DeepSeek-V2) over the paged cache, with
     * the key/value up-projection folded in. Each cached token is one
     * record r = [c (kv_lora) | k_pe (rope)] of rec = kv_lora + rope
     * elements: r[0, rec/2) at k_cache + slot*rec/2, r[rec/2, rec) at
     * v_cache + slot*rec/2 (c normed, k_pe rotated). q [n_tok, n_heads,
     * nope + rope] contiguous (q_pe rotated); wkv_b [n_heads * (nope + v),
     * kv_lora] (this rank's heads: rows of head h are [k_nope-up (nope) |
     * v-up (v)]). For head h: k_t = [W_uk,h c_t | k_pe_t], v_t = W_uv,h c_t,
     * out[n_tok, n_heads, v] = softmax(q k^T * scale) v, causal as in
     * attention(). */
    fl_status (*mla_attention)(fl_backend *b, const void *q, const fl_attn_meta *m, int n_heads,
                               int nope, int rope, int v_dim, int kv_lora, float scale,
                               const fl_tensor *wkv_b, const void *k_cache, const void *v_cache,
                               void *out);
    /* Greedy pick per row of x [n, d] (activations): out[2 i] = the row's
     * largest value, out[2 i + 1] = (float)(offset + the lowest j holding
     * it), like torch.argmax; a row with a NaN gives out[2 i] = NaN. offset
     * (a vocabulary shard's first id) + d <= 2^24, so the id is exact in
     * f32. out: 2 n floats of backend memory. Lets a greedy step bring 8
     * bytes per row to the host instead of the vocabulary. */
    fl_status (*argmax_rows)(fl_backend *b, const void *x, int n, int d, int offset, float *out);
    /* Sampling where the logits are (NULL: the host samples downloaded
     * logits). For each row i of x [n, d] (activations, the whole
     * vocabulary): the token fl_sampler_sample_u (core/sampler.h) picks
     * with rows[i]'s parameters, history and draw. out[2 i] = the token and
     * out[2 i + 1] = 0; or out[2 i + 1] = 1 and out[2 i] = the first id
     * whose logit (after the penalty) is NaN; or out[2 i + 1] = 2: every
     * logit is -inf and the row samples. rows [n], hist, out [2 n]: backend
     * memory; ws: sample_rows_ws(b, n, d) bytes of backend memory (0: the
     * backend does not take this size). any_top_p: some row has top_p < 1
     * (false: no row can need CUDA's full sort, whose check it skips). Lets a
     * sampled step bring 8 bytes per row to the host instead of the
     * vocabulary, and keeps the filters off the host's one core. */
    /* dst[i * dst_stride + j] = src[i * src_stride + j] for i < n, j < w
     * (activations, strides in elements): lays gathered vocabulary shards
     * out as rows for sample_rows under tensor parallelism. */
    fl_status (*copy_2d)(fl_backend *b, void *dst, int dst_stride, const void *src, int src_stride, int n,
                         int w);
    size_t (*sample_rows_ws)(fl_backend *b, int n, int d);
    fl_status (*sample_rows)(fl_backend *b, const void *x, int n, int d, const fl_sample_row *rows,
                             const int32_t *hist, bool any_top_p, void *ws, int32_t *out);

    /* --- experts routed on the device (NULL: the host routes them, with
     * one download of the top-k per MoE layer; runtime/model/forward_moe_dev.c) */
    /* Groups the n * k routed pairs p = token * k + slot (ids [n, k]: global
     * expert ids) by this rank's experts [e_lo, e_lo + n_local): list[j] is
     * where local expert j's pairs start, list[n_local] how many pairs are
     * routed here, and list[n_local + 1 + i] the pairs, ascending within
     * each expert. list: n_local + 1 + n * k int32 of backend memory. */
    fl_status (*moe_group)(fl_backend *b, const int32_t *ids, int n, int k, int e_lo, int n_local,
                           int32_t *list);
    /* For every pair p that list (moe_group) gives local expert j:
     * out[p, :] = x[x_per_pair ? p : p / k, :] @ W_j^T, W_j = table[j]
     * (n_local descriptors of backend memory, each as upload_weight made it,
     * all of the shape and dtype of w0, a host copy of table[0]: the launch
     * is sized from it and from n, never from device data, so a graph can
     * record it). Rows of pairs not routed here are left as they are. Only
     * the experts with pairs read their weights. n = 0 only checks that the
     * backend can run w0's dtype and layout (FL_ERR_UNSUPPORTED if not). */
    fl_status (*moe_matmul)(fl_backend *b, const void *x, int x_per_pair, int n, int k, const int32_t *list,
                            int n_local, const fl_tensor *table, const fl_tensor *w0, void *out);
    /* acc[i, :] = the sum of weights[i k + j] * src[i k + j, :] over token
     * i's pairs whose expert is local (0 when none), added from zero in
     * ascending expert order and rounded after each add as scatter_add_rows
     * rounds (so it equals the host-routed path's zeroed buffer plus one
     * expert at a time, bit for bit). acc, src activations [n, d], [n k, d]. */
    fl_status (*moe_combine)(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                             const float *weights, int n, int k, int e_lo, int n_local, int d);

    /* --- graph capture (NULL: not supported; see the top of this file) -- */
    /* Starts recording the backend's stream. */
    fl_status (*graph_begin)(fl_backend *b);
    /* Stops recording. keep: instantiate the recording into *graph (an
     * opaque handle for graph_launch); otherwise discard it (after a failed
     * op) and set *graph = NULL. */
    fl_status (*graph_end)(fl_backend *b, bool keep, void **graph);
    /* Enqueues one replay of the recorded ops on the stream. */
    fl_status (*graph_launch)(fl_backend *b, void *graph);
    /* NULL is a no-op. */
    void (*graph_free)(fl_backend *b, void *graph);

    /* --- page-locked host memory (NULL: not supported; use malloc) ------ */
    /* Host memory that download() can fill at full bus speed (CUDA:
     * cudaMallocHost). Allocate once, outside the hot path. */
    fl_status (*host_alloc)(fl_backend *b, size_t bytes, void **ptr);
    /* NULL is a no-op. */
    void (*host_free)(fl_backend *b, void *ptr);

    /* --- cross-stream ordering (NULL: one in-order queue, nothing to order) */
    /* Work enqueued on stream `waiter` after this call starts only once
     * everything enqueued on stream `signaler` before it has completed; the
     * host does not wait. NULL names the backend's own stream; any other
     * stream is a cudaStream_t (as void *) of the backend's device, e.g. an
     * NCCL communicator's (fl_comm_stream). The MoE all-to-all uses it both
     * ways to overlap one micro-batch's exchange with the other's experts
     * (runtime/model/forward_moe.c). Not allowed while recording a graph. */
    fl_status (*stream_wait)(fl_backend *b, void *waiter, void *signaler);
    /* The backend's own stream as the native handle (a cudaStream_t as
     * void *), for a communicator that should enqueue its collectives on
     * it; NULL member or NULL result: the backend has no such stream. The
     * backend keeps ownership. */
    void *(*native_stream)(fl_backend *b);

    /* --- one decode layer (NULL: the caller runs the plain ops) --------- */
    /* Layer L of a decode step s (a step whose sequences have one query
     * row each), what the plain op sequence does, with the backend's own
     * fusions: x += o(attention(q|k|v(h))) (reduce first), then, where L has
     * a dense MLP, x += down(silu(gate(h')) * up(h')) with h' = rmsnorm(x) by
     * mlp_norm (reduce first). On entry *h_state says what s->h holds: NONE
     * (the op norms x by attn_norm first), NORMED, or BACKEND (left by its
     * previous call, for this layer). On return s->h holds the input of
     * what follows: without a dense MLP, rmsnorm(x) by mlp_norm (NORMED; the
     * caller's MoE block reads it); else rmsnorm(x) by next_norm (the next
     * layer's attn_norm or the final norm), NORMED, or the BACKEND form of
     * it when next (the next layer, NULL for the last) is one the backend
     * takes it into. Results match the plain sequence up to bf16 rounding
     * (CUDA: see docs/cuda.md). */
    fl_status (*decode_layer)(fl_backend *b, const fl_layer_desc *L, const fl_layer_desc *next,
                              const fl_tensor *next_norm, const fl_layer_step *s, int *h_state);

    /* --- combined ops: each what the ops it names give, which a backend may
     * run as one pass (NULL: not supported; the caller runs those ops) ---- */
    /* The routed experts' gated MLP first half (see moe_matmul): for every
     * pair p that list gives local expert j, out[p, :] = silu(x[p / k] @
     * gate_j^T) * (x[p / k] @ up_j^T), what moe_matmul (gate), moe_matmul
     * (up) and silu_mul give (CUDA: one routed W4 GEMV pass where it takes
     * the weights; kernels/layer.c's fl_layer_moe_gate_up otherwise). Rows
     * of pairs routed to other ranks are left unspecified. up_table NULL:
     * gate_table holds the stacked [2 d, in] gate|up weights. gate0 and up0
     * (NULL when stacked): host copies of expert 0's descriptors. gu: [n k,
     * 2 d] activations of scratch. */
    fl_status (*moe_gate_up_silu)(fl_backend *b, const void *x, int n, int k, const int32_t *list, int n_local,
                                  const fl_tensor *gate_table, const fl_tensor *up_table, const fl_tensor *gate0,
                                  const fl_tensor *up0, void *gu, void *out);
    /* The end of a MoE layer in one pass: exactly moe_combine(acc, src,
     * ids, weights, n, k, e_lo, n_local, d), then, extra not NULL (the
     * shared expert's output), add(acc, extra), then add_rmsnorm(x, acc, w,
     * eps, n, d, out): x += the layer's sum, out = rmsnorm(x) (CUDA: one
     * launch for three; the CPU backend runs the ops in order). The caller
     * uses it where no reduction sits between the combine and the norm. */
    fl_status (*moe_combine_add_rmsnorm)(fl_backend *b, void *acc, const void *src, const int32_t *ids,
                                         const float *weights, int n, int k, int e_lo, int n_local, int d,
                                         const void *extra, void *x, const fl_tensor *w, float eps, void *out);
    /* Qwen3's per-head q and k norms before the rotation: exactly
     * rmsnorm of every head of q (n_heads a token, row stride q_stride) by
     * q_norm and of k's (n_kv_heads, kv_stride) by k_norm, in place, then
     * rope_kv_store with the same arguments (CUDA: one launch, a warp a
     * head, for three; the norms' squares summed in another order; the CPU
     * backend runs the ops in order). Strided rows let q, k and v come
     * from one fused q|k|v matmul. */
    fl_status (*qknorm_rope_kv_store)(fl_backend *b, void *q, void *k, const void *v, int n_tok, int n_heads,
                                      int n_kv_heads, int head_dim, int q_stride, int kv_stride,
                                      const fl_tensor *q_norm, const fl_tensor *k_norm, float eps,
                                      const float *cos, const float *sin, int rot_dim, bool interleaved,
                                      const int32_t *slots, void *k_cache, void *v_cache);
    /* DeepSeek-V2's MLA inputs after their projections (qk = nope + rope
     * elements a head, a cache record rec = kvl + rope, split over the K and
     * V arrays, rec / 2 each): exactly rope(q + nope, n_tok, n_heads, qk,
     * q_stride, cos, sin, rope, true) (every head's q_pe), rope(ckv + kvl,
     * n_tok, 1, rope, rec, cos, sin, rope, true) (the shared k_pe), rmsnorm
     * of each row's latent ckv[t, 0 .. kvl) by kv_norm in place, then
     * kv_store(ckv, ckv + rec / 2, n_tok, rec / 2, rec, slots, k_cache,
     * v_cache) (CUDA: one launch for six at a decode step, 4 + 2 n_tok
     * with the latent's copies; the norm's squares summed in another
     * order; the CPU backend runs the ops in order). */
    fl_status (*mla_rope_norm_store)(fl_backend *b, void *q, int q_stride, void *ckv, int n_tok, int n_heads,
                                     int nope, int rope, int kvl, const float *cos, const float *sin,
                                     const fl_tensor *kv_norm, float eps, const int32_t *slots, void *k_cache,
                                     void *v_cache);
    /* --- profiler (NULL: nothing to mark) -------------------------------- */
    /* Starts (on) or stops the range an attached profiler records (CUDA:
     * cudaProfilerStart/Stop; Nsight Compute with --profile-from-start off
     * then sees only that range). Without a profiler it does nothing. */
    fl_status (*profile_range)(fl_backend *b, bool on);

    /* --- memory accounting (NULL: the backend's memory is host memory) --- */
    /* Free and total bytes of the device (CUDA: cudaMemGetInfo on the
     * backend's device); the engine logs them around each start-up phase
     * and sizes the KV cache from them. */
    fl_status (*mem_info)(fl_backend *b, size_t *free_bytes, size_t *total_bytes);

    /* --- KV block moves (NULL: the caller copies block by block with
     * upload and download) ---------------------------------------------- */
    /* The KV cache's swap: for i < n, block dst_ids[i] of dst receives block
     * src_ids[i] of src, blocks of block_bytes bytes. to_host: src is
     * backend memory and dst host memory; else the reverse. Host memory
     * should come from host_alloc where the backend has it (CUDA: a pageable
     * buffer makes each copy wait). Enqueued on the backend's stream, so
     * ordered with the ops before and after it: the host must not touch
     * those host blocks before sync(). ids (host arrays) are the caller's to
     * check. Not allowed while recording a graph. */
    fl_status (*copy_blocks)(fl_backend *b, void *dst, const void *src, const int32_t *dst_ids,
                             const int32_t *src_ids, int n, size_t block_bytes, bool to_host);

    /* --- capabilities ---------------------------------------------------- */
    /* The store ops, attention and the fused q|k|v paths honour
     * fl_backend.kv_int8_head_dim (int8 KV records); false: the cache
     * holds activations only. */
    bool kv_int8;
    /* mla_attention reads int8 records too (kv_int8_head_dim-value groups). */
    bool kv_int8_mla;
    /* The same ops honour fl_backend.kv_fp8_codes (records of e4m3 codes;
     * MLA too where kv_int8_mla is set). */
    bool kv_fp8;
    /* A backend of f32 activations whose store ops, attention and
     * mla_attention honour fl_backend.kv_bf16 (a 16-bit cache). */
    bool kv_bf16;
    /* The store ops and attention honour fl_backend.kv_block_size (a cache
     * laid out head by head within each block). */
    bool kv_blocked;
} fl_backend_ops;

struct fl_backend {
    const fl_backend_ops *ops;
    const char *name;   /* "cpu", "cuda" */
    fl_dtype act_dtype; /* F32 or BF16 */
    /* The KV cache's records: 0, activations of act_dtype (kv_dim per
     * slot); > 0 (backends whose ops->kv_int8 is set: CPU and CUDA), int8:
     * each slot holds kv_dim int8 values (padded to 4 bytes) then one f32
     * scale (absmax / 127) per this many values (a head), the record padded
     * to 16 bytes (fl_kv_int8_record_bytes: 16-byte rows for vector copies).
     * Set by whoever makes the cache (runtime/engine/kv_cache.c) before any
     * op reads it; the store ops quantize, attention reads the records as
     * stored. */
    int kv_int8_head_dim;
    /* With kv_int8_head_dim > 0: the records hold float8_e4m3fn codes
     * instead of int8, scale absmax / 448 (fl_f32_to_f8e4m3: ties to even,
     * saturating), the same layout and bytes. */
    bool kv_fp8_codes;
    /* With act_dtype F32 (backends whose ops->kv_bf16 is set: CPU): each
     * slot holds kv_dim bf16 values instead of f32, half the bytes that
     * long-context decode reads; the store ops round to nearest even. */
    bool kv_bf16;
    /* f32 / bf16 caches where ops->kv_blocked is set (CPU): > 0, each block
     * of this many slots holds its values head by head, [block][KV head]
     * [slot in block][kv_head_dim], so the attention reads one head's
     * positions as contiguous runs (a 16-slot block of a 64-value head:
     * 4 KiB in f32) rather than a head's values every kv_dim; 0: slot by
     * slot, [slot][kv_dim]. Set with kv_head_dim by the cache's maker;
     * MLA's records stay slot by slot. */
    int kv_block_size;
    int kv_head_dim;
    const char *detail; /* which kernels it chose, for --verbose; NULL: nothing to tell */
    void *impl;
};

static inline size_t fl_kv_int8_record_bytes(int64_t kv_dim, int head_dim) {
    const size_t b = (size_t)((kv_dim + 3) & ~(int64_t)3) + (size_t)(kv_dim / head_dim) * sizeof(float);
    return (b + 15) & ~(size_t)15;
}

static inline size_t fl_backend_act_bytes(const fl_backend *b, size_t n) {
    return n * (b->act_dtype == FL_DTYPE_F32 ? 4 : 2);
}

/* Creates the CPU reference backend (f32 activations, kernels/pool.h threads). */
fl_status fl_backend_cpu_init(fl_backend **out);
/* Device memory the CUDA backend allocates once, at the first packed W4
 * weight: the W4 GEMM's split-k workspace, 768 partial tiles of 256 x 32 f32
 * and 1024 counters (kernels/cuda/cuda_w4_gemm.cu checks it); the memory
 * planner counts it. */
#define FL_CUDA_W4_GEMM_WS_BYTES ((size_t)768 * 256 * 32 * 4 + 1024 * 4)

/* Creates the CUDA backend on the given device; FL_ERR_UNSUPPORTED when
 * flotilla was built without CUDA or no GPU is visible. */
fl_status fl_backend_cuda_init(int device, fl_backend **out);
/* "auto" (CUDA when a GPU is visible, else CPU), "cpu" or "cuda". */
fl_status fl_backend_init_by_name(const char *name, int device, fl_backend **out);

/* b's native stream (ops->native_stream), or NULL where it has none. */
void *fl_backend_native_stream(fl_backend *b);
/* NULL is a no-op. */
void fl_backend_free(fl_backend *b);

#ifdef __cplusplus
}
#endif
#endif /* FL_BACKEND_H */
