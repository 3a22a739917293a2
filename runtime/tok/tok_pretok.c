/*
 * tok_pretok.c — normalizers and pre-tokenizers, with Hugging Face
 * tokenizers' semantics (normalizers and pre_tokenizers modules,
 * NormalizedString::split).
 *
 * Pre-tokenizers run depth-first: step k splits (or rewrites) its piece and
 * calls step k+1 on each sub-piece; past the last step the piece is a word
 * and goes to the model. Splitting steps pass slices of their input, so text
 * is copied only by the steps that rewrite it (ByteLevel's byte->char map,
 * Metaspace's space replacement); each step owns scratch buffers indexed by
 * its depth, which stay valid while deeper steps run.
 *
 * A split is a list of marks (start, end, is_match) covering the piece, as
 * HF's Pattern::find_matches returns; the split behavior then groups marks
 * into pieces and empty pieces are dropped, as PreTokenizedString::split does.
 */
#define _GNU_SOURCE /* memmem */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "runtime/tok/tok_impl.h"

static fl_status oom(void) { return FL_ERR(FL_ERR_OOM, "out of memory while tokenizing"); }

/* ---- normalizers -------------------------------------------------------- */

static fl_status norm_one(const tok_norm *nm, const char *s, size_t n, tok_buf *o) {
    switch (nm->type) {
    case NORM_NFC: case NORM_NFD: case NORM_NFKC: case NORM_NFKD: {
        int opts = UTF8PROC_STABLE;
        if (nm->type == NORM_NFC || nm->type == NORM_NFKC) opts |= UTF8PROC_COMPOSE;
        else opts |= UTF8PROC_DECOMPOSE;
        if (nm->type == NORM_NFKC || nm->type == NORM_NFKD) opts |= UTF8PROC_COMPAT;
        if (n == 0) return FL_OK;
        if (nm->type == NORM_NFC) {
            /* Text below U+0300 is always NFC (NFC_QC=No/Maybe code points
             * all start at U+0300); its UTF-8 bytes are all < 0xCC. */
            size_t k = 0;
            while (k < n && (unsigned char)s[k] < 0xcc) k++;
            if (k == n) return tok_buf_put(o, s, n) ? FL_OK : oom();
        }
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                          (utf8proc_option_t)opts);
        if (r < 0) {
            free(dst);
            return FL_ERR(FL_ERR_INVALID_ARG, "Unicode normalization failed: %s", utf8proc_errmsg(r));
        }
        bool ok = tok_buf_put(o, dst, (size_t)r);
        free(dst);
        return ok ? FL_OK : oom();
    }
    case NORM_LOWERCASE:
        for (size_t i = 0; i < n;) {
            size_t cl;
            int32_t cp = tok_u8dec(s + i, n - i, &cl);
            char tmp[8];
            size_t k;
            if (cp == 0x130) { /* Rust: 'İ'.to_lowercase() == "i\u{307}" */
                k = tok_u8enc('i', tmp);
                k += tok_u8enc(0x307, tmp + k);
            } else {
                k = tok_u8enc(utf8proc_tolower(cp), tmp);
            }
            if (!tok_buf_put(o, tmp, k)) return oom();
            i += cl;
        }
        return FL_OK;
    case NORM_PREPEND:
        if (n > 0 && !tok_buf_put(o, nm->str, nm->str_len)) return oom();
        return tok_buf_put(o, s, n) ? FL_OK : oom();
    case NORM_STRIP: {
        size_t a = 0, b = n;
        while (nm->left && a < b) {
            size_t cl;
            int32_t cp = tok_u8dec(s + a, b - a, &cl);
            if (!tok_is_ws(cp)) break;
            a += cl;
        }
        while (nm->right && b > a) {
            size_t st = b - 1;
            while (st > a && ((unsigned char)s[st] & 0xc0) == 0x80) st--;
            size_t cl;
            int32_t cp = tok_u8dec(s + st, b - st, &cl);
            if (!tok_is_ws(cp)) break;
            b = st;
        }
        return tok_buf_put(o, s + a, b - a) ? FL_OK : oom();
    }
    case NORM_REPLACE: {
        if (nm->re == NULL) {
            size_t i = 0;
            while (i < n) {
                const char *hit = nm->str_len ? memmem(s + i, n - i, nm->str, nm->str_len) : NULL;
                size_t end = hit ? (size_t)(hit - s) : n;
                if (!tok_buf_put(o, s + i, end - i)) return oom();
                if (!hit) break;
                if (!tok_buf_put(o, nm->content, nm->content_len)) return oom();
                i = end + nm->str_len;
            }
            return tok_buf_reserve(o, 0) ? FL_OK : oom();
        }
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(nm->re, NULL);
        if (!md) return oom();
        size_t prev = 0, start = 0;
        fl_status st = FL_OK;
        while (start <= n) {
            int rc = pcre2_match(nm->re, (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc < 0) { st = FL_ERR(FL_ERR_INTERNAL, "PCRE2 match failed (%d) in Replace normalizer", rc); break; }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            if (!tok_buf_put(o, s + prev, ov[0] - prev) || !tok_buf_put(o, nm->content, nm->content_len)) {
                st = oom();
                break;
            }
            prev = ov[1];
            if (ov[1] == ov[0]) {
                if (ov[0] >= n) break;
                size_t cl = tok_u8len((unsigned char)s[ov[0]]);
                if (!tok_buf_put(o, s + ov[0], cl)) { st = oom(); break; }
                prev = ov[0] + cl;
                start = prev;
            } else {
                start = ov[1];
            }
        }
        pcre2_match_data_free(md);
        if (st != FL_OK) return st;
        if (prev < n && !tok_buf_put(o, s + prev, n - prev)) return oom();
        return tok_buf_reserve(o, 0) ? FL_OK : oom();
    }
    }
    return FL_ERR(FL_ERR_INTERNAL, "unknown normalizer %d", (int)nm->type);
}

