/*
 * gguf.c — reader for GGUF v2/v3 files (llama.cpp's model format).
 *
 * The file is mmap'd once (fl_mapfile) and parsed in place:
 *
 *   "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv   x { string key | u32 value type | value }
 *   n_tensors x { string name | u32 n_dims | i64 ne[n_dims] | u32 ggml type | u64 offset }
 *   padding to general.alignment (default 32) | tensor data
 *
 * (string = u64 length + bytes, no NUL; ne[] is innermost-first.)
 *
 * Every length, count and offset is checked against the bytes that remain
 * before it is used, and every product against overflow, so a truncated or
 * hostile file yields FL_ERR_FORMAT naming the file and the key or tensor,
 * never an out-of-bounds read. Tensor kinds we cannot compute with yet yield
 * FL_ERR_UNSUPPORTED naming the tensor and the ggml type.
 *
 * The result is an fl_ckpt (checkpoint_impl.h) whose tensors carry Hugging
 * Face names and row-major shapes, so the model builder never sees GGUF
 * conventions. The parsed key/values stay alive in ck->aux (gguf_meta) because
 * the tokenizer (fl_gguf_tokenizer) is built from them later.
 *
 * RoPE layout: llama.cpp's convert_hf_to_gguf.py permutes the q_proj/k_proj
 * rows of "llama" models (LlamaModel.permute) so that llama.cpp can rotate
 * consecutive pairs (LLAMA_ROPE_TYPE_NORM); Qwen2 weights are stored
 * unpermuted and rotated as halves (LLAMA_ROPE_TYPE_NEOX). We keep the stored
 * weights and record the layout in cfg.rope.interleaved instead of
 * un-permuting at load time, which keeps the weights zero-copy. deepseek2
 * (DeepSeek-V2) weights are not permuted: HF and llama.cpp both rotate its
 * q_pe / k_pe in pairs; its split attn_k_b / attn_v_b are joined back into
 * kv_b_proj at open (gguf_mla.h), the one copy this reader makes.
 */
#include "runtime/load/gguf.h"

#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/gguf_kquant.h"
#include "runtime/load/checkpoint_impl.h"
#include "runtime/load/gguf_mla.h"
#include "runtime/load/gguf_moe.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c reads little-endian GGUF files in place and assumes a little-endian host"
#endif

/* ------------------------------------------------------------------------ */
/* Value types and ggml tensor types                                         */
/* ------------------------------------------------------------------------ */

enum gguf_vtype {
    GV_U8 = 0, GV_I8 = 1, GV_U16 = 2, GV_I16 = 3, GV_U32 = 4, GV_I32 = 5, GV_F32 = 6,
    GV_BOOL = 7, GV_STRING = 8, GV_ARRAY = 9, GV_U64 = 10, GV_I64 = 11, GV_F64 = 12,
    GV_COUNT
};

static const char *vtype_name(uint32_t t) {
    static const char *const names[GV_COUNT] = {
        "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
    };
    return t < GV_COUNT ? names[t] : "unknown";
}

/* Size of one fixed-size value; 0 for string and array (variable). */
static size_t vtype_size(uint32_t t) {
    switch (t) {
    case GV_U8: case GV_I8: case GV_BOOL: return 1;
    case GV_U16: case GV_I16: return 2;
    case GV_U32: case GV_I32: case GV_F32: return 4;
    case GV_U64: case GV_I64: case GV_F64: return 8;
    default: return 0;
    }
}

/* ggml type ids as written in files (ggml.h enum ggml_type). Only the names
 * matter for the ones we do not support: they make the error actionable. */
static const char *ggml_type_name(uint32_t t) {
    static const char *const names[] = {
        [0] = "F32", [1] = "F16", [2] = "Q4_0", [3] = "Q4_1", [6] = "Q5_0", [7] = "Q5_1",
        [8] = "Q8_0", [9] = "Q8_1", [10] = "Q2_K", [11] = "Q3_K", [12] = "Q4_K", [13] = "Q5_K",
        [14] = "Q6_K", [15] = "Q8_K", [16] = "IQ2_XXS", [17] = "IQ2_XS", [18] = "IQ3_XXS",
        [19] = "IQ1_S", [20] = "IQ4_NL", [21] = "IQ3_S", [22] = "IQ2_S", [23] = "IQ4_XS",
        [24] = "I8", [25] = "I16", [26] = "I32", [27] = "I64", [28] = "F64", [29] = "IQ1_M",
        [30] = "BF16", [34] = "TQ1_0", [35] = "TQ2_0", [39] = "MXFP4", [40] = "NVFP4",
        [41] = "Q1_0",
    };
    if (t < sizeof names / sizeof names[0] && names[t]) return names[t];
    return NULL;
}

/* The ggml types we read: fl_dtype, elements per block, bytes per block. */
static bool ggml_type_info(uint32_t t, fl_dtype *dt, int64_t *blck, uint64_t *bsize) {
    switch (t) {
    case 0: *dt = FL_DTYPE_F32; *blck = 1; *bsize = 4; return true;
    case 1: *dt = FL_DTYPE_F16; *blck = 1; *bsize = 2; return true;
    case 2: *dt = FL_DTYPE_Q4_0; *blck = 32; *bsize = 18; return true;  /* f16 d, u8 qs[16] */
    case 3: *dt = FL_DTYPE_Q4_1; *blck = 32; *bsize = 20; return true;  /* f16 d, f16 m, u8 qs[16] */
    case 8: *dt = FL_DTYPE_Q8_0; *blck = 32; *bsize = 34; return true;  /* f16 d, i8 qs[32] */
    case 10: *dt = FL_DTYPE_Q2_K; break;
    case 11: *dt = FL_DTYPE_Q3_K; break;
    case 12: *dt = FL_DTYPE_Q4_K; break;
    case 13: *dt = FL_DTYPE_Q5_K; break;
    case 14: *dt = FL_DTYPE_Q6_K; break;
    case 15: *dt = FL_DTYPE_Q8_K; break;
    case 20: *dt = FL_DTYPE_IQ4_NL; break;
    case 23: *dt = FL_DTYPE_IQ4_XS; break;
    case 26: *dt = FL_DTYPE_I32; *blck = 1; *bsize = 4; return true;
    case 30: *dt = FL_DTYPE_BF16; *blck = 1; *bsize = 2; return true;
    default: return false;
    }
    /* the super-block kinds: sizes live with their decoders */
    size_t b;
    fl_kquant_block(*dt, blck, &b);
    *bsize = b;
    return true;
}

/* ------------------------------------------------------------------------ */
/* The metadata store (ck->aux)                                              */
/* ------------------------------------------------------------------------ */

typedef struct gguf_kv {
    char *key;             /* NUL-terminated copy */
    uint32_t type;         /* enum gguf_vtype */
    uint64_t u;            /* u8/u16/u32/u64/bool */
    int64_t i;             /* i8/i16/i32/i64 */
    double f;              /* f32/f64 */
    char *str;             /* GV_STRING: NUL-terminated copy */
    uint32_t arr_type;     /* GV_ARRAY: element type */
    uint64_t arr_n;        /* GV_ARRAY: element count */
    const uint8_t *arr_data; /* fixed-size elements: little-endian, in the mapping, maybe unaligned */
    char **arr_strs;       /* string elements: [arr_n] NUL-terminated, pointing into arr_buf */
    char *arr_buf;
} gguf_kv;

typedef struct gguf_meta {
    gguf_kv *kv;           /* [n_kv] in file order */
    size_t n_kv;
    uint32_t version;
    uint64_t alignment;
    uint64_t data_start;   /* file offset of the tensor data section */
    char **gguf_names;     /* [n_tensors] tensor names as stored, in file order (ck->tensors
                              is re-sorted by fl_ckpt_index, so do not index it with i) */
    size_t n_names;
} gguf_meta;

static void meta_free(void *p) {
    gguf_meta *m = p;
    if (!m) return;
    for (size_t i = 0; i < m->n_kv; i++) {
        free(m->kv[i].key);
        free(m->kv[i].str);
        free(m->kv[i].arr_strs);
        free(m->kv[i].arr_buf);
    }
    free(m->kv);
    for (size_t i = 0; i < m->n_names; i++) free(m->gguf_names[i]);
    free(m->gguf_names);
    free(m);
}

static const gguf_kv *kv_find(const gguf_meta *m, const char *key) {
    for (size_t i = 0; i < m->n_kv; i++)
        if (strcmp(m->kv[i].key, key) == 0) return &m->kv[i];
    return NULL;
}

