/*
 * resume.h — what makes a `flotilla generate` job restartable after a kill:
 *
 * - a string set (custom_id -> input line) used both for the ids already in
 *   the output file and for the duplicate check of the input;
 * - opening the output file for a job: the complete records already in it
 *   are collected as done, a torn last record (no '\n', or not valid JSON)
 *   left by a kill is cut off with ftruncate, and the file is positioned for
 *   appending;
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

/* Opens path for a job's results. With fresh, the file is truncated.
 * Otherwise every complete record in it is added to done (*n_done counts
 * them) and a torn final record is removed (*torn_bytes says how many bytes
 * were cut); a malformed record before the last one is FL_ERR_FORMAT naming
 * path:line (the file is not a flotilla output; nothing is changed). *out is
 * positioned at the end. */
fl_status fl_resume_open_output(const char *path, bool fresh, fl_idset *done, long *n_done,
                                long *torn_bytes, FILE **out);

/* Reads the input once (streaming): *n_total = requests (non-blank lines),
 * *n_todo = those whose key is not in done (done may be NULL). Two lines with
 * the same custom_id are FL_ERR_INVALID_ARG naming "path:L1 and path:L2".
 * Lines that are not JSON objects with a string custom_id are counted but
 * not checked: they become error records when the job reaches them. */
fl_status fl_resume_scan_input(const char *path, const fl_idset *done, long *n_total,
                               long *n_todo);

#endif /* FL_RESUME_H */
