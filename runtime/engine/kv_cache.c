/*
 * kv_cache.c — paged KV storage and the block allocator (see kv_cache.h).
 */
#include "runtime/engine/kv_cache.h"

#include <stdlib.h>
#include <string.h>

size_t fl_kv_cache_token_bytes(const fl_backend *be, int n_layers, int kv_dim) {
    return 2 * (size_t)n_layers * fl_backend_act_bytes(be, (size_t)kv_dim);
}

fl_status fl_kv_cache_init(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                           fl_kv_cache *kv) {
    return fl_kv_cache_init_int8(be, n_layers, n_blocks, block_size, kv_dim, 0, kv);
}

fl_status fl_kv_cache_init_int8(fl_backend *be, int n_layers, int n_blocks, int block_size, int kv_dim,
                                int int8_head_dim, fl_kv_cache *kv) {
    fl_status st = FL_OK;
    if (int8_head_dim > 0 && (be->act_dtype != FL_DTYPE_F32 || be->ops->mem_info || kv_dim % int8_head_dim))
        return FL_ERR(FL_ERR_UNSUPPORTED, "an int8 KV cache is implemented on the CPU backend only (%s backend, "
                      "kv_dim %d, head_dim %d)", be->name, kv_dim, int8_head_dim);
    memset(kv, 0, sizeof *kv);
    kv->be = be;
    kv->n_layers = n_layers;
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->kv_dim = kv_dim;
    kv->int8_head_dim = int8_head_dim > 0 ? int8_head_dim : 0;
    kv->k = calloc((size_t)n_layers, sizeof(void *));
    kv->v = calloc((size_t)n_layers, sizeof(void *));
    FL_CHECK_ALLOC(kv->k, st, fail);
    FL_CHECK_ALLOC(kv->v, st, fail);
    size_t bytes = kv->int8_head_dim ? (size_t)n_blocks * block_size * fl_kv_int8_record_bytes(kv_dim, int8_head_dim)
                                     : fl_backend_act_bytes(be, (size_t)n_blocks * block_size * kv_dim);
    for (int l = 0; l < n_layers; l++) {
        FL_TRY_GOTO(be->ops->alloc(be, bytes, &kv->k[l]), st, fail);
        FL_TRY_GOTO(be->ops->alloc(be, bytes, &kv->v[l]), st, fail);
    }
    be->kv_int8_head_dim = kv->int8_head_dim;
    return FL_OK;
fail:
    fl_kv_cache_free(kv);
    return st;
}

void fl_kv_cache_free(fl_kv_cache *kv) {
    if (!kv) return;
    if (kv->be && kv->int8_head_dim) kv->be->kv_int8_head_dim = 0;
    for (int l = 0; l < kv->n_layers; l++) {
        if (kv->k && kv->k[l]) kv->be->ops->free(kv->be, kv->k[l]);
        if (kv->v && kv->v[l]) kv->be->ops->free(kv->be, kv->v[l]);
    }
    free(kv->k);
    free(kv->v);
    memset(kv, 0, sizeof *kv);
}

fl_status fl_kv_blocks_init(fl_kv_blocks *a, int n_blocks) {
    memset(a, 0, sizeof *a);
    a->free_ids = malloc((size_t)(n_blocks > 0 ? n_blocks : 1) * sizeof(int32_t));
    if (!a->free_ids) return FL_ERR(FL_ERR_OOM, "out of memory for %d KV blocks", n_blocks);
    a->n_blocks = n_blocks;
    a->n_free = n_blocks;
    /* Hand out low ids first (stack top = 0) so small jobs touch little memory. */
    for (int i = 0; i < n_blocks; i++) a->free_ids[i] = n_blocks - 1 - i;
    return FL_OK;
}

void fl_kv_blocks_free(fl_kv_blocks *a) {
    if (!a) return;
    free(a->free_ids);
    memset(a, 0, sizeof *a);
}

int32_t fl_kv_blocks_alloc(fl_kv_blocks *a) {
    return a->n_free > 0 ? a->free_ids[--a->n_free] : -1;
}

void fl_kv_blocks_release(fl_kv_blocks *a, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++) {
        FL_ASSERT(a->n_free < a->n_blocks);
        a->free_ids[a->n_free++] = ids[i];
    }
}
