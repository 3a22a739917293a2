/*
 * quantize_output.c — the tensors and side files `flotilla quantize`
 * writes (quantize_output.h). Both formats hold the same quantization
 * (awq_calib.h: AutoAWQ's zero-point groups); they differ in layout:
 *
 *   awq: prefix.qweight I32 [in, out/8], .qzeros I32 [in/group, out/8],
 *        .scales F16 [in/group, out] (AutoAWQ GEMM);
 *   compressed-tensors: prefix.weight_packed I32 [out, in/8],
 *        .weight_scale [out, in/group] in the linear's stored dtype,
 *        .weight_zero_point I32 [ceil(out/8), in/group], .weight_shape I64
 *        [2] (llm-compressor's pack-quantized W4A16, asymmetric, group).
 *
 * The compressed-tensors scales are rounded to f16 as AutoAWQ's are when
 * the model is f16 or f32 (either holds them exactly), so both formats
 * decode to the same weights; a bf16 model gets bf16-rounded scales, the
 * dtype llm-compressor stores them in.
 */
#include "launcher/quantize_output.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "launcher/awq_calib.h"
#include "launcher/cli.h"

const char *fl_qformat_name(fl_qformat f) { return f == FL_QFORMAT_CT ? "compressed-tensors" : "awq"; }

/* Layer index and linear of a "model.layers.L.<linear>.weight" name, else
 * -1 (*layer is still set for other tensors of a layer). */
static int layer_linear(const char *name, int *layer) {
    int l, off = 0;
    if (sscanf(name, "model.layers.%d.%n", &l, &off) != 1 || off == 0) return -1;
    for (int k = 0; k < FL_QLIN_COUNT; k++) {
        size_t m = strlen(FL_QLAYER_NAMES[k]);
        if (!strncmp(name + off, FL_QLAYER_NAMES[k], m) && !strcmp(name + off + m, ".weight")) {
            *layer = l;
            return k;
        }
    }
    *layer = l;
    return -1;
}

/* The dtype of a compressed-tensors linear's scales (the weight's), and the
 * one their values are rounded to. */
static fl_dtype ct_scale_dtype(fl_dtype w) { return w == FL_DTYPE_F32 || w == FL_DTYPE_BF16 ? w : FL_DTYPE_F16; }
static fl_dtype ct_round_dtype(fl_dtype w) { return w == FL_DTYPE_BF16 ? FL_DTYPE_BF16 : FL_DTYPE_F16; }

/* A quantized linear's tensors: names (prefix + suffix), dtypes and shapes. */
typedef struct qtensors {
    int n;
    const char *suffix[4];
    fl_dtype dt[4];
    int ndim[4];
    int64_t shape[4][2];
} qtensors;

static qtensors linear_tensors(fl_qformat f, fl_dtype w_dt, int64_t out, int64_t in, int group) {
    const int64_t ng = in / group;
    if (f == FL_QFORMAT_AWQ)
        return (qtensors){3, {"qweight", "qzeros", "scales"}, {FL_DTYPE_I32, FL_DTYPE_I32, FL_DTYPE_F16},
                          {2, 2, 2}, {{in, out / 8}, {ng, out / 8}, {ng, out}}};
    return (qtensors){4,
                      {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"},
                      {FL_DTYPE_I32, ct_scale_dtype(w_dt), FL_DTYPE_I32, FL_DTYPE_I64},
                      {2, 2, 2, 1},
                      {{out, in / 8}, {out, ng}, {(out + 7) / 8, ng}, {2, 0}}};
}

fl_status fl_qout_plan(const fl_ckpt *ck, fl_qformat f, int group, fl_stw *w) {
    char name[300];
    for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
        const fl_ckpt_tensor *t = fl_ckpt_at(ck, i);
        int l;
        if (layer_linear(t->name, &l) < 0) {
            FL_TRY(fl_stw_add(w, t->name, t->dtype, t->ndim, t->shape));
            continue;
        }
        const int base = (int)strlen(t->name) - 7; /* without ".weight" */
        const qtensors q = linear_tensors(f, t->dtype, t->shape[0], t->shape[1], group);
        for (int k = 0; k < q.n; k++) {
            snprintf(name, sizeof name, "%.*s.%s", base, t->name, q.suffix[k]);
            FL_TRY(fl_stw_add(w, name, q.dt[k], q.ndim[k], q.shape[k]));
        }
    }
    return FL_OK;
}

