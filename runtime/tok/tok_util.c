/*
 * tok_util.c — small building blocks of the tokenizer: open-addressing hash
 * maps (string -> id, id pair -> merge), strict UTF-8 checks and lossy
 * repair, Unicode predicates that match Rust's char methods (Hugging Face
 * tokenizers is Rust), a growable buffer and PCRE2 compilation.
 *
 * The string map stores only ids: the key of an id is the tokenizer's own
 * string for it, so a 150k vocabulary costs 4 bytes per slot.
 */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "runtime/tok/tok_impl.h"

uint64_t tok_hash(const char *s, size_t n) {
    /* FNV-1a, then a final mix so the low bits are usable for pow2 tables. */
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h;
}

static uint32_t pow2_for(uint32_t expected) {
    uint32_t cap = 16;
    while (cap < expected * 2u + 1u && cap < (1u << 30)) cap <<= 1;
    return cap;
}

fl_status tok_strmap_init(tok_strmap *m, uint32_t expected) {
    m->cap = pow2_for(expected);
    m->count = 0;
    m->slots = malloc(sizeof(int32_t) * m->cap);
    if (!m->slots) return FL_ERR(FL_ERR_OOM, "out of memory allocating a tokenizer hash map (%u slots)", m->cap);
    memset(m->slots, 0xff, sizeof(int32_t) * m->cap);
    return FL_OK;
}

void tok_strmap_free(tok_strmap *m) {
    if (!m) return;
    free(m->slots);
    m->slots = NULL;
    m->cap = m->count = 0;
}

void tok_strmap_put(tok_strmap *m, const fl_tokenizer *tok, int32_t id, bool replace) {
    const char *s = tok->str[id];
    size_t n = tok->len[id];
    uint32_t mask = m->cap - 1, i = (uint32_t)tok_hash(s, n) & mask;
    for (;;) {
        int32_t cur = m->slots[i];
        if (cur < 0) {
            m->slots[i] = id;
            m->count++;
            return;
        }
        if (tok->len[cur] == n && memcmp(tok->str[cur], s, n) == 0) {
            if (replace) m->slots[i] = id;
            return;
        }
        i = (i + 1) & mask;
    }
}

int32_t tok_strmap_get(const tok_strmap *m, const fl_tokenizer *tok, const char *s, size_t n) {
    uint32_t mask = m->cap - 1, i = (uint32_t)tok_hash(s, n) & mask;
    for (;;) {
        int32_t cur = m->slots[i];
        if (cur < 0) return -1;
        if (tok->len[cur] == n && memcmp(tok->str[cur], s, n) == 0) return cur;
        i = (i + 1) & mask;
    }
}

static inline uint32_t pair_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (uint32_t)k;
}

fl_status tok_pairmap_init(tok_pairmap *m, uint32_t expected) {
    m->cap = pow2_for(expected);
    m->count = 0;
    m->keys = malloc(sizeof(uint64_t) * m->cap);
    m->rank = malloc(sizeof(int32_t) * m->cap);
    m->merged = malloc(sizeof(int32_t) * m->cap);
    if (!m->keys || !m->rank || !m->merged) {
        tok_pairmap_free(m);
        return FL_ERR(FL_ERR_OOM, "out of memory allocating the merge table (%u slots)", expected);
    }
    memset(m->keys, 0xff, sizeof(uint64_t) * m->cap);
    return FL_OK;
}

void tok_pairmap_free(tok_pairmap *m) {
    if (!m) return;
    free(m->keys);
    free(m->rank);
    free(m->merged);
    m->keys = NULL;
    m->rank = m->merged = NULL;
    m->cap = m->count = 0;
}

void tok_pairmap_put(tok_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged) {
    uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = m->cap - 1, i = pair_hash(k) & mask;
    while (m->keys[i] != UINT64_MAX && m->keys[i] != k) i = (i + 1) & mask;
    if (m->keys[i] == UINT64_MAX) m->count++;
    /* A duplicate merge overwrites: HF collects merges into a HashMap. */
    m->keys[i] = k;
    m->rank[i] = rank;
    m->merged[i] = merged;
}

