/*
 * gguf_mla.c — DeepSeek-V2 GGUF tensors under their HF names, with the
 * split attn_k_b / attn_v_b joined back into kv_b_proj (see gguf_mla.h).
 */
#include "runtime/load/gguf_mla.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char SHEXP[] = ".mlp.shared_expert.";

static size_t find(const fl_ckpt_tensor *t, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(t[i].name, name) == 0) return i;
    return SIZE_MAX;
}

/* One layer whose kv_b_proj is joined from k_b (index ik) and v_b (iv). */
typedef struct join {
    int layer;
    size_t ik, iv;
    size_t off; /* byte offset of the joined tensor in the owned block */
} join;

/* Checks a split tensor against the shape the config implies; `ne` is the
 * GGUF (innermost-first) order the converter documents. */
static fl_status check_shape(const char *path, const char *gname, const fl_ckpt_tensor *t, const int64_t ne[3]) {
    if (t->ndim == 3 && t->shape[0] == ne[2] && t->shape[1] == ne[1] && t->shape[2] == ne[0]) return FL_OK;
    char got[96] = "";
    for (int d = t->ndim - 1, k = 0; d >= 0; d--)
        k += snprintf(got + k, sizeof got - (size_t)k, "%s%" PRId64, d == t->ndim - 1 ? "" : ", ", t->shape[d]);
    return FL_ERR(FL_ERR_FORMAT,
                  "%s: GGUF tensor '%s' has ne = [%s], expected [%" PRId64 ", %" PRId64 ", %" PRId64
                  "] from the MLA metadata (kv_lora_rank, key/value lengths, head_count)",
                  path, gname, got, ne[0], ne[1], ne[2]);
}

static bool plain_float(fl_dtype dt) { return dt == FL_DTYPE_F32 || dt == FL_DTYPE_F16 || dt == FL_DTYPE_BF16; }

/* Writes kv_b [H * (nope + v), kvl] of dtype dt into dst: per head the nope
 * k rows (k_b is [H, kvl, nope]: transposed back) then the v rows (v_b is
 * [H, v, kvl]: copied). tmp holds max(nope, kvl) floats. */
static void join_layer(const fl_ckpt_tensor *kb, const fl_ckpt_tensor *vb, int64_t H, int64_t kvl, int64_t nope,
                       int64_t v, fl_dtype dt, uint8_t *dst, float *tmp) {
    const size_t es = dt == FL_DTYPE_F32 ? 4 : 2;
    const bool raw = kb->dtype == dt && vb->dtype == dt;
    const fl_tensor k2 = {.dtype = kb->dtype, .ndim = 2, .shape = {H * kvl, nope}, .data = (void *)kb->data};
    const fl_tensor v2 = {.dtype = vb->dtype, .ndim = 2, .shape = {H * v, kvl}, .data = (void *)vb->data};
    for (int64_t h = 0; h < H; h++) {
        for (int64_t c = 0; c < kvl; c++) {
            const uint8_t *src = (const uint8_t *)kb->data + (size_t)((h * kvl + c) * nope) * es;
            if (!raw) {
                fl_tensor_row_f32(&k2, h * kvl + c, tmp);
                src = (const uint8_t *)tmp;
            }
            for (int64_t j = 0; j < nope; j++)
                memcpy(dst + (size_t)((h * (nope + v) + j) * kvl + c) * es, src + (size_t)j * es, es);
        }
        for (int64_t i = 0; i < v; i++) {
            uint8_t *row = dst + (size_t)((h * (nope + v) + nope + i) * kvl) * es;
            if (raw) memcpy(row, (const uint8_t *)vb->data + (size_t)((h * v + i) * kvl) * es, (size_t)kvl * es);
            else {
                fl_tensor_row_f32(&v2, h * v + i, tmp);
                memcpy(row, tmp, (size_t)kvl * es);
            }
        }
    }
}

static fl_status rename_shared(const char *path, fl_ckpt_tensor *t, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char *p = strstr(t[i].name, SHEXP);
        if (!p) continue;
        size_t len = strlen(t[i].name) + 2;
        char *s = malloc(len);
        if (!s) return FL_ERR(FL_ERR_OOM, "%s: out of memory renaming tensors", path);
        snprintf(s, len, "%.*s.mlp.shared_experts.%s", (int)(p - t[i].name), t[i].name, p + sizeof SHEXP - 1);
        free((char *)t[i].name);
        t[i].name = s;
    }
    return FL_OK;
}

