/*
 * tok_impl.h — internals of the tokenizer module (runtime/tok/tokenizer.c and
 * runtime/tok_*.c). Not a public header.
 *
 * A tokenizer is one id space (model vocabulary + added tokens), hash maps
 * from strings to ids and from id pairs to merge ranks, and three pipelines
 * described as small tagged arrays: normalizers (text -> text, applied to each
 * stretch of text between added tokens, as Hugging Face does), pre-tokenizers
 * (text -> words; run depth-first, so splitting steps never copy text) and
 * decoders (token strings -> text). Everything is immutable once built, so
 * encode/decode keep their scratch state in a per-call context.
 */
#ifndef FL_TOK_IMPL_H
#define FL_TOK_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "runtime/tok/tokenizer.h"

/* ---- hash maps (tok_util.c) ------------------------------------------- */

/* String -> id. Keys are not copied: they are the strings of the ids
 * (tok->str[id]), so the map is just a table of ids. */
typedef struct tok_strmap {
    int32_t *slots; /* [cap], -1 = empty */
    uint32_t cap;   /* power of two */
    uint32_t count;
} tok_strmap;

/* (left id, right id) -> (merge rank, merged id). */
typedef struct tok_pairmap {
    uint64_t *keys; /* [cap], UINT64_MAX = empty */
    int32_t *rank;  /* [cap] */
    int32_t *merged;/* [cap] */
    uint32_t cap;
    uint32_t count;
} tok_pairmap;

/* ---- pipeline descriptions ------------------------------------------- */

typedef enum norm_type {
    NORM_NFC, NORM_NFD, NORM_NFKC, NORM_NFKD,
    NORM_LOWERCASE, NORM_PREPEND, NORM_REPLACE, NORM_STRIP,
} norm_type;

typedef struct tok_norm {
    norm_type type;
    char *str;          /* Prepend text / Replace literal pattern (NULL when regex) */
    size_t str_len;
    pcre2_code *re;     /* Replace regex pattern */
    char *content;      /* Replace content */
    size_t content_len;
    bool left, right;   /* Strip */
} tok_norm;

typedef enum pt_type { PT_SPLIT, PT_DIGITS, PT_BYTELEVEL, PT_METASPACE } pt_type;

typedef enum split_behavior {
    SPLIT_REMOVED, SPLIT_ISOLATED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT, SPLIT_CONTIGUOUS,
} split_behavior;

typedef enum prepend_scheme { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER } prepend_scheme;

typedef struct tok_pretok {
    pt_type type;
    pcre2_code *re;            /* Split pattern, ByteLevel regex (use_regex) */
    split_behavior behavior;   /* Split */
    bool invert;               /* Split */
    bool individual_digits;    /* Digits */
    bool add_prefix_space;     /* ByteLevel */
    char repl[8];              /* Metaspace replacement (UTF-8) */
    size_t repl_len;
    prepend_scheme prepend;    /* Metaspace */
    bool split;                /* Metaspace */
} tok_pretok;

typedef enum dec_type {
    DEC_BYTELEVEL, DEC_REPLACE, DEC_BYTEFALLBACK, DEC_FUSE, DEC_STRIP, DEC_METASPACE,
} dec_type;

typedef struct tok_dec {
    dec_type type;
    char *pat;            /* Replace literal */
    size_t pat_len;
    char *content;        /* Replace content / Strip char (UTF-8) */
    size_t content_len;
    int start, stop;      /* Strip */
    char repl[8];         /* Metaspace */
    size_t repl_len;
    prepend_scheme prepend;
} tok_dec;

typedef struct tok_added {
    int32_t id;
    const char *content;  /* what is matched in the text, and what decode emits (HF
                             simple_id_to_token): the content, or its normalized form
                             for normalized tokens when there is a normalizer */
    size_t len;
    const char *text;     /* the content as written in tokenizer.json */
    size_t text_len;
    bool special, lstrip, rstrip, single_word, normalized;
} tok_added;

typedef enum model_type { MODEL_BPE, MODEL_SPM } model_type;

/* Per-id attribute bits. */
enum {
    ATTR_SPECIAL = 1,   /* declared special (fl_tokenizer_is_special) */
    ATTR_MODEL = 2,     /* in the model vocabulary (BPE may produce it) */
    ATTR_MERGEABLE = 4, /* SPM: may be the result of a merge (normal tokens) */
    ATTR_SKIP = 8,      /* dropped by decode(skip_special): HF drops an id when the
                           string it decodes from is a special token's content */
};