static bool vtype_is_int(uint32_t t) {
    return t == GV_U8 || t == GV_I8 || t == GV_U16 || t == GV_I16 || t == GV_U32 ||
           t == GV_I32 || t == GV_U64 || t == GV_I64;
}
static bool vtype_is_signed(uint32_t t) {
    return t == GV_I8 || t == GV_I16 || t == GV_I32 || t == GV_I64;
}

/* Integer key in [lo, hi]. *found = false (and FL_OK) when absent and not
 * required. Wrong type or range: FL_ERR_FORMAT naming file and key. */
static fl_status kv_int(const gguf_meta *m, const char *path, const char *key, bool required,
                        int64_t lo, int64_t hi, int64_t *out, bool *found) {
    const gguf_kv *kv = kv_find(m, key);
    if (found) *found = kv != NULL;
    if (!kv) {
        if (required) return FL_ERR(FL_ERR_FORMAT, "%s: GGUF metadata lacks the required key '%s'", path, key);
        return FL_OK;
    }
    if (kv->type == GV_ARRAY)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF key '%s' is an array (per-layer values are not supported)",
                      path, key);
    if (!vtype_is_int(kv->type))
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' has type %s, expected an integer", path, key,
                      vtype_name(kv->type));
    if (vtype_is_signed(kv->type)) {
        if (kv->i < lo || kv->i > hi)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' = %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]",
                          path, key, kv->i, lo, hi);
        *out = kv->i;
    } else {
        if ((lo > 0 && kv->u < (uint64_t)lo) || (hi >= 0 && kv->u > (uint64_t)hi))
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' = %" PRIu64 " is out of range [%" PRId64 ", %" PRId64 "]",
                          path, key, kv->u, lo, hi);
        *out = (int64_t)kv->u;
    }
    return FL_OK;
}

/* Float key (f32/f64, or an integer). Same conventions as kv_int. */
static fl_status kv_float(const gguf_meta *m, const char *path, const char *key, bool required,
                          double *out, bool *found) {
    const gguf_kv *kv = kv_find(m, key);
    if (found) *found = kv != NULL;
    if (!kv) {
        if (required) return FL_ERR(FL_ERR_FORMAT, "%s: GGUF metadata lacks the required key '%s'", path, key);
        return FL_OK;
    }
    if (kv->type == GV_F32 || kv->type == GV_F64) *out = kv->f;
    else if (vtype_is_int(kv->type)) *out = vtype_is_signed(kv->type) ? (double)kv->i : (double)kv->u;
    else
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' has type %s, expected a number", path, key,
                      vtype_name(kv->type));
    return FL_OK;
}

/* String key; *out = NULL when absent and not required. */
static fl_status kv_str(const gguf_meta *m, const char *path, const char *key, bool required,
                        const char **out) {
    const gguf_kv *kv = kv_find(m, key);
    *out = NULL;
    if (!kv) {
        if (required) return FL_ERR(FL_ERR_FORMAT, "%s: GGUF metadata lacks the required key '%s'", path, key);
        return FL_OK;
    }
    if (kv->type != GV_STRING)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' has type %s, expected a string", path, key,
                      vtype_name(kv->type));
    *out = kv->str;
    return FL_OK;
}

static fl_status kv_bool(const gguf_meta *m, const char *path, const char *key, bool *out, bool *found) {
    const gguf_kv *kv = kv_find(m, key);
    if (found) *found = kv != NULL;
    if (!kv) return FL_OK;
    if (kv->type != GV_BOOL)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' has type %s, expected a bool", path, key,
                      vtype_name(kv->type));
    *out = kv->u != 0;
    return FL_OK;
}

/* Array key of element type `elem`; *out = NULL when absent. */
static fl_status kv_array(const gguf_meta *m, const char *path, const char *key, uint32_t elem,
                          const gguf_kv **out) {
    const gguf_kv *kv = kv_find(m, key);
    *out = NULL;
    if (!kv) return FL_OK;
    if (kv->type != GV_ARRAY || kv->arr_type != elem)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' has type %s%s%s, expected an array of %s", path, key,
                      vtype_name(kv->type), kv->type == GV_ARRAY ? " of " : "",
                      kv->type == GV_ARRAY ? vtype_name(kv->arr_type) : "", vtype_name(elem));
    *out = kv;
    return FL_OK;
}

/* A special-token id key; -1 when absent or outside [0, n_vocab). Like
 * llama.cpp ("bad special token ... using default id"), an out-of-range id
 * is treated as absent rather than failing the load: some converters write
 * 0xFFFFFFFF for "none". Non-integer values are still FL_ERR_FORMAT. */
static fl_status special_id(const gguf_meta *m, const char *path, const char *key, int64_t n_vocab,
                            int32_t *out) {
    const gguf_kv *kv = kv_find(m, key);
    *out = -1;
    if (!kv) return FL_OK;
    if (!vtype_is_int(kv->type))
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' has type %s, expected an integer", path, key,
                      vtype_name(kv->type));
    if (vtype_is_signed(kv->type) ? (kv->i >= 0 && kv->i < n_vocab) : kv->u < (uint64_t)n_vocab)
        *out = (int32_t)(vtype_is_signed(kv->type) ? kv->i : (int64_t)kv->u);
    return FL_OK;
}

/* ------------------------------------------------------------------------ */
/* Bounds-checked cursor over the mapping                                    */
/* ------------------------------------------------------------------------ */

typedef struct cursor {
    const uint8_t *base;
    size_t size;
    size_t pos;
    const char *path;
} cursor;

/* `what` names the thing being read ("key 'general.name'", "tensor #3 'x'"),
 * `field` the part of it ("value length"). */
static fl_status need(cursor *c, uint64_t n, const char *what, const char *field) {
    if (n > c->size - c->pos)
        return FL_ERR(FL_ERR_FORMAT,
                      "%s: GGUF file is truncated or corrupt: the %s of %s needs %" PRIu64
                      " bytes at offset %zu, but the file has only %zu bytes",
                      c->path, field, what, n, c->pos, c->size);
    return FL_OK;
}

static fl_status rd(cursor *c, void *dst, size_t n, const char *what, const char *field) {
    FL_TRY(need(c, n, what, field));
    memcpy(dst, c->base + c->pos, n);
    c->pos += n;
    return FL_OK;
}

/* A GGUF string: u64 length + bytes. Returns a pointer into the mapping. */
static fl_status rd_str(cursor *c, const char **s, uint64_t *len, const char *what, const char *field) {
    FL_TRY(rd(c, len, 8, what, field));
    if (*len > c->size - c->pos)
        return FL_ERR(FL_ERR_FORMAT,
                      "%s: GGUF file is truncated or corrupt: the %s of %s has length %" PRIu64
                      " at offset %zu, but only %zu bytes remain in the file",
                      c->path, field, what, *len, c->pos - 8, c->size - c->pos);
    *s = (const char *)(c->base + c->pos);
    c->pos += (size_t)*len;
    return FL_OK;
}

static char *dup_n(const char *s, uint64_t n) {
    char *d = malloc((size_t)n + 1);
    if (!d) return NULL;
    memcpy(d, s, (size_t)n);
    d[n] = 0;
    return d;
}

/* Nested arrays are legal GGUF but no key we read uses them; we validate and
 * skip them. The depth limit keeps hostile files from recursing forever. */
#define GGUF_MAX_ARRAY_DEPTH 8

static fl_status skip_array(cursor *c, int depth, const char *what) {
    uint32_t et;
    uint64_t n;
    if (depth > GGUF_MAX_ARRAY_DEPTH)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF %s nests arrays deeper than %d levels", c->path, what,
                      GGUF_MAX_ARRAY_DEPTH);
    FL_TRY(rd(c, &et, 4, what, "array element type"));
    FL_TRY(rd(c, &n, 8, what, "array length"));
    if (et >= GV_COUNT)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF %s has an array of unknown value type %" PRIu32, c->path, what, et);
    size_t esz = vtype_size(et);
    size_t left = c->size - c->pos;
    if (esz) {
        if (n > left / esz)
            return FL_ERR(FL_ERR_FORMAT,
                          "%s: GGUF %s declares %" PRIu64 " %s elements at offset %zu, more than the %zu bytes left",
                          c->path, what, n, vtype_name(et), c->pos, left);
        c->pos += (size_t)n * esz;
        return FL_OK;
    }
    /* every string takes >= 8 bytes, every array >= 12: bound the loop first */
    size_t min_el = et == GV_STRING ? 8 : 12;
    if (n > left / min_el)
        return FL_ERR(FL_ERR_FORMAT,
                      "%s: GGUF %s declares %" PRIu64 " %s elements at offset %zu, more than the %zu bytes left",
                      c->path, what, n, vtype_name(et), c->pos, left);
    for (uint64_t k = 0; k < n; k++) {
        if (et == GV_STRING) {
            const char *s;
            uint64_t len;
            FL_TRY(rd_str(c, &s, &len, what, "array string"));
        } else {
            FL_TRY(skip_array(c, depth + 1, what));
        }
    }
    return FL_OK;
}

