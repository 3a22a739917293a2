#!/usr/bin/env python3
"""make_perplexity_ref.py — reference perplexities for `flotilla perplexity`.

The `llama` fixture with a byte-level tokenizer (tests/make_byte_tokenizer.py:
token id = byte value) on tests/golden/llama/perplexity.txt. For each
(ctx, stride) the Hugging Face perplexity guide's loop runs in float64
(transformers, eager attention): windows start every `stride` tokens, hold up
to `ctx` tokens, and their labels mask all but the tokens no earlier window
scored; a window's NLL is the sum over its unmasked shifted labels, and
PPL = exp(total NLL / scored tokens). Writes tests/golden/llama/perplexity.json.
No BOS: the byte tokenizer has none.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from tokenizers import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "llama")
CASES = [(512, None), (64, None), (64, 24), (40, 1), (128, 100)]

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)

text = open(os.path.join(FIX, "perplexity.txt"), "rb").read()
with tempfile.TemporaryDirectory() as tmp:
    tj = os.path.join(tmp, "tokenizer.json")
    V = json.load(open(os.path.join(FIX, "config.json")))["vocab_size"]
    subprocess.check_call([sys.executable, os.path.join(HERE, "..", "make_byte_tokenizer.py"), tj, str(V)])
    ids = Tokenizer.from_file(tj).encode(text.decode("utf-8"), add_special_tokens=False).ids
assert ids == list(text), "the byte tokenizer must give the bytes as ids"

model = transformers.AutoModelForCausalLM.from_pretrained(FIX, dtype=torch.float64, attn_implementation="eager")
model.eval()
enc = torch.tensor([ids])
N = len(ids)
out = {"text": "perplexity.txt", "text_tokens": N, "tokenizer": "tests/make_byte_tokenizer.py", "cases": []}
for ctx, stride in CASES:
    s = stride or ctx
    nll, count, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, N, s):
        end = min(begin + ctx, N)
        trg_len = end - prev_end
        inp = enc[:, begin:end]
        labels = inp.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            logits = model(inp).logits[0]
        lp = torch.log_softmax(logits[:-1], dim=-1)
        lab = labels[0, 1:]
        keep = lab != -100
        nll += float(-lp[keep].gather(1, lab[keep][:, None]).sum())
        count += int(keep.sum())
        windows += 1
        prev_end = end
        if end == N:
            break
    out["cases"].append({"ctx": ctx, "stride": s, "perplexity": math.exp(nll / count),
                         "mean_nll": nll / count, "scored_tokens": count, "windows": windows})
    print(out["cases"][-1])
json.dump(out, open(os.path.join(FIX, "perplexity.json"), "w"), indent=1)
print("wrote", os.path.join(FIX, "perplexity.json"))
