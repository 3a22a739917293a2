/*
 * checkpoint.c — the checkpoint directory (checkpoint.h) for Hugging Face
 * folders, plus the format-independent parts shared with gguf.c: lookup,
 * free, and turning stored tensors into the fl_tensor kinds the model uses
 * (fl_ckpt_load_linear / fl_ckpt_load_tensor).
 *
 * A folder holds config.json, then either model.safetensors or
 * model.safetensors.index.json whose weight_map names the shard holding
 * each tensor. Every file is mmap'd and its header validated at open, so
 * nothing later reads out of bounds; data pages are only touched when a
 * tensor is used, so a rank that loads only its shard of the weights reads
 * only those bytes.
 */
#include "runtime/load/checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/gguf_kquant.h"
#include "runtime/load/checkpoint_impl.h"
#include "runtime/load/gguf.h"
#include "runtime/load/json_file.h"
#include "runtime/load/quant.h"
#include "runtime/load/safetensors.h"
#include "runtime/tok/tokenizer.h"

/* ---- small helpers -------------------------------------------------------- */

static char *join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t n = a;
    if (a == 0 || dir[a - 1] != '/') p[n++] = '/';
    memcpy(p + n, name, b + 1);
    return p;
}

static bool is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static void fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

/* ---- the index ------------------------------------------------------------ */

static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const fl_ckpt_tensor *)a)->name, ((const fl_ckpt_tensor *)b)->name);
}

fl_status fl_ckpt_index(fl_ckpt *ck) {
    if (ck->n_tensors > 1) qsort(ck->tensors, ck->n_tensors, sizeof *ck->tensors, cmp_tensor);
    for (size_t i = 1; i < ck->n_tensors; i++) {
        if (strcmp(ck->tensors[i - 1].name, ck->tensors[i].name) == 0)
            return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" appears twice (in %s and %s)", ck->path,
                          ck->tensors[i].name, ck->tensors[i - 1].file, ck->tensors[i].file);
    }
    return FL_OK;
}

static const fl_ckpt_tensor *find(const fl_ckpt *ck, const char *name) {
    if (!ck || !ck->n_tensors) return NULL;
    fl_ckpt_tensor key = {.name = name};
    return bsearch(&key, ck->tensors, ck->n_tensors, sizeof *ck->tensors, cmp_tensor);
}

fl_status fl_ckpt_get(const fl_ckpt *ck, const char *name, const fl_ckpt_tensor **out) {
    const fl_ckpt_tensor *t = find(ck, name);
    *out = t;
    if (!t) return FL_ERR(FL_ERR_NOT_FOUND, "tensor \"%s\" not found in checkpoint %s", name, ck ? ck->path : "?");
    return FL_OK;
}

bool fl_ckpt_has(const fl_ckpt *ck, const char *name) { return find(ck, name) != NULL; }
size_t fl_ckpt_count(const fl_ckpt *ck) { return ck ? ck->n_tensors : 0; }
const fl_ckpt_tensor *fl_ckpt_at(const fl_ckpt *ck, size_t i) {
    return (ck && i < ck->n_tensors) ? &ck->tensors[i] : NULL;
}
const char *fl_ckpt_format(const fl_ckpt *ck) { return ck ? ck->format : NULL; }
const char *fl_ckpt_path(const fl_ckpt *ck) { return ck ? ck->path : NULL; }
const char *fl_ckpt_chat_template(const fl_ckpt *ck) { return ck ? ck->chat_template : NULL; }

fl_status fl_ckpt_model_config(const fl_ckpt *ck, fl_model_config *cfg) {
    *cfg = ck->cfg;
    return FL_OK;
}

void fl_ckpt_free(fl_ckpt *ck) {
    if (ck) free(ck->bytes_read);
    if (!ck) return;
    for (size_t i = 0; i < ck->n_tensors; i++) free((char *)ck->tensors[i].name);
    free(ck->tensors);
    for (size_t i = 0; i < ck->n_maps; i++) fl_mapfile_close(&ck->maps[i]);
    free(ck->maps);
    free(ck->built);
    if (ck->aux_free) ck->aux_free(ck->aux);
    free(ck->chat_template);
    free(ck->path);
    free(ck);
}

fl_status fl_ckpt_tokenizer(const fl_ckpt *ck, fl_tokenizer **out) {
    *out = NULL;
    if (strcmp(ck->format, "gguf") == 0) return fl_gguf_tokenizer(ck, out);
    char *p = join(ck->path, "tokenizer.json");
    if (!p) return FL_ERR(FL_ERR_OOM, "out of memory");
    fl_status st = fl_tokenizer_load_json(p, out);
    free(p);
    return st;
}

/* ---- opening a folder ----------------------------------------------------- */

/* Maps one safetensors file and appends its tensors to ck. */
static fl_status add_file(fl_ckpt *ck, const char *file) {
    fl_status st = FL_OK;
    fl_ckpt_tensor *ts = NULL;
    size_t n = 0;
    fl_mapfile *maps = realloc(ck->maps, (ck->n_maps + 1) * sizeof *maps);
    FL_CHECK_ALLOC(maps, st, fail);
    ck->maps = maps;
    fl_mapfile *m = &ck->maps[ck->n_maps];
    FL_TRY_GOTO(fl_mapfile_open(file, m), st, fail);
    ck->n_maps++;
    /* `file` of each tensor borrows the mapping's path, which lives as
     * long as the checkpoint. */
    FL_TRY_GOTO(fl_safetensors_parse(m->path, m->data, m->size, &ts, &n), st, fail);
    fl_ckpt_tensor *all = realloc(ck->tensors, (ck->n_tensors + n + 1) * sizeof *all);
    FL_CHECK_ALLOC(all, st, fail);
    ck->tensors = all;
    memcpy(ck->tensors + ck->n_tensors, ts, n * sizeof *ts);
    ck->n_tensors += n;
    free(ts); /* names now belong to ck */
    return FL_OK;
fail:
    fl_safetensors_tensors_free(ts, n);
    return st;
}

