#!/usr/bin/env python3
"""make_fp8w8a8_golden.py — reference for `--quantize fp8` on the `llama` fixture.

FP8 linears (kernels/backend.h, "FP8 linears"; runtime/load/quant.c,
fl_quant_to_fp8), computed here with PyTorch's float8_e4m3fn casts:
  weights, per row:   scale = max(absmax / 448, FLT_MIN) (f32; an all-zero row: 1),
                      code = e4m3(w / scale);
  activations, per token, at every linear call:
                      sx = max(absmax(x) / 448, FLT_MIN) (f32; an all-zero token: 1),
                      code = e4m3(x * (1 / sx)) (f32 product);
  y = sx * scale * sum(code_x * code_w) (+ bias), in float64.
Every decoder linear (q/k/v/o, gate/up/down) runs that way; transformers
runs the rest of the model in float64. Writes
tests/golden/llama/fp8_logits.f64 ([T, vocab] float64) for the prompt in
golden.json.
"""
import json
import os
import sys

import torch
import transformers

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama")
out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "fp8_logits.f64")
g = json.load(open(os.path.join(here, "golden.json")))
model = transformers.AutoModelForCausalLM.from_pretrained(here, dtype=torch.float32,
                                                          attn_implementation="eager")
F8 = torch.float8_e4m3fn


def e4m3(t):
    # saturating, as the C code's conversion (values here never pass 448 by more than rounding)
    return t.clamp(-448.0, 448.0).to(F8).to(torch.float64)


def row_scales(m):
    mx = m.abs().amax(dim=-1)
    s = torch.clamp(mx / torch.tensor(448.0, dtype=torch.float32), min=torch.finfo(torch.float32).tiny)
    return torch.where(mx > 0, s, torch.ones_like(mx))


class Fp8Linear(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        w = lin.weight.detach().to(torch.float32)
        self.sw = row_scales(w)
        self.cw = e4m3(w / self.sw[:, None])
        self.bias = None if lin.bias is None else lin.bias.detach().to(torch.float64)

    def forward(self, x):
        x32 = x.to(torch.float32)
        sx = row_scales(x32)
        inv = torch.tensor(1.0, dtype=torch.float32) / sx
        cx = e4m3(x32 * inv[..., None])
        y = (cx @ self.cw.T) * sx.to(torch.float64)[..., None] * self.sw.to(torch.float64)
        return y if self.bias is None else y + self.bias


names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
with torch.no_grad():
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if child_name in names:
                setattr(mod, child_name, Fp8Linear(child))
    model = model.double()
    logits = model(torch.tensor([g["prompt_ids"]])).logits[0].numpy()
logits.astype("<f8").tofile(out_path)
print("wrote", out_path, logits.shape)
