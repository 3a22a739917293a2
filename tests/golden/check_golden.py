#!/usr/bin/env python3
"""check_golden.py — sanity check of the committed golden fixtures (not run in CI).

For every fixture folder it checks the committed logits.f64 and greedy tokens
two independent ways:

  1. transformers: reload the folder with from_pretrained (float64, eager
     attention, eager experts), run the full prompt, compare with logits.f64
     (must be identical up to 1e-12 relative: same code, same dtype), and redo
     the greedy continuation by full recompute. The AWQ fixture cannot be
     loaded by transformers without a GPU AWQ backend, so its tensors are
     dequantized here (make_golden.awq_dequantize) into a LlamaForCausalLM.
  2. an independent float64 re-implementation of the forward pass written
     from the config.json / tensor names alone (the `Ref` class below). It is
     the executable description of what the C engine must compute; it has no
     float32 islands, while transformers computes RoPE angles, RMSNorm and the
     softmaxes in float32 even inside a float64 model, so agreement is only
     ~1e-6 relative — still 100x inside the engine's 1e-4 budget.

Relative error of a position = max|a - b| / max|b| over the vocabulary.

Usage: python3 tests/golden/check_golden.py [fixture ...]   (exit 1 on failure)
"""

import json
import math
import os
import sys

import numpy as np
import torch
from safetensors import safe_open

import transformers
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_golden as mg  # noqa: E402  (AWQ unpacking, shared helpers)

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)

HF_TOL = 1e-12       # transformers f64 vs committed (same code path)
INDEP_TOL = 1e-5     # independent f64 forward vs committed (HF has f32 islands)


def rel_err(a, b):
    return float(((a - b).abs().amax(dim=-1) / b.abs().amax(dim=-1)).max())


# --------------------------------------------------------------------------
# independent reference forward (float64 throughout)
# --------------------------------------------------------------------------