static bool bad_shard_name(const char *s) {
    return s[0] == 0 || strchr(s, '/') || strcmp(s, ".") == 0 || strcmp(s, "..") == 0;
}

/* True when `file` (folder/shard as joined by add_file) is `shard`. */
static bool in_shard(const char *file, const char *shard) {
    size_t a = strlen(file), b = strlen(shard);
    return a > b && file[a - b - 1] == '/' && strcmp(file + a - b, shard) == 0;
}

static fl_status open_sharded(fl_ckpt *ck, const char *index_path) {
    fl_status st = FL_OK;
    cJSON *root = NULL;
    char *shard_path = NULL;
    const char **shards = NULL;
    size_t n_shards = 0;

    FL_TRY_GOTO(fl_json_parse_file(index_path, &root), st, exit);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm) || !wm->child) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: key \"weight_map\" is missing, empty or not an object", index_path);
        goto exit;
    }
    shards = calloc((size_t)cJSON_GetArraySize(wm), sizeof *shards);
    FL_CHECK_ALLOC(shards, st, exit);
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e) || bad_shard_name(e->valuestring)) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: weight_map entry for tensor \"%s\" must be a file name in the folder",
                        index_path, e->string);
            goto exit;
        }
        bool seen = false;
        for (size_t i = 0; i < n_shards && !seen; i++) seen = strcmp(shards[i], e->valuestring) == 0;
        if (seen) continue;
        shard_path = join(ck->path, e->valuestring);
        FL_CHECK_ALLOC(shard_path, st, exit);
        if (!is_file(shard_path)) {
            st = FL_ERR(FL_ERR_NOT_FOUND, "%s: shard %s (holding tensor \"%s\") is missing from %s", index_path,
                        e->valuestring, e->string, ck->path);
            goto exit;
        }
        FL_TRY_GOTO(add_file(ck, shard_path), st, exit);
        free(shard_path);
        shard_path = NULL;
        shards[n_shards++] = e->valuestring;
    }
    FL_TRY_GOTO(fl_ckpt_index(ck), st, exit);
    /* Every tensor the index promises must be in the shard it names. */
    cJSON_ArrayForEach(e, wm) {
        const fl_ckpt_tensor *t = find(ck, e->string);
        if (!t || !in_shard(t->file, e->valuestring)) {
            st = FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" is listed in shard %s but %s", index_path, e->string,
                        e->valuestring, t ? "stored in another shard" : "not stored there");
            goto exit;
        }
    }
exit: /* success and failure alike */
    free(shard_path);
    free(shards);
    cJSON_Delete(root);
    return st;
}

/* Reads the chat template: chat_template.jinja (what transformers 5
 * writes), else tokenizer_config.json's "chat_template", either a string or
 * a list of {name, template} from which "default" is taken. */
static fl_status load_chat_template(fl_ckpt *ck) {
    fl_status st = FL_OK;
    cJSON *root = NULL;
    char *p = join(ck->path, "chat_template.jinja");
    FL_CHECK_ALLOC(p, st, exit);
    if (is_file(p)) {
        size_t len;
        FL_TRY_GOTO(fl_file_read_text(p, &ck->chat_template, &len), st, exit);
        goto exit; /* found */
    }
    free(p);
    p = join(ck->path, "tokenizer_config.json");
    FL_CHECK_ALLOC(p, st, exit);
    if (!is_file(p)) goto exit;
    FL_TRY_GOTO(fl_json_parse_file(p, &root), st, exit);
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
    const char *text = NULL;
    if (cJSON_IsString(ct)) {
        text = ct->valuestring;
    } else if (cJSON_IsArray(ct)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, ct) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
            const cJSON *tpl = cJSON_GetObjectItemCaseSensitive(it, "template");
            if (cJSON_IsString(name) && cJSON_IsString(tpl) && strcmp(name->valuestring, "default") == 0)
                text = tpl->valuestring;
        }
    } else if (ct && !cJSON_IsNull(ct)) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: key \"chat_template\" must be a string or a list of {name, template}", p);
        goto exit;
    }
    if (text) {
        ck->chat_template = strdup(text);
        FL_CHECK_ALLOC(ck->chat_template, st, exit);
    }
exit: /* success and failure alike */
    cJSON_Delete(root);
    free(p);
    return st;
}