/* Reads the value of one top-level key into kv (type already read). */
static fl_status parse_value(cursor *c, gguf_kv *kv, const char *what) {
    switch (kv->type) {
    case GV_U8: { uint8_t v; FL_TRY(rd(c, &v, 1, what, "value")); kv->u = v; return FL_OK; }
    case GV_BOOL: { uint8_t v; FL_TRY(rd(c, &v, 1, what, "value")); kv->u = v != 0; return FL_OK; }
    case GV_I8: { int8_t v; FL_TRY(rd(c, &v, 1, what, "value")); kv->i = v; return FL_OK; }
    case GV_U16: { uint16_t v; FL_TRY(rd(c, &v, 2, what, "value")); kv->u = v; return FL_OK; }
    case GV_I16: { int16_t v; FL_TRY(rd(c, &v, 2, what, "value")); kv->i = v; return FL_OK; }
    case GV_U32: { uint32_t v; FL_TRY(rd(c, &v, 4, what, "value")); kv->u = v; return FL_OK; }
    case GV_I32: { int32_t v; FL_TRY(rd(c, &v, 4, what, "value")); kv->i = v; return FL_OK; }
    case GV_U64: { uint64_t v; FL_TRY(rd(c, &v, 8, what, "value")); kv->u = v; return FL_OK; }
    case GV_I64: { int64_t v; FL_TRY(rd(c, &v, 8, what, "value")); kv->i = v; return FL_OK; }
    case GV_F32: { float v; FL_TRY(rd(c, &v, 4, what, "value")); kv->f = v; return FL_OK; }
    case GV_F64: { double v; FL_TRY(rd(c, &v, 8, what, "value")); kv->f = v; return FL_OK; }
    case GV_STRING: {
        const char *s;
        uint64_t len;
        FL_TRY(rd_str(c, &s, &len, what, "string value"));
        kv->str = dup_n(s, len);
        if (!kv->str) return FL_ERR(FL_ERR_OOM, "%s: out of memory copying %s", c->path, what);
        return FL_OK;
    }
    case GV_ARRAY: break;
    default:
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF %s has unknown value type %" PRIu32, c->path, what, kv->type);
    }

    size_t start = c->pos;
    FL_TRY(rd(c, &kv->arr_type, 4, what, "array element type"));
    FL_TRY(rd(c, &kv->arr_n, 8, what, "array length"));
    if (kv->arr_type == GV_ARRAY) { /* nested: validate, keep nothing */
        c->pos = start;
        return skip_array(c, 1, what);
    }
    if (kv->arr_type >= GV_COUNT)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF %s has an array of unknown value type %" PRIu32, c->path, what,
                      kv->arr_type);
    size_t esz = vtype_size(kv->arr_type);
    size_t left = c->size - c->pos;
    if (esz) {
        if (kv->arr_n > left / esz)
            return FL_ERR(FL_ERR_FORMAT,
                          "%s: GGUF %s declares %" PRIu64 " %s elements at offset %zu, more than the %zu bytes left",
                          c->path, what, kv->arr_n, vtype_name(kv->arr_type), c->pos, left);
        kv->arr_data = c->base + c->pos;
        c->pos += (size_t)kv->arr_n * esz;
        return FL_OK;
    }
    /* array of strings: validate and measure, then copy into one block */
    if (kv->arr_n > left / 8)
        return FL_ERR(FL_ERR_FORMAT,
                      "%s: GGUF %s declares %" PRIu64 " strings at offset %zu, more than the %zu bytes left",
                      c->path, what, kv->arr_n, c->pos, left);
    size_t first = c->pos;
    uint64_t total = 0;
    for (uint64_t k = 0; k < kv->arr_n; k++) {
        const char *s;
        uint64_t len;
        FL_TRY(rd_str(c, &s, &len, what, "array string"));
        total += len + 1; /* len <= file size, so no overflow */
    }
    kv->arr_strs = malloc((size_t)(kv->arr_n ? kv->arr_n : 1) * sizeof *kv->arr_strs);
    kv->arr_buf = malloc((size_t)(total ? total : 1));
    if (!kv->arr_strs || !kv->arr_buf) return FL_ERR(FL_ERR_OOM, "%s: out of memory copying %s", c->path, what);
    size_t end = c->pos;
    c->pos = first;
    char *dst = kv->arr_buf;
    for (uint64_t k = 0; k < kv->arr_n; k++) {
        uint64_t len;
        memcpy(&len, c->base + c->pos, 8);
        memcpy(dst, c->base + c->pos + 8, (size_t)len);
        dst[len] = 0;
        kv->arr_strs[k] = dst;
        dst += len + 1;
        c->pos += 8 + (size_t)len;
    }
    FL_ASSERT(c->pos == end);
    return FL_OK;
}

static int cmp_kv_ptr(const void *a, const void *b) {
    const gguf_kv *x = *(const gguf_kv *const *)a, *y = *(const gguf_kv *const *)b;
    return strcmp(x->key, y->key);
}

/* ------------------------------------------------------------------------ */
/* llama.cpp tensor names -> Hugging Face names                              */
/* ------------------------------------------------------------------------ */

/* Returns a malloc'd HF name, or a copy of `g` when we do not know it. */
static char *map_tensor_name(const char *g) {
    static const struct { const char *gguf, *hf; } globals[] = {
        { "token_embd.weight", "model.embed_tokens.weight" },
        { "output_norm.weight", "model.norm.weight" },
        { "output.weight", "lm_head.weight" },
    };
    static const struct { const char *gguf, *hf; } per_layer[] = {
        { "attn_norm", "input_layernorm" },
        { "attn_q", "self_attn.q_proj" },
        { "attn_k", "self_attn.k_proj" },
        { "attn_v", "self_attn.v_proj" },
        { "attn_output", "self_attn.o_proj" },
        { "attn_q_norm", "self_attn.q_norm" },
        { "attn_k_norm", "self_attn.k_norm" },
        { "ffn_norm", "post_attention_layernorm" },
        { "ffn_gate", "mlp.gate_proj" },
        { "ffn_up", "mlp.up_proj" },
        { "ffn_down", "mlp.down_proj" },
        /* Mixture of Experts (qwen2moe, qwen3moe); the stacked experts are
         * split per expert afterwards (gguf_moe.h) */
        { "ffn_gate_inp", "mlp.gate" },
        { "ffn_gate_exps", "mlp.experts.gate_proj" },
        { "ffn_up_exps", "mlp.experts.up_proj" },
        { "ffn_down_exps", "mlp.experts.down_proj" },
        { "ffn_gate_shexp", "mlp.shared_expert.gate_proj" },
        { "ffn_up_shexp", "mlp.shared_expert.up_proj" },
        { "ffn_down_shexp", "mlp.shared_expert.down_proj" },
        { "ffn_gate_inp_shexp", "mlp.shared_expert_gate" },
        /* DeepSeek-V2 multi-head latent attention (deepseek2); attn_k_b and
         * attn_v_b are joined into kv_b_proj afterwards (gguf_mla.h) */
        { "attn_q_a", "self_attn.q_a_proj" },
        { "attn_q_a_norm", "self_attn.q_a_layernorm" },
        { "attn_q_b", "self_attn.q_b_proj" },
        { "attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa" },
        { "attn_kv_a_norm", "self_attn.kv_a_layernorm" },
        { "attn_kv_b", "self_attn.kv_b_proj" },
        { "attn_k_b", "self_attn.k_b_proj" },
        { "attn_v_b", "self_attn.v_b_proj" },
    };
    for (size_t i = 0; i < sizeof globals / sizeof globals[0]; i++)
        if (strcmp(g, globals[i].gguf) == 0) return strdup(globals[i].hf);

    /* blk.<N>.<base>.<weight|bias> */
    if (strncmp(g, "blk.", 4) == 0) {
        const char *p = g + 4;
        long layer = 0;
        int nd = 0;
        while (*p >= '0' && *p <= '9' && nd < 7) layer = layer * 10 + (*p++ - '0'), nd++;
        if (nd > 0 && *p == '.') {
            const char *base = p + 1;
            const char *dot = strrchr(base, '.');
            if (dot && (strcmp(dot, ".weight") == 0 || strcmp(dot, ".bias") == 0)) {
                size_t blen = (size_t)(dot - base);
                for (size_t i = 0; i < sizeof per_layer / sizeof per_layer[0]; i++) {
                    if (strlen(per_layer[i].gguf) == blen && strncmp(base, per_layer[i].gguf, blen) == 0) {
                        size_t n = strlen("model.layers.") + 8 + strlen(per_layer[i].hf) + strlen(dot) + 2;
                        char *out = malloc(n);
                        if (out) snprintf(out, n, "model.layers.%ld.%s%s", layer, per_layer[i].hf, dot);
                        return out;
                    }
                }
            }
        }
    }
    return strdup(g); /* unknown (e.g. rope_freqs.weight): kept as is */
}

