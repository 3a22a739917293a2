/*
 * tokenizer.h — BPE tokenizers compatible with Hugging Face `tokenizers`.
 *
 * Two families:
 *  - byte-level BPE (GPT-2, Llama-3, Qwen2, SmolLM2): optional NFC
 *    normalizer, Split (regex) / ByteLevel / Digits pre-tokenizers, merges;
 *  - SentencePiece-style BPE (Llama-2, Mistral, Mixtral): Prepend "▁" /
 *    Replace " " -> "▁" normalizers, merges or scores, ByteFallback <0xNN>
 *    tokens, Fuse / Strip decoders.
 * Added and special tokens written in the text are matched before the model
 * runs, with their lstrip / rstrip / single_word / normalized flags as in HF
 * (normalized=false ones in the raw text, normalized=true ones in the
 * normalized text).
 *
 * Sources: a tokenizer.json file, or the vocabulary stored in a GGUF file
 * (fl_tokenizer_init_from_vocab).
 *
 * Thread-safety: a built tokenizer is immutable; encode/decode may run
 * concurrently on one instance.
 */
#ifndef FL_TOKENIZER_H
#define FL_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fl_tokenizer fl_tokenizer;

/* Loads a Hugging Face tokenizer.json. Unsupported components give
 * FL_ERR_UNSUPPORTED naming the component type; bad JSON gives
 * FL_ERR_FORMAT naming the file. */
fl_status fl_tokenizer_load_json(const char *path, fl_tokenizer **out);

typedef enum fl_tok_kind {
    FL_TOK_BYTE_BPE = 0, /* GGUF tokenizer.ggml.model == "gpt2" */
    FL_TOK_SPM_BPE,      /* GGUF tokenizer.ggml.model == "llama" (scores, byte fallback) */
} fl_tok_kind;

/* A vocabulary as stored in GGUF metadata (tokenizer.ggml.*). Arrays are
 * borrowed for the duration of the call. */
typedef struct fl_tokenizer_spec {
    fl_tok_kind kind;
    const char *pre;              /* tokenizer.ggml.pre ("llama-bpe", "qwen2", "smollm",
                                     "gpt2", "default", ...); NULL = "default" */
    int n_vocab;
    const char *const *tokens;    /* [n_vocab] */
    const float *scores;          /* [n_vocab] or NULL */
    const int32_t *token_types;   /* [n_vocab] or NULL: 1 normal, 2 unknown, 3 control,
                                     4 user-defined, 5 unused, 6 byte */
    int n_merges;
    const char *const *merges;    /* [n_merges] "a b", or NULL */
    int32_t bos_id, eos_id, unk_id, pad_id; /* -1 when absent */
    bool add_bos;
} fl_tokenizer_spec;

fl_status fl_tokenizer_init_from_vocab(const fl_tokenizer_spec *spec, fl_tokenizer **out);
void fl_tokenizer_free(fl_tokenizer *tok);

/* Encodes `len` bytes of UTF-8 text. When parse_special is true, added /
 * special tokens written in the text (e.g. "<|im_start|>") become their ids;
 * otherwise they are tokenized as plain text. Never adds BOS/EOS itself:
 * callers prepend fl_tokenizer_bos() when fl_tokenizer_add_bos() says so.
 * *ids is malloc'd; the caller frees it. */
fl_status fl_tokenizer_encode(const fl_tokenizer *tok, const char *text, size_t len,
                              bool parse_special, int32_t **ids, size_t *n_ids);

/* Decodes ids to UTF-8 (malloc'd, NUL-terminated). skip_special drops
 * control/special tokens. Invalid ids give FL_ERR_INVALID_ARG. */
fl_status fl_tokenizer_decode(const fl_tokenizer *tok, const int32_t *ids, size_t n_ids,
                              bool skip_special, char **text);

int fl_tokenizer_n_vocab(const fl_tokenizer *tok);
/* Id of a token's exact string (added tokens included), or -1. */
int32_t fl_tokenizer_token_id(const fl_tokenizer *tok, const char *token);
/* Raw vocabulary string of an id (as stored, e.g. "Ġthe"), or NULL. */
const char *fl_tokenizer_token_str(const fl_tokenizer *tok, int32_t id);
int32_t fl_tokenizer_bos(const fl_tokenizer *tok); /* -1 when none */
int32_t fl_tokenizer_eos(const fl_tokenizer *tok); /* -1 when none */
bool fl_tokenizer_add_bos(const fl_tokenizer *tok);
bool fl_tokenizer_is_special(const fl_tokenizer *tok, int32_t id);

#ifdef __cplusplus
}
#endif
#endif /* FL_TOKENIZER_H */
