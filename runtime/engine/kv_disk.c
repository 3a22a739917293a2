/*
 * kv_disk.c — the KV cache's cold tier: block files, their checks, rank 0's
 * index of them (see kv_disk.h).
 */
#include "runtime/engine/kv_disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAGIC 0x314b4c42564b4c46ull /* "FLKVBLK1" little-endian */
#define VERSION 1u
#define FIXED_BYTES 64               /* header fields before the token ids */

/* Header offsets (native byte order: the magic tells another order apart). */
enum { OFF_MAGIC = 0, OFF_VERSION = 8, OFF_HDR_BYTES = 12, OFF_FP = 16, OFF_HASH = 24, OFF_PARENT = 32,
       OFF_BS = 40, OFF_LAYERS = 44, OFF_LAYER_BYTES = 48, OFF_RANK = 56 };

static size_t header_bytes(const fl_kv_disk_geom *g) {
    return (FIXED_BYTES + 4 * (size_t)g->block_size + 63) / 64 * 64; /* the payload starts aligned */
}

static size_t payload_bytes(const fl_kv_disk_geom *g) { return 2 * (size_t)g->n_layers * (size_t)g->layer_bytes; }

size_t fl_kv_disk_file_bytes(const fl_kv_disk_geom *g) { return header_bytes(g) + payload_bytes(g) + 8; }

void *fl_kv_disk_payload(const fl_kv_disk_geom *g, void *buf) { return (char *)buf + header_bytes(g); }

static void put64(char *b, size_t off, uint64_t v) { memcpy(b + off, &v, 8); }
static void put32(char *b, size_t off, uint32_t v) { memcpy(b + off, &v, 4); }
static uint64_t get64(const char *b, size_t off) {
    uint64_t v;
    memcpy(&v, b + off, 8);
    return v;
}
static uint32_t get32(const char *b, size_t off) {
    uint32_t v;
    memcpy(&v, b + off, 4);
    return v;
}

/* 64-bit checksum of n bytes: four splitmix lanes over 8-byte words (so the
 * multiplies overlap), folded with the length. */
static uint64_t checksum(const char *p, size_t n) {
    uint64_t h[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 4; l++) h[l] = fl_kv_mix64(h[l] ^ get64(p, i + 8 * (size_t)l));
    uint64_t tail = 0;
    for (size_t j = 0; i + j < n; j++) tail |= (uint64_t)(unsigned char)p[i + j] << (8 * (j % 8));
    uint64_t r = fl_kv_mix64(h[0] ^ fl_kv_mix64(h[1] ^ fl_kv_mix64(h[2] ^ fl_kv_mix64(h[3] ^ tail))));
    return fl_kv_mix64(r ^ (uint64_t)n);
}

void fl_kv_disk_encode(const fl_kv_disk_geom *g, uint64_t hash, uint64_t parent, const int32_t *tokens,
                       void *buf) {
    char *b = buf;
    const size_t hb = header_bytes(g), body = hb + payload_bytes(g);
    memset(b, 0, hb);
    put64(b, OFF_MAGIC, MAGIC);
    put32(b, OFF_VERSION, VERSION);
    put32(b, OFF_HDR_BYTES, (uint32_t)hb);
    put64(b, OFF_FP, g->fingerprint);
    put64(b, OFF_HASH, hash);
    put64(b, OFF_PARENT, parent);
    put32(b, OFF_BS, (uint32_t)g->block_size);
    put32(b, OFF_LAYERS, (uint32_t)g->n_layers);
    put64(b, OFF_LAYER_BYTES, g->layer_bytes);
    put32(b, OFF_RANK, (uint32_t)g->tp_rank);
    memcpy(b + FIXED_BYTES, tokens, (size_t)g->block_size * sizeof(int32_t));
    put64(b, body, checksum(b, body));
}

