/*
 * test_backend_ops.c — every op of the backend table (kernels/backend.h) on
 * every backend present, in the manner of ggml's test-backend-ops: one table
 * of cases {op, shapes, dtype, tolerances}, each case run
 *   1. as an independent float64 scalar reference written here (plain loops,
 *      the "obviously right" math of the op's contract in backend.h; the
 *      quantized weights are decoded here from their documented layouts),
 *   2. on the CPU backend, compared with (1) at the case's tol_ref: this is
 *      what CI (no GPU) checks, so a broken CPU op fails it;
 *   3. on the CUDA backend when fl_backend_cuda_init succeeds, compared with
 *      the CPU backend's output at tol_dev (bf16 activations there).
 * Inputs are random, rounded to bf16 so every backend sees the same numbers,
 * and regenerated from the case's seed for each run. Outputs of the devices
 * are poisoned (NaN) first where the op writes a fresh buffer.
 *
 * Error measure (as ggml normalizes): per output row, max |got - ref| /
 * max |ref| over the row; a case's error is the worst row of any output.
 * Integer outputs (ids, lists, argmax positions) must match exactly; a NaN
 * where the reference has none fails.
 *
 * Shapes are awkward on purpose (1, 7, 19, 111, 500 rows; widths that are no
 * power of two; batch 19 of decode rows; paged block tables in scattered
 * order; padding rows with slot -1 and context 0).
 *
 * Each case is one row of g_cases; delete a row to drop a case.
 *
 *   test_backend_ops                 CPU vs float64, then CUDA vs CPU
 *   test_backend_ops --perf [reps]   also times each case's op per backend
 *   test_backend_ops --filter TEXT   only the cases whose name holds TEXT
 *   test_backend_ops --all           also the large cases against float64 (slow
 *                                    on 2 cores; they always run on the devices)
 * FL_REQUIRE_GPU=1: a CUDA backend that cannot start fails the run instead of
 * skipping the device part (what a GPU run sets, scripts/gpu-check.sh).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "core/status.h"
#include "core/tensor.h"
#include "core/option.h"
#include "kernels/backend.h"
#include "runtime/load/quant.h"

/* --- the case table ---------------------------------------------------------------- */

typedef enum op_id {
    OP_EMBED, OP_RMSNORM, OP_MATMUL, OP_ROPE, OP_ROPE_KV_STORE, OP_KV_STORE, OP_ATTENTION, OP_SILU_MUL,
    OP_ADD, OP_ADD_RMSNORM, OP_MOE_TOPK, OP_GATHER_ROWS, OP_SCATTER_ADD_ROWS, OP_SIGMOID_SCALE_ROWS,
    OP_MLA_ATTENTION, OP_ARGMAX_ROWS, OP_COPY_2D, OP_SAMPLE_ROWS, OP_MOE_GROUP, OP_MOE_MATMUL, OP_MOE_COMBINE,
    OP_MOE_COMBINE_ADD_RMSNORM, OP_QKNORM_ROPE_KV_STORE, OP_MLA_ROPE_NORM_STORE, OP_COUNT
} op_id;

static const char *const OP_NAMES[OP_COUNT] = {
    "embed", "rmsnorm", "matmul", "rope", "rope_kv_store", "kv_store", "attention", "silu_mul",
    "add", "add_rmsnorm", "moe_topk", "gather_rows", "scatter_add_rows", "sigmoid_scale_rows",
    "mla_attention", "argmax_rows", "copy_2d", "sample_rows", "moe_group", "moe_matmul", "moe_combine",
    "moe_combine_add_rmsnorm", "qknorm_rope_kv_store", "mla_rope_norm_store"};

/* p[] holds the op's shape parameters; the macros below name them. dt is
 * the weight dtype where the op takes a weight (matmul, embed, moe_matmul;
 * FL_DTYPE_Q4_0 / Q4_1 go through the GGUF loader's conversion to W4). */
typedef struct tcase {
    op_id op;
    fl_dtype dt;
    int p[10];
    double tol_ref; /* CPU backend vs the float64 reference */
    double tol_dev; /* other backends vs the CPU backend */
    bool big;       /* too slow for the float64 reference in CI: checked against the CPU
                       backend on the devices only (and against float64 with --all) */
} tcase;

/* Activation dtype of the device backends (bf16): the output rounding alone
 * is up to 2^-9 relative, accumulation order adds to it; f16/f32 weights
 * become bf16 on CUDA; W4 scales/biases become f16 there. */
#define DEV_ELEM 1e-2
#define DEV_W4 2e-2

/* embed: vocab, d, n tokens */
/* (f16 tables become bf16 on CUDA: not exact there) */
#define EMBED(dt, V, d, n) {OP_EMBED, dt, {V, d, n}, 0, (dt) == FL_DTYPE_F16 ? DEV_ELEM : 0, false}
/* rmsnorm: n, d, in place (out == x) */
#define RMSNORM(n, d, inpl) {OP_RMSNORM, FL_DTYPE_F32, {n, d, inpl}, 2e-6, DEV_ELEM, false}
/* matmul: n, in, out, W4 group (0: the dtype's own), bias */
#define MATMUL(dt, n, in, out, group, bias, tref, tdev) {OP_MATMUL, dt, {n, in, out, group, bias}, tref, tdev, false}
#define MATMUL_BIG(dt, n, in, out, group, bias, tref, tdev) {OP_MATMUL, dt, {n, in, out, group, bias}, tref, tdev, true}
/* rope: n_tok, n_heads, head_dim, extra row stride, rot_dim, interleaved */
#define ROPE(n, nh, hd, pad, rot, il) {OP_ROPE, FL_DTYPE_F32, {n, nh, hd, pad, rot, il}, 1e-6, DEV_ELEM, false}
/* rope_kv_store: n_tok, n_heads, n_kv_heads, head_dim, rot_dim, interleaved, n_slots */
#define ROPE_KV(n, nh, nkv, hd, rot, il, slots) \
    {OP_ROPE_KV_STORE, FL_DTYPE_F32, {n, nh, nkv, hd, rot, il, slots}, 1e-6, DEV_ELEM, false}
/* kv_store: n_tok, kv_dim, extra row stride, n_slots */
#define KV_STORE(n, kvd, pad, slots) {OP_KV_STORE, FL_DTYPE_F32, {n, kvd, pad, slots}, 0, 0, false}
/* attention: n_heads, n_kv_heads, head_dim, block_size, case of seq list (ATTN_SEQS) */
#define ATTN(nh, nkv, hd, bs, seqs) {OP_ATTENTION, FL_DTYPE_F32, {nh, nkv, hd, bs, seqs}, 1e-5, DEV_ELEM, false}
/* silu_mul: n, d, fused gate|up rows (stride 2 d) */
#define SILU_MUL(n, d, fused) {OP_SILU_MUL, FL_DTYPE_F32, {n, d, fused}, 1e-6, DEV_ELEM, false}
/* add: rows, width (n = rows * width) */
#define ADD(n, d) {OP_ADD, FL_DTYPE_F32, {n, d}, 1e-7, DEV_ELEM, false}
/* add_rmsnorm: n, d, weight bf16 (else f32) */
#define ADD_RMSNORM(n, d, wbf) {OP_ADD_RMSNORM, FL_DTYPE_F32, {n, d, wbf}, 2e-6, DEV_ELEM, false}
/* moe_topk: n, n_experts, k, renorm, n_group, topk_group, scale x 100 */
#define MOE_TOPK(n, E, k, rn, ng, tg, sc) {OP_MOE_TOPK, FL_DTYPE_F32, {n, E, k, rn, ng, tg, sc}, 1e-6, 1e-4, false}
/* gather_rows: n_src, n_idx, d */
#define GATHER(ns, ni, d) {OP_GATHER_ROWS, FL_DTYPE_F32, {ns, ni, d}, 0, 0, false}
/* scatter_add_rows: n_dst, n_idx, d, with scales */
#define SCATTER(nd, ni, d, sc) {OP_SCATTER_ADD_ROWS, FL_DTYPE_F32, {nd, ni, d, sc}, 1e-6, DEV_ELEM, false}
/* sigmoid_scale_rows: n, d */
#define SIGMOID(n, d) {OP_SIGMOID_SCALE_ROWS, FL_DTYPE_F32, {n, d}, 1e-6, DEV_ELEM, false}
/* mla_attention: n_heads, nope, rope, v_dim, kv_lora, block_size, seq list */
#define MLA(nh, nope, rope, v, kvl, bs, seqs) \
    {OP_MLA_ATTENTION, FL_DTYPE_F32, {nh, nope, rope, v, kvl, bs, seqs}, 1e-5, 2e-2, false}
/* argmax_rows: n, d, offset */
#define ARGMAX(n, d, off) {OP_ARGMAX_ROWS, FL_DTYPE_F32, {n, d, off}, 0, 0, false}
/* copy_2d: n, w, dst stride pad, src stride pad */
#define COPY2D(n, w, dp, sp) {OP_COPY_2D, FL_DTYPE_F32, {n, w, dp, sp}, 0, 0, false}
/* sample_rows: n, d, mode (SAMPLE_*) */
#define SAMPLE(n, d, mode) {OP_SAMPLE_ROWS, FL_DTYPE_F32, {n, d, mode}, 0, 0, false}
/* moe_group: n, k, n_experts, e_lo, n_local */
#define MOE_GROUP(n, k, E, lo, nl) {OP_MOE_GROUP, FL_DTYPE_F32, {n, k, E, lo, nl}, 0, 0, false}
/* moe_matmul: n, k, n_experts, e_lo, n_local, in, out, x per pair, W4 group */
#define MOE_MATMUL(dt, n, k, E, lo, nl, in, out, pp, g, tref, tdev) \
    {OP_MOE_MATMUL, dt, {n, k, E, lo, nl, in, out, pp, g}, tref, tdev, false}
/* moe_combine: n, k, n_experts, e_lo, n_local, d */
#define MOE_COMBINE(n, k, E, lo, nl, d) {OP_MOE_COMBINE, FL_DTYPE_F32, {n, k, E, lo, nl, d}, 1e-6, DEV_ELEM, false}
/* moe_combine_add_rmsnorm: n, k, n_experts, e_lo, n_local, d, with extra */
#define MOE_CAR(n, k, E, lo, nl, d, ex) \
    {OP_MOE_COMBINE_ADD_RMSNORM, FL_DTYPE_F32, {n, k, E, lo, nl, d, ex}, 2e-6, 2e-2, false}
/* qknorm_rope_kv_store: as ROPE_KV */
#define QKNORM(n, nh, nkv, hd, rot, il, slots) \
    {OP_QKNORM_ROPE_KV_STORE, FL_DTYPE_F32, {n, nh, nkv, hd, rot, il, slots}, 2e-6, 2e-2, false}
/* mla_rope_norm_store: n_tok, n_heads, nope, rope, kv_lora, n_slots */
#define MLA_PREP(n, nh, nope, rope, kvl, slots) \
    {OP_MLA_ROPE_NORM_STORE, FL_DTYPE_F32, {n, nh, nope, rope, kvl, slots}, 2e-6, 2e-2, false}

/* Sequence lists of the attention cases: {n_seqs, ctx_len..., q_len...}. */
static const int ATTN_SEQ_LISTS[][41] = {
    {3, 1, 17, 500, 1, 1, 1},           /* 0: decode rows of three contexts */
    {3, 1, 17, 500, 1, 17, 111},        /* 1: prefill: a chunk of a longer prompt last */
    {1, 33, 33},                        /* 2: one whole prompt */
    {4, 16, 48, 128, 1, 1, 1, 1, 1},    /* 3: decode of short contexts */
    {4, 5, 0, 40, 0, 1, 1, 1, 1},       /* 4: padding sequences (context 0) among real ones */
    {19, 1, 7, 13, 19, 25, 31, 37, 43, 49, 55, 61, 67, 73, 79, 85, 91, 97, 103, 520, /* 5: batch 19 */
     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 7, 111, 7, 3},                  /* 6: prefill and decode mixed */
};

/* sample_rows modes */
enum { SAMPLE_GREEDY, SAMPLE_PENALTY, SAMPLE_TOPK, SAMPLE_TOPP, SAMPLE_MINP, SAMPLE_ALL };