#define TOK_MAX_PRETOK 16
#define TOK_CP_TABLE 0x10000

struct fl_tokenizer {
    int n_vocab;
    char **str;          /* [n_vocab] NUL-terminated, NULL for holes */
    uint32_t *len;       /* [n_vocab] */
    uint8_t *attr;       /* [n_vocab] ATTR_* */
    float *scores;       /* [n_vocab] SPM only */
    tok_strmap model_map;/* model vocabulary only */
    tok_strmap all_map;  /* every id with a string (added tokens first) */
    int32_t *cp_id;      /* [TOK_CP_TABLE] model id of the one-character token for
                            code point cp, or -1: skips hashing in the BPE seed */
    tok_pairmap merges;

    model_type model;
    bool byte_fallback, fuse_unk, ignore_merges;
    int32_t unk_id;
    int32_t byte_ids[256];       /* ids of "<0xNN>" or -1 */

    tok_norm *norms;     int n_norms;
    tok_pretok *pretoks; int n_pretoks;
    tok_dec *decs;       int n_decs;

    tok_added *added;    int n_added;  /* sorted by first byte, then length descending */
    int added_first[257];              /* bucket [first byte] = added[added_first[b] .. added_first[b+1]) */
    bool has_normalized_added;         /* some added token has normalized=true */
    char **owned;        int n_owned;  /* added-token strings (normalized forms, copies) */
    const char **dec_str;              /* [n_vocab] or NULL: string decode uses for an id
                                          when it is not str[id] (NULL = str[id]) */
    uint32_t *dec_len;                 /* [n_vocab] with dec_str */

    int32_t bos, eos;
    bool add_bos;
};

/* ---- tok_util.c -------------------------------------------------------- */

uint64_t tok_hash(const char *s, size_t n);
fl_status tok_strmap_init(tok_strmap *m, uint32_t expected);
void tok_strmap_free(tok_strmap *m);
/* Inserts id (its key is tok->str[id]); an existing equal key keeps its id
 * unless `replace`. */
void tok_strmap_put(tok_strmap *m, const fl_tokenizer *tok, int32_t id, bool replace);
int32_t tok_strmap_get(const tok_strmap *m, const fl_tokenizer *tok, const char *s, size_t n);
fl_status tok_pairmap_init(tok_pairmap *m, uint32_t expected);
void tok_pairmap_free(tok_pairmap *m);
void tok_pairmap_put(tok_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged);
/* Returns false when the pair has no merge. */
bool tok_pairmap_get(const tok_pairmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *merged);

/* Length of the UTF-8 sequence starting with lead byte c (1 for bad bytes). */
static inline size_t tok_u8len(unsigned char c) {
    return c < 0x80 ? 1 : c < 0xC0 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : c < 0xF8 ? 4 : 1;
}
/* Decodes one code point of valid UTF-8 at s (n bytes left); sets *cl. */
int32_t tok_u8dec(const char *s, size_t n, size_t *cl);
/* Encodes cp, returns byte count (1..4). */
size_t tok_u8enc(int32_t cp, char *out);
/* Offset of the first byte that is not valid UTF-8 (strict: no overlongs,
 * surrogates or > U+10FFFF), or n when all is valid. */
size_t tok_u8check(const char *s, size_t n);
bool tok_is_ws(int32_t cp);      /* Unicode White_Space (Rust char::is_whitespace) */
bool tok_is_numeric(int32_t cp); /* Nd, Nl, No (Rust char::is_numeric) */

/* GPT-2 byte <-> printable character map (bytes_to_unicode): printable
 * Latin-1 bytes map to themselves, the 68 others to U+0100.. in order. */
static inline int32_t tok_bl_cp(unsigned b) {
    return b <= 32 ? 256 + (int32_t)b : (b >= 127 && b <= 160) ? 289 + (int32_t)(b - 127)
         : b == 173 ? 323 : (int32_t)b;
}
static inline int tok_bl_byte(int32_t cp) {
    if (cp < 0 || cp > 323) return -1;
    if (cp >= 256) return cp <= 288 ? cp - 256 : cp <= 322 ? cp - 289 + 127 : 173;
    return (cp <= 32 || (cp >= 127 && cp <= 160) || cp == 173) ? -1 : cp;
}

