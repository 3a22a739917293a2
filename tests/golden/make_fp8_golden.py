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
  qwen2_moe_ct_fp8     the `qwen2_moe` fixture (8 experts top-2, a gated
                       shared expert, one dense layer) with every attention,
                       expert, shared-expert and dense MLP linear compressed
                       by the compressed-tensors package (FP8_DYNAMIC:
                       channel scales); the routers (mlp.gate) and
                       shared_expert_gate stay f32, in the scheme's ignore list
  qwen2_moe_fp8_block  the same linears as quant_method "fp8" with
                       weight_block_size [8, 8]: DeepSeek-V3's format (f32
                       weight_scale_inv tiles) with tiles small enough that
                       the 16..88-wide matrices of the tiny model hold
                       several; 8 divides every dimension, as transformers'
                       own FP8 dequantization requires of a grid of more
                       than one tile, and tp 2 cuts inside a tile (expert
                       rows 40 -> 20 + 20, shared 56 -> 28 + 28)

The reference is transformers in float64 on the exact dequantized weights
(e4m3 value * scale, exact in float64), over golden.json's prompt (logits.f64;
greedy tokens by full recompute): the float model whose weights are exactly
the dequantized fp8 values. For the MoE fixtures those weights are written
per expert as F64 safetensors and loaded by from_pretrained, which fuses
the experts as transformers 5 keeps them; their router margins (k-th minus
(k+1)-th router logit) are checked on that reference, so that the expert
choice cannot flip on a 1e-6 difference. Every folder is also loaded as it is by
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
import tempfile

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
from compressed_tensors.quantization.utils.helpers import calculate_qparams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import RouterTap  # noqa: E402 (the MoE fixtures' router margin)

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "llama")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEEP_EXACT = ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# name: (kind, scheme preset or block size, format)
FIXTURES = {"llama_ct_fp8": ("ct", "FP8_DYNAMIC", "float-quantized"),
            "llama_ct_fp8_tensor": ("ct", "FP8", "naive-quantized"),
            "llama_fp8_tensor": ("hf", None, None),
            "llama_fp8_block": ("hf", [128, 128], None),
            "qwen2_moe_ct_fp8": ("ct", "FP8_DYNAMIC", "float-quantized"),
            "qwen2_moe_fp8_block": ("hf", [8, 8], None)}
# linears kept exact in dequant.safetensors, per source fixture
KEEP_EXACT_MOE = ("model.layers.0.mlp.experts.5.down_proj", "model.layers.2.mlp.shared_expert.gate_proj")
# float linears of the MoE fixtures: routers and the shared expert's gate (as
# real Qwen MoE FP8 checkpoints keep them)
MOE_FLOAT = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]
PROMPT_LEN, N_NEW, MARGIN_REL, ROUTER_MARGIN_REL = 13, 8, 1e-3, 1e-3

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
            if stem in KEEP_EXACT + KEEP_EXACT_MOE:
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


