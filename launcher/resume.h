/*
 * resume.h — what makes a `flotilla generate` job restartable after a kill:
 *
 * - a string set (custom_id -> input line) used both for the ids already in
 *   the output file and for the duplicate check of the input;
 * - opening the output file for a job, which appends to or truncates only
 *   a file it can prove its own (a state file beside it names the same
 *   job): the complete records already in it are collected as done, a torn
 *   last record (no '\n', or not valid JSON) left by a kill is cut off with
 *   ftruncate, and the file is positioned for appending;
 * - a streaming pre-pass over the input (one line in memory at a time) that
 *   counts the requests still to do and refuses duplicate custom_ids,
 *   naming both lines, before any model is loaded.
 *
 * A record is identified by its custom_id; an error record without one
 * (the input line had no readable custom_id) by its input line number, so
 * it is not redone either (fl_resume_key).
 */
#ifndef FL_RESUME_H
#define FL_RESUME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "core/status.h"
#include "runtime/engine/batch_state.h"

typedef struct fl_idset fl_idset;

fl_status fl_idset_new(fl_idset **out);
void fl_idset_free(fl_idset *s);
/* Adds key with value val. When key is already present nothing changes,
 * *added = false and *prev (may be NULL) receives the stored value. */
fl_status fl_idset_put(fl_idset *s, const char *key, long val, bool *added, long *prev);
bool fl_idset_has(const fl_idset *s, const char *key);
size_t fl_idset_size(const fl_idset *s);

/* The done-set key of a record: custom_id, or (when NULL) a key made from
 * the input line, written into buf[n]. Returns custom_id or buf. */
const char *fl_resume_key(const char *custom_id, long line, char *buf, size_t n);

/* How a job's output is opened. */
typedef struct fl_resume_job {
    const char *in_path;           /* "-" = standard input */
    const char *out_path;          /* "-" = standard output (no resume, no state file) */
    const fl_batch_ident *ident;   /* this run's identity */
    bool resume;                   /* --resume: also adopt a results file without state file */
    bool overwrite;                /* --overwrite: start over */
    bool force;                    /* --force: resume/overwrite what this job cannot prove its own */
} fl_resume_job;

typedef struct fl_resume_info {
    long n_done;       /* results already in the output */
    long torn_bytes;   /* cut off the end (a record torn by a kill) */
    long n_total;      /* requests in the input; -1 for standard input */
    long n_todo;       /* of those, not in the output yet; -1 for standard input */
    bool adopted;      /* the output had no state file and was taken over (--resume) */
    bool forced;       /* the state file named another job (--force) */
    char why[1200];    /* forced: what differed */
} fl_resume_info;

/* The state file's path beside out_path: out_path + ".flotilla.json" (malloc'd). */
char *fl_resume_state_path(const char *out_path);

/* Fills id's input and model parts: absolute paths, sizes, and the FNV-1a
 * hash of the input's bytes (regular files only; "-" and pipes are not read). */
fl_status fl_resume_ident_files(const char *in_path, const char *model_path, fl_batch_ident *id);

/* Reads a job state file: *have = false when there is none. Anything else
 * at that path (a directory, a large file, text that is not a state) is
 * refused, with a message telling to move it away or choose another
 * --output, rather than overwritten. */
fl_status fl_resume_read_state(const char *path, bool *have, fl_batch_ident *id);

/* Writes id as the state file at path (fl_resume_write_atomic). */
fl_status fl_resume_write_state(const char *path, const fl_batch_ident *id);

/* Replaces path with head then body (body may be NULL when body_len is 0)
 * atomically: a temporary file beside it, synced, renamed over it, the
 * folder synced, so a crash leaves the old content or the new, never half
 * of either. */
fl_status fl_resume_write_atomic(const char *path, const void *head, size_t head_len, const void *body,
                                 size_t body_len);

/* Opens a job's output, or refuses without changing a byte. The rules (also
 * in `flotilla generate --help` and README.md "Output files"):
 * - "-": standard output, nothing resumed;
 * - not a regular file, or the input itself (same device and inode):
 *   refused;
 * - missing or empty: a new job;
 * - with a state file of the same job: resumed (records collected into done,
 *   a torn last record cut); of another job: refused unless force;
 * - non-empty without a state file: refused, unless resume is set and every
 *   line is a complete result record for a request of this input (adopted);
 * - overwrite: truncated when a state file, or content that is all result
 *   records, proves it a flotilla output (or with force).
 * A new, adopted or forced job (re)writes the state file atomically before
 * the first record. The input is scanned too (fl_resume_scan_input) before
 * anything is changed. *out is positioned at the end (stdout for "-"). */
fl_status fl_resume_open_output(const fl_resume_job *job, fl_idset *done, fl_resume_info *info,
                                FILE **out);

/* Reads the input once (streaming): *n_total = requests (non-blank lines),
 * *n_todo = those whose key is not in done (done may be NULL), *n_matched
 * (may be NULL) = those whose key is. Two lines with the same custom_id are
 * FL_ERR_INVALID_ARG naming "path:L1 and path:L2". Lines that are not JSON
 * objects with a string custom_id are counted but not checked: they become
 * error records when the job reaches them. */
fl_status fl_resume_scan_input(const char *path, const fl_idset *done, long *n_total,
                               long *n_todo, long *n_matched);

#endif /* FL_RESUME_H */