fl_status fl_gguf_deepseek_tensors(const char *path, const fl_model_config *cfg, fl_ckpt_tensor **tensors,
                                   char ***gguf_names, size_t *n, void **owned, size_t *owned_size) {
    const fl_mla_config *a = &cfg->mla;
    const int64_t H = cfg->n_heads, kvl = a->kv_lora_rank, nope = a->qk_nope_head_dim, v = a->v_head_dim;
    fl_ckpt_tensor *in = *tensors;
    char **gn = *gguf_names;
    fl_status st = FL_OK;
    join *js = NULL;
    size_t nj = 0, total = 0;
    fl_dtype *dts = NULL;
    *owned = NULL;
    *owned_size = 0;

    FL_TRY(rename_shared(path, in, *n));
    js = calloc((size_t)cfg->n_layers, sizeof *js);
    dts = calloc((size_t)cfg->n_layers, sizeof *dts);
    if (!js || !dts) {
        st = FL_ERR(FL_ERR_OOM, "%s: out of memory joining attn_k_b / attn_v_b", path);
        goto done;
    }
    for (int l = 0; l < cfg->n_layers; l++) {
        char kn[96], vn[96], kvn[96];
        snprintf(kn, sizeof kn, "model.layers.%d.self_attn.k_b_proj.weight", l);
        snprintf(vn, sizeof vn, "model.layers.%d.self_attn.v_b_proj.weight", l);
        snprintf(kvn, sizeof kvn, "model.layers.%d.self_attn.kv_b_proj.weight", l);
        const size_t ik = find(in, *n, kn), iv = find(in, *n, vn), ikv = find(in, *n, kvn);
        if (ikv != SIZE_MAX && (ik != SIZE_MAX || iv != SIZE_MAX)) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF layer %d has both blk.%d.attn_kv_b and the split attn_k_b/attn_v_b",
                        path, l, l);
            goto done;
        }
        if (ikv != SIZE_MAX) continue;
        if (ik == SIZE_MAX || iv == SIZE_MAX) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: GGUF file lacks the tensor 'blk.%d.%s.weight' (DeepSeek-V2 layers need "
                        "attn_kv_b, or attn_k_b and attn_v_b)", path, l, ik == SIZE_MAX ? "attn_k_b" : "attn_v_b");
            goto done;
        }
        const int64_t kne[3] = {nope, kvl, H}, vne[3] = {kvl, v, H};
        FL_TRY_GOTO(check_shape(path, gn[ik], &in[ik], kne), st, done);
        FL_TRY_GOTO(check_shape(path, gn[iv], &in[iv], vne), st, done);
        const fl_dtype dt = in[ik].dtype == in[iv].dtype && plain_float(in[ik].dtype) ? in[ik].dtype : FL_DTYPE_F32;
        js[nj] = (join){.layer = l, .ik = ik, .iv = iv, .off = total};
        dts[nj++] = dt;
        const size_t bytes = (size_t)(H * (nope + v) * kvl) * (dt == FL_DTYPE_F32 ? 4 : 2);
        total += (bytes + 63) & ~(size_t)63;
    }
    if (nj == 0) goto done;

    uint8_t *blk = malloc(total);
    float *tmp = malloc((size_t)(nope > kvl ? nope : kvl) * sizeof *tmp);
    const size_t m = *n - nj; /* two tensors out, one in, per join */
    fl_ckpt_tensor *out = calloc(m, sizeof *out);
    char **names = calloc(m, sizeof *names);
    bool *drop = calloc(*n, sizeof *drop);
    if (!blk || !tmp || !out || !names || !drop) {
        free(blk);
        free(tmp);
        free(out);
        free(names);
        free(drop);
        st = FL_ERR(FL_ERR_OOM, "%s: out of memory joining attn_k_b / attn_v_b (%zu bytes)", path, total);
        goto done;
    }
    for (size_t j = 0; j < nj; j++) drop[js[j].ik] = drop[js[j].iv] = true;
    size_t k = 0;
    for (size_t i = 0; i < *n; i++) {
        if (drop[i]) continue;
        out[k] = in[i];
        names[k++] = gn[i];
    }
    for (size_t j = 0; j < nj && st == FL_OK; j++, k++) {
        const fl_ckpt_tensor *kb = &in[js[j].ik], *vb = &in[js[j].iv];
        join_layer(kb, vb, H, kvl, nope, v, dts[j], blk + js[j].off, tmp);
        fl_ckpt_tensor *t = &out[k];
        *t = *kb;
        t->dtype = dts[j];
        t->ndim = 2;
        t->shape[0] = H * (nope + v);
        t->shape[1] = kvl;
        t->shape[2] = 0;
        t->data = blk + js[j].off;
        t->nbytes = (size_t)(H * (nope + v) * kvl) * (dts[j] == FL_DTYPE_F32 ? 4 : 2);
        char hn[96], gg[96];
        snprintf(hn, sizeof hn, "model.layers.%d.self_attn.kv_b_proj.weight", js[j].layer);
        snprintf(gg, sizeof gg, "blk.%d.attn_k_b.weight+attn_v_b.weight", js[j].layer);
        t->name = strdup(hn);
        names[k] = strdup(gg);
        if (!t->name || !names[k]) st = FL_ERR(FL_ERR_OOM, "%s: out of memory joining attn_k_b / attn_v_b", path);
    }
    free(tmp);
    free(drop);
    if (st != FL_OK) { /* the old arrays still own every name they had */
        for (size_t i = *n - 2 * nj; i < m; i++) {
            free((char *)out[i].name);
            free(names[i]);
        }
        free(out);
        free(names);
        free(blk);
        goto done;
    }
    for (size_t j = 0; j < nj; j++) {
        free((char *)in[js[j].ik].name);
        free(gn[js[j].ik]);
        free((char *)in[js[j].iv].name);
        free(gn[js[j].iv]);
    }
    free(in);
    free(gn);
    *tensors = out;
    *gguf_names = names;
    *n = m;
    *owned = blk;
    *owned_size = total;
done:
    free(js);
    free(dts);
    return st;
}