static const tcase g_cases[] = {
    EMBED(FL_DTYPE_F32, 1000, 500, 19),
    EMBED(FL_DTYPE_BF16, 311, 96, 7),
    EMBED(FL_DTYPE_F16, 50, 64, 1),
    RMSNORM(1, 500, 0),
    RMSNORM(19, 4096, 0),
    RMSNORM(7, 111, 1),
    RMSNORM(111, 96, 0),
    RMSNORM(1, 4096, 1),
    RMSNORM(19, 500, 1),
    MATMUL(FL_DTYPE_F32, 1, 500, 111, 0, 0, 1e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_F32, 7, 500, 111, 0, 1, 1e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_F32, 19, 4096, 1000, 0, 0, 2e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_F32, 111, 500, 111, 0, 0, 1e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_F32, 19, 500, 111, 0, 0, 1e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_F32, 1, 4096, 1000, 0, 0, 2e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_F32, 7, 4096, 1000, 0, 1, 2e-5, DEV_ELEM),
    MATMUL_BIG(FL_DTYPE_F32, 111, 4096, 1000, 0, 0, 2e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_BF16, 1, 96, 311, 0, 0, 1e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_BF16, 19, 500, 111, 0, 1, 1e-5, DEV_ELEM),
    MATMUL(FL_DTYPE_F16, 7, 500, 111, 0, 0, 1e-5, 2e-2),
    MATMUL(FL_DTYPE_F16, 1, 4096, 256, 0, 1, 2e-5, 2e-2),
    MATMUL(FL_DTYPE_W4, 1, 4096, 111, 32, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 7, 4096, 111, 32, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 19, 4096, 111, 32, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 111, 4096, 111, 32, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 1, 4096, 14336, 32, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 7, 4096, 14336, 32, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 19, 4096, 14336, 32, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 111, 4096, 14336, 32, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 1, 4096, 111, 64, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 7, 4096, 111, 64, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 19, 4096, 111, 64, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 111, 4096, 111, 64, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 1, 4096, 14336, 64, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 7, 4096, 14336, 64, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 19, 4096, 14336, 64, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 111, 4096, 14336, 64, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 1, 4096, 111, 128, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 7, 4096, 111, 128, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 19, 4096, 111, 128, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 111, 4096, 111, 128, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 1, 4096, 14336, 128, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 7, 4096, 14336, 128, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 19, 4096, 14336, 128, 0, 2e-5, DEV_W4),
    MATMUL_BIG(FL_DTYPE_W4, 111, 4096, 14336, 128, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 8, 1024, 512, 128, 0, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 9, 1024, 512, 64, 1, 2e-5, DEV_W4),
    MATMUL(FL_DTYPE_W4, 5, 160, 96, 32, 0, 1e-5, DEV_W4),
    MATMUL(FL_DTYPE_Q8_0, 1, 512, 111, 0, 0, 1e-5, 2e-2),
    MATMUL(FL_DTYPE_Q8_0, 19, 576, 500, 0, 1, 1e-5, 2e-2),
    MATMUL(FL_DTYPE_Q4_0, 1, 576, 111, 0, 0, 1e-5, DEV_W4),
    MATMUL(FL_DTYPE_Q4_0, 7, 1536, 500, 0, 0, 1e-5, DEV_W4),
    MATMUL(FL_DTYPE_Q4_1, 1, 576, 111, 0, 0, 1e-5, DEV_W4),
    MATMUL(FL_DTYPE_Q4_1, 19, 1536, 500, 0, 1, 1e-5, DEV_W4),
    ROPE(7, 5, 64, 16, 64, 0),
    ROPE(7, 5, 64, 16, 32, 0),
    ROPE(7, 5, 64, 16, 64, 1),
    ROPE(7, 5, 64, 16, 32, 1),
    ROPE(1, 3, 16, 0, 16, 1),
    ROPE(111, 2, 128, 0, 128, 0),
    ROPE_KV(19, 8, 2, 128, 128, 0, 40),
    ROPE_KV(19, 8, 2, 128, 64, 1, 40),
    ROPE_KV(1, 8, 8, 64, 64, 0, 3),
    ROPE_KV(7, 4, 2, 16, 16, 0, 500),
    KV_STORE(19, 111, 19, 64),
    KV_STORE(1, 256, 0, 3),
    KV_STORE(3, 64, 0, 8),
    ATTN(32, 8, 64, 16, 0),
    ATTN(32, 8, 64, 16, 1),
    ATTN(32, 8, 128, 16, 0),
    ATTN(32, 8, 128, 16, 1),
    ATTN(4, 4, 256, 16, 2),
    ATTN(6, 2, 80, 16, 2),
    ATTN(32, 8, 128, 16, 3),
    ATTN(28, 4, 64, 16, 3),
    ATTN(28, 4, 96, 16, 3),
    ATTN(4, 4, 256, 16, 3),
    ATTN(8, 2, 64, 16, 4),
    ATTN(8, 2, 64, 16, 5),
    ATTN(4, 2, 16, 4, 6),
    SILU_MUL(19, 500, 0),
    SILU_MUL(19, 500, 1),
    SILU_MUL(1, 111, 0),
    ADD(19, 500),
    ADD(1, 7),
    ADD_RMSNORM(1, 4096, 0),
    ADD_RMSNORM(19, 4096, 1),
    ADD_RMSNORM(7, 136, 0),
    ADD_RMSNORM(3, 500, 0),
    ADD_RMSNORM(2, 9001, 0),
    ADD_RMSNORM(16, 3584, 0),
    ADD_RMSNORM(5, 8192, 1),
    ADD_RMSNORM(2, 896, 1),
    ADD_RMSNORM(3, 8200, 0),
    MOE_TOPK(19, 64, 6, 1, 1, 1, 100),
    MOE_TOPK(19, 64, 6, 0, 1, 1, 100),
    MOE_TOPK(19, 8, 2, 1, 1, 1, 100),
    MOE_TOPK(1, 60, 4, 0, 1, 1, 100),
    MOE_TOPK(19, 160, 6, 0, 8, 3, 1600),
    MOE_TOPK(7, 64, 6, 1, 8, 3, 1600),
    GATHER(23, 19, 500),
    GATHER(1, 1, 7),
    SCATTER(23, 19, 500, 1),
    SCATTER(23, 19, 500, 0),
    SIGMOID(19, 500),
    SIGMOID(1, 7),
    MLA(4, 16, 16, 16, 32, 16, 1),
    MLA(16, 128, 64, 128, 512, 16, 0),
    MLA(4, 16, 16, 16, 32, 4, 6),
    ARGMAX(19, 111, 77),
    ARGMAX(19, 32001, 0),
    ARGMAX(1, 7, 3),
    ARGMAX(19, 128256, 77),
    ARGMAX(19, 151936, 0),
    COPY2D(19, 500, 7, 0),
    COPY2D(1, 7, 0, 5),
    SAMPLE(7, 500, SAMPLE_GREEDY),
    SAMPLE(7, 500, SAMPLE_PENALTY),
    SAMPLE(19, 311, SAMPLE_TOPK),
    SAMPLE(19, 311, SAMPLE_TOPP),
    SAMPLE(19, 311, SAMPLE_MINP),
    SAMPLE(5, 32001, SAMPLE_ALL),
    MOE_GROUP(19, 6, 64, 0, 64),
    MOE_GROUP(19, 2, 8, 2, 3),
    MOE_GROUP(1, 4, 60, 30, 30),
    MOE_MATMUL(FL_DTYPE_F32, 7, 2, 8, 0, 8, 96, 40, 0, 0, 1e-5, DEV_ELEM),
    MOE_MATMUL(FL_DTYPE_BF16, 19, 2, 8, 2, 4, 64, 111, 0, 0, 1e-5, DEV_ELEM),
    MOE_MATMUL(FL_DTYPE_W4, 19, 6, 64, 0, 64, 256, 96, 0, 128, 1e-5, DEV_W4),
    MOE_MATMUL(FL_DTYPE_W4, 1, 8, 128, 0, 128, 512, 256, 0, 64, 1e-5, DEV_W4),
    MOE_MATMUL(FL_DTYPE_W4, 7, 2, 8, 0, 8, 96, 256, 1, 32, 1e-5, DEV_W4),
    MOE_COMBINE(19, 2, 8, 0, 8, 500),
    MOE_COMBINE(7, 6, 64, 16, 16, 111),
    MOE_CAR(19, 2, 8, 0, 8, 500, 1),
    MOE_CAR(1, 6, 64, 0, 64, 4096, 0),
    MOE_CAR(7, 2, 8, 4, 4, 96, 1),
    QKNORM(19, 8, 2, 128, 128, 0, 40),
    QKNORM(7, 4, 2, 16, 16, 0, 20),
    QKNORM(1, 32, 4, 128, 64, 1, 3),
    MLA_PREP(5, 16, 128, 64, 512, 12),
    MLA_PREP(7, 4, 16, 16, 32, 20),
};
#define N_CASES (sizeof g_cases / sizeof g_cases[0])

/* --- random inputs ----------------------------------------------------------------- */

static uint64_t g_rng;
static void rng_seed(uint64_t s) { g_rng = s * 0x9E3779B97F4A7C15ull + 0x1234567ull; }
static float frand(void) { /* uniform in [-1, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}
static int irand(int n) { return (int)((frand() + 1.0f) * 0.5f * (float)n) % n; }
/* bf16 rounding by bit arithmetic (round to nearest even), independent of core/tensor.c. */
static float bf16r(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&v, &u, 4);
    return v;
}
static float *rnd(size_t n, float amp) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(x);
    for (size_t i = 0; i < n; i++) x[i] = bf16r(frand() * amp);
    return x;
}
static int32_t *perm(int n) { /* a random permutation of 0..n-1 */
    int32_t *p = malloc(sizeof(int32_t) * (n ? n : 1));
    for (int i = 0; i < n; i++) p[i] = i;
    for (int i = n - 1; i > 0; i--) {
        const int j = irand(i + 1);
        const int32_t t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    return p;
}
static double *dup_d(const float *x, size_t n) {
    double *d = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

/* IEEE half to double, by the formula (independent of core/tensor.c). */
static double half_to_d(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double s = h & 0x8000 ? -1.0 : 1.0;
    if (e == 0) return s * ldexp(m, -24);
    if (e == 31) return m ? NAN : s * INFINITY;
    return s * ldexp(1024 + m, e - 25);
}
/* double to the nearest half (inputs here are small and normal). */
static uint16_t d_to_half(double v) {
    uint16_t best = 0;
    double bd = INFINITY;
    /* binary search over the monotonic positive halves, then the sign */
    const double a = fabs(v);
    int lo = 0, hi = 0x7BFF;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (half_to_d((uint16_t)mid) < a) lo = mid + 1;
        else hi = mid;
    }
    for (int c = lo - 1; c <= lo; c++) {
        if (c < 0) continue;
        const double d = fabs(half_to_d((uint16_t)c) - a);
        if (d < bd || (d == bd && !(c & 1))) bd = d, best = (uint16_t)c;
    }
    return (uint16_t)(best | (v < 0 ? 0x8000 : 0));
}
static uint16_t f_to_bf16_bits(float v) {
    v = bf16r(v);
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)(u >> 16);
}

/* --- a host weight of any dtype and its float64 decoding ----------------------------- */

typedef struct hweight {
    fl_tensor t;   /* what the backend's upload_weight gets */
    double *w;     /* [rows, cols] the values it stands for, decoded here */
    void *raw;     /* storage owned here (not by t) */
} hweight;

static void hweight_free(hweight *h) {
    if (h->t.owned) fl_tensor_free(&h->t);
    free(h->raw);
    free(h->w);
    memset(h, 0, sizeof *h);
}

/* A random [rows, cols] weight of dtype dt. W4: codes, per-group scale and
 * bias as AWQ makes them; Q8_0 raw GGUF blocks; Q4_0/Q4_1 raw GGUF blocks
 * converted by the loader (fl_quant_gguf_q4_to_w4), decoded here from the
 * raw blocks. */