fl_status fl_kv_disk_decode(const fl_kv_disk_geom *g, const void *buf, size_t n, const uint64_t *want_hash,
                            uint64_t *hash, uint64_t *parent, const int32_t **tokens) {
    const char *b = buf;
    const size_t want = fl_kv_disk_file_bytes(g), body = want - 8;
    if (n < 8 || get64(b, OFF_MAGIC) != MAGIC)
        return FL_ERR(FL_ERR_FORMAT, "not a flotilla KV block file (%zu bytes, no magic)", n);
    if (n < header_bytes(g)) return FL_ERR(FL_ERR_FORMAT, "torn: %zu bytes, a block file has %zu", n, want);
    if (get32(b, OFF_VERSION) != VERSION)
        return FL_ERR(FL_ERR_FORMAT, "KV block file version %u, this build reads %u", get32(b, OFF_VERSION), VERSION);
    if (get64(b, OFF_FP) != g->fingerprint)
        return FL_ERR(FL_ERR_FORMAT, "written for another cache (fingerprint %016" PRIx64 ", this one %016" PRIx64 ")",
                      get64(b, OFF_FP), g->fingerprint);
    if (get32(b, OFF_BS) != (uint32_t)g->block_size || get32(b, OFF_LAYERS) != (uint32_t)g->n_layers ||
        get64(b, OFF_LAYER_BYTES) != g->layer_bytes || get32(b, OFF_RANK) != (uint32_t)g->tp_rank ||
        get32(b, OFF_HDR_BYTES) != header_bytes(g))
        return FL_ERR(FL_ERR_FORMAT, "another cache geometry (block size %u, %u layers, %" PRIu64 " bytes a layer, "
                      "rank %u; this cache: %d, %d, %" PRIu64 ", rank %d)", get32(b, OFF_BS), get32(b, OFF_LAYERS),
                      get64(b, OFF_LAYER_BYTES), get32(b, OFF_RANK), g->block_size, g->n_layers, g->layer_bytes,
                      g->tp_rank);
    if (n != want) return FL_ERR(FL_ERR_FORMAT, "torn: %zu bytes, a block file has %zu", n, want);
    if (get64(b, body) != checksum(b, body)) return FL_ERR(FL_ERR_FORMAT, "checksum mismatch (torn or corrupted)");
    if (want_hash && get64(b, OFF_HASH) != *want_hash)
        return FL_ERR(FL_ERR_FORMAT, "holds block %016" PRIx64 ", its name says %016" PRIx64, get64(b, OFF_HASH),
                      *want_hash);
    *hash = get64(b, OFF_HASH);
    *parent = get64(b, OFF_PARENT);
    *tokens = (const int32_t *)(const void *)(b + FIXED_BYTES);
    return FL_OK;
}

/* ---- rank 0's index ---------------------------------------------------- */

static uint32_t home(const fl_kv_disk *d, uint64_t h) { return (uint32_t)(h ^ (h >> 32)) & d->table_mask; }

static fl_status rehash(fl_kv_disk *d, size_t tcap) {
    int32_t *t = malloc(tcap * sizeof *t);
    if (!t) return FL_ERR(FL_ERR_OOM, "out of memory for the KV disk index");
    for (size_t i = 0; i < tcap; i++) t[i] = -1;
    free(d->table);
    d->table = t;
    d->table_mask = (uint32_t)(tcap - 1);
    for (int e = 0; e < d->n; e++) {
        uint32_t i = home(d, d->hash[e]);
        while (t[i] >= 0) i = (i + 1) & d->table_mask;
        t[i] = e;
    }
    return FL_OK;
}

