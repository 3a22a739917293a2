/*
 * tok_json.c — reads a Hugging Face tokenizer.json into an fl_tokenizer.
 *
 * Supported components (anything else is FL_ERR_UNSUPPORTED naming it):
 *   model          BPE (vocab, merges as "a b" strings or [a, b] arrays,
 *                  unk_token, fuse_unk, byte_fallback, ignore_merges)
 *   normalizer     NFC NFD NFKC NFKD Lowercase Prepend Replace Strip Sequence
 *   pre_tokenizer  Split ByteLevel Digits Metaspace Sequence
 *   decoder        ByteLevel Replace ByteFallback Fuse Strip Metaspace Sequence
 *   post_processor TemplateProcessing RobertaProcessing BertProcessing
 *                  ByteLevel Sequence — read only to learn the BOS token and
 *                  whether it is prepended (fl_tokenizer_add_bos); encode
 *                  itself never adds it.
 * EOS is not in tokenizer.json: it is taken from tokenizer_config.json next
 * to the file when present ("eos_token"), else from well-known names.
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "runtime/load/json_file.h"
#include "runtime/tok/tok_impl.h"

typedef struct jctx {
    const char *path;
    fl_tokenizer *tok;
} jctx;

static bool jbool(const cJSON *o, const char *key, bool dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsBool(v)) return cJSON_IsTrue(v);
    return dflt;
}

static const char *jstr(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static const char *jtype(const cJSON *o) {
    const char *t = jstr(o, "type");
    return t ? t : "(no type)";
}

static fl_status read_file(const char *path, char **out, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return FL_ERR(FL_ERR_IO, "cannot open tokenizer file %s", path);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    /* a regular file's size is known: one buffer of that size (plus the
     * read-ahead margin) instead of 1 MiB for every small file */
    struct stat st;
    size_t first = 1 << 20;
    if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size < first)
        first = (size_t)st.st_size + 65536;
    for (;;) {
        if (len + 65536 > cap) {
            cap = cap ? cap * 2 : first;
            char *p = realloc(buf, cap + 1);
            if (!p) {
                free(buf);
                fclose(f);
                return FL_ERR(FL_ERR_OOM, "out of memory reading %s", path);
            }
            buf = p;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    bool err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return FL_ERR(FL_ERR_IO, "read error on tokenizer file %s", path);
    }
    buf[len] = 0;
    *out = buf;
    *n = len;
    return FL_OK;
}

/* {"String": "..."} or {"Regex": "..."}: literal sets *literal. */
static fl_status pattern_of(const jctx *j, const cJSON *o, const char *what, const char **pat, bool *literal) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "pattern");
    const char *s;
    if ((s = jstr(p, "String")) != NULL) {
        *pat = s;
        *literal = true;
        return FL_OK;
    }
    if ((s = jstr(p, "Regex")) != NULL) {
        *pat = s;
        *literal = false;
        return FL_OK;
    }
    return FL_ERR(FL_ERR_FORMAT, "%s: %s has no pattern {\"String\"|\"Regex\": ...}", j->path, what);
}

/* Copies a string used to rewrite text (Prepend, Replace, Strip): it must be
 * valid UTF-8, since the matchers run with UTF checks off. */
static fl_status dup_str(const jctx *j, const char *s, char **out, size_t *n) {
    if (s && tok_u8check(s, strlen(s)) != strlen(s))
        return FL_ERR(FL_ERR_FORMAT, "%s: a normalizer/decoder string is not valid UTF-8", j->path);
    *out = strdup(s ? s : "");
    if (!*out) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
    if (n) *n = strlen(*out);
    return FL_OK;
}

/* ---- normalizers -------------------------------------------------------- */

static fl_status add_norm(const jctx *j, tok_norm **out) {
    fl_tokenizer *tok = j->tok;
    tok_norm *p = realloc(tok->norms, (size_t)(tok->n_norms + 1) * sizeof *p);
    if (!p) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
    tok->norms = p;
    *out = &p[tok->n_norms++];
    memset(*out, 0, sizeof **out);
    return FL_OK;
}