/* ------------------------------------------------------------------------ */
/* Model config from metadata                                               */
/* ------------------------------------------------------------------------ */

static bool has_gguf_tensor(const gguf_meta *m, const char *name) {
    for (size_t i = 0; i < m->n_names; i++)
        if (strcmp(m->gguf_names[i], name) == 0) return true;
    return false;
}

static const fl_ckpt_tensor *find_hf_tensor(const fl_ckpt *ck, const char *name) {
    for (size_t i = 0; i < ck->n_tensors; i++)
        if (strcmp(ck->tensors[i].name, name) == 0) return &ck->tensors[i];
    return NULL;
}

static void add_eos(fl_model_config *cfg, int id) {
    for (int i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_token_ids[i] == id) return;
    if (cfg->n_eos < FL_MAX_EOS) cfg->eos_token_ids[cfg->n_eos++] = id;
}

/* The Mixture-of-Experts keys of qwen2moe / qwen3moe and of llama files
 * with experts (Mixtral). llama.cpp has no key for HF's norm_topk_prob: it
 * normalizes the top-k weights for Mixtral and qwen3moe and not for
 * qwen2moe (as the HF configs of these families do), unless
 * <arch>.expert_weights_norm says otherwise. A layer without a router
 * (ffn_gate_inp) is dense, which is how HF's mlp_only_layers reaches GGUF. */
static fl_status moe_from_meta(const fl_ckpt *ck, const gguf_meta *m, const char *arch, fl_model_config *cfg) {
    const char *path = ck->path;
    char key[160];
    int64_t v = 0;
    bool found = false;
#define MKEY(suffix) (snprintf(key, sizeof key, "%s." suffix, arch), key)
    FL_TRY(kv_int(m, path, MKEY("expert_count"), true, 1, 65536, &v, NULL));
    cfg->n_experts = (int)v;
    FL_TRY(kv_int(m, path, MKEY("expert_used_count"), true, 1, cfg->n_experts, &v, NULL));
    cfg->n_experts_per_tok = (int)v;
    /* Mixtral's experts are feed_forward_length wide; llama.cpp writes no
     * expert_feed_forward_length for it */
    const bool mixtral = cfg->arch == FL_ARCH_MIXTRAL;
    v = cfg->intermediate_size;
    FL_TRY(kv_int(m, path, MKEY("expert_feed_forward_length"), !mixtral, 1, INT_MAX, &v, NULL));
    cfg->moe_intermediate_size = (int)v;
    FL_TRY(kv_int(m, path, MKEY("expert_shared_feed_forward_length"), false, 1, INT_MAX, &v, &found));
    if (found) cfg->shared_expert_intermediate_size = (int)v;
    else if (has_gguf_tensor(m, "blk.0.ffn_gate_shexp.weight"))
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF file has shared-expert tensors but no '%s'", path, key);
    cfg->norm_topk_prob = cfg->arch == FL_ARCH_QWEN3_MOE || mixtral;
    FL_TRY(kv_bool(m, path, MKEY("expert_weights_norm"), &cfg->norm_topk_prob, NULL));
#undef MKEY
    cfg->decoder_sparse_step = 1;
    return FL_OK;
}

/* DeepSeek-V2 ("deepseek2") as convert_hf_to_gguf.py's DeepseekV2Model
 * writes it. MLA sizes: attention.{q,kv}_lora_rank, rope.dimension_count
 * (qk_rope_head_dim) and attention.key_length_mla / value_length_mla
 * (nope + rope, v_head_dim; key_length itself is kv_lora + rope there), or
 * key_length / value_length in files of older converters (which kept
 * attn_kv_b whole). Routing: llama.cpp makes layers >= leading_dense_block_count
 * MoE, scales routed weights by expert_weights_scale, and limits experts to
 * groups only when expert_group_count / expert_group_used_count are written
 * (newer converters); without them it picks greedily, and so do we. YaRN:
 * rope.scaling.yarn_log_multiplier is 0.1 * mscale_all_dim, and llama.cpp's
 * deepseek2 keeps the rotation unscaled (HF's mscale == mscale_all_dim). */
static fl_status deepseek_from_meta(const fl_ckpt *ck, const gguf_meta *m, const char *arch, fl_model_config *cfg) {
    const char *path = ck->path;
    fl_mla_config *a = &cfg->mla;
    char key[160];
    int64_t v = 0, kl = 0, vl = 0;
    double d = 0;
    bool found = false, mla_keys = false;
#define DKEY(suffix) (snprintf(key, sizeof key, "%s." suffix, arch), key)
    FL_TRY(kv_int(m, path, DKEY("attention.q_lora_rank"), false, 1, INT_MAX, &v, &found));
    a->q_lora_rank = found ? (int)v : 0;
    FL_TRY(kv_int(m, path, DKEY("attention.kv_lora_rank"), true, 1, 4096, &v, NULL));
    a->kv_lora_rank = (int)v;
    FL_TRY(kv_int(m, path, DKEY("rope.dimension_count"), true, 2, 1024, &v, NULL));
    a->qk_rope_head_dim = (int)v;
    FL_TRY(kv_int(m, path, DKEY("attention.key_length_mla"), false, 1, 1024, &kl, &mla_keys));
    if (mla_keys) {
        FL_TRY(kv_int(m, path, DKEY("attention.value_length_mla"), true, 1, 1024, &vl, NULL));
    } else {
        FL_TRY(kv_int(m, path, DKEY("attention.key_length"), true, 1, 1024, &kl, NULL));
        FL_TRY(kv_int(m, path, DKEY("attention.value_length"), true, 1, 1024, &vl, NULL));
    }
    if (kl <= a->qk_rope_head_dim)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s.attention.%s' = %" PRId64 " must exceed %s.rope.dimension_count %d",
                      path, arch, mla_keys ? "key_length_mla" : "key_length", kl, arch, a->qk_rope_head_dim);
    a->qk_nope_head_dim = (int)(kl - a->qk_rope_head_dim);
    a->v_head_dim = (int)vl;
    if (a->qk_rope_head_dim % 2 || a->kv_lora_rank % 2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF %s.rope.dimension_count (%d) and %s.attention.kv_lora_rank (%d) "
                      "must be even", path, arch, a->qk_rope_head_dim, arch, a->kv_lora_rank);
    /* the cache holds one latent record per token (see model_config.h) */
    cfg->n_kv_heads = 1;
    cfg->head_dim = (a->kv_lora_rank + a->qk_rope_head_dim) / 2;
    cfg->rope.partial_rotary_factor = 1.0f;
    cfg->rope.interleaved = true;
    cfg->attention_bias = has_gguf_tensor(m, "blk.0.attn_kv_a_mqa.bias");
    if (cfg->rope.kind == FL_ROPE_YARN) {
        FL_TRY(kv_float(m, path, DKEY("rope.scaling.yarn_log_multiplier"), false, &d, &found));
        cfg->rope.mscale = cfg->rope.mscale_all_dim = found ? (float)(d / 0.1) : 0.0f;
        cfg->rope.attention_factor = 1.0f;
    }

    cfg->decoder_sparse_step = cfg->moe_layer_freq = 1;
    cfg->routed_scaling_factor = 1.0f;
    cfg->n_group = cfg->topk_group = 1;
    FL_TRY(kv_int(m, path, DKEY("expert_count"), false, 0, 65536, &v, &found));
    cfg->n_experts = found ? (int)v : 0;
    if (cfg->n_experts == 0) return FL_OK; /* a dense model */
    FL_TRY(kv_int(m, path, DKEY("expert_used_count"), true, 1, cfg->n_experts, &v, NULL));
    cfg->n_experts_per_tok = (int)v;
    FL_TRY(kv_int(m, path, DKEY("expert_feed_forward_length"), true, 1, INT_MAX, &v, NULL));
    cfg->moe_intermediate_size = (int)v;
    FL_TRY(kv_int(m, path, DKEY("expert_shared_count"), false, 0, 256, &v, &found));
    cfg->n_shared_experts = found ? (int)v : 0;
    cfg->shared_expert_intermediate_size = cfg->moe_intermediate_size * cfg->n_shared_experts;
    FL_TRY(kv_int(m, path, DKEY("leading_dense_block_count"), false, 0, cfg->n_layers, &v, &found));
    cfg->first_k_dense_replace = found ? (int)v : 0;
    FL_TRY(kv_float(m, path, DKEY("expert_weights_scale"), false, &d, &found));
    if (found && !(d > 0))
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' = %g must be positive", path, key, d);
    if (found) cfg->routed_scaling_factor = (float)d;
    cfg->norm_topk_prob = false;
    FL_TRY(kv_bool(m, path, DKEY("expert_weights_norm"), &cfg->norm_topk_prob, NULL));
    FL_TRY(kv_int(m, path, DKEY("expert_gating_func"), false, 0, INT_MAX, &v, &found));
    if (found && v != 1) /* llama.cpp: 1 softmax, 2 sigmoid (DeepSeek-V3) */
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF key '%s' = %" PRId64 " is not supported (only 1, softmax, is)",
                      path, key, v);
    int64_t groups = 1, used = 1;
    FL_TRY(kv_int(m, path, DKEY("expert_group_count"), false, 0, cfg->n_experts, &groups, NULL));
    FL_TRY(kv_int(m, path, DKEY("expert_group_used_count"), false, 0, cfg->n_experts, &used, NULL));
    cfg->topk_method = FL_TOPK_GREEDY;
    if (groups > 1) {
        cfg->topk_method = FL_TOPK_GROUP_LIMITED;
        cfg->n_group = (int)groups;
        cfg->topk_group = (int)used;
        if (used < 1 || cfg->n_experts % cfg->n_group || cfg->topk_group > cfg->n_group ||
            cfg->topk_group * (cfg->n_experts / cfg->n_group) < cfg->n_experts_per_tok)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF %s.expert_group_count %d / expert_group_used_count %d do not fit "
                          "%d experts with %d used", path, arch, cfg->n_group, cfg->topk_group, cfg->n_experts,
                          cfg->n_experts_per_tok);
    }