static fl_status insert(fl_kv_disk *d, uint64_t hash, uint64_t parent, const int32_t *tokens, bool loadable) {
    const int bs = d->g.block_size;
    if (d->n == d->cap) {
        int cap = d->cap ? 2 * d->cap : 256;
        uint64_t *h = realloc(d->hash, (size_t)cap * sizeof *h);
        if (h) d->hash = h;
        uint64_t *p = realloc(d->parent, (size_t)cap * sizeof *p);
        if (p) d->parent = p;
        int32_t *t = realloc(d->tokens, (size_t)cap * bs * sizeof *t);
        if (t) d->tokens = t;
        bool *l = realloc(d->loadable, (size_t)cap * sizeof *l);
        if (l) d->loadable = l;
        if (!h || !p || !t || !l) return FL_ERR(FL_ERR_OOM, "out of memory for the KV disk index");
        d->cap = cap;
    }
    if (!d->table || 2 * (size_t)(d->n + 1) > (size_t)d->table_mask + 1)
        FL_TRY(rehash(d, d->table ? 2 * ((size_t)d->table_mask + 1) : 512));
    const int e = d->n++;
    d->hash[e] = hash;
    d->parent[e] = parent;
    memcpy(d->tokens + (size_t)e * bs, tokens, (size_t)bs * sizeof(int32_t));
    d->loadable[e] = loadable;
    uint32_t i = home(d, hash);
    while (d->table[i] >= 0) i = (i + 1) & d->table_mask;
    d->table[i] = e;
    return FL_OK;
}

int fl_kv_disk_n_loadable(const fl_kv_disk *d) {
    int n = 0;
    for (int e = 0; e < d->n; e++) n += d->loadable[e];
    return n;
}

bool fl_kv_disk_find(const fl_kv_disk *d, uint64_t hash, uint64_t parent, const int32_t *tokens) {
    if (!d->table) return false;
    const size_t bs = (size_t)d->g.block_size;
    for (uint32_t i = home(d, hash); d->table[i] >= 0; i = (i + 1) & d->table_mask) {
        const int e = d->table[i];
        if (d->hash[e] == hash && d->loadable[e] && d->parent[e] == parent &&
            !memcmp(d->tokens + (size_t)e * bs, tokens, bs * sizeof(int32_t)))
            return true;
    }
    return false;
}

bool fl_kv_disk_note(fl_kv_disk *d, uint64_t hash, uint64_t parent, const int32_t *tokens) {
    for (uint32_t i = d->table ? home(d, hash) : 0; d->table && d->table[i] >= 0; i = (i + 1) & d->table_mask)
        if (d->hash[d->table[i]] == hash) return false; /* one file per hash */
    return insert(d, hash, parent, tokens, false) == FL_OK; /* no memory: write it again later, harmless */
}

/* ---- files -------------------------------------------------------------- */

static const char *file_name(fl_kv_disk *d, uint64_t hash, const char *suffix) {
    snprintf(d->path, strlen(d->dir) + 192, "%s/%016" PRIx64 ".r%d%s", d->dir, hash, d->g.tp_rank, suffix);
    return d->path;
}

/* Reads a whole file of at most d->file_bytes into d->buf; *n its size. */
static fl_status read_file(fl_kv_disk *d, const char *path, size_t *n) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return FL_ERR(FL_ERR_IO, "cannot open: %s", strerror(errno));
    struct stat sb;
    fl_status st = FL_OK;
    if (fstat(fd, &sb) != 0) {
        st = FL_ERR(FL_ERR_IO, "cannot stat: %s", strerror(errno));
        goto done;
    }
    /* a longer file is read only as far as a block file goes: decode then
     * reports its size */
    *n = (size_t)sb.st_size;
    const size_t want = *n < d->file_bytes ? *n : d->file_bytes;
    for (size_t got = 0; got < want;) {
        ssize_t r = read(fd, d->buf + got, want - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            st = FL_ERR(FL_ERR_IO, "cannot read: %s", r < 0 ? strerror(errno) : "file shrank");
            goto done;
        }
        got += (size_t)r;
    }
done:
    close(fd);
    return st;
}