/* Growable byte buffer. */
typedef struct tok_buf { char *p; size_t n, cap; } tok_buf;
bool tok_buf_reserve(tok_buf *b, size_t extra);
bool tok_buf_put(tok_buf *b, const void *s, size_t n);
/* Appends s with invalid sequences replaced by U+FFFD, one per maximal
 * invalid subpart (what Rust's String::from_utf8_lossy does). */
bool tok_buf_lossy(tok_buf *b, const char *s, size_t n);

/* A normalizer or decoder chain may lengthen text by a small factor (NFKC,
 * "\u2581" for a space); steps that compound (Replace "a" -> "aaaa" eight
 * times) would take minutes and gigabytes on a short string, so a chain whose
 * output passes TOK_MAX_GROWTH times its input (plus a little) is refused:
 * FL_ERR_UNSUPPORTED naming `chain` and the sizes, or FL_OK. */
#define TOK_MAX_GROWTH 32
fl_status tok_check_growth(size_t in_n, size_t out_n, const char *chain);

fl_status tok_compile_regex(const char *pattern, size_t len, bool literal, const char *where,
                            pcre2_code **out);

/* ---- tok_json.c -------------------------------------------------------- */

fl_status tok_load_json(const char *path, fl_tokenizer *tok);

/* ---- tokenizer.c: shared by the two builders --------------------------- */

fl_status tok_alloc_ids(fl_tokenizer *tok, int n_vocab);
/* Sorts added tokens and builds the maps; call after str/attr are filled. */
fl_status tok_finish(fl_tokenizer *tok, const char *where);

/* ---- tok_gguf_pre.c --------------------------------------------------- */

/* Sets model, normalizers, pre-tokenizers and decoders for a GGUF-style
 * vocabulary from spec->kind and spec->pre (tokenizer.ggml.pre); an unknown
 * pre gives FL_ERR_UNSUPPORTED naming it and the known ones. */
fl_status tok_vocab_pipeline(fl_tokenizer *tok, const fl_tokenizer_spec *spec);

/* ---- tok_bpe.c --------------------------------------------------------- */

typedef struct tok_ids { int32_t *p; size_t n, cap; } tok_ids;
bool tok_ids_push(tok_ids *v, int32_t id);

typedef struct tok_bpe_scratch {
    struct tok_sym *syms; size_t syms_cap;
    struct tok_heap_ent *heap; size_t heap_cap;
} tok_bpe_scratch;
void tok_bpe_scratch_free(tok_bpe_scratch *s);

/* Encodes one pre-token (word) with the model and appends its ids. */
fl_status tok_model_encode(const fl_tokenizer *tok, tok_bpe_scratch *sc, const char *w, size_t n,
                           tok_ids *out);

/* ---- tok_pretok.c ------------------------------------------------------ */

/* Applies the normalizers to s; *out is malloc'd (NUL-terminated). */
fl_status tok_normalize(const fl_tokenizer *tok, const char *s, size_t n, char **out, size_t *out_n);

/* Per-call cache of word -> ids (words repeat a lot in long texts). Per
 * call, so the tokenizer stays immutable and thread-safe. */
typedef struct tok_wcache_slot {
    uint64_t h;
    uint32_t word_off, ids_off;
    uint16_t wlen, nids; /* wlen 0 = empty slot */
} tok_wcache_slot;

typedef struct tok_enc_ctx {
    const fl_tokenizer *tok;
    bool parse_special;
    pcre2_match_data *md;
    tok_buf tmp[TOK_MAX_PRETOK][2];
    struct tok_mark { size_t s, e; bool m; } *marks[TOK_MAX_PRETOK];
    size_t marks_cap[TOK_MAX_PRETOK];
    tok_bpe_scratch bpe;
    tok_ids out;
    tok_wcache_slot *wc;   /* NULL: no cache */
    uint32_t wc_cap, wc_count;
    tok_buf wc_words;
    tok_ids wc_ids;
} tok_enc_ctx;

/* Sets up the word cache for a text of len bytes (only used when there are
 * pre-tokenizers, i.e. words are short). */
void tok_enc_ctx_cache(tok_enc_ctx *c, size_t len);

/* Runs pre-tokenizers from `step` on s (at0: s starts at offset 0 of the
 * original text) and the model on each resulting word. */
fl_status tok_pretok_run(tok_enc_ctx *c, int step, const char *s, size_t n, bool at0);
void tok_enc_ctx_free(tok_enc_ctx *c);

#endif /* FL_TOK_IMPL_H */
