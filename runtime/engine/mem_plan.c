/*
 * mem_plan.c — the memory planner (see mem_plan.h).
 *
 * The weight walk mirrors runtime/model/model.c (which tensors a rank loads,
 * which rows or columns of them) and runtime/load/checkpoint.c (what each
 * stored kind becomes); the workspace comes from fl_forward_mem_size, which
 * sits next to fl_forward_init. tests/test_mem_plan_rss.c holds the prediction
 * against the resident memory measured while loading real checkpoints.
 */
#include "runtime/engine/mem_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/sampler.h"
#include "runtime/engine/kv_swap.h"
#include "runtime/load/quant.h"
#include "runtime/model/forward.h"

/* CUDA figures the planner cannot see without a device: the cuBLAS
 * workspace plus the decode-step graphs' pools, and NCCL's channel buffers
 * per peer. Estimates, labelled as such wherever they are printed. */
#define CUDA_GRAPH_EST ((size_t)256 << 20)
#define CUDA_NCCL_PER_PEER_EST ((size_t)64 << 20)

static const char *const kind_names[FL_MEM_W_KINDS] = {"attention", "mlp/experts", "embeddings", "lm_head",
                                                       "norms"};

const char *fl_mem_weight_kind_name(int kind) {
    return kind >= 0 && kind < FL_MEM_W_KINDS ? kind_names[kind] : "?";
}

fl_status fl_kv_dtype_parse(const char *s, fl_kv_dtype *out) {
    static const char *names[] = {"auto", "f32", "bf16", "int8", "fp8"};
    for (int i = 0; i < 5; i++)
        if (s && !strcmp(s, names[i])) {
            *out = (fl_kv_dtype)i;
            return FL_OK;
        }
    return FL_ERR(FL_ERR_INVALID_ARG, "KV cache dtype must be auto, f32, bf16, int8 or fp8, got '%s'", s ? s : "");
}

const char *fl_kv_dtype_name(fl_kv_dtype d) {
    switch (d) {
    case FL_KV_DTYPE_F32: return "f32";
    case FL_KV_DTYPE_BF16: return "bf16";
    case FL_KV_DTYPE_INT8: return "int8";
    case FL_KV_DTYPE_FP8: return "fp8";
    default: return "auto";
    }
}

fl_kv_dtype fl_kv_dtype_resolve(fl_kv_dtype d, fl_mem_backend be) {
    if (d != FL_KV_DTYPE_AUTO) return d;
    return be == FL_MEM_BACKEND_CUDA ? FL_KV_DTYPE_BF16 : FL_KV_DTYPE_F32;
}

int fl_kv_int8_group(const fl_model_config *c) {
    if (c->arch != FL_ARCH_DEEPSEEK_V2) return c->head_dim;
    int g = 64;
    while (g > 1 && c->head_dim % g) g /= 2;
    return g;
}

size_t fl_kv_token_layer_bytes(fl_kv_dtype d, int kv_heads, int head_dim, int int8_group) {
    const size_t n = (size_t)kv_heads * (size_t)head_dim;
    const int grp = int8_group > 0 ? int8_group : head_dim;
    switch (d) {
    case FL_KV_DTYPE_F32: return 2 * n * 4;
    case FL_KV_DTYPE_INT8:
    case FL_KV_DTYPE_FP8: return kv_heads > 0 && grp > 0 ? 2 * fl_kv_int8_record_bytes((int64_t)n, grp) : 0;
    default: return 2 * n * 2;
    }
}

/* ---- weights --------------------------------------------------------------- */

typedef struct walk {
    const fl_mem_plan_in *in;
    fl_mem_plan *p;
    const fl_model_dims *d;
    uintptr_t (*spans)[2]; /* page-aligned [lo, hi) of every tensor read from the mapping */
    size_t n_spans, cap_spans;
    bool oom;
    size_t kept;           /* tensors the model keeps (fl_model.host_owned) */
    int64_t w4_deq_elems;  /* CUDA: the largest packed W4 matrix (its dequantize scratch) */
    bool w4_packed;        /* CUDA: some W4 matrix is packed (the W4 GEMM's workspace) */
    int64_t fp8_in, fp8_rows; /* CUDA: the widest FP8 linear's input and the tallest's rows (scratch) */
} walk;

/* Records that the loader reads [p, p + n) of the mapping (CPU backend). */
static void span(walk *w, const void *p, size_t n) {
    if (w->in->backend != FL_MEM_BACKEND_CPU || !n) return;
    if (w->n_spans == w->cap_spans) {
        size_t cap = w->cap_spans ? 2 * w->cap_spans : 256;
        uintptr_t (*q)[2] = realloc(w->spans, cap * sizeof *q);
        if (!q) {
            w->oom = true;
            return;
        }
        w->spans = q, w->cap_spans = cap;
    }
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p;
    w->spans[w->n_spans][0] = a & ~(pg - 1);
    w->spans[w->n_spans][1] = (a + n + pg - 1) & ~(pg - 1);
    w->n_spans++;
}

static int cmp_span(const void *a, const void *b) {
    const uintptr_t x = ((const uintptr_t *)a)[0], y = ((const uintptr_t *)b)[0];
    return x < y ? -1 : x > y;
}

/* Bytes of the union of the recorded spans: the pages the load maps. */
static size_t span_union(walk *w) {
    if (w->n_spans == 0) return 0; /* presets map no file (and spans may be NULL) */
    qsort(w->spans, w->n_spans, sizeof *w->spans, cmp_span);
    size_t total = 0;
    uintptr_t lo = 0, hi = 0;
    for (size_t i = 0; i < w->n_spans; i++) {
        if (w->spans[i][0] > hi) {
            total += hi - lo;
            lo = w->spans[i][0], hi = w->spans[i][1];
        } else if (w->spans[i][1] > hi) {
            hi = w->spans[i][1];
        }
    }
    return total + (hi - lo);
}