fl_status fl_qout_put_rest(const fl_ckpt *ck, fl_stw *w) {
    for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
        const fl_ckpt_tensor *t = fl_ckpt_at(ck, i);
        if (strncmp(t->name, "model.layers.", 13)) FL_TRY(fl_stw_put(w, t->name, t->data));
    }
    return FL_OK;
}

/* A vector we changed (a norm, a bias), written in its stored dtype. */
static fl_status put_vector(fl_stw *w, const fl_ckpt_tensor *t, const float *v) {
    const int64_t n = t->shape[0];
    void *buf = malloc((size_t)n * 4);
    if (!buf) return FL_ERR(FL_ERR_OOM, "out of memory");
    for (int64_t i = 0; i < n; i++) {
        if (t->dtype == FL_DTYPE_F32) ((float *)buf)[i] = v[i];
        else if (t->dtype == FL_DTYPE_F16) ((uint16_t *)buf)[i] = fl_f32_to_f16(v[i]);
        else ((uint16_t *)buf)[i] = fl_f32_to_bf16(v[i]);
    }
    fl_status st = fl_stw_put(w, t->name, buf);
    free(buf);
    return st;
}

/* Quantizes and puts one linear (the tensor t of the float checkpoint). */
static fl_status put_linear(fl_qformat f, fl_stw *w, const fl_ckpt_tensor *t, const float *wf, int64_t out,
                            int64_t in, int group) {
    const qtensors q = linear_tensors(f, t->dtype, out, in, group);
    void *buf[4] = {0};
    int64_t *shape = NULL;
    fl_status st = FL_OK;
    for (int k = 0; k < q.n; k++) {
        size_t bytes = fl_dtype_row_bytes(q.dt[k], q.shape[k][0]);
        if (q.ndim[k] == 2) bytes *= (size_t)q.shape[k][1];
        buf[k] = malloc(bytes);
        if (!buf[k]) st = FL_ERR(FL_ERR_OOM, "out of memory packing %s", t->name);
    }
    if (st == FL_OK && f == FL_QFORMAT_AWQ) {
        st = fl_awq_pack_gemm(wf, out, in, group, buf[0], buf[1], buf[2]);
    } else if (st == FL_OK) {
        st = fl_awq_pack_ct(wf, out, in, group, ct_round_dtype(t->dtype), q.dt[1], buf[0], buf[2], buf[1]);
        shape = buf[3];
        shape[0] = out;
        shape[1] = in;
    }
    char name[300];
    for (int k = 0; k < q.n && st == FL_OK; k++) {
        snprintf(name, sizeof name, "%.*s.%s", (int)strlen(t->name) - 7, t->name, q.suffix[k]);
        st = fl_stw_put(w, name, buf[k]);
    }
    for (int k = 0; k < 4; k++) free(buf[k]);
    return st;
}

fl_status fl_qout_put_layer(const fl_ckpt *ck, fl_qformat f, fl_stw *w, int l, const fl_qlayer *L, int group) {
    char name[300];
    for (size_t i = 0; i < fl_ckpt_count(ck); i++) {
        const fl_ckpt_tensor *t = fl_ckpt_at(ck, i);
        int tl = -1;
        const int k = layer_linear(t->name, &tl);
        if (tl != l) continue;
        if (k >= 0) {
            FL_TRY(put_linear(f, w, t, L->w[k], L->out[k], L->in[k], group));
            continue;
        }
        const char *rest = strchr(t->name + strlen("model.layers."), '.') + 1;
        const float *v = NULL;
        if (!strcmp(rest, "input_layernorm.weight")) v = L->in_norm;
        else if (!strcmp(rest, "post_attention_layernorm.weight")) v = L->post_norm;
        for (int b = 0; b < 3; b++) {
            snprintf(name, sizeof name, "%s.bias", FL_QLAYER_NAMES[b]);
            if (!strcmp(rest, name)) v = L->bias[b];
        }
        if (v && t->ndim == 1 && (t->dtype == FL_DTYPE_F32 || t->dtype == FL_DTYPE_F16 || t->dtype == FL_DTYPE_BF16))
            FL_TRY(put_vector(w, t, v));
        else
            FL_TRY(fl_stw_put(w, t->name, t->data));
    }
    return FL_OK;
}

static fl_status copy_file(const char *from, const char *to) {
    char *data = NULL;
    size_t len = 0;
    FL_TRY(fl_cli_read_all(from, &data, &len));
    fl_status st = FL_OK;
    FILE *f = fopen(to, "wb");
    if (!f || fwrite(data, 1, len, f) != len) st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", to, strerror(errno));
    if (f && fclose(f) != 0 && st == FL_OK) st = FL_ERR(FL_ERR_IO, "cannot write %s", to);
    free(data);
    return st;
}