fl_status fl_ckpt_open(const char *path, fl_ckpt **out) {
    fl_status st = FL_OK;
    fl_ckpt *ck = NULL;
    char *p = NULL;
    *out = NULL;
    if (ends_with(path, ".gguf")) return fl_ckpt_open_gguf(path, out);

    struct stat sb;
    if (stat(path, &sb) != 0)
        return FL_ERR(FL_ERR_NOT_FOUND, "checkpoint %s: %s", path, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return FL_ERR(FL_ERR_INVALID_ARG,
                      "checkpoint %s is neither a Hugging Face model folder nor a .gguf file", path);
    ck = calloc(1, sizeof *ck);
    FL_CHECK_ALLOC(ck, st, fail);
    ck->format = "safetensors";
    ck->path = strdup(path);
    FL_CHECK_ALLOC(ck->path, st, fail);

    p = join(path, "config.json");
    FL_CHECK_ALLOC(p, st, fail);
    FL_TRY_GOTO(fl_model_config_from_json(p, &ck->cfg), st, fail);
    free(p);

    p = join(path, "model.safetensors.index.json");
    FL_CHECK_ALLOC(p, st, fail);
    if (is_file(p)) {
        FL_TRY_GOTO(open_sharded(ck, p), st, fail);
    } else {
        free(p);
        p = join(path, "model.safetensors");
        FL_CHECK_ALLOC(p, st, fail);
        if (!is_file(p)) {
            st = FL_ERR(FL_ERR_NOT_FOUND, "%s holds neither model.safetensors nor model.safetensors.index.json",
                        path);
            goto fail;
        }
        FL_TRY_GOTO(add_file(ck, p), st, fail);
        FL_TRY_GOTO(fl_ckpt_index(ck), st, fail);
    }
    FL_TRY_GOTO(load_chat_template(ck), st, fail);
    free(p);
    *out = ck;
    return FL_OK;
fail:
    free(p);
    fl_ckpt_free(ck);
    return st;
}

/* ---- loading tensors ------------------------------------------------------ */

/* A descriptor that aliases the mapping. */
static void alias(const fl_ckpt_tensor *t, fl_tensor *out) {
    memset(out, 0, sizeof *out);
    out->dtype = t->dtype;
    out->ndim = t->ndim;
    memcpy(out->shape, t->shape, sizeof out->shape);
    out->data = (void *)t->data;
    out->owned = 0;
}

/* Elements per block of a GGUF block kind (1 for element kinds). */
static int64_t block_elems(fl_dtype dt) {
    int64_t e;
    if (fl_kquant_block(dt, &e, NULL)) return e;
    return dt == FL_DTYPE_Q8_0 || dt == FL_DTYPE_Q4_0 || dt == FL_DTYPE_Q4_1 ? 32 : 1;
}

/* Dequantizes a GGUF block tensor into an owned F32 tensor. */
static fl_status dequant_f32(const fl_ckpt_tensor *t, fl_tensor *out) {
    fl_tensor src;
    alias(t, &src);
    int64_t cols = t->ndim ? t->shape[t->ndim - 1] : 1;
    int64_t numel = fl_tensor_numel(&src);
    const int64_t be = block_elems(t->dtype);
    if (cols % be != 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" of dtype %s has %lld columns, not whole %lld-element blocks",
                      t->file, t->name, fl_dtype_name(t->dtype), (long long)cols, (long long)be);
    int64_t rows = cols ? numel / cols : 0;
    memset(out, 0, sizeof *out);
    float *data = malloc((size_t)(numel ? numel : 1) * sizeof(float));
    if (!data) return FL_ERR(FL_ERR_OOM, "out of memory dequantizing tensor \"%s\"", t->name);
    for (int64_t r = 0; r < rows; r++) fl_tensor_row_f32(&src, r, data + r * cols);
    out->dtype = FL_DTYPE_F32;
    out->ndim = t->ndim;
    memcpy(out->shape, t->shape, sizeof out->shape);
    out->data = data;
    out->owned = 1;
    return FL_OK;
}

static fl_status check_2d(const fl_ckpt_tensor *t, int64_t rows, int64_t cols, const char *what) {
    if (t->ndim == 2 && (rows < 0 || t->shape[0] == rows) && (cols < 0 || t->shape[1] == cols)) return FL_OK;
    char got[128];
    fmt_shape(got, sizeof got, t->ndim, t->shape);
    return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" has shape %s but %s [%lld, %lld] was expected", t->file,
                  t->name, got, what, (long long)rows, (long long)cols);
}

static int rtn_group(int64_t cols) {
    if (cols % 128 == 0) return 128;
    if (cols % 64 == 0) return 64;
    if (cols % 32 == 0) return 32;
    return 0;
}

static void count_read(const fl_ckpt *ck, size_t n);

/* Copies nr rows of nb bytes, each from byte b0 of row r0 + r of a
 * row-major matrix with row_bytes per row, into dst back to back, and
 * counts them: the 4-bit loaders read a rank's block this way. */
static void gather(const fl_ckpt *ck, const void *src, size_t row_bytes, int64_t r0, int64_t nr, size_t b0,
                   size_t nb, uint8_t *dst) {
    for (int64_t r = 0; r < nr; r++)
        memcpy(dst + (size_t)r * nb, (const uint8_t *)src + (size_t)(r0 + r) * row_bytes + b0, nb);
    count_read(ck, (size_t)nr * nb);
}

static bool is_whole(const fl_ckpt_slice *s, int64_t out_f, int64_t in_f) {
    return s->n_rows == out_f && s->n_cols == in_f;
}

/* prefix.qweight, prefix.qzeros and prefix.scales: the three tensors of an
 * AWQ or GPTQ linear (fl_ckpt_get's error names a missing one). */
static fl_status get_int4_triple(const fl_ckpt *ck, const char *prefix, const fl_ckpt_tensor **qw,
                                 const fl_ckpt_tensor **qz, const fl_ckpt_tensor **sc) {
    static const char *const sfx[3] = {"qweight", "qzeros", "scales"};
    const fl_ckpt_tensor **dst[3] = {qw, qz, sc};
    char name[512];
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "%s.%s", prefix, sfx[i]);
        FL_TRY(fl_ckpt_get(ck, name, dst[i]));
    }
    return FL_OK;
}

/* AutoAWQ: the block's qweight words (input rows col_lo.., output words
 * row_lo / 8..), qzeros and scales when the rows are whole words of 8 and
 * the columns whole groups; otherwise the whole weight (*cut: the caller
 * cuts the block). */