/* One linear weight as a rank loads it: stored kind and what it becomes. */
typedef struct part {
    int kind;
    fl_dtype held;
    int group;
    int64_t rows, cols;
    bool copy;          /* the CPU holds a converted or copied buffer (not the mapping) */
} part;

static int rtn_group(int64_t cols) {
    return cols % 128 == 0 ? 128 : cols % 64 == 0 ? 64 : cols % 32 == 0 ? 32 : 0;
}

static size_t held_bytes(const walk *w, fl_dtype dt, int group, int64_t rows, int64_t cols, bool vec) {
    /* an FP8 linear: codes and f32 scales (CUDA: bf16 when cuBLASLt's FP8 GEMMs refuse the shape) */
    if (dt == FL_DTYPE_F8_E4M3 && !vec && (w->in->backend != FL_MEM_BACKEND_CUDA || (rows % 16 == 0 && cols % 16 == 0)))
        return (size_t)rows * (size_t)cols + (size_t)rows * 4;
    if (dt == FL_DTYPE_W4) {
        const size_t per_group = w->in->backend == FL_MEM_BACKEND_CUDA ? 4 : 8; /* bf16 or f32 scale+bias */
        return (size_t)rows * (size_t)(cols / 2) + (size_t)rows * (size_t)(cols / group) * per_group;
    }
    if (w->in->backend == FL_MEM_BACKEND_CUDA) return (size_t)rows * (size_t)cols * (vec ? 4 : 2);
    return (size_t)rows * fl_dtype_row_bytes(dt, cols);
}

/* What a matrix of `rows` rows (a stack of parts counts whole) adds to the
 * CUDA backend's scratch. W4: the dequantize scratch holds the largest W4
 * matrix in its packed layout (kernels/cuda/cuda_matmul.cu: rows % 16, cols
 * % 64, a power-of-two group >= 64; at most 256M elements) as uploaded, and
 * the first packed matrix makes the W4 GEMM's workspace. FP8: the widest
 * input and the tallest matrix size the activation codes and the tail's
 * output (kernels/cuda/cuda_fp8.cu). */
static void note_matrix(walk *w, const part *pt, int64_t rows) {
    if (w->in->backend != FL_MEM_BACKEND_CUDA) return;
    if (pt->held == FL_DTYPE_F8_E4M3) {
        if (pt->cols > w->fp8_in) w->fp8_in = pt->cols;
        if (rows > w->fp8_rows) w->fp8_rows = rows;
        return;
    }
    const int g = pt->group;
    if (pt->held != FL_DTYPE_W4 || rows % 16 || pt->cols % 64 || g < 64 || (g & (g - 1)) || pt->cols % g)
        return;
    w->w4_packed = true;
    const int64_t e = rows * pt->cols;
    if (e <= ((int64_t)256 << 20) && e > w->w4_deq_elems) w->w4_deq_elems = e;
}

/* The FP8 matmul's workspace (kernels/cuda/cuda_fp8.cu) at `tokens` tokens:
 * for cuBLASLt, codes and scales of the tokens padded to 16, each rounded to
 * 256 bytes, and the [rows, 16] bf16 tail; for the decode GEMV, f16 codes
 * of up to 16 tokens; whichever is larger. The workspace registry
 * (kernels/cuda/cuda_workspace.h) grows in powers of two from 1 MiB and
 * keeps the buffers it outgrew: up to twice the last one. */
static size_t fp8_scratch(int64_t tokens, int64_t in, int64_t rows) {
    if (!in) return 0;
    const size_t n16 = (size_t)(tokens + 15) / 16 * 16;
    size_t need = (n16 * (size_t)in + 255) / 256 * 256 + (n16 * 4 + 255) / 256 * 256 + (size_t)rows * 16 * 2;
    /* the decode GEMV's form (cuda_gemv_fp8.cu): f16 codes of at most 16 tokens and their scales */
    const size_t gemv = 2 * (size_t)(tokens < 16 ? tokens : 16) * (size_t)in + 64;
    if (gemv > need) need = gemv;
    size_t nb = (size_t)1 << 20;
    while (nb < need) nb *= 2;
    return 2 * nb - ((size_t)1 << 20);
}

static void add(walk *w, const part *pt, bool vec) {
    if (!vec) note_matrix(w, pt, pt->rows);
    size_t b = held_bytes(w, pt->held, pt->group, pt->rows, pt->cols, vec);
    w->p->weights[pt->kind] += b;
    w->p->weights_total += b;
    w->kept++;
    if (w->in->backend == FL_MEM_BACKEND_CPU && w->in->ck && !pt->copy) w->p->weights_aliased += b;
}

static fl_status linear_stored(walk *w, const char *prefix, int64_t out, int64_t in, int64_t rlo, int64_t nr,
                               int64_t nc, bool w4, part *pt);

/* Rows [rlo, rlo + nr) and nc of the columns of the [out, in] linear
 * `prefix` (a column block reads every row's pages). */