static fl_status parse_normalizer(const jctx *j, const cJSON *o, int depth) {
    if (o == NULL || cJSON_IsNull(o)) return FL_OK;
    if (!cJSON_IsObject(o) || depth > 8) return FL_ERR(FL_ERR_FORMAT, "%s: \"normalizer\" is not an object", j->path);
    const char *t = jtype(o);
    tok_norm *nm = NULL;
    if (strcmp(t, "Sequence") == 0) {
        const cJSON *arr = cJSON_GetObjectItemCaseSensitive(o, "normalizers"), *e;
        if (!cJSON_IsArray(arr)) return FL_ERR(FL_ERR_FORMAT, "%s: normalizer Sequence without \"normalizers\"", j->path);
        cJSON_ArrayForEach(e, arr) FL_TRY(parse_normalizer(j, e, depth + 1));
        return FL_OK;
    }
    static const struct { const char *name; norm_type type; } simple[] = {
        {"NFC", NORM_NFC}, {"NFD", NORM_NFD}, {"NFKC", NORM_NFKC}, {"NFKD", NORM_NFKD}, {"Lowercase", NORM_LOWERCASE},
    };
    for (size_t i = 0; i < sizeof simple / sizeof *simple; i++) {
        if (strcmp(t, simple[i].name) == 0) {
            FL_TRY(add_norm(j, &nm));
            nm->type = simple[i].type;
            return FL_OK;
        }
    }
    if (strcmp(t, "Prepend") == 0) {
        FL_TRY(add_norm(j, &nm));
        nm->type = NORM_PREPEND;
        return dup_str(j, jstr(o, "prepend"), &nm->str, &nm->str_len);
    }
    if (strcmp(t, "Strip") == 0) {
        FL_TRY(add_norm(j, &nm));
        nm->type = NORM_STRIP;
        nm->left = jbool(o, "strip_left", true);
        nm->right = jbool(o, "strip_right", true);
        return FL_OK;
    }
    if (strcmp(t, "Replace") == 0) {
        const char *pat;
        bool literal;
        FL_TRY(pattern_of(j, o, "normalizer Replace", &pat, &literal));
        FL_TRY(add_norm(j, &nm));
        nm->type = NORM_REPLACE;
        FL_TRY(dup_str(j, jstr(o, "content"), &nm->content, &nm->content_len));
        if (literal) return dup_str(j, pat, &nm->str, &nm->str_len);
        return tok_compile_regex(pat, strlen(pat), false, j->path, &nm->re);
    }
    return FL_ERR(FL_ERR_UNSUPPORTED, "%s: normalizer type \"%s\" is not supported", j->path, t);
}

/* ---- pre-tokenizers ----------------------------------------------------- */

static fl_status add_pretok(const jctx *j, tok_pretok **out) {
    fl_tokenizer *tok = j->tok;
    if (tok->n_pretoks >= TOK_MAX_PRETOK)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizers", j->path, TOK_MAX_PRETOK);
    tok_pretok *p = realloc(tok->pretoks, (size_t)(tok->n_pretoks + 1) * sizeof *p);
    if (!p) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
    tok->pretoks = p;
    *out = &p[tok->n_pretoks++];
    memset(*out, 0, sizeof **out);
    return FL_OK;
}

/* ByteLevel and Metaspace rewrite the text they split (up to 2 and 3 bytes a
 * byte); a second one would rewrite its own output, doubling the text each
 * time, which no real tokenizer does, so a chain takes each at most once. */
static fl_status add_pretok_once(const jctx *j, pt_type type, const char *name, tok_pretok **out) {
    for (int i = 0; i < j->tok->n_pretoks; i++)
        if (j->tok->pretoks[i].type == type)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: pre_tokenizer has more than one %s step", j->path, name);
    return add_pretok(j, out);
}