static fl_status load_awq(const fl_ckpt *ck, const char *prefix, int64_t out_f, int64_t in_f,
                          const fl_ckpt_slice *s, fl_tensor *out, bool *cut) {
    const fl_ckpt_tensor *qw, *qz, *sc;
    int g = ck->cfg.quant_group_size;
    FL_TRY(get_int4_triple(ck, prefix, &qw, &qz, &sc));
    if (qw->dtype != FL_DTYPE_I32 || qz->dtype != FL_DTYPE_I32)
        return FL_ERR(FL_ERR_FORMAT, "%s: AWQ tensors %s.qweight / .qzeros must be I32, got %s / %s", qw->file,
                      prefix, fl_dtype_name(qw->dtype), fl_dtype_name(qz->dtype));
    if (sc->dtype != FL_DTYPE_F16 && sc->dtype != FL_DTYPE_BF16 && sc->dtype != FL_DTYPE_F32)
        return FL_ERR(FL_ERR_FORMAT, "%s: AWQ tensor \"%s\" must be F16, got %s", sc->file, sc->name,
                      fl_dtype_name(sc->dtype));
    if (out_f % 8 != 0 || g <= 0 || in_f % g != 0)
        return FL_ERR(FL_ERR_FORMAT, "%s: AWQ linear %s [%lld, %lld] needs out %% 8 == 0 and in %% %d == 0",
                      ck->path, prefix, (long long)out_f, (long long)in_f, g);
    FL_TRY(check_2d(qw, in_f, out_f / 8, "AWQ qweight [in, out/8] ="));
    FL_TRY(check_2d(qz, in_f / g, out_f / 8, "AWQ qzeros [in/group, out/8] ="));
    FL_TRY(check_2d(sc, in_f / g, out_f, "AWQ scales [in/group, out] ="));
    const int64_t nr = s->n_rows, nc = s->n_cols;
    if (is_whole(s, out_f, in_f) || s->row_lo % 8 || nr % 8 || s->col_lo % g || nc % g) {
        *cut = !is_whole(s, out_f, in_f);
        count_read(ck, qw->nbytes + qz->nbytes + sc->nbytes);
        return fl_quant_awq_to_w4(prefix, qw->data, qz->data, sc->data, sc->dtype, out_f, in_f, g, out);
    }
    const size_t es = fl_dtype_row_bytes(sc->dtype, 1), wb = (size_t)nr / 2; /* bytes of nr / 8 words */
    const size_t n_qw = (size_t)nc * wb, n_qz = (size_t)(nc / g) * wb;
    uint8_t *buf = malloc(n_qw + n_qz + (size_t)(nc / g) * (size_t)nr * es);
    if (!buf) return FL_ERR(FL_ERR_OOM, "out of memory reading %s", prefix);
    gather(ck, qw->data, (size_t)out_f / 2, s->col_lo, nc, (size_t)s->row_lo / 2, wb, buf);
    gather(ck, qz->data, (size_t)out_f / 2, s->col_lo / g, nc / g, (size_t)s->row_lo / 2, wb, buf + n_qw);
    gather(ck, sc->data, (size_t)out_f * es, s->col_lo / g, nc / g, (size_t)s->row_lo * es, (size_t)nr * es,
           buf + n_qw + n_qz);
    fl_status st = fl_quant_awq_to_w4(prefix, buf, buf + n_qw, buf + n_qw + n_qz, sc->dtype, nr, nc, g, out);
    free(buf);
    return st;
}

/* compressed-tensors pack-quantized: prefix.weight_packed [out, in/8] I32,
 * .weight_scale [out, in/group], .weight_zero_point [ceil(out/8), in/group]
 * I32 when asymmetric; .weight_g_idx (activation order) is refused. */
static fl_status load_ct(const fl_ckpt *ck, const char *prefix, int64_t out_f, int64_t in_f,
                         const fl_ckpt_slice *s, fl_tensor *out, bool *cut) {
    char name[512];
    const fl_ckpt_tensor *pk, *sc, *zp = NULL;
    const int g = ck->cfg.quant_group_size ? ck->cfg.quant_group_size : (int)in_f;
    snprintf(name, sizeof name, "%s.weight_g_idx", prefix);
    if (fl_ckpt_has(ck, name))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" reorders the columns (activation order); flotilla "
                      "does not apply g_idx permutations", ck->path, name);
    snprintf(name, sizeof name, "%s.weight_packed", prefix);
    FL_TRY(fl_ckpt_get(ck, name, &pk));
    snprintf(name, sizeof name, "%s.weight_scale", prefix);
    FL_TRY(fl_ckpt_get(ck, name, &sc));
    if (!ck->cfg.quant_symmetric) {
        snprintf(name, sizeof name, "%s.weight_zero_point", prefix);
        FL_TRY(fl_ckpt_get(ck, name, &zp));
        if (zp->dtype != FL_DTYPE_I32)
            return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" must be I32, got %s", zp->file, zp->name,
                          fl_dtype_name(zp->dtype));
    }
    if (pk->dtype != FL_DTYPE_I32)
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" must be I32, got %s", pk->file, pk->name,
                      fl_dtype_name(pk->dtype));
    if (in_f % 8 != 0 || in_f % g != 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: compressed-tensors linear %s [%lld, %lld] needs in %% 8 == 0 and "
                      "in %% %d == 0", ck->path, prefix, (long long)out_f, (long long)in_f, g);
    FL_TRY(check_2d(pk, out_f, in_f / 8, "weight_packed [out, in/8] ="));
    FL_TRY(check_2d(sc, out_f, in_f / g, "weight_scale [out, in/group] ="));
    if (zp) FL_TRY(check_2d(zp, (out_f + 7) / 8, in_f / g, "weight_zero_point [ceil(out/8), in/group] ="));
    /* a block reads its rows' words of whole groups (channel: any 8 columns, one group of the block's width) */
    const bool grouped = ck->cfg.quant_group_size != 0;
    const int64_t nr = s->n_rows, nc = s->n_cols;
    if (is_whole(s, out_f, in_f) || s->col_lo % 8 || nc % 8 || (grouped && (s->col_lo % g || nc % g))) {
        *cut = !is_whole(s, out_f, in_f);
        count_read(ck, pk->nbytes + sc->nbytes + (zp ? zp->nbytes : 0));
        return fl_quant_ct_pack_to_w4(prefix, pk->data, zp ? zp->data : NULL, sc->data, sc->dtype, out_f, in_f, g,
                                      out);
    }
    const int64_t ng = in_f / g, ngs = grouped ? nc / g : 1, g0 = grouped ? s->col_lo / g : 0;
    const int64_t z0 = s->row_lo / 8, nz = (s->row_lo + nr - 1) / 8 - z0 + 1, nzs = (nr + 7) / 8;
    const size_t es = fl_dtype_row_bytes(sc->dtype, 1), n_pk = (size_t)nr * (size_t)nc / 2;
    const size_t n_sc = (size_t)nr * (size_t)ngs * es, n_zt = zp ? (size_t)nz * (size_t)ngs * 4 : 0;
    uint8_t *buf = calloc(1, n_pk + n_sc + n_zt + (zp ? (size_t)nzs * (size_t)ngs * 4 : 0));
    if (!buf) return FL_ERR(FL_ERR_OOM, "out of memory reading %s", prefix);
    uint8_t *pkb = buf, *scb = buf + n_pk, *zt = scb + n_sc, *zs = zt + n_zt;
    gather(ck, pk->data, (size_t)in_f / 2, s->row_lo, nr, (size_t)s->col_lo / 2, (size_t)nc / 2, pkb);
    gather(ck, sc->data, (size_t)ng * es, s->row_lo, nr, (size_t)g0 * es, (size_t)ngs * es, scb);
    if (zp) {
        /* zero points pack 8 output rows a word: repack from the block's first row */
        gather(ck, zp->data, (size_t)ng * 4, z0, nz, (size_t)g0 * 4, (size_t)ngs * 4, zt);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t j = 0; j < ngs; j++) {
                uint32_t w, d;
                const int64_t gr = s->row_lo + r;
                memcpy(&w, zt + 4 * ((size_t)(gr / 8 - z0) * (size_t)ngs + (size_t)j), 4);
                uint8_t *dp = zs + 4 * ((size_t)(r / 8) * (size_t)ngs + (size_t)j);
                memcpy(&d, dp, 4);
                d |= ((w >> (4 * (gr % 8))) & 0xfu) << (4 * (r % 8));
                memcpy(dp, &d, 4);
            }
    }
    fl_status st = fl_quant_ct_pack_to_w4(prefix, pkb, zp ? zs : NULL, scb, sc->dtype, nr, nc,
                                          grouped ? g : (int)nc, out);
    free(buf);
    return st;
}

