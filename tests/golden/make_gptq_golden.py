#!/usr/bin/env python3
"""make_gptq_golden.py — GPTQ int4 fixtures, quantized and packed by GPTQModel.

A tiny random llama (hidden 64, intermediate 128, 2 layers, vocab 256, f16
like real GPTQ checkpoints) whose decoder linears are quantized by
GPTQModel's own GPTQ algorithm (gptqmodel.quantization.gptq.GPTQ on random
calibration inputs with uneven channel magnitudes, as optimum drives it),
packed by its TorchLinear.pack and, for checkpoint format "gptq", converted
to the old on-disk zero points by its convert_gptq_v2_to_v1_format_module
(qzeros word - 0x11111111). Tensors per linear, as GPTQModel saves them:
`qweight` I32 [in/8, out], `qzeros` I32 [n_groups, out/8], `scales` F16
[n_groups, out], `g_idx` I32 [in]. Folders:

  llama_gptq       symmetric, group 32, no act-order, format "gptq" (v1)
  llama_gptq_act   asymmetric, group 32, desc_act (g_idx permuted), "gptq"
  llama_gptq_chan  asymmetric, group_size -1 (per channel), "gptq_v2"

The reference weight of every linear is GPTQModel's own dequantize_weight()
of the module after the v1 -> v2 load conversion that transformers' GPTQ
path applies, run with the scales widened to f32 so it returns the exact
(q - z) * s (asserted equal to an independent unpacking, and to the f16
result the package normally returns once rounded). Those weights go into
the same llama in transformers, float64, over golden.json's prompt
(logits.f64, greedy tokens by full recompute). `dequant.safetensors` keeps
two linears' exact f32 values for the loader's bit-exact check
(tests/test_quant.c).

Needs torch, transformers, safetensors and gptqmodel (7.7.0; installed with
`pip install --no-deps gptqmodel==7.7.0` plus pypcre logbar device-smi
threadpoolctl accelerate tokenicer defuser pillow requests, which its
modules import). Run: python3 tests/golden/make_gptq_golden.py [fixture ...]
"""
import json
import os
import sys

os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # pure-torch packing, no JIT C++ build

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from gptqmodel.nn_modules.qlinear.torch import TorchLinear
from gptqmodel.quantization.config import QuantizeConfig
from gptqmodel.quantization.gptq import GPTQ
from gptqmodel.utils.model import (convert_gptq_v1_to_v2_format_module,
                                   convert_gptq_v2_to_v1_format_module)

HERE = os.path.dirname(os.path.abspath(__file__))
LINEARS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
KEEP_EXACT = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")
# name: (sym, group_size, desc_act, checkpoint format)
FIXTURES = {"llama_gptq": (True, 32, False, "gptq"), "llama_gptq_act": (False, 32, True, "gptq"),
            "llama_gptq_chan": (False, -1, False, "gptq_v2")}
PROMPT_LEN, N_NEW, MARGIN_REL = 13, 8, 1e-3

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)


def llama_config():
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, attention_bias=False, mlp_bias=False)


def unpack(module, in_f, out_f):
    """Independent unpacking of a v2-format module: q [in, out], z [G, out]."""
    qw = module.qweight.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(qw >> (4 * k)) & 0xF for k in range(8)], dim=1).reshape(in_f, out_f)
    qz = module.qzeros.to(torch.int64) & 0xFFFFFFFF
    z = torch.stack([(qz >> (4 * k)) & 0xF for k in range(8)], dim=2).reshape(qz.shape[0], out_f)
    return q, z


