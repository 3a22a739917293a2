/*
 * tok_bpe.c — the two merge loops, applied to one pre-token (word).
 *
 * MODEL_BPE follows Hugging Face tokenizers' BPE model (models/bpe/word.rs):
 * the word starts as one symbol per character (vocabulary lookup, else
 * <0xNN> byte-fallback tokens, else the unk token, fused when fuse_unk), then
 * a binary heap ordered by (merge rank, position) applies merges; stale heap
 * entries are recognised by re-checking the pair. O(n log n) per word, so a
 * whole paragraph as one word (Llama-2 has no pre-tokenizer) stays fast.
 *
 * MODEL_SPM follows llama.cpp's llm_tokenizer_spm for GGUF "llama"
 * vocabularies: any adjacent pair whose concatenation is a (normal) token is
 * a candidate, the highest score wins (ties: leftmost), and symbols that are
 * not tokens at the end become <0xNN> byte tokens.
 */
#include <stdlib.h>
#include <string.h>

#include "runtime/tok/tok_impl.h"

struct tok_sym {
    int32_t id;     /* BPE: token id; SPM: unused */
    int32_t prev, next;
    uint32_t off;   /* byte offset in the word */
    uint32_t len;   /* bytes; 0 = merged away */
};

struct tok_heap_ent {
    float score;    /* SPM: higher first */
    int32_t rank;   /* BPE: lower first */
    int32_t pos;    /* left symbol: lower first */
    int32_t aux;    /* BPE: merged id; SPM: merged byte length */
};

bool tok_ids_push(tok_ids *v, int32_t id) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 256;
        int32_t *p = realloc(v->p, cap * sizeof *p);
        if (!p) return false;
        v->p = p;
        v->cap = cap;
    }
    v->p[v->n++] = id;
    return true;
}

void tok_bpe_scratch_free(tok_bpe_scratch *s) {
    if (!s) return;
    free(s->syms);
    free(s->heap);
    s->syms = NULL;
    s->heap = NULL;
    s->syms_cap = s->heap_cap = 0;
}

static bool heap_reserve(tok_bpe_scratch *sc, size_t need) {
    if (need <= sc->heap_cap) return true;
    size_t cap = sc->heap_cap ? sc->heap_cap : 64;
    while (cap < need) cap *= 2;
    struct tok_heap_ent *p = realloc(sc->heap, cap * sizeof *p);
    if (!p) return false;
    sc->heap = p;
    sc->heap_cap = cap;
    return true;
}

static bool sc_reserve(tok_bpe_scratch *sc, size_t nsym) {
    if (nsym > sc->syms_cap) {
        size_t cap = nsym < 64 ? 64 : nsym * 2;
        struct tok_sym *p = realloc(sc->syms, cap * sizeof *p);
        if (!p) return false;
        sc->syms = p;
        sc->syms_cap = cap;
    }
    /* The seed pushes n-1 entries; merges grow the heap on demand. */
    return heap_reserve(sc, nsym + 8);
}

/* "a before b" in pop order. */
static inline bool bpe_before(const struct tok_heap_ent *a, const struct tok_heap_ent *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}
static inline bool spm_before(const struct tok_heap_ent *a, const struct tok_heap_ent *b) {
    return a->score != b->score ? a->score > b->score : a->pos < b->pos;
}

#define HEAP_FUNCS(NAME, BEFORE)                                                     \
    static void NAME##_push(struct tok_heap_ent *h, size_t *n, struct tok_heap_ent e) { \
        size_t i = (*n)++;                                                           \
        while (i > 0) {                                                              \
            size_t p = (i - 1) / 2;                                                  \
            if (!BEFORE(&e, &h[p])) break;                                           \
            h[i] = h[p];                                                             \
            i = p;                                                                   \
        }                                                                            \
        h[i] = e;                                                                    \
    }                                                                                \
    static struct tok_heap_ent NAME##_pop(struct tok_heap_ent *h, size_t *n) {       \
        struct tok_heap_ent top = h[0], last = h[--(*n)];                            \
        size_t i = 0, m = *n;                                                        \
        for (;;) {                                                                   \
            size_t l = 2 * i + 1, r = l + 1, best = i;                               \
            const struct tok_heap_ent *bv = &last;                                   \
            if (l < m && BEFORE(&h[l], bv)) { best = l; bv = &h[l]; }                \
            if (r < m && BEFORE(&h[r], bv)) { best = r; }                            \
            if (best == i) break;                                                    \
            h[i] = h[best];                                                          \
            i = best;                                                                \
        }                                                                            \
        if (m > 0) h[i] = last;                                                      \
        return top;                                                                  \
    }