def moe_reference(src_dir, tensors, deq, prompt, workdir):
    """The float64 model of exactly the dequantized weights, for a fixture
    whose experts transformers 5 fuses in memory: written per expert as F64
    safetensors with the source's config (no quantization_config) and loaded
    by from_pretrained, whose checkpoint conversion fuses them. Returns the
    model, the prompt's logits and the smallest router margin of the prompt."""
    f64 = {k: (deq[k] if k in deq else t.to(torch.float64)).contiguous()
           for k, t in tensors.items() if not k.endswith(("_scale", "_scale_inv"))}
    shutil.copy(os.path.join(src_dir, "config.json"), workdir)
    save_file(f64, os.path.join(workdir, "model.safetensors"), metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(workdir, dtype=torch.float64, attn_implementation="eager",
                                               experts_implementation="eager").eval()
    with torch.no_grad():  # every weight of the file is in the model, exactly
        sd = ref.state_dict()
        for k, v in f64.items():
            if k in sd:
                assert torch.equal(sd[k], v), k
        tap = RouterTap(ref)
        logits = ref(torch.tensor([prompt])).logits[0]
        router = tap.min_margin()
        tap.close()
    return ref, logits, router


def hf_own_load(out_dir, kind, prompt, logits):
    """transformers loads the folder as written and dequantizes it itself:
    its logits must equal the reference's within 1e-4 relative."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    if kind == "ct":  # compressed-tensors would also round activations to FP8, which flotilla does not do
        hf.apply(disable_quantization)
    with torch.no_grad():
        got = hf(torch.tensor([prompt])).logits[0].to(torch.float64)
    hf_err = float(((got - logits).abs().amax(dim=-1) / logits.abs().amax(dim=-1)).max())
    assert hf_err <= 1e-4, f"{out_dir}: transformers' own FP8 load differs by {hf_err:.2e}"
    return hf_err


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
        elif name.startswith("qwen2_moe"):
            src_dir = os.path.join(HERE, "qwen2_moe")
            gm = json.load(open(os.path.join(src_dir, "golden.json")))
            seed, prompt = gm.get("seed"), gm["prompt_ids"]
            with safe_open(os.path.join(src_dir, "model.safetensors"), "pt") as f:
                moe_src = {k: f.get_tensor(k) for k in f.keys()}
            if kind == "ct":
                scheme = preset_name_to_scheme(arg, ["Linear"])
                tensors, deq, keep = quantize_all(moe_src, lambda w: ct_quantize(w, scheme)[:3])
            else:
                tensors, deq, keep = quantize_all(moe_src, lambda w: hf_quantize(w, arg))
            # qwen2_moe's prompt, else the first seeded one whose router and
            # logit margins are safe on the quantized model
            vocab = json.load(open(os.path.join(src_dir, "config.json")))["vocab_size"]
            with tempfile.TemporaryDirectory() as work:
                for s in [None] + list(range(5300, 5400)):
                    if s is not None:
                        seed = s
                        g = torch.Generator().manual_seed(s)
                        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()
                    ref, logits, router = moe_reference(src_dir, tensors, deq, prompt, work)
                    toks = greedy(ref, prompt, N_NEW)
                    tap = RouterTap(ref)
                    with torch.no_grad():
                        full = ref(torch.tensor([prompt + toks[:-1]])).logits[0]
                    router = min(router, tap.min_margin())
                    tap.close()
                    if router >= ROUTER_MARGIN_REL and min(margins(logits), margins(full)) >= MARGIN_REL \
                            and len(set(toks)) >= 3:
                        break
                else:
                    raise SystemExit(f"{name}: no prompt with router margin >= {ROUTER_MARGIN_REL}")
            c = json.load(open(os.path.join(src_dir, "config.json")))
            shutil.copy(os.path.join(src_dir, "generation_config.json"), out_dir)
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
        moe = name.startswith("qwen2_moe")
        ignore = MOE_FLOAT if moe else ["lm_head"]
        if kind == "ct":
            qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                                    quantization_status="compressed", ignore=ignore)
            c["quantization_config"] = json.loads(qc.model_dump_json(exclude_none=False))
            c["quantization_config"]["quant_method"] = "compressed-tensors"
        else:
            c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": arg,
                                        "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate"]
                                        if moe else ["lm_head"]}
        json.dump(c, open(os.path.join(out_dir, "config.json"), "w"), indent=2, sort_keys=True)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        save_file(keep, os.path.join(out_dir, "dequant.safetensors"))
        logits = logits.detach()
        logits.numpy().astype("<f8").tofile(os.path.join(out_dir, "logits.f64"))
        full = ref(torch.tensor([prompt + toks[:-1]])).logits[0].detach()
        margin = min(margins(logits), margins(full))

        # transformers loads the folder as written and dequantizes it itself
        hf_err = hf_own_load(out_dir, kind, prompt, logits)

        golden = {"arch": c["architectures"][0], "prompt_ids": prompt, "logits_file": "logits.f64",
                  "vocab_size": int(logits.shape[1]), "n_positions": len(prompt), "greedy_new_tokens": toks,
                  "min_margin": margin, "seed": seed, "hf_fp8_load_max_rel_err": hf_err,
                  "weights_dtype": "float8_e4m3fn linears" + (", bf16 rest" if name == "llama_fp8_block" else ""),
                  "notes": f"{name} (make_fp8_golden.py)"}
        if moe:
            golden["min_router_margin"] = router
        json.dump(golden, open(os.path.join(out_dir, "golden.json"), "w"), indent=1)
        print(name, "seed", seed, "min_margin", f"{margin:.3g}", "hf load err", f"{hf_err:.2e}", "greedy", toks)


if __name__ == "__main__":
    main(sys.argv[1:] or list(FIXTURES))