static void make_weight(fl_dtype dt, int rows, int cols, int group, float amp, hweight *h) {
    memset(h, 0, sizeof *h);
    const size_t n = (size_t)rows * cols;
    h->w = malloc(sizeof(double) * n);
    fl_tensor *t = &h->t;
    t->ndim = 2, t->shape[0] = rows, t->shape[1] = cols, t->dtype = dt;
    if (dt == FL_DTYPE_F32) {
        float *v = rnd(n, amp);
        for (size_t i = 0; i < n; i++) h->w[i] = v[i];
        h->raw = t->data = v;
    } else if (dt == FL_DTYPE_BF16 || dt == FL_DTYPE_F16) {
        uint16_t *v = malloc(2 * n);
        for (size_t i = 0; i < n; i++) {
            const float f = frand() * amp;
            if (dt == FL_DTYPE_BF16) {
                v[i] = f_to_bf16_bits(f);
                const uint32_t u = (uint32_t)v[i] << 16;
                float g;
                memcpy(&g, &u, 4);
                h->w[i] = g;
            } else {
                v[i] = d_to_half(f);
                h->w[i] = half_to_d(v[i]);
            }
        }
        h->raw = t->data = v;
    } else if (dt == FL_DTYPE_W4) {
        assert_int_equal(fl_quant_w4_alloc(rows, cols, group, t), FL_OK);
        uint8_t *codes = t->data;
        for (size_t i = 0; i < n / 2; i++) codes[i] = (uint8_t)irand(256);
        const int ng = cols / group;
        for (size_t g = 0; g < (size_t)rows * ng; g++) {
            t->scales[g] = bf16r((0.002f + 0.01f * fabsf(frand())) * amp / 0.05f);
            t->bias[g] = bf16r(-(float)irand(16) * t->scales[g]);
        }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) {
                const uint8_t byte = codes[((size_t)r * cols + c) / 2];
                const int q = c % 2 ? byte >> 4 : byte & 15;
                const size_t gi = (size_t)r * ng + c / group;
                h->w[(size_t)r * cols + c] = (double)q * t->scales[gi] + t->bias[gi];
            }
    } else if (dt == FL_DTYPE_Q8_0) {
        const int nb = cols / 32;
        uint8_t *v = malloc(n / 32 * 34);
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < nb; b++) {
                uint8_t *blk = v + ((size_t)r * nb + b) * 34;
                const uint16_t d = d_to_half(amp / 127.0 * (0.5 + 0.5 * fabsf(frand())));
                memcpy(blk, &d, 2);
                for (int j = 0; j < 32; j++) {
                    const int8_t q = (int8_t)(irand(255) - 127);
                    blk[2 + j] = (uint8_t)q;
                    h->w[(size_t)r * cols + b * 32 + j] = half_to_d(d) * q;
                }
            }
        h->raw = t->data = v;
    } else { /* Q4_0 / Q4_1 */
        const bool q41 = dt == FL_DTYPE_Q4_1;
        const int bb = q41 ? 20 : 18, nb = cols / 32;
        uint8_t *v = malloc(n / 32 * bb);
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < nb; b++) {
                uint8_t *blk = v + ((size_t)r * nb + b) * bb;
                const uint16_t d = d_to_half(amp / 8.0 * (0.5 + 0.5 * fabsf(frand())));
                const uint16_t m = d_to_half(-amp * fabsf(frand()));
                memcpy(blk, &d, 2);
                if (q41) memcpy(blk + 2, &m, 2);
                uint8_t *qs = blk + (q41 ? 4 : 2);
                for (int j = 0; j < 16; j++) {
                    const int lo = irand(16), hi = irand(16);
                    qs[j] = (uint8_t)(lo | hi << 4);
                    /* ggml pairs element j with the low nibble, j + 16 with the high one */
                    double *o = h->w + (size_t)r * cols + b * 32;
                    o[j] = q41 ? half_to_d(d) * lo + half_to_d(m) : half_to_d(d) * (lo - 8);
                    o[j + 16] = q41 ? half_to_d(d) * hi + half_to_d(m) : half_to_d(d) * (hi - 8);
                }
            }
        fl_tensor src = {.dtype = dt, .ndim = 2, .shape = {rows, cols}, .data = v};
        assert_int_equal(fl_quant_gguf_q4_to_w4("test", &src, t), FL_OK);
        h->raw = v;
    }
}

/* --- one run of a case: on a backend (b) or as the reference (b == NULL) ------------- */

#define MAX_OUTS 6
typedef struct outs {
    int n;
    const char *name[MAX_OUTS];
    double *v[MAX_OUTS];
    size_t rows[MAX_OUTS], cols[MAX_OUTS];
    bool exact[MAX_OUTS]; /* integer-valued: must match exactly on every backend */
} outs;

static void outs_add(outs *o, const char *name, double *v, size_t rows, size_t cols, bool exact) {
    assert_true(o->n < MAX_OUTS);
    o->name[o->n] = name, o->v[o->n] = v, o->rows[o->n] = rows, o->cols[o->n] = cols, o->exact[o->n] = exact;
    o->n++;
}
static void outs_free(outs *o) {
    for (int i = 0; i < o->n; i++) free(o->v[i]);
    memset(o, 0, sizeof *o);
}

/* Device allocations of one run, freed together. */
static void *g_allocs[64];
static int g_n_allocs;
static fl_tensor g_weights[300];
static int g_n_weights;

#define OK(call)                                                                               \
    do {                                                                                       \
        fl_status st_ = (call);                                                                \
        if (st_ != FL_OK) fail_msg("%s -> %s: %s", #call, fl_status_str(st_), fl_error_msg()); \
    } while (0)

static int g_perf_reps; /* > 0: time the op (--perf) */
static fl_backend *g_cpu;  /* the reference backend */
static bool g_not_offered; /* the run's backend declined the case where the contract lets it */
static double g_last_us;
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
/* Runs one op call; in a --perf pass, times g_perf_reps more calls of it. */
#define LAUNCH(b, call)                                                            \
    do {                                                                           \
        OK(call);                                                                  \
        if (g_perf_reps > 0) {                                                     \
            OK((b)->ops->sync(b));                                                 \
            const double t0_ = now_s();                                            \
            for (int r_ = 0; r_ < g_perf_reps; r_++) OK(call);                     \
            OK((b)->ops->sync(b));                                                 \
            g_last_us = (now_s() - t0_) / g_perf_reps * 1e6;                       \
        }                                                                          \
    } while (0)

static void *d_alloc(fl_backend *b, size_t bytes) {
    void *p = NULL;
    OK(b->ops->alloc(b, bytes ? bytes : 16, &p));
    assert_true(g_n_allocs < 64);
    g_allocs[g_n_allocs++] = p;
    return p;
}
static void *d_act(fl_backend *b, const float *h, size_t n) {
    void *p = d_alloc(b, fl_backend_act_bytes(b, n));
    OK(b->ops->upload_act(b, p, h, n));
    return p;
}
static void *d_poison(fl_backend *b, size_t n) { /* n activations of NaN */
    float *h = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    void *p = d_act(b, h, n);
    free(h);
    return p;
}
static void *d_raw(fl_backend *b, const void *h, size_t bytes) {
    void *p = d_alloc(b, bytes);
    OK(b->ops->upload(b, p, h, bytes));
    return p;
}
static double *d_get_act(fl_backend *b, const void *d, size_t n) {
    float *h = malloc(sizeof(float) * (n ? n : 1));
    OK(b->ops->download_act(b, h, d, n));
    double *o = dup_d(h, n);
    free(h);
    return o;
}
static double *d_get_f32(fl_backend *b, const void *d, size_t n) {
    float *h = malloc(sizeof(float) * (n ? n : 1));
    OK(b->ops->download(b, h, d, sizeof(float) * n));
    double *o = dup_d(h, n);
    free(h);
    return o;
}
static double *d_get_i32(fl_backend *b, const void *d, size_t n) {
    int32_t *h = malloc(sizeof(int32_t) * (n ? n : 1));
    OK(b->ops->download(b, h, d, sizeof(int32_t) * n));
    double *o = malloc(sizeof(double) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) o[i] = h[i];
    free(h);
    return o;
}
static fl_tensor *d_weight(fl_backend *b, const fl_tensor *host) {
    assert_true(g_n_weights < 300);
    fl_tensor *t = &g_weights[g_n_weights++];
    OK(b->ops->upload_weight(b, host, t));
    return t;
}
static fl_tensor vec_t(float *v, int n) {
    fl_tensor t = {.dtype = FL_DTYPE_F32, .ndim = 1, .shape = {n}, .data = v};
    return t;
}
static void run_release(fl_backend *b) {
    if (!b) return;
    for (int i = 0; i < g_n_weights; i++) b->ops->free_weight(b, &g_weights[i]);
    for (int i = 0; i < g_n_allocs; i++) b->ops->free(b, g_allocs[i]);
    g_n_weights = g_n_allocs = 0;
}

/* --- float64 references of the shared pieces ---------------------------------------- */

static void ref_rmsnorm(double *x, const double *w, double eps, int d) { /* in place */
    double ss = 0;
    for (int j = 0; j < d; j++) ss += x[j] * x[j];
    const double inv = 1.0 / sqrt(ss / d + eps);
    for (int j = 0; j < d; j++) x[j] = x[j] * inv * w[j];
}
/* Rotates the first rot dims of n_heads heads of head_dim at x by angles (c, s)[rot / 2]. */
static void ref_rope(double *x, int n_heads, int head_dim, const float *c, const float *s, int rot, bool il) {
    const int half = rot / 2;
    for (int h = 0; h < n_heads; h++) {
        double *v = x + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            const int i0 = il ? 2 * i : i, i1 = il ? 2 * i + 1 : i + half;
            const double a = v[i0], bb = v[i1];
            v[i0] = a * c[i] - bb * s[i];
            v[i1] = bb * c[i] + a * s[i];
        }
    }
}
static void angles(int n, int half, float **c, float **s) {
    *c = malloc(sizeof(float) * (size_t)(n * half + 1));
    *s = malloc(sizeof(float) * (size_t)(n * half + 1));
    for (int i = 0; i < n * half; i++) {
        const float a = frand() * 3.14159f;
        (*c)[i] = cosf(a);
        (*s)[i] = sinf(a);
    }
}
/* n distinct slots of n_slots, row 1 padding (-1) when n > 2. */
static int32_t *slot_list(int n, int n_slots) {
    int32_t *p = perm(n_slots), *s = malloc(sizeof(int32_t) * (n ? n : 1));
    for (int i = 0; i < n; i++) s[i] = n > 2 && i == 1 ? -1 : p[i];
    free(p);
    return s;
}

/* --- the ops --------------------------------------------------------------------- */

static void op_embed(const tcase *c, fl_backend *b, outs *o) {
    const int V = c->p[0], d = c->p[1], n = c->p[2];
    hweight w;
    make_weight(c->dt, V, d, 0, 1.0f, &w);
    int32_t *ids = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) ids[i] = (i * 331 + 999) % V;
    ids[0] = V - 1;
    double *out;
    if (!b) {
        out = malloc(sizeof(double) * n * d);
        for (int i = 0; i < n; i++) memcpy(out + (size_t)i * d, w.w + (size_t)ids[i] * d, sizeof(double) * d);
    } else {
        fl_tensor *dw = d_weight(b, &w.t);
        void *dids = d_raw(b, ids, sizeof(int32_t) * n), *dout = d_poison(b, (size_t)n * d);
        LAUNCH(b, b->ops->embed(b, dw, dids, n, dout));
        out = d_get_act(b, dout, (size_t)n * d);
    }
    outs_add(o, "out", out, n, d, false);
    free(ids);
    hweight_free(&w);
}

static void op_rmsnorm(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], d = c->p[1], inpl = c->p[2];
    float *x = rnd((size_t)n * d, 3.0f), *w = rnd(d, 1.0f);
    double *out;
    if (!b) {
        out = dup_d(x, (size_t)n * d);
        double *wd = dup_d(w, d);
        for (int i = 0; i < n; i++) ref_rmsnorm(out + (size_t)i * d, wd, 1e-5, d);
        free(wd);
    } else {
        fl_tensor tw = vec_t(w, d), *dw = d_weight(b, &tw);
        void *dx = d_act(b, x, (size_t)n * d), *dy = inpl ? dx : d_poison(b, (size_t)n * d);
        OK(b->ops->rmsnorm(b, dx, dw, 1e-5f, n, d, dy));
        if (!inpl) LAUNCH(b, b->ops->rmsnorm(b, dx, dw, 1e-5f, n, d, dy));
        out = d_get_act(b, dy, (size_t)n * d);
    }
    outs_add(o, "out", out, n, d, false);
    free(x);
    free(w);
}