HEAP_FUNCS(bpeh, bpe_before)
HEAP_FUNCS(spmh, spm_before)

static fl_status oom(void) { return FL_ERR(FL_ERR_OOM, "out of memory while tokenizing"); }

static fl_status bpe_encode(const fl_tokenizer *tok, tok_bpe_scratch *sc, const char *w, size_t n,
                            tok_ids *out) {
    if (tok->ignore_merges) {
        int32_t id = tok_strmap_get(&tok->model_map, tok, w, n);
        if (id >= 0) return tok_ids_push(out, id) ? FL_OK : oom();
    }
    if (!sc_reserve(sc, n + 1)) return oom();
    struct tok_sym *sy = sc->syms;
    int32_t ns = 0;
    int32_t unk_off = -1, unk_len = 0; /* pending unk (HF keeps one to fuse) */
#define ADD_SYM(ID, OFF, LEN)                                 \
    do {                                                       \
        sy[ns].id = (ID); sy[ns].off = (uint32_t)(OFF);        \
        sy[ns].len = (uint32_t)(LEN); sy[ns].prev = ns - 1;    \
        sy[ns].next = ns + 1; ns++;                            \
    } while (0)
    for (size_t i = 0; i < n;) {
        size_t cl;
        int32_t cp = tok_u8dec(w + i, n - i, &cl);
        int32_t id = cp < TOK_CP_TABLE ? tok->cp_id[cp] : tok_strmap_get(&tok->model_map, tok, w + i, cl);
        if (id >= 0) {
            if (unk_off >= 0) { ADD_SYM(tok->unk_id, unk_off, unk_len); unk_off = -1; }
            ADD_SYM(id, i, cl);
        } else {
            bool done = false;
            if (tok->byte_fallback) {
                bool all = true;
                for (size_t k = 0; k < cl; k++)
                    if (tok->byte_ids[(unsigned char)w[i + k]] < 0) all = false;
                if (all) {
                    for (size_t k = 0; k < cl; k++) ADD_SYM(tok->byte_ids[(unsigned char)w[i + k]], i + k, 1);
                    done = true;
                }
            }
            if (!done && tok->unk_id >= 0) {
                if (unk_off >= 0 && tok->fuse_unk) {
                    unk_len += (int32_t)cl;
                } else {
                    if (unk_off >= 0) ADD_SYM(tok->unk_id, unk_off, unk_len);
                    unk_off = (int32_t)i;
                    unk_len = (int32_t)cl;
                }
            }
            /* No unk token: HF drops the character. */
        }
        i += cl;
    }
    if (unk_off >= 0) ADD_SYM(tok->unk_id, unk_off, unk_len);
#undef ADD_SYM
    if (ns == 0) return FL_OK;
    sy[ns - 1].next = -1;

    struct tok_heap_ent *h = sc->heap;
    size_t hn = 0;
    int32_t rank, merged;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (tok_pairmap_get(&tok->merges, sy[i].id, sy[i + 1].id, &rank, &merged))
            bpeh_push(h, &hn, (struct tok_heap_ent){0, rank, i, merged});
    while (hn > 0) {
        struct tok_heap_ent top = bpeh_pop(h, &hn);
        struct tok_sym *L = &sy[top.pos];
        if (L->len == 0 || L->next < 0) continue;
        struct tok_sym *R = &sy[L->next];
        if (!tok_pairmap_get(&tok->merges, L->id, R->id, &rank, &merged) || merged != top.aux) continue;
        L->id = merged;
        L->len += R->len;
        R->len = 0;
        L->next = R->next;
        if (L->next >= 0) sy[L->next].prev = top.pos;
        if (!heap_reserve(sc, hn + 2)) return oom();
        h = sc->heap;
        if (L->prev >= 0 && tok_pairmap_get(&tok->merges, sy[L->prev].id, L->id, &rank, &merged))
            bpeh_push(h, &hn, (struct tok_heap_ent){0, rank, L->prev, merged});
        if (L->next >= 0 && tok_pairmap_get(&tok->merges, L->id, sy[L->next].id, &rank, &merged))
            bpeh_push(h, &hn, (struct tok_heap_ent){0, rank, top.pos, merged});
    }
    for (int32_t i = 0; i >= 0; i = sy[i].next)
        if (!tok_ids_push(out, sy[i].id)) return oom();
    return FL_OK;
}

