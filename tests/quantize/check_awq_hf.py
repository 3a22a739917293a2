"""check_awq_hf.py AWQ_DIR IDS.json FLOTILLA_LOGITS.f32 [OUT_REF.f32] — loads a
checkpoint written by `flotilla quantize` in Hugging Face transformers and
compares its logits with flotilla's on the same prompt (max |diff| / max
|logit| <= 1e-4 per position, printed).

The AWQ linears are dequantized in numpy (same_weights.py) with AutoAWQ's
documented GEMM layout, independently of flotilla's loader: qweight int32 [in, out/8]
and qzeros int32 [in/group, out/8] hold 8 nibbles a word, nibble k being
output 8j + [0, 2, 4, 6, 1, 3, 5, 7][k] (AutoAWQ's AWQ_ORDER; its unpacking
applies AWQ_REVERSE_ORDER [0, 4, 1, 5, 2, 6, 3, 7] to the nibbles in
order), scales f16 [in/group, out], W[out, in] = ((q - z) * s)^T. When the
autoawq package imports, its own unpack (awq.utils.packing_utils) is used
as a second witness. The float model is then built by transformers from
config.json (quantization_config removed) and these weights, in float64.
Needs torch, transformers, safetensors (not run in CI; see
docs/quantize.md). With OUT_REF, writes transformers' float32 logits.
"""
import json
import os
import sys

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from same_weights import awq_dequant as dequant, compare_logits  # noqa: E402


def autoawq_packing():
    """awq/utils/packing_utils.py loaded alone: the package's __init__ pulls in
    model code (accelerate, old transformers APIs) that the unpacking needs not."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("awq")
    if spec is None:
        raise ModuleNotFoundError("No module named 'awq'")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "packing_utils.py")
    mod_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def autoawq_dequant(qweight, qzeros, scales):
    dequantize_gemm = autoawq_packing().dequantize_gemm
    group = qweight.shape[0] // scales.shape[0]
    w = dequantize_gemm(torch.from_numpy(qweight), torch.from_numpy(qzeros), torch.from_numpy(scales), 4, group)
    return w.double().numpy().T


def main():
    d, ids_path, fl_path = sys.argv[1:4]
    st = load_file(f"{d}/model.safetensors")
    try:
        autoawq_packing()
        have_awq = True
    except Exception as e:  # unmaintained; often fails to import with new transformers
        print(f"autoawq not usable ({type(e).__name__}: {e}); numpy dequantization only")
        have_awq = False
    sd, n_lin = {}, 0
    for name, t in st.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            w = dequant(t, st[p + ".qzeros"], st[p + ".scales"])
            if have_awq:
                w2 = autoawq_dequant(t, st[p + ".qzeros"], st[p + ".scales"])
                # AutoAWQ multiplies in f16: its result is ours rounded once to f16
                assert np.array_equal(w.astype(np.float16), w2.astype(np.float16)), f"{p}: numpy and autoawq differ"
            sd[p + ".weight"] = torch.from_numpy(w)
            n_lin += 1
        elif not name.endswith((".qzeros", ".scales")):
            sd[name] = torch.from_numpy(t.astype(np.float64))
    cfg = AutoConfig.from_pretrained(d)
    qc = getattr(cfg, "quantization_config", None)
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    assert qc["quant_method"] == "awq" and qc["bits"] == 4 and qc["version"] == "gemm" and qc["zero_point"], qc
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    ids = json.load(open(ids_path))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    what = (f"{n_lin} AWQ linears dequantized{' (numpy == autoawq dequantize_gemm)' if have_awq else ''} "
            f"(group {qc['group_size']})")
    sys.exit(compare_logits(fl_path, ref, what, sys.argv[4] if len(sys.argv) > 4 else None))

if __name__ == "__main__":
    main()