static fl_status linear(walk *w, int kind, const char *prefix, int64_t out, int64_t in, int64_t rlo, int64_t nr,
                        int64_t nc, bool quantize, part *pt) {
    const fl_mem_plan_in *I = w->in;
    const bool w4 = quantize && I->quant == FL_LOAD_W4;
    memset(pt, 0, sizeof *pt);
    pt->kind = kind;
    pt->rows = nr;
    pt->cols = nc;
    if (!I->ck) { /* synthetic (runtime/load/synth.c): bf16, W4 group 128 when it divides, or FP8 */
        const bool q = w4 && nc % 128 == 0;
        pt->held = q ? FL_DTYPE_W4 : quantize && I->quant == FL_LOAD_FP8 ? FL_DTYPE_F8_E4M3 : FL_DTYPE_BF16;
        pt->group = q ? 128 : 0;
        pt->copy = true;
        return FL_OK;
    }
    FL_TRY(linear_stored(w, prefix, out, in, rlo, nr, nc, w4, pt));
    /* --quantize fp8: the model loader turns float linears as loaded into FP8 */
    if (quantize && I->quant == FL_LOAD_FP8 && fl_quant_fp8_source(pt->held))
        pt->held = FL_DTYPE_F8_E4M3, pt->group = 0, pt->copy = true;
    return FL_OK;
}

/* linear() for a checkpoint: what the checkpoint loader makes of the block. */
static fl_status linear_stored(walk *w, const char *prefix, int64_t out, int64_t in, int64_t rlo, int64_t nr,
                               int64_t nc, bool w4, part *pt) {
    const fl_mem_plan_in *I = w->in;
    char name[512];
    snprintf(name, sizeof name, "%s.qweight", prefix);
    if (I->cfg->quant == FL_QUANT_AWQ && fl_ckpt_has(I->ck, name)) {
        /* AWQ: the block's words are read and repacked (their pages spanned
         * whole: the planner does not know the column offset, and a strided
         * block touches most pages of small rows anyway) */
        const fl_ckpt_tensor *t;
        static const char *sfx[3] = {"qweight", "qzeros", "scales"};
        for (int i = 0; i < 3; i++) {
            snprintf(name, sizeof name, "%s.%s", prefix, sfx[i]);
            FL_TRY(fl_ckpt_get(I->ck, name, &t));
            span(w, t->data, t->nbytes);
        }
        pt->held = FL_DTYPE_W4;
        pt->group = I->cfg->quant_group_size;
        pt->copy = true;
        return FL_OK;
    }
    if (I->cfg->quant == FL_QUANT_GPTQ && fl_ckpt_has(I->ck, name)) {
        /* GPTQ: read and repacked like AWQ; act-order linears are held in f32 */
        const fl_ckpt_tensor *t;
        static const char *sfx[4] = {"qweight", "qzeros", "scales", "g_idx"};
        const int g = I->cfg->quant_group_size ? I->cfg->quant_group_size : (int)in;
        bool grouped = in % g == 0;
        for (int i = 0; i < 4; i++) {
            snprintf(name, sizeof name, "%s.%s", prefix, sfx[i]);
            if (i == 3 && !fl_ckpt_has(I->ck, name)) break;
            FL_TRY(fl_ckpt_get(I->ck, name, &t));
            span(w, t->data, t->nbytes);
            if (i == 3)
                grouped = grouped && t->dtype == FL_DTYPE_I32 && t->nbytes == (size_t)in * 4 &&
                          fl_quant_gptq_g_idx_trivial(t->data, in, g);
        }
        pt->held = grouped ? FL_DTYPE_W4 : FL_DTYPE_F32;
        pt->group = grouped ? (I->cfg->quant_group_size ? g : (int)nc) : 0; /* channel: one group per row of the block */
        pt->copy = true;
        return FL_OK;
    }
    snprintf(name, sizeof name, "%s.weight_packed", prefix);
    if (I->cfg->quant == FL_QUANT_CT_PACK && fl_ckpt_has(I->ck, name)) {
        /* compressed-tensors: read and repacked like AWQ */
        const fl_ckpt_tensor *t;
        static const char *sfx[3] = {"weight_packed", "weight_scale", "weight_zero_point"};
        for (int i = 0; i < 3; i++) {
            snprintf(name, sizeof name, "%s.%s", prefix, sfx[i]);
            if (i == 2 && !fl_ckpt_has(I->ck, name)) break;
            FL_TRY(fl_ckpt_get(I->ck, name, &t));
            span(w, t->data, t->nbytes);
        }
        pt->held = FL_DTYPE_W4;
        pt->group = I->cfg->quant_group_size ? I->cfg->quant_group_size : (int)nc; /* channel: one group per row of the block */
        pt->copy = true;
        return FL_OK;
    }
    const fl_ckpt_tensor *t;
    snprintf(name, sizeof name, "%s.weight", prefix);
    FL_TRY(fl_ckpt_get(I->ck, name, &t));
    if (t->ndim != 2 || t->shape[0] != out || t->shape[1] != in)
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" is not [%lld, %lld]", t->file, name, (long long)out,
                      (long long)in);
    const size_t row = fl_dtype_row_bytes(t->dtype, in);
    span(w, (const uint8_t *)t->data + (size_t)rlo * row, (size_t)nr * row);
    switch (t->dtype) {
    case FL_DTYPE_F8_E4M3: { /* dequantized to f32 (or RTN W4 with w4) from the block's bytes and scales */
        char sname[512];
        snprintf(sname, sizeof sname, "%s.%s", prefix, I->cfg->quant_scale_inv ? "weight_scale_inv" : "weight_scale");
        const fl_ckpt_tensor *sc;
        if (fl_ckpt_get(I->ck, sname, &sc) == FL_OK) span(w, sc->data, sc->nbytes);
        else fl_error_clear(); /* the loader names it */
        pt->held = w4 ? FL_DTYPE_W4 : FL_DTYPE_F32, pt->group = w4 ? rtn_group(nc) : 0, pt->copy = true;
        if (w4 && !pt->group)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" has %lld columns, not a multiple of 32: "
                          "cannot quantize to W4", t->file, name, (long long)nc);
        break;
    }
    case FL_DTYPE_Q4_0: case FL_DTYPE_Q4_1:
        pt->held = FL_DTYPE_W4, pt->group = 32, pt->copy = true;
        break;
    case FL_DTYPE_Q4_K:
        pt->held = FL_DTYPE_W4, pt->group = 32, pt->copy = true;
        break;
    case FL_DTYPE_Q2_K: case FL_DTYPE_Q3_K: case FL_DTYPE_Q5_K: case FL_DTYPE_Q6_K: case FL_DTYPE_Q8_K:
    case FL_DTYPE_IQ4_NL: case FL_DTYPE_IQ4_XS: /* decoded to f32 at load (or RTN W4 with w4) */
        pt->held = w4 ? FL_DTYPE_W4 : FL_DTYPE_F32, pt->group = w4 ? rtn_group(nc) : 0, pt->copy = true;
        break;
    default:
        if (w4) {
            pt->held = FL_DTYPE_W4, pt->group = rtn_group(nc), pt->copy = true;
            if (!pt->group)
                return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" has %lld columns, not a multiple of 32: "
                              "cannot quantize to W4", t->file, name, (long long)nc);
        } else {
            pt->held = t->dtype;
            pt->copy = nc != in; /* column blocks are copied row by row */
        }
    }
    return FL_OK;
}