fl_status tok_normalize(const fl_tokenizer *tok, const char *s, size_t n, char **out, size_t *out_n) {
    tok_buf cur = {0};
    fl_status st = FL_OK;
    if (!tok_buf_put(&cur, s, n)) return oom();
    for (int i = 0; i < tok->n_norms; i++) {
        tok_buf nx = {0};
        if (!tok_buf_reserve(&nx, cur.n)) { st = oom(); free(nx.p); goto fail; }
        st = norm_one(&tok->norms[i], cur.p, cur.n, &nx);
        if (st != FL_OK) { free(nx.p); goto fail; }
        free(cur.p);
        cur = nx;
        st = tok_check_growth(n, cur.n, "normalizer");
        if (st != FL_OK) goto fail;
    }
    *out = cur.p;
    *out_n = cur.n;
    return FL_OK;
fail:
    free(cur.p);
    return st;
}

/* ---- splitting ---------------------------------------------------------- */

static bool mark_push(tok_enc_ctx *c, int d, size_t *nm, size_t s, size_t e, bool m) {
    if (*nm == c->marks_cap[d]) {
        size_t cap = c->marks_cap[d] ? c->marks_cap[d] * 2 : 64;
        struct tok_mark *p = realloc(c->marks[d], cap * sizeof *p);
        if (!p) return false;
        c->marks[d] = p;
        c->marks_cap[d] = cap;
    }
    c->marks[d][(*nm)++] = (struct tok_mark){s, e, m};
    return true;
}

