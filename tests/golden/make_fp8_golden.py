#!/usr/bin/env python3
"""make_fp8_golden.py — FP8 (float8_e4m3fn) checkpoint fixtures.

  llama_ct_fp8         the `llama` fixture's decoder linears compressed by the
                       compressed-tensors package (FP8_DYNAMIC scheme: one bf16
                       scale per output channel, dynamic per-token input
                       activations), format "float-quantized"
  llama_ct_fp8_tensor  the same with the FP8 scheme (one f32 scale per tensor,
                       a static input_scale), format "naive-quantized"
  llama_fp8_tensor     quant_method "fp8" (transformers' FineGrainedFP8Config)
                       with weight_block_size null: a scalar f32
                       weight_scale_inv per linear
  llama_fp8_block      quant_method "fp8", weight_block_size [128, 128]
                       (DeepSeek-V3 style) on a tiny llama of its own (hidden
                       128, intermediate 256, 64-row k/v: one partial tile),
                       bf16 embeddings and norms; weight + f32 weight_scale_inv
                       tiles made as transformers' Fp8Quantize makes them
                       (scale = 448 / amax of the tile, stored inverted)

The reference is transformers in float64 on the exact dequantized weights
(e4m3 value * scale, exact in float64), over golden.json's prompt (logits.f64;
greedy tokens by full recompute). Every folder is also loaded as it is by
transformers (its own FP8 dequantization on the CPU; compressed-tensors'
activation fake-quantization switched off, as flotilla keeps activations in
bf16 / f32) and must give the same logits within 1e-4 relative
(`hf_fp8_load_max_rel_err`). `dequant.safetensors`
keeps two linears as f32 (e4m3 * scale rounded once to f32, the engine's
value) for the loader's bit-exact check (tests/test_fp8.c).
"""
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
from compressed_tensors.quantization.utils.helpers import calculate_qparams

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "llama")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEEP_EXACT = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# name: (kind, scheme preset or block size, format)
FIXTURES = {"llama_ct_fp8": ("ct", "FP8_DYNAMIC", "float-quantized"),
            "llama_ct_fp8_tensor": ("ct", "FP8", "naive-quantized"),
            "llama_fp8_tensor": ("hf", None, None),
            "llama_fp8_block": ("hf", [128, 128], None)}
PROMPT_LEN, N_NEW, MARGIN_REL = 13, 8, 1e-3

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)


def ct_quantize(w, scheme):
    """compressed-tensors: scale from the package's qparams, compressed by its compressor."""
    a = scheme.weights
    x = w if a.strategy == "channel" else w.reshape(1, -1)
    scale, _ = calculate_qparams(x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True), a)
    # FP8_DYNAMIC checkpoints keep channel scales in the model's bf16; the FP8 scheme's one scale in f32
    scale = scale.to(torch.bfloat16 if a.strategy == "channel" else torch.float32)
    if a.strategy == "tensor":
        scale = scale.reshape(1)
    sd = {"weight": w, "weight_scale": scale}
    comp = FloatQuantizationCompressor.compress(dict(sd), scheme)
    assert comp["weight"].dtype == torch.float8_e4m3fn
    s = comp["weight_scale"].to(torch.float64)
    exact = comp["weight"].to(torch.float64) * (s if s.ndim == 2 else s.reshape(1, 1))
    back = FloatQuantizationCompressor.decompress(dict(comp), scheme)["weight"]
    assert torch.equal(back.to(torch.float64), exact.to(back.dtype).to(torch.float64)), "decompress != exact"
    if scheme.input_activations is not None and not scheme.input_activations.dynamic:
        comp["input_scale"] = (w.abs().amax() / FP8_MAX).reshape(1).to(torch.float32)  # ignored by flotilla
    f32 = (comp["weight"].to(torch.float32) * comp["weight_scale"].to(torch.float32).reshape(s.shape[0] if s.ndim == 2 else 1, 1))
    return comp, exact, f32


def hf_quantize(w, block):
    """quant_method fp8: Fp8Quantize's formula per tile (the whole tensor without a block size)."""
    rows, cols = w.shape
    br, bc = block if block else (rows, cols)
    gr, gc = -(-rows // br), -(-cols // bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    inv = torch.empty(gr, gc, dtype=torch.float32)
    for i in range(gr):
        for j in range(gc):
            tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].to(torch.float32)
            amax = tile.abs().amax()
            scale = FP8_MAX / amax if amax > 0 else torch.tensor(1.0)
            inv[i, j] = 1.0 / scale
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rs = inv.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    exact = q.to(torch.float64) * rs.to(torch.float64)
    f32 = q.to(torch.float32) * rs
    saved = {"weight": q, "weight_scale_inv": inv if block else inv.reshape(())}
    return saved, exact, f32


def block_config():
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, attention_bias=False, mlp_bias=False)