bool tok_pairmap_get(const tok_pairmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *merged) {
    if (m->cap == 0) return false;
    uint64_t k = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = m->cap - 1, i = pair_hash(k) & mask;
    for (;;) {
        uint64_t cur = m->keys[i];
        if (cur == UINT64_MAX) return false;
        if (cur == k) {
            *rank = m->rank[i];
            *merged = m->merged[i];
            return true;
        }
        i = (i + 1) & mask;
    }
}

int32_t tok_u8dec(const char *s, size_t n, size_t *cl) {
    const unsigned char *u = (const unsigned char *)s;
    size_t l = tok_u8len(u[0]);
    if (l > n) l = 1;
    *cl = l;
    switch (l) {
    case 1: return u[0];
    case 2: return ((u[0] & 0x1f) << 6) | (u[1] & 0x3f);
    case 3: return ((u[0] & 0x0f) << 12) | ((u[1] & 0x3f) << 6) | (u[2] & 0x3f);
    default: return ((u[0] & 0x07) << 18) | ((u[1] & 0x3f) << 12) | ((u[2] & 0x3f) << 6) | (u[3] & 0x3f);
    }
}

size_t tok_u8enc(int32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = 0xc0 | (cp >> 6); o[1] = 0x80 | (cp & 0x3f); return 2; }
    if (cp < 0x10000) {
        o[0] = 0xe0 | (cp >> 12); o[1] = 0x80 | ((cp >> 6) & 0x3f); o[2] = 0x80 | (cp & 0x3f);
        return 3;
    }
    o[0] = 0xf0 | (cp >> 18); o[1] = 0x80 | ((cp >> 12) & 0x3f);
    o[2] = 0x80 | ((cp >> 6) & 0x3f); o[3] = 0x80 | (cp & 0x3f);
    return 4;
}

/* Length of the valid sequence at s, or -(bytes of its maximal invalid
 * subpart) (the Unicode "substitution of maximal subparts" rule). */
static long u8_step(const unsigned char *s, size_t n) {
    unsigned char b = s[0];
    if (b < 0x80) return 1;
    size_t need;
    unsigned char lo = 0x80, hi = 0xbf;
    if (b >= 0xc2 && b <= 0xdf) need = 1;
    else if (b == 0xe0) { need = 2; lo = 0xa0; }
    else if (b == 0xed) { need = 2; hi = 0x9f; }
    else if (b >= 0xe1 && b <= 0xef) need = 2;
    else if (b == 0xf0) { need = 3; lo = 0x90; }
    else if (b == 0xf4) { need = 3; hi = 0x8f; }
    else if (b >= 0xf1 && b <= 0xf3) need = 3;
    else return -1;
    for (size_t k = 0; k < need; k++) {
        size_t j = 1 + k;
        if (j >= n) return -(long)j;
        unsigned char c = s[j];
        unsigned char l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xbf;
        if (c < l || c > h) return -(long)j;
    }
    return (long)need + 1;
}

size_t tok_u8check(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        long st = u8_step(u + i, n - i);
        if (st < 0) return i;
        i += (size_t)st;
    }
    return n;
}

bool tok_buf_reserve(tok_buf *b, size_t extra) {
    if (b->n + extra + 1 <= b->cap) {
        b->p[b->n] = 0;
        return true;
    }
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return false;
    b->p = p;
    b->cap = cap;
    b->p[b->n] = 0; /* always NUL-terminated */
    return true;
}

bool tok_buf_put(tok_buf *b, const void *s, size_t n) {
    if (!tok_buf_reserve(b, n)) return false;
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return true;
}

bool tok_buf_lossy(tok_buf *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        while (j < n && u[j] < 0x80) j++;
        if (j > i && !tok_buf_put(b, s + i, j - i)) return false;
        i = j;
        if (i >= n) break;
        long st = u8_step(u + i, n - i);
        if (st > 0) {
            if (!tok_buf_put(b, s + i, (size_t)st)) return false;
            i += (size_t)st;
        } else {
            if (!tok_buf_put(b, "\xef\xbf\xbd", 3)) return false;
            i += (size_t)(-st);
        }
    }
    return tok_buf_reserve(b, 0);
}

