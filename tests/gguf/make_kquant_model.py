#!/usr/bin/env python3
"""make_kquant_model.py — tiny llama GGUF files with K-quant weights, for
tests/test_gguf_kquant.c.

One set of random float weights (llama, hidden 256, 2 layers, 4 heads of 64,
2 KV heads, FFN 256, vocab 256, untied output) is written four times into
tests/gguf/kquant_model/, every 2-D weight (token_embd and output included)
quantized with kquant_quantize.py:

  llama_q4_k.gguf   all Q4_K        llama_q5_k.gguf   all Q5_K
  llama_q6_k.gguf   all Q6_K
  llama_mixed.gguf  layer 0: q Q2_K, k Q3_K, v IQ4_NL, o IQ4_XS, gate Q8_K,
                    up Q5_K, down Q6_K; layer 1 Q4_K; token_embd Q6_K,
                    output Q8_K

Norms stay F32. q/k rows are permuted as convert_hf_to_gguf.py does for
llama. Beside each <name>.gguf:

  <name>.rows.f32    for every quantized tensor (order in <name>.json), its
                     first and last rows as gguf-py dequantizes them (HF row
                     order, i.e. after undoing the q/k permutation)
  <name>.logits.f64  float64 logits [T, V] of the prompt through a numpy
                     float64 llama forward on the dequantized weights
  float.logits.f64   the same forward on the unquantized float weights
  <name>.json        prompt, tensors, and the measured max relative logit
                     error of the dequantized model against the float one
                     (what quantization itself costs)
  baseline.json      the same error for gguf-py's own Q8_0 and Q4_0
                     quantizers on these weights: the scale to judge the
                     K-quant numbers by (this random model is sensitive)

Usage: python3 tests/gguf/make_kquant_model.py   (needs: pip install gguf numpy)
"""
import json
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

import kquant_quantize as kq

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kquant_model")
H, L, NH, NKV, HD, FF, V = 256, 2, 4, 2, 64, 256, 256
EPS, THETA = 1e-5, 10000.0

LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}


