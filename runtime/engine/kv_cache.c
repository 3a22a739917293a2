/*
 * kv_cache.c — paged KV storage and the block allocator (see kv_cache.h).
 */
#include "runtime/engine/kv_cache.h"

#include <stdlib.h>
#include <string.h>

fl_status fl_kv_cache_init(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                           fl_kv_cache *kv) {
    return fl_kv_cache_init_int8(be, n_layers, n_blocks, block_size, kv_dim, 0, kv);
}

fl_status fl_kv_cache_init_int8(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                                int int8_head_dim, fl_kv_cache *kv) {
    return fl_kv_cache_init_q(be, n_layers, n_blocks, block_size, kv_dim, int8_head_dim, false, kv);
}

fl_status fl_kv_cache_init_q(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                             int int8_head_dim, bool fp8, fl_kv_cache *kv) {
    const fl_kv_dtype d = int8_head_dim <= 0 ? FL_KV_DTYPE_AUTO : fp8 ? FL_KV_DTYPE_FP8 : FL_KV_DTYPE_INT8;
    return fl_kv_cache_init_dtype(be, n_layers, n_blocks, block_size, kv_dim, d, 0, int8_head_dim, kv);
}

size_t fl_kv_cache_slot_bytes(const fl_kv_cache *kv) {
    if (kv->int8_head_dim > 0) return fl_kv_int8_record_bytes(kv->kv_dim, kv->int8_head_dim);
    return kv->bf16 ? 2 * (size_t)kv->kv_dim : fl_backend_act_bytes(kv->be, (size_t)kv->kv_dim);
}

fl_status fl_kv_cache_init_dtype(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                                 fl_kv_dtype d, int head_dim, int int8_group, fl_kv_cache *kv) {
    fl_status st = FL_OK;
    const bool quant = d == FL_KV_DTYPE_INT8 || d == FL_KV_DTYPE_FP8, fp8 = d == FL_KV_DTYPE_FP8;
    const int int8_head_dim = quant ? int8_group : 0;
    /* a 16-bit cache under f32 activations: the backend converts on store and read */
    const bool bf16 = d == FL_KV_DTYPE_BF16 && be->act_dtype == FL_DTYPE_F32;
    if (bf16 && !be->ops->kv_bf16)
        return FL_ERR(FL_ERR_UNSUPPORTED, "the %s backend has no bf16 KV cache under f32 activations", be->name);
    if (d == FL_KV_DTYPE_F32 && be->act_dtype != FL_DTYPE_F32)
        return FL_ERR(FL_ERR_UNSUPPORTED, "the %s backend keeps its KV cache in bf16, not f32", be->name);
    if (quant && int8_head_dim <= 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "an %s KV cache needs a group size (%d)", fp8 ? "fp8" : "int8", int8_group);
    if (int8_head_dim > 0 && (!(fp8 ? be->ops->kv_fp8 : be->ops->kv_int8) || kv_dim % int8_head_dim))
        return FL_ERR(FL_ERR_UNSUPPORTED, "an %s KV cache is not implemented here (%s backend, kv_dim %d, "
                      "head_dim %d)", fp8 ? "fp8" : "int8", be->name, kv_dim, int8_head_dim);
    memset(kv, 0, sizeof *kv);
    kv->be = be;
    kv->n_layers = n_layers;
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->kv_dim = kv_dim;
    kv->int8_head_dim = int8_head_dim > 0 ? int8_head_dim : 0;
    kv->fp8 = kv->int8_head_dim > 0 && fp8;
    kv->bf16 = bf16;
    kv->blocked_head_dim = !quant && be->ops->kv_blocked && head_dim > 0 && kv_dim % head_dim == 0 ? head_dim : 0;
    kv->k = calloc((size_t)n_layers, sizeof(void *));
    kv->v = calloc((size_t)n_layers, sizeof(void *));
    FL_CHECK_ALLOC(kv->k, st, fail);
    FL_CHECK_ALLOC(kv->v, st, fail);
    const size_t bytes = (size_t)n_blocks * (size_t)block_size * fl_kv_cache_slot_bytes(kv);
    for (int l = 0; l < n_layers; l++) {
        FL_TRY_GOTO(be->ops->alloc(be, bytes, &kv->k[l]), st, fail);
        FL_TRY_GOTO(be->ops->alloc(be, bytes, &kv->v[l]), st, fail);
    }
    be->kv_int8_head_dim = kv->int8_head_dim;
    be->kv_fp8_codes = kv->fp8;
    be->kv_bf16 = kv->bf16;
    be->kv_block_size = kv->blocked_head_dim ? block_size : 0;
    be->kv_head_dim = kv->blocked_head_dim;
    return FL_OK;
fail:
    fl_kv_cache_free(kv);
    return st;
}