/* GPTQ: prefix.qweight I32 [in/8, out], .qzeros I32 [n_groups, out/8],
 * .scales [n_groups, out], .g_idx I32 [in] (optional). Contiguous groups
 * repack into W4; act-order (a permuted g_idx) is dequantized to F32, which
 * holds (q - z) * s exactly where no W4 layout could (each input row may
 * belong to any group), whatever q asks: re-quantizing would lose the
 * checkpoint's own codes. */
static fl_status load_gptq(const fl_ckpt *ck, const char *prefix, int64_t out_f, int64_t in_f,
                           const fl_ckpt_slice *s, fl_tensor *out, bool *cut) {
    char name[512];
    const fl_ckpt_tensor *qw, *qz, *sc, *gi = NULL;
    const int g = ck->cfg.quant_group_size ? ck->cfg.quant_group_size : (int)in_f;
    const int64_t ng = (in_f + g - 1) / g;
    FL_TRY(get_int4_triple(ck, prefix, &qw, &qz, &sc));
    snprintf(name, sizeof name, "%s.g_idx", prefix);
    if (fl_ckpt_has(ck, name)) FL_TRY(fl_ckpt_get(ck, name, &gi));
    const fl_ckpt_tensor *ints[3] = {qw, qz, gi};
    for (int i = 0; i < 3; i++)
        if (ints[i] && ints[i]->dtype != FL_DTYPE_I32)
            return FL_ERR(FL_ERR_FORMAT, "%s: GPTQ tensor \"%s\" must be I32, got %s", ints[i]->file,
                          ints[i]->name, fl_dtype_name(ints[i]->dtype));
    if (out_f % 8 != 0 || in_f % 8 != 0)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: GPTQ linear %s [%lld, %lld] needs in %% 8 == 0 and out %% 8 == 0",
                      ck->path, prefix, (long long)out_f, (long long)in_f);
    FL_TRY(check_2d(qw, in_f / 8, out_f, "GPTQ qweight [in/8, out] ="));
    FL_TRY(check_2d(qz, ng, out_f / 8, "GPTQ qzeros [n_groups, out/8] ="));
    FL_TRY(check_2d(sc, ng, out_f, "GPTQ scales [n_groups, out] ="));
    if (gi && (gi->ndim != 1 || gi->shape[0] != in_f))
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" must be [%lld] (one group index per input)", gi->file,
                      gi->name, (long long)in_f);
    fl_quant_gptq src = {.qweight = qw->data, .qzeros = qz->data, .scales = sc->data,
                         .g_idx = gi ? gi->data : NULL, .scales_dt = sc->dtype, .out = out_f, .in = in_f,
                         .n_groups = ng, .group = g, .zeros_minus_one = ck->cfg.quant_zeros_minus_one};
    const bool trivial = in_f % g == 0 && fl_quant_gptq_g_idx_trivial(src.g_idx, in_f, g);
    const bool channel = ck->cfg.quant_group_size == 0;
    const int64_t nr = s->n_rows, nc = s->n_cols;
    uint8_t *buf = NULL;
    if (gi) count_read(ck, gi->nbytes); /* every block needs the whole g_idx to know its kind */
    /* a block reads whole words (8 inputs down, 8 outputs across for the
     * zero points) of its groups: contiguous ones of its columns, or all of
     * them for act-order, whose inputs may belong to any group */
    if (is_whole(s, out_f, in_f) || s->col_lo % 8 || nc % 8 || s->row_lo % 8 || nr % 8 || (!trivial && !gi) ||
        (trivial && !channel && (s->col_lo % g || nc % g))) {
        *cut = !is_whole(s, out_f, in_f);
        count_read(ck, qw->nbytes + qz->nbytes + sc->nbytes);
    } else {
        const int64_t grp_lo = trivial && !channel ? s->col_lo / g : 0;
        const int64_t ngs = !trivial ? ng : channel ? 1 : nc / g;
        const size_t es = fl_dtype_row_bytes(sc->dtype, 1), n_qw = (size_t)nc / 8 * (size_t)nr * 4;
        const size_t n_qz = (size_t)ngs * (size_t)nr / 2;
        buf = malloc(n_qw + n_qz + (size_t)ngs * (size_t)nr * es);
        if (!buf) return FL_ERR(FL_ERR_OOM, "out of memory reading %s", prefix);
        gather(ck, qw->data, (size_t)out_f * 4, s->col_lo / 8, nc / 8, (size_t)s->row_lo * 4, (size_t)nr * 4, buf);
        gather(ck, qz->data, (size_t)out_f / 2, grp_lo, ngs, (size_t)s->row_lo / 2, (size_t)nr / 2, buf + n_qw);
        gather(ck, sc->data, (size_t)out_f * es, grp_lo, ngs, (size_t)s->row_lo * es, (size_t)nr * es,
               buf + n_qw + n_qz);
        src.qweight = buf, src.qzeros = buf + n_qw, src.scales = buf + n_qw + n_qz;
        src.g_idx = trivial ? NULL : (const uint8_t *)gi->data + (size_t)s->col_lo * 4;
        src.out = nr, src.in = nc, src.n_groups = ngs, src.group = trivial && channel ? (int)nc : g;
    }
    fl_status st;
    if (trivial) {
        st = fl_quant_gptq_to_w4(prefix, &src, out);
        free(buf);
        return st;
    }
    fl_ckpt *m = (fl_ckpt *)ck; /* a note printed once: never touches the tensors */
    if (!m->noted_dense) {
        m->noted_dense = true;
        fprintf(stderr, "flotilla: %s: GPTQ act-order linears (%s is the first) are dequantized to f32 at load: "
                "exact, 8x the memory of 4 bits\n", ck->path, prefix);
    }
    st = fl_quant_gptq_to_f32(prefix, &src, out);
    free(buf);
    return st;
}

