#!/usr/bin/env python3
"""make_decode_refs.py — teacher-forced decode references for the golden fixtures.

For each fixture folder (tests/golden/<name>/, see README.md) this writes

  decode_ref.json     {"prompt_ids", "tokens", "n_rows", "vocab_size",
                       "logits_file", "transformers", "torch", "notes"}
  decode_logits.f32   raw float32 little-endian [n_rows, vocab_size]

where `tokens` is the greedy continuation (N_NEW tokens) of the float64 model
and row r of the logits file is the float64 model's logits after the prompt
and the first r tokens of the continuation (row 0: the prompt's last
position; row N_NEW: after the whole continuation), computed the way
generate() computes them: one prefill forward of the prompt, then one forward
per token with the KV cache (past_key_values). So each row is the teacher-
forced logits of that decode position (the continuation is the model's own
greedy choice, so teacher forcing and greedy decoding coincide here).

The cached path matters only for dynamic-NTK RoPE (llama_dynamic): there the
prefill rotates with the prompt's length and each decode step with its own,
keys keeping the rotation they were stored with — what a paged-KV engine
does, and what a full recompute (logits.f64) does not.

`llama` gets a second, long reference, decode_long.json / decode_long.f32: a
520-token random prompt (beyond 512, past the 128/256/512 context buckets of
the CUDA graphs and the attention kernels' tile sizes). Its RoPE is the
default one (no scaling), which does not depend on max_position_embeddings
(128 in config.json) in transformers nor in the engine, so the fixture is
unchanged.

MoE fixtures also get `router_margin`: per row, the smallest gap between
the k-th and (k+1)-th router logit over the MoE layers, relative to that
router's largest |logit| (row 0: over every prompt position). A small one
is a routing near-tie: a bf16 backend may pick the other expert there, and
the row's logits then differ by more than rounding (tests/test_decode_steps.c).

Sanity check (asserted): the prefill's logits equal the committed logits.f64
rows (same prompt) to 1e-6 relative.

Usage: python3 tests/golden/make_decode_refs.py [fixture ...]   (~1 min, CPU)
Needs torch, transformers and safetensors (pip install torch transformers).
"""

import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import check_golden as cg  # noqa: E402  (hf_model: the fixtures as float64 transformers models)
import make_golden as mg  # noqa: E402
import transformers  # noqa: E402

torch.set_num_threads(2)

N_NEW = 32
LONG_T = 520
FIXTURES = ["llama", "llama_awq", "llama_tied_rope3", "llama_linear", "llama_dynamic", "llama_yarn",
            "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v2_lite"]


@torch.no_grad()
def cached_decode(model, prompt, n_new):
    """Prefill, then n_new greedy steps with the KV cache; returns the tokens
    and the [n_new + 1, V] float64 logits rows (see the top)."""
    mg.reset_dynamic_rope(model)
    x = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=x, use_cache=True)
    past = out.past_key_values
    rows = [out.logits[0, -1].to(torch.float64)]
    prefill = out.logits[0].to(torch.float64)
    toks = []
    for i in range(n_new):
        tok = int(rows[-1].argmax())
        toks.append(tok)
        pos = torch.tensor([[len(prompt) + i]], dtype=torch.long)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, position_ids=pos,
                    cache_position=pos[0], use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0, -1].to(torch.float64))
    return toks, torch.stack(rows), prefill


def moe_routers(model):
    """The router linears of the MoE layers ([n_experts, hidden] weights)."""
    c = model.config
    n = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or getattr(c, "n_routed_experts", None)
    if not n:
        return []
    return [mod for name, mod in model.named_modules()
            if name.endswith(".gate") and getattr(mod, "weight", None) is not None and mod.weight.shape[0] == n]


@torch.no_grad()
def router_margins(model, prompt, toks):
    """Per decode row, the smallest relative top-k routing margin over the
    MoE layers (see the top), recomputed in float64 from each router's input."""
    routers = moe_routers(model)
    if not routers:
        return None
    k = model.config.num_experts_per_tok
    seen = []

    def hook(mod, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).to(torch.float64)
        s = (x @ mod.weight.to(torch.float64).T).sort(dim=-1, descending=True).values
        seen.append(float(((s[:, k - 1] - s[:, k]) / s.abs().amax(-1)).min()))

    hooks = [r.register_forward_hook(hook) for r in routers]
    try:
        mg.reset_dynamic_rope(model)
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        past, rows = out.past_key_values, [min(seen)]
        for i, tok in enumerate(toks):
            seen.clear()
            pos = torch.tensor([[len(prompt) + i]], dtype=torch.long)
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, position_ids=pos,
                        cache_position=pos[0], use_cache=True)
            past = out.past_key_values
            rows.append(min(seen))
    finally:
        for h in hooks:
            h.remove()
    return rows


def write(folder, stem, prompt, toks, rows, notes, margins=None):
    n_rows, V = rows.shape
    rows.numpy().astype("<f4").tofile(os.path.join(folder, stem + ".f32"))
    top = rows.topk(2, dim=-1).values
    doc = dict(prompt_ids=list(prompt), tokens=toks, n_rows=n_rows, vocab_size=V,
               logits_file=stem + ".f32", transformers=transformers.__version__,
               torch=torch.__version__,
               min_margin_abs=float((top[:, 0] - top[:, 1]).min()),
               max_abs_logit=float(rows.abs().max()), notes=notes)
    if margins is not None:
        doc["router_margin"] = margins
    name = "decode_ref.json" if stem == "decode_logits" else stem + ".json"
    with open(os.path.join(folder, name), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def make(name):
    folder = os.path.join(HERE, name)
    with open(os.path.join(folder, "golden.json")) as f:
        g = json.load(f)
    T, V = g["n_positions"], g["vocab_size"]
    gold = torch.from_numpy(np.fromfile(os.path.join(folder, g["logits_file"]), dtype="<f8")).view(T, V)
    m = cg.hf_model(folder)
    prompt = g["prompt_ids"]
    toks, rows, prefill = cached_decode(m, prompt, N_NEW)
    e = float(((prefill - gold).abs().amax(-1) / gold.abs().amax(-1)).max())
    assert e < 1e-6, f"{name}: prefill differs from logits.f64 by {e:.2e} (relative)"
    write(folder, "decode_logits", prompt, toks, rows,
          "greedy continuation of the float64 model, KV-cached; rows: logits after the prompt "
          "and each continuation token", router_margins(m, prompt, toks))
    agree = sum(a == b for a, b in zip(toks, g["greedy_new_tokens"]))
    print(f"{name:18s} V={V} prompt {T}, {N_NEW} tokens (first 8 agree with golden.json's "
          f"full-recompute greedy: {agree}/8), prefill vs logits.f64 {e:.1e}")
    if name == "llama":
        rng = np.random.default_rng(20261204)
        long_prompt = [int(t) for t in rng.integers(3, V, size=LONG_T)]
        toks, rows, _ = cached_decode(m, long_prompt, N_NEW)
        write(folder, "decode_long", long_prompt, toks, rows,
              f"{LONG_T}-token random prompt (ids 3..V-1, numpy default_rng(20261204)), then as decode_ref.json")
        print(f"{name:18s} long: prompt {LONG_T}, {N_NEW} tokens")


def main(argv):
    for name in argv or FIXTURES:
        make(name)


if __name__ == "__main__":
    main(sys.argv[1:])
