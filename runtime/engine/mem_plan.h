/*
 * mem_plan.h — the memory planner: what one rank will hold, computed from
 * the model config and the checkpoint's headers (no weight is read), so a
 * layout that does not fit is refused before loading, the KV cache can take
 * what is left, and the engine can print the prediction next to what it
 * measures (`flotilla plan`, `--verbose`).
 *
 * Weights are counted as each backend holds them, not as the file stores
 * them: the CPU backend keeps f32/f16/bf16/Q8_0 as stored (aliasing the
 * mapping when it can) and GGUF Q4/AWQ/--quantize w4 as W4 (codes plus an
 * f32 scale and bias per group); CUDA holds every float or Q8_0 matrix as
 * bf16, vectors as f32 and W4 with bf16 scale and bias per group.
 *
 * Units: bytes everywhere. Pure functions; thread-safe.
 */
#ifndef FL_MEM_PLAN_H
#define FL_MEM_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "runtime/load/checkpoint.h"
#include "runtime/engine/kv_cache.h"
#include "runtime/model/model.h"

/* Which backend's storage rules apply. */
typedef enum fl_mem_backend {
    FL_MEM_BACKEND_CPU = 0,
    FL_MEM_BACKEND_CUDA,
} fl_mem_backend;

/* "auto", "f32", "bf16", "int8" -> *out; FL_ERR_INVALID_ARG names the value. */
fl_status fl_kv_dtype_parse(const char *s, fl_kv_dtype *out);
const char *fl_kv_dtype_name(fl_kv_dtype d);
/* AUTO resolved for a backend. */
fl_kv_dtype fl_kv_dtype_resolve(fl_kv_dtype d, fl_mem_backend be);
/* Bytes one token takes in one layer's K and V for kv_heads heads of
 * head_dim elements (int8: the values plus one f32 scale per int8_group
 * values each, padded as kernels/backend.h says; int8_group 0: a head). */
size_t fl_kv_token_layer_bytes(fl_kv_dtype d, int kv_heads, int head_dim, int int8_group);
/* The values an int8 KV scale covers for this model: a head; for MLA,
 * whose cache "head" is half a record (latent and rotary key together),
 * the largest power of two up to 64 that divides it, so the rotary part
 * (a multiple of 32 in DeepSeek-V2) never shares a scale with the latent
 * and outliers stay local (one scale a half record measured 9 % logit
 * error on deepseek_v2_lite, over the 6 % the other fixtures stay under). */
int fl_kv_int8_group(const fl_model_config *c);

/* Weight kinds of the breakdown. */
enum {
    FL_MEM_W_ATTN = 0, /* q/k/v/o projections, their biases and the MLA down/up projections */
    FL_MEM_W_MLP,      /* dense MLPs, routed and shared experts, routers */
    FL_MEM_W_EMBED,    /* token embeddings */
    FL_MEM_W_HEAD,     /* lm_head (this rank's vocabulary rows) */
    FL_MEM_W_NORM,     /* every norm weight */
    FL_MEM_W_KINDS
};
const char *fl_mem_weight_kind_name(int kind);

typedef struct fl_mem_plan_in {
    const fl_model_config *cfg; /* required */
    const fl_ckpt *ck;          /* stored dtypes from its headers; NULL: a synthetic model (bench
                                   presets: bf16 matrices, f32 vectors, W4 with quant) */
    fl_load_quant quant;
    fl_shard shard;             /* this rank's part (zeroed: the whole model) */
    fl_mem_backend backend;
    fl_kv_dtype kv_dtype;
    int block_size;             /* tokens per KV block (default 16) */
    int max_model_len;          /* 0: the model's */
    int max_num_batched_tokens; /* rows per step (workspace) */
    int max_num_seqs;           /* sequences per step */
    int tp;                     /* size of the group the model is sharded over (1: alone) */
    int dp;                     /* replicas (rank 0 keeps every replica's logits) */
    size_t budget;              /* bytes this rank may use: device memory x utilization on CUDA,
                                   the memory budget on the CPU */
    size_t swap_space_bytes;    /* --swap-space: the host pool of preempted sequences' blocks (0: none) */
} fl_mem_plan_in;