static void op_matmul(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], in = c->p[1], out_f = c->p[2], group = c->p[3], has_bias = c->p[4];
    hweight w;
    make_weight(c->dt, out_f, in, group, 0.05f, &w);
    float *x = rnd((size_t)n * in, 1.0f), *bias = rnd(out_f, 0.5f);
    double *y;
    if (!b) {
        y = malloc(sizeof(double) * n * out_f);
        for (int i = 0; i < n; i++)
            for (int r = 0; r < out_f; r++) {
                double s = has_bias ? bias[r] : 0;
                const double *wr = w.w + (size_t)r * in;
                const float *xi = x + (size_t)i * in;
                for (int j = 0; j < in; j++) s += xi[j] * wr[j];
                y[(size_t)i * out_f + r] = s;
            }
    } else {
        fl_tensor *dw = d_weight(b, &w.t), tb = vec_t(bias, out_f), *db = has_bias ? d_weight(b, &tb) : NULL;
        void *dx = d_act(b, x, (size_t)n * in), *dy = d_poison(b, (size_t)n * out_f);
        LAUNCH(b, b->ops->matmul(b, dx, n, dw, db, dy));
        y = d_get_act(b, dy, (size_t)n * out_f);
    }
    outs_add(o, "y", y, n, out_f, false);
    free(x);
    free(bias);
    hweight_free(&w);
}

static void op_rope(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], nh = c->p[1], hd = c->p[2], stride = nh * hd + c->p[3], rot = c->p[4];
    const bool il = c->p[5];
    float *x = rnd((size_t)n * stride, 2.0f), *cs, *sn;
    angles(n, rot / 2, &cs, &sn);
    double *out;
    if (!b) {
        out = dup_d(x, (size_t)n * stride);
        for (int t = 0; t < n; t++)
            ref_rope(out + (size_t)t * stride, nh, hd, cs + (size_t)t * rot / 2, sn + (size_t)t * rot / 2, rot, il);
    } else {
        void *dx = d_act(b, x, (size_t)n * stride);
        void *dc = d_raw(b, cs, sizeof(float) * n * rot / 2), *ds = d_raw(b, sn, sizeof(float) * n * rot / 2);
        LAUNCH(b, b->ops->rope(b, dx, n, nh, hd, stride, dc, ds, rot, il));
        out = d_get_act(b, dx, (size_t)n * stride);
    }
    /* in a --perf pass the rotation ran again and again: only the timing counts */
    outs_add(o, "x", out, n, stride, false);
    free(x);
    free(cs);
    free(sn);
}

/* rope_kv_store and qknorm_rope_kv_store (norms: per-head RMSNorm of q and k first). */
static void rope_kv_common(const tcase *c, fl_backend *b, outs *o, bool norms) {
    const int n = c->p[0], nh = c->p[1], nkv = c->p[2], hd = c->p[3], rot = c->p[4], n_slots = c->p[6];
    const bool il = c->p[5];
    const int qs = nh * hd + 8, kvs = nkv * hd + 24, kvd = nkv * hd; /* strided rows, as a fused q|k|v leaves them */
    float *q = rnd((size_t)n * qs, 2.0f), *k = rnd((size_t)n * kvs, 2.0f), *v = rnd((size_t)n * kvs, 2.0f);
    float *kc = rnd((size_t)n_slots * kvd, 1.0f), *vc = rnd((size_t)n_slots * kvd, 1.0f);
    float *qw = rnd(hd, 1.0f), *kw = rnd(hd, 1.0f), *cs, *sn;
    angles(n, rot / 2, &cs, &sn);
    int32_t *slots = slot_list(n, n_slots);
    double *oq, *ok, *okc, *ovc;
    if (!b) {
        oq = dup_d(q, (size_t)n * qs), ok = dup_d(k, (size_t)n * kvs);
        okc = dup_d(kc, (size_t)n_slots * kvd), ovc = dup_d(vc, (size_t)n_slots * kvd);
        double *qwd = dup_d(qw, hd), *kwd = dup_d(kw, hd);
        for (int t = 0; t < n; t++) {
            double *qt = oq + (size_t)t * qs, *kt = ok + (size_t)t * kvs;
            if (norms) {
                for (int h = 0; h < nh; h++) ref_rmsnorm(qt + (size_t)h * hd, qwd, 1e-6, hd);
                for (int h = 0; h < nkv; h++) ref_rmsnorm(kt + (size_t)h * hd, kwd, 1e-6, hd);
            }
            ref_rope(qt, nh, hd, cs + (size_t)t * rot / 2, sn + (size_t)t * rot / 2, rot, il);
            ref_rope(kt, nkv, hd, cs + (size_t)t * rot / 2, sn + (size_t)t * rot / 2, rot, il);
            if (slots[t] < 0) continue;
            memcpy(okc + (size_t)slots[t] * kvd, kt, sizeof(double) * kvd);
            for (int j = 0; j < kvd; j++) ovc[(size_t)slots[t] * kvd + j] = v[(size_t)t * kvs + j];
        }
        free(qwd);
        free(kwd);
    } else {
        void *dq = d_act(b, q, (size_t)n * qs), *dk = d_act(b, k, (size_t)n * kvs), *dv = d_act(b, v, (size_t)n * kvs);
        void *dkc = d_act(b, kc, (size_t)n_slots * kvd), *dvc = d_act(b, vc, (size_t)n_slots * kvd);
        void *dc = d_raw(b, cs, sizeof(float) * n * rot / 2), *ds = d_raw(b, sn, sizeof(float) * n * rot / 2);
        void *dsl = d_raw(b, slots, sizeof(int32_t) * n);
        if (norms) {
            fl_tensor tq = vec_t(qw, hd), tk = vec_t(kw, hd);
            fl_tensor *dqw = d_weight(b, &tq), *dkw = d_weight(b, &tk);
            LAUNCH(b, b->ops->qknorm_rope_kv_store(b, dq, dk, dv, n, nh, nkv, hd, qs, kvs, dqw, dkw, 1e-6f, dc, ds,
                                                   rot, il, dsl, dkc, dvc));
        } else {
            LAUNCH(b, b->ops->rope_kv_store(b, dq, dk, dv, n, nh, nkv, hd, qs, kvs, dc, ds, rot, il, dsl, dkc, dvc));
        }
        oq = d_get_act(b, dq, (size_t)n * qs), ok = d_get_act(b, dk, (size_t)n * kvs);
        okc = d_get_act(b, dkc, (size_t)n_slots * kvd), ovc = d_get_act(b, dvc, (size_t)n_slots * kvd);
    }
    outs_add(o, "q", oq, n, qs, false);
    outs_add(o, "k", ok, n, kvs, false);
    outs_add(o, "k_cache", okc, n_slots, kvd, false);
    outs_add(o, "v_cache", ovc, n_slots, kvd, false);
    void *fr[] = {q, k, v, kc, vc, qw, kw, cs, sn, slots};
    for (size_t i = 0; i < sizeof fr / sizeof fr[0]; i++) free(fr[i]);
}
static void op_rope_kv_store(const tcase *c, fl_backend *b, outs *o) { rope_kv_common(c, b, o, false); }
static void op_qknorm_rope_kv_store(const tcase *c, fl_backend *b, outs *o) { rope_kv_common(c, b, o, true); }

static void op_kv_store(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], kvd = c->p[1], stride = kvd + c->p[2], n_slots = c->p[3];
    float *k = rnd((size_t)n * stride, 1.0f), *v = rnd((size_t)n * stride, 1.0f);
    float *kc = rnd((size_t)n_slots * kvd, 1.0f), *vc = rnd((size_t)n_slots * kvd, 1.0f);
    int32_t *slots = slot_list(n, n_slots);
    double *okc, *ovc;
    if (!b) {
        okc = dup_d(kc, (size_t)n_slots * kvd), ovc = dup_d(vc, (size_t)n_slots * kvd);
        for (int t = 0; t < n; t++)
            for (int j = 0; j < kvd && slots[t] >= 0; j++) {
                okc[(size_t)slots[t] * kvd + j] = k[(size_t)t * stride + j];
                ovc[(size_t)slots[t] * kvd + j] = v[(size_t)t * stride + j];
            }
    } else {
        void *dk = d_act(b, k, (size_t)n * stride), *dv = d_act(b, v, (size_t)n * stride);
        void *dkc = d_act(b, kc, (size_t)n_slots * kvd), *dvc = d_act(b, vc, (size_t)n_slots * kvd);
        void *dsl = d_raw(b, slots, sizeof(int32_t) * n);
        LAUNCH(b, b->ops->kv_store(b, dk, dv, n, kvd, stride, dsl, dkc, dvc));
        okc = d_get_act(b, dkc, (size_t)n_slots * kvd), ovc = d_get_act(b, dvc, (size_t)n_slots * kvd);
    }
    outs_add(o, "k_cache", okc, n_slots, kvd, false);
    outs_add(o, "v_cache", ovc, n_slots, kvd, false);
    free(k);
    free(v);
    free(kc);
    free(vc);
    free(slots);
}

/* Paged metadata of a sequence list: q_start, ctx_len, scattered block
 * tables (blocks of all sequences a permutation of n_blocks), host copies. */
typedef struct paged {
    int n_seqs, n_tok, max_blocks, n_blocks, bs, max_ctx, max_q;
    int32_t *q_start, *ctx, *bt;
} paged;
static void paged_make(const int *list, int bs, paged *p) {
    memset(p, 0, sizeof *p);
    p->n_seqs = list[0], p->bs = bs;
    p->q_start = malloc(sizeof(int32_t) * (p->n_seqs + 1));
    p->ctx = malloc(sizeof(int32_t) * p->n_seqs);
    for (int s = 0; s < p->n_seqs; s++) {
        p->ctx[s] = list[1 + s];
        const int nq = list[1 + p->n_seqs + s];
        p->q_start[s] = p->n_tok;
        p->n_tok += nq;
        if (p->ctx[s] > p->max_ctx) p->max_ctx = p->ctx[s];
        if (nq > p->max_q) p->max_q = nq;
        const int nb = (p->ctx[s] + bs - 1) / bs;
        if (nb > p->max_blocks) p->max_blocks = nb;
    }
    p->q_start[p->n_seqs] = p->n_tok;
    if (p->max_blocks == 0) p->max_blocks = 1;
    p->n_blocks = p->n_seqs * p->max_blocks;
    int32_t *pm = perm(p->n_blocks);
    p->bt = malloc(sizeof(int32_t) * p->n_blocks);
    for (int i = 0; i < p->n_blocks; i++) p->bt[i] = pm[i];
    free(pm);
}
static void paged_free(paged *p) {
    free(p->q_start);
    free(p->ctx);
    free(p->bt);
}
static fl_attn_meta paged_meta(fl_backend *b, const paged *p) {
    fl_attn_meta m = {.n_seqs = p->n_seqs, .max_blocks = p->max_blocks, .block_size = p->bs,
                      .max_ctx_len = p->max_ctx, .max_q_len = p->max_q};
    m.q_start = d_raw(b, p->q_start, sizeof(int32_t) * (p->n_seqs + 1));
    m.ctx_len = d_raw(b, p->ctx, sizeof(int32_t) * p->n_seqs);
    m.block_tables = d_raw(b, p->bt, sizeof(int32_t) * p->n_blocks);
    return m;
}
/* Cache slot of position t of sequence s. */
static size_t paged_slot(const paged *p, int s, int t) {
    return (size_t)p->bt[s * p->max_blocks + t / p->bs] * p->bs + t % p->bs;
}

/* Softmax-weighted sum for one query row: scores[0..L) -> weights in place. */
static void ref_softmax(double *sc, int L) {
    double mx = -INFINITY, sum = 0;
    for (int t = 0; t < L; t++) mx = sc[t] > mx ? sc[t] : mx;
    for (int t = 0; t < L; t++) sum += (sc[t] = exp(sc[t] - mx));
    for (int t = 0; t < L; t++) sc[t] /= sum;
}