#undef DKEY
    for (int l = cfg->first_k_dense_replace; l < cfg->n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.exp_probs_b.bias", l);
        if (has_gguf_tensor(m, name))
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF tensor '%s' (DeepSeek-V3's noaux_tc routing bias) is not "
                          "supported", path, name);
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
        if (!has_gguf_tensor(m, name))
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF file lacks the router '%s': layers from %s.leading_dense_block_count "
                          "(%d) on are MoE", path, name, arch, cfg->first_k_dense_replace);
    }
    return FL_OK;
}

static fl_status config_from_meta(const fl_ckpt *ck, const gguf_meta *m, fl_model_config *cfg) {
    const char *path = ck->path;
    const char *arch = NULL;
    char key[160];
    int64_t v = 0;
    double d = 0;
    bool found = false;

    memset(cfg, 0, sizeof *cfg);
    FL_TRY(kv_str(m, path, "general.architecture", true, &arch));
    if (strcmp(arch, "llama") == 0) cfg->arch = FL_ARCH_LLAMA;
    else if (strcmp(arch, "qwen2") == 0) cfg->arch = FL_ARCH_QWEN2;
    else if (strcmp(arch, "qwen2moe") == 0) cfg->arch = FL_ARCH_QWEN2_MOE;
    else if (strcmp(arch, "qwen3moe") == 0) cfg->arch = FL_ARCH_QWEN3_MOE;
    else if (strcmp(arch, "deepseek2") == 0) cfg->arch = FL_ARCH_DEEPSEEK_V2;
    else
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: GGUF architecture '%.64s' (general.architecture) is not supported (llama, qwen2, "
                      "qwen2moe, qwen3moe, deepseek2 are)", path, arch);

#define AKEY(suffix) (snprintf(key, sizeof key, "%s." suffix, arch), key)
    FL_TRY(kv_int(m, path, AKEY("expert_count"), false, 0, INT_MAX, &v, &found));
    if (found && v > 0 && cfg->arch == FL_ARCH_LLAMA) cfg->arch = FL_ARCH_MIXTRAL; /* llama.cpp's Mixtral */
    if (found && v > 0 && cfg->arch == FL_ARCH_QWEN2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF qwen2 files with experts (%s = %" PRId64 ") are not supported",
                      path, key, v);

    FL_TRY(kv_int(m, path, AKEY("embedding_length"), true, 1, INT_MAX, &v, NULL));
    cfg->hidden_size = (int)v;
    FL_TRY(kv_int(m, path, AKEY("block_count"), true, 1, 65536, &v, NULL));
    cfg->n_layers = (int)v;
    FL_TRY(kv_int(m, path, AKEY("feed_forward_length"), true, 1, INT_MAX, &v, NULL));
    cfg->intermediate_size = (int)v;
    if (cfg->arch == FL_ARCH_MIXTRAL || cfg->arch == FL_ARCH_QWEN2_MOE || cfg->arch == FL_ARCH_QWEN3_MOE)
        FL_TRY(moe_from_meta(ck, m, arch, cfg));
    FL_TRY(kv_int(m, path, AKEY("context_length"), true, 1, INT_MAX, &v, NULL));
    cfg->max_position_embeddings = (int)v;
    FL_TRY(kv_int(m, path, AKEY("attention.head_count"), true, 1, INT_MAX, &v, NULL));
    cfg->n_heads = (int)v;
    cfg->n_kv_heads = cfg->n_heads;
    FL_TRY(kv_int(m, path, AKEY("attention.head_count_kv"), false, 1, INT_MAX, &v, &found));
    if (found) cfg->n_kv_heads = (int)v;
    FL_TRY(kv_float(m, path, AKEY("attention.layer_norm_rms_epsilon"), true, &d, NULL));
    if (!(d > 0 && d < 1))
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' = %g is not a valid epsilon", path, key, d);
    cfg->rms_norm_eps = (float)d;

    FL_TRY(kv_int(m, path, AKEY("attention.key_length"), false, 1, INT_MAX, &v, &found));
    if (found) {
        cfg->head_dim = (int)v;
    } else {
        if (cfg->hidden_size % cfg->n_heads != 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: %s.embedding_length %d is not a multiple of %s.attention.head_count %d",
                          path, arch, cfg->hidden_size, arch, cfg->n_heads);
        cfg->head_dim = cfg->hidden_size / cfg->n_heads;
    }

    /* vocabulary size: explicit key, else the token list, else the embedding rows */
    FL_TRY(kv_int(m, path, AKEY("vocab_size"), false, 1, INT_MAX, &v, &found));
    if (found) {
        cfg->vocab_size = (int)v;
    } else {
        const gguf_kv *toks = NULL;
        FL_TRY(kv_array(m, path, "tokenizer.ggml.tokens", GV_STRING, &toks));
        const fl_ckpt_tensor *emb = find_hf_tensor(ck, "model.embed_tokens.weight");
        if (toks && toks->arr_n > 0 && toks->arr_n <= INT_MAX) cfg->vocab_size = (int)toks->arr_n;
        else if (emb && emb->ndim == 2 && emb->shape[0] <= INT_MAX) cfg->vocab_size = (int)emb->shape[0];
        else
            return FL_ERR(FL_ERR_FORMAT,
                          "%s: cannot tell the vocabulary size: no %s.vocab_size, tokenizer.ggml.tokens or token_embd.weight",
                          path, arch);
    }

    /* RoPE */
    cfg->rope.kind = FL_ROPE_DEFAULT;
    cfg->rope.theta = 10000.0f;
    cfg->rope.factor = 1.0f;
    cfg->rope.beta_fast = 32.0f;
    cfg->rope.beta_slow = 1.0f;
    cfg->rope.partial_rotary_factor = 1.0f;
    /* see the file comment; Mixtral GGUF files are "llama" files too */
    cfg->rope.interleaved = cfg->arch == FL_ARCH_LLAMA || cfg->arch == FL_ARCH_MIXTRAL;
    FL_TRY(kv_float(m, path, AKEY("rope.freq_base"), false, &d, &found));
    if (found) {
        if (!(d > 0)) return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' = %g must be positive", path, key, d);
        cfg->rope.theta = (float)d;
    }
    FL_TRY(kv_int(m, path, AKEY("rope.dimension_count"), false, 1, INT_MAX, &v, &found));
    if (found) {
        if (v > cfg->head_dim || v % 2 != 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key '%s' = %" PRId64 " must be even and at most head_dim %d",
                          path, key, v, cfg->head_dim);
        cfg->rope.partial_rotary_factor = (float)v / (float)cfg->head_dim;
    }
    const char *scaling = NULL;
    FL_TRY(kv_str(m, path, AKEY("rope.scaling.type"), false, &scaling));
    FL_TRY(kv_float(m, path, AKEY("rope.scaling.factor"), false, &d, &found));
    if (found) cfg->rope.factor = (float)d;
    if (!found) { /* older files: rope.scale_linear */
        FL_TRY(kv_float(m, path, AKEY("rope.scale_linear"), false, &d, &found));
        if (found) {
            cfg->rope.factor = (float)d;
            if (!scaling && d != 1.0) scaling = "linear";
        }
    }
    FL_TRY(kv_int(m, path, AKEY("rope.scaling.original_context_length"), false, 1, INT_MAX, &v, &found));
    if (found) cfg->rope.original_max_pos = (int)v;
    if (scaling && strcmp(scaling, "none") != 0) {
        if (strcmp(scaling, "linear") == 0) {
            cfg->rope.kind = FL_ROPE_LINEAR;
        } else if (strcmp(scaling, "yarn") == 0) {
            cfg->rope.kind = FL_ROPE_YARN;
            FL_TRY(kv_float(m, path, AKEY("rope.scaling.yarn_beta_fast"), false, &d, &found));
            if (found) cfg->rope.beta_fast = (float)d;
            FL_TRY(kv_float(m, path, AKEY("rope.scaling.yarn_beta_slow"), false, &d, &found));
            if (found) cfg->rope.beta_slow = (float)d;
            FL_TRY(kv_float(m, path, AKEY("rope.scaling.attn_factor"), false, &d, &found));
            if (found) cfg->rope.attention_factor = (float)d;
        } else {
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF RoPE scaling '%.64s' (%s.rope.scaling.type) is not supported",
                          path, scaling, arch);
        }
        if (!(cfg->rope.factor > 0))
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF RoPE scaling factor %g must be positive", path, cfg->rope.factor);
    }
    /* Llama-3 style scaling is not described by keys: the converter stores
     * the per-frequency divisors as the tensor rope_freqs.weight, which the
     * model builder applies (kind stays DEFAULT). */