static fl_status regex_marks(tok_enc_ctx *c, int d, const pcre2_code *re, const char *s, size_t n,
                             size_t *nm) {
    *nm = 0;
    if (n == 0) return mark_push(c, d, nm, 0, 0, false) ? FL_OK : oom();
    size_t prev = 0, start = 0;
    while (start <= n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, c->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return FL_ERR(FL_ERR_INTERNAL, "PCRE2 match failed in a Split pre-tokenizer: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (prev != ms && !mark_push(c, d, nm, prev, ms, false)) return oom();
        if (!mark_push(c, d, nm, ms, me, true)) return oom();
        prev = me;
        if (me == ms) {
            if (ms >= n) break;
            start = ms + tok_u8len((unsigned char)s[ms]);
        } else {
            start = me;
        }
    }
    if (prev != n && !mark_push(c, d, nm, prev, n, false)) return oom();
    return FL_OK;
}

/* Marks for a per-character predicate (HF's `impl Pattern for Fn(char)`):
 * every matching char is its own match; non-matching runs are merged. */
static fl_status char_marks(tok_enc_ctx *c, int d, const char *s, size_t n, int kind,
                            const char *repl, size_t repl_len, size_t *nm) {
    *nm = 0;
    if (n == 0) return mark_push(c, d, nm, 0, 0, false) ? FL_OK : oom();
    size_t run = 0;
    for (size_t i = 0; i < n;) {
        size_t cl;
        bool hit;
        if (kind == 0) {
            int32_t cp = tok_u8dec(s + i, n - i, &cl);
            hit = tok_is_numeric(cp);
        } else {
            cl = tok_u8len((unsigned char)s[i]);
            if (cl > n - i) cl = n - i;
            hit = cl == repl_len && memcmp(s + i, repl, cl) == 0;
        }
        if (hit) {
            if (run < i && !mark_push(c, d, nm, run, i, false)) return oom();
            if (!mark_push(c, d, nm, i, i + cl, true)) return oom();
            run = i + cl;
        }
        i += cl;
    }
    if (run < n && !mark_push(c, d, nm, run, n, false)) return oom();
    return FL_OK;
}

/* Groups marks into pieces in place (the output never outgrows the input);
 * returns the number of pieces; removed pieces are dropped. */
static size_t apply_behavior(struct tok_mark *mk, size_t nm, split_behavior b, bool invert) {
    if (invert)
        for (size_t i = 0; i < nm; i++) mk[i].m = !mk[i].m;
    size_t k = 0;
    bool prev = false;
    switch (b) {
    case SPLIT_ISOLATED:
        return nm;
    case SPLIT_REMOVED:
        for (size_t i = 0; i < nm; i++)
            if (!mk[i].m) mk[k++] = mk[i];
        return k;
    case SPLIT_CONTIGUOUS:
        for (size_t i = 0; i < nm; i++) {
            bool m = mk[i].m;
            if (m == prev && k > 0) mk[k - 1].e = mk[i].e;
            else mk[k++] = mk[i];
            prev = m;
        }
        return k;
    case SPLIT_MERGED_PREV:
        for (size_t i = 0; i < nm; i++) {
            bool m = mk[i].m;
            if (m && !prev && k > 0) mk[k - 1].e = mk[i].e;
            else mk[k++] = mk[i];
            prev = m;
        }
        return k;
    case SPLIT_MERGED_NEXT: {
        /* Walk backwards, writing from the end, then shift down. */
        size_t w = nm;
        for (size_t i = nm; i-- > 0;) {
            bool m = mk[i].m;
            if (m && !prev && w < nm) mk[w].s = mk[i].s;
            else mk[--w] = mk[i];
            prev = m;
        }
        memmove(mk, mk + w, (nm - w) * sizeof *mk);
        return nm - w;
    }
    }
    return nm;
}

static fl_status run_marks(tok_enc_ctx *c, int step, const char *s, size_t npieces, bool at0) {
    for (size_t i = 0; i < npieces; i++) {
        struct tok_mark m = c->marks[step][i];
        if (m.e <= m.s) continue;
        FL_TRY(tok_pretok_run(c, step + 1, s + m.s, m.e - m.s, at0 && m.s == 0));
    }
    return FL_OK;
}

#define WC_MAX_WORD 64

void tok_enc_ctx_cache(tok_enc_ctx *c, size_t len) {
    if (c->tok->n_pretoks == 0 || len < 256) return;
    uint32_t cap = 256;
    while (cap < len / 4 && cap < (1u << 16)) cap <<= 1;
    c->wc = calloc(cap, sizeof *c->wc);
    if (c->wc) c->wc_cap = cap; /* no cache on OOM: it is only a speed-up */
}

static fl_status model_word(tok_enc_ctx *c, const char *s, size_t n) {
    if (!c->wc || n > WC_MAX_WORD) return tok_model_encode(c->tok, &c->bpe, s, n, &c->out);
    uint64_t h = tok_hash(s, n);
    uint32_t mask = c->wc_cap - 1, i = (uint32_t)h & mask;
    for (; c->wc[i].wlen; i = (i + 1) & mask) {
        const tok_wcache_slot *e = &c->wc[i];
        if (e->h == h && e->wlen == n && memcmp(c->wc_words.p + e->word_off, s, n) == 0) {
            for (uint32_t k = 0; k < e->nids; k++)
                if (!tok_ids_push(&c->out, c->wc_ids.p[e->ids_off + k])) return oom();
            return FL_OK;
        }
    }
    size_t before = c->out.n;
    FL_TRY(tok_model_encode(c->tok, &c->bpe, s, n, &c->out));
    size_t nids = c->out.n - before;
    if (c->wc_count * 2 >= c->wc_cap || nids > 0xffff || c->wc_words.n > UINT32_MAX / 2) return FL_OK;
    tok_wcache_slot e = {h, (uint32_t)c->wc_words.n, (uint32_t)c->wc_ids.n, (uint16_t)n, (uint16_t)nids};
    if (!tok_buf_put(&c->wc_words, s, n)) return FL_OK;
    for (size_t k = 0; k < nids; k++)
        if (!tok_ids_push(&c->wc_ids, c->out.p[before + k])) return FL_OK;
    c->wc[i] = e;
    c->wc_count++;
    return FL_OK;
}

fl_status tok_pretok_run(tok_enc_ctx *c, int step, const char *s, size_t n, bool at0) {
    const fl_tokenizer *tok = c->tok;
    if (n == 0) return FL_OK;
    if (step >= tok->n_pretoks) return model_word(c, s, n);
    const tok_pretok *p = &tok->pretoks[step];
    size_t nm = 0;
    switch (p->type) {
    case PT_SPLIT:
        FL_TRY(regex_marks(c, step, p->re, s, n, &nm));
        nm = apply_behavior(c->marks[step], nm, p->behavior, p->invert);
        return run_marks(c, step, s, nm, at0);
    case PT_DIGITS:
        FL_TRY(char_marks(c, step, s, n, 0, NULL, 0, &nm));
        nm = apply_behavior(c->marks[step], nm, p->individual_digits ? SPLIT_ISOLATED : SPLIT_CONTIGUOUS, false);
        return run_marks(c, step, s, nm, at0);
    case PT_METASPACE: {
        tok_buf *b = &c->tmp[step][0];
        b->n = 0;
        bool pre = p->prepend == PREPEND_ALWAYS || (p->prepend == PREPEND_FIRST && at0);
        if (pre && !(n >= p->repl_len && memcmp(s, p->repl, p->repl_len) == 0)) {
            /* the replaced text starts with repl iff s starts with ' ' or repl */
            if (s[0] != ' ' && !tok_buf_put(b, p->repl, p->repl_len)) return oom();
        }
        for (size_t i = 0; i < n; i++) {
            if (s[i] == ' ') {
                if (!tok_buf_put(b, p->repl, p->repl_len)) return oom();
            } else {
                size_t j = i;
                while (j < n && s[j] != ' ') j++;
                if (!tok_buf_put(b, s + i, j - i)) return oom();
                i = j - 1;
            }
        }
        if (!p->split) return tok_pretok_run(c, step + 1, b->p, b->n, at0);
        FL_TRY(char_marks(c, step, b->p, b->n, 1, p->repl, p->repl_len, &nm));
        nm = apply_behavior(c->marks[step], nm, SPLIT_MERGED_NEXT, false);
        return run_marks(c, step, b->p, nm, at0);
    }
    case PT_BYTELEVEL: {
        const char *src = s;
        size_t sn = n;
        if (p->add_prefix_space && s[0] != ' ') {
            tok_buf *b = &c->tmp[step][0];
            b->n = 0;
            if (!tok_buf_put(b, " ", 1) || !tok_buf_put(b, s, n)) return oom();
            src = b->p;
            sn = b->n;
        }
        if (p->re) {
            FL_TRY(regex_marks(c, step, p->re, src, sn, &nm));
        } else {
            nm = 0;
            if (!mark_push(c, step, &nm, 0, sn, false)) return oom();
        }
        tok_buf *mb = &c->tmp[step][1];
        for (size_t i = 0; i < nm; i++) {
            struct tok_mark m = c->marks[step][i];
            if (m.e <= m.s) continue;
            mb->n = 0;
            if (!tok_buf_reserve(mb, 2 * (m.e - m.s))) return oom();
            for (size_t k = m.s; k < m.e; k++) {
                int32_t cp = tok_bl_cp((unsigned char)src[k]);
                mb->n += tok_u8enc(cp, mb->p + mb->n);
            }
            FL_TRY(tok_pretok_run(c, step + 1, mb->p, mb->n, at0 && m.s == 0));
        }
        return FL_OK;
    }
    }
    return FL_ERR(FL_ERR_INTERNAL, "unknown pre-tokenizer %d", (int)p->type);
}

void tok_enc_ctx_free(tok_enc_ctx *c) {
    if (!c) return;
    for (int i = 0; i < TOK_MAX_PRETOK; i++) {
        free(c->tmp[i][0].p);
        free(c->tmp[i][1].p);
        free(c->marks[i]);
    }
    pcre2_match_data_free(c->md);
    tok_bpe_scratch_free(&c->bpe);
    free(c->out.p);
    free(c->wc);
    free(c->wc_words.p);
    free(c->wc_ids.p);
    memset(c, 0, sizeof *c);
}