static fl_status parse_prepend_scheme(const jctx *j, const cJSON *o, prepend_scheme *ps) {
    const char *s = jstr(o, "prepend_scheme");
    if (!s) {
        /* older files: add_prefix_space */
        *ps = jbool(o, "add_prefix_space", true) ? PREPEND_ALWAYS : PREPEND_NEVER;
        return FL_OK;
    }
    if (strcmp(s, "always") == 0) *ps = PREPEND_ALWAYS;
    else if (strcmp(s, "first") == 0) *ps = PREPEND_FIRST;
    else if (strcmp(s, "never") == 0) *ps = PREPEND_NEVER;
    else return FL_ERR(FL_ERR_UNSUPPORTED, "%s: Metaspace prepend_scheme \"%s\" is not supported", j->path, s);
    return FL_OK;
}

static fl_status parse_replacement(const jctx *j, const cJSON *o, char *repl, size_t *len) {
    const char *r = jstr(o, "replacement");
    if (!r) r = "\xe2\x96\x81";
    size_t n = strlen(r);
    if (n == 0 || n > 4 || tok_u8len((unsigned char)r[0]) != n || tok_u8check(r, n) != n)
        return FL_ERR(FL_ERR_FORMAT, "%s: Metaspace replacement \"%s\" is not one character", j->path, r);
    memcpy(repl, r, n);
    repl[n] = 0;
    *len = n;
    return FL_OK;
}

#define GPT2_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

static fl_status parse_pretok(const jctx *j, const cJSON *o, int depth) {
    if (o == NULL || cJSON_IsNull(o)) return FL_OK;
    if (!cJSON_IsObject(o) || depth > 8) return FL_ERR(FL_ERR_FORMAT, "%s: \"pre_tokenizer\" is not an object", j->path);
    const char *t = jtype(o);
    tok_pretok *p;
    if (strcmp(t, "Sequence") == 0) {
        const cJSON *arr = cJSON_GetObjectItemCaseSensitive(o, "pretokenizers"), *e;
        if (!cJSON_IsArray(arr)) return FL_ERR(FL_ERR_FORMAT, "%s: pre_tokenizer Sequence without \"pretokenizers\"", j->path);
        cJSON_ArrayForEach(e, arr) FL_TRY(parse_pretok(j, e, depth + 1));
        return FL_OK;
    }
    if (strcmp(t, "Split") == 0) {
        const char *pat;
        bool literal;
        FL_TRY(pattern_of(j, o, "pre_tokenizer Split", &pat, &literal));
        const char *b = jstr(o, "behavior");
        static const struct { const char *name; split_behavior b; } names[] = {
            {"Removed", SPLIT_REMOVED}, {"Isolated", SPLIT_ISOLATED}, {"MergedWithPrevious", SPLIT_MERGED_PREV},
            {"MergedWithNext", SPLIT_MERGED_NEXT}, {"Contiguous", SPLIT_CONTIGUOUS},
        };
        int found = -1;
        for (int i = 0; b && i < 5; i++)
            if (strcmp(b, names[i].name) == 0) found = i;
        if (found < 0)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: Split behavior \"%s\" is not supported", j->path, b ? b : "(none)");
        FL_TRY(add_pretok(j, &p));
        p->type = PT_SPLIT;
        p->behavior = names[found].b;
        p->invert = jbool(o, "invert", false);
        return tok_compile_regex(pat, strlen(pat), literal, j->path, &p->re);
    }
    if (strcmp(t, "ByteLevel") == 0) {
        FL_TRY(add_pretok_once(j, PT_BYTELEVEL, "ByteLevel", &p));
        p->type = PT_BYTELEVEL;
        p->add_prefix_space = jbool(o, "add_prefix_space", true);
        if (jbool(o, "use_regex", true)) return tok_compile_regex(GPT2_RE, strlen(GPT2_RE), false, j->path, &p->re);
        return FL_OK;
    }
    if (strcmp(t, "Digits") == 0) {
        FL_TRY(add_pretok(j, &p));
        p->type = PT_DIGITS;
        p->individual_digits = jbool(o, "individual_digits", false);
        return FL_OK;
    }
    if (strcmp(t, "Metaspace") == 0) {
        FL_TRY(add_pretok_once(j, PT_METASPACE, "Metaspace", &p));
        p->type = PT_METASPACE;
        FL_TRY(parse_replacement(j, o, p->repl, &p->repl_len));
        p->split = jbool(o, "split", true);
        return parse_prepend_scheme(j, o, &p->prepend);
    }
    return FL_ERR(FL_ERR_UNSUPPORTED, "%s: pre_tokenizer type \"%s\" is not supported", j->path, t);
}