def block_source(seed):
    """A random tiny llama in bf16 (norms 1 + 0.1 N, matrices 0.08 N) and a prompt."""
    cfg = block_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    src = {}
    for n, p in model.state_dict().items():
        v = 1 + 0.1 * torch.randn(p.shape, generator=g) if n.endswith("norm.weight") else \
            torch.randn(p.shape, generator=g) * 0.08
        src[n] = v.to(torch.bfloat16)
    prompt = torch.randint(3, cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist()
    return cfg, src, prompt


def greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def margins(logits):
    top2 = logits.topk(2, dim=-1).values
    return float(((top2[:, 0] - top2[:, 1]) / logits.abs().amax(dim=-1)).min())


def quantize_all(src, quant):
    tensors, deq, keep = {}, {}, {}
    for k, t in src.items():
        stem = k[: -len(".weight")] if k.endswith(".weight") else None
        if stem and ".layers." in k and stem.split(".")[-1] in LINEARS:
            saved, exact, f32 = quant(t.to(torch.float32))
            for sfx, v in saved.items():
                tensors[f"{stem}.{sfx}"] = v.contiguous()
            deq[k] = exact
            if stem in KEEP_EXACT:
                keep[stem] = f32.contiguous()
        else:
            tensors[k] = t
    return tensors, deq, keep


def reference(cfg, tensors, deq, prompt):
    ref = LlamaForCausalLM(cfg).to(torch.float64).eval()
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        sd = ref.state_dict()
        for k in sd:
            sd[k].copy_(deq[k] if k in deq else tensors[k].to(torch.float64))
        logits = ref(torch.tensor([prompt])).logits[0]
    return ref, logits


def main(names):
    g0 = json.load(open(os.path.join(HERE, "llama", "golden.json")))
    with safe_open(os.path.join(SRC, "model.safetensors"), "pt") as f:
        llama = {k: f.get_tensor(k) for k in f.keys()}
    for name in names:
        kind, arg, fmt = FIXTURES[name]
        out_dir = os.path.join(HERE, name)
        os.makedirs(out_dir, exist_ok=True)
        if name == "llama_fp8_block":
            for seed in range(5100, 5200):
                cfg, src, prompt = block_source(seed)
                tensors, deq, keep = quantize_all(src, lambda w: hf_quantize(w, arg))
                ref, logits = reference(cfg, tensors, deq, prompt)
                toks = greedy(ref, prompt, N_NEW)
                full = ref(torch.tensor([prompt + toks[:-1]])).logits[0].detach()
                if min(margins(logits), margins(full)) >= MARGIN_REL and len(set(toks)) >= 3:
                    break
            else:
                raise SystemExit(f"{name}: no seed with margin >= {MARGIN_REL}")
            c = cfg.to_dict()
            c["architectures"] = ["LlamaForCausalLM"]
            c["torch_dtype"] = "bfloat16"
            c.pop("dtype", None)
            json.dump({"bos_token_id": 1, "eos_token_id": 2},
                      open(os.path.join(out_dir, "generation_config.json"), "w"))
        else:
            seed, prompt = g0.get("seed"), g0["prompt_ids"]
            cfg = LlamaConfig.from_pretrained(SRC)
            if kind == "ct":
                scheme = preset_name_to_scheme(arg, ["Linear"])
                tensors, deq, keep = quantize_all(llama, lambda w: ct_quantize(w, scheme)[:3])
            else:
                tensors, deq, keep = quantize_all(llama, lambda w: hf_quantize(w, None))
            ref, logits = reference(cfg, tensors, deq, prompt)
            toks = greedy(ref, prompt, N_NEW)
            c = json.load(open(os.path.join(SRC, "config.json")))
            shutil.copy(os.path.join(SRC, "generation_config.json"), out_dir)
        if kind == "ct":
            qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                                    quantization_status="compressed", ignore=["lm_head"])
            c["quantization_config"] = json.loads(qc.model_dump_json(exclude_none=False))
            c["quantization_config"]["quant_method"] = "compressed-tensors"
        else:
            c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": arg, "modules_to_not_convert": ["lm_head"]}
        json.dump(c, open(os.path.join(out_dir, "config.json"), "w"), indent=2, sort_keys=True)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        save_file(keep, os.path.join(out_dir, "dequant.safetensors"))
        logits = logits.detach()
        logits.numpy().astype("<f8").tofile(os.path.join(out_dir, "logits.f64"))
        full = ref(torch.tensor([prompt + toks[:-1]])).logits[0].detach()
        margin = min(margins(logits), margins(full))

        # transformers loads the folder as written and dequantizes it itself
        hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        if kind == "ct":  # compressed-tensors would also round activations to FP8, which flotilla does not do
            hf.apply(disable_quantization)
        with torch.no_grad():
            got = hf(torch.tensor([prompt])).logits[0].to(torch.float64)
        hf_err = float(((got - logits).abs().amax(dim=-1) / logits.abs().amax(dim=-1)).max())
        assert hf_err <= 1e-4, f"{name}: transformers' own FP8 load differs by {hf_err:.2e}"

        golden = {"arch": "LlamaForCausalLM", "prompt_ids": prompt, "logits_file": "logits.f64",
                  "vocab_size": int(logits.shape[1]), "n_positions": len(prompt), "greedy_new_tokens": toks,
                  "min_margin": margin, "seed": seed, "hf_fp8_load_max_rel_err": hf_err,
                  "weights_dtype": "float8_e4m3fn linears" + (", bf16 rest" if name == "llama_fp8_block" else ""),
                  "notes": f"{name} (make_fp8_golden.py)"}
        json.dump(golden, open(os.path.join(out_dir, "golden.json"), "w"), indent=1)
        print(name, "seed", seed, "min_margin", f"{margin:.3g}", "hf load err", f"{hf_err:.2e}", "greedy", toks)


if __name__ == "__main__":
    main(sys.argv[1:] or list(FIXTURES))