#undef AKEY

    cfg->tie_word_embeddings = !has_gguf_tensor(m, "output.weight");
    cfg->attention_bias = cfg->arch == FL_ARCH_QWEN2 || has_gguf_tensor(m, "blk.0.attn_q.bias");
    cfg->qk_norm = has_gguf_tensor(m, "blk.0.attn_q_norm.weight");
    for (int l = 0; cfg->n_experts > 0 && l < cfg->n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
        if (has_gguf_tensor(m, name)) continue;
        if (l >= 256)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF layer %d has no router (%s): dense layers among MoE ones are "
                          "supported in the first 256 layers only", path, l, name);
        cfg->mlp_only_layers_mask[l / 64] |= UINT64_C(1) << (l % 64);
    }

    if (cfg->arch == FL_ARCH_DEEPSEEK_V2) FL_TRY(deepseek_from_meta(ck, m, arch, cfg));

    /* special tokens */
    int32_t id;
    FL_TRY(special_id(m, path, "tokenizer.ggml.bos_token_id", cfg->vocab_size, &id));
    cfg->bos_token_id = id;
    static const char *const eos_keys[] = {
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
    };
    for (size_t i = 0; i < sizeof eos_keys / sizeof eos_keys[0]; i++) {
        FL_TRY(special_id(m, path, eos_keys[i], cfg->vocab_size, &id));
        if (id >= 0) add_eos(cfg, id);
    }
    cfg->quant = FL_QUANT_NONE;
    return FL_OK;
}

/* ------------------------------------------------------------------------ */
/* Open                                                                      */
/* ------------------------------------------------------------------------ */

typedef struct name_idx {
    const char *name;
    size_t idx;
} name_idx;

static int cmp_name_idx(const void *a, const void *b) {
    const name_idx *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->idx > y->idx) - (x->idx < y->idx);
}

/* Mapped names must be unique: two GGUF names mapping to one HF name (or a
 * name written twice) would make lookups ambiguous. Checked here so the
 * message can name both GGUF tensors. */
static fl_status check_unique_names(const fl_ckpt *ck, const gguf_meta *m) {
    fl_status st = FL_OK;
    size_t n = ck->n_tensors;
    if (n < 2) return FL_OK;
    name_idx *v = malloc(n * sizeof *v);
    if (!v) return FL_ERR(FL_ERR_OOM, "%s: out of memory checking tensor names", ck->path);
    for (size_t i = 0; i < n; i++) v[i] = (name_idx){ ck->tensors[i].name, i };
    qsort(v, n, sizeof *v, cmp_name_idx);
    for (size_t i = 1; i < n; i++) {
        if (strcmp(v[i - 1].name, v[i].name) == 0) {
            size_t a = v[i - 1].idx, b = v[i].idx; /* a < b: ties sort by index */
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF tensor name '%s' appears twice (tensor #%zu '%s' and #%zu '%s')",
                        ck->path, ck->tensors[a].name, a, m->gguf_names[a], b, m->gguf_names[b]);
            break;
        }
    }
    free(v);
    return st;
}

