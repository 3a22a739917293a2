#!/usr/bin/env python3
"""make_rtn_golden.py — reference for `--quantize w4` on the `llama` fixture.

Round-to-nearest asymmetric 4-bit, group 128/64/32 by what divides the columns (runtime/load/quant.c,
fl_quant_rtn_to_w4), computed here in float32 exactly as the C code does:
  per row and group of columns: mn, mx = min, max; scale = (mx - mn) / 15;
  code = clamp(round_half_away((x - mn) / scale), 0, 15); value = code * scale + mn.
Every decoder linear (q/k/v/o, gate/up/down) is replaced by its dequantized
value, then transformers runs the model in float64. Writes
tests/golden/llama/rtn_w4_logits.f64 ([T, vocab] float64) for the prompt in
golden.json.
"""
import json
import os

import numpy as np
import torch
import transformers

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama")
g = json.load(open(os.path.join(here, "golden.json")))
model = transformers.AutoModelForCausalLM.from_pretrained(here, dtype=torch.float32,
                                                          attn_implementation="eager")


def rtn(w):
    w = w.astype(np.float32)
    r, c = w.shape
    # the loader's group rule (checkpoint.c rtn_group): 128 when it divides the
    # columns, else 64, else 32
    group = next(gs for gs in (128, 64, 32) if c % gs == 0)
    x = w.reshape(r, c // group, group)
    mn, mx = x.min(axis=2, keepdims=True), x.max(axis=2, keepdims=True)
    scale = ((mx - mn) / np.float32(15)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = ((x - mn) / scale).astype(np.float32)
    q = np.where(scale > 0, np.sign(t) * np.floor(np.abs(t) + np.float32(0.5)), 0)
    q = np.clip(q, 0, 15).astype(np.float32)
    return (q * scale + mn).astype(np.float32).reshape(r, c)


names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
with torch.no_grad():
    for name, mod in model.named_modules():
        if name.split(".")[-1] in names:
            mod.weight.copy_(torch.from_numpy(rtn(mod.weight.numpy())))
    model = model.double()
    logits = model(torch.tensor([g["prompt_ids"]])).logits[0].numpy()
logits.astype("<f8").tofile(os.path.join(here, "rtn_w4_logits.f64"))
print("wrote", os.path.join(here, "rtn_w4_logits.f64"), logits.shape)
