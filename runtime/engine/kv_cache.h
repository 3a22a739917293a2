/*
 * kv_cache.h — the paged KV cache storage of one rank, and rank 0's block
 * allocator.
 *
 * Storage: per layer, K and V arrays of n_blocks * block_size token slots,
 * each slot kv_dim activation elements (this rank's KV heads). A token at
 * position p of a sequence lives in slot block_table[p / bs] * bs + p % bs.
 *
 * The allocator (fl_kv_blocks) only hands out block ids; it runs on rank 0
 * and its decisions reach other ranks through the step plan.
 */
#ifndef FL_KV_CACHE_H
#define FL_KV_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/backend.h"

/* The KV cache's element type; AUTO is the backend's activation dtype (f32
 * on the CPU, bf16 on CUDA). INT8 (CPU backend) stores int8 values plus one
 * f32 scale per token and KV head (kernels/backend.h, kv_int8_head_dim). */
typedef enum fl_kv_dtype {
    FL_KV_DTYPE_AUTO = 0,
    FL_KV_DTYPE_F32,
    FL_KV_DTYPE_BF16,
    FL_KV_DTYPE_INT8,
} fl_kv_dtype;

typedef struct fl_kv_cache {
    fl_backend *be;     /* borrowed */
    int n_layers;
    int n_blocks;
    int block_size;
    int kv_dim;         /* elements per token slot (n_kv_heads * head_dim) */
    int int8_head_dim;  /* > 0: int8 records (kernels/backend.h), one scale per this many values */
    void **k;           /* [n_layers] device buffers [n_blocks * block_size, kv_dim] (int8: records) */
    void **v;
} fl_kv_cache;

/* Bytes one token takes in the cache across all layers (K and V). */
size_t fl_kv_cache_token_bytes(const fl_backend *be, int n_layers, int kv_dim);
fl_status fl_kv_cache_init(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                           fl_kv_cache *kv);
/* The same with int8 records when int8_head_dim > 0 (the CPU backend:
 * FL_ERR_UNSUPPORTED elsewhere); sets be->kv_int8_head_dim, which
 * fl_kv_cache_free clears. One cache per backend at a time. */
fl_status fl_kv_cache_init_int8(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                                int int8_head_dim, fl_kv_cache *kv);
void fl_kv_cache_free(fl_kv_cache *kv);

/* Free-list allocator of block ids. */
typedef struct fl_kv_blocks {
    int n_blocks;
    int n_free;
    int32_t *free_ids;  /* stack of free ids */
} fl_kv_blocks;

fl_status fl_kv_blocks_init(fl_kv_blocks *a, int n_blocks);
void fl_kv_blocks_free(fl_kv_blocks *a);
/* Pops one block id; returns -1 when none is free. */
int32_t fl_kv_blocks_alloc(fl_kv_blocks *a);
void fl_kv_blocks_release(fl_kv_blocks *a, const int32_t *ids, int n);

#endif /* FL_KV_CACHE_H */