typedef struct fl_mem_plan {
    size_t weights[FL_MEM_W_KINDS]; /* held by the backend */
    size_t weights_total;
    size_t weights_aliased;  /* CPU: the part used in place from the mapped checkpoint */
    size_t file_pages;       /* CPU: the checkpoint pages the load reads (the weights used in
                                place and the sources of the converted ones); they stay mapped,
                                counted in RSS (clean page cache the kernel may reclaim) */
    size_t bookkeeping;      /* the model's host structures (layer and tensor tables) */
    size_t rss_predicted;    /* CPU: resident growth once every weight is read: the converted
                                copies, file_pages and bookkeeping */
    size_t kv_token_bytes;   /* one token, every layer, this rank's heads or latent */
    size_t kv_block_bytes;   /* one block */
    size_t workspace;        /* activation buffers at max_num_batched_tokens (backend memory) */
    size_t host_scratch;     /* host-side buffers of the forward pass (rope tables, MoE lists) */
    size_t logits;           /* logits buffers, device and host */
    size_t graph_estimate;   /* CUDA: graph pools and cuBLAS workspace (estimate) */
    size_t comm_estimate;    /* CUDA with tp > 1: NCCL buffers (estimate) */
    size_t w4_scratch;       /* CUDA: a bf16 copy of the largest packed W4 matrix, made while the
                                weights upload (many-token W4 matmuls dequantize into it), and
                                the W4 GEMM's workspace (FL_CUDA_W4_GEMM_WS_BYTES); with FP8
                                linears, a step's activations as e4m3 codes plus a scale a row */
    size_t fixed;            /* everything above but the KV cache, in the budget's memory */
    size_t budget;
    int64_t kv_blocks;       /* what the budget leaves for the cache (<= 0: nothing), at most what
                                max_model_len x max_num_seqs can use (the engine's cap) */
    bool kv_capped;          /* kv_blocks is that cap, not what the budget leaves */
    int64_t kv_tokens;
    int max_model_len;
    double kv_seqs;          /* full-length sequences the cache holds */
    int kv_heads, head_dim;  /* per token per layer record: this rank's heads */
    fl_kv_dtype kv_dtype;    /* resolved */
    fl_mem_backend backend;
    /* The host swap pool (runtime/engine/kv_swap.h), sized as the engine sizes it
     * (fl_kv_swap_pool_blocks of kv_blocks): pinned host memory on CUDA, outside
     * the device budget; plain host memory on the CPU, allocated on top of the
     * budget the cache took and resident only as blocks are swapped out. */
    size_t swap_space;       /* asked for (--swap-space) */
    int64_t swap_blocks;     /* blocks of kv_block_bytes (0: preemption recomputes) */
    int64_t swap_tokens;
    size_t swap_bytes;
    size_t host_total;       /* CPU: fixed + KV cache + a full pool, the host memory at worst (CUDA: 0) */
} fl_mem_plan;

/* Computes the plan. Errors: a config the shard does not divide (named),
 * a checkpoint tensor missing. Does not check the budget: see
 * fl_mem_plan_check. */
fl_status fl_mem_plan_compute(const fl_mem_plan_in *in, fl_mem_plan *out);
/* Sets the cache and pool as made (given, capped, or the minimum over the
 * ranks) and the figures that follow from them (tokens, sequences, host
 * total); block_size as planned. */
void fl_mem_plan_set_blocks(fl_mem_plan *p, int64_t kv_blocks, int64_t swap_blocks, int block_size);
/* FL_ERR_OOM with the numbers when the weights and workspaces alone exceed
 * the budget, or when it leaves no KV block. */
fl_status fl_mem_plan_check(const fl_mem_plan *p);
/* The table, one line per item, each line prefixed by `prefix`. */
void fl_mem_plan_print(const fl_mem_plan *p, const char *prefix, FILE *f);

/* Defaults that scale (docs/engine.md, "Memory"). The CPU budget: half of
 * MemAvailable, at most FL_MEM_CPU_BUDGET_MAX (8 GiB) so two jobs side by
 * side on a small machine cannot exhaust it; CUDA: 0.90 of device memory.
 * Tokens per step: 8192 on CUDA, 512 on the CPU. */
#define FL_MEM_CPU_BUDGET_MAX ((size_t)8 << 30)
#define FL_MEM_GPU_UTILIZATION 0.90
#define FL_MEM_MAX_SEQS_DEFAULT 256
size_t fl_mem_cpu_default_budget(void);
int fl_mem_default_batched_tokens(fl_mem_backend be);
/* max_num_seqs when not given: what the cache holds in sequences of half
 * the max length (a running sequence is half-way on average), 1..256. */
int fl_mem_default_max_seqs(int64_t kv_tokens, int max_model_len);

/* A size flag: bytes with an optional K/M/G/T suffix (powers of 1024,
 * "8G", "512MiB"), or "N%" of MemAvailable. FL_ERR_INVALID_ARG names flag. */
fl_status fl_mem_parse_size(const char *flag, const char *s, size_t *out);

/* Host memory: MemAvailable from /proc/meminfo (0 when unknown). */
size_t fl_mem_host_available(void);
/* This process's resident set (/proc/self/statm), bytes; 0 when unknown. */
size_t fl_mem_rss(void);

#endif /* FL_MEM_PLAN_H */
