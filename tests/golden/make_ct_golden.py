#!/usr/bin/env python3
"""make_ct_golden.py — compressed-tensors "pack-quantized" W4A16 fixtures.

The `llama` fixture's decoder linears quantized to 4 bits by the
compressed-tensors package itself (calculate_qparams on per-group min/max,
then PackedQuantizationCompressor.compress, which runs its quantize and
pack_to_int32), written as llm-compressor lays a checkpoint out
(`<linear>.weight_packed` I32 [out, in/8], `.weight_scale` BF16 [out, in/group],
`.weight_zero_point` I32 [ceil(out/8), in/group] when asymmetric,
`.weight_shape` I64 [2]; `quantization_config` from the package's
QuantizationConfig). Folders:

  llama_ct          symmetric, group 32
  llama_ct_asym     asymmetric, group 32
  llama_ct_channel  symmetric, channel (one scale per output row)

Each reference: the exact dequantized weights (q - zp) * scale in float64
(the package's decompress returns the same values rounded to the scale's
bf16, which is asserted), put into the `llama` model, run by transformers in
float64 over golden.json's prompt (logits.f64, greedy tokens by full
recompute). `dequant.safetensors` keeps the exact f32 values of two linears
for the loader's bit-exact check (tests/test_quant.c).
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "llama")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEEP_EXACT = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")
FIXTURES = {"llama_ct": (True, "group"), "llama_ct_asym": (False, "group"), "llama_ct_channel": (True, "channel")}

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)


def scheme_for(sym, strategy):
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy=strategy,
                            group_size=32 if strategy == "group" else None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def quantize_linear(w, scheme):
    """w f32 [out, in] -> (compressed dict, exact f64 dequantized weight)."""
    a = scheme.weights
    out_f, in_f = w.shape
    g = a.group_size if a.strategy == "group" else in_f
    x = w.reshape(out_f, in_f // g, g)
    scale, zp = calculate_qparams(x.amin(dim=2), x.amax(dim=2), a)
    scale = scale.to(torch.bfloat16)  # llm-compressor stores scales in the model's dtype
    zp = torch.round(zp).to(torch.int8)
    sd = {"weight": w, "weight_scale": scale}
    if not a.symmetric:
        sd["weight_zero_point"] = zp
    comp = PackedQuantizationCompressor.compress(dict(sd), scheme)
    # the exact value from the package's own unpacking
    q = unpack_from_int32(comp["weight_packed"], 4, torch.Size([out_f, in_f])).to(torch.float64)
    z = torch.zeros(out_f, in_f // g, dtype=torch.float64)
    if not a.symmetric:
        z = unpack_from_int32(comp["weight_zero_point"], 4, torch.Size([out_f, in_f // g]), packed_dim=0)
        assert torch.equal(z, zp), "zero points must round-trip"
        z = z.to(torch.float64)
    exact = ((q.reshape(out_f, in_f // g, g) - z[:, :, None]) * scale.to(torch.float64)[:, :, None]).reshape(out_f, in_f)
    back = PackedQuantizationCompressor.decompress(dict(comp), scheme)["weight"]
    assert torch.equal(back, exact.to(back.dtype)), "package decompress != exact value rounded to the scale dtype"
    assert torch.equal(exact.to(torch.float32).to(torch.float64), exact), "exact value must be exact in f32"
    return comp, exact


def greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def main(names):
    g0 = json.load(open(os.path.join(SRC, "golden.json")))
    prompt = g0["prompt_ids"]
    with safe_open(os.path.join(SRC, "model.safetensors"), "pt") as f:
        meta = f.metadata()
        src = {k: f.get_tensor(k) for k in f.keys()}
    for name in names:
        sym, strategy = FIXTURES[name]
        scheme = scheme_for(sym, strategy)
        out_dir = os.path.join(HERE, name)
        os.makedirs(out_dir, exist_ok=True)
        tensors, deq, keep = {}, {}, {}
        for k, t in src.items():
            stem = k[: -len(".weight")] if k.endswith(".weight") else None
            if stem and ".layers." in k and stem.split(".")[-1] in LINEARS:
                comp, exact = quantize_linear(t, scheme)
                for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
                    if suffix in comp:
                        tensors[f"{stem}.{suffix}"] = comp[suffix].contiguous()
                deq[k] = exact
                if stem in KEEP_EXACT:
                    keep[stem] = exact.to(torch.float32)
            else:
                tensors[k] = t
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        save_file(keep, os.path.join(out_dir, "dequant.safetensors"))
        shutil.copy(os.path.join(SRC, "generation_config.json"), out_dir)
        cfg = json.load(open(os.path.join(SRC, "config.json")))
        qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=["lm_head"])
        cfg["quantization_config"] = json.loads(qc.model_dump_json(exclude_none=False))
        cfg["quantization_config"]["quant_method"] = "compressed-tensors"
        json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=2)

        model = transformers.AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float64,
                                                                  attn_implementation="eager").eval()
        with torch.no_grad():
            sd = model.state_dict()
            for k, v in deq.items():
                sd[k].copy_(v)
            logits = model(torch.tensor([prompt])).logits[0]
        logits.numpy().astype("<f8").tofile(os.path.join(out_dir, "logits.f64"))
        top2 = logits.topk(2, dim=-1).values
        margin = float(((top2[:, 0] - top2[:, 1]) / logits.abs().amax(dim=-1)).min())
        toks = greedy(model, prompt, 8)
        golden = {"arch": "LlamaForCausalLM", "prompt_ids": prompt, "logits_file": "logits.f64",
                  "vocab_size": int(logits.shape[1]), "n_positions": len(prompt), "greedy_new_tokens": toks,
                  "min_margin": margin, "seed": g0.get("seed"), "weights_dtype": "int4 pack-quantized / bf16 scales",
                  "notes": f"compressed-tensors {'symmetric' if sym else 'asymmetric'} {strategy} of `llama` "
                           "(make_ct_golden.py)"}
        json.dump(golden, open(os.path.join(out_dir, "golden.json"), "w"), indent=1)
        print(name, "min_margin", margin, "greedy", toks)


if __name__ == "__main__":
    main(sys.argv[1:] or list(FIXTURES))
