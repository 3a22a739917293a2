#!/usr/bin/env python3
"""make_demo_golden.py — reference values for the demo model (SmolLM2-135M-Instruct,
GGUF Q4_1) from Hugging Face transformers, which dequantizes the GGUF tensors to
float; the reference runs in float64.

Writes tests/golden/smollm2_gguf.json:
  prompt_ids       the ChatML prompt for "What is the capital of France?",
                   tokenized by the HF tokenizer converted from the GGUF
  check_ids        256 fixed vocabulary ids (plus every position's top-8)
  logits           {position: {id: logit}} for those ids, float64
  row_absmax       max |logit| per position (the relative-error denominator)
  greedy_new_tokens 24 greedy tokens (float64, full recompute)
The vocabulary is 49152, so full logits would be 3.5 MB per prompt; a fixed
subset plus each position's top ids checks the same math at a fraction of it.

usage: python3 tests/golden/make_demo_golden.py models/SmolLM2-135M-Instruct.Q4_1.gguf
(needs: pip install torch transformers gguf accelerate)
"""
import json
import os
import sys

import numpy as np
import torch
import transformers

path = sys.argv[1]
d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
model = model.double().eval()

text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
ids = tok(text, add_special_tokens=False)["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].numpy()
rng = np.random.default_rng(0)
check = set(rng.choice(logits.shape[1], 256, replace=False).tolist())
for row in logits:
    check.update(np.argsort(-row)[:8].tolist())
check = sorted(int(i) for i in check)

seq = list(ids)
greedy = []
with torch.no_grad():
    for _ in range(24):
        nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        greedy.append(nxt)
        seq.append(nxt)
        if nxt == tok.eos_token_id:
            break

out = {
    "model": f,
    "prompt_text": text,
    "prompt_ids": ids,
    "check_ids": check,
    "logits": [[float(logits[t, i]) for i in check] for t in range(len(ids))],
    "row_absmax": [float(np.abs(r).max()) for r in logits],
    "greedy_new_tokens": greedy,
    "greedy_text": tok.decode(greedy, skip_special_tokens=True),
}
dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_gguf.json")
with open(dst, "w") as fh:
    json.dump(out, fh)
print(f"wrote {dst}: {len(ids)} positions, {len(check)} ids, greedy: {out['greedy_text']!r}")