bool tok_is_ws(int32_t cp) {
    switch (cp) {
    case 0x09: case 0x0a: case 0x0b: case 0x0c: case 0x0d: case 0x20: case 0x85: case 0xa0:
    case 0x1680: case 0x2028: case 0x2029: case 0x202f: case 0x205f: case 0x3000:
        return true;
    default:
        return cp >= 0x2000 && cp <= 0x200a;
    }
}

bool tok_is_numeric(int32_t cp) {
    utf8proc_category_t c = utf8proc_category(cp);
    return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

/* Unicode White_Space, which is what Oniguruma's \s (used by HF) matches.
 * PCRE2's \s also matches U+180E, so patterns are rewritten to use this. */
#define WS_SET "\\t\\n\\x0b\\f\\r\\x20\\x85\\xa0\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"

/* Rewrites \s and \S (outside classes) / \s (inside classes) of an HF regex
 * to WS_SET. Returns a malloc'd pattern or NULL on OOM. */
static char *rewrite_ws(const char *p, size_t n, size_t *out_n) {
    size_t cap = n * 8 + 64, k = 0;
    char *o = malloc(cap);
    if (!o) return NULL;
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        const char *rep = NULL;
        if (k + sizeof(WS_SET) + 8 > cap) {
            cap *= 2;
            char *q = realloc(o, cap);
            if (!q) { free(o); return NULL; }
            o = q;
        }
        if (p[i] == '\\' && i + 1 < n) {
            char c = p[i + 1];
            if (c == 's') rep = in_class ? WS_SET : "[" WS_SET "]";
            else if (c == 'S' && !in_class) rep = "[^" WS_SET "]";
            if (rep) {
                size_t rl = strlen(rep);
                memcpy(o + k, rep, rl);
                k += rl;
            } else {
                o[k++] = p[i];
                o[k++] = c;
            }
            i++;
            continue;
        }
        if (!in_class && p[i] == '[') {
            in_class = true;
            o[k++] = p[i];
            /* a ']' right after '[' or '[^' is a literal */
            if (i + 1 < n && p[i + 1] == '^') o[k++] = p[++i];
            if (i + 1 < n && p[i + 1] == ']') o[k++] = p[++i];
            continue;
        }
        if (in_class && p[i] == ']') in_class = false;
        o[k++] = p[i];
    }
    *out_n = k;
    return o;
}

fl_status tok_compile_regex(const char *pattern, size_t len, bool literal, const char *where,
                            pcre2_code **out) {
    int err = 0;
    PCRE2_SIZE off = 0;
    char *rewritten = NULL;
    if (!literal) {
        size_t rn = 0;
        rewritten = rewrite_ws(pattern, len, &rn);
        if (!rewritten) return FL_ERR(FL_ERR_OOM, "out of memory compiling a regex of %s", where);
        pattern = rewritten;
        len = rn;
    }
    /* PCRE2_LITERAL admits no PCRE2_UCP (and needs none) */
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &err, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        fl_status st = FL_ERR(FL_ERR_UNSUPPORTED, "%s: regex /%.*s/ does not compile with PCRE2 at offset %zu: %s",
                      where, (int)(len > 200 ? 200 : len), pattern, (size_t)off, (const char *)msg);
        free(rewritten);
        return st;
    }
    free(rewritten);
    /* JIT is an optimization only: pcre2_match falls back to the interpreter. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return FL_OK;
}

fl_status tok_check_growth(size_t in_n, size_t out_n, const char *chain) {
    if (out_n <= TOK_MAX_GROWTH * in_n + 256) return FL_OK;
    return FL_ERR(FL_ERR_UNSUPPORTED,
                  "the tokenizer's %s turns %zu bytes of text into %zu (more than %dx): its steps compound", chain,
                  in_n, out_n, TOK_MAX_GROWTH);
}