/* FP8 (float8_e4m3fn): prefix.weight [out, in] and its scales
 * (.weight_scale for compressed-tensors, .weight_scale_inv for quant_method
 * "fp8"), shaped by the config's scaling: [1] or [] per tensor, [out] or
 * [out, 1] per channel, [ceil(out / b0), ceil(in / b1)] per block. The
 * block s is dequantized to F32 from its own bytes (a tile that a rank's
 * block cuts is scaled the same on both sides of the cut), then quantized
 * to W4 like any float weight when q asks. */
static fl_status load_fp8(const fl_ckpt *ck, const fl_ckpt_tensor *t, const char *prefix, int64_t out_f,
                          int64_t in_f, const fl_ckpt_slice *s, fl_load_quant q, fl_tensor *out) {
    char name[512];
    const fl_ckpt_tensor *sc;
    const fl_model_config *c = &ck->cfg;
    if (c->quant != FL_QUANT_FP8)
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" is F8_E4M3 but config.json has no FP8 "
                      "quantization_config (quant_method \"fp8\" or compressed-tensors float-quantized) to "
                      "give its scales", t->file, t->name);
    snprintf(name, sizeof name, "%s.%s", prefix, c->quant_scale_inv ? "weight_scale_inv" : "weight_scale");
    FL_TRY(fl_ckpt_get(ck, name, &sc));
    int64_t br = out_f, bc = in_f, want[2] = {1, 1};
    if (c->quant_fp8 == FL_FP8_CHANNEL) br = 1, want[0] = out_f;
    if (c->quant_fp8 == FL_FP8_BLOCK) {
        br = c->quant_block[0], bc = c->quant_block[1];
        want[0] = (out_f + br - 1) / br, want[1] = (in_f + bc - 1) / bc;
    }
    /* the grid's shape, with or without unit dims ([out] for [out, 1], [] for [1, 1]) */
    bool ok = sc->ndim <= 2;
    if (ok && sc->ndim == 2) ok = sc->shape[0] == want[0] && sc->shape[1] == want[1];
    if (ok && sc->ndim == 1) ok = want[1] == 1 ? sc->shape[0] == want[0] : (want[0] == 1 && sc->shape[0] == want[1]);
    if (ok && sc->ndim == 0) ok = want[0] == 1 && want[1] == 1;
    if (!ok) {
        char got[128];
        fmt_shape(got, sizeof got, sc->ndim, sc->shape);
        static const char *const what[] = {"per tensor", "per channel", "per block"};
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" has shape %s but FP8 scales %s of [%lld, %lld] need "
                      "[%lld, %lld]", sc->file, sc->name, got, what[c->quant_fp8], (long long)out_f,
                      (long long)in_f, (long long)want[0], (long long)want[1]);
    }
    const fl_quant_fp8 src = {.weight = t->data, .scales = sc->data, .scales_dt = sc->dtype, .out = out_f,
                              .in = in_f, .block_rows = br, .block_cols = bc};
    size_t nread = 0;
    fl_tensor f;
    FL_TRY(fl_quant_fp8_to_f32(t->name, &src, s->row_lo, s->n_rows, s->col_lo, s->n_cols, &f, &nread));
    count_read(ck, nread);
    if (q == FL_LOAD_AS_STORED) {
        *out = f;
        return FL_OK;
    }
    const int g = rtn_group(s->n_cols);
    fl_status st = g ? fl_quant_rtn_to_w4(t->name, &f, g, out)
                     : FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" block has %lld columns, not a multiple of "
                              "32: cannot quantize to W4", t->file, t->name, (long long)s->n_cols);
    fl_tensor_free(&f);
    return st;
}