def make_weights(rng):
    w = {"token_embd.weight": rng.standard_normal((V, H)),
         "output.weight": rng.standard_normal((V, H)) * 0.04,
         "output_norm.weight": 1 + 0.1 * rng.standard_normal(H)}
    shapes = {"attn_q": (NH * HD, H), "attn_k": (NKV * HD, H), "attn_v": (NKV * HD, H),
              "attn_output": (H, NH * HD), "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF)}
    for l in range(L):
        for k, s in shapes.items():
            w[f"blk.{l}.{k}.weight"] = rng.standard_normal(s) * 0.04
        w[f"blk.{l}.attn_norm.weight"] = 1 + 0.1 * rng.standard_normal(H)
        w[f"blk.{l}.ffn_norm.weight"] = 1 + 0.1 * rng.standard_normal(H)
    return {k: v.astype(np.float32) for k, v in w.items()}


def permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (HF rows -> llama.cpp rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def n_perm_heads(name):
    return NH if ".attn_q." in name else NKV if ".attn_k." in name else 0


def forward(w, ids):
    """llama forward in float64 on HF-layout weights (gguf names)."""
    g = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(ids)

    def rms(x, n):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g[n]

    inv = 1.0 / THETA ** (np.arange(0, HD, 2, dtype=np.float64) / HD)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rot(t):  # HF rotate-half
        return t * cos + np.concatenate([-t[..., HD // 2:], t[..., :HD // 2]], -1) * sin

    x = g["token_embd.weight"][ids]
    mask = np.triu(np.ones((T, T), dtype=bool), 1)
    for l in range(L):
        p = f"blk.{l}."
        h = rms(x, p + "attn_norm.weight")
        q = rot((h @ g[p + "attn_q.weight"].T).reshape(T, NH, HD))
        k = rot((h @ g[p + "attn_k.weight"].T).reshape(T, NKV, HD))
        v = (h @ g[p + "attn_v.weight"].T).reshape(T, NKV, HD)
        k = np.repeat(k, NH // NKV, axis=1)
        v = np.repeat(v, NH // NKV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(HD)
        s = np.where(mask, -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, NH * HD)
        x = x + o @ g[p + "attn_output.weight"].T
        h = rms(x, p + "ffn_norm.weight")
        a = h @ g[p + "ffn_gate.weight"].T
        x = x + ((a / (1 + np.exp(-a))) * (h @ g[p + "ffn_up.weight"].T)) @ g[p + "ffn_down.weight"].T
    return rms(x, "output_norm.weight") @ g["output.weight"].T


def hf_name(n):
    if n == "token_embd.weight":
        return "model.embed_tokens.weight"
    if n == "output.weight":
        return "lm_head.weight"
    _, l, k, _ = n.split(".")
    return f"model.layers.{l}.{LAYER[k]}.weight"


def rel_err(a, b):
    return float(max(np.abs(a[t] - b[t]).max() / np.abs(b[t]).max() for t in range(a.shape[0])))


def kinds(name):
    if name == "mixed":
        k = {"token_embd.weight": QT.Q6_K, "output.weight": QT.Q8_K}
        for t, qt in zip(LAYER, [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS, QT.Q8_K, QT.Q5_K, QT.Q6_K]):
            k[f"blk.0.{t}.weight"] = qt
        for t in LAYER:
            k[f"blk.1.{t}.weight"] = QT.Q4_K
        return k
    qt = QT[name.upper()]
    return {n: qt for n in ["token_embd.weight", "output.weight"] + [f"blk.{l}.{t}.weight" for l in range(L) for t in LAYER]}


def write(name, w, prompt, ref_float):
    kind = kinds(name)
    wr = gguf.GGUFWriter(os.path.join(OUT, f"llama_{name}.gguf"), "llama")
    wr.add_name(f"flotilla kquant test {name}")
    wr.add_context_length(128)
    wr.add_embedding_length(H)
    wr.add_block_count(L)
    wr.add_feed_forward_length(FF)
    wr.add_head_count(NH)
    wr.add_head_count_kv(NKV)
    wr.add_layer_norm_rms_eps(EPS)
    wr.add_rope_freq_base(THETA)
    wr.add_rope_dimension_count(HD)
    deq, facts, rows = {}, [], []
    for n, a in w.items():
        if n not in kind:
            wr.add_tensor(n, a)
            deq[n] = a
            continue
        nh = n_perm_heads(n)
        stored = permute(a, nh) if nh else a
        q = kq.quantize(stored, kind[n])
        wr.add_tensor(n, q, raw_dtype=kind[n])
        d = kq.dequantize(q, kind[n], a.shape)
        deq[n] = unpermute(d, nh) if nh else d
        facts.append({"name": hf_name(n), "dtype": kind[n].name, "shape": list(a.shape)})
        rows += [deq[n][0], deq[n][-1]]
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    ref = forward(deq, prompt)
    np.concatenate(rows).astype("<f4").tofile(os.path.join(OUT, f"llama_{name}.rows.f32"))
    ref.astype("<f8").tofile(os.path.join(OUT, f"llama_{name}.logits.f64"))
    err = rel_err(ref, ref_float)
    with open(os.path.join(OUT, f"llama_{name}.json"), "w") as f:
        json.dump({"prompt": prompt, "vocab_size": V, "tensors": facts, "quant_vs_float_rel_err": err}, f, indent=1)
    print(f"llama_{name}: dequantized vs float max rel logit err {err:.3e}")


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20251205)
    kq.roundtrip_check(rng)
    w = make_weights(rng)
    prompt = [int(v) for v in rng.integers(0, V, 13)]
    ref_float = forward(w, prompt)
    ref_float.astype("<f8").tofile(os.path.join(OUT, "float.logits.f64"))
    for name in ["q4_k", "q5_k", "q6_k", "mixed"]:
        write(name, w, prompt, ref_float)
    base = {}
    for qt in (QT.Q8_0, QT.Q4_0):
        d = {k: gguf.quants.dequantize(gguf.quants.quantize(v, qt), qt).reshape(v.shape) if v.ndim == 2 else v
             for k, v in w.items()}
        base[qt.name] = rel_err(forward(d, prompt), ref_float)
        print(f"baseline {qt.name} (gguf-py quantizer): max rel logit err {base[qt.name]:.3e}")
    with open(os.path.join(OUT, "baseline.json"), "w") as f:
        json.dump({"quant_vs_float_rel_err": base}, f, indent=1)


if __name__ == "__main__":
    main()
