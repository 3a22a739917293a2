/*
 * resume.c — restartable batch jobs (see resume.h): which output files a
 * job may append to or truncate (its own, proven by the state file beside
 * them), the done set read back from the output file, cutting a record torn
 * by a kill, and the duplicate custom_id check of the input.
 *
 * Why a pre-pass over the input: a duplicate found only when the job
 * reaches it would fail a job hours in, after writing half its results; a
 * streaming pass costs one cJSON parse per line and keeps only the ids (one
 * hash set), never the input, in memory. It also gives the progress bar its
 * total.
 */
#include "launcher/resume.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/engine/request.h"

/* ---- string set: open addressing, FNV-1a, grown at 70% load -------------- */

typedef struct slot {
    char *key; /* NULL: empty */
    long val;
} slot;

struct fl_idset {
    slot *slots;
    size_t cap, len; /* cap is a power of two */
};

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static slot *find(const fl_idset *s, const char *key) {
    size_t i = (size_t)hash_str(key) & (s->cap - 1);
    while (s->slots[i].key && strcmp(s->slots[i].key, key) != 0) i = (i + 1) & (s->cap - 1);
    return &s->slots[i];
}

fl_status fl_idset_new(fl_idset **out) {
    fl_idset *s = calloc(1, sizeof *s);
    if (s) s->slots = calloc(64, sizeof *s->slots);
    if (!s || !s->slots) {
        free(s);
        return FL_ERR(FL_ERR_OOM, "out of memory allocating an id set");
    }
    s->cap = 64;
    *out = s;
    return FL_OK;
}

void fl_idset_free(fl_idset *s) {
    if (!s) return;
    for (size_t i = 0; i < s->cap; i++) free(s->slots[i].key);
    free(s->slots);
    free(s);
}

static fl_status grow(fl_idset *s) {
    slot *old = s->slots;
    size_t old_cap = s->cap;
    slot *n = calloc(old_cap * 2, sizeof *n);
    if (!n) return FL_ERR(FL_ERR_OOM, "out of memory growing an id set to %zu ids", s->len);
    s->slots = n;
    s->cap = old_cap * 2;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].key) *find(s, old[i].key) = old[i];
    free(old);
    return FL_OK;
}

fl_status fl_idset_put(fl_idset *s, const char *key, long val, bool *added, long *prev) {
    slot *sl = find(s, key);
    if (sl->key) {
        *added = false;
        if (prev) *prev = sl->val;
        return FL_OK;
    }
    if ((s->len + 1) * 10 > s->cap * 7) {
        FL_TRY(grow(s));
        sl = find(s, key);
    }
    sl->key = strdup(key);
    if (!sl->key) return FL_ERR(FL_ERR_OOM, "out of memory adding to an id set");
    sl->val = val;
    s->len++;
    *added = true;
    return FL_OK;
}

bool fl_idset_has(const fl_idset *s, const char *key) { return s && find(s, key)->key != NULL; }

size_t fl_idset_size(const fl_idset *s) { return s ? s->len : 0; }

const char *fl_resume_key(const char *custom_id, long line, char *buf, size_t n) {
    if (custom_id) return custom_id;
    /* \x01 cannot start a custom_id anyone writes by hand; the line number
     * is stable as long as the input is the same file. */
    snprintf(buf, n, "\x01line %ld", line);
    return buf;
}

/* ---- the output file ------------------------------------------------------ */

char *fl_resume_state_path(const char *out_path) {
    size_t n = strlen(out_path) + sizeof ".flotilla.json";
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s.flotilla.json", out_path);
    return p;
}

static void abs_path(const char *path, char *dst, size_t n) {
    char *r = realpath(path, NULL);
    snprintf(dst, n, "%s", r ? r : path);
    free(r);
}