/* A file name of this rank: 16 hex digits, ".r", the rank; its hash. */
static bool own_name(const char *name, int rank, uint64_t *hash) {
    char *end;
    for (int i = 0; i < 16; i++)
        if (!strchr("0123456789abcdef", name[i]) || !name[i]) return false;
    if (strncmp(name + 16, ".r", 2) || name[18] < '0' || name[18] > '9') return false;
    long r = strtol(name + 18, &end, 10);
    if (*end || r != rank) return false;
    char hex[17];
    memcpy(hex, name, 16);
    hex[16] = 0;
    *hash = strtoull(hex, NULL, 16);
    return true;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* A temporary file (write_file) of this rank whose writer, a process of
 * this host, is gone: killed mid-write, it is deleted. */
static void drop_if_orphan(fl_kv_disk *d, const char *name) {
    const char *host = d->host;
    uint64_t hash;
    char base[32];
    const char *t = strstr(name, ".tmp.");
    if (!t || t - name >= (ptrdiff_t)sizeof base) return;
    memcpy(base, name, (size_t)(t - name));
    base[t - name] = 0;
    const size_t hl = strlen(host);
    if (!own_name(base, d->g.tp_rank, &hash) || strncmp(t + 5, host, hl) || t[5 + hl] != '.') return;
    char *end;
    const long pid = strtol(t + 6 + hl, &end, 10);
    if (end == t + 6 + hl || *end != '.' || pid <= 0 || kill((pid_t)pid, 0) == 0 || errno != ESRCH) return;
    snprintf(d->path, strlen(d->dir) + 192, "%s/%s", d->dir, name);
    (void)unlink(d->path);
}

/* Checks every file of this rank: the good ones go into the index (all
 * loadable for now), the others are reported; orphaned temporary files
 * of this host are deleted. */
static fl_status scan(fl_kv_disk *d) {
    DIR *dir = opendir(d->dir);
    if (!dir) return FL_ERR(FL_ERR_IO, "--kv-offload-dir: cannot open %s: %s", d->dir, strerror(errno));
    fl_status st = FL_OK;
    struct dirent *de;
    while ((de = readdir(dir))) {
        uint64_t name_hash, hash, parent;
        const int32_t *tokens;
        size_t n = 0;
        if (!own_name(de->d_name, d->g.tp_rank, &name_hash)) {
            drop_if_orphan(d, de->d_name);
            continue;
        }
        const char *path = file_name(d, name_hash, "");
        fl_status fs = read_file(d, path, &n);
        if (fs == FL_OK) fs = fl_kv_disk_decode(&d->g, d->buf, n, &name_hash, &hash, &parent, &tokens);
        if (fs != FL_OK) {
            fprintf(stderr, "flotilla: rank %d: warning: KV offload: ignoring %s: %s\n", d->log_rank, path,
                    fl_error_msg());
            continue;
        }
        if ((st = insert(d, hash, parent, tokens, true)) != FL_OK) break;
    }
    closedir(dir);
    return st;
}

/* Rank 0 keeps the blocks whose files are good on every rank: it sends its
 * hashes, each rank flags those it has, and the flags are and-ed. */
static fl_status agree(fl_kv_disk *d, fl_comm *comm) {
    int32_t n = fl_comm_rank(comm) == 0 ? d->n : 0;
    FL_TRY(fl_comm_broadcast_host(comm, &n, 1, 0, FL_COMM_I32));
    fl_status st = FL_OK;
    int32_t *words = malloc(2 * (size_t)(n > 0 ? n : 1) * sizeof *words);
    int32_t *flags = malloc((size_t)(n > 0 ? n : 1) * sizeof *flags);
    uint64_t *mine = malloc((size_t)(d->n > 0 ? d->n : 1) * sizeof *mine);
    FL_CHECK_ALLOC(words, st, done);
    FL_CHECK_ALLOC(flags, st, done);
    FL_CHECK_ALLOC(mine, st, done);
    if (fl_comm_rank(comm) == 0)
        for (int e = 0; e < n; e++) fl_plan_put_u64(words + 2 * e, d->hash[e]);
    FL_TRY_GOTO(fl_comm_broadcast_host(comm, words, 2 * (size_t)n, 0, FL_COMM_I32), st, done);
    if (d->n) memcpy(mine, d->hash, (size_t)d->n * sizeof *mine);
    qsort(mine, (size_t)d->n, sizeof *mine, cmp_u64);
    for (int e = 0; e < n; e++) {
        const uint64_t h = fl_plan_get_u64(words + 2 * e);
        flags[e] = d->n > 0 && bsearch(&h, mine, (size_t)d->n, sizeof *mine, cmp_u64) != NULL;
    }
    FL_TRY_GOTO(fl_comm_agree_each(comm, flags, (size_t)n), st, done);
    if (fl_comm_rank(comm) == 0)
        for (int e = 0; e < n; e++) d->loadable[e] = flags[e] != 0;
done:
    free(words);
    free(flags);
    free(mine);
    return st;
}

static fl_status make_dir(const char *path) {
    if (mkdir(path, 0777) == 0 || errno == EEXIST) {
        struct stat sb;
        if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) return FL_OK;
        return FL_ERR(FL_ERR_IO, "--kv-offload-dir: %s is not a folder", path);
    }
    return FL_ERR(FL_ERR_IO, "--kv-offload-dir: cannot create %s: %s", path, strerror(errno));
}