static void op_attention(const tcase *c, fl_backend *b, outs *o) {
    const int nh = c->p[0], nkv = c->p[1], hd = c->p[2], bs = c->p[3];
    paged p;
    paged_make(ATTN_SEQ_LISTS[c->p[4]], bs, &p);
    const int kvd = nkv * hd, qstr = nh * hd + 2 * kvd; /* q rows of a fused q|k|v output */
    const size_t n_slots = (size_t)p.n_blocks * bs;
    float *q = rnd((size_t)p.n_tok * qstr, 1.0f), *kc = rnd(n_slots * kvd, 1.0f), *vc = rnd(n_slots * kvd, 1.0f);
    const float scale = 1.0f / sqrtf((float)hd);
    double *out;
    if (!b) {
        out = calloc((size_t)p.n_tok * nh * hd, sizeof(double));
        double *sc = malloc(sizeof(double) * (p.max_ctx + 1));
        for (int s = 0; s < p.n_seqs; s++) {
            const int nq = p.q_start[s + 1] - p.q_start[s];
            for (int i = 0; i < nq; i++) {
                const int row = p.q_start[s] + i, pos = p.ctx[s] - nq + i, L = pos + 1;
                if (p.ctx[s] == 0 || L <= 0) continue; /* sees nothing: zeros */
                for (int h = 0; h < nh; h++) {
                    const int g = h / (nh / nkv);
                    const float *qh = q + (size_t)row * qstr + (size_t)h * hd;
                    for (int t = 0; t < L; t++) {
                        const float *kt = kc + paged_slot(&p, s, t) * kvd + (size_t)g * hd;
                        double d = 0;
                        for (int j = 0; j < hd; j++) d += (double)qh[j] * kt[j];
                        sc[t] = d * scale;
                    }
                    ref_softmax(sc, L);
                    double *oh = out + ((size_t)row * nh + h) * hd;
                    for (int t = 0; t < L; t++) {
                        const float *vt = vc + paged_slot(&p, s, t) * kvd + (size_t)g * hd;
                        for (int j = 0; j < hd; j++) oh[j] += sc[t] * vt[j];
                    }
                }
            }
        }
        free(sc);
    } else {
        fl_attn_meta m = paged_meta(b, &p);
        void *dq = d_act(b, q, (size_t)p.n_tok * qstr), *dkc = d_act(b, kc, n_slots * kvd);
        void *dvc = d_act(b, vc, n_slots * kvd), *dout = d_poison(b, (size_t)p.n_tok * nh * hd);
        LAUNCH(b, b->ops->attention(b, dq, qstr, &m, nh, nkv, hd, scale, dkc, dvc, dout));
        out = d_get_act(b, dout, (size_t)p.n_tok * nh * hd);
    }
    outs_add(o, "out", out, (size_t)p.n_tok * nh, hd, false);
    free(q);
    free(kc);
    free(vc);
    paged_free(&p);
}

static void op_silu_mul(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], d = c->p[1], fused = c->p[2], stride = fused ? 2 * d : d;
    float *g = rnd((size_t)n * stride, 6.0f), *u = rnd((size_t)n * stride, 2.0f);
    double *out;
    if (!b) {
        out = malloc(sizeof(double) * n * d);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < d; j++) {
                const double gv = g[(size_t)i * stride + j];
                const double uv = fused ? g[(size_t)i * stride + d + j] : u[(size_t)i * stride + j];
                out[(size_t)i * d + j] = gv / (1.0 + exp(-gv)) * uv;
            }
    } else {
        void *dg = d_act(b, g, (size_t)n * stride), *du = d_act(b, u, (size_t)n * stride);
        void *dout = d_poison(b, (size_t)n * d);
        const void *up = fused ? (const char *)dg + fl_backend_act_bytes(b, d) : du;
        LAUNCH(b, b->ops->silu_mul(b, dg, up, n, d, stride, dout));
        out = d_get_act(b, dout, (size_t)n * d);
    }
    outs_add(o, "out", out, n, d, false);
    free(g);
    free(u);
}

static void op_add(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], d = c->p[1];
    const size_t nd = (size_t)n * d;
    float *x = rnd(nd, 2.0f), *y = rnd(nd, 2.0f);
    double *out;
    if (!b) {
        out = malloc(sizeof(double) * nd);
        for (size_t i = 0; i < nd; i++) out[i] = (double)x[i] + y[i];
    } else {
        void *dx = d_act(b, x, nd), *dy = d_act(b, y, nd);
        LAUNCH(b, b->ops->add(b, dx, dy, nd));
        out = d_get_act(b, dx, nd);
    }
    outs_add(o, "x", out, n, d, false);
    free(x);
    free(y);
}

static void op_add_rmsnorm(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], d = c->p[1], wbf = c->p[2];
    const size_t nd = (size_t)n * d;
    float *x = rnd(nd, 2.0f), *y = rnd(nd, 2.0f), *w = rnd(d, 1.0f);
    double *ox, *out;
    if (!b) {
        ox = malloc(sizeof(double) * nd);
        for (size_t i = 0; i < nd; i++) ox[i] = (double)x[i] + y[i];
        out = malloc(sizeof(double) * nd);
        memcpy(out, ox, sizeof(double) * nd);
        double *wd = dup_d(w, d);
        for (int i = 0; i < n; i++) ref_rmsnorm(out + (size_t)i * d, wd, 1e-5, d);
        free(wd);
    } else {
        hweight hw;
        make_weight(wbf ? FL_DTYPE_BF16 : FL_DTYPE_F32, 1, d, 0, 1.0f, &hw);
        /* the norm weight as a vector of either dtype (values of w) */
        hw.t.ndim = 1, hw.t.shape[0] = d, hw.t.shape[1] = 0;
        if (wbf) for (int j = 0; j < d; j++) ((uint16_t *)hw.t.data)[j] = f_to_bf16_bits(w[j]);
        else memcpy(hw.t.data, w, sizeof(float) * d);
        fl_tensor *dw = d_weight(b, &hw.t);
        void *dx = d_act(b, x, nd), *dy = d_act(b, y, nd), *dout = d_poison(b, nd);
        OK(b->ops->add_rmsnorm(b, dx, dy, dw, 1e-5f, n, d, dout));
        ox = d_get_act(b, dx, nd);
        out = d_get_act(b, dout, nd);
        if (g_perf_reps > 0) LAUNCH(b, b->ops->add_rmsnorm(b, dx, dy, dw, 1e-5f, n, d, dout));
        hweight_free(&hw);
    }
    outs_add(o, "x", ox, n, d, false);
    outs_add(o, "out", out, n, d, false);
    free(x);
    free(y);
    free(w);
}

/* The router's picks (float64): ids [k], weights [k] of one row. */
static void ref_topk_row(const float *l, int E, int k, const fl_moe_route *r, int32_t *ids, double *wts) {
    double *p = malloc(sizeof(double) * E), mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
    for (int e = 0; e < E; e++) sum += (p[e] = exp(l[e] - mx));
    for (int e = 0; e < E; e++) p[e] /= sum;
    double *q = malloc(sizeof(double) * E);
    memcpy(q, p, sizeof(double) * E);
    if (fl_moe_route_grouped(r, E)) {
        const int gsz = E / r->n_group;
        bool *keep = calloc(r->n_group, 1);
        for (int t = 0; t < r->topk_group; t++) {
            int best = -1;
            double bv = -1;
            for (int g = 0; g < r->n_group; g++) {
                if (keep[g]) continue;
                double gm = -1;
                for (int e = g * gsz; e < (g + 1) * gsz; e++) gm = p[e] > gm ? p[e] : gm;
                if (gm > bv) bv = gm, best = g;
            }
            keep[best] = true;
        }
        for (int e = 0; e < E; e++)
            if (!keep[e / gsz]) q[e] = 0;
        free(keep);
    }
    bool *taken = calloc(E, 1);
    double ws = 0;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || q[e] > q[best])) best = e;
        taken[best] = true;
        ids[j] = best;
        wts[j] = q[best];
        ws += q[best];
    }
    for (int j = 0; j < k; j++) wts[j] = r->renorm ? wts[j] / ws : wts[j] * r->scale;
    free(taken);
    free(p);
    free(q);
}

static void op_moe_topk(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], E = c->p[1], k = c->p[2];
    const fl_moe_route r = {c->p[4], c->p[5], c->p[3] != 0, c->p[6] / 100.0f};
    float *l = rnd((size_t)n * E, 4.0f);
    double *ids, *w;
    if (!b) {
        ids = malloc(sizeof(double) * n * k), w = malloc(sizeof(double) * n * k);
        int32_t *row = malloc(sizeof(int32_t) * k);
        for (int i = 0; i < n; i++) {
            ref_topk_row(l + (size_t)i * E, E, k, &r, row, w + (size_t)i * k);
            for (int j = 0; j < k; j++) ids[(size_t)i * k + j] = row[j];
        }
        free(row);
    } else {
        void *dl = d_act(b, l, (size_t)n * E), *dids = d_alloc(b, sizeof(int32_t) * n * k);
        void *dw = d_alloc(b, sizeof(float) * n * k);
        LAUNCH(b, b->ops->moe_topk(b, dl, n, E, k, &r, dids, dw));
        ids = d_get_i32(b, dids, (size_t)n * k), w = d_get_f32(b, dw, (size_t)n * k);
    }
    outs_add(o, "ids", ids, n, k, true);
    outs_add(o, "weights", w, n, k, false);
    free(l);
}

static void op_gather_rows(const tcase *c, fl_backend *b, outs *o) {
    const int ns = c->p[0], ni = c->p[1], d = c->p[2];
    float *src = rnd((size_t)ns * d, 1.0f);
    int32_t *idx = malloc(sizeof(int32_t) * ni);
    for (int i = 0; i < ni; i++) idx[i] = irand(ns); /* repeats allowed */
    double *out;
    if (!b) {
        out = malloc(sizeof(double) * ni * d);
        for (int i = 0; i < ni; i++)
            for (int j = 0; j < d; j++) out[(size_t)i * d + j] = src[(size_t)idx[i] * d + j];
    } else {
        void *ds = d_act(b, src, (size_t)ns * d), *di = d_raw(b, idx, sizeof(int32_t) * ni);
        void *dout = d_poison(b, (size_t)ni * d);
        LAUNCH(b, b->ops->gather_rows(b, ds, di, ni, d, dout));
        out = d_get_act(b, dout, (size_t)ni * d);
    }
    outs_add(o, "dst", out, ni, d, false);
    free(src);
    free(idx);
}

static void op_scatter_add_rows(const tcase *c, fl_backend *b, outs *o) {
    const int nd = c->p[0], ni = c->p[1], d = c->p[2], has_sc = c->p[3];
    float *dst = rnd((size_t)nd * d, 1.0f), *src = rnd((size_t)ni * d, 1.0f), *sc = rnd(ni, 1.0f);
    int32_t *pm = perm(nd), *idx = malloc(sizeof(int32_t) * ni); /* distinct */
    for (int i = 0; i < ni; i++) idx[i] = pm[i];
    double *out;
    if (!b) {
        out = dup_d(dst, (size_t)nd * d);
        for (int i = 0; i < ni; i++)
            for (int j = 0; j < d; j++)
                out[(size_t)idx[i] * d + j] += (has_sc ? sc[i] : 1.0) * src[(size_t)i * d + j];
    } else {
        void *dd = d_act(b, dst, (size_t)nd * d), *ds = d_act(b, src, (size_t)ni * d);
        void *di = d_raw(b, idx, sizeof(int32_t) * ni), *dsc = d_raw(b, sc, sizeof(float) * ni);
        OK(b->ops->scatter_add_rows(b, dd, ds, di, has_sc ? dsc : NULL, ni, d));
        out = d_get_act(b, dd, (size_t)nd * d);
        if (g_perf_reps > 0) LAUNCH(b, b->ops->scatter_add_rows(b, dd, ds, di, has_sc ? dsc : NULL, ni, d));
    }
    outs_add(o, "dst", out, nd, d, false);
    free(dst);
    free(src);
    free(sc);
    free(pm);
    free(idx);
}

static void op_sigmoid_scale_rows(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], d = c->p[1];
    float *x = rnd((size_t)n * d, 2.0f), *g = rnd(n, 4.0f);
    double *out;
    if (!b) {
        out = dup_d(x, (size_t)n * d);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < d; j++) out[(size_t)i * d + j] *= 1.0 / (1.0 + exp(-(double)g[i]));
    } else {
        void *dx = d_act(b, x, (size_t)n * d), *dg = d_act(b, g, n);
        OK(b->ops->sigmoid_scale_rows(b, dx, dg, n, d));
        out = d_get_act(b, dx, (size_t)n * d);
        if (g_perf_reps > 0) LAUNCH(b, b->ops->sigmoid_scale_rows(b, dx, dg, n, d));
    }
    outs_add(o, "x", out, n, d, false);
    free(x);
    free(g);
}