/* Cuts a block out of an owned F32 [out, in] tensor. */
static fl_status f32_block(const char *name, const fl_tensor *w, const fl_ckpt_slice *s, fl_tensor *out) {
    memset(out, 0, sizeof *out);
    float *v = malloc((size_t)s->n_rows * (size_t)s->n_cols * sizeof(float));
    if (!v) return FL_ERR(FL_ERR_OOM, "out of memory cutting %s", name);
    for (int64_t r = 0; r < s->n_rows; r++)
        memcpy(v + r * s->n_cols, (const float *)w->data + (s->row_lo + r) * w->shape[1] + s->col_lo,
               (size_t)s->n_cols * sizeof(float));
    out->dtype = FL_DTYPE_F32;
    out->ndim = 2;
    out->shape[0] = s->n_rows;
    out->shape[1] = s->n_cols;
    out->data = v;
    out->owned = 1;
    return FL_OK;
}

static void count_read(const fl_ckpt *ck, size_t n) {
    fl_ckpt *m = (fl_ckpt *)ck; /* accounting only: never touches the tensors */
    if (!m->bytes_read) m->bytes_read = calloc(1, sizeof *m->bytes_read);
    if (m->bytes_read) *m->bytes_read += n;
}

size_t fl_ckpt_bytes_read(const fl_ckpt *ck) { return ck->bytes_read ? *ck->bytes_read : 0; }

/* Converts a whole stored linear (already shape-checked) into *out. */
static fl_status convert_linear(const fl_ckpt_tensor *t, fl_load_quant q, fl_tensor *out) {
    switch (t->dtype) {
    case FL_DTYPE_F32:
    case FL_DTYPE_F16:
    case FL_DTYPE_BF16: {
        fl_tensor src;
        alias(t, &src);
        if (q == FL_LOAD_AS_STORED) {
            *out = src;
            return FL_OK;
        }
        int g = rtn_group(t->shape[1]);
        if (!g)
            return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" has %lld columns, not a multiple of 32: cannot "
                          "quantize to W4", t->file, t->name, (long long)t->shape[1]);
        return fl_quant_rtn_to_w4(t->name, &src, g, out);
    }
    case FL_DTYPE_Q4_0:
    case FL_DTYPE_Q4_1: {
        fl_tensor src;
        alias(t, &src);
        return fl_quant_gguf_q4_to_w4(t->name, &src, out);
    }
    case FL_DTYPE_Q4_K: {
        fl_tensor src;
        alias(t, &src);
        return fl_quant_gguf_q4k_to_w4(t->name, &src, out);
    }
    case FL_DTYPE_Q2_K:
    case FL_DTYPE_Q3_K:
    case FL_DTYPE_Q5_K:
    case FL_DTYPE_Q6_K:
    case FL_DTYPE_Q8_K:
    case FL_DTYPE_IQ4_NL:
    case FL_DTYPE_IQ4_XS: {
        /* no kernel reads these blocks: decoded once to f32, which holds
         * every value exactly (an f16 d times small integers) */
        fl_tensor f;
        FL_TRY(dequant_f32(t, &f));
        if (q == FL_LOAD_AS_STORED) {
            *out = f;
            return FL_OK;
        }
        fl_status st = fl_quant_rtn_to_w4(t->name, &f, rtn_group(t->shape[1]), out);
        fl_tensor_free(&f);
        return st;
    }
    case FL_DTYPE_Q8_0: {
        /* kept as stored: 8.5 bits per weight instead of 32, dequantized
         * exactly (d * q in f32) by the backend as it reads rows */
        if (q == FL_LOAD_AS_STORED) {
            alias(t, out);
            return FL_OK;
        }
        fl_tensor f;
        FL_TRY(dequant_f32(t, &f));
        fl_status st = fl_quant_rtn_to_w4(t->name, &f, rtn_group(t->shape[1]), out);
        fl_tensor_free(&f);
        return st;
    }
    default:
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s, which is not a linear weight type", t->file,
                      t->name, fl_dtype_name(t->dtype));
    }
}

/* Cuts a block out of a whole W4 tensor (AWQ, compressed-tensors after
 * repacking). A tensor of one group per row (channel scales) keeps one
 * group per row, of the block's width. */
static fl_status w4_block(const char *name, const fl_tensor *w, const fl_ckpt_slice *s, fl_tensor *out) {
    const int64_t in = w->shape[1], ng = w->group == in ? 1 : in / w->group;
    const int64_t G = ng == 1 ? s->n_cols : w->group;
    if (ng == 1 && s->n_cols % 2)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: cannot split columns at %lld (+%lld): W4 needs an even width",
                      name, (long long)s->col_lo, (long long)s->n_cols);
    if (ng > 1 && (s->col_lo % G || s->n_cols % G))
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: cannot split columns at %lld (+%lld): not whole groups of %lld",
                      name, (long long)s->col_lo, (long long)s->n_cols, (long long)G);
    FL_TRY(fl_quant_w4_alloc(s->n_rows, s->n_cols, (int)G, out));
    for (int64_t r = 0; r < s->n_rows; r++) {
        int64_t src_r = s->row_lo + r;
        memcpy((uint8_t *)out->data + r * (s->n_cols / 2), (const uint8_t *)w->data + src_r * (in / 2) + s->col_lo / 2,
               (size_t)s->n_cols / 2);
        const int64_t g0 = ng == 1 ? 0 : s->col_lo / G;
        memcpy(out->scales + r * (s->n_cols / G), w->scales + src_r * ng + g0, (size_t)(s->n_cols / G) * sizeof(float));
        memcpy(out->bias + r * (s->n_cols / G), w->bias + src_r * ng + g0, (size_t)(s->n_cols / G) * sizeof(float));
    }
    return FL_OK;
}

