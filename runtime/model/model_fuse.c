/*
 * model_fuse.c — weights that read the same input, stacked into one matrix
 * at load time: q|k|v of an attention block and gate|up of a SiLU MLP.
 *
 * Decode is a sequence of small matmuls whose cost is mostly fixed per
 * launch: k_proj and v_proj of Llama-3-8B are 1024 x 4096 (2 MB in int4), a
 * few microseconds each, too small to keep the GPU's memory system busy. One
 * [q + k + v, hidden] matmul reads the same bytes in one launch, and one
 * [2 inter, hidden] matmul replaces gate and up (their outputs side by side
 * in each row; silu_mul takes the row stride). Rows are concatenated on the
 * host before upload, so every backend and every weight format that stores
 * rows one after another (f32, f16, bf16, W4 codes with per-row group scales,
 * Q8_0 blocks) fuses the same way, and the backend repacks the fused matrix
 * as it would any other. Parts that differ in dtype, width or group (a GGUF
 * file may quantize v_proj differently) stay separate.
 */
#include <stdlib.h>
#include <string.h>

#include "core/option.h"
#include "runtime/model/model.h"

/* Rows that can follow one another: same dtype, and for matrices the same
 * width (and W4 group); vectors (biases) of any lengths. */
static bool same_layout(const fl_tensor *a, const fl_tensor *b) {
    if (a->dtype != b->dtype || a->ndim != b->ndim) return false;
    if (a->ndim == 2 && a->shape[1] != b->shape[1]) return false;
    if (a->dtype == FL_DTYPE_W4 && (a->group != b->group || !a->scales || !b->scales || !a->bias || !b->bias))
        return false;
    if (a->dtype == FL_DTYPE_F8_E4M3 && (a->ndim != 2 || !a->scales || !b->scales)) return false;
    return a->ndim == 1 || a->ndim == 2;
}


/* Measured on one H200 (Llama-3-8B batch 1): q|k|v stacked helps both
 * formats (the 1024-row k and v GEMVs run far below the copy ceiling, the
 * 6144-row stack much closer); gate|up stacked helps bf16 (cuBLAS) but not
 * W4, whose 28672-row GEMV no longer fits one wave of blocks (see
 * pick_config in kernels/cuda/cuda_gemv.cu). Small W4 gate|up stacks do
 * help (DeepSeek-V2-Lite's 2 x 1408-row experts; Qwen3-30B-A3B's 2 x 768
 * unchanged; Mixtral's 2 x 14336 lose), so W4 gate|up is stacked when the
 * stack has at most W4_GATE_UP_MAX_ROWS rows. */
#define W4_GATE_UP_MAX_ROWS 8192
bool fl_model_fuse_wanted(bool gate_up, fl_dtype dt, int64_t rows) {
    /* FL_FUSE's choices in core/option_list.h: off|auto|qkv|all */
    switch (fl_opt_int(FL_OPT_FUSE)) {
    case 0: return false;
    case 2: return !gate_up;
    case 3: return true;
    default: return !gate_up || dt != FL_DTYPE_W4 || rows <= W4_GATE_UP_MAX_ROWS;
    }
}

bool fl_model_qknorm_fused(const fl_backend *be) {
    return fl_opt_bool(FL_OPT_QKNORM_FUSE) && be->ops->qknorm_rope_kv_store;
}

static bool fusable_dtype(fl_dtype d) {
    return d == FL_DTYPE_F32 || d == FL_DTYPE_F16 || d == FL_DTYPE_BF16 || d == FL_DTYPE_W4 || d == FL_DTYPE_Q8_0 ||
           d == FL_DTYPE_F8_E4M3;
}

fl_status fl_model_keep_fused(fl_model *m, fl_tensor *parts, int n, bool allow, fl_tensor *fused,
                              fl_tensor *const *devs) {
    bool ok = allow && n > 1 && fusable_dtype(parts[0].dtype) && parts[0].data;
    for (int i = 1; i < n && ok; i++) ok = same_layout(&parts[0], &parts[i]) && parts[i].data;
    if (!ok) {
        fl_status st = FL_OK;
        for (int i = 0; i < n; i++) {
            if (st == FL_OK)
                st = fl_model_keep_weight(m, &parts[i], devs[i]); /* takes the part either way */
            else
                fl_tensor_free(&parts[i]);
        }
        return st;
    }
    /* a vector is one row of its length; a matrix, rows of a shared width */
    const bool vec = parts[0].ndim == 1;
    const int64_t cols = parts[0].shape[parts[0].ndim - 1];
    /* scales a row: W4's groups (with a bias each), an FP8 linear's one */
    const bool w4 = parts[0].dtype == FL_DTYPE_W4 && !vec;
    const int groups = w4 ? (int)(cols / parts[0].group) : parts[0].dtype == FL_DTYPE_F8_E4M3 ? 1 : 0;
    int64_t rows = 0;
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        rows += parts[i].shape[0];
        bytes += vec ? fl_dtype_row_bytes(parts[i].dtype, parts[i].shape[0])
                     : fl_dtype_row_bytes(parts[i].dtype, cols) * (size_t)parts[i].shape[0];
    }
    fl_tensor h = parts[0];
    h.shape[0] = rows;
    h.data = malloc(bytes);
    h.scales = groups ? malloc(sizeof(float) * (size_t)rows * groups) : NULL;
    h.bias = w4 ? malloc(sizeof(float) * (size_t)rows * groups) : NULL;
    h.owned = 1;
    if (!h.data || (groups && !h.scales) || (w4 && !h.bias)) {
        free(h.data);
        free(h.scales);
        free(h.bias);
        for (int i = 0; i < n; i++) fl_tensor_free(&parts[i]);
        return FL_ERR(FL_ERR_OOM, "out of memory fusing %d weights", n);
    }
    size_t at = 0, gat = 0;
    for (int i = 0; i < n; i++) {
        const int64_t r = parts[i].shape[0];
        const size_t b = vec ? fl_dtype_row_bytes(parts[i].dtype, r) : fl_dtype_row_bytes(parts[i].dtype, cols) * (size_t)r;
        memcpy((char *)h.data + at, parts[i].data, b);
        at += b;
        if (groups) {
            memcpy(h.scales + gat, parts[i].scales, sizeof(float) * (size_t)r * groups);
            if (w4) memcpy(h.bias + gat, parts[i].bias, sizeof(float) * (size_t)r * groups);
            gat += (size_t)r * groups;
        }
        fl_tensor_free(&parts[i]);
    }
    return fl_model_keep_weight(m, &h, fused);
}
