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
 * on the CPU, bf16 on CUDA). INT8 stores int8 values plus one f32 scale per
 * token and KV head (kernels/backend.h, kv_int8_head_dim); FP8 the same
 * records with float8_e4m3fn codes (kv_fp8_codes). */
typedef enum fl_kv_dtype {
    FL_KV_DTYPE_AUTO = 0,
    FL_KV_DTYPE_F32,
    FL_KV_DTYPE_BF16,
    FL_KV_DTYPE_INT8,
    FL_KV_DTYPE_FP8,
} fl_kv_dtype;

typedef struct fl_kv_cache {
    fl_backend *be;     /* borrowed */
    int n_layers;
    int n_blocks;
    int block_size;
    int kv_dim;         /* elements per token slot (n_kv_heads * head_dim) */
    int int8_head_dim;  /* > 0: int8 records (kernels/backend.h), one scale per this many values */
    bool fp8;           /* with int8_head_dim: the records hold e4m3 codes (backend.h, kv_fp8_codes) */
    bool bf16;          /* f32 activations, bf16 slots (backend.h, kv_bf16) */
    int blocked_head_dim; /* > 0: head by head within blocks (backend.h, kv_block_size) */
    /* [n_layers] device buffers [n_blocks * block_size, kv_dim] (int8:
     * records; blocked_head_dim: each block's slots head by head) */
    void **k;
    void **v;
} fl_kv_cache;

fl_status fl_kv_cache_init(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                           fl_kv_cache *kv);
/* The same with int8 records when int8_head_dim > 0 (backends whose
 * ops->kv_int8 is set: FL_ERR_UNSUPPORTED elsewhere); sets
 * be->kv_int8_head_dim (and kv_fp8_codes), which fl_kv_cache_free clears.
 * One cache per backend at a time. */
fl_status fl_kv_cache_init_int8(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                                int int8_head_dim, fl_kv_cache *kv);
/* Either quantized record: int8, or fp8 (e4m3 codes, the same layout) where
 * the backend's ops->kv_fp8 is set. */
fl_status fl_kv_cache_init_q(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                             int int8_head_dim, bool fp8, fl_kv_cache *kv);
/* Any element type d (not AUTO): F32 or BF16 where it is the backend's
 * activation dtype, BF16 on an f32 backend whose ops->kv_bf16 is set (sets
 * be->kv_bf16), INT8 / FP8 records of int8_group-value groups. An f32 or
 * bf16 cache of heads of head_dim values (> 0; 0 for MLA's records) is laid
 * out head by head within blocks where the backend's ops->kv_blocked is set
 * (sets be->kv_block_size and kv_head_dim). */
fl_status fl_kv_cache_init_dtype(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                                 fl_kv_dtype d, int head_dim, int int8_group, fl_kv_cache *kv);
/* One token slot's bytes of one layer's K (or V) array. */
size_t fl_kv_cache_slot_bytes(const fl_kv_cache *kv);
void fl_kv_cache_free(fl_kv_cache *kv);

/* Rank 0's allocator of block ids, with reference counts and (when
 * prefix caching is on) a content index.
 *
 * A block table entry holds one reference. A full block whose K/V are (or
 * are being) computed can be published under its identity (a chained hash,
 * fl_kv_block_hash); a later sequence whose prompt starts with the same
 * tokens looks the chain up and takes references to the same blocks instead
 * of computing them again. When its last reference goes, a published block
 * keeps its content and joins an LRU list of cached blocks (refcount 0); an
 * unpublished one returns to the free stack. Allocation takes a free block
 * first and only then evicts the least recently used cached block, which
 * forgets its identity.
 *
 * A hit needs more than an equal hash: the block's stored tokens must equal
 * the looked-up ones and its parent must be the very block the caller
 * matched for the previous position, not reallocated since (a generation
 * count per block, bumped by every allocation), so by induction the whole
 * prefix is compared and a hash collision never serves another prefix's
 * K/V; blocks with equal hashes coexist in the index.
 *
 * Not thread-safe; rank 0's scheduler is its only user. */
