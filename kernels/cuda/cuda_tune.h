/*
 * cuda_tune.h — the CUDA backend's tuning overrides: values that replace a
 * built-in choice of a default path (a kernel, a block shape, a split count,
 * an A/B switch) for measurements and tests. They are not product options:
 * bench/bench_kernels.cu sets them from `--tune NAME=VALUE`, tests call
 * fl_cuda_tune_set, and an end-to-end A/B run (flotilla bench) sets them
 * through the one registry option FL_CUDA_TUNE=NAME=VALUE[,...], applied
 * when the process opens its first CUDA backend. Unset, every value stays
 * -1 (the built-in choice).
 *
 * Threading: plain process-wide values, read by the launchers on every call
 * (one load each). Set them before launching, from one thread; a captured
 * CUDA graph keeps the choices of its capture.
 */
#ifndef FL_CUDA_TUNE_H
#define FL_CUDA_TUNE_H

#include <stdio.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* FL_CUDA_TUNE(ID, "name", "values"): name is what --tune takes. For an
 * on/off switch, 0 turns the default path off (1 or -1: on). */
#define FL_CUDA_TUNE_LIST(FL_CUDA_TUNE)                                                                     \
    FL_CUDA_TUNE(PDL, "pdl", "0: no programmatic dependent launch")                                         \
    FL_CUDA_TUNE(W4_DEQUANT_MIN_N, "w4_dequant_min_n", "tokens from which W4 goes dequantize + cuBLAS "       \
                                                       "(default 128; read at backend init)")              \
    FL_CUDA_TUNE(W4_GEMM, "w4_gemm", "W4 tensor-core GEMM (cuda_w4_gemm.cu) from this many tokens up to "    \
                                     "w4_dequant_min_n (default 64; 0: never)")                                  \
    FL_CUDA_TUNE(W4_GEMV, "w4_gemv", "plain W4 GEMV kernel: ring=0, bulk=1, dual=2 (bulk for gate|up only)") \
    FL_CUDA_TUNE(W4_GEMV_VARIANT, "w4_gemv_variant", "with w4_gemv=bulk: the bulk kernel's variant, every " \
                                                     "launch")                                             \
    FL_CUDA_TUNE(W4_GEMV_WARPS, "w4_gemv_warps", "with w4_gemv=bulk: its warps a block, every launch")      \
    FL_CUDA_TUNE(W4_GEMV_SMALL_T, "w4_gemv_small_t", "ring kernel, plain GEMVs of <= 8192 rows: tiles a "   \
                                                     "block (1, 2, 4; with w4_gemv_small_warps)")          \
    FL_CUDA_TUNE(W4_GEMV_SMALL_WARPS, "w4_gemv_small_warps", "the same: warps a block")                     \
    FL_CUDA_TUNE(W4_BULK_WARPS, "w4_bulk_warps", "bulk W4 kernel: resident warps an SM (1..32, default "    \
                                                 "16)")                                                    \
    FL_CUDA_TUNE(W4_BULK_UNROLL16, "w4_bulk_unroll16", "0: no full-chunk instantiations at 9..16 tokens")   \
    FL_CUDA_TUNE(W4_STAGES, "w4_stages", "old W4 kernel (w4_mma_kernel): ring stages, 4 or 5")             \
    FL_CUDA_TUNE(W4_T, "w4_t", "old W4 kernel: tiles a block, 1, 2 or 4")                                  \
    FL_CUDA_TUNE(BF16_GEMV, "bf16_gemv", "bf16 decode GEMV: tiles an SM it takes at most (default 14; 0: " \
                                         "never)")                                                         \
    FL_CUDA_TUNE(FP8_GEMV, "fp8_gemv", "FP8 decode GEMV (default 1..8 tokens): 0 never (cuBLASLt), 1 or more " \
                                       "up to 16")                                                         \
    FL_CUDA_TUNE(FP8_FAST_ACCUM, "fp8_fast_accum", "FP8 cuBLASLt GEMMs: 1 fast accumulation "             \
                                                   "(CUBLASLT_MATMUL_DESC_FAST_ACCUM), 0 or unset: f32")   \
    FL_CUDA_TUNE(GEMV_ROWS, "gemv_rows", "0: few-row bf16 matmuls on cuBLAS")                               \
    FL_CUDA_TUNE(ROPE_FUSE, "rope_fuse", "0: no matmul_rope_kv (matmul, then rope_kv_store)")               \
    FL_CUDA_TUNE(GLU_FUSE, "glu_fuse", "gate_up_silu serves none=0, dense=1, moe=2, all=3 (default)")      \
    FL_CUDA_TUNE(MOE_BULK, "moe_bulk", "routed W4 GEMVs on the bulk kernel: none=0, all=1, dual=2 "         \
                                       "(default: by shape)")                                              \
    FL_CUDA_TUNE(MOE_NORM_FUSE, "moe_norm_fuse", "0: moe_combine, add, add_rmsnorm as three launches")      \
    FL_CUDA_TUNE(NORM_VEC, "norm_vec", "0: every add_rmsnorm on the 1024-thread form")                      \
    FL_CUDA_TUNE(RMS_DEFER, "rms_defer", "0: no deferred norm (matmul_add_rms_max_n says 0)")               \
    FL_CUDA_TUNE(RMS_DEFER_N, "rms_defer_n", "most tokens a step defers its norms at (default 16)")         \
    FL_CUDA_TUNE(RMS_DEFER_FINAL, "rms_defer_final", "producer's last block adds the partials: 0 never, "   \
                                                     "1 always (default from 2 tokens)")                   \
    FL_CUDA_TUNE(ATTN_DECODE, "attn_decode", "0: short-context decode on the SIMT kernel")                  \
    FL_CUDA_TUNE(ATTN_PREWAIT, "attn_prewait", "0: attn_decode_kernel stages every K/V row after the wait") \
    FL_CUDA_TUNE(ATTN_DEC_HEADS, "attn_dec_heads", "query heads a block of attn_decode_kernel (1..4)")      \
    FL_CUDA_TUNE(ATTN_SPLITDEC, "attn_splitdec", "0: long-context decode on attn_mma_kernel")               \
    FL_CUDA_TUNE(SPLITDEC_PREWAIT, "splitdec_prewait", "0: attn_split_decode_kernel waits before any "      \
                                                       "global access")                                    \
    FL_CUDA_TUNE(MLA_KERNEL, "mla_kernel", "MLA attention kernel: simt=0, mma=1")                           \
    FL_CUDA_TUNE(MLA_SPLITS, "mla_splits", "MLA attention: context splits (capped by the context)")         \
    FL_CUDA_TUNE(MLA_WINDOW_ROWS, "mla_window_rows", "MLA attention: query rows a window at most")          \
    FL_CUDA_TUNE(SAMPLE_CLUSTER, "sample_cluster", "sample_rows: blocks a row (1, 2, 4, 8)")

