/*
 * batch_state.h — what a batch job needs to prove that an output file is
 * its own before it appends to it or cuts it (the pure half of resuming;
 * the files themselves are opened by launcher/resume.c):
 *
 * - a bounded line reader: no line, however the file was made (a device
 *   that never ends, a file without newlines), makes it hold more than
 *   `max` bytes;
 * - the scan of a results stream: every complete, valid result record is
 *   reported; a bad record is forgiven only as the last line (a kill
 *   mid-write), a bad record followed by more lines means the stream is not
 *   a results file;
 * - the job identity kept in the state file beside the output
 *   (`<output>.flotilla.json`): the input (path, size, FNV-1a 64 hash of its
 *   bytes), the model (path, bytes) and the options that change outputs.
 *
 * Everything here works on FILE* and memory, so the fuzz target and the
 * unit tests run it on fmemopen buffers. Re-entrant; no global state.
 */
#ifndef FL_BATCH_STATE_H
#define FL_BATCH_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The longest result line a resume scan accepts (64 MiB): far above any
 * real completion, small enough that a runaway file cannot exhaust memory. */
#define FL_BATCH_MAX_LINE ((size_t)64 << 20)

/* Reads the next line of f into *buf (grown as needed, *cap its size),
 * including its '\n' when there is one; *len = its length, 0 at end of file.
 * The text is NUL-terminated at (*buf)[*len] (it may also hold NUL bytes).
 * A line longer than max bytes is FL_ERR_FORMAT "name:line: ... longer than
 * max" (line_no names it); a read error is FL_ERR_IO. Never reads more than
 * max + 1 bytes of one line. */
fl_status fl_batch_read_line(FILE *f, const char *name, long line_no, size_t max, char **buf,
                             size_t *cap, size_t *len);

/* Called for each valid result record: custom_id (NULL for an error record
 * of an input line without a readable custom_id, then error_line names that
 * input line) and the record's line number in the results file. */
typedef fl_status (*fl_batch_record_fn)(void *ctx, const char *custom_id, long error_line,
                                        long out_line);

typedef struct fl_batch_scan {
    long n_lines;       /* lines read */
    long n_records;     /* valid, complete records (each reported once) */
    uint64_t good_end;  /* byte offset just after the last valid record */
    uint64_t size;      /* bytes read */
    long bad_line;      /* the last line when it is torn or not a record; 0: none */
} fl_batch_scan;

/* True when text[0..len) (one line, with or without its '\n') is a result
 * record flotilla writes: a JSON object with "custom_id" (a non-empty string,
 * or null with "error": {"line": N}) and either "text" + "finish_reason" or
 * "error": {"message"} (compact), or "response": {"status_code", "body"} whose
 * body has "choices" (200) or "error": {"message", "line"} (OpenAI Batch).
 * *custom_id (borrowed from *json, which the caller
 * deletes with cJSON_Delete) and *error_line describe it. */
bool fl_batch_record_parse(const char *text, size_t len, void **json, const char **custom_id,
                           long *error_line);

/* Reads f to its end (at most max_line bytes a line) and reports each
 * valid record through fn (may be NULL). A line that is not a valid
 * complete record is allowed only as the last one (out->bad_line); one
 * followed by more lines is FL_ERR_FORMAT naming "name:line". Writes
 * nothing. */
fl_status fl_batch_scan_results(FILE *f, const char *name, size_t max_line, fl_batch_record_fn fn,
                                void *ctx, fl_batch_scan *out);

/* ---- job identity ----------------------------------------------------------- */

/* FNV-1a 64 over n bytes, continuing from h (start with FL_BATCH_HASH_INIT). */
#define FL_BATCH_HASH_INIT 14695981039346656037ull
uint64_t fl_batch_hash(uint64_t h, const void *data, size_t n);

#define FL_BATCH_MAX_OPTS 16

typedef struct fl_batch_opt {
    char name[32];
    char value[64];
} fl_batch_opt;

typedef struct fl_batch_ident {
    char input[4096];        /* absolute path, or "-" (standard input: size and hash unknown) */
    uint64_t input_bytes;
    uint64_t input_hash;     /* fl_batch_hash of the input's bytes */
    char model[4096];        /* absolute path of the model folder or file */
    uint64_t model_bytes;    /* the file's size, or the sum of the folder's files */
    int n_opts;
    fl_batch_opt opts[FL_BATCH_MAX_OPTS]; /* output-changing options, canonical text */
} fl_batch_ident;

/* Adds (or replaces) option name = value. FL_ERR_INVALID_ARG when full or
 * too long. */
fl_status fl_batch_ident_set_opt(fl_batch_ident *id, const char *name, const char *value);

/* The state file's text (a JSON object with its '\n'), malloc'd. */
fl_status fl_batch_ident_format(const fl_batch_ident *id, char **out);

/* Parses a state file's text; FL_ERR_FORMAT naming name when it is not one. */
fl_status fl_batch_ident_parse(const char *text, size_t len, const char *name,
                               fl_batch_ident *id);

/* True when a and b are the same job; otherwise false and why[n] says the
 * first difference ("input hash 0123... vs 4567...", "option temperature 0 vs
 * 0.7"). */
bool fl_batch_ident_same(const fl_batch_ident *a, const fl_batch_ident *b, char *why, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* FL_BATCH_STATE_H */