/* Whether fl_model_keep_fused stacks these parts (a copy on the CPU). */
static bool fuses(const part *pts, int n, bool allow) {
    if (!allow) return false;
    const fl_dtype dt = pts[0].held;
    if (dt != FL_DTYPE_F32 && dt != FL_DTYPE_F16 && dt != FL_DTYPE_BF16 && dt != FL_DTYPE_W4 && dt != FL_DTYPE_Q8_0 &&
        dt != FL_DTYPE_F8_E4M3)
        return false;
    for (int i = 1; i < n; i++)
        if (pts[i].held != dt || pts[i].cols != pts[0].cols || pts[i].group != pts[0].group) return false;
    return true;
}

/* A 1-D tensor or its elements [lo, lo + n) (n < 0: all): kept as stored
 * when whole and float, else an f32 copy. */
static fl_status vec(walk *w, int kind, const char *name, int64_t total, int64_t n, bool force_copy, part *pt) {
    const fl_mem_plan_in *I = w->in;
    memset(pt, 0, sizeof *pt);
    pt->kind = kind;
    pt->rows = 1;
    pt->cols = n < 0 ? total : n;
    pt->held = FL_DTYPE_F32;
    pt->copy = true;
    if (!I->ck) return FL_OK;
    const fl_ckpt_tensor *t;
    FL_TRY(fl_ckpt_get(I->ck, name, &t));
    span(w, t->data, t->nbytes);
    const bool flt = t->dtype == FL_DTYPE_F32 || t->dtype == FL_DTYPE_F16 || t->dtype == FL_DTYPE_BF16;
    if (flt && (n < 0 || n == total)) pt->held = t->dtype, pt->copy = force_copy;
    return FL_OK;
}

static fl_status add_vec(walk *w, int kind, const char *name, int64_t total, int64_t n) {
    part pt;
    FL_TRY(vec(w, kind, name, total, n, false, &pt));
    add(w, &pt, true);
    return FL_OK;
}

static fl_status add_linear(walk *w, int kind, const char *prefix, int64_t out, int64_t in, int64_t rlo, int64_t nr,
                            int64_t nc, bool quantize) {
    part pt;
    FL_TRY(linear(w, kind, prefix, out, in, rlo, nr, nc, quantize, &pt));
    add(w, &pt, false);
    return FL_OK;
}

static fl_status add_mlp(walk *w, const char *g, const char *u, const char *dn, int64_t hidden, int64_t inter,
                         int64_t lo, int64_t n) {
    part pts[2];
    FL_TRY(linear(w, FL_MEM_W_MLP, g, inter, hidden, lo, n, hidden, true, &pts[0]));
    FL_TRY(linear(w, FL_MEM_W_MLP, u, inter, hidden, lo, n, hidden, true, &pts[1]));
    if (fuses(pts, 2, fl_model_fuse_wanted(true, pts[0].held, 2 * n))) {
        pts[0].copy = pts[1].copy = true;
        w->kept--; /* one stacked tensor for the two */
        note_matrix(w, &pts[0], pts[0].rows + pts[1].rows);
    }
    add(w, &pts[0], false);
    add(w, &pts[1], false);
    return add_linear(w, FL_MEM_W_MLP, dn, hidden, inter, 0, hidden, n, true);
}

#define NAME(buf, ...) snprintf((buf), sizeof(buf), __VA_ARGS__)