typedef enum fl_cuda_tune_id {
#define FL_CUDA_TUNE_ENUM(id, name, doc) FL_CUDA_TUNE_##id,
    FL_CUDA_TUNE_LIST(FL_CUDA_TUNE_ENUM)
#undef FL_CUDA_TUNE_ENUM
    FL_CUDA_TUNE_COUNT
} fl_cuda_tune_id;

/* The values in force, indexed by fl_cuda_tune_id; -1: the built-in choice.
 * Read by the launchers directly (no call); written only through
 * fl_cuda_tune_set. */
extern long fl_cuda_tune_values[FL_CUDA_TUNE_COUNT];

/* Sets one override (-1: back to the built-in choice). An id out of range
 * is ignored. */
void fl_cuda_tune_set(fl_cuda_tune_id id, long value);

/* Sets every override back to -1. */
void fl_cuda_tune_reset(void);

/* "NAME=VALUE" (bench_kernels' --tune): NAME one of the list's names (case
 * ignored, an FL_ prefix allowed), VALUE a decimal integer, "auto" (-1) or
 * one of the words the list gives for it. FL_ERR_INVALID_ARG naming the
 * setting when it does not parse. */
fl_status fl_cuda_tune_parse(const char *setting);

/* A comma-separated list of NAME=VALUE settings (FL_CUDA_TUNE), each as
 * fl_cuda_tune_parse; NULL or "" sets nothing. */
fl_status fl_cuda_tune_parse_list(const char *list);

/* One line an override: name, value in force, what it does. */
void fl_cuda_tune_print(FILE *f);

static inline long fl_cuda_tune(fl_cuda_tune_id id) { return fl_cuda_tune_values[id]; }

#ifdef __cplusplus
}
#endif
#endif /* FL_CUDA_TUNE_H */