/* ---- decoders ----------------------------------------------------------- */

static fl_status add_dec(const jctx *j, tok_dec **out) {
    fl_tokenizer *tok = j->tok;
    tok_dec *p = realloc(tok->decs, (size_t)(tok->n_decs + 1) * sizeof *p);
    if (!p) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
    tok->decs = p;
    *out = &p[tok->n_decs++];
    memset(*out, 0, sizeof **out);
    return FL_OK;
}

static fl_status parse_decoder(const jctx *j, const cJSON *o, int depth) {
    if (o == NULL || cJSON_IsNull(o)) return FL_OK;
    if (!cJSON_IsObject(o) || depth > 8) return FL_ERR(FL_ERR_FORMAT, "%s: \"decoder\" is not an object", j->path);
    const char *t = jtype(o);
    tok_dec *d = NULL;
    if (strcmp(t, "Sequence") == 0) {
        const cJSON *arr = cJSON_GetObjectItemCaseSensitive(o, "decoders"), *e;
        if (!cJSON_IsArray(arr)) return FL_ERR(FL_ERR_FORMAT, "%s: decoder Sequence without \"decoders\"", j->path);
        cJSON_ArrayForEach(e, arr) FL_TRY(parse_decoder(j, e, depth + 1));
        return FL_OK;
    }
    if (strcmp(t, "ByteLevel") == 0 || strcmp(t, "ByteFallback") == 0 || strcmp(t, "Fuse") == 0) {
        FL_TRY(add_dec(j, &d));
        d->type = t[4] == 'L' ? DEC_BYTELEVEL : t[0] == 'F' ? DEC_FUSE : DEC_BYTEFALLBACK;
        return FL_OK;
    }
    if (strcmp(t, "Replace") == 0) {
        const char *pat;
        bool literal;
        FL_TRY(pattern_of(j, o, "decoder Replace", &pat, &literal));
        if (!literal) return FL_ERR(FL_ERR_UNSUPPORTED, "%s: decoder Replace with a Regex pattern is not supported", j->path);
        FL_TRY(add_dec(j, &d));
        d->type = DEC_REPLACE;
        FL_TRY(dup_str(j, pat, &d->pat, &d->pat_len));
        return dup_str(j, jstr(o, "content"), &d->content, &d->content_len);
    }
    if (strcmp(t, "Strip") == 0) {
        FL_TRY(add_dec(j, &d));
        d->type = DEC_STRIP;
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "start"), *sp = cJSON_GetObjectItemCaseSensitive(o, "stop");
        d->start = cJSON_IsNumber(st) ? st->valueint : 0;
        d->stop = cJSON_IsNumber(sp) ? sp->valueint : 0;
        if (d->start < 0 || d->stop < 0) return FL_ERR(FL_ERR_FORMAT, "%s: decoder Strip with negative counts", j->path);
        return dup_str(j, jstr(o, "content"), &d->content, &d->content_len);
    }
    if (strcmp(t, "Metaspace") == 0) {
        FL_TRY(add_dec(j, &d));
        d->type = DEC_METASPACE;
        FL_TRY(parse_replacement(j, o, d->repl, &d->repl_len));
        return parse_prepend_scheme(j, o, &d->prepend);
    }
    return FL_ERR(FL_ERR_UNSUPPORTED, "%s: decoder type \"%s\" is not supported", j->path, t);
}