void fl_kv_cache_free(fl_kv_cache *kv) {
    if (!kv) return;
    if (kv->be && (kv->int8_head_dim || kv->bf16 || kv->blocked_head_dim)) {
        kv->be->kv_int8_head_dim = 0;
        kv->be->kv_fp8_codes = false;
        kv->be->kv_bf16 = false;
        kv->be->kv_block_size = kv->be->kv_head_dim = 0;
    }
    for (int l = 0; l < kv->n_layers; l++) {
        if (kv->k && kv->k[l]) kv->be->ops->free(kv->be, kv->k[l]);
        if (kv->v && kv->v[l]) kv->be->ops->free(kv->be, kv->v[l]);
    }
    free(kv->k);
    free(kv->v);
    memset(kv, 0, sizeof *kv);
}

#define mix64 fl_kv_mix64

#define HASH_STEP 0x9e3779b97f4a7c15ull /* 2^64 / golden ratio */

uint64_t fl_kv_block_hash(uint64_t seed, uint64_t parent, const int32_t *tokens, int n) {
    uint64_t h = mix64(seed ^ mix64(parent + HASH_STEP));
    for (int i = 0; i < n; i++) h = mix64((h ^ (uint64_t)(uint32_t)tokens[i]) + HASH_STEP);
    return mix64(h ^ (uint64_t)(uint32_t)n);
}

uint64_t fl_kv_fingerprint(const char *text) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 over the bytes, then mixed */
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) h = (h ^ *p) * 0x100000001b3ull;
    return mix64(h);
}

fl_status fl_kv_blocks_init(fl_kv_blocks *a, int n_blocks, int cache_block_size) {
    memset(a, 0, sizeof *a);
    const size_t nb = (size_t)(n_blocks > 0 ? n_blocks : 1);
    a->free_ids = malloc(nb * sizeof(int32_t));
    a->ref = calloc(nb, sizeof(int32_t));
    if (!a->free_ids || !a->ref) goto oom;
    a->n_blocks = n_blocks;
    a->n_free = n_blocks;
    /* Hand out low ids first (stack top = 0) so small jobs touch little memory. */
    for (int i = 0; i < n_blocks; i++) a->free_ids[i] = n_blocks - 1 - i;
    a->lru_head = a->lru_tail = -1;
    if (cache_block_size <= 0) return FL_OK;
    a->block_size = cache_block_size;
    size_t tcap = 16;
    while (tcap < 2 * nb) tcap *= 2; /* load factor <= 1/2: short probes */
    a->published = calloc(nb, sizeof(bool));
    a->hash = calloc(nb, sizeof(uint64_t));
    a->tokens = malloc(nb * (size_t)cache_block_size * sizeof(int32_t));
    a->parent = malloc(nb * sizeof(int32_t));
    a->parent_gen = calloc(nb, sizeof(uint32_t));
    a->gen = calloc(nb, sizeof(uint32_t));
    a->lru_prev = malloc(nb * sizeof(int32_t));
    a->lru_next = malloc(nb * sizeof(int32_t));
    a->table = malloc(tcap * sizeof(int32_t));
    if (!a->published || !a->hash || !a->tokens || !a->parent || !a->parent_gen || !a->gen ||
        !a->lru_prev || !a->lru_next || !a->table)
        goto oom;
    a->table_mask = (uint32_t)(tcap - 1);
    for (size_t i = 0; i < tcap; i++) a->table[i] = -1;
    return FL_OK;
oom:
    fl_kv_blocks_free(a);
    return FL_ERR(FL_ERR_OOM, "out of memory for %d KV blocks", n_blocks);
}

void fl_kv_blocks_free(fl_kv_blocks *a) {
    if (!a) return;
    free(a->free_ids);
    free(a->ref);
    free(a->published);
    free(a->hash);
    free(a->tokens);
    free(a->parent);
    free(a->parent_gen);
    free(a->gen);
    free(a->lru_prev);
    free(a->lru_next);
    free(a->table);
    memset(a, 0, sizeof *a);
}

static void lru_unlink(fl_kv_blocks *a, int32_t id) {
    int32_t p = a->lru_prev[id], n = a->lru_next[id];
    if (p >= 0) a->lru_next[p] = n; else a->lru_head = n;
    if (n >= 0) a->lru_prev[n] = p; else a->lru_tail = p;
    a->n_cached--;
}

