/*
 * quantize_resume.c — the run state of `flotilla quantize` (see
 * quantize_resume.h). The identity file and its comparison are those of
 * `flotilla generate`'s resumable output (resume.h); the state file is
 * binary: a 48-byte header (an 8-byte magic, then little-endian u64s:
 * version, layers done, n, d, FNV-1a of the hidden states' bytes), then
 * the hidden states, f32 in host order (little-endian on every machine
 * flotilla builds for).
 */
#include "launcher/quantize_resume.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "launcher/resume.h"

static const char MAGIC[8] = {'F', 'L', 'Q', 'S', 'T', 'A', 'T', 'E'};
enum { STATE_VERSION = 1, HEAD_BYTES = 48 };

struct fl_qresume {
    char dir[4096], ident[4200], state[4200];
    int lock_fd, n_layers;
    int64_t n, d;
};

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* *done = 0 when there is no state file. */
static fl_status read_state(const fl_qresume *r, float *h, int *done) {
    *done = 0;
    FILE *f = fopen(r->state, "rb");
    if (!f) {
        if (errno == ENOENT) return FL_OK;
        return FL_ERR(FL_ERR_IO, "cannot open %s: %s", r->state, strerror(errno));
    }
    uint8_t head[HEAD_BYTES];
    fl_status st = FL_OK;
    const size_t bytes = (size_t)(r->n * r->d) * sizeof *h;
    if (fread(head, 1, HEAD_BYTES, f) != HEAD_BYTES || memcmp(head, MAGIC, 8) ||
        get_u64(head + 8) != STATE_VERSION) {
        st = FL_ERR(FL_ERR_FORMAT, "%s is not a flotilla quantize state file", r->state);
    } else if (get_u64(head + 16) > (uint64_t)r->n_layers || get_u64(head + 24) != (uint64_t)r->n ||
               get_u64(head + 32) != (uint64_t)r->d) {
        st = FL_ERR(FL_ERR_FORMAT, "%s holds %llu layers of %llu tokens x %llu, not at most %d of %lld x %lld",
                    r->state, (unsigned long long)get_u64(head + 16), (unsigned long long)get_u64(head + 24),
                    (unsigned long long)get_u64(head + 32), r->n_layers, (long long)r->n, (long long)r->d);
    }
    if (st == FL_OK && (fread(h, 1, bytes, f) != bytes || fgetc(f) != EOF ||
                        get_u64(head + 40) != fl_batch_hash(FL_BATCH_HASH_INIT, h, bytes)))
        st = FL_ERR(FL_ERR_FORMAT, "%s is damaged (short, or its checksum does not match)", r->state);
    if (st == FL_OK) *done = (int)get_u64(head + 16);
    fclose(f);
    return st;
}

fl_status fl_qresume_open(const char *dir, const fl_batch_ident *id, int n_layers, int64_t n, int64_t d, float *h,
                          int *done, fl_qresume **out) {
    *out = NULL;
    *done = 0;
    fl_qresume *r = calloc(1, sizeof *r);
    if (!r) return FL_ERR(FL_ERR_OOM, "out of memory");
    r->lock_fd = -1;
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    snprintf(r->ident, sizeof r->ident, "%s/.flotilla-quantize.json", dir);
    snprintf(r->state, sizeof r->state, "%s/.flotilla-quantize.state", dir);
    r->n_layers = n_layers;
    r->n = n;
    r->d = d;
    fl_status st = FL_OK;
    bool have = false;
    fl_batch_ident prev;
    char why[1200];
    r->lock_fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (r->lock_fd < 0) {
        st = FL_ERR(FL_ERR_IO, "cannot open %s: %s", dir, strerror(errno));
        goto fail;
    }
    if (flock(r->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        st = FL_ERR(FL_ERR_IO, "%s is in use by another flotilla quantize run (locked)", dir);
        goto fail;
    }
    FL_TRY_GOTO(fl_resume_read_state(r->ident, &have, &prev), st, fail);
    if (!have) {
        /* a state file without an identity belongs to no run that can be proven ours */
        if (unlink(r->state) != 0 && errno != ENOENT) {
            st = FL_ERR(FL_ERR_IO, "cannot remove %s: %s", r->state, strerror(errno));
            goto fail;
        }
        FL_TRY_GOTO(fl_resume_write_state(r->ident, id), st, fail);
    } else if (!fl_batch_ident_same(&prev, id, why, sizeof why)) {
        st = FL_ERR(FL_ERR_INVALID_ARG, "%s holds an unfinished quantization by other settings (that run's vs "
                    "this one's: %s; the input is the --calib file), per %s; refusing to continue it: rerun with "
                    "that run's model, calibration file and options, or choose another --output (or remove the "
                    "folder) to start over", dir, why, r->ident);
        goto fail;
    } else {
        FL_TRY_GOTO(read_state(r, h, done), st, fail);
    }
    *out = r;
    return FL_OK;
fail:
    fl_qresume_free(r);
    return st;
}

fl_status fl_qresume_commit(fl_qresume *r, int done, const float *h) {
    const size_t bytes = (size_t)(r->n * r->d) * sizeof *h;
    uint8_t head[HEAD_BYTES];
    memcpy(head, MAGIC, 8);
    put_u64(head + 8, STATE_VERSION);
    put_u64(head + 16, (uint64_t)done);
    put_u64(head + 24, (uint64_t)r->n);
    put_u64(head + 32, (uint64_t)r->d);
    put_u64(head + 40, fl_batch_hash(FL_BATCH_HASH_INIT, h, bytes));
    return fl_resume_write_atomic(r->state, head, HEAD_BYTES, h, bytes);
}

fl_status fl_qresume_finish(fl_qresume *r) {
    /* the state first: an identity alone restarts from layer 0, never from stale states */
    if (unlink(r->state) != 0 && errno != ENOENT)
        return FL_ERR(FL_ERR_IO, "cannot remove %s: %s", r->state, strerror(errno));
    if (unlink(r->ident) != 0 && errno != ENOENT)
        return FL_ERR(FL_ERR_IO, "cannot remove %s: %s", r->ident, strerror(errno));
    /* temporary files of a state write a kill interrupted (fl_resume_write_atomic) */
    DIR *d = opendir(r->dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        char p[4400];
        if (strncmp(e->d_name, ".flotilla-quantize.", 19) || !strstr(e->d_name, ".tmp.")) continue;
        snprintf(p, sizeof p, "%s/%s", r->dir, e->d_name);
        unlink(p);
    }
    if (d) closedir(d);
    return FL_OK;
}

void fl_qresume_free(fl_qresume *r) {
    if (!r) return;
    if (r->lock_fd >= 0) close(r->lock_fd);
    free(r);
}
