/*
 * fuzz_resume.c — libFuzzer target for the resume scan of `flotilla
 * generate` (runtime/engine/batch_state.c): the results file read back when
 * a job restarts, and the job state file beside it.
 *
 * Each input is read as a results stream through fmemopen, with a small line
 * bound so the too-long-line path is reached too. Checked on every input:
 * the scan never reads past its bound, every reported record is one the
 * record parser accepts, good_end <= size, a reported bad line is the last
 * line, and a clean scan (no bad line) reports exactly the lines it read.
 * The same bytes are also parsed as a state file; a state file that parses
 * must format and parse back to the same identity. Any status is fine; a
 * crash, a sanitizer report or a broken invariant (abort) is a bug.
 *
 * Built and run by scripts/fuzz.sh (CMake, -DFL_FUZZ=ON, clang); ctest
 * replays fuzz/corpus/resume and fuzz/regress/resume.
 * Run with the seeds:
 *   build-fuzz/fuzz_resume fuzz/corpus/resume -max_len=4096
 */
#define _GNU_SOURCE /* fmemopen */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/engine/batch_state.h"

/* Small enough that fuzzed inputs cross it. */
enum { MAX_LINE = 512 };

typedef struct check {
    long records;
} check;

static fl_status on_record(void *ctx, const char *custom_id, long error_line, long out_line) {
    check *c = ctx;
    /* a record has an id, or is an id-less error record naming its line */
    if (!custom_id && error_line <= 0) abort();
    if (custom_id && !custom_id[0]) abort();
    if (out_line <= 0) abort();
    c->records++;
    return FL_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0; /* fmemopen wants a non-empty buffer */
    FILE *f = fmemopen((void *)data, size, "r");
    if (!f) return 0;
    check c = {0};
    fl_batch_scan sc;
    fl_status st = fl_batch_scan_results(f, "fuzz", MAX_LINE, on_record, &c, &sc);
    fclose(f);
    if (st == FL_OK) {
        if (c.records != sc.n_records) abort();
        if (sc.good_end > sc.size || sc.size != size) abort();
        if (sc.bad_line && sc.bad_line != sc.n_lines) abort();
        if (!sc.bad_line && (sc.n_records != sc.n_lines || sc.good_end != sc.size)) abort();
    }

    /* the bounded reader alone: no line returned is longer than the bound */
    f = fmemopen((void *)data, size, "r");
    if (f) {
        char *buf = NULL;
        size_t cap = 0, len = 0, total = 0;
        for (long line = 1; fl_batch_read_line(f, "fuzz", line, MAX_LINE, &buf, &cap, &len) == FL_OK &&
                            len > 0; line++) {
            if (len > MAX_LINE || cap > MAX_LINE + 2 + 4096) abort();
            total += len;
        }
        if (total > size) abort();
        free(buf);
        fclose(f);
    }

    /* the same bytes as a job state file */
    fl_batch_ident a, b;
    if (fl_batch_ident_parse((const char *)data, size, "fuzz.flotilla.json", &a) == FL_OK) {
        char *text = NULL, why[512];
        if (fl_batch_ident_format(&a, &text) != FL_OK) abort();
        if (fl_batch_ident_parse(text, strlen(text), "again", &b) != FL_OK) abort();
        if (!fl_batch_ident_same(&a, &b, why, sizeof why)) abort();
        free(text);
    }
    return 0;
}