/* ---- post-processor: BOS ------------------------------------------------ */

static int32_t special_id(const jctx *j, const cJSON *specials, const char *name) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(specials, name);
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(e, "ids");
    long long v;
    if (cJSON_IsArray(ids) && cJSON_GetArraySize(ids) == 1 &&
        fl_json_int(cJSON_GetArrayItem(ids, 0), -1, INT32_MAX, &v))
        return (int32_t)v;
    return fl_tokenizer_token_id(j->tok, name);
}

static fl_status parse_post(const jctx *j, const cJSON *o, int depth) {
    if (o == NULL || cJSON_IsNull(o) || depth > 8) return FL_OK;
    const char *t = jtype(o);
    fl_tokenizer *tok = j->tok;
    if (strcmp(t, "Sequence") == 0) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(o, "processors")) FL_TRY(parse_post(j, e, depth + 1));
        return FL_OK;
    }
    if (strcmp(t, "TemplateProcessing") == 0) {
        const cJSON *single = cJSON_GetObjectItemCaseSensitive(o, "single");
        const cJSON *first = cJSON_IsArray(single) ? cJSON_GetArrayItem(single, 0) : NULL;
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(first, "SpecialToken");
        const char *name = jstr(sp, "id");
        if (name) {
            int32_t id = special_id(j, cJSON_GetObjectItemCaseSensitive(o, "special_tokens"), name);
            if (id < 0 || id >= tok->n_vocab)
                return FL_ERR(FL_ERR_FORMAT, "%s: post_processor special token \"%s\" has no id", j->path, name);
            tok->bos = id;
            tok->add_bos = true;
        }
        return FL_OK;
    }
    if (strcmp(t, "RobertaProcessing") == 0 || strcmp(t, "BertProcessing") == 0) {
        const cJSON *cls = cJSON_GetObjectItemCaseSensitive(o, "cls");
        const cJSON *id = cJSON_IsArray(cls) ? cJSON_GetArrayItem(cls, 1) : NULL;
        long long v;
        if (fl_json_int(id, 0, tok->n_vocab - 1, &v)) {
            tok->bos = (int32_t)v;
            tok->add_bos = true;
        }
        return FL_OK;
    }
    if (strcmp(t, "ByteLevel") == 0) return FL_OK;
    return FL_ERR(FL_ERR_UNSUPPORTED, "%s: post_processor type \"%s\" is not supported", j->path, t);
}

/* BOS/EOS names from tokenizer_config.json beside the file, if any. */
static void config_token(const char *path, const char *key, char *out, size_t cap) {
    out[0] = 0;
    const char *slash = strrchr(path, '/');
    size_t dl = slash ? (size_t)(slash - path + 1) : 0;
    char *cfg = malloc(dl + 32);
    if (!cfg) return;
    memcpy(cfg, path, dl);
    strcpy(cfg + dl, "tokenizer_config.json");
    char *buf = NULL;
    size_t n = 0;
    FILE *f = fopen(cfg, "rb");
    if (f) {
        fclose(f);
        if (read_file(cfg, &buf, &n) != FL_OK) fl_error_clear();
    }
    free(cfg);
    if (!buf) return;
    cJSON *root = cJSON_ParseWithLength(buf, n);
    free(buf);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    const char *s = cJSON_IsString(v) ? v->valuestring : jstr(v, "content");
    if (s && strlen(s) < cap) strcpy(out, s);
    cJSON_Delete(root);
}

/* ---- model and added tokens -------------------------------------------- */

/* Keeps s (n bytes) for the tokenizer's lifetime. */
static fl_status own_str(const jctx *j, const char *s, size_t n, const char **out) {
    char *c = malloc(n + 1);
    if (!c) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
    memcpy(c, s, n);
    c[n] = 0;
    j->tok->owned[j->tok->n_owned++] = c;
    *out = c;
    return FL_OK;
}

