/*
 * tokenizer.c — public API of the tokenizer: encode (added tokens, then
 * normalizers, pre-tokenizers and the BPE model), decode (decoder chain),
 * lookups, and building a tokenizer from a GGUF-style vocabulary.
 *
 * Encoding follows Hugging Face tokenizers (AddedVocabulary::
 * extract_and_normalize): added tokens whose `normalized` flag is false are
 * found in the raw text first (leftmost, then longest — Aho-Corasick
 * LeftmostLongest), each stretch of text between them is normalized, then
 * `normalized` added tokens are found in the normalized stretch, then the
 * remaining pieces are pre-tokenized and run through the model.
 *
 * parse_special=false is HF's `split_special_tokens=True`: special added
 * tokens are not matched (their text is tokenized as plain text), while
 * non-special added tokens are still matched — exactly what HF does for
 * them with add_special_tokens=False.
 */
#define _GNU_SOURCE /* memmem */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "runtime/tok/tok_impl.h"

/* ---- building ----------------------------------------------------------- */

fl_status tok_alloc_ids(fl_tokenizer *tok, int n_vocab) {
    tok->n_vocab = n_vocab;
    tok->str = calloc((size_t)n_vocab, sizeof *tok->str);
    tok->len = calloc((size_t)n_vocab, sizeof *tok->len);
    tok->attr = calloc((size_t)n_vocab, sizeof *tok->attr);
    if (!tok->str || !tok->len || !tok->attr)
        return FL_ERR(FL_ERR_OOM, "out of memory allocating a vocabulary of %d tokens", n_vocab);
    return FL_OK;
}

