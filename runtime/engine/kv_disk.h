/*
 * kv_disk.h — the cold tier of the KV cache: prefix-cached blocks written
 * to files that outlive the process, read back by a later job with the same
 * cache fingerprint (docs/engine.md, "KV offload to disk").
 *
 * Layout: DIR/<fingerprint, 16 hex>/<block hash, 16 hex>.r<tp rank>, one
 * file per block and rank (each rank holds its shard of the heads). A file
 * is a header (magic, version, fingerprint, block hash, parent block hash,
 * block_size, n_layers, bytes of one layer's K (or V) for the block, tp
 * rank, the block's token ids), the payload [n_layers][K, V][layer_bytes]
 * as the cache stores it, and a 64-bit checksum of header + payload.
 *
 * Write-through: rank 0's scheduler lists each newly published block in the
 * next step's plan (persist list), when its K/V are computed; every rank
 * writes its file (a temporary name, then rename: readers never see half a
 * file). Start-up: every rank checks each of its files (size, header
 * against its own cache geometry, checksum); a torn or foreign file is
 * reported once and ignored, never deleted (a temporary file whose writer,
 * a process of this host, is gone is deleted). Rank 0 keeps the blocks whose
 * files are good on every rank of its tp group. A prefix-cache miss that
 * the disk index has becomes a fresh block on the plan's disk-in list;
 * every rank reads its file into it before the forward, checking it again
 * (a file that changed since start-up fails the job, naming it).
 */
#ifndef FL_KV_DISK_H
#define FL_KV_DISK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "parallel/comm.h"
#include "runtime/engine/kv_cache.h"
#include "runtime/engine/plan.h"

/* What a file must match to be this cache's: everything that changes the
 * meaning or the size of its bytes. */
typedef struct fl_kv_disk_geom {
    uint64_t fingerprint; /* fl_kv_fingerprint of the cache (model, dtype, layout, block size) */
    int block_size;
    int n_layers;
    uint64_t layer_bytes; /* one block of one layer's K (or V) array, as the cache lays it out */
    int tp_rank;
} fl_kv_disk_geom;

/* Bytes of one block's file. */
size_t fl_kv_disk_file_bytes(const fl_kv_disk_geom *g);
/* Writes a whole file image into buf[fl_kv_disk_file_bytes(g)]: the header
 * for (hash, parent, tokens[block_size]) and the checksum; the payload
 * (n_layers * 2 * layer_bytes) must already be at fl_kv_disk_payload(g, buf). */
void fl_kv_disk_encode(const fl_kv_disk_geom *g, uint64_t hash, uint64_t parent, const int32_t *tokens,
                       void *buf);
/* Where the payload sits in a file image. */
void *fl_kv_disk_payload(const fl_kv_disk_geom *g, void *buf);
/* Checks a file image of n bytes against g and, when want_hash is not
 * NULL, its block hash; FL_OK and the header's fields, or FL_ERR_IO with a
 * message saying what is wrong (short, not a block file, checksum, another
 * cache). tokens points into buf. */
fl_status fl_kv_disk_decode(const fl_kv_disk_geom *g, const void *buf, size_t n, const uint64_t *want_hash,
                            uint64_t *hash, uint64_t *parent, const int32_t **tokens);

/* One rank's view of the folder; rank 0's also indexes the blocks it may
 * read (good on every rank) and those it has had written. */
typedef struct fl_kv_disk {
    char *dir;            /* DIR/<fingerprint hex> */
    fl_kv_disk_geom g;
    size_t file_bytes;
    char *buf;            /* [file_bytes] one file image */
    char *path;           /* scratch for file names */
    int log_rank;         /* rank number in messages */
    char host[64];        /* this host's name, in temporary file names */
    int64_t n_write_errors;
    /* rank 0: entries [n] of (hash, parent, tokens, loadable), an
     * open-addressing table of entry indexes by hash */
    uint64_t *hash, *parent;
    int32_t *tokens;      /* [cap, block_size] */
    bool *loadable;       /* false: written by this job (read from the next one on) */
    int n, cap;
    int32_t *table;
    uint32_t table_mask;
} fl_kv_disk;

/* Collective over comm (NULL: one rank): creates root/<fingerprint hex>
 * when missing, checks this rank's files and agrees on the good ones. Bad
 * files are reported on stderr (one line each, naming the file). */
fl_status fl_kv_disk_open(const char *root, const fl_kv_disk_geom *g, fl_comm *comm, int log_rank,
                          fl_kv_disk *d);
/* NULL and a zeroed one are no-ops. */
void fl_kv_disk_close(fl_kv_disk *d);

/* Rank 0: blocks that may be read from disk (good on every rank at start-up). */
int fl_kv_disk_n_loadable(const fl_kv_disk *d);
/* Rank 0: whether the block (hash, parent hash, tokens[block_size]) can be
 * read from disk. */
bool fl_kv_disk_find(const fl_kv_disk *d, uint64_t hash, uint64_t parent, const int32_t *tokens);
/* Rank 0: records that block `hash` is (or will be) on disk; false when it
 * was already (nothing to write). */
bool fl_kv_disk_note(fl_kv_disk *d, uint64_t hash, uint64_t parent, const int32_t *tokens);

/* Every rank, before the step's swaps: writes the plan's persist list from
 * this rank's cache (a failed write is reported and skipped: the block is
 * only not kept). */
fl_status fl_kv_disk_persist(fl_kv_disk *d, fl_kv_cache *kv, const fl_step_plan *p);
/* Every rank, after the step's swaps: reads the plan's disk-in list into
 * this rank's cache; a file that is missing or no longer checks out is
 * FL_ERR_IO naming it. */
fl_status fl_kv_disk_load(fl_kv_disk *d, fl_kv_cache *kv, const fl_step_plan *p);

#endif /* FL_KV_DISK_H */
