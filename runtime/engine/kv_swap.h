/*
 * kv_swap.h — the host pool that holds the KV blocks of sequences preempted
 * by swapping (the warm tier), and the moves between it and the device cache.
 *
 * The pool mirrors the cache's layout: per layer, K and V arrays of
 * n_blocks blocks of block_size token slots of this rank's records. Rank 0's
 * scheduler decides which blocks move and writes them into the step plan
 * (plan.h swap lists); every rank moves its own shard of the same blocks
 * before the step's forward, on the backend's stream. The pool is pinned
 * host memory where the backend has it (CUDA: cudaMallocHost), else plain
 * host memory, whose pages the CPU backend only touches when blocks land.
 */
#ifndef FL_KV_SWAP_H
#define FL_KV_SWAP_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/engine/kv_cache.h"
#include "runtime/engine/plan.h"

typedef struct fl_kv_swap {
    fl_backend *be;       /* borrowed */
    int n_blocks;         /* host blocks */
    int n_layers;
    size_t layer_bytes;   /* one block of one layer's K (or V) */
    char *base;           /* [n_layers][2][n_blocks][layer_bytes] */
    bool pinned;          /* from host_alloc */
    int32_t *ids;         /* [2 * n_blocks] scratch: a swap list split into dst and src ids */
} fl_kv_swap;

/* Bytes of one block across all layers, K and V: what a swap moves per block. */
size_t fl_kv_swap_block_bytes(const fl_kv_cache *kv);
/* Blocks of the pool one rank asks for: the whole blocks of block_bytes
 * that swap_bytes hold, at most four times the device cache's
 * cache_blocks (a pool is for the sequences the cache cannot hold at a
 * time, not for the whole job) and INT32_MAX / 4. Pure: the engine sizes
 * its pool with it and the memory planner predicts the same. */
int64_t fl_kv_swap_pool_blocks(size_t swap_bytes, size_t block_bytes, int64_t cache_blocks);

/* A pool of n_blocks blocks (> 0) shaped like kv's blocks. */
fl_status fl_kv_swap_init(const fl_kv_cache *kv, int n_blocks, fl_kv_swap *sw);
/* NULL and a zeroed pool are no-ops. */
void fl_kv_swap_free(fl_kv_swap *sw);

/* Runs p's swap lists on this rank's cache: every swap-out, then every
 * swap-in, enqueued on the backend's stream ahead of the step's forward. A
 * block id out of range (cache or pool) is FL_ERR_INTERNAL; a plan with
 * swaps and no pool too. */
fl_status fl_kv_swap_run(fl_kv_swap *sw, fl_kv_cache *kv, const fl_step_plan *p);

/* Seconds to move one block one way (all layers, K and V): moves up to 8
 * blocks out and back twice, timing the second round trip, so per-copy
 * overheads count as well as bandwidth. Overwrites those cache blocks with
 * themselves; call it before the first step. */
fl_status fl_kv_swap_measure(fl_kv_swap *sw, fl_kv_cache *kv, double *seconds_per_block);

#endif /* FL_KV_SWAP_H */