static fl_status mla_layer(walk *w, int l) {
    const fl_model_config *c = w->in->cfg;
    const fl_mla_config *a = &c->mla;
    const int64_t hidden = c->hidden_size, qk = a->qk_nope_head_dim + a->qk_rope_head_dim,
                  kvb = a->qk_nope_head_dim + a->v_head_dim, H = c->n_heads, hn = w->d->n_heads,
                  hlo = w->d->q_head_lo, rec = a->kv_lora_rank + a->qk_rope_head_dim;
    char n1[256];
    if (a->q_lora_rank > 0) {
        NAME(n1, "model.layers.%d.self_attn.q_a_proj", l);
        FL_TRY(add_linear(w, FL_MEM_W_ATTN, n1, a->q_lora_rank, hidden, 0, a->q_lora_rank, hidden, true));
        if (c->attention_bias) {
            NAME(n1, "model.layers.%d.self_attn.q_a_proj.bias", l);
            FL_TRY(add_vec(w, FL_MEM_W_ATTN, n1, a->q_lora_rank, -1));
        }
        NAME(n1, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
        FL_TRY(add_vec(w, FL_MEM_W_NORM, n1, a->q_lora_rank, -1));
        NAME(n1, "model.layers.%d.self_attn.q_b_proj", l);
        FL_TRY(add_linear(w, FL_MEM_W_ATTN, n1, H * qk, a->q_lora_rank, hlo * qk, hn * qk, a->q_lora_rank, true));
    } else {
        NAME(n1, "model.layers.%d.self_attn.q_proj", l);
        FL_TRY(add_linear(w, FL_MEM_W_ATTN, n1, H * qk, hidden, hlo * qk, hn * qk, hidden, true));
    }
    NAME(n1, "model.layers.%d.self_attn.kv_a_proj_with_mqa", l);
    FL_TRY(add_linear(w, FL_MEM_W_ATTN, n1, rec, hidden, 0, rec, hidden, true));
    if (c->attention_bias && w->in->ck) {
        NAME(n1, "model.layers.%d.self_attn.kv_a_proj_with_mqa.bias", l);
        FL_TRY(add_vec(w, FL_MEM_W_ATTN, n1, rec, -1));
    }
    NAME(n1, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
    FL_TRY(add_vec(w, FL_MEM_W_NORM, n1, a->kv_lora_rank, -1));
    NAME(n1, "model.layers.%d.self_attn.kv_b_proj", l);
    FL_TRY(add_linear(w, FL_MEM_W_ATTN, n1, H * kvb, a->kv_lora_rank, hlo * kvb, hn * kvb, a->kv_lora_rank, true));
    NAME(n1, "model.layers.%d.self_attn.o_proj", l);
    FL_TRY(add_linear(w, FL_MEM_W_ATTN, n1, hidden, H * a->v_head_dim, 0, hidden, hn * a->v_head_dim, true));
    NAME(n1, "model.layers.%d.self_attn.o_proj.bias", l);
    if (w->in->ck && fl_ckpt_has(w->in->ck, n1) && w->in->shard.tp_rank == 0)
        FL_TRY(add_vec(w, FL_MEM_W_ATTN, n1, hidden, -1));
    return FL_OK;
}

static fl_status gqa_layer(walk *w, int l) {
    const fl_model_config *c = w->in->cfg;
    const int64_t hidden = c->hidden_size, hd = c->head_dim, qd = (int64_t)c->n_heads * hd,
                  kvd = (int64_t)c->n_kv_heads * hd, q_n = w->d->n_heads * hd, kv_n = w->d->n_kv_heads * hd;
    static const char *proj[3] = {"q_proj", "k_proj", "v_proj"};
    const int64_t tot[3] = {qd, kvd, kvd}, cnt[3] = {q_n, kv_n, kv_n},
                  lo[3] = {w->d->q_head_lo * hd, w->d->kv_head_lo * hd, w->d->kv_head_lo * hd};
    char n1[256];
    part pts[3];
    for (int i = 0; i < 3; i++) {
        NAME(n1, "model.layers.%d.self_attn.%s", l, proj[i]);
        FL_TRY(linear(w, FL_MEM_W_ATTN, n1, tot[i], hidden, lo[i], cnt[i], hidden, true, &pts[i]));
    }
    /* both backends have the fused q/k norm + rope + store, so q|k|v stack
     * even with qk_norm unless FL_QKNORM_FUSE=0 (fl_model_qknorm_fused) */
    const bool fused = fuses(pts, 3, fl_model_fuse_wanted(false, pts[0].held, 0));
    for (int i = 0; i < 3; i++) {
        pts[i].copy |= fused;
        add(w, &pts[i], false);
    }
    if (fused) {
        w->kept -= 2;
        note_matrix(w, &pts[0], pts[0].rows + pts[1].rows + pts[2].rows);
    }
    if (c->attention_bias) {
        for (int i = 0; i < 3; i++) {
            NAME(n1, "model.layers.%d.self_attn.%s.bias", l, proj[i]);
            FL_TRY(vec(w, FL_MEM_W_ATTN, n1, tot[i], cnt[i], fused, &pts[i]));
            add(w, &pts[i], true);
        }
        if (fused) w->kept -= 2;
    }
    NAME(n1, "model.layers.%d.self_attn.o_proj", l);
    FL_TRY(add_linear(w, FL_MEM_W_ATTN, n1, hidden, qd, 0, hidden, q_n, true));
    NAME(n1, "model.layers.%d.self_attn.o_proj.bias", l);
    if (w->in->ck && fl_ckpt_has(w->in->ck, n1) && w->in->shard.tp_rank == 0)
        FL_TRY(add_vec(w, FL_MEM_W_ATTN, n1, hidden, -1));
    if (c->qk_norm) {
        NAME(n1, "model.layers.%d.self_attn.q_norm.weight", l);
        FL_TRY(add_vec(w, FL_MEM_W_NORM, n1, hd, -1));
        NAME(n1, "model.layers.%d.self_attn.k_norm.weight", l);
        FL_TRY(add_vec(w, FL_MEM_W_NORM, n1, hd, -1));
    }
    return FL_OK;
}

static fl_status layer(walk *w, int l) {
    const fl_model_config *c = w->in->cfg;
    const fl_model_dims *d = w->d;
    const int64_t hidden = c->hidden_size;
    char n1[256];
    NAME(n1, "model.layers.%d.input_layernorm.weight", l);
    FL_TRY(add_vec(w, FL_MEM_W_NORM, n1, hidden, -1));
    NAME(n1, "model.layers.%d.post_attention_layernorm.weight", l);
    FL_TRY(add_vec(w, FL_MEM_W_NORM, n1, hidden, -1));
    FL_TRY(c->arch == FL_ARCH_DEEPSEEK_V2 ? mla_layer(w, l) : gqa_layer(w, l));
    fl_mlp_names mn;
    if (!fl_model_config_layer_is_moe(c, l)) {
        fl_model_mlp_names(c, l, FL_MLP_DENSE, &mn);
        return add_mlp(w, mn.gate, mn.up, mn.down, hidden, c->intermediate_size, d->inter_lo, d->inter);
    }
    const bool mixtral = c->arch == FL_ARCH_MIXTRAL;
    const int64_t inter = mixtral ? c->intermediate_size : c->moe_intermediate_size;
    fl_model_router_name(c, l, n1);
    FL_TRY(add_linear(w, FL_MEM_W_MLP, n1, c->n_experts, hidden, 0, c->n_experts, hidden, false));
    for (int le = 0; le < d->n_experts; le++) {
        fl_model_mlp_names(c, l, d->expert_lo + le, &mn);
        FL_TRY(add_mlp(w, mn.gate, mn.up, mn.down, hidden, inter, d->moe_inter_lo, d->moe_inter));
    }
    if (c->shared_expert_intermediate_size > 0) {
        const bool ds = c->arch == FL_ARCH_DEEPSEEK_V2;
        fl_model_mlp_names(c, l, FL_MLP_SHARED, &mn);
        FL_TRY(add_mlp(w, mn.gate, mn.up, mn.down, hidden, c->shared_expert_intermediate_size, d->shared_inter_lo,
                       d->shared_inter));
        if (!ds && w->in->ck) {
            NAME(n1, "model.layers.%d.mlp.shared_expert_gate", l);
            FL_TRY(add_linear(w, FL_MEM_W_MLP, n1, 1, hidden, 0, 1, hidden, false));
        }
    }
    return FL_OK;
}

static fl_status weights(walk *w) {
    const fl_mem_plan_in *I = w->in;
    const fl_model_config *c = I->cfg;
    const int64_t V = c->vocab_size, H = c->hidden_size;
    part pt;
    /* embeddings: whole on every rank, float as stored, GGUF kinds as f32 */
    memset(&pt, 0, sizeof pt);
    pt.kind = FL_MEM_W_EMBED, pt.rows = V, pt.cols = H, pt.held = FL_DTYPE_BF16, pt.copy = true;
    if (I->ck) {
        const fl_ckpt_tensor *t;
        FL_TRY(fl_ckpt_get(I->ck, "model.embed_tokens.weight", &t));
        const bool flt = t->dtype == FL_DTYPE_F32 || t->dtype == FL_DTYPE_F16 || t->dtype == FL_DTYPE_BF16;
        pt.held = flt ? t->dtype : FL_DTYPE_F32;
        pt.copy = !flt;
        span(w, t->data, t->nbytes);
    }
    add(w, &pt, false);
    FL_TRY(add_vec(w, FL_MEM_W_NORM, "model.norm.weight", H, -1));
    const bool tied = !I->ck || c->tie_word_embeddings || !fl_ckpt_has(I->ck, "lm_head.weight");
    FL_TRY(linear(w, FL_MEM_W_HEAD, tied && I->ck ? "model.embed_tokens" : "lm_head", V, H, w->d->vocab_lo, w->d->vocab,
                  H, false, &pt));
    add(w, &pt, false);
    for (int l = 0; l < c->n_layers; l++) FL_TRY(layer(w, l));
    return FL_OK;
}

/* ---- the plan -------------------------------------------------------------- */

fl_status fl_mem_plan_compute(const fl_mem_plan_in *in, fl_mem_plan *p) {
    memset(p, 0, sizeof *p);
    const fl_model_config *c = in->cfg;
    fl_model_dims d;
    fl_shard sh = in->shard;
    FL_TRY(fl_model_dims_init(c, &sh, &d));
    walk w = {.in = in, .p = p, .d = &d};
    fl_status st = weights(&w);
    if (st == FL_OK && w.oom) st = FL_ERR(FL_ERR_OOM, "out of memory planning");
    if (st == FL_OK) p->file_pages = span_union(&w);
    free(w.spans);
    if (st != FL_OK) return st;
    /* the model's own host structures: layers, expert tables, the list of
     * kept tensors (grown by doubling from 64) */
    size_t cap = 64;
    while (cap < w.kept) cap *= 2;
    int moe_layers = 0;
    for (int l = 0; l < c->n_layers; l++) moe_layers += fl_model_config_layer_is_moe(c, l);
    p->bookkeeping = sizeof(fl_model) + (size_t)c->n_layers * sizeof(fl_layer_weights) +
                     (size_t)moe_layers * (size_t)d.n_experts * sizeof(fl_mlp_weights) + cap * sizeof(fl_tensor);
    p->rss_predicted = p->weights_total - p->weights_aliased + p->file_pages + p->bookkeeping;

    const int bs = in->block_size > 0 ? in->block_size : 16;
    p->kv_dtype = fl_kv_dtype_resolve(in->kv_dtype, in->backend);
    p->backend = in->backend;
    p->kv_heads = d.n_kv_heads;
    p->head_dim = c->head_dim;
    p->kv_token_bytes = (size_t)c->n_layers * fl_kv_token_layer_bytes(p->kv_dtype, d.n_kv_heads, c->head_dim, fl_kv_int8_group(c));
    p->kv_block_bytes = p->kv_token_bytes * (size_t)bs;
    p->max_model_len = in->max_model_len > 0 ? in->max_model_len : c->max_position_embeddings;
    if (p->max_model_len <= 0) p->max_model_len = 2048;

    const int seqs = in->max_num_seqs > 0 ? in->max_num_seqs : 1;
    fl_forward_limits lim = {
        .max_tokens = in->max_num_batched_tokens > 0 ? in->max_num_batched_tokens : 512,
        .max_seqs = seqs,
        .max_blocks = (p->max_model_len + bs - 1) / bs,
        .max_logits = seqs > 64 ? seqs : 64,
    };
    const bool cuda = in->backend == FL_MEM_BACKEND_CUDA;
    const int tp = in->tp > 1 ? in->tp : 1, dp = in->dp > 1 ? in->dp : 1;
    fl_forward_mem fm;
    fl_forward_mem_size(c, &d, cuda ? FL_DTYPE_BF16 : FL_DTYPE_F32, &lim, cuda, tp, cuda, &fm);
    p->workspace = fm.act;
    p->host_scratch = fm.host;
    /* the engine's host rows (rank 0 with dp > 1: every replica's) and the sampler's */
    const size_t rows = (size_t)lim.max_logits * (size_t)dp;
    const size_t engine_host = rows * (size_t)c->vocab_size * sizeof(float) + rows * sizeof(int32_t) +
                               fl_sampler_workspace_size(c->vocab_size) + rows * sizeof(fl_sample_row);
    p->logits = fm.logits_dev + fm.logits_host + engine_host;
    if (cuda) {
        p->graph_estimate = CUDA_GRAPH_EST;
        p->comm_estimate = tp > 1 ? CUDA_NCCL_PER_PEER_EST * (size_t)(tp - 1) : 0;
        p->w4_scratch = (size_t)w.w4_deq_elems * 2 + (w.w4_packed ? FL_CUDA_W4_GEMM_WS_BYTES : 0) +
                        fp8_scratch(lim.max_tokens, w.fp8_in, w.fp8_rows);
        /* in device memory: weights, the W4 scratch, activations, device logits, estimates */
        p->fixed = p->weights_total + p->w4_scratch + p->workspace + fm.logits_dev + p->graph_estimate +
                   p->comm_estimate;
    } else {
        p->fixed = p->weights_total + p->workspace + p->host_scratch + p->logits;
    }
    p->budget = in->budget;
    int64_t blocks = p->budget > p->fixed ? (int64_t)((p->budget - p->fixed) / p->kv_block_bytes) : 0;
    /* as the engine: no more than max_model_len x max_num_seqs tokens can be in use */
    const int64_t most = ((int64_t)p->max_model_len * seqs + bs - 1) / bs;
    p->kv_capped = blocks > most;
    if (p->kv_capped) blocks = most;
    p->swap_space = in->swap_space_bytes;
    fl_mem_plan_set_blocks(p, blocks, fl_kv_swap_pool_blocks(p->swap_space, p->kv_block_bytes, blocks), bs);
    return FL_OK;
}

void fl_mem_plan_set_blocks(fl_mem_plan *p, int64_t kv_blocks, int64_t swap_blocks, int block_size) {
    p->kv_blocks = kv_blocks;
    p->kv_tokens = kv_blocks * block_size;
    p->kv_seqs = p->max_model_len > 0 ? (double)p->kv_tokens / p->max_model_len : 0;
    p->swap_blocks = swap_blocks;
    p->swap_tokens = swap_blocks * block_size;
    p->swap_bytes = (size_t)swap_blocks * p->kv_block_bytes;
    const size_t kv = kv_blocks > 0 ? (size_t)kv_blocks * p->kv_block_bytes : 0;
    p->host_total = p->backend == FL_MEM_BACKEND_CPU ? p->fixed + kv + p->swap_bytes : 0;
}

fl_status fl_mem_plan_check(const fl_mem_plan *p) {
    if (p->weights_total > p->budget)
        return FL_ERR(FL_ERR_OOM, "the weights alone need %.1f MiB but the budget is %.1f MiB",
                      p->weights_total / 1048576.0, p->budget / 1048576.0);
    if (p->kv_blocks < 1)
        return FL_ERR(FL_ERR_OOM, "weights %.1f MiB + workspaces %.1f MiB leave no KV block (%.2f MiB) "
                      "in the budget of %.1f MiB", p->weights_total / 1048576.0,
                      (p->fixed - p->weights_total) / 1048576.0, p->kv_block_bytes / 1048576.0,
                      p->budget / 1048576.0);
    return FL_OK;
}

static void line(FILE *f, const char *prefix, const char *what, double bytes, const char *note) {
    fprintf(f, "%s%-34s %12.2f MiB%s%s\n", prefix, what, bytes / 1048576.0, note ? "  " : "", note ? note : "");
}

void fl_mem_plan_print(const fl_mem_plan *p, const char *prefix, FILE *f) {
    char what[64];
    for (int k = 0; k < FL_MEM_W_KINDS; k++) {
        snprintf(what, sizeof what, "weights: %s", kind_names[k]);
        line(f, prefix, what, (double)p->weights[k], NULL);
    }
    line(f, prefix, "weights: total", (double)p->weights_total, NULL);
    if (p->weights_aliased || p->file_pages) {
        line(f, prefix, "  of which used in place (mmap)", (double)p->weights_aliased, NULL);
        line(f, prefix, "checkpoint pages mapped", (double)p->file_pages, "(page cache, counted in RSS)");
        line(f, prefix, "resident once all weights are read", (double)p->rss_predicted, NULL);
    }
    fprintf(f, "%s%-34s %12zu B   (%s, %d KV heads x %d)\n", prefix, "KV per token (all layers)",
            p->kv_token_bytes, fl_kv_dtype_name(p->kv_dtype), p->kv_heads, p->head_dim);
    fprintf(f, "%s%-34s %12zu B\n", prefix, "KV per block", p->kv_block_bytes);
    if (p->w4_scratch)
        line(f, prefix, "W4 scratch", (double)p->w4_scratch,
             "(W4 dequantize copy + GEMM workspace, FP8 activation codes)");
    line(f, prefix, "activation workspace", (double)p->workspace, NULL);
    line(f, prefix, "host scratch", (double)p->host_scratch, NULL);
    line(f, prefix, "logits buffers", (double)p->logits, NULL);
    if (p->graph_estimate) line(f, prefix, "CUDA graphs + cuBLAS", (double)p->graph_estimate, "(estimate)");
    if (p->comm_estimate) line(f, prefix, "NCCL buffers", (double)p->comm_estimate, "(estimate)");
    if (p->budget) line(f, prefix, "budget", (double)p->budget, NULL);
    line(f, prefix, "KV cache", (double)p->kv_blocks * (double)p->kv_block_bytes,
         p->kv_capped ? "(capped: what max-model-len x max-num-seqs can use)" : NULL);
    fprintf(f, "%s%-34s %12lld tokens, %.1f sequences of %d\n", prefix, "KV capacity", (long long)p->kv_tokens,
            p->kv_seqs, p->max_model_len);
    const bool cpu = p->backend == FL_MEM_BACKEND_CPU;
    if (p->swap_blocks <= 0) {
        fprintf(f, "%s%-34s %12s      %s\n", prefix, "KV swap pool", "none",
                p->swap_space ? "(less than a block, or no cache: preemption recomputes)"
                              : "(--swap-space 0: preemption recomputes)");
        return;
    }
    line(f, prefix, cpu ? "KV swap pool (host memory)" : "KV swap pool (pinned host memory)", (double)p->swap_bytes,
         cpu ? "(allocated lazily: resident as blocks are swapped out)" : "(allocated at start, outside the budget)");
    fprintf(f, "%s%-34s %12lld tokens, %lld blocks%s\n", prefix, "KV swap capacity", (long long)p->swap_tokens,
            (long long)p->swap_blocks, p->swap_blocks == 4 * p->kv_blocks ? " (capped at 4x the cache)" : "");
    if (cpu) {
        char note[96] = "";
        if (p->budget && p->host_total > p->budget)
            snprintf(note, sizeof note, "(%.2f MiB over the budget: the pool comes on top of the cache)",
                     (p->host_total - p->budget) / 1048576.0);
        line(f, prefix, "host memory with a full pool", (double)p->host_total, note[0] ? note : NULL);
    }
}

size_t fl_mem_cpu_default_budget(void) {
    size_t half = fl_mem_host_available() / 2;
    if (half == 0) half = (size_t)4 << 30; /* no /proc/meminfo: a size most hosts have */
    return half < FL_MEM_CPU_BUDGET_MAX ? half : FL_MEM_CPU_BUDGET_MAX;
}

int fl_mem_default_batched_tokens(fl_mem_backend be) { return be == FL_MEM_BACKEND_CUDA ? 8192 : 512; }

int fl_mem_default_max_seqs(int64_t kv_tokens, int max_model_len) {
    const int64_t avg = max_model_len > 2 ? max_model_len / 2 : 1;
    int64_t n = kv_tokens / avg;
    if (n > FL_MEM_MAX_SEQS_DEFAULT) n = FL_MEM_MAX_SEQS_DEFAULT;
    return n < 1 ? 1 : (int)n;
}

fl_status fl_mem_parse_size(const char *flag, const char *s, size_t *out) {
    char *end = NULL;
    const double v = s ? strtod(s, &end) : 0;
    double mul = 1;
    if (end && !strcmp(end, "%")) {
        if (!(v > 0 && v <= 100))
            return FL_ERR(FL_ERR_INVALID_ARG, "--%s: a percentage must be in (0, 100], got '%s'", flag, s);
        *out = (size_t)(v / 100.0 * (double)fl_mem_host_available());
        return FL_OK;
    }
    if (end && *end) {
        const char *units = "KMGT", *u = strchr(units, end[0] & ~0x20);
        mul = u && end[0] ? (double)((size_t)1 << (10 * (u - units + 1))) : 0;
        const char *rest = end + 1;
        if (mul && *rest && strcmp(rest, "B") && strcmp(rest, "iB")) mul = 0;
    }
    if (!s || end == s || !(v > 0) || mul == 0)
        return FL_ERR(FL_ERR_INVALID_ARG, "--%s must be a size in bytes (e.g. 8G, 512M) or a percentage of "
                      "available memory (e.g. 50%%), got '%s'", flag, s ? s : "");
    *out = (size_t)(v * mul);
    return FL_OK;
}

size_t fl_mem_host_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char buf[256];
    unsigned long long kb = 0;
    while (fgets(buf, sizeof buf, f))
        if (sscanf(buf, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (size_t)kb * 1024;
}

size_t fl_mem_rss(void) { return fl_model_mem_in_use(NULL); }