fl_status fl_ckpt_load_linear_part(const fl_ckpt *ck, const char *prefix, int64_t expect_out,
                                   int64_t expect_in, const fl_ckpt_slice *slice, fl_load_quant q,
                                   fl_tensor *out) {
    char name[512];
    const fl_ckpt_tensor *t;
    fl_status st = FL_OK;
    memset(out, 0, sizeof *out);
    if (strlen(prefix) + 16 > sizeof name)
        return FL_ERR(FL_ERR_INVALID_ARG, "tensor prefix too long: %s", prefix);
    fl_ckpt_slice all = {0, expect_out, 0, expect_in};
    const fl_ckpt_slice *s = slice ? slice : &all;
    if (s->row_lo < 0 || s->n_rows <= 0 || s->row_lo + s->n_rows > expect_out || s->col_lo < 0 ||
        s->n_cols <= 0 || s->col_lo + s->n_cols > expect_in)
        return FL_ERR(FL_ERR_INVALID_ARG, "%s: block rows %lld+%lld, cols %lld+%lld is outside [%lld, %lld]",
                      prefix, (long long)s->row_lo, (long long)s->n_rows, (long long)s->col_lo,
                      (long long)s->n_cols, (long long)expect_out, (long long)expect_in);
    const bool whole = is_whole(s, expect_out, expect_in);
    /* AWQ and GPTQ checkpoints keep some linears (lm_head, routers) in
     * float: the presence of .qweight decides per layer. */
    snprintf(name, sizeof name, "%s.%s", prefix, ck->cfg.quant == FL_QUANT_CT_PACK ? "weight_packed" : "qweight");
    const fl_quant_kind qk = ck->cfg.quant;
    if ((qk == FL_QUANT_AWQ || qk == FL_QUANT_CT_PACK || qk == FL_QUANT_GPTQ) && fl_ckpt_has(ck, name)) {
        fl_tensor full;
        bool cut = false; /* the loader read the whole weight: cut the block here */
        if (qk == FL_QUANT_CT_PACK) FL_TRY(load_ct(ck, prefix, expect_out, expect_in, s, &full, &cut));
        else if (qk == FL_QUANT_GPTQ) FL_TRY(load_gptq(ck, prefix, expect_out, expect_in, s, &full, &cut));
        else FL_TRY(load_awq(ck, prefix, expect_out, expect_in, s, &full, &cut));
        if (!cut) {
            *out = full;
            return FL_OK;
        }
        st = full.dtype == FL_DTYPE_W4 ? w4_block(prefix, &full, s, out) : f32_block(prefix, &full, s, out);
        fl_tensor_free(&full);
        return st;
    }
    snprintf(name, sizeof name, "%s.weight", prefix);
    FL_TRY(fl_ckpt_get(ck, name, &t));
    FL_TRY(check_2d(t, expect_out, expect_in, "[out, in] ="));
    if (t->dtype == FL_DTYPE_F8_E4M3) return load_fp8(ck, t, prefix, expect_out, expect_in, s, q, out);
    const size_t row_bytes = fl_dtype_row_bytes(t->dtype, expect_in);
    if (whole) {
        count_read(ck, t->nbytes);
        return convert_linear(t, q, out);
    }
    /* A view of the block: rows are contiguous, columns are copied. */
    const int64_t be = block_elems(t->dtype);
    if (s->col_lo % be || s->n_cols % be)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" cannot be split at column %lld (+%lld): its %s blocks "
                      "hold %lld columns", t->file, t->name, (long long)s->col_lo, (long long)s->n_cols,
                      fl_dtype_name(t->dtype), (long long)be);
    fl_ckpt_tensor sub = *t;
    sub.shape[0] = s->n_rows;
    sub.shape[1] = s->n_cols;
    const size_t sub_row = fl_dtype_row_bytes(t->dtype, s->n_cols);
    sub.nbytes = sub_row * (size_t)s->n_rows;
    uint8_t *tmp = NULL;
    const uint8_t *base = (const uint8_t *)t->data + (size_t)s->row_lo * row_bytes;
    if (s->n_cols == expect_in) {
        sub.data = base;
    } else {
        size_t off = fl_dtype_row_bytes(t->dtype, s->col_lo);
        tmp = malloc(sub.nbytes ? sub.nbytes : 1);
        if (!tmp) return FL_ERR(FL_ERR_OOM, "out of memory slicing \"%s\"", t->name);
        for (int64_t r = 0; r < s->n_rows; r++) memcpy(tmp + r * sub_row, base + r * row_bytes + off, sub_row);
        sub.data = tmp;
    }
    count_read(ck, sub.nbytes);
    st = convert_linear(&sub, q, out);
    if (st == FL_OK && tmp && out->data == tmp) {
        out->owned = 1; /* the copy is the weight now */
        tmp = NULL;
    }
    free(tmp);
    return st;
}

fl_status fl_ckpt_load_linear(const fl_ckpt *ck, const char *prefix, int64_t expect_out, int64_t expect_in,
                              fl_load_quant q, fl_tensor *out) {
    return fl_ckpt_load_linear_part(ck, prefix, expect_out, expect_in, NULL, q, out);
}

fl_status fl_ckpt_load_tensor(const fl_ckpt *ck, const char *name, int ndim, const int64_t *expect,
                              fl_tensor *out) {
    const fl_ckpt_tensor *t;
    memset(out, 0, sizeof *out);
    FL_TRY(fl_ckpt_get(ck, name, &t));
    bool ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = expect[i] < 0 || expect[i] == t->shape[i];
    if (!ok) {
        char got[128], want[128];
        fmt_shape(got, sizeof got, t->ndim, t->shape);
        fmt_shape(want, sizeof want, ndim, expect);
        return FL_ERR(FL_ERR_FORMAT, "%s: tensor \"%s\" has shape %s but %s was expected (-1 = any)", t->file,
                      name, got, want);
    }
    if (t->dtype == FL_DTYPE_F8_E4M3)
        return FL_ERR(FL_ERR_UNSUPPORTED, "%s: tensor \"%s\" is F8_E4M3: FP8 is supported for linear weights "
                      "only", t->file, name);
    count_read(ck, t->nbytes);
    switch (t->dtype) {
    case FL_DTYPE_F32:
    case FL_DTYPE_F16:
    case FL_DTYPE_BF16:
    case FL_DTYPE_I32: alias(t, out); return FL_OK;
    default: return dequant_f32(t, out); /* every GGUF block kind */
    }
}