fl_status fl_resume_ident_files(const char *in_path, const char *model_path, fl_batch_ident *id) {
    struct stat s;
    if (strcmp(in_path, "-") == 0) {
        snprintf(id->input, sizeof id->input, "-");
    } else {
        abs_path(in_path, id->input, sizeof id->input);
        if (stat(in_path, &s) == 0 && S_ISREG(s.st_mode)) {
            int fd = open(in_path, O_RDONLY);
            if (fd < 0) return FL_ERR(FL_ERR_IO, "cannot open %s: %s", in_path, strerror(errno));
            static char buf[1 << 16];
            uint64_t h = FL_BATCH_HASH_INIT, n = 0;
            ssize_t r;
            while ((r = read(fd, buf, sizeof buf)) > 0) {
                h = fl_batch_hash(h, buf, (size_t)r);
                n += (uint64_t)r;
            }
            int e = errno;
            close(fd);
            if (r < 0) return FL_ERR(FL_ERR_IO, "reading %s: %s", in_path, strerror(e));
            id->input_hash = h;
            id->input_bytes = n;
        }
    }
    abs_path(model_path, id->model, sizeof id->model);
    id->model_bytes = 0;
    if (stat(model_path, &s) != 0) return FL_OK; /* the loader names the missing model */
    if (!S_ISDIR(s.st_mode)) {
        id->model_bytes = (uint64_t)s.st_size;
        return FL_OK;
    }
    /* a folder: the sum of its files' sizes (weights, config, tokenizer)
     * stands for its content without reading gigabytes */
    DIR *d = opendir(model_path);
    if (!d) return FL_OK;
    struct dirent *e;
    while ((e = readdir(d))) {
        char p[4608];
        snprintf(p, sizeof p, "%s/%s", model_path, e->d_name);
        if (e->d_name[0] != '.' && stat(p, &s) == 0 && S_ISREG(s.st_mode))
            id->model_bytes += (uint64_t)s.st_size;
    }
    closedir(d);
    return FL_OK;
}

