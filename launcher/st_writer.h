/*
 * st_writer.h — writes one safetensors file whose tensor list is known
 * before any data: add every tensor, begin (the header is written and every
 * offset fixed), then put each tensor's bytes in any order, then close
 * (which fails if a tensor was never put). Used by `flotilla quantize`,
 * which produces a layer's tensors long after the header, and completes a
 * file an interrupted run left (fl_stw_reopen).
 */
#ifndef FL_ST_WRITER_H
#define FL_ST_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "core/tensor.h"

typedef struct fl_stw fl_stw;

/* Creates (truncates) path. */
fl_status fl_stw_open(const char *path, fl_stw **out);
/* Opens a file an earlier run with the same plan left unfinished, to
 * complete it: nothing is truncated, and fl_stw_begin checks the header
 * instead of writing it. */
fl_status fl_stw_reopen(const char *path, fl_stw **out);
/* Declares a tensor of dtype F32, F16, BF16, I32 or I64 (names unique). */
fl_status fl_stw_add(fl_stw *w, const char *name, fl_dtype dt, int ndim, const int64_t *shape);
/* Writes the header (reopened: FL_ERR_FORMAT unless the file's header is
 * byte for byte the planned one); no tensor may be added after it. */
fl_status fl_stw_begin(fl_stw *w);
/* Counts every tensor whose name starts with prefix as written: an earlier
 * run put its bytes (after begin, on a reopened file). */
fl_status fl_stw_have_prefix(fl_stw *w, const char *prefix);
/* Flushes what was put to the disk (fsync), so that a later run may rely
 * on it after a crash. */
fl_status fl_stw_sync(fl_stw *w);
/* Writes the bytes of a declared tensor (its full size). */
fl_status fl_stw_put(fl_stw *w, const char *name, const void *data);
/* Checks every tensor was written, closes the file and frees w (even on
 * failure). NULL is a no-op. */
fl_status fl_stw_close(fl_stw *w);

#endif /* FL_ST_WRITER_H */
