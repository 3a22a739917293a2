/*
 * safetensors.h — parser for one .safetensors file held in memory.
 *
 * Layout: u64 little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {...}}, then the data section; offsets are relative to
 * the start of the data section.
 *
 * The parser works on a byte buffer (the checkpoint loader passes an mmap'd
 * file, the fuzz target a fuzzer input) and validates everything before any
 * tensor is exposed: header length within the file, every offset pair in
 * range and consistent with dtype x shape. Afterwards tensor data pointers
 * can be read without further checks.
 */
#ifndef FL_SAFETENSORS_H
#define FL_SAFETENSORS_H

#include <stddef.h>

#include "runtime/load/checkpoint.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Parses the safetensors file `path` whose bytes are data[0..size). On
 * success *tensors is a malloc'd array of *n entries (unsorted) whose names
 * are malloc'd, whose data point into `data`, and whose `file` is `path`
 * (borrowed: it must outlive the entries). Release with
 * fl_safetensors_tensors_free. Errors name `path` and the tensor or key:
 * FL_ERR_FORMAT for malformed input, FL_ERR_UNSUPPORTED for dtypes other
 * than F32/F16/BF16/I32/I64 or more than FL_MAX_DIMS dims. */
fl_status fl_safetensors_parse(const char *path, const void *data, size_t size,
                               fl_ckpt_tensor **tensors, size_t *n);

/* Frees the names and the array; NULL is a no-op. */
void fl_safetensors_tensors_free(fl_ckpt_tensor *tensors, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* FL_SAFETENSORS_H */