static fl_status parse_added(const jctx *j, const cJSON *arr, int n_vocab) {
    fl_tokenizer *tok = j->tok;
    int n = cJSON_GetArraySize(arr);
    tok->added = calloc((size_t)n + 1, sizeof *tok->added);
    tok->owned = calloc(2 * (size_t)n + 1, sizeof *tok->owned);
    if (!tok->added || !tok->owned) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) {
        const cJSON *idv = cJSON_GetObjectItemCaseSensitive(e, "id");
        const char *content = jstr(e, "content");
        long long idl;
        if (!content || !fl_json_int(idv, 0, n_vocab - 1, &idl))
            return FL_ERR(FL_ERR_FORMAT, "%s: added_tokens entry without a valid id/content", j->path);
        int32_t id = (int32_t)idl;
        size_t clen = strlen(content);
        if (tok_u8check(content, clen) != clen)
            return FL_ERR(FL_ERR_FORMAT, "%s: added token %d is not valid UTF-8", j->path, id);
        if (!tok->str[id]) { /* not a model-vocabulary id: its string is the content (HF id_to_token) */
            tok->str[id] = strdup(content);
            if (!tok->str[id]) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
            tok->len[id] = (uint32_t)clen;
        }
        tok_added *a = &tok->added[tok->n_added++];
        a->id = id;
        a->special = jbool(e, "special", false);
        a->lstrip = jbool(e, "lstrip", false);
        a->rstrip = jbool(e, "rstrip", false);
        a->single_word = jbool(e, "single_word", false);
        a->normalized = jbool(e, "normalized", !a->special);
        if (a->special) tok->attr[id] |= ATTR_SPECIAL;
        /* normalized tokens are looked for in normalized text (in a second
         * pass, also without a normalizer: the pass order decides overlaps) */
        if (a->normalized) tok->has_normalized_added = true;
        if (tok->len[id] == clen && memcmp(tok->str[id], content, clen) == 0) {
            a->text = tok->str[id];
        } else {
            FL_TRY(own_str(j, content, clen, &a->text));
        }
        a->text_len = clen;
        a->content = a->text;
        a->len = clen;
        if (a->normalized && tok->n_norms > 0) {
            /* HF matches normalized added tokens by their normalized form,
             * and decodes them from it */
            char *nc;
            size_t nn;
            FL_TRY(tok_normalize(tok, content, clen, &nc, &nn));
            tok->owned[tok->n_owned++] = nc;
            a->content = nc;
            a->len = nn;
        }
        if (a->len != tok->len[id] || memcmp(a->content, tok->str[id], a->len) != 0) {
            if (!tok->dec_str) {
                tok->dec_str = calloc((size_t)n_vocab, sizeof *tok->dec_str);
                tok->dec_len = calloc((size_t)n_vocab, sizeof *tok->dec_len);
                if (!tok->dec_str || !tok->dec_len) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
            }
            tok->dec_str[id] = a->content;
            tok->dec_len[id] = (uint32_t)a->len;
        } else if (tok->dec_str) {
            tok->dec_str[id] = NULL; /* a later entry for the same id wins */
        }
    }
    return FL_OK;
}

/* decode(skip_special) drops an id when the string it decodes from is the
 * content of a special token (HF Tokenizer::decode): the special tokens
 * themselves, unless normalization changed their decoded form, and any other
 * token that decodes from the same text. Needs the model map (tok_finish). */
static void mark_skip(fl_tokenizer *tok) {
    for (int k = 0; k < tok->n_added; k++) {
        const tok_added *s = &tok->added[k];
        if (!s->special) continue;
        int32_t m = tok_strmap_get(&tok->model_map, tok, s->text, s->text_len);
        if (m >= 0 && !(tok->dec_str && tok->dec_str[m])) tok->attr[m] |= ATTR_SKIP;
        for (int q = 0; q < tok->n_added; q++) {
            const tok_added *a = &tok->added[q];
            if (a->len == s->text_len && memcmp(a->content, s->text, a->len) == 0) tok->attr[a->id] |= ATTR_SKIP;
        }
    }
}