fl_status fl_kv_disk_open(const char *root, const fl_kv_disk_geom *g, fl_comm *comm, int log_rank,
                          fl_kv_disk *d) {
    memset(d, 0, sizeof *d);
    fl_status st = FL_OK;
    d->g = *g;
    d->log_rank = log_rank;
    if (gethostname(d->host, sizeof d->host - 1) != 0) snprintf(d->host, sizeof d->host, "host");
    d->host[sizeof d->host - 1] = 0;
    d->file_bytes = fl_kv_disk_file_bytes(g);
    const size_t dl = strlen(root) + 32;
    d->dir = malloc(dl);
    d->buf = malloc(d->file_bytes);
    FL_CHECK_ALLOC(d->dir, st, fail);
    FL_CHECK_ALLOC(d->buf, st, fail);
    snprintf(d->dir, dl, "%s/%016" PRIx64, root, g->fingerprint);
    d->path = malloc(strlen(d->dir) + 192); /* a block's name and a temporary suffix */
    FL_CHECK_ALLOC(d->path, st, fail);
    /* every rank checks its own folder (it may be node-local); a failure
     * anywhere fails every rank alike */
    fl_status mine = make_dir(root);
    if (mine == FL_OK) mine = make_dir(d->dir);
    if (mine == FL_OK) mine = scan(d);
    if (comm && fl_comm_size(comm) > 1) {
        bool all_ok = false;
        const char *msg = mine == FL_OK ? "" : fl_error_msg();
        if (mine != FL_OK) fprintf(stderr, "flotilla: rank %d: %s\n", log_rank, msg);
        FL_TRY_GOTO(fl_comm_agree(comm, mine == FL_OK, &all_ok), st, fail);
        if (!all_ok) {
            st = mine != FL_OK ? mine : FL_ERR(FL_ERR_IO, "--kv-offload-dir: another rank could not use its folder");
            goto fail;
        }
        FL_TRY_GOTO(agree(d, comm), st, fail);
    } else if (mine != FL_OK) {
        st = mine;
        goto fail;
    }
    return FL_OK;
fail:
    fl_kv_disk_close(d);
    return st;
}

void fl_kv_disk_close(fl_kv_disk *d) {
    if (!d) return;
    free(d->dir);
    free(d->buf);
    free(d->path);
    free(d->hash);
    free(d->parent);
    free(d->tokens);
    free(d->loadable);
    free(d->table);
    memset(d, 0, sizeof *d);
}

/* Writes the image in d->buf under its final name through a temporary one,
 * this writer's alone (host, process, a count: another job on another node
 * of a shared folder may be writing the same block), so the rename is the
 * only place two writers meet, and either file is whole. */