class Ref:
    """Decoder-only forward of Llama / Qwen2 / Mixtral / Qwen2-MoE / Qwen3-MoE
    from config.json + model.safetensors, in float64."""

    def __init__(self, folder):
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        self.c = c
        self.arch = c["architectures"][0]
        w = {}
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            for k in f.keys():
                w[k] = f.get_tensor(k)
        q = c.get("quantization_config")
        if q:
            assert q["quant_method"] == "awq" and q["version"] == "gemm" and q["bits"] == 4
            for k in [k for k in w if k.endswith(".qweight")]:
                stem = k[: -len(".qweight")]
                w[stem + ".weight"] = mg.awq_dequantize(
                    w.pop(stem + ".qweight").numpy(), w.pop(stem + ".qzeros").numpy(),
                    w.pop(stem + ".scales"), q["group_size"])
        self.w = {k: v.to(torch.float64) for k, v in w.items()}
        self.H = c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads") or self.nh
        self.hd = c.get("head_dim") or self.H // self.nh
        self.eps = c["rms_norm_eps"]
        self.L = c["num_hidden_layers"]
        if "lm_head.weight" in self.w:
            assert not c.get("tie_word_embeddings", False)
            self.lm_head = self.w["lm_head.weight"]
        else:
            assert c.get("tie_word_embeddings", False)
            self.lm_head = self.w["model.embed_tokens.weight"]
        # rope: new form (rope_parameters) or old form (rope_theta + rope_scaling)
        rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rp.setdefault("rope_theta", c.get("rope_theta", 10000.0))
        rp["rope_type"] = rp.get("rope_type", rp.get("type", "default"))
        self.rope = rp

    # --- rope -------------------------------------------------------------
    def inv_freq(self, seq_len):
        rp, d = self.rope, self.hd
        base = float(rp["rope_theta"])
        i = torch.arange(0, d, 2, dtype=torch.float64)
        t = rp["rope_type"]
        scale = 1.0
        if t == "default":
            inv = 1.0 / base ** (i / d)
        elif t == "linear":
            inv = 1.0 / base ** (i / d) / rp["factor"]
        elif t == "dynamic":
            mpe = self.c["max_position_embeddings"]  # HF: the original length
            f = rp["factor"]
            if seq_len > mpe:
                base = base * (f * seq_len / mpe - (f - 1)) ** (d / (d - 2))
            inv = 1.0 / base ** (i / d)
        elif t == "llama3":
            inv = 1.0 / base ** (i / d)
            f, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
            old = rp["original_max_position_embeddings"]
            wl = 2 * math.pi / inv
            out = torch.where(wl > old / lo, inv / f, inv)
            smooth = (old / wl - lo) / (hi - lo)
            mid = (wl >= old / hi) & (wl <= old / lo)
            inv = torch.where(mid, (1 - smooth) * inv / f + smooth * inv, out)
        elif t == "yarn":
            f = rp["factor"]
            orig = rp["original_max_position_embeddings"]
            bf, bs = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

            def corr(rot):
                return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
            lo, hi = corr(bf), corr(bs)
            if rp.get("truncate", True):
                lo, hi = math.floor(lo), math.ceil(hi)
            lo, hi = max(lo, 0), min(hi, d - 1)
            if lo == hi:
                hi += 0.001
            ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
            pos_freqs = base ** (i / d)
            extra = 1 - ramp
            inv = (1 / (f * pos_freqs)) * (1 - extra) + (1 / pos_freqs) * extra
            scale = rp.get("attention_factor") or (0.1 * math.log(f) + 1.0 if f > 1 else 1.0)
        else:
            raise ValueError(f"rope type {t}")
        return inv, scale

    # --- blocks -----------------------------------------------------------
    def rms(self, x, wname):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w[wname]

    def lin(self, x, name):
        y = x @ self.w[name + ".weight"].T
        if name + ".bias" in self.w:
            y = y + self.w[name + ".bias"]
        return y

    def mlp(self, x, p):
        return self.lin(torch.nn.functional.silu(self.lin(x, p + ".gate_proj")) *
                        self.lin(x, p + ".up_proj"), p + ".down_proj")

    def attention(self, x, l, cos, sin):
        T = x.shape[0]
        p = f"model.layers.{l}.self_attn"
        q = self.lin(x, p + ".q_proj").view(T, self.nh, self.hd)
        k = self.lin(x, p + ".k_proj").view(T, self.nkv, self.hd)
        v = self.lin(x, p + ".v_proj").view(T, self.nkv, self.hd)
        if p + ".q_norm.weight" in self.w:          # Qwen3: per-head RMSNorm before RoPE
            q = self.rms(q, p + ".q_norm.weight")
            k = self.rms(k, p + ".k_norm.weight")

        def rot(t):                                 # HF "rotate half" layout
            h = self.hd // 2
            t1, t2 = t[..., :h], t[..., h:]
            return t * cos[:, None, :] + torch.cat((-t2, t1), -1) * sin[:, None, :]
        q, k = rot(q), rot(k)
        rep = self.nh // self.nkv                   # q head j uses kv head j // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(self.hd)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        s = s.masked_fill(mask, -math.inf).softmax(-1)
        o = torch.einsum("hts,shd->thd", s, v).reshape(T, self.nh * self.hd)
        return self.lin(o, p + ".o_proj")

    def moe(self, x, l):
        c = self.c
        if self.arch == "MixtralForCausalLM":
            p = f"model.layers.{l}.block_sparse_moe"
            names, norm, E = ("w1", "w3", "w2"), True, c["num_local_experts"]
        else:
            p = f"model.layers.{l}.mlp"
            names, norm, E = ("gate_proj", "up_proj", "down_proj"), c["norm_topk_prob"], c["num_experts"]
        k = c["num_experts_per_tok"]
        probs = (x @ self.w[p + ".gate.weight"].T).softmax(-1)
        top, idx = probs.topk(k, dim=-1)
        if norm:
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(k):
                e = f"{p}.experts.{int(idx[t, j])}"
                g = x[t] @ self.w[f"{e}.{names[0]}.weight"].T
                u = x[t] @ self.w[f"{e}.{names[1]}.weight"].T
                out[t] += top[t, j] * ((torch.nn.functional.silu(g) * u) @ self.w[f"{e}.{names[2]}.weight"].T)
        if p + ".shared_expert_gate.weight" in self.w:   # Qwen2-MoE
            gate = torch.sigmoid(x @ self.w[p + ".shared_expert_gate.weight"].T)
            out = out + gate * self.mlp(x, p + ".shared_expert")
        return out

    def is_moe(self, l):
        c = self.c
        if self.arch == "MixtralForCausalLM":
            return True
        if self.arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            return (l not in (c.get("mlp_only_layers") or []) and c["num_experts"] > 0
                    and (l + 1) % c.get("decoder_sparse_step", 1) == 0)
        return False

    @torch.no_grad()
    def logits(self, ids):
        T = len(ids)
        inv, scale = self.inv_freq(T)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos() * scale, ang.sin() * scale
        x = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        for l in range(self.L):
            p = f"model.layers.{l}"
            x = x + self.attention(self.rms(x, p + ".input_layernorm.weight"), l, cos, sin)
            h = self.rms(x, p + ".post_attention_layernorm.weight")
            x = x + (self.moe(h, l) if self.is_moe(l) else self.mlp(h, p + ".mlp"))
        return self.rms(x, "model.norm.weight") @ self.lm_head.T