static fl_status parse_merges(const jctx *j, const cJSON *merges) {
    fl_tokenizer *tok = j->tok;
    int n = cJSON_GetArraySize(merges);
    FL_TRY(tok_pairmap_init(&tok->merges, (uint32_t)n));
    int rank = 0;
    const cJSON *e;
    char *cat = NULL;
    size_t cat_cap = 0;
    fl_status st = FL_OK;
    cJSON_ArrayForEach(e, merges) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (cJSON_IsString(e)) {
            const char *s = e->valuestring, *sp = strchr(s, ' ');
            if (sp && !strchr(sp + 1, ' ')) {
                a = s;
                la = (size_t)(sp - s);
                b = sp + 1;
                lb = strlen(b);
            }
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            a = cJSON_GetArrayItem(e, 0)->valuestring;
            b = cJSON_GetArrayItem(e, 1)->valuestring;
            la = strlen(a);
            lb = strlen(b);
        }
        if (!a) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: model.merges[%d] is neither \"a b\" nor [\"a\", \"b\"]", j->path, rank);
            break;
        }
        if (la + lb + 1 > cat_cap) {
            cat_cap = (la + lb + 1) * 2;
            char *p = realloc(cat, cat_cap);
            if (!p) { st = FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path); break; }
            cat = p;
        }
        memcpy(cat, a, la);
        memcpy(cat + la, b, lb);
        int32_t ia = tok_strmap_get(&tok->model_map, tok, a, la);
        int32_t ib = tok_strmap_get(&tok->model_map, tok, b, lb);
        int32_t ic = tok_strmap_get(&tok->model_map, tok, cat, la + lb);
        if (ia < 0 || ib < 0 || ic < 0) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: model.merges[%d] (\"%.*s\" \"%.*s\") uses a token missing from model.vocab",
                        j->path, rank, (int)la, a, (int)lb, b);
            break;
        }
        tok_pairmap_put(&tok->merges, ia, ib, rank, ic);
        rank++;
    }
    free(cat);
    return st;
}

