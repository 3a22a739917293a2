/*
 * kv_swap.c — the host pool of swapped-out KV blocks (see kv_swap.h).
 */
#include "runtime/engine/kv_swap.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* One block of one layer's K (or V) array, as the cache lays it out. */
static size_t layer_block_bytes(const fl_kv_cache *kv) { return (size_t)kv->block_size * fl_kv_cache_slot_bytes(kv); }

size_t fl_kv_swap_block_bytes(const fl_kv_cache *kv) { return 2 * (size_t)kv->n_layers * layer_block_bytes(kv); }

int64_t fl_kv_swap_pool_blocks(size_t swap_bytes, size_t block_bytes, int64_t cache_blocks) {
    int64_t n = block_bytes ? (int64_t)(swap_bytes / block_bytes) : 0;
    if (n > 4 * cache_blocks) n = 4 * cache_blocks;
    if (n > INT32_MAX / 4) n = INT32_MAX / 4;
    return n > 0 ? n : 0;
}

fl_status fl_kv_swap_init(const fl_kv_cache *kv, int n_blocks, fl_kv_swap *sw) {
    memset(sw, 0, sizeof *sw);
    if (n_blocks <= 0) return FL_ERR(FL_ERR_INVALID_ARG, "a swap pool of %d blocks", n_blocks);
    fl_backend *be = kv->be;
    sw->be = be;
    sw->n_blocks = n_blocks;
    sw->n_layers = kv->n_layers;
    sw->layer_bytes = layer_block_bytes(kv);
    const size_t total = 2 * (size_t)kv->n_layers * (size_t)n_blocks * sw->layer_bytes;
    sw->ids = malloc(2 * (size_t)n_blocks * sizeof *sw->ids);
    if (!sw->ids) goto oom;
    if (be->ops->host_alloc) {
        fl_status st = be->ops->host_alloc(be, total, (void **)&sw->base);
        if (st != FL_OK) {
            fl_kv_swap_free(sw);
            return FL_ERR(st, "the KV swap space (%.1f MiB of pinned host memory, --swap-space) could not be "
                          "allocated: %s", total / 1048576.0, fl_error_msg());
        }
        sw->pinned = true;
    } else {
        sw->base = malloc(total ? total : 1);
        if (!sw->base) goto oom;
    }
    return FL_OK;
oom:
    fl_kv_swap_free(sw);
    return FL_ERR(FL_ERR_OOM, "out of memory for the KV swap space (%d blocks; lower --swap-space)", n_blocks);
}

void fl_kv_swap_free(fl_kv_swap *sw) {
    if (!sw) return;
    if (sw->base) {
        if (sw->pinned)
            sw->be->ops->host_free(sw->be, sw->base);
        else
            free(sw->base);
    }
    free(sw->ids);
    memset(sw, 0, sizeof *sw);
}

/* Layer l's K (kv 0) or V (kv 1) blocks in the pool. */
static char *pool_of(const fl_kv_swap *sw, int l, int kv) {
    return sw->base + ((size_t)l * 2 + (size_t)kv) * (size_t)sw->n_blocks * sw->layer_bytes;
}

/* Moves n (a, b) pairs: to_host: device block a to host block b; else
 * host block a to device block b. */
static fl_status move(fl_kv_swap *sw, fl_kv_cache *kv, const int32_t *pairs, int n, bool to_host) {
    if (n == 0) return FL_OK;
    if (!sw->base || n > sw->n_blocks)
        return FL_ERR(FL_ERR_INTERNAL, "step plan: %d KV blocks to swap, the pool holds %d", n, sw->n_blocks);
    int32_t *dev = sw->ids, *host = sw->ids + sw->n_blocks;
    for (int i = 0; i < n; i++) {
        dev[i] = pairs[2 * i + (to_host ? 0 : 1)];
        host[i] = pairs[2 * i + (to_host ? 1 : 0)];
        if (dev[i] < 0 || dev[i] >= kv->n_blocks || host[i] < 0 || host[i] >= sw->n_blocks)
            return FL_ERR(FL_ERR_INTERNAL, "step plan: swap of device block %d, host block %d (%d and %d blocks)",
                          dev[i], host[i], kv->n_blocks, sw->n_blocks);
    }
    fl_backend *be = sw->be;
    const size_t lb = sw->layer_bytes;
    for (int l = 0; l < kv->n_layers; l++)
        for (int k = 0; k < 2; k++) {
            char *d = (char *)(k ? kv->v[l] : kv->k[l]), *h = pool_of(sw, l, k);
            if (be->ops->copy_blocks) {
                FL_TRY(to_host ? be->ops->copy_blocks(be, h, d, host, dev, n, lb, true)
                               : be->ops->copy_blocks(be, d, h, dev, host, n, lb, false));
                continue;
            }
            for (int i = 0; i < n; i++) { /* a backend without the op: one copy a block */
                char *hp = h + (size_t)host[i] * lb, *dp = d + (size_t)dev[i] * lb;
                FL_TRY(to_host ? be->ops->download(be, hp, dp, lb) : be->ops->upload(be, dp, hp, lb));
            }
        }
    return FL_OK;
}

fl_status fl_kv_swap_run(fl_kv_swap *sw, fl_kv_cache *kv, const fl_step_plan *p) {
    FL_TRY(move(sw, kv, p->swap_out, p->n_swap_out, true));
    return move(sw, kv, p->swap_in, p->n_swap_in, false);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

fl_status fl_kv_swap_measure(fl_kv_swap *sw, fl_kv_cache *kv, double *seconds_per_block) {
    int n = 8;
    if (n > sw->n_blocks) n = sw->n_blocks;
    if (n > kv->n_blocks) n = kv->n_blocks;
    int32_t out[16], in[16];
    for (int i = 0; i < n; i++) out[2 * i] = in[2 * i + 1] = i, out[2 * i + 1] = in[2 * i] = i;
    double t = 0;
    for (int round = 0; round < 2; round++) { /* the first warms the pages and the copy engine up */
        FL_TRY(sw->be->ops->sync(sw->be));
        const double t0 = now_s();
        FL_TRY(move(sw, kv, out, n, true));
        FL_TRY(move(sw, kv, in, n, false));
        FL_TRY(sw->be->ops->sync(sw->be));
        t = now_s() - t0;
    }
    *seconds_per_block = n > 0 ? t / (2.0 * n) : 0;
    return FL_OK;
}