static void spm_try(const fl_tokenizer *tok, const char *w, struct tok_sym *sy, int32_t l, int32_t r,
                    struct tok_heap_ent *h, size_t *hn) {
    if (l < 0 || r < 0) return;
    uint32_t len = sy[l].len + sy[r].len;
    int32_t id = tok_strmap_get(&tok->model_map, tok, w + sy[l].off, len);
    if (id < 0 || !(tok->attr[id] & ATTR_MERGEABLE)) return;
    spmh_push(h, hn, (struct tok_heap_ent){tok->scores ? tok->scores[id] : 0.0f, 0, l, (int32_t)len});
}

static fl_status spm_encode(const fl_tokenizer *tok, tok_bpe_scratch *sc, const char *w, size_t n,
                            tok_ids *out) {
    if (!sc_reserve(sc, n + 1)) return oom();
    struct tok_sym *sy = sc->syms;
    int32_t ns = 0;
    for (size_t i = 0; i < n;) {
        size_t cl = tok_u8len((unsigned char)w[i]);
        if (cl > n - i) cl = n - i;
        sy[ns] = (struct tok_sym){-1, ns - 1, ns + 1, (uint32_t)i, (uint32_t)cl};
        ns++;
        i += cl;
    }
    if (ns == 0) return FL_OK;
    sy[ns - 1].next = -1;
    struct tok_heap_ent *h = sc->heap;
    size_t hn = 0;
    for (int32_t i = 1; i < ns; i++) spm_try(tok, w, sy, i - 1, i, h, &hn);
    while (hn > 0) {
        struct tok_heap_ent top = spmh_pop(h, &hn);
        struct tok_sym *L = &sy[top.pos];
        if (L->len == 0 || L->next < 0) continue;
        struct tok_sym *R = &sy[L->next];
        if (R->len == 0 || L->len + R->len != (uint32_t)top.aux) continue;
        L->len += R->len;
        R->len = 0;
        L->next = R->next;
        if (L->next >= 0) sy[L->next].prev = top.pos;
        if (!heap_reserve(sc, hn + 2)) return oom();
        h = sc->heap;
        spm_try(tok, w, sy, L->prev, top.pos, h, &hn);
        spm_try(tok, w, sy, top.pos, L->next, h, &hn);
    }
    for (int32_t i = 0; i >= 0; i = sy[i].next) {
        int32_t id = tok_strmap_get(&tok->model_map, tok, w + sy[i].off, sy[i].len);
        if (id >= 0) {
            if (!tok_ids_push(out, id)) return oom();
            continue;
        }
        for (uint32_t k = 0; k < sy[i].len; k++) {
            int32_t b = tok->byte_ids[(unsigned char)w[sy[i].off + k]];
            if (b < 0) b = tok->unk_id;
            if (b < 0) continue; /* neither byte tokens nor unk: dropped */
            if (!tok_ids_push(out, b)) return oom();
        }
    }
    return FL_OK;
}

fl_status tok_model_encode(const fl_tokenizer *tok, tok_bpe_scratch *sc, const char *w, size_t n,
                           tok_ids *out) {
    if (n == 0) return FL_OK;
    if (n > INT32_MAX / 4) return FL_ERR(FL_ERR_INVALID_ARG, "a single pre-token of %zu bytes is too long", n);
    return tok->model == MODEL_SPM ? spm_encode(tok, sc, w, n, out) : bpe_encode(tok, sc, w, n, out);
}