static fl_status load_root(const jctx *j, const cJSON *root) {
    fl_tokenizer *tok = j->tok;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) return FL_ERR(FL_ERR_FORMAT, "%s: no \"model\" object", j->path);
    const char *mt = jstr(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (mt ? strcmp(mt, "BPE") != 0 : !cJSON_IsArray(merges))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: model type \"%s\" is not supported (only BPE)", j->path, mt ? mt : "?");
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
        return FL_ERR(FL_ERR_FORMAT, "%s: BPE model needs \"vocab\" (object) and \"merges\" (array)", j->path);
    const char *cp = jstr(model, "continuing_subword_prefix"), *ews = jstr(model, "end_of_word_suffix");
    if ((cp && cp[0]) || (ews && ews[0]))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: BPE continuing_subword_prefix/end_of_word_suffix are not supported", j->path);
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble > 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: BPE dropout is not supported (non-deterministic)", j->path);

    /* id space: model vocab ∪ added tokens */
    int max_id = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        long long v;
        if (!fl_json_int(e, 0, 1e8, &v))
            return FL_ERR(FL_ERR_FORMAT, "%s: model.vocab[\"%s\"] is not a valid id", j->path, e->string ? e->string : "");
        if ((int)v > max_id) max_id = (int)v;
    }
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsArray(added) && !cJSON_IsNull(added))
        return FL_ERR(FL_ERR_FORMAT, "%s: \"added_tokens\" is not an array", j->path);
    cJSON_ArrayForEach(e, added) {
        const cJSON *idv = cJSON_GetObjectItemCaseSensitive(e, "id");
        long long v;
        if (!fl_json_int(idv, 0, 1e8, &v))
            return FL_ERR(FL_ERR_FORMAT, "%s: added_tokens entry without a valid \"id\"", j->path);
        if ((int)v > max_id) max_id = (int)v;
    }
    if (max_id < 0) return FL_ERR(FL_ERR_FORMAT, "%s: empty vocabulary", j->path);
    /* Tables are indexed by id; real files number their tokens densely (a few
     * holes at most), and one stray huge id would cost seconds and gigabytes. */
    long long n_def = (long long)cJSON_GetArraySize(vocab) + (added ? cJSON_GetArraySize(added) : 0);
    if (max_id >= 2 * n_def + 1024)
        return FL_ERR(FL_ERR_FORMAT, "%s: token id %d is far beyond the %lld tokens defined (ids must be dense)",
                      j->path, max_id, n_def);
    FL_TRY(tok_alloc_ids(tok, max_id + 1));
    cJSON_ArrayForEach(e, vocab) {
        int id = (int)e->valuedouble;
        if (tok->str[id])
            return FL_ERR(FL_ERR_FORMAT, "%s: model.vocab has two tokens with id %d", j->path, id);
        tok->str[id] = strdup(e->string);
        if (!tok->str[id]) return FL_ERR(FL_ERR_OOM, "out of memory loading %s", j->path);
        tok->len[id] = (uint32_t)strlen(e->string);
        tok->attr[id] |= ATTR_MODEL;
    }
    tok->model = MODEL_BPE;
    tok->byte_fallback = jbool(model, "byte_fallback", false);
    tok->fuse_unk = jbool(model, "fuse_unk", false);
    tok->ignore_merges = jbool(model, "ignore_merges", false);

    FL_TRY(parse_normalizer(j, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), 0));
    FL_TRY(parse_pretok(j, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), 0));
    FL_TRY(parse_decoder(j, cJSON_GetObjectItemCaseSensitive(root, "decoder"), 0));
    FL_TRY(parse_added(j, added, tok->n_vocab));
    FL_TRY(tok_finish(tok, j->path));
    mark_skip(tok);
    FL_TRY(parse_merges(j, merges));
    const char *unk = jstr(model, "unk_token");
    if (unk) {
        tok->unk_id = tok_strmap_get(&tok->model_map, tok, unk, strlen(unk));
        if (tok->unk_id < 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: model.unk_token \"%s\" is not in model.vocab", j->path, unk);
    }
    FL_TRY(parse_post(j, cJSON_GetObjectItemCaseSensitive(root, "post_processor"), 0));

    char name[256];
    config_token(j->path, "eos_token", name, sizeof name);
    if (name[0]) tok->eos = fl_tokenizer_token_id(tok, name);
    static const char *eos_names[] = {"</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>", "<|eot_id|>"};
    for (size_t i = 0; tok->eos < 0 && i < sizeof eos_names / sizeof *eos_names; i++)
        tok->eos = fl_tokenizer_token_id(tok, eos_names[i]);
    if (tok->bos < 0) {
        config_token(j->path, "bos_token", name, sizeof name);
        if (name[0]) tok->bos = fl_tokenizer_token_id(tok, name);
        static const char *bos_names[] = {"<s>", "<|begin_of_text|>", "<bos>"};
        for (size_t i = 0; tok->bos < 0 && i < sizeof bos_names / sizeof *bos_names; i++)
            tok->bos = fl_tokenizer_token_id(tok, bos_names[i]);
    }
    return FL_OK;
}

fl_status tok_load_json(const char *path, fl_tokenizer *tok) {
    char *buf = NULL;
    size_t n = 0;
    FL_TRY(read_file(path, &buf, &n));
    cJSON *root = cJSON_ParseWithLength(buf, n);
    fl_status st = FL_OK;
    if (!root || !cJSON_IsObject(root)) {
        const char *ep = cJSON_GetErrorPtr();
        size_t off = (ep && ep >= buf && ep <= buf + n) ? (size_t)(ep - buf) : 0;
        st = FL_ERR(FL_ERR_FORMAT, "%s: not a valid tokenizer.json (JSON error near byte %zu)", path, off);
    } else {
        jctx j = {path, tok};
        st = load_root(&j, root);
    }
    cJSON_Delete(root);
    free(buf);
    return st;
}
