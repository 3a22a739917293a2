/*
 * gguf.h — GGUF v3 reader (llama.cpp's model file format).
 *
 * fl_ckpt_open() hands .gguf paths to fl_ckpt_open_gguf() (checkpoint_impl.h),
 * which maps the file, validates the header, metadata and tensor infos, maps
 * llama.cpp tensor names onto Hugging Face names, and fills the model config
 * from the metadata (general.architecture, <arch>.* keys).
 */
#ifndef FL_GGUF_H
#define FL_GGUF_H

#include "runtime/load/checkpoint.h"
#include "runtime/tok/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Opens a GGUF file for its metadata only (a vocabulary file such as
 * llama.cpp's ggml-vocab-*.gguf): header, metadata and tensor infos are
 * checked, the architecture is not, so any model family's vocabulary can be
 * passed to fl_gguf_tokenizer. Free with fl_ckpt_free. */
fl_status fl_gguf_open_vocab(const char *path, fl_ckpt **out);

/* Builds the tokenizer stored in a GGUF checkpoint's metadata
 * (tokenizer.ggml.*). FL_ERR_INVALID_ARG if ck is not a GGUF checkpoint. */
fl_status fl_gguf_tokenizer(const fl_ckpt *ck, fl_tokenizer **out);

#ifdef __cplusplus
}
#endif
#endif /* FL_GGUF_H */