# --------------------------------------------------------------------------

def hf_model(folder):
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        c = json.load(f)
    if "quantization_config" not in c:
        return mg.load(folder, torch.float64)
    # AWQ: build the float architecture and put the dequantized weights in
    cfg = AutoConfig.from_pretrained(folder)
    del cfg.quantization_config
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().double()
    ref = Ref(folder)
    sd = m.state_dict()
    missing = set(sd) - set(ref.w)
    assert missing <= {"lm_head.weight"} or not missing, missing
    m.load_state_dict({k: ref.w[k] for k in sd}, strict=True)
    return m


def greedy(fn, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(fn(ids)[-1].argmax()))
    return ids[len(prompt):]


def check(name):
    folder = os.path.join(HERE, name)
    with open(os.path.join(folder, "golden.json")) as f:
        g = json.load(f)
    T, V = g["n_positions"], g["vocab_size"]
    gold = torch.from_numpy(np.fromfile(os.path.join(folder, g["logits_file"]), dtype="<f8"))
    assert gold.numel() == T * V, f"{name}: logits.f64 has {gold.numel()} values, want {T}*{V}"
    gold = gold.view(T, V)
    prompt = g["prompt_ids"]
    assert len(prompt) == T
    ok = True

    m = hf_model(folder)
    hf = mg.full_logits(m, prompt)
    e_hf = rel_err(hf, gold)
    hf_greedy = greedy(lambda ids: mg.full_logits(m, ids), prompt, len(g["greedy_new_tokens"]))

    ref = Ref(folder)
    ind = ref.logits(prompt)
    e_ind = rel_err(ind, gold)
    ind_greedy = greedy(ref.logits, prompt, len(g["greedy_new_tokens"]))

    top = gold.topk(2, dim=-1).values
    margin = float(((top[:, 0] - top[:, 1]) / gold.abs().amax(-1)).min())

    for what, bad in [
        (f"transformers rel err {e_hf:.1e} > {HF_TOL}", e_hf > HF_TOL),
        (f"independent rel err {e_ind:.1e} > {INDEP_TOL}", e_ind > INDEP_TOL),
        (f"transformers greedy {hf_greedy} != {g['greedy_new_tokens']}", hf_greedy != g["greedy_new_tokens"]),
        (f"independent greedy {ind_greedy} != {g['greedy_new_tokens']}", ind_greedy != g["greedy_new_tokens"]),
        (f"prompt margin {margin:.2e} < min_margin {g['min_margin']:.2e}", margin < g["min_margin"] * (1 - 1e-9)),
    ]:
        if bad:
            print(f"FAIL {name}: {what}")
            ok = False
    print(f"{'ok  ' if ok else 'BAD '} {name:18s} T={T:3d} V={V} hf_rel={e_hf:.1e} "
          f"indep_rel={e_ind:.1e} min_margin={g['min_margin']:.2e}")
    return ok


def main(argv):
    mg.awq_selfcheck()
    names = argv or sorted(d for d in os.listdir(HERE)
                           if os.path.exists(os.path.join(HERE, d, "golden.json")))
    results = [check(n) for n in names]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