def quantize_linear(w, sym, group, desc_act, fmt, seed):
    """w f32 [out, in] -> (tensors to save, exact f64 weight [out, in])."""
    out_f, in_f = w.shape
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    lin.weight.data.copy_(w)
    gar = group > 0 and not desc_act  # GPTQModel's default group-aware reordering needs groups
    qcfg = QuantizeConfig(bits=4, group_size=group, sym=sym, desc_act=desc_act, act_group_aware=gar,
                          offload_to_disk=False)
    gq = GPTQ(lin, qcfg)
    gq.quantizer.configure(perchannel=True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 32, in_f, generator=g) * torch.exp(torch.randn(in_f, generator=g))
    gq.add_batch(x, lin(x))
    scale, zero, g_idx, *_ = gq.hf_quantize(group_size=group, actorder=desc_act, act_group_aware=gar)
    lin.weight.data.copy_(w)  # hf_quantize leaves the fake-quantized weight; pack recomputes codes from w
    ql = TorchLinear(bits=4, group_size=group if group > 0 else in_f, sym=sym, desc_act=desc_act,
                     in_features=in_f, out_features=out_f, bias=False)
    ql.pack(lin, scale, zero, g_idx)
    trivial = torch.equal(ql.g_idx.long(), torch.arange(in_f) // (group if group > 0 else in_f))
    assert trivial != desc_act, "act-order must (and only it must) permute g_idx"
    if fmt == "gptq":
        convert_gptq_v2_to_v1_format_module(ql, QuantizeConfig(bits=4))
    saved = {"qweight": ql.qweight.clone(), "qzeros": ql.qzeros.clone(), "scales": ql.scales.clone(),
             "g_idx": ql.g_idx.to(torch.int32).clone()}
    if fmt == "gptq":  # what loading a "gptq" checkpoint does before the torch kernel runs
        convert_gptq_v1_to_v2_format_module(ql, bits=4, pack_dtype=torch.int32)
    q, z = unpack(ql, in_f, out_f)
    gi = ql.g_idx.long()
    exact = ((q - z[gi]).to(torch.float64) * ql.scales.to(torch.float64)[gi]).T.contiguous()  # [out, in]
    assert torch.equal(exact.to(torch.float32).to(torch.float64), exact), "exact value must be exact in f32"
    ql.post_init()
    pkg16 = ql.dequantize_weight().T  # the package's f16 dequantization
    assert torch.equal(pkg16, exact.to(torch.float16)), "package f16 dequant != exact value rounded"
    ql.scales.data = ql.scales.data.to(torch.float32)
    ql.clear_weight_cache()
    pkg32 = ql.dequantize_weight().T
    assert pkg32.dtype == torch.float32 and torch.equal(pkg32.to(torch.float64), exact), \
        "package f32 dequant != exact (q - z) * s"
    if sym:
        assert bool((z == 8).all()), "symmetric GPTQ zero point is 8 (stored 7 in format gptq)"
    return saved, exact


def greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def margins(logits):
    top2 = logits.topk(2, dim=-1).values
    return float(((top2[:, 0] - top2[:, 1]) / logits.abs().amax(dim=-1)).min())


def build(name, seed):
    sym, group, desc_act, fmt = FIXTURES[name]
    cfg = llama_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(torch.float16).to(p.dtype))
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)).to(torch.float16).to(p.dtype))
    prompt = torch.randint(3, cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist()
    tensors, deq, keep = {}, {}, {}
    for k, t in model.state_dict().items():
        stem = k[: -len(".weight")]
        if ".layers." in k and stem.split(".")[-1] in LINEARS:
            saved, exact = quantize_linear(t.float(), sym, group, desc_act, fmt, seed + len(tensors))
            for sfx, v in saved.items():
                tensors[f"{stem}.{sfx}"] = v.contiguous()
            deq[k] = exact
            if stem in KEEP_EXACT:
                keep[stem] = exact.to(torch.float32)
        else:
            tensors[k] = t.to(torch.float16).contiguous()
    ref = LlamaForCausalLM(cfg).to(torch.float64).eval()
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        sd = ref.state_dict()
        for k in sd:
            sd[k].copy_(deq[k] if k in deq else tensors[k].to(torch.float64))
        logits = ref(torch.tensor([prompt])).logits[0]
    return cfg, prompt, tensors, keep, ref, logits


def main(names):
    for name in names:
        sym, group, desc_act, fmt = FIXTURES[name]
        for seed in range(4200, 4300):
            cfg, prompt, tensors, keep, ref, logits = build(name, seed)
            toks = greedy(ref, prompt, N_NEW)
            full = ref(torch.tensor([prompt + toks[:-1]])).logits[0].detach()
            margin = min(margins(logits), margins(full))
            if margin >= MARGIN_REL and len(set(toks)) >= 3:
                break
        else:
            raise SystemExit(f"{name}: no seed with margin >= {MARGIN_REL}")
        out_dir = os.path.join(HERE, name)
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        save_file(keep, os.path.join(out_dir, "dequant.safetensors"))
        c = cfg.to_dict()
        c["architectures"] = ["LlamaForCausalLM"]
        c["torch_dtype"] = "float16"
        c.pop("dtype", None)
        c["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                    "desc_act": desc_act, "static_groups": False, "true_sequential": True,
                                    "damp_percent": 0.01, "pack_dtype": "int32", "format": fmt,
                                    "checkpoint_format": fmt}
        json.dump(c, open(os.path.join(out_dir, "config.json"), "w"), indent=2, sort_keys=True)
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, open(os.path.join(out_dir, "generation_config.json"), "w"))
        logits.detach().numpy().astype("<f8").tofile(os.path.join(out_dir, "logits.f64"))
        golden = {"arch": "LlamaForCausalLM", "prompt_ids": prompt, "logits_file": "logits.f64",
                  "vocab_size": cfg.vocab_size, "n_positions": len(prompt), "greedy_new_tokens": toks,
                  "min_margin": margin, "seed": seed, "weights_dtype": "int4 GPTQ / f16 scales, f16 rest",
                  "notes": f"GPTQ {'symmetric' if sym else 'asymmetric'} group {group}"
                           f"{' act-order' if desc_act else ''}, format {fmt} (make_gptq_golden.py)"}
        json.dump(golden, open(os.path.join(out_dir, "golden.json"), "w"), indent=1)
        print(name, "seed", seed, "min_margin", margin, "greedy", toks)


if __name__ == "__main__":
    main(sys.argv[1:] or list(FIXTURES))