/* AutoAWQ's quantization_config. */
static bool awq_config(cJSON *q, int group) {
    return cJSON_AddStringToObject(q, "quant_method", "awq") && cJSON_AddNumberToObject(q, "bits", 4) &&
           cJSON_AddNumberToObject(q, "group_size", group) && cJSON_AddTrueToObject(q, "zero_point") &&
           cJSON_AddStringToObject(q, "version", "gemm") && cJSON_AddNullToObject(q, "modules_to_not_convert");
}

/* llm-compressor's quantization_config for W4A16 asymmetric group weights
 * (compressed-tensors' QuantizationConfig, as ModelCompressor.update_config
 * writes it, without the package version). */
static bool ct_config(cJSON *q, int group) {
    cJSON *groups = cJSON_AddObjectToObject(q, "config_groups"), *g0 = cJSON_AddObjectToObject(groups, "group_0");
    cJSON *targets = cJSON_AddArrayToObject(g0, "targets"), *wt = cJSON_AddObjectToObject(g0, "weights");
    cJSON *ignore;
    return targets && cJSON_AddItemToArray(targets, cJSON_CreateString("Linear")) && wt &&
           cJSON_AddNumberToObject(wt, "num_bits", 4) && cJSON_AddStringToObject(wt, "type", "int") &&
           cJSON_AddFalseToObject(wt, "symmetric") && cJSON_AddNumberToObject(wt, "group_size", group) &&
           cJSON_AddStringToObject(wt, "strategy", "group") && cJSON_AddFalseToObject(wt, "dynamic") &&
           cJSON_AddNullToObject(g0, "input_activations") && cJSON_AddNullToObject(g0, "output_activations") &&
           cJSON_AddStringToObject(g0, "format", "pack-quantized") &&
           cJSON_AddStringToObject(q, "quant_method", "compressed-tensors") &&
           cJSON_AddStringToObject(q, "format", "pack-quantized") &&
           cJSON_AddStringToObject(q, "quantization_status", "compressed") &&
           cJSON_AddNullToObject(q, "global_compression_ratio") && (ignore = cJSON_AddArrayToObject(q, "ignore")) &&
           cJSON_AddItemToArray(ignore, cJSON_CreateString("lm_head")) && cJSON_AddNullToObject(q, "kv_cache_scheme") &&
           cJSON_AddObjectToObject(q, "sparsity_config") && cJSON_AddObjectToObject(q, "transform_config");
}

fl_status fl_qout_side_files(const char *src, const char *dst, fl_qformat f, int group) {
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                        "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                                        "chat_template.jinja"};
    char from[4096], to[4096];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(from, sizeof from, "%s/%s", src, files[i]);
        snprintf(to, sizeof to, "%s/%s", dst, files[i]);
        struct stat sb;
        if (stat(from, &sb) == 0) FL_TRY(copy_file(from, to));
    }
    snprintf(from, sizeof from, "%s/config.json", src);
    snprintf(to, sizeof to, "%s/config.json", dst);
    char *text = NULL;
    size_t len;
    FL_TRY(fl_cli_read_all(from, &text, &len));
    fl_status st = FL_OK;
    char *out = NULL;
    FILE *fp = NULL;
    cJSON *j = cJSON_ParseWithLength(text, len), *q = cJSON_CreateObject();
    if (!j || !cJSON_IsObject(j)) {
        st = FL_ERR(FL_ERR_FORMAT, "%s: not a JSON object", from);
        goto done;
    }
    cJSON_DeleteItemFromObjectCaseSensitive(j, "quantization_config");
    if (!q || !(f == FL_QFORMAT_CT ? ct_config(q, group) : awq_config(q, group)) ||
        !cJSON_AddItemToObject(j, "quantization_config", q)) {
        st = FL_ERR(FL_ERR_OOM, "out of memory");
        goto done;
    }
    q = NULL;
    out = cJSON_Print(j);
    FL_CHECK_ALLOC(out, st, done);
    fp = fopen(to, "w");
    if (!fp || fprintf(fp, "%s\n", out) < 0) st = FL_ERR(FL_ERR_IO, "cannot write %s: %s", to, strerror(errno));
done:
    if (fp && fclose(fp) != 0 && st == FL_OK) st = FL_ERR(FL_ERR_IO, "cannot write %s", to);
    cJSON_Delete(q);
    cJSON_Delete(j);
    free(out);
    free(text);
    return st;
}
