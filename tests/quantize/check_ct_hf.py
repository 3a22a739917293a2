"""check_ct_hf.py CT_DIR IDS.json FLOTILLA_LOGITS.f32 [AWQ_DIR [OUT_REF.f32]] —
checks a compressed-tensors checkpoint written by `flotilla quantize --format
compressed-tensors` with the compressed-tensors package and Hugging Face
transformers, and compares their logits with flotilla's on the same prompt
(max |diff| / max |logit| <= 1e-4 per position, printed).

1. config.json's quantization_config parses as the package's
   QuantizationConfig, and its one scheme is the package's W4A16_ASYM preset
   at the written group size: pack-quantized, ignore ["lm_head"].
2. Every linear is decompressed by the package's own
   PackedQuantizationCompressor.decompress; the result must equal the exact
   float64 value (q - zp) * scale from the package's unpack_from_int32
   rounded to the scale's dtype (the package multiplies in it: exact for f32
   and f16 scales, rounded for bf16 ones), and the exact value must equal the
   numpy decoding of same_weights.py.
3. With AWQ_DIR (the AutoAWQ checkpoint written with the same model,
   calibration file and options), both formats must decode to the same
   weights exactly (same_weights.py).
4. transformers loads CT_DIR through its compressed-tensors integration, with
   CompressedTensorsConfig(dequantize=True): the default, which keeps the
   layers compressed, fails for asymmetric schemes (transformers 5.25 with
   compressed-tensors 0.20.1 build the compressed layers' zero points
   unpacked, [out, in/group], and refuse the packed [ceil(out/8), in/group]
   the package itself writes; the package's own fixtures fail the same way).
   Its weights must equal the package's decompression; the model then runs
   in float64 with the exact values in its linears (flotilla computes with
   them; for f32 and f16 models they are the loaded weights). With OUT_REF,
   writes its float32 logits (the reference tests/test_quantize.sh compares
   flotilla with).

Needs torch, transformers, compressed-tensors, safetensors (not run in CI; see
docs/quantize.md).
"""
import json
import os
import sys

import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import same_weights  # noqa: E402


def check_config(d):
    qc = json.load(open(f"{d}/config.json"))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized", qc
    cfg = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in ("sparsity_config",
                                                                                       "transform_config")})
    assert list(cfg.config_groups) == ["group_0"] and cfg.ignore == ["lm_head"], cfg
    scheme = cfg.config_groups["group_0"]
    want = preset_name_to_scheme("W4A16_ASYM", ["Linear"])
    want.weights.group_size = scheme.weights.group_size
    assert scheme.weights.model_dump() == want.weights.model_dump(), (scheme.weights, want.weights)
    assert scheme.targets == ["Linear"] and scheme.input_activations is None, scheme
    return scheme


def check_weights(d, scheme):
    """-> {prefix.weight: (package-decompressed weight, exact float64 weight)}."""
    st = load_file(f"{d}/model.safetensors")
    ref = same_weights.decode(f"{d}/model.safetensors")
    out = {}
    for name, packed in st.items():
        if not name.endswith(".weight_packed"):
            continue
        p = name[: -len(".weight_packed")]
        scale, zp, shape = st[p + ".weight_scale"], st[p + ".weight_zero_point"], st[p + ".weight_shape"]
        n_out, n_in = shape.tolist()
        g = n_in // scale.shape[1]
        assert packed.dtype == torch.int32 and list(packed.shape) == [n_out, n_in // 8], (name, packed.shape)
        assert zp.dtype == torch.int32 and list(zp.shape) == [(n_out + 7) // 8, n_in // g], (p, zp.shape)
        assert list(scale.shape) == [n_out, n_in // g] and shape.dtype == torch.int64, (p, scale.shape)
        comp = {"weight_packed": packed, "weight_scale": scale, "weight_zero_point": zp, "weight_shape": shape}
        w = PackedQuantizationCompressor.decompress(comp, scheme)["weight"]
        q = unpack_from_int32(packed, 4, torch.Size([n_out, n_in])).double()
        z = unpack_from_int32(zp, 4, torch.Size([n_out, n_in // g]), packed_dim=0).double()
        exact = (q - z.repeat_interleave(g, dim=1)) * scale.double().repeat_interleave(g, dim=1)
        assert q.min() >= -8 and q.max() <= 7 and z.min() >= -8 and z.max() <= 7, p
        assert torch.equal(w, exact.to(w.dtype)), f"{p}: package decompress is not the exact value rounded"
        assert np.array_equal(exact.numpy(), ref[p + ".weight"]), f"{p}: numpy decoding differs"
        out[p + ".weight"] = (w, exact)
    return out


def main():
    d, ids_path, fl_path = sys.argv[1:4]
    scheme = check_config(d)
    deq = check_weights(d, scheme)
    msg = f"{len(deq)} linears: package decompress == exact (q - zp) * scale (in the scale dtype) == numpy decoding"
    if len(sys.argv) > 4:
        print(same_weights.check_same(sys.argv[4], d))
    model = AutoModelForCausalLM.from_pretrained(d, quantization_config=CompressedTensorsConfig(dequantize=True))
    sd = model.state_dict()
    for k, (w, _) in deq.items():
        assert torch.equal(sd[k], w.to(sd[k].dtype)), f"{k}: transformers' weight differs from the package's"
    model = model.double().eval()
    sd = model.state_dict()
    with torch.no_grad():
        for k, (_, exact) in deq.items():
            sd[k].copy_(exact)
    ids = json.load(open(ids_path))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    what = f"{msg} (group {scheme.weights.group_size}); transformers loads it"
    sys.exit(same_weights.compare_logits(fl_path, ref, what, sys.argv[5] if len(sys.argv) > 5 else None))


if __name__ == "__main__":
    main()