static fl_status parse_file(fl_ckpt *ck, gguf_meta *m) {
    const fl_mapfile *map = &ck->maps[0];
    cursor c = { .base = map->data, .size = map->size, .pos = 0, .path = ck->path };
    char what[256];
    char magic[4];
    uint64_t n_tensors = 0, n_kv = 0;

    /* header */
    if (c.size < 4 || (memcpy(magic, c.base, 4), memcmp(magic, "GGUF", 4) != 0))
        return FL_ERR(FL_ERR_FORMAT, "%s: not a GGUF file (the first 4 bytes are not \"GGUF\")", ck->path);
    c.pos = 4;
    FL_TRY(rd(&c, &m->version, 4, "the header", "version"));
    if (m->version == 1)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF version 1 is not supported (re-convert the model: v2 or v3 is needed)",
                      ck->path);
    if (m->version != 2 && m->version != 3) {
        if ((m->version & 0xffff) == 0 && (m->version >> 16) != 0)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: big-endian GGUF files are not supported (version field 0x%08" PRIx32 ")",
                          ck->path, m->version);
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF version %" PRIu32 " is not supported (2 and 3 are)", ck->path,
                      m->version);
    }
    FL_TRY(rd(&c, &n_tensors, 8, "the header", "tensor count"));
    FL_TRY(rd(&c, &n_kv, 8, "the header", "key/value count"));

    /* each key/value takes >= 13 bytes (key length, type, 1-byte value),
     * each tensor info >= 32: reject absurd counts before allocating */
    size_t left = c.size - c.pos;
    if (n_kv > left / 13)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF header declares %" PRIu64 " metadata keys, impossible in a %zu-byte file",
                      ck->path, n_kv, c.size);
    if (n_tensors > left / 32 || (n_kv > 0 && n_tensors > (left - 13 * n_kv) / 32))
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF header declares %" PRIu64 " tensors, impossible in a %zu-byte file",
                      ck->path, n_tensors, c.size);

    /* key/values */
    m->kv = calloc(n_kv ? (size_t)n_kv : 1, sizeof *m->kv);
    if (!m->kv) return FL_ERR(FL_ERR_OOM, "%s: out of memory for %" PRIu64 " GGUF keys", ck->path, n_kv);
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_kv *kv = &m->kv[i];
        const char *s;
        uint64_t len;
        snprintf(what, sizeof what, "metadata key #%" PRIu64, i);
        FL_TRY(rd_str(&c, &s, &len, what, "name"));
        kv->key = dup_n(s, len);
        if (!kv->key) return FL_ERR(FL_ERR_OOM, "%s: out of memory copying %s", ck->path, what);
        m->n_kv = (size_t)i + 1;
        snprintf(what, sizeof what, "metadata key '%.200s'", kv->key);
        FL_TRY(rd(&c, &kv->type, 4, what, "value type"));
        if (kv->type >= GV_COUNT)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF %s has unknown value type %" PRIu32 " at offset %zu", ck->path, what,
                          kv->type, c.pos - 4);
        FL_TRY(parse_value(&c, kv, what));
    }
    if (m->n_kv > 1) { /* keys must be unique, or lookups would depend on order */
        fl_status st = FL_OK;
        const gguf_kv **sorted = malloc(m->n_kv * sizeof *sorted);
        if (!sorted) return FL_ERR(FL_ERR_OOM, "%s: out of memory checking GGUF keys", ck->path);
        for (size_t i = 0; i < m->n_kv; i++) sorted[i] = &m->kv[i];
        qsort(sorted, m->n_kv, sizeof *sorted, cmp_kv_ptr);
        for (size_t i = 1; i < m->n_kv && st == FL_OK; i++)
            if (strcmp(sorted[i - 1]->key, sorted[i]->key) == 0)
                st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF metadata key '%.200s' appears twice", ck->path, sorted[i]->key);
        free(sorted);
        if (st != FL_OK) return st;
    }

    m->alignment = 32;
    const gguf_kv *al = kv_find(m, "general.alignment");
    if (al) {
        if (al->type != GV_U32)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key 'general.alignment' has type %s, expected u32", ck->path,
                          vtype_name(al->type));
        if (al->u == 0 || (al->u & (al->u - 1)) != 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF key 'general.alignment' = %" PRIu64 " is not a power of two",
                          ck->path, al->u);
        m->alignment = al->u;
    }

    /* tensor infos */
    ck->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *ck->tensors);
    m->gguf_names = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *m->gguf_names);
    if (!ck->tensors || !m->gguf_names)
        return FL_ERR(FL_ERR_OOM, "%s: out of memory for %" PRIu64 " tensors", ck->path, n_tensors);
    ck->n_tensors = (size_t)n_tensors; /* names are NULL until set: fl_ckpt_free copes */
    m->n_names = (size_t)n_tensors;
    uint64_t *offsets = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *offsets);
    if (!offsets) return FL_ERR(FL_ERR_OOM, "%s: out of memory for %" PRIu64 " tensors", ck->path, n_tensors);
    fl_status st = FL_OK;

    for (uint64_t i = 0; i < n_tensors; i++) {
        fl_ckpt_tensor *t = &ck->tensors[i];
        const char *s;
        uint64_t len;
        uint32_t n_dims, type;
        int64_t ne[FL_MAX_DIMS];
        snprintf(what, sizeof what, "tensor info #%" PRIu64, i);
        FL_TRY_GOTO(rd_str(&c, &s, &len, what, "name"), st, done);
        if (len == 0) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF tensor #%" PRIu64 " has an empty name", ck->path, i);
            goto done;
        }
        m->gguf_names[i] = dup_n(s, len);
        if (!m->gguf_names[i]) {
            st = FL_ERR(FL_ERR_OOM, "%s: out of memory copying tensor names", ck->path);
            goto done;
        }
        const char *gname = m->gguf_names[i];
        snprintf(what, sizeof what, "tensor '%.200s'", gname);
        FL_TRY_GOTO(rd(&c, &n_dims, 4, what, "n_dims"), st, done);
        if (n_dims == 0 || n_dims > FL_MAX_DIMS) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF tensor '%.200s' has n_dims %" PRIu32 " (1..%d allowed)", ck->path,
                        gname, n_dims, FL_MAX_DIMS);
            goto done;
        }
        int64_t numel = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            FL_TRY_GOTO(rd(&c, &ne[d], 8, what, "dimensions"), st, done);
            if (ne[d] < 0 || (ne[d] > 0 && numel > INT64_MAX / ne[d])) {
                st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF tensor '%.200s' has an invalid dimension ne[%" PRIu32 "] = %" PRId64
                            " (negative or element count overflows)", ck->path, gname, d, ne[d]);
                goto done;
            }
            numel *= ne[d];
        }
        FL_TRY_GOTO(rd(&c, &type, 4, what, "type"), st, done);
        FL_TRY_GOTO(rd(&c, &offsets[i], 8, what, "data offset"), st, done);

        fl_dtype dt;
        int64_t blck;
        uint64_t bsize;
        if (!ggml_type_info(type, &dt, &blck, &bsize)) {
            const char *tn = ggml_type_name(type);
            if (tn)
                st = FL_ERR(FL_ERR_UNSUPPORTED,
                            "%s: GGUF tensor '%.200s' has ggml type %s (%" PRIu32
                            "), which is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, "
                            "Q5_K, Q6_K, Q8_K, IQ4_NL, IQ4_XS, I32 are)",
                            ck->path, gname, tn, type);
            else
                st = FL_ERR(FL_ERR_UNSUPPORTED, "%s: GGUF tensor '%.200s' has unknown ggml type %" PRIu32, ck->path,
                            gname, type);
            goto done;
        }
        if (ne[0] % blck != 0) {
            st = FL_ERR(FL_ERR_FORMAT,
                        "%s: GGUF tensor '%.200s' (%s) has rows of %" PRId64 " elements, not a multiple of its %" PRId64
                        "-element block", ck->path, gname, ggml_type_name(type), ne[0], blck);
            goto done;
        }
        uint64_t nblocks = (uint64_t)(numel / blck);
        if (nblocks > UINT64_MAX / bsize || nblocks * bsize > SIZE_MAX) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF tensor '%.200s' is too large (%" PRId64 " elements)", ck->path, gname,
                        numel);
            goto done;
        }
        t->dtype = dt;
        t->ndim = (int)n_dims;
        for (uint32_t d = 0; d < n_dims; d++) t->shape[d] = ne[n_dims - 1 - d];
        t->nbytes = (size_t)(nblocks * bsize);
        t->file = map->path;
        t->name = map_tensor_name(gname);
        if (!t->name) {
            st = FL_ERR(FL_ERR_OOM, "%s: out of memory copying tensor names", ck->path);
            goto done;
        }
    }

    /* data section: starts at the next multiple of the alignment */
    uint64_t data_start = ((uint64_t)c.pos + m->alignment - 1) / m->alignment * m->alignment;
    m->data_start = data_start;
    if (n_tensors > 0 && data_start > c.size) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF file is truncated: tensor data should start at offset %" PRIu64
                    " but the file has only %zu bytes", ck->path, data_start, c.size);
        goto done;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        fl_ckpt_tensor *t = &ck->tensors[i];
        const char *gname = m->gguf_names[i];
        if (offsets[i] % m->alignment != 0) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF tensor '%.200s' has data offset %" PRIu64
                        ", not a multiple of the alignment %" PRIu64, ck->path, gname, offsets[i], m->alignment);
            goto done;
        }
        uint64_t avail = c.size - data_start;
        if (offsets[i] > avail || t->nbytes > avail - offsets[i]) {
            st = FL_ERR(FL_ERR_FORMAT,
                        "%s: GGUF tensor '%.200s' lies outside the file: %zu bytes at data offset %" PRIu64
                        " (file offset %" PRIu64 "), but the data section holds only %" PRIu64 " bytes",
                        ck->path, gname, t->nbytes, offsets[i], data_start + offsets[i], avail);
            goto done;
        }
        t->data = c.base + data_start + offsets[i];
    }
done:
    free(offsets);
    return st;
}

/* Keeps every special-token id of the metadata as stored: the config and the
 * tokenizer drop one outside the vocabulary, and fl_ckpt_validate must see
 * it to refuse the file, naming the key. Negative ids mean "none". */
static void record_token_keys(fl_ckpt *ck, const gguf_meta *m) {
    static const char *const keys[] = {
        "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.separator_token_id", "tokenizer.ggml.cls_token_id",
        "tokenizer.ggml.mask_token_id",
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const gguf_kv *kv = kv_find(m, keys[i]);
        if (!kv || !vtype_is_int(kv->type)) continue;
        int64_t v = vtype_is_signed(kv->type) ? kv->i
                    : kv->u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)kv->u;
        if (v < 0) continue;
        ck->token_keys[ck->n_token_keys].key = keys[i];
        ck->token_keys[ck->n_token_keys++].id = v;
    }
}

/* Maps the file and parses header, metadata and tensor infos into a new
 * checkpoint (*ck, freed by the caller either way). */
