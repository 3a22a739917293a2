#!/usr/bin/env python3
"""check_bf16.py — how far transformers itself lands from a golden fixture's
float64 logits when run in bfloat16, per position, and which positions a
bf16 run may legitimately get wrong: the yardstick for the CUDA backend's
bf16 tolerance (tests/test_cuda_golden.c).

A position is "bf16-exempt" when
  - transformers in bf16 is itself more than 5e-2 (relative to the
    position's largest logit) off the float64 reference there, or
  - (DeepSeek-V2) one of its routing decisions has a margin below 2^-7 of
    the largest router logit (the gaps make_golden_deepseek.py's DSTap
    measures, per token): bf16 activations may send the token to another
    expert, which moves its logits by far more than rounding.
With --write the exempt positions go into golden.json
("bf16_exempt_positions", with "bf16_exempt_note"); the test holds every
other position to its bound.

Run from the repo root: python3 tests/golden/check_bf16.py [--write] [fixture ...]
"""
import json
import math
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

TOL, MARGIN = 5e-2, 2.0 ** -7


def router_margins(m, T):
    """Per-position smallest routing margin of a DeepSeek-V2 model (inf when not DeepSeek)."""
    c = m.config
    if type(m).__name__ != "DeepseekV2ForCausalLM":
        return None, []
    logs = []
    hs = [mm.register_forward_hook(lambda mod, i, o: logs.append(o[0].detach().double().clone()))
          for _, mm in m.named_modules() if type(mm).__name__ == "DeepseekV2TopkRouter"]
    return (c.num_experts_per_tok, c.n_group or 1, c.topk_group or 1, c.topk_method), (logs, hs)


def gap(v, k):
    s = v.sort(dim=-1, descending=True).values
    return s[..., k - 1] - s[..., k]


def per_position_margin(spec, logs, T):
    k, ng, kg, method = spec
    per = torch.full((T,), math.inf, dtype=torch.float64)
    for rl in logs:
        rl = rl.reshape(T, -1)
        scale = rl.abs().amax(dim=-1)
        if method == "group_limited_greedy":
            E = rl.shape[-1]
            gs = rl.view(-1, ng, E // ng).amax(dim=-1)
            per = torch.minimum(per, gap(gs, kg) / scale)
            keep = gs.topk(kg, dim=-1).indices
            mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
            mask = mask.unsqueeze(-1).expand(-1, ng, E // ng).reshape(-1, E)
            rl = rl.masked_fill(~mask, -1e30)
        per = torch.minimum(per, gap(rl, k) / scale)
    return per


def main(argv):
    write = "--write" in argv
    names = [a for a in argv if a != "--write"] or ["deepseek_v2", "deepseek_v2_lite", "mixtral", "qwen2_moe",
                                                   "qwen3_moe", "llama", "qwen2"]
    for fx in names:
        d = f"tests/golden/{fx}"
        path = f"{d}/golden.json"
        g = json.load(open(path))
        ids = torch.tensor([g["prompt_ids"]])
        T = ids.shape[1]
        ref = np.fromfile(f"{d}/logits.f64", dtype=np.float64).reshape(-1, g["vocab_size"])
        load = lambda dt: AutoModelForCausalLM.from_pretrained(
            d, dtype=dt, attn_implementation="eager", experts_implementation="eager").eval()
        m = load(torch.bfloat16)
        with torch.no_grad():
            out = m(ids).logits[0].double().numpy()
        pe = np.abs(out - ref).max(1) / np.abs(ref).max(1)
        exempt = {int(i) for i in np.nonzero(pe > TOL)[0]}
        m64 = load(torch.float64)
        spec, tap = router_margins(m64, T)
        margins = None
        if spec:
            with torch.no_grad():
                m64(ids)
            margins = per_position_margin(spec, tap[0], T)
            exempt |= {i for i in range(T) if margins[i] < MARGIN}
        print(f"{fx}: transformers bf16 max rel {pe.max():.3e} at {pe.argmax()}, median {np.median(pe):.2e}; "
              f"router margins < 2^-7 at {[i for i in range(T) if margins is not None and margins[i] < MARGIN]}; "
              f"exempt {sorted(exempt)}")
        if write and spec:
            g["bf16_exempt_positions"] = sorted(exempt)
            g["bf16_exempt_note"] = (
                "positions where transformers in bf16 is > 5e-2 off the float64 logits, or a routing "
                "margin is < 2^-7 of the largest router logit (tests/golden/check_bf16.py)")
            with open(path, "w") as f:
                json.dump(g, f, indent=2)
                f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