static void op_mla_attention(const tcase *c, fl_backend *b, outs *o) {
    const int nh = c->p[0], nope = c->p[1], rope = c->p[2], vd = c->p[3], kvl = c->p[4], bs = c->p[5];
    const int qk = nope + rope, rec = kvl + rope;
    paged p;
    paged_make(ATTN_SEQ_LISTS[c->p[6]], bs, &p);
    const size_t n_slots = (size_t)p.n_blocks * bs;
    float *q = rnd((size_t)p.n_tok * nh * qk, 1.0f), *kc = rnd(n_slots * rec / 2, 1.0f);
    float *vc = rnd(n_slots * rec / 2, 1.0f);
    hweight w;
    make_weight(FL_DTYPE_F32, nh * (nope + vd), kvl, 0, 0.15f, &w);
    const float scale = 1.0f / sqrtf((float)qk);
    double *out;
    if (!b) {
        out = calloc((size_t)p.n_tok * nh * vd, sizeof(double));
        double *sc = malloc(sizeof(double) * (p.max_ctx + 1)), *r = malloc(sizeof(double) * rec);
        double *kn = malloc(sizeof(double) * ((size_t)p.max_ctx + 1) * nope);
        double *vv = malloc(sizeof(double) * ((size_t)p.max_ctx + 1) * vd);
        for (int s = 0; s < p.n_seqs; s++) {
            const int nq = p.q_start[s + 1] - p.q_start[s];
            for (int h = 0; h < nh; h++) {
                const double *wk = w.w + (size_t)h * (nope + vd) * kvl, *wv = wk + (size_t)nope * kvl;
                for (int t = 0; t < p.ctx[s]; t++) { /* this head's k_nope and v of every cached token */
                    const size_t sl = paged_slot(&p, s, t);
                    for (int j = 0; j < rec / 2; j++) r[j] = kc[sl * rec / 2 + j], r[rec / 2 + j] = vc[sl * rec / 2 + j];
                    for (int a = 0; a < nope; a++) {
                        double d = 0;
                        for (int j = 0; j < kvl; j++) d += wk[(size_t)a * kvl + j] * r[j];
                        kn[(size_t)t * nope + a] = d;
                    }
                    for (int a = 0; a < vd; a++) {
                        double d = 0;
                        for (int j = 0; j < kvl; j++) d += wv[(size_t)a * kvl + j] * r[j];
                        vv[(size_t)t * vd + a] = d;
                    }
                }
                for (int i = 0; i < nq; i++) {
                    const int row = p.q_start[s] + i, L = p.ctx[s] - nq + i + 1;
                    if (p.ctx[s] == 0 || L <= 0) continue;
                    const float *qh = q + ((size_t)row * nh + h) * qk;
                    for (int t = 0; t < L; t++) {
                        const size_t sl = paged_slot(&p, s, t);
                        double d = 0;
                        for (int a = 0; a < nope; a++) d += qh[a] * kn[(size_t)t * nope + a];
                        for (int a = 0; a < rope; a++) { /* k_pe: record elements kvl .. rec */
                            const int e = kvl + a;
                            const double kpe = e < rec / 2 ? kc[sl * rec / 2 + e] : vc[sl * rec / 2 + e - rec / 2];
                            d += qh[nope + a] * kpe;
                        }
                        sc[t] = d * scale;
                    }
                    ref_softmax(sc, L);
                    double *oh = out + ((size_t)row * nh + h) * vd;
                    for (int t = 0; t < L; t++)
                        for (int a = 0; a < vd; a++) oh[a] += sc[t] * vv[(size_t)t * vd + a];
                }
            }
        }
        free(sc);
        free(r);
        free(kn);
        free(vv);
    } else {
        fl_attn_meta m = paged_meta(b, &p);
        fl_tensor *dw = d_weight(b, &w.t);
        void *dq = d_act(b, q, (size_t)p.n_tok * nh * qk), *dkc = d_act(b, kc, n_slots * rec / 2);
        void *dvc = d_act(b, vc, n_slots * rec / 2), *dout = d_poison(b, (size_t)p.n_tok * nh * vd);
        LAUNCH(b, b->ops->mla_attention(b, dq, &m, nh, nope, rope, vd, kvl, scale, dw, dkc, dvc, dout));
        out = d_get_act(b, dout, (size_t)p.n_tok * nh * vd);
    }
    outs_add(o, "out", out, (size_t)p.n_tok * nh, vd, false);
    free(q);
    free(kc);
    free(vc);
    hweight_free(&w);
    paged_free(&p);
}

static void op_argmax_rows(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], d = c->p[1], off = c->p[2];
    float *x = rnd((size_t)n * d, 8.0f);
    for (int i = 0; i < n; i++) { /* a tie at two ids above the rest: the lower id wins */
        x[(size_t)i * d + (i * 37) % d] = 9.0f;
        x[(size_t)i * d + (i * 37 + 1 + i * 53) % d] = 9.0f;
    }
    if (n > 3) x[(size_t)3 * d + d / 2] = NAN;
    if (n > 5)
        for (int j = 0; j < d; j++) x[(size_t)5 * d + j] = -INFINITY;
    double *val = malloc(sizeof(double) * n), *id = malloc(sizeof(double) * n);
    if (!b) {
        for (int i = 0; i < n; i++) {
            int best = 0;
            bool nan = false;
            for (int j = 0; j < d; j++) {
                const float v = x[(size_t)i * d + j];
                if (isnan(v)) nan = true;
                if (v > x[(size_t)i * d + best]) best = j;
            }
            val[i] = nan ? NAN : x[(size_t)i * d + best];
            id[i] = nan ? NAN : off + best; /* the id of a NaN row is not specified */
        }
    } else {
        void *dx = d_act(b, x, (size_t)n * d), *dout = d_alloc(b, sizeof(float) * 2 * n);
        LAUNCH(b, b->ops->argmax_rows(b, dx, n, d, off, dout));
        double *both = d_get_f32(b, dout, 2 * (size_t)n);
        for (int i = 0; i < n; i++) val[i] = both[2 * i], id[i] = isnan(both[2 * i]) ? NAN : both[2 * i + 1];
        free(both);
    }
    outs_add(o, "value", val, n, 1, true);
    outs_add(o, "id", id, n, 1, true);
    free(x);
}

static void op_copy_2d(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], w = c->p[1], dstr = w + c->p[2], sstr = w + c->p[3];
    float *src = rnd((size_t)n * sstr, 1.0f), *dst = rnd((size_t)n * dstr, 1.0f);
    double *out;
    if (!b) {
        out = dup_d(dst, (size_t)n * dstr);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < w; j++) out[(size_t)i * dstr + j] = src[(size_t)i * sstr + j];
    } else {
        void *ds = d_act(b, src, (size_t)n * sstr), *dd = d_act(b, dst, (size_t)n * dstr);
        LAUNCH(b, b->ops->copy_2d(b, dd, dstr, ds, sstr, n, w));
        out = d_get_act(b, dd, (size_t)n * dstr);
    }
    outs_add(o, "dst", out, n, dstr, false);
    free(src);
    free(dst);
}

/* The sampler's contract (core/sampler.h) in float64 for one row: penalty,
 * temperature, top-k (boundary ties kept), top-p (keep while the mass
 * strictly above is < top_p), min-p, softmax over the survivors, walk them
 * in id order to the first whose cumulative probability exceeds u. *amb is
 * set where a float32 implementation may legitimately differ (u or a filter
 * boundary within 1e-5 of a decision). */
static int ref_sample_row(const float *x, int d, const fl_sample_row *r, const int32_t *hist, bool *amb) {
    double *l = malloc(sizeof(double) * d);
    for (int j = 0; j < d; j++) l[j] = x[j];
    if (r->penalty != 1.0f) {
        bool *seen = calloc(d, 1);
        for (int i = 0; i < r->hist_n; i++) seen[hist[r->hist_lo + i]] = true;
        for (int j = 0; j < d; j++)
            if (seen[j]) l[j] = (float)(l[j] > 0 ? (float)l[j] / r->penalty : (float)l[j] * r->penalty);
        free(seen);
    }
    int best = 0;
    for (int j = 1; j < d; j++)
        if (l[j] > l[best]) best = j;
    *amb = false;
    if (r->temperature == 0) {
        free(l);
        return best;
    }
    double *pr = malloc(sizeof(double) * d), sum = 0;
    bool *keep = malloc(d);
    for (int j = 0; j < d; j++) l[j] /= r->temperature, keep[j] = true;
    if (r->top_k > 0 && r->top_k < d) { /* the k-th largest score */
        double *s = malloc(sizeof(double) * d);
        memcpy(s, l, sizeof(double) * d);
        for (int i = 0; i < r->top_k; i++) { /* partial selection sort, descending */
            int m = i;
            for (int j = i + 1; j < d; j++)
                if (s[j] > s[m]) m = j;
            const double t = s[i];
            s[i] = s[m], s[m] = t;
        }
        const double kth = s[r->top_k - 1];
        for (int j = 0; j < d; j++) keep[j] = l[j] >= kth;
        free(s);
    }
    for (int j = 0; j < d; j++) sum += keep[j] ? (pr[j] = exp(l[j] - l[best])) : (pr[j] = 0);
    for (int j = 0; j < d; j++) pr[j] /= sum;
    if (r->top_p < 1.0f) { /* descending by probability (ties: lower id first) */
        int *ord = malloc(sizeof(int) * d), m = 0;
        for (int j = 0; j < d; j++)
            if (keep[j]) ord[m++] = j;
        for (int i = 1; i < m; i++) /* insertion sort */
            for (int j = i; j > 0 && (pr[ord[j]] > pr[ord[j - 1]]); j--) {
                const int t = ord[j];
                ord[j] = ord[j - 1], ord[j - 1] = t;
            }
        double above = 0;
        for (int i = 0; i < m; i++) {
            if (i > 0 && above >= r->top_p) keep[ord[i]] = false;
            if (fabs(above - r->top_p) < 1e-5) *amb = true;
            above += pr[ord[i]];
        }
        free(ord);
    }
    if (r->min_p > 0) {
        for (int j = 0; j < d; j++) {
            if (!keep[j] || j == best) continue;
            if (fabs(pr[j] - r->min_p * pr[best]) < 1e-5 * pr[best]) *amb = true;
            if (pr[j] < r->min_p * pr[best]) keep[j] = false;
        }
    }
    sum = 0;
    for (int j = 0; j < d; j++) sum += keep[j] ? pr[j] : 0;
    double cum = 0;
    int pick = -1, last = -1;
    for (int j = 0; j < d && pick < 0; j++) {
        if (!keep[j]) continue;
        last = j;
        /* u near either end of the picked token's interval: a near tie */
        if (fabs(cum - r->u) < 1e-5) *amb = true;
        cum += pr[j] / sum;
        if (fabs(cum - r->u) < 1e-5) *amb = true;
        if (r->u < cum) pick = j;
    }
    free(l);
    free(pr);
    free(keep);
    return pick >= 0 ? pick : last;
}