static int added_cmp(const void *pa, const void *pb) {
    const tok_added *a = pa, *b = pb;
    unsigned char fa = a->len ? (unsigned char)a->content[0] : 0;
    unsigned char fb = b->len ? (unsigned char)b->content[0] : 0;
    if (fa != fb) return fa < fb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

fl_status tok_finish(fl_tokenizer *tok, const char *where) {
    size_t n_model = 0;
    for (int i = 0; i < tok->n_vocab; i++)
        if (tok->attr[i] & ATTR_MODEL) n_model++;
    FL_TRY(tok_strmap_init(&tok->model_map, (uint32_t)n_model));
    FL_TRY(tok_strmap_init(&tok->all_map, (uint32_t)tok->n_vocab));
    for (int i = 0; i < tok->n_added; i++) {
        int32_t id = tok->added[i].id;
        if (tok->str[id]) tok_strmap_put(&tok->all_map, tok, id, false);
    }
    for (int i = 0; i < tok->n_vocab; i++) {
        if (!tok->str[i]) continue;
        if (tok->attr[i] & ATTR_MODEL) tok_strmap_put(&tok->model_map, tok, i, false);
        tok_strmap_put(&tok->all_map, tok, i, false);
    }
    tok->cp_id = malloc(TOK_CP_TABLE * sizeof *tok->cp_id);
    if (!tok->cp_id) return FL_ERR(FL_ERR_OOM, "out of memory building the tokenizer of %s", where);
    memset(tok->cp_id, 0xff, TOK_CP_TABLE * sizeof *tok->cp_id);
    for (int i = 0; i < tok->n_vocab; i++) {
        if (!tok->str[i] || !(tok->attr[i] & ATTR_MODEL) || tok->len[i] == 0) continue;
        size_t cl;
        int32_t cp = tok_u8dec(tok->str[i], tok->len[i], &cl);
        /* first id wins, like the string map */
        if (cl == tok->len[i] && cp < TOK_CP_TABLE && tok->cp_id[cp] < 0 &&
            tok_u8check(tok->str[i], tok->len[i]) == tok->len[i] &&
            tok_strmap_get(&tok->model_map, tok, tok->str[i], cl) == i)
            tok->cp_id[cp] = i;
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        tok->byte_ids[b] = tok_strmap_get(&tok->model_map, tok, name, 6);
    }
    /* Added tokens with empty content can never match; drop them from the
     * matcher (HF's trie would never report them either). */
    int k = 0;
    for (int i = 0; i < tok->n_added; i++)
        if (tok->added[i].len > 0) tok->added[k++] = tok->added[i];
    tok->n_added = k;
    qsort(tok->added, (size_t)tok->n_added, sizeof *tok->added, added_cmp);
    int j = 0;
    for (int b = 0; b <= 256; b++) {
        while (j < tok->n_added && (unsigned char)tok->added[j].content[0] < b) j++;
        tok->added_first[b] = j;
    }
    tok->added_first[256] = tok->n_added;
    return FL_OK;
}

void fl_tokenizer_free(fl_tokenizer *tok) {
    if (!tok) return;
    if (tok->str)
        for (int i = 0; i < tok->n_vocab; i++) free(tok->str[i]);
    free(tok->str);
    free(tok->len);
    free(tok->attr);
    free(tok->scores);
    tok_strmap_free(&tok->model_map);
    tok_strmap_free(&tok->all_map);
    free(tok->cp_id);
    tok_pairmap_free(&tok->merges);
    for (int i = 0; i < tok->n_norms; i++) {
        free(tok->norms[i].str);
        free(tok->norms[i].content);
        pcre2_code_free(tok->norms[i].re);
    }
    free(tok->norms);
    for (int i = 0; i < tok->n_pretoks; i++) pcre2_code_free(tok->pretoks[i].re);
    free(tok->pretoks);
    for (int i = 0; i < tok->n_decs; i++) {
        free(tok->decs[i].pat);
        free(tok->decs[i].content);
    }
    free(tok->decs);
    free(tok->added);
    for (int i = 0; i < tok->n_owned; i++) free(tok->owned[i]);
    free(tok->owned);
    free(tok->dec_str);
    free(tok->dec_len);
    free(tok);
}

fl_status fl_tokenizer_load_json(const char *path, fl_tokenizer **out) {
    if (!path || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_tokenizer_load_json: NULL argument");
    *out = NULL;
    fl_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", path);
    tok->unk_id = tok->bos = tok->eos = -1;
    fl_status st = tok_load_json(path, tok);
    if (st != FL_OK) {
        fl_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return FL_OK;
}

/* ---- GGUF-style vocabulary --------------------------------------------- */

fl_status fl_tokenizer_init_from_vocab(const fl_tokenizer_spec *spec, fl_tokenizer **out) {
    if (!spec || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_tokenizer_init_from_vocab: NULL argument");
    *out = NULL;
    if (spec->n_vocab <= 0 || !spec->tokens)
        return FL_ERR(FL_ERR_INVALID_ARG, "GGUF vocabulary is empty (tokenizer.ggml.tokens)");
    if (spec->kind != FL_TOK_BYTE_BPE && spec->kind != FL_TOK_SPM_BPE)
        return FL_ERR(FL_ERR_UNSUPPORTED, "GGUF tokenizer kind %d is not supported", (int)spec->kind);
    if (spec->n_merges < 0 || (spec->n_merges > 0 && !spec->merges))
        return FL_ERR(FL_ERR_INVALID_ARG, "GGUF merges: count %d without an array", spec->n_merges);
    if (spec->kind == FL_TOK_BYTE_BPE && spec->n_merges == 0)
        return FL_ERR(FL_ERR_FORMAT, "GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges");
    fl_status st = FL_OK;
    fl_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return FL_ERR(FL_ERR_OOM, "out of memory building a tokenizer");
    tok->unk_id = tok->bos = tok->eos = -1;
    int n = spec->n_vocab;
    FL_TRY_GOTO(tok_alloc_ids(tok, n), st, fail);
    tok->added = calloc((size_t)n, sizeof *tok->added);
    FL_CHECK_ALLOC(tok->added, st, fail);
    if (spec->kind == FL_TOK_SPM_BPE) {
        tok->scores = calloc((size_t)n, sizeof *tok->scores);
        FL_CHECK_ALLOC(tok->scores, st, fail);
    }
    for (int i = 0; i < n; i++) {
        const char *s = spec->tokens[i];
        if (!s) {
            st = FL_ERR(FL_ERR_FORMAT, "GGUF tokenizer.ggml.tokens[%d] is NULL", i);
            goto fail;
        }
        tok->str[i] = strdup(s);
        FL_CHECK_ALLOC(tok->str[i], st, fail);
        tok->len[i] = (uint32_t)strlen(s);
        int32_t type = spec->token_types ? spec->token_types[i] : 1;
        if (tok->scores && spec->scores) tok->scores[i] = spec->scores[i];
        tok->attr[i] = ATTR_MODEL;
        if (type == 1) tok->attr[i] |= ATTR_MERGEABLE;
        /* 2 unknown, 3 control: special, matched only with parse_special and
         * skipped by decode(skip_special); 4 user-defined: matched always
         * (llama.cpp's tokenizer_st_partition; HF added tokens agree). */
        /* A token that is not valid UTF-8 could match half a character of
         * the text and split it; such tokens are never matched as text. */
        bool valid = tok_u8check(s, tok->len[i]) == tok->len[i];
        if ((type == 2 || type == 3 || type == 4) && valid && tok->len[i] > 0) {
            tok_added *a = &tok->added[tok->n_added++];
            a->id = i;
            a->content = a->text = tok->str[i];
            a->len = a->text_len = tok->len[i];
            a->special = type != 4;
        }
        if (type == 2 || type == 3) tok->attr[i] |= ATTR_SPECIAL | ATTR_SKIP;
    }
    if (spec->n_merges > 0) {
        FL_TRY_GOTO(tok_pairmap_init(&tok->merges, (uint32_t)spec->n_merges), st, fail);
    }
    FL_TRY_GOTO(tok_finish(tok, "GGUF vocabulary"), st, fail);
    for (int i = 0; i < spec->n_merges; i++) {
        const char *m = spec->merges[i];
        const char *sp = m && m[0] ? strchr(m + 1, ' ') : NULL;
        if (!sp) {
            st = FL_ERR(FL_ERR_FORMAT, "GGUF tokenizer.ggml.merges[%d] \"%s\" is not \"left right\"", i,
                        m ? m : "(null)");
            goto fail;
        }
        int32_t a = tok_strmap_get(&tok->model_map, tok, m, (size_t)(sp - m));
        int32_t b = tok_strmap_get(&tok->model_map, tok, sp + 1, strlen(sp + 1));
        size_t la = (size_t)(sp - m), lb = strlen(sp + 1);
        char stackbuf[256];
        char *cat = la + lb < sizeof stackbuf ? stackbuf : malloc(la + lb + 1);
        FL_CHECK_ALLOC(cat, st, fail);
        memcpy(cat, m, la);
        memcpy(cat + la, sp + 1, lb);
        int32_t c = tok_strmap_get(&tok->model_map, tok, cat, la + lb);
        if (cat != stackbuf) free(cat);
        if (a < 0 || b < 0 || c < 0) {
            st = FL_ERR(FL_ERR_FORMAT, "GGUF tokenizer.ggml.merges[%d] \"%s\" uses a token missing from the vocabulary",
                        i, m);
            goto fail;
        }
        tok_pairmap_put(&tok->merges, a, b, i, c);
    }
    FL_TRY_GOTO(tok_vocab_pipeline(tok, spec), st, fail);
#define CHECK_ID(field, name)                                                              \
    if (spec->field >= n || spec->field < -1) {                                            \
        st = FL_ERR(FL_ERR_FORMAT, "GGUF " name " %d is outside the vocabulary (%d tokens)", \
                    (int)spec->field, n);                                                  \
        goto fail;                                                                         \
    }
    CHECK_ID(bos_id, "tokenizer.ggml.bos_token_id")
    CHECK_ID(eos_id, "tokenizer.ggml.eos_token_id")
    CHECK_ID(unk_id, "tokenizer.ggml.unknown_token_id")
    CHECK_ID(pad_id, "tokenizer.ggml.padding_token_id")
#undef CHECK_ID
    tok->bos = spec->bos_id;
    tok->eos = spec->eos_id;
    /* Byte-level BPE covers every byte, so its unk id is never emitted (HF
     * conversions set no unk_token); SPM falls back to it for missing bytes. */
    tok->unk_id = spec->kind == FL_TOK_SPM_BPE ? spec->unk_id : -1;
    tok->add_bos = spec->add_bos && spec->bos_id >= 0;
    *out = tok;
    return FL_OK;
fail:
    fl_tokenizer_free(tok);
    return st;
}

/* ---- encode ------------------------------------------------------------- */

/* HF single_word looks for a word character next to the match with Rust
 * regex's Unicode \w: Alphabetic, marks, decimal digits, connector
 * punctuation and the two join controls. Alphabetic is the letters, Nl and
 * Other_Alphabetic, whose members outside the marks are four blocks of
 * circled and squared Latin letters (So). Not \w: other numbers (No: ² ½ ③). */
static bool is_word_char(int32_t cp) {
    switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
        return true;
    default:
        return cp == 0x200C || cp == 0x200D || (cp >= 0x24B6 && cp <= 0x24E9) ||
               (cp >= 0x1F130 && cp <= 0x1F149) || (cp >= 0x1F150 && cp <= 0x1F169) ||
               (cp >= 0x1F170 && cp <= 0x1F189);
    }
}

/* Finds the leftmost-longest added token (of the given `normalized` class)
 * in s[from..n). */
static int find_added(const fl_tokenizer *tok, const char *s, size_t n, size_t from, bool normalized,
                      size_t *ms) {
    for (size_t i = from; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        for (int k = tok->added_first[b]; k < tok->added_first[b + 1]; k++) {
            const tok_added *a = &tok->added[k];
            if (a->normalized != normalized || a->len > n - i) continue;
            if (memcmp(s + i, a->content, a->len) == 0) {
                *ms = i;
                return k;
            }
        }
    }
    return -1;
}

typedef fl_status (*piece_fn)(tok_enc_ctx *c, const char *s, size_t n, bool at0);

/* HF AddedVocabulary::find_matches + split_with_indices. */
static fl_status split_added(tok_enc_ctx *c, const char *s, size_t n, bool at0, bool normalized,
                             bool parse_special, piece_fn fn) {
    const fl_tokenizer *tok = c->tok;
    size_t start_offset = 0, scan = 0, ms;
    int k;
    while (scan < n && (k = find_added(tok, s, n, scan, normalized, &ms)) >= 0) {
        const tok_added *a = &tok->added[k];
        size_t start = ms, stop = ms + a->len;
        scan = stop;
        if (a->special && !parse_special) continue;
        if (a->single_word) {
            bool start_space = true, stop_space = true;
            if (start > 0) {
                size_t p = start - 1, cl;
                while (p > 0 && ((unsigned char)s[p] & 0xc0) == 0x80) p--;
                start_space = !is_word_char(tok_u8dec(s + p, n - p, &cl));
            }
            if (stop < n) {
                size_t cl;
                stop_space = !is_word_char(tok_u8dec(s + stop, n - stop, &cl));
            }
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            size_t p = start;
            while (p > 0) {
                size_t q = p - 1, cl;
                while (q > 0 && ((unsigned char)s[q] & 0xc0) == 0x80) q--;
                if (!tok_is_ws(tok_u8dec(s + q, n - q, &cl))) break;
                p = q;
            }
            /* spaces an earlier token's rstrip took stay with it */
            start = p > start_offset ? p : start_offset;
            /* HF panics when that passes the match's end (a token made of
             * spaces inside an earlier rstrip); keep the split well-formed */
            if (start > stop) start = stop;
        }
        if (a->rstrip) {
            while (stop < n) {
                size_t cl;
                if (!tok_is_ws(tok_u8dec(s + stop, n - stop, &cl))) break;
                stop += cl;
            }
        }
        if (start_offset < start) FL_TRY(fn(c, s + start_offset, start - start_offset, at0 && start_offset == 0));
        if (!tok_ids_push(&c->out, a->id)) return FL_ERR(FL_ERR_OOM, "out of memory while tokenizing");
        /* as HF: a match inside an earlier token's rstrip moves the start of
         * the next stretch back to its own end */
        start_offset = stop;
    }
    if (start_offset < n) FL_TRY(fn(c, s + start_offset, n - start_offset, at0 && start_offset == 0));
    return FL_OK;
}

static fl_status pretok_piece(tok_enc_ctx *c, const char *s, size_t n, bool at0) {
    return tok_pretok_run(c, 0, s, n, at0);
}

static fl_status normalize_piece(tok_enc_ctx *c, const char *s, size_t n, bool at0) {
    const fl_tokenizer *tok = c->tok;
    if (tok->n_norms == 0 && !tok->has_normalized_added) return tok_pretok_run(c, 0, s, n, at0);
    char *ns = NULL;
    size_t nn = 0;
    FL_TRY(tok_normalize(tok, s, n, &ns, &nn));
    fl_status st;
    if (tok->has_normalized_added)
        st = split_added(c, ns, nn, at0, true, c->parse_special, pretok_piece);
    else
        st = tok_pretok_run(c, 0, ns, nn, at0);
    free(ns);
    return st;
}

fl_status fl_tokenizer_encode(const fl_tokenizer *tok, const char *text, size_t len, bool parse_special,
                              int32_t **ids, size_t *n_ids) {
    if (!tok || (!text && len > 0) || !ids || !n_ids)
        return FL_ERR(FL_ERR_INVALID_ARG, "fl_tokenizer_encode: NULL argument");
    *ids = NULL;
    *n_ids = 0;
    size_t bad = tok_u8check(text, len);
    if (bad != len)
        return FL_ERR(FL_ERR_INVALID_ARG, "text to encode is not valid UTF-8 (byte 0x%02x at offset %zu)",
                      (unsigned char)text[bad], bad);
    tok_enc_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    tok_enc_ctx *c = &ctx;
    c->tok = tok;
    c->parse_special = parse_special;
    fl_status st = FL_OK;
    c->md = pcre2_match_data_create(16, NULL);
    FL_CHECK_ALLOC(c->md, st, fail);
    tok_enc_ctx_cache(c, len);
    if (len > 0) FL_TRY_GOTO(split_added(c, text, len, true, false, parse_special, normalize_piece), st, fail);
    if (c->out.n == 0) {
        /* return a valid (empty) malloc'd array */
        *ids = malloc(sizeof(int32_t));
        FL_CHECK_ALLOC(*ids, st, fail);
    } else {
        *ids = c->out.p;
        c->out.p = NULL;
    }
    *n_ids = c->out.n;
fail:
    tok_enc_ctx_free(c);
    return st;
}

/* ---- decode ------------------------------------------------------------- */

/* A list of strings in one arena: string i is buf.p[off[i] .. off[i]+len[i]). */
typedef struct strv {
    tok_buf buf;
    size_t *off, *len;
    size_t n, cap;
} strv;

static void strv_free(strv *s) {
    free(s->buf.p);
    free(s->off);
    free(s->len);
    memset(s, 0, sizeof *s);
}

static bool strv_init(strv *s, size_t cap, size_t bytes) {
    memset(s, 0, sizeof *s);
    s->cap = cap + 1;
    s->off = malloc(s->cap * sizeof *s->off);
    s->len = malloc(s->cap * sizeof *s->len);
    return s->off && s->len && tok_buf_reserve(&s->buf, bytes);
}

/* Starts string n (appends to it with tok_buf_put on s->buf, then strv_end). */
static inline void strv_begin(strv *s) { s->off[s->n] = s->buf.n; }
static inline void strv_end(strv *s) {
    s->len[s->n] = s->buf.n - s->off[s->n];
    s->n++;
}
static inline const char *strv_at(const strv *s, size_t i) { return s->buf.p + s->off[i]; }

static fl_status dec_oom(void) { return FL_ERR(FL_ERR_OOM, "out of memory while decoding"); }

/* Appends s with every occurrence of pat replaced by rep. */
static bool replace_all(tok_buf *o, const char *s, size_t n, const char *pat, size_t pl, const char *rep,
                        size_t rl) {
    size_t i = 0;
    while (i < n) {
        const char *hit = pl ? memmem(s + i, n - i, pat, pl) : NULL;
        size_t end = hit ? (size_t)(hit - s) : n;
        if (!tok_buf_put(o, s + i, end - i)) return false;
        if (!hit) break;
        if (!tok_buf_put(o, rep, rl)) return false;
        i = end + pl;
    }
    return true;
}

static int byte_token(const char *s, size_t n) {
    /* "<0xNN>" with two hex digits (HF: u8::from_str_radix(&token[3..5], 16)) */
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int k = 3; k < 5; k++) {
        char c = s[k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Each decoder maps the list `in` to a new list `out` (HF decode_chain). */
static fl_status dec_apply(const tok_dec *d, const strv *in, strv *out) {
    /* k inputs never give more than k outputs (ByteFallback: k byte tokens
     * -> at most k U+FFFD), and at most 3 bytes per input byte. */
    if (!strv_init(out, in->n, in->buf.n + 16)) return dec_oom();
    switch (d->type) {
    case DEC_BYTELEVEL: {
        /* Tokens -> bytes (a token with a char outside the map keeps its own
         * bytes), then one lossy UTF-8 conversion of everything. */
        tok_buf raw = {0};
        if (!tok_buf_reserve(&raw, in->buf.n)) return dec_oom();
        for (size_t i = 0; i < in->n; i++) {
            const char *s = strv_at(in, i);
            size_t n = in->len[i], mark = raw.n;
            bool ok = true;
            for (size_t k = 0; k < n;) {
                size_t cl;
                int b = tok_bl_byte(tok_u8dec(s + k, n - k, &cl));
                if (b < 0) { ok = false; break; }
                raw.p[raw.n++] = (char)b; /* fits: one byte per char of >= 1 byte */
                k += cl;
            }
            if (!ok) {
                raw.n = mark;
                if (!tok_buf_put(&raw, s, n)) { free(raw.p); return dec_oom(); }
            }
        }
        strv_begin(out);
        bool ok = tok_buf_lossy(&out->buf, raw.p, raw.n);
        strv_end(out);
        free(raw.p);
        return ok ? FL_OK : dec_oom();
    }
    case DEC_REPLACE:
        for (size_t i = 0; i < in->n; i++) {
            strv_begin(out);
            if (!replace_all(&out->buf, strv_at(in, i), in->len[i], d->pat, d->pat_len, d->content, d->content_len))
                return dec_oom();
            strv_end(out);
        }
        return FL_OK;
    case DEC_BYTEFALLBACK: {
        tok_buf bytes = {0};
        fl_status st = FL_OK;
        for (size_t i = 0; i <= in->n && st == FL_OK; i++) {
            const char *s = i < in->n ? strv_at(in, i) : NULL;
            size_t n = i < in->n ? in->len[i] : 0;
            int hv = s ? byte_token(s, n) : -1;
            if (hv >= 0) {
                unsigned char ch = (unsigned char)hv;
                if (!tok_buf_put(&bytes, &ch, 1)) st = dec_oom();
                continue;
            }
            if (bytes.n > 0) {
                if (tok_u8check(bytes.p, bytes.n) == bytes.n) {
                    strv_begin(out);
                    if (!tok_buf_put(&out->buf, bytes.p, bytes.n)) st = dec_oom();
                    strv_end(out);
                } else {
                    /* invalid UTF-8: one U+FFFD per byte, as HF does */
                    for (size_t k = 0; k < bytes.n && st == FL_OK; k++) {
                        strv_begin(out);
                        if (!tok_buf_put(&out->buf, "\xef\xbf\xbd", 3)) st = dec_oom();
                        strv_end(out);
                    }
                }
                bytes.n = 0;
            }
            if (s && st == FL_OK) {
                strv_begin(out);
                if (!tok_buf_put(&out->buf, s, n)) st = dec_oom();
                strv_end(out);
            }
        }
        free(bytes.p);
        return st;
    }
    case DEC_FUSE:
        strv_begin(out);
        for (size_t i = 0; i < in->n; i++)
            if (!tok_buf_put(&out->buf, strv_at(in, i), in->len[i])) return dec_oom();
        strv_end(out);
        return FL_OK;
    case DEC_STRIP:
        for (size_t i = 0; i < in->n; i++) {
            const char *s = strv_at(in, i);
            size_t a = 0, b = in->len[i], cl = d->content_len;
            for (int k = 0; k < d->start && cl && b - a >= cl && memcmp(s + a, d->content, cl) == 0; k++) a += cl;
            for (int k = 0; k < d->stop && cl && b - a >= cl && memcmp(s + b - cl, d->content, cl) == 0; k++) b -= cl;
            strv_begin(out);
            if (!tok_buf_put(&out->buf, s + a, b - a)) return dec_oom();
            strv_end(out);
        }
        return FL_OK;
    case DEC_METASPACE:
        /* HF: the replacement becomes ' ', except in the first token (when
         * a prefix was prepended), where every replacement char is dropped. */
        for (size_t i = 0; i < in->n; i++) {
            const char *rep = (i == 0 && d->prepend != PREPEND_NEVER) ? "" : " ";
            strv_begin(out);
            if (!replace_all(&out->buf, strv_at(in, i), in->len[i], d->repl, d->repl_len, rep, strlen(rep)))
                return dec_oom();
            strv_end(out);
        }
        return FL_OK;
    }
    return FL_ERR(FL_ERR_INTERNAL, "unknown decoder %d", (int)d->type);
}

fl_status fl_tokenizer_decode(const fl_tokenizer *tok, const int32_t *ids, size_t n_ids, bool skip_special,
                              char **text) {
    if (!tok || (!ids && n_ids > 0) || !text) return FL_ERR(FL_ERR_INVALID_ARG, "fl_tokenizer_decode: NULL argument");
    *text = NULL;
    strv cur;
    fl_status st = FL_OK;
    size_t bytes = 0;
    for (size_t i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= tok->n_vocab || !tok->str[id])
            return FL_ERR(FL_ERR_INVALID_ARG, "decode: token id %d at position %zu is not in the vocabulary (%d ids)",
                          (int)id, i, tok->n_vocab);
        bytes += tok->dec_str && tok->dec_str[id] ? tok->dec_len[id] : tok->len[id];
    }
    if (!strv_init(&cur, n_ids, bytes + 16)) {
        strv_free(&cur);
        return dec_oom();
    }
    for (size_t i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (skip_special && (tok->attr[id] & ATTR_SKIP)) continue;
        bool alt = tok->dec_str && tok->dec_str[id];
        strv_begin(&cur);
        if (!tok_buf_put(&cur.buf, alt ? tok->dec_str[id] : tok->str[id], alt ? tok->dec_len[id] : tok->len[id])) {
            st = dec_oom();
            goto fail;
        }
        strv_end(&cur);
    }
    for (int d = 0; d < tok->n_decs; d++) {
        strv nx;
        st = dec_apply(&tok->decs[d], &cur, &nx);
        strv_free(&cur);
        cur = nx;
        if (st != FL_OK) goto fail;
        st = tok_check_growth(bytes, cur.buf.n, "decoder");
        if (st != FL_OK) goto fail;
    }
    tok_buf res = {0};
    bool ok = tok_buf_reserve(&res, cur.buf.n + cur.n);
    for (size_t i = 0; ok && i < cur.n; i++) {
        /* No decoder: HF joins tokens with spaces; with decoders, with "". */
        if (tok->n_decs == 0 && i > 0) ok = tok_buf_put(&res, " ", 1);
        if (ok) ok = tok_buf_put(&res, strv_at(&cur, i), cur.len[i]);
    }
    if (!ok) {
        free(res.p);
        st = dec_oom();
        goto fail;
    }
    *text = res.p;
fail:
    strv_free(&cur);
    return st;
}

/* ---- lookups ------------------------------------------------------------ */

int fl_tokenizer_n_vocab(const fl_tokenizer *tok) { return tok ? tok->n_vocab : 0; }

int32_t fl_tokenizer_token_id(const fl_tokenizer *tok, const char *token) {
    if (!tok || !token) return -1;
    return tok_strmap_get(&tok->all_map, tok, token, strlen(token));
}

const char *fl_tokenizer_token_str(const fl_tokenizer *tok, int32_t id) {
    if (!tok || id < 0 || id >= tok->n_vocab) return NULL;
    return tok->str[id];
}

int32_t fl_tokenizer_bos(const fl_tokenizer *tok) { return tok ? tok->bos : -1; }
int32_t fl_tokenizer_eos(const fl_tokenizer *tok) { return tok ? tok->eos : -1; }
bool fl_tokenizer_add_bos(const fl_tokenizer *tok) { return tok && tok->add_bos; }

bool fl_tokenizer_is_special(const fl_tokenizer *tok, int32_t id) {
    return tok && id >= 0 && id < tok->n_vocab && (tok->attr[id] & ATTR_SPECIAL);
}
