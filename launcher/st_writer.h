/*
 * st_writer.h — writes one safetensors file whose tensor list is known
 * before any data: add every tensor, begin (the header is written and every
 * offset fixed), then put each tensor's bytes in any order, then close
 * (which fails if a tensor was never put). Used by `flotilla quantize`,
 * which produces a layer's tensors long after the header.
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
/* Declares a tensor of dtype F32, F16, BF16, I32 or I64 (names unique). */
fl_status fl_stw_add(fl_stw *w, const char *name, fl_dtype dt, int ndim, const int64_t *shape);
/* Writes the header; no tensor may be added after it. */
fl_status fl_stw_begin(fl_stw *w);
/* Writes the bytes of a declared tensor (its full size). */
fl_status fl_stw_put(fl_stw *w, const char *name, const void *data);
/* Checks every tensor was written, closes the file and frees w (even on
 * failure). NULL is a no-op. */
fl_status fl_stw_close(fl_stw *w);

#endif /* FL_ST_WRITER_H */