static void lru_push_tail(fl_kv_blocks *a, int32_t id) {
    a->lru_prev[id] = a->lru_tail;
    a->lru_next[id] = -1;
    if (a->lru_tail >= 0) a->lru_next[a->lru_tail] = id; else a->lru_head = id;
    a->lru_tail = id;
    a->n_cached++;
}

static uint32_t home(const fl_kv_blocks *a, uint64_t h) { return (uint32_t)(h ^ (h >> 32)) & a->table_mask; }

/* Removes published block id from the index (linear probing with
 * backward-shift deletion, so no tombstones accumulate). */
static void index_remove(fl_kv_blocks *a, int32_t id) {
    uint32_t i = home(a, a->hash[id]);
    while (a->table[i] != id) {
        FL_ASSERT(a->table[i] >= 0);
        i = (i + 1) & a->table_mask;
    }
    for (uint32_t j = i;;) {
        j = (j + 1) & a->table_mask;
        if (a->table[j] < 0) break;
        uint32_t k = home(a, a->hash[a->table[j]]);
        /* the entry at j may move to the hole at i unless its home lies in (i, j] */
        bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        a->table[i] = a->table[j];
        i = j;
    }
    a->table[i] = -1;
    a->published[id] = false;
}

int32_t fl_kv_blocks_alloc(fl_kv_blocks *a) {
    int32_t id;
    if (a->n_free > 0) {
        id = a->free_ids[--a->n_free];
    } else if (a->n_cached > 0) {
        id = a->lru_head;
        lru_unlink(a, id);
        index_remove(a, id);
        a->n_evicted++;
    } else {
        return -1;
    }
    FL_ASSERT(a->ref[id] == 0);
    a->ref[id] = 1;
    /* new content from here on: children published after the old content
     * no longer follow this block */
    if (a->gen) a->gen[id]++;
    return id;
}

void fl_kv_blocks_release(fl_kv_blocks *a, const int32_t *ids, int n) {
    for (int i = n - 1; i >= 0; i--) {
        int32_t id = ids[i];
        FL_ASSERT(id >= 0 && id < a->n_blocks && a->ref[id] > 0);
        if (--a->ref[id] > 0) continue;
        if (a->block_size > 0 && a->published[id]) {
            lru_push_tail(a, id);
        } else {
            FL_ASSERT(a->n_free < a->n_blocks);
            a->free_ids[a->n_free++] = id;
        }
    }
}

static bool same_block(const fl_kv_blocks *a, int32_t id, uint64_t hash, int32_t parent, const int32_t *tokens) {
    if (a->hash[id] != hash || a->parent[id] != parent) return false;
    if (parent >= 0 && a->parent_gen[id] != a->gen[parent]) return false;
    return memcmp(a->tokens + (size_t)id * a->block_size, tokens, (size_t)a->block_size * sizeof(int32_t)) == 0;
}

static int32_t find(const fl_kv_blocks *a, uint64_t hash, int32_t parent, const int32_t *tokens) {
    for (uint32_t i = home(a, hash); a->table[i] >= 0; i = (i + 1) & a->table_mask)
        if (same_block(a, a->table[i], hash, parent, tokens)) return a->table[i];
    return -1;
}

int32_t fl_kv_blocks_peek(const fl_kv_blocks *a, uint64_t hash, int32_t parent, const int32_t *tokens) {
    return a->block_size > 0 ? find(a, hash, parent, tokens) : -1;
}

int32_t fl_kv_blocks_lookup(fl_kv_blocks *a, uint64_t hash, int32_t parent, const int32_t *tokens) {
    if (a->block_size <= 0) return -1;
    int32_t id = find(a, hash, parent, tokens);
    if (id < 0) return -1;
    if (a->ref[id]++ == 0) lru_unlink(a, id);
    return id;
}

bool fl_kv_blocks_publish(fl_kv_blocks *a, int32_t id, uint64_t hash, int32_t parent, const int32_t *tokens) {
    if (a->block_size <= 0) return false;
    FL_ASSERT(id >= 0 && id < a->n_blocks && a->ref[id] > 0);
    if (a->published[id] || find(a, hash, parent, tokens) >= 0) return false;
    a->published[id] = true;
    a->hash[id] = hash;
    a->parent[id] = parent;
    a->parent_gen[id] = parent >= 0 ? a->gen[parent] : 0;
    memcpy(a->tokens + (size_t)id * a->block_size, tokens, (size_t)a->block_size * sizeof(int32_t));
    uint32_t i = home(a, hash);
    while (a->table[i] >= 0) i = (i + 1) & a->table_mask;
    a->table[i] = id;
    return true;
}