fl_status fl_resume_read_state(const char *path, bool *have, fl_batch_ident *id) {
    struct stat s;
    *have = false;
    if (lstat(path, &s) != 0) {
        if (errno == ENOENT) return FL_OK;
        return FL_ERR(FL_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    }
    if (!S_ISREG(s.st_mode) || s.st_size > (1 << 20))
        return FL_ERR(FL_ERR_FORMAT, "%s is not a flotilla job state file (not a small regular "
                      "file); move it away or choose another --output", path);
    char *text = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return FL_ERR(FL_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    fl_status st = FL_OK;
    text = malloc((size_t)s.st_size + 1);
    FL_CHECK_ALLOC(text, st, done);
    size_t n = fread(text, 1, (size_t)s.st_size, f);
    st = fl_batch_ident_parse(text, n, path, id);
    if (st != FL_OK) {
        char why[1024]; /* the message buffer is rewritten by FL_ERR */
        snprintf(why, sizeof why, "%s", fl_error_msg());
        st = FL_ERR(FL_ERR_FORMAT, "%s; move it away or choose another --output", why);
    } else {
        *have = true;
    }
done:
    free(text);
    fclose(f);
    return st;
}

/* write() until all n bytes are out (large writes may be partial). */
static bool write_all(int fd, const void *data, size_t n) {
    for (const char *p = data; n > 0;) {
        ssize_t r = write(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        p += r;
        n -= (size_t)r;
    }
    return true;
}

fl_status fl_resume_write_atomic(const char *path, const void *head, size_t head_len, const void *body,
                                 size_t body_len) {
    char *tmp = NULL;
    fl_status st = FL_OK;
    int fd = -1;
    size_t n = strlen(path) + 32;
    tmp = malloc(n);
    FL_CHECK_ALLOC(tmp, st, done);
    snprintf(tmp, n, "%s.tmp.%ld", path, (long)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || !write_all(fd, head, head_len) || (body_len && !write_all(fd, body, body_len)) || fsync(fd) != 0) {
        st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
        goto done;
    }
    close(fd);
    fd = -1;
    if (rename(tmp, path) != 0) {
        st = FL_ERR(FL_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        goto done;
    }
    char *dir = strdup(path);
    FL_CHECK_ALLOC(dir, st, done);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = slash == dir ? (slash[1] = 0, '/') : 0;
    int dfd = open(slash ? dir : ".", O_RDONLY | O_DIRECTORY);
    free(dir);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
done:
    if (fd >= 0) close(fd);
    if (st != FL_OK && tmp) unlink(tmp);
    free(tmp);
    return st;
}

fl_status fl_resume_write_state(const char *path, const fl_batch_ident *id) {
    char *text = NULL;
    FL_TRY(fl_batch_ident_format(id, &text));
    fl_status st = fl_resume_write_atomic(path, text, strlen(text), NULL, 0);
    free(text);
    return st;
}

typedef struct scan_ctx {
    fl_idset *done;
} scan_ctx;

static fl_status on_record(void *ctx, const char *custom_id, long error_line, long out_line) {
    scan_ctx *c = ctx;
    char kb[48];
    bool added;
    return fl_idset_put(c->done, fl_resume_key(custom_id, error_line, kb, sizeof kb), out_line,
                        &added, NULL);
}

typedef enum out_mode { MODE_NEW, MODE_RESUME } out_mode;

fl_status fl_resume_open_output(const fl_resume_job *job, fl_idset *done, fl_resume_info *info,
                                FILE **out) {
    const char *path = job->out_path, *in = job->in_path;
    const bool in_stdin = strcmp(in, "-") == 0;
    fl_status st = FL_OK;
    char *state_path = NULL;
    fl_batch_ident state;
    bool have_state = false, exists, need_proof = false;
    struct stat so, si;
    FILE *f = NULL;
    int fd = -1;
    long n_matched = 0;
    out_mode mode = MODE_NEW;
    memset(info, 0, sizeof *info);
    info->n_total = info->n_todo = -1;
    *out = NULL;

    if (strcmp(path, "-") == 0) {
        if (job->resume)
            return FL_ERR(FL_ERR_INVALID_ARG, "--resume needs an output file (--output - writes to "
                          "standard output, which cannot be resumed)");
        if (!in_stdin) FL_TRY(fl_resume_scan_input(in, NULL, &info->n_total, &info->n_todo, NULL));
        *out = stdout;
        return FL_OK;
    }
    /* ---- read-only checks: nothing is created or changed before the decision */
    exists = stat(path, &so) == 0;
    if (!exists && errno != ENOENT) return FL_ERR(FL_ERR_IO, "cannot stat %s: %s", path, strerror(errno));
    if (exists && !S_ISREG(so.st_mode))
        return FL_ERR(FL_ERR_INVALID_ARG, "--output %s is not a regular file (a device, pipe or "
                      "folder); give a file path, or - for standard output", path);
    if (exists && !in_stdin && stat(in, &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
        return FL_ERR(FL_ERR_INVALID_ARG, "--output %s is the input file %s itself; results "
                      "must go to another file", path, in);
    state_path = fl_resume_state_path(path);
    FL_CHECK_ALLOC(state_path, st, fail);
    FL_TRY_GOTO(fl_resume_read_state(state_path, &have_state, &state), st, fail);
    const bool empty = !exists || so.st_size == 0;
    if (empty) {
        mode = MODE_NEW; /* nothing to lose: an empty file holds no one's data */
    } else if (job->overwrite) {
        /* without a state file, only content that is all result records
         * proves the file a flotilla output (one made before state files) */
        need_proof = !have_state && !job->force;
        mode = MODE_NEW;
    } else if (have_state) {
        if (!fl_batch_ident_same(&state, job->ident, info->why, sizeof info->why)) {
            if (!job->force) {
                st = FL_ERR(FL_ERR_INVALID_ARG, "%s holds the results of another job (%s, per %s); "
                            "refusing to resume it: choose another --output, --overwrite to start "
                            "over, or --force to continue it anyway", path, info->why, state_path);
                goto fail;
            }
            info->forced = true;
        }
        mode = MODE_RESUME;
    } else {
        mode = MODE_RESUME; /* adoption, checked below */
        info->adopted = true;
    }

    if (exists) {
        fd = open(path, O_RDWR | O_NOCTTY);
        struct stat s2;
        if (fd < 0) {
            st = FL_ERR(FL_ERR_IO, "cannot open %s: %s", path, strerror(errno));
            goto fail;
        }
        if (fstat(fd, &s2) != 0 || s2.st_dev != so.st_dev || s2.st_ino != so.st_ino) {
            st = FL_ERR(FL_ERR_IO, "%s changed while it was being opened; try again", path);
            goto fail;
        }
        /* two jobs appending to one file would interleave and repeat work */
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            st = FL_ERR(FL_ERR_IO, "%s is in use by another flotilla job (locked)", path);
            goto fail;
        }
        f = fdopen(fd, "r+");
        if (!f) {
            st = FL_ERR(FL_ERR_IO, "cannot open %s: %s", path, strerror(errno));
            goto fail;
        }
        fd = -1;
    }
    fl_batch_scan scan = {0};
    if (need_proof) {
        st = fl_batch_scan_results(f, path, FL_BATCH_MAX_LINE, NULL, NULL, &scan);
        if (st != FL_OK || scan.bad_line) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "--overwrite: %s was not written by flotilla (no %s "
                        "beside it, and not every line is a result record); refusing to truncate "
                        "it (add --force to overwrite it anyway)", path, state_path);
            goto fail;
        }
    }
    if (mode == MODE_RESUME) {
        scan_ctx c = {done};
        st = fl_batch_scan_results(f, path, FL_BATCH_MAX_LINE, on_record, &c, &scan);
        if (st != FL_OK && info->adopted) {
            char why[1024]; /* the message buffer is rewritten by FL_ERR */
            snprintf(why, sizeof why, "%s", fl_error_msg());
            st = FL_ERR(FL_ERR_INVALID_ARG, "%s exists and is not a flotilla results file (%s); "
                        "refusing to append to or truncate it: choose another --output", path, why);
        }
        if (st != FL_OK) goto fail;
        info->n_done = scan.n_records;
    }
    if (!in_stdin)
        FL_TRY_GOTO(fl_resume_scan_input(in, done, &info->n_total, &info->n_todo, &n_matched), st,
                    fail);
    if (info->adopted) {
        /* no state file: the content alone must prove the file is this
         * job's, and only when the user asked to resume */
        bool ours = !in_stdin && scan.bad_line == 0 && n_matched == (long)fl_idset_size(done);
        if (!job->resume || !ours) {
            st = FL_ERR(FL_ERR_INVALID_ARG, "%s exists and was not written by this job (no %s "
                        "beside it); refusing to append to or truncate it: choose another "
                        "--output%s", path, state_path,
                        ours ? ", or add --resume to continue it (every line is a result for "
                               "this input)" : "");
            goto fail;
        }
    }

    /* ---- the decision is made: change the files */
    if (!exists) {
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOCTTY, 0644);
        if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0 || !(f = fdopen(fd, "r+"))) {
            st = FL_ERR(FL_ERR_IO, "cannot create %s: %s", path, strerror(errno));
            goto fail;
        }
        fd = -1;
    }
    if (mode == MODE_NEW && exists && so.st_size > 0) {
        if (ftruncate(fileno(f), 0) != 0 || fsync(fileno(f)) != 0) {
            st = FL_ERR(FL_ERR_IO, "cannot truncate %s: %s", path, strerror(errno));
            goto fail;
        }
    }
    if (mode == MODE_RESUME && scan.size > scan.good_end) {
        info->torn_bytes = (long)(scan.size - scan.good_end);
        if (fflush(f) != 0 || ftruncate(fileno(f), (off_t)scan.good_end) != 0 ||
            fsync(fileno(f)) != 0) {
            st = FL_ERR(FL_ERR_IO, "cannot cut the torn last record (line %ld) of %s: %s",
                        scan.bad_line, path, strerror(errno));
            goto fail;
        }
    }
    /* the output is empty (or ours) before the state names this job, so a
     * crash in between never lets a later run take old results for new */
    if (mode == MODE_NEW || info->adopted || info->forced || !have_state)
        FL_TRY_GOTO(fl_resume_write_state(state_path, job->ident), st, fail);
    if (fseek(f, 0, SEEK_END) != 0) {
        st = FL_ERR(FL_ERR_IO, "cannot seek in %s: %s", path, strerror(errno));
        goto fail;
    }
    free(state_path);
    *out = f;
    return FL_OK;
fail:
    if (f) fclose(f);
    if (fd >= 0) close(fd);
    free(state_path);
    return st;
}

/* ---- the input pre-pass --------------------------------------------------- */

fl_status fl_resume_scan_input(const char *path, const fl_idset *done, long *n_total,
                               long *n_todo, long *n_matched) {
    fl_request_reader *rd = NULL;
    fl_idset *seen = NULL;
    fl_status st;
    *n_total = *n_todo = 0;
    if (n_matched) *n_matched = 0;
    FL_TRY(fl_request_reader_open(path, &rd));
    FL_TRY_GOTO(fl_idset_new(&seen), st, fail);
    for (;;) {
        long line;
        const char *text;
        size_t len;
        FL_TRY_GOTO(fl_request_reader_next(rd, &line, &text, &len), st, fail);
        if (!text) break;
        (*n_total)++;
        cJSON *j = cJSON_ParseWithLength(text, len);
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "custom_id");
        char np[16];
        if (cJSON_IsString(id) && !id->valuestring[0]) id = NULL; /* "" is refused, keyed by line */
        /* an id with an escaped NUL is refused too (fl_request_parse) */
        if (id && fl_request_find_nul_escape(text, len, np, sizeof np) && !strcmp(np, "custom_id"))
            id = NULL;
        char kb[48];
        const char *key = fl_resume_key(cJSON_IsString(id) ? id->valuestring : NULL, line, kb,
                                        sizeof kb);
        bool added = true;
        long prev = 0;
        st = FL_OK;
        if (cJSON_IsString(id)) st = fl_idset_put(seen, key, line, &added, &prev);
        if (st == FL_OK && !added)
            st = FL_ERR(FL_ERR_INVALID_ARG, "duplicate custom_id \"%.200s\" at %s:%ld and %s:%ld; "
                        "custom_ids must be unique for results to be matched and resumed",
                        key, path, prev, path, line);
        if (st == FL_OK && !fl_idset_has(done, key)) (*n_todo)++;
        else if (st == FL_OK && n_matched) (*n_matched)++;
        cJSON_Delete(j);
        if (st != FL_OK) goto fail;
    }
    st = FL_OK;
fail:
    fl_idset_free(seen);
    fl_request_reader_close(rd);
    return st;
}
