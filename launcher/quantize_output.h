/*
 * quantize_output.h — the checkpoint `flotilla quantize` writes, in one of
 * two formats (docs/quantize.md "The checkpoint"): which tensors
 * model.safetensors holds, a layer's tensors from its quantized float
 * weights, and config.json with the format's quantization_config beside the
 * copied tokenizer files.
 */
#ifndef FL_QUANTIZE_OUTPUT_H
#define FL_QUANTIZE_OUTPUT_H

#include "core/status.h"
#include "launcher/quantize_layer.h"
#include "launcher/st_writer.h"
#include "runtime/load/checkpoint.h"

typedef enum fl_qformat {
    FL_QFORMAT_AWQ, /* AutoAWQ GEMM: qweight / qzeros / scales (f16) */
    FL_QFORMAT_CT,  /* compressed-tensors pack-quantized (llm-compressor W4A16, asymmetric, group) */
} fl_qformat;

/* "awq" or "compressed-tensors". */
const char *fl_qformat_name(fl_qformat f);

/* Declares every output tensor in w: the decoder layers' linears as the
 * format's quantized tensors, everything else as stored in ck. */
fl_status fl_qout_plan(const fl_ckpt *ck, fl_qformat f, int group, fl_stw *w);

/* Puts every tensor outside the decoder layers, as stored. */
fl_status fl_qout_put_rest(const fl_ckpt *ck, fl_stw *w);

/* Puts layer l's tensors: the linears of L quantized, its norms and biases
 * as they are in L now (rounded to their stored dtype), anything else of
 * the layer as stored in ck. */
fl_status fl_qout_put_layer(const fl_ckpt *ck, fl_qformat f, fl_stw *w, int l, const fl_qlayer *L, int group);

/* Writes dst/config.json (src's, with the format's quantization_config)
 * and copies the tokenizer and generation files src has. */
fl_status fl_qout_side_files(const char *src, const char *dst, fl_qformat f, int group);

#endif /* FL_QUANTIZE_OUTPUT_H */