static void op_sample_rows(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], d = c->p[1], mode = c->p[2];
    float *x = rnd((size_t)n * d, 4.0f);
    fl_sample_row *rows = calloc(n, sizeof *rows);
    const int n_hist = 3 * n;
    int32_t *hist = malloc(sizeof(int32_t) * n_hist);
    for (int i = 0; i < n_hist; i++) hist[i] = irand(d);
    for (int i = 0; i < n; i++) {
        fl_sample_row *r = &rows[i];
        r->u = (frand() + 1.0) * 0.5;
        r->temperature = mode == SAMPLE_GREEDY || mode == SAMPLE_PENALTY ? 0.0f : 0.5f + 0.1f * (i % 5);
        r->top_p = 1.0f, r->min_p = 0.0f, r->penalty = 1.0f;
        r->hist_lo = 3 * i, r->hist_n = 3;
        if (mode == SAMPLE_PENALTY || mode == SAMPLE_ALL) r->penalty = 1.3f;
        if (mode == SAMPLE_TOPK || mode == SAMPLE_ALL) r->top_k = 1 + i % 40;
        if (mode == SAMPLE_TOPP || mode == SAMPLE_ALL) r->top_p = 0.5f + 0.05f * (i % 9);
        if (mode == SAMPLE_MINP || mode == SAMPLE_ALL) r->min_p = 0.02f + 0.03f * (i % 4);
        if (mode == SAMPLE_PENALTY) /* make a history token the top one, so the penalty decides */
            x[(size_t)i * d + hist[3 * i]] = 4.5f;
    }
    bool any_top_p = mode == SAMPLE_TOPP || mode == SAMPLE_ALL;
    double *tok = malloc(sizeof(double) * n);
    if (!b) {
        int n_amb = 0;
        for (int i = 0; i < n; i++) {
            bool amb;
            tok[i] = ref_sample_row(x + (size_t)i * d, d, &rows[i], hist, &amb);
            if (amb) tok[i] = -1, n_amb++; /* either pick is right: compare() accepts any */
        }
        /* the draws are random: nearly every row must be decided */
        if (n_amb > n / 4) fail_msg("sample_rows: %d of %d rows too close to a boundary to check", n_amb, n);
    } else {
        void *dx = d_act(b, x, (size_t)n * d), *dr = d_raw(b, rows, sizeof *rows * n);
        void *dh = d_raw(b, hist, sizeof(int32_t) * n_hist), *dout = d_alloc(b, sizeof(int32_t) * 2 * n);
        const size_t ws = b->ops->sample_rows_ws(b, n, d);
        void *dws = ws ? d_alloc(b, ws) : NULL;
        LAUNCH(b, b->ops->sample_rows(b, dx, n, d, dr, dh, any_top_p, dws, dout));
        double *both = d_get_i32(b, dout, 2 * (size_t)n);
        for (int i = 0; i < n; i++) {
            if (both[2 * i + 1] != 0) fail_msg("sample_rows row %d: flag %g (NaN / all -inf?)", i, both[2 * i + 1]);
            tok[i] = both[2 * i];
        }
        free(both);
    }
    outs_add(o, "token", tok, n, 1, true);
    free(x);
    free(rows);
    free(hist);
}

/* Routed pairs of a MoE case: ids [n, k] distinct per row, of E experts. */
static int32_t *moe_ids(int n, int k, int E) {
    int32_t *ids = malloc(sizeof(int32_t) * n * k);
    for (int i = 0; i < n; i++) {
        int32_t *p = perm(E);
        memcpy(ids + (size_t)i * k, p, sizeof(int32_t) * k);
        free(p);
    }
    return ids;
}
/* The grouping moe_group must make (float64 not needed: integers). */
static int32_t *ref_moe_group(const int32_t *ids, int n, int k, int lo, int nl) {
    int32_t *list = calloc((size_t)nl + 1 + (size_t)n * k, sizeof(int32_t));
    int at = 0;
    for (int j = 0; j < nl; j++) {
        list[j] = at;
        for (int p = 0; p < n * k; p++)
            if (ids[p] == lo + j) list[nl + 1 + at++] = p;
    }
    list[nl] = at;
    return list;
}

static void op_moe_group(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], k = c->p[1], E = c->p[2], lo = c->p[3], nl = c->p[4];
    int32_t *ids = moe_ids(n, k, E);
    const size_t len = (size_t)nl + 1 + (size_t)n * k;
    double *out = malloc(sizeof(double) * len);
    if (!b) {
        int32_t *list = ref_moe_group(ids, n, k, lo, nl);
        for (size_t i = 0; i < len; i++) out[i] = i < (size_t)nl + 1 + list[nl] ? list[i] : -1;
        free(list);
    } else {
        void *di = d_raw(b, ids, sizeof(int32_t) * n * k), *dl = d_alloc(b, sizeof(int32_t) * len);
        LAUNCH(b, b->ops->moe_group(b, di, n, k, lo, nl, dl));
        double *got = d_get_i32(b, dl, len);
        for (size_t i = 0; i < len; i++) out[i] = i < (size_t)nl + 1 + (size_t)got[nl] ? got[i] : -1;
        free(got);
    }
    outs_add(o, "list", out, 1, len, true);
    free(ids);
}

static void op_moe_matmul(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], k = c->p[1], E = c->p[2], lo = c->p[3], nl = c->p[4], in = c->p[5], out_f = c->p[6];
    const int pp = c->p[7], g = c->p[8];
    int32_t *ids = moe_ids(n, k, E), *list = ref_moe_group(ids, n, k, lo, nl);
    hweight *w = calloc(nl, sizeof *w);
    for (int j = 0; j < nl; j++) make_weight(c->dt, out_f, in, g, 0.05f, &w[j]);
    const int xr = pp ? n * k : n;
    float *x = rnd((size_t)xr * in, 1.0f), *pre = rnd((size_t)n * k * out_f, 1.0f);
    double *out;
    if (!b) {
        out = dup_d(pre, (size_t)n * k * out_f); /* rows of pairs not routed here stay */
        for (int j = 0; j < nl; j++)
            for (int a = list[j]; a < list[j + 1]; a++) {
                const int p = list[nl + 1 + a];
                const float *xi = x + (size_t)(pp ? p : p / k) * in;
                for (int r = 0; r < out_f; r++) {
                    double s = 0;
                    for (int q = 0; q < in; q++) s += xi[q] * w[j].w[(size_t)r * in + q];
                    out[(size_t)p * out_f + r] = s;
                }
            }
    } else {
        fl_tensor *tab = malloc(sizeof(fl_tensor) * nl);
        for (int j = 0; j < nl; j++) tab[j] = *d_weight(b, &w[j].t);
        void *dtab = d_raw(b, tab, sizeof(fl_tensor) * nl);
        void *dx = d_act(b, x, (size_t)xr * in), *dout = d_act(b, pre, (size_t)n * k * out_f);
        void *dl = d_raw(b, list, sizeof(int32_t) * ((size_t)nl + 1 + (size_t)n * k));
        /* w0: a host copy of the first device descriptor (upload_weight may repack);
         * n = 0 asks whether the backend runs these weights at all (backend.h) */
        const fl_status probe = b->ops->moe_matmul(b, dx, pp, 0, k, dl, nl, dtab, &tab[0], dout);
        if (probe == FL_ERR_UNSUPPORTED && b != g_cpu) {
            fl_error_clear();
            g_not_offered = true;
            out = dup_d(pre, (size_t)n * k * out_f);
        } else {
            OK(probe);
            LAUNCH(b, b->ops->moe_matmul(b, dx, pp, n, k, dl, nl, dtab, &tab[0], dout));
            out = d_get_act(b, dout, (size_t)n * k * out_f);
        }
        free(tab);
    }
    outs_add(o, "out", out, (size_t)n * k, out_f, false);
    for (int j = 0; j < nl; j++) hweight_free(&w[j]);
    free(w);
    free(ids);
    free(list);
    free(x);
    free(pre);
}

/* moe_combine, and with extra / x / norm the whole moe_combine_add_rmsnorm. */
static void moe_combine_common(const tcase *c, fl_backend *b, outs *o, bool norm) {
    const int n = c->p[0], k = c->p[1], E = c->p[2], lo = c->p[3], nl = c->p[4], d = c->p[5];
    const bool has_extra = norm && c->p[6];
    int32_t *ids = moe_ids(n, k, E);
    float *src = rnd((size_t)n * k * d, 1.0f), *wts = rnd((size_t)n * k, 1.0f), *acc0 = rnd((size_t)n * d, 1.0f);
    float *extra = rnd((size_t)n * d, 1.0f), *x = rnd((size_t)n * d, 2.0f), *nw = rnd(d, 1.0f);
    double *oacc, *ox = NULL, *oout = NULL;
    if (!b) {
        oacc = calloc((size_t)n * d, sizeof(double));
        for (int i = 0; i < n; i++)
            for (int e = lo; e < lo + nl; e++) /* ascending expert order */
                for (int j = 0; j < k; j++) {
                    if (ids[i * k + j] != e) continue;
                    for (int q = 0; q < d; q++)
                        oacc[(size_t)i * d + q] += (double)wts[i * k + j] * src[((size_t)i * k + j) * d + q];
                }
        if (norm) {
            if (has_extra)
                for (size_t q = 0; q < (size_t)n * d; q++) oacc[q] += extra[q];
            ox = malloc(sizeof(double) * n * d);
            for (size_t q = 0; q < (size_t)n * d; q++) ox[q] = (double)x[q] + oacc[q];
            oout = malloc(sizeof(double) * n * d);
            memcpy(oout, ox, sizeof(double) * n * d);
            double *wd = dup_d(nw, d);
            for (int i = 0; i < n; i++) ref_rmsnorm(oout + (size_t)i * d, wd, 1e-6, d);
            free(wd);
        }
    } else {
        void *dacc = d_act(b, acc0, (size_t)n * d), *dsrc = d_act(b, src, (size_t)n * k * d);
        void *dids = d_raw(b, ids, sizeof(int32_t) * n * k), *dw = d_raw(b, wts, sizeof(float) * n * k);
        if (norm) {
            fl_tensor tw = vec_t(nw, d), *dnw = d_weight(b, &tw);
            void *dx = d_act(b, x, (size_t)n * d), *dout = d_poison(b, (size_t)n * d);
            void *dex = has_extra ? d_act(b, extra, (size_t)n * d) : NULL;
            OK(b->ops->moe_combine_add_rmsnorm(b, dacc, dsrc, dids, dw, n, k, lo, nl, d, dex, dx, dnw, 1e-6f, dout));
            ox = d_get_act(b, dx, (size_t)n * d), oout = d_get_act(b, dout, (size_t)n * d);
            oacc = d_get_act(b, dacc, (size_t)n * d);
            if (g_perf_reps > 0)
                LAUNCH(b, b->ops->moe_combine_add_rmsnorm(b, dacc, dsrc, dids, dw, n, k, lo, nl, d, dex, dx, dnw,
                                                          1e-6f, dout));
        } else {
            LAUNCH(b, b->ops->moe_combine(b, dacc, dsrc, dids, dw, n, k, lo, nl, d));
            oacc = d_get_act(b, dacc, (size_t)n * d);
        }
    }
    outs_add(o, "acc", oacc, n, d, false);
    if (norm) {
        outs_add(o, "x", ox, n, d, false);
        outs_add(o, "out", oout, n, d, false);
    }
    void *fr[] = {ids, src, wts, acc0, extra, x, nw};
    for (size_t i = 0; i < sizeof fr / sizeof fr[0]; i++) free(fr[i]);
}
static void op_moe_combine(const tcase *c, fl_backend *b, outs *o) { moe_combine_common(c, b, o, false); }
static void op_moe_combine_add_rmsnorm(const tcase *c, fl_backend *b, outs *o) { moe_combine_common(c, b, o, true); }

