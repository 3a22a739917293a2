#!/usr/bin/env python3
"""check_bf16.py — how far transformers itself lands from a golden fixture's
float64 logits when run in bfloat16 (and float32), per fixture: the yardstick
for the CUDA backend's bf16 tolerance (tests/test_cuda_golden.c). A fixture
whose router margins are below bf16 resolution can route a token to another
expert in bf16, which moves that position's logits far more than rounding.

Run: python3 tests/golden/check_bf16.py [fixture ...]   (from the repo root)
"""
import json, sys, numpy as np, torch
from transformers import AutoModelForCausalLM
for fx in sys.argv[1:] or ["deepseek_v2_lite", "deepseek_v2", "mixtral", "qwen2_moe", "qwen3_moe", "llama"]:
    d = f"tests/golden/{fx}"
    g = json.load(open(f"{d}/golden.json"))
    ref = np.fromfile(f"{d}/logits.f64", dtype=np.float64).reshape(-1, g["vocab_size"])
    for dt in [torch.float32, torch.bfloat16]:
        m = AutoModelForCausalLM.from_pretrained(d, torch_dtype=dt, attn_implementation="eager")
        m.eval()
        with torch.no_grad():
            out = m(torch.tensor([g["prompt_ids"]])).logits[0].double().numpy()
        pe = np.abs(out - ref).max(1) / np.abs(ref).max(1)
        print(fx, dt, f"max rel {pe.max():.3e} at {pe.argmax()}, median {np.median(pe):.2e}, over 5e-2: {(pe>5e-2).sum()} of {len(pe)}, argmax agree {(out.argmax(1)==ref.argmax(1)).mean():.2f}")