static fl_status open_meta(const char *path, fl_ckpt **out, gguf_meta **meta) {
    fl_status st = FL_OK;
    fl_ckpt *ck = NULL;
    gguf_meta *m = NULL;
    ck = calloc(1, sizeof *ck);
    FL_CHECK_ALLOC(ck, st, fail);
    ck->format = "gguf";
    ck->path = strdup(path);
    FL_CHECK_ALLOC(ck->path, st, fail);
    ck->maps = calloc(1, sizeof *ck->maps);
    FL_CHECK_ALLOC(ck->maps, st, fail);
    ck->n_maps = 1;
    FL_TRY_GOTO(fl_mapfile_open(path, &ck->maps[0]), st, fail);
    m = calloc(1, sizeof *m);
    FL_CHECK_ALLOC(m, st, fail);
    ck->aux = m;
    ck->aux_free = meta_free;

    FL_TRY_GOTO(parse_file(ck, m), st, fail);
fail:
    *out = ck;
    *meta = m;
    return st;
}

fl_status fl_gguf_open_vocab(const char *path, fl_ckpt **out) {
    if (!path || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_gguf_open_vocab: path and out are required");
    *out = NULL;
    fl_ckpt *ck = NULL;
    gguf_meta *m = NULL;
    fl_status st = open_meta(path, &ck, &m);
    if (st != FL_OK) {
        fl_ckpt_free(ck);
        return st;
    }
    *out = ck;
    return FL_OK;
}

fl_status fl_ckpt_open_gguf(const char *path, fl_ckpt **out) {
    if (!path || !out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_ckpt_open_gguf: path and out are required");
    *out = NULL;
    fl_ckpt *ck = NULL;
    gguf_meta *m = NULL;
    fl_status st = open_meta(path, &ck, &m);
    if (st != FL_OK) goto fail;
    FL_TRY_GOTO(fl_gguf_split_experts(ck->path, &ck->tensors, &m->gguf_names, &ck->n_tensors), st, fail);
    m->n_names = ck->n_tensors;
    FL_TRY_GOTO(check_unique_names(ck, m), st, fail);
    FL_TRY_GOTO(config_from_meta(ck, m, &ck->cfg), st, fail);
    if (ck->cfg.arch == FL_ARCH_MIXTRAL)
        FL_TRY_GOTO(fl_gguf_mixtral_names(ck->path, ck->tensors, ck->n_tensors), st, fail);
    if (ck->cfg.arch == FL_ARCH_DEEPSEEK_V2) {
        st = fl_gguf_deepseek_tensors(ck->path, &ck->cfg, &ck->tensors, &m->gguf_names, &ck->n_tensors, &ck->built,
                                      &ck->built_size);
        m->n_names = ck->n_tensors;
        if (st != FL_OK) goto fail;
    }
    record_token_keys(ck, m);

    const char *tmpl = NULL;
    FL_TRY_GOTO(kv_str(m, ck->path, "tokenizer.chat_template", false, &tmpl), st, fail);
    if (tmpl) {
        ck->chat_template = strdup(tmpl);
        FL_CHECK_ALLOC(ck->chat_template, st, fail);
    }
    FL_TRY_GOTO(fl_ckpt_index(ck), st, fail);
    *out = ck;
    return FL_OK;

fail:
    fl_ckpt_free(ck);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Tokenizer                                                                 */
/* ------------------------------------------------------------------------ */

fl_status fl_gguf_tokenizer(const fl_ckpt *ck, fl_tokenizer **out) {
    fl_status st = FL_OK;
    float *scores = NULL;
    int32_t *types = NULL;

    if (!out) return FL_ERR(FL_ERR_INVALID_ARG, "fl_gguf_tokenizer: out is NULL");
    *out = NULL;
    if (!ck || !ck->format || strcmp(ck->format, "gguf") != 0 || !ck->aux || ck->aux_free != meta_free)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s is not a GGUF checkpoint: no GGUF tokenizer metadata",
                      ck && ck->path ? ck->path : "(null)");
    const gguf_meta *m = ck->aux;
    const char *path = ck->path;

    fl_tokenizer_spec spec;
    memset(&spec, 0, sizeof spec);
    const char *model = NULL;
    FL_TRY(kv_str(m, path, "tokenizer.ggml.model", true, &model));
    if (strcmp(model, "gpt2") == 0) spec.kind = FL_TOK_BYTE_BPE;
    else if (strcmp(model, "llama") == 0) spec.kind = FL_TOK_SPM_BPE;
    else
        return FL_ERR(FL_ERR_UNSUPPORTED,
                      "%s: GGUF tokenizer model '%.64s' (tokenizer.ggml.model) is not supported (gpt2, llama are)",
                      path, model);
    FL_TRY(kv_str(m, path, "tokenizer.ggml.pre", false, &spec.pre));

    const gguf_kv *toks = NULL, *sc = NULL, *tt = NULL, *merges = NULL;
    FL_TRY(kv_array(m, path, "tokenizer.ggml.tokens", GV_STRING, &toks));
    if (!toks || toks->arr_n == 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF metadata lacks the token list 'tokenizer.ggml.tokens'", path);
    if (toks->arr_n > INT32_MAX)
        return FL_ERR(FL_ERR_FORMAT, "%s: GGUF 'tokenizer.ggml.tokens' has too many tokens (%" PRIu64 ")", path,
                      toks->arr_n);
    spec.n_vocab = (int)toks->arr_n;
    spec.tokens = (const char *const *)toks->arr_strs;

    FL_TRY(kv_array(m, path, "tokenizer.ggml.scores", GV_F32, &sc));
    if (sc) {
        if (sc->arr_n != toks->arr_n)
            return FL_ERR(FL_ERR_FORMAT, "%s: GGUF 'tokenizer.ggml.scores' has %" PRIu64 " entries for %d tokens",
                          path, sc->arr_n, spec.n_vocab);
        scores = malloc((size_t)spec.n_vocab * sizeof *scores); /* the mapping may be unaligned */
        FL_CHECK_ALLOC(scores, st, done);
        memcpy(scores, sc->arr_data, (size_t)spec.n_vocab * sizeof *scores);
        spec.scores = scores;
    }
    FL_TRY_GOTO(kv_array(m, path, "tokenizer.ggml.token_type", GV_I32, &tt), st, done);
    if (tt) {
        if (tt->arr_n != toks->arr_n) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF 'tokenizer.ggml.token_type' has %" PRIu64 " entries for %d tokens",
                        path, tt->arr_n, spec.n_vocab);
            goto done;
        }
        types = malloc((size_t)spec.n_vocab * sizeof *types);
        FL_CHECK_ALLOC(types, st, done);
        memcpy(types, tt->arr_data, (size_t)spec.n_vocab * sizeof *types);
        spec.token_types = types;
    }
    FL_TRY_GOTO(kv_array(m, path, "tokenizer.ggml.merges", GV_STRING, &merges), st, done);
    if (merges) {
        if (merges->arr_n > INT32_MAX) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF 'tokenizer.ggml.merges' has too many entries", path);
            goto done;
        }
        spec.n_merges = (int)merges->arr_n;
        spec.merges = (const char *const *)merges->arr_strs;
    }
    FL_TRY_GOTO(special_id(m, path, "tokenizer.ggml.bos_token_id", spec.n_vocab, &spec.bos_id), st, done);
    FL_TRY_GOTO(special_id(m, path, "tokenizer.ggml.eos_token_id", spec.n_vocab, &spec.eos_id), st, done);
    FL_TRY_GOTO(special_id(m, path, "tokenizer.ggml.unknown_token_id", spec.n_vocab, &spec.unk_id), st, done);
    FL_TRY_GOTO(special_id(m, path, "tokenizer.ggml.padding_token_id", spec.n_vocab, &spec.pad_id), st, done);
    /* llama.cpp's defaults when tokenizer.ggml.add_bos_token is absent: true
     * for SPM vocabularies and for the Llama-3 family of BPE pre-tokenizers */
    static const char *const bos_pre[] = {
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    };
    spec.add_bos = spec.kind == FL_TOK_SPM_BPE;
    for (size_t i = 0; spec.pre && i < sizeof bos_pre / sizeof bos_pre[0]; i++)
        if (strcmp(spec.pre, bos_pre[i]) == 0) spec.add_bos = true;
    FL_TRY_GOTO(kv_bool(m, path, "tokenizer.ggml.add_bos_token", &spec.add_bos, NULL), st, done);

    st = fl_tokenizer_init_from_vocab(&spec, out);
    if (st != FL_OK) {
        /* the vocabulary builder sees only the metadata: name the file */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", fl_error_msg());
        st = FL_ERR(st, "%s: %s", path, msg);
    }
done:
    free(scores);
    free(types);
    return st;
}