typedef struct fl_kv_blocks {
    int n_blocks;
    int n_free;          /* blocks on the free stack (no content kept) */
    int32_t *free_ids;   /* [n_blocks] stack of free ids */
    int32_t *ref;        /* [n_blocks] references from block tables */
    /* content index, block_size > 0 only */
    int block_size;
    int n_cached;        /* published blocks with no reference: the LRU list */
    int64_t n_evicted;   /* cached blocks given to another use (stats) */
    bool *published;     /* [n_blocks] in the index */
    uint64_t *hash;      /* [n_blocks] identity of a published block */
    int32_t *tokens;     /* [n_blocks, block_size] its token ids */
    int32_t *parent;     /* [n_blocks] block of the previous position, -1 for the first */
    uint32_t *parent_gen;/* [n_blocks] parent's generation when published */
    uint32_t *gen;       /* [n_blocks] bumped by each allocation (new content) */
    int32_t *lru_prev, *lru_next; /* [n_blocks] LRU list, head = least recently used */
    int32_t lru_head, lru_tail;
    int32_t *table;      /* open-addressing index of published block ids (-1 empty) */
    uint32_t table_mask;
} fl_kv_blocks;

/* cache_block_size > 0 turns the content index on (blocks of that many
 * tokens); 0 gives a plain free list. */
fl_status fl_kv_blocks_init(fl_kv_blocks *a, int n_blocks, int cache_block_size);
void fl_kv_blocks_free(fl_kv_blocks *a);
/* Blocks an allocation can still get: free plus cached (evictable) ones. */
static inline int fl_kv_blocks_n_available(const fl_kv_blocks *a) { return a->n_free + a->n_cached; }
/* One block with one reference: a free one, else the least recently used
 * cached one (evicted); -1 when every block is referenced. */
int32_t fl_kv_blocks_alloc(fl_kv_blocks *a);
/* Drops one reference to each of ids, last to first, so that a sequence's
 * tail blocks are evicted before its head (heads are the shared prefixes). */
void fl_kv_blocks_release(fl_kv_blocks *a, const int32_t *ids, int n);
/* The published block with identity `hash`, whose parent is `parent` (-1:
 * the first block) and whose tokens equal tokens[block_size]; takes a
 * reference to it (moving it off the LRU list). -1 on a miss. */
int32_t fl_kv_blocks_lookup(fl_kv_blocks *a, uint64_t hash, int32_t parent, const int32_t *tokens);
/* The same block without taking a reference (nothing changes): where a
 * request would find its prefix. */
int32_t fl_kv_blocks_peek(const fl_kv_blocks *a, uint64_t hash, int32_t parent, const int32_t *tokens);
/* Publishes full block `id` (referenced by the caller) under hash, after
 * `parent`, holding tokens[block_size]. Returns false, and leaves the block
 * private, when the index is off, the block is published already, or an
 * equal block (same hash, parent and tokens) is published: the first copy
 * stays the shared one. */
bool fl_kv_blocks_publish(fl_kv_blocks *a, int32_t id, uint64_t hash, int32_t parent, const int32_t *tokens);

/* splitmix64's finalizer: a bijection on 64 bits with full avalanche (the
 * mixing step of the block hashes and of the disk tier's checksums). */
static inline uint64_t fl_kv_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* Block identity: a 64-bit hash chained from the parent block's identity
 * (0 for the first block) over the block's token ids, seeded with the
 * cache fingerprint (docs/engine.md, "Prefix caching", gives the exact
 * definition so other tiers can compute it). */
uint64_t fl_kv_block_hash(uint64_t seed, uint64_t parent, const int32_t *tokens, int n);
/* The seed of fl_kv_block_hash for a cache described by text (model
 * identity, KV dtype, parallel layout, block size). */
uint64_t fl_kv_fingerprint(const char *text);

#endif /* FL_KV_CACHE_H */