static fl_status write_file(fl_kv_disk *d, uint64_t hash) {
    char tmp_suffix[128];
    char *tmp = NULL;
    int fd = -1;
    for (unsigned k = 0; fd < 0 && k < 100; k++) {
        snprintf(tmp_suffix, sizeof tmp_suffix, ".tmp.%s.%ld.%u", d->host, (long)getpid(), k);
        free(tmp);
        tmp = strdup(file_name(d, hash, tmp_suffix));
        if (!tmp) return FL_ERR(FL_ERR_OOM, "out of memory");
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (fd < 0 && errno != EEXIST) break; /* a leftover of a killed run with this pid: the next count */
    }
    fl_status st = FL_OK;
    if (fd < 0) {
        st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
        goto done;
    }
    for (size_t put = 0; put < d->file_bytes;) {
        ssize_t w = write(fd, d->buf + put, d->file_bytes - put);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", tmp, w < 0 ? strerror(errno) : "no progress");
            break;
        }
        put += (size_t)w;
    }
    if (close(fd) != 0 && st == FL_OK) st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
    if (st == FL_OK && rename(tmp, file_name(d, hash, "")) != 0)
        st = FL_ERR(FL_ERR_IO, "cannot rename %s to %s: %s", tmp, d->path, strerror(errno));
    if (st != FL_OK) unlink(tmp);
done:
    free(tmp);
    return st;
}

static fl_status check_block(const fl_kv_cache *kv, int32_t id) {
    if (id < 0 || id >= kv->n_blocks)
        return FL_ERR(FL_ERR_INTERNAL, "step plan: disk tier block %d of %d", id, kv->n_blocks);
    return FL_OK;
}

fl_status fl_kv_disk_persist(fl_kv_disk *d, fl_kv_cache *kv, const fl_step_plan *p) {
    fl_backend *be = kv->be;
    const size_t lb = d->g.layer_bytes, words = FL_PLAN_PERSIST_WORDS(p->block_size);
    char *pay = fl_kv_disk_payload(&d->g, d->buf);
    for (int i = 0; i < p->n_persist; i++) {
        const int32_t *w = p->persist + (size_t)i * words;
        const int32_t id = w[0];
        FL_TRY(check_block(kv, id));
        for (int l = 0; l < kv->n_layers; l++) {
            FL_TRY(be->ops->download(be, pay + (2 * (size_t)l) * lb, (char *)kv->k[l] + (size_t)id * lb, lb));
            FL_TRY(be->ops->download(be, pay + (2 * (size_t)l + 1) * lb, (char *)kv->v[l] + (size_t)id * lb, lb));
        }
        const uint64_t hash = fl_plan_get_u64(w + 1);
        fl_kv_disk_encode(&d->g, hash, fl_plan_get_u64(w + 3), w + 5, d->buf);
        if (write_file(d, hash) != FL_OK && d->n_write_errors++ < 3) /* a full disk: say it a few times */
            fprintf(stderr, "flotilla: rank %d: warning: KV offload: %s (the block is not kept)\n", d->log_rank,
                    fl_error_msg());
    }
    return FL_OK;
}

fl_status fl_kv_disk_load(fl_kv_disk *d, fl_kv_cache *kv, const fl_step_plan *p) {
    fl_backend *be = kv->be;
    const size_t lb = d->g.layer_bytes;
    const char *pay = fl_kv_disk_payload(&d->g, d->buf);
    for (int i = 0; i < p->n_disk_in; i++) {
        const int32_t *w = p->disk_in + (size_t)i * FL_PLAN_DISK_IN_WORDS;
        const int32_t id = w[0];
        const uint64_t want = fl_plan_get_u64(w + 1);
        uint64_t hash, parent;
        const int32_t *tokens;
        size_t n = 0;
        FL_TRY(check_block(kv, id));
        const char *path = file_name(d, want, "");
        fl_status st = read_file(d, path, &n);
        if (st == FL_OK) st = fl_kv_disk_decode(&d->g, d->buf, n, &want, &hash, &parent, &tokens);
        if (st != FL_OK)
            return FL_ERR(FL_ERR_IO, "KV offload file %s changed during the run: %s", path, fl_error_msg());
        for (int l = 0; l < kv->n_layers; l++) {
            FL_TRY(be->ops->upload(be, (char *)kv->k[l] + (size_t)id * lb, pay + (2 * (size_t)l) * lb, lb));
            FL_TRY(be->ops->upload(be, (char *)kv->v[l] + (size_t)id * lb, pay + (2 * (size_t)l + 1) * lb, lb));
        }
    }
    return FL_OK;
}