static void op_mla_rope_norm_store(const tcase *c, fl_backend *b, outs *o) {
    const int n = c->p[0], nh = c->p[1], nope = c->p[2], rope = c->p[3], kvl = c->p[4], n_slots = c->p[5];
    const int qk = nope + rope, rec = kvl + rope, qs = nh * qk, half = rope / 2;
    float *q = rnd((size_t)n * qs, 2.0f), *ckv = rnd((size_t)n * rec, 2.0f), *w = rnd(kvl, 1.0f), *cs, *sn;
    float *kc = rnd((size_t)n_slots * rec / 2, 1.0f), *vc = rnd((size_t)n_slots * rec / 2, 1.0f);
    angles(n, half, &cs, &sn);
    int32_t *slots = slot_list(n, n_slots);
    double *oq, *ockv, *okc, *ovc;
    if (!b) {
        oq = dup_d(q, (size_t)n * qs), ockv = dup_d(ckv, (size_t)n * rec);
        okc = dup_d(kc, (size_t)n_slots * rec / 2), ovc = dup_d(vc, (size_t)n_slots * rec / 2);
        double *wd = dup_d(w, kvl);
        for (int t = 0; t < n; t++) {
            double *r = ockv + (size_t)t * rec;
            for (int h = 0; h < nh; h++) /* every head's q_pe, interleaved pairs */
                ref_rope(oq + (size_t)t * qs + (size_t)h * qk + nope, 1, rope, cs + (size_t)t * half,
                         sn + (size_t)t * half, rope, true);
            ref_rope(r + kvl, 1, rope, cs + (size_t)t * half, sn + (size_t)t * half, rope, true);
            ref_rmsnorm(r, wd, 1e-6, kvl);
            if (slots[t] < 0) continue;
            memcpy(okc + (size_t)slots[t] * rec / 2, r, sizeof(double) * rec / 2);
            memcpy(ovc + (size_t)slots[t] * rec / 2, r + rec / 2, sizeof(double) * rec / 2);
        }
        free(wd);
    } else {
        fl_tensor tw = vec_t(w, kvl), *dw = d_weight(b, &tw);
        void *dq = d_act(b, q, (size_t)n * qs), *dckv = d_act(b, ckv, (size_t)n * rec);
        void *dkc = d_act(b, kc, (size_t)n_slots * rec / 2), *dvc = d_act(b, vc, (size_t)n_slots * rec / 2);
        void *dc = d_raw(b, cs, sizeof(float) * n * half), *ds = d_raw(b, sn, sizeof(float) * n * half);
        void *dsl = d_raw(b, slots, sizeof(int32_t) * n);
        LAUNCH(b, b->ops->mla_rope_norm_store(b, dq, qs, dckv, n, nh, nope, rope, kvl, dc, ds, dw, 1e-6f, dsl, dkc,
                                              dvc));
        oq = d_get_act(b, dq, (size_t)n * qs), ockv = d_get_act(b, dckv, (size_t)n * rec);
        okc = d_get_act(b, dkc, (size_t)n_slots * rec / 2), ovc = d_get_act(b, dvc, (size_t)n_slots * rec / 2);
    }
    outs_add(o, "q", oq, (size_t)n * nh, qk, false);
    outs_add(o, "ckv", ockv, n, rec, false);
    outs_add(o, "k_cache", okc, n_slots, rec / 2, false);
    outs_add(o, "v_cache", ovc, n_slots, rec / 2, false);
    void *fr[] = {q, ckv, w, cs, sn, kc, vc, slots};
    for (size_t i = 0; i < sizeof fr / sizeof fr[0]; i++) free(fr[i]);
}

typedef void (*op_fn)(const tcase *c, fl_backend *b, outs *o);
static const op_fn OP_FNS[OP_COUNT] = {
    op_embed, op_rmsnorm, op_matmul, op_rope, op_rope_kv_store, op_kv_store, op_attention, op_silu_mul,
    op_add, op_add_rmsnorm, op_moe_topk, op_gather_rows, op_scatter_add_rows, op_sigmoid_scale_rows,
    op_mla_attention, op_argmax_rows, op_copy_2d, op_sample_rows, op_moe_group, op_moe_matmul, op_moe_combine,
    op_moe_combine_add_rmsnorm, op_qknorm_rope_kv_store, op_mla_rope_norm_store};

/* Whether backend b has the op (optional members may be NULL). */
static bool has_op(const fl_backend *b, op_id op) {
    const fl_backend_ops *o = b->ops;
    switch (op) {
    case OP_MOE_GROUP: return o->moe_group;
    case OP_MOE_MATMUL: return o->moe_matmul;
    case OP_MOE_COMBINE: return o->moe_combine;
    case OP_MOE_COMBINE_ADD_RMSNORM: return o->moe_combine_add_rmsnorm;
    case OP_QKNORM_ROPE_KV_STORE: return o->qknorm_rope_kv_store;
    case OP_MLA_ROPE_NORM_STORE: return o->mla_rope_norm_store;
    case OP_SAMPLE_ROWS: return o->sample_rows && o->sample_rows_ws;
    case OP_ARGMAX_ROWS: return o->argmax_rows;
    case OP_COPY_2D: return o->copy_2d;
    case OP_MLA_ATTENTION: return o->mla_attention;
    default: return true;
    }
}

/* --- comparison ------------------------------------------------------------------ */

/* Worst normalized row error of got against ref (see the top); exact
 * outputs: 0 when equal (NaN equal to NaN; a reference of -1 in a token
 * output accepts anything), else +inf. */
static double compare(const outs *got, const outs *ref, int i) {
    const size_t rows = ref->rows[i], cols = ref->cols[i];
    assert_int_equal(got->rows[i] * got->cols[i], rows * cols);
    double worst = 0;
    for (size_t r = 0; r < rows; r++) {
        double num = 0, den = 0;
        for (size_t c = 0; c < cols; c++) {
            const double g = got->v[i][r * cols + c], e = ref->v[i][r * cols + c];
            if (ref->exact[i]) {
                if (!(g == e || (isnan(g) && isnan(e)) || (e == -1 && !strcmp(ref->name[i], "token")))) return INFINITY;
                continue;
            }
            if (isnan(g) != isnan(e) || isinf(g) != isinf(e)) return INFINITY;
            if (isnan(e) || isinf(e)) continue;
            const double d = fabs(g - e);
            num = d > num ? d : num;
            den = fabs(e) > den ? fabs(e) : den;
        }
        const double rel = num / (den > 0 ? den : 1);
        worst = rel > worst ? rel : worst;
    }
    return worst;
}

static void case_name(const tcase *c, char *buf, size_t n) {
    int at = snprintf(buf, n, "%s", OP_NAMES[c->op]);
    if (c->op == OP_MATMUL || c->op == OP_EMBED || c->op == OP_MOE_MATMUL)
        at += snprintf(buf + at, n - at, " %s", fl_dtype_name(c->dt));
    int np = 10;
    while (np > 0 && c->p[np - 1] == 0) np--;
    for (int i = 0; i < np && at < (int)n; i++) at += snprintf(buf + at, n - at, "%s%d", i ? "," : " [", c->p[i]);
    if (np && at < (int)n) snprintf(buf + at, n - at, "]");
}

/* A case's inputs depend on its name only (FNV-1a), so deleting or adding
 * rows leaves the other cases' inputs as they were. */
static uint64_t case_seed(const tcase *c) {
    char name[160];
    case_name(c, name, sizeof name);
    uint64_t h = 1469598103934665603ull;
    for (const char *p = name; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
    return h;
}

/* --- the runs ------------------------------------------------------------------- */

static const char *g_filter;
static fl_backend *g_dev;
static char g_dev_why[512];

static bool selected(const tcase *c) {
    if (!g_filter) return true;
    char name[160];
    case_name(c, name, sizeof name);
    return strstr(name, g_filter) != NULL;
}

/* Runs case i on b and on the reference (or on g_cpu when cmp_cpu): prints
 * one line, returns whether it passed. */
static bool run_case(size_t i, fl_backend *b, bool cmp_cpu) {
    const tcase *c = &g_cases[i];
    char name[160];
    case_name(c, name, sizeof name);
    if (!has_op(b, c->op)) {
        printf("  %-52s %-5s not offered (optional op)\n", name, b->name);
        return true;
    }
    outs ref = {0}, got = {0};
    const uint64_t seed = case_seed(c);
    rng_seed(seed);
    OP_FNS[c->op](c, cmp_cpu ? g_cpu : NULL, &ref);
    run_release(g_cpu);
    rng_seed(seed);
    g_perf_reps = 0;
    g_not_offered = false;
    OP_FNS[c->op](c, b, &got);
    run_release(b);
    if (g_not_offered) { /* only a device may decline, and it is listed */
        printf("  %-52s %-5s declined (FL_ERR_UNSUPPORTED where backend.h allows it)\n", name, b->name);
        outs_free(&ref);
        outs_free(&got);
        return true;
    }
    const double tol = cmp_cpu ? c->tol_dev : c->tol_ref;
    bool pass = got.n == ref.n;
    double worst = 0;
    const char *worst_out = "";
    for (int k = 0; k < ref.n && pass; k++) {
        const double e = compare(&got, &ref, k);
        if (e > worst || k == 0) worst = e, worst_out = ref.name[k];
        if (!(e <= (ref.exact[k] ? 0 : tol))) pass = false;
    }
    printf("  %-52s %-5s vs %-4s err %-9.2e (%s) tol %.0e %s\n", name, b->name, cmp_cpu ? "cpu" : "f64", worst,
           worst_out, tol, pass ? "ok" : "FAIL");
    outs_free(&ref);
    outs_free(&got);
    return pass;
}

static int g_perf_arg;
static bool g_all;

static void perf_case(size_t i, fl_backend *b) {
    const tcase *c = &g_cases[i];
    if (!has_op(b, c->op)) return;
    char name[160];
    case_name(c, name, sizeof name);
    outs got = {0};
    rng_seed(case_seed(c));
    g_perf_reps = g_perf_arg;
    g_last_us = NAN;
    OP_FNS[c->op](c, b, &got);
    g_perf_reps = 0;
    run_release(b);
    outs_free(&got);
    printf("  perf %-52s %-5s %10.2f us\n", name, b->name, g_last_us);
}

static void test_cpu_vs_f64(void **state) {
    (void)state;
    int failed = 0, ran = 0;
    bool seen[OP_COUNT] = {0};
    int n_big = 0;
    for (size_t i = 0; i < N_CASES; i++) {
        if (!selected(&g_cases[i])) continue;
        seen[g_cases[i].op] = true;
        if (g_cases[i].big && !g_all) {
            n_big++;
            continue;
        }
        ran++;
        if (!run_case(i, g_cpu, false)) failed++;
    }
    if (n_big) printf("(%d large cases left to the device comparison; --all checks them here too)\n", n_big);
    int n_ops = 0;
    for (int k = 0; k < OP_COUNT; k++) n_ops += seen[k];
    printf("cpu vs float64: %d cases of %d ops, %d failed\n", ran, n_ops, failed);
    if (!g_filter && n_ops != OP_COUNT) fail_msg("only %d of %d ops have cases", n_ops, OP_COUNT);
    if (failed) fail_msg("%d of %d cases failed on the CPU backend", failed, ran);
}

static void test_devices_vs_cpu(void **state) {
    (void)state;
    if (!g_dev) {
        if (getenv("FL_REQUIRE_GPU") && !strcmp(getenv("FL_REQUIRE_GPU"), "1"))
            fail_msg("FL_REQUIRE_GPU=1 but the CUDA backend did not start: %s", g_dev_why);
        printf("  skipped (no GPU): %s\n", g_dev_why);
        skip();
    }
    int failed = 0, ran = 0;
    for (size_t i = 0; i < N_CASES; i++) {
        if (!selected(&g_cases[i])) continue;
        ran++;
        if (!run_case(i, g_dev, true)) failed++;
    }
    printf("%s vs cpu: %d cases, %d failed\n", g_dev->name, ran, failed);
    if (failed) fail_msg("%d of %d cases failed on %s", failed, ran, g_dev->name);
}

static void test_perf(void **state) {
    (void)state;
    for (size_t i = 0; i < N_CASES; i++) {
        if (!selected(&g_cases[i])) continue;
        perf_case(i, g_cpu);
        if (g_dev) perf_case(i, g_dev);
    }
}

static int setup(void **state) {
    (void)state;
    /* the CPU backend is the reference here: its f32 matmuls, not its SIMD kernels */
    if (!fl_opt_is_set(FL_OPT_CPU_KERNELS)) (void)fl_opt_override(FL_OPT_CPU_KERNELS, "c");
    if (fl_backend_cpu_init(&g_cpu) != FL_OK) return -1;
    if (fl_backend_cuda_init(0, &g_dev) != FL_OK) {
        snprintf(g_dev_why, sizeof g_dev_why, "%s", fl_error_msg());
        g_dev = NULL;
        fl_error_clear();
    }
    return 0;
}
static int teardown(void **state) {
    (void)state;
    fl_backend_free(g_dev);
    fl_backend_free(g_cpu);
    return 0;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--perf")) {
            g_perf_arg = 20;
            if (i + 1 < argc && atoi(argv[i + 1]) > 0) g_perf_arg = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--all")) {
            g_all = true;
        } else if (!strcmp(argv[i], "--filter") && i + 1 < argc) {
            g_filter = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--perf [reps]] [--all] [--filter TEXT]\n", argv[0]);
            return 2;
        }
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_vs_f64),
        cmocka_unit_test(test_devices_vs_cpu),
        cmocka_unit_test(test_perf),
    };
    /* test_perf only with --perf */
    return _cmocka_run_group_tests("test_backend_ops", tests, g_perf_arg > 0 ? 3 : 2, setup, teardown);
}
