#!/usr/bin/env python3
"""make_golden.py — builds flotilla's golden reference fixtures.

Each fixture is a tiny random-weight Hugging Face checkpoint (config.json +
model.safetensors, written by save_pretrained and then, where transformers 5
writes something real hub checkpoints do not, rewritten into the hub form)
plus the output of transformers itself on a fixed prompt:

    <fixture>/config.json, model.safetensors, generation_config.json
    <fixture>/logits.f64    float64 little-endian, [n_positions, vocab_size]
    <fixture>/golden.json   prompt, greedy continuation, margins, notes

Why transformers and not our own numpy forward: the C engine must agree with
what users run, i.e. transformers, including its quirks (dynamic NTK RoPE
recomputed from the sequence length, f32 islands inside an f64 model).

The reference is always computed from the folder as written to disk (reloaded
with from_pretrained), in float64, with eager attention and eager experts, and
the script checks that the reload gives the same float32 logits as the model
that was saved (so a checkpoint rewrite — old-style rope keys, per-expert MoE
tensors — cannot silently change the model).

Seeds are searched (starting from a fixed base) until every prompt position,
every greedy step and every MoE routing decision has a margin wide enough that
float32 rounding in the engine cannot flip it; see README.md.

Run from anywhere:  python3 tests/golden/make_golden.py [fixture ...]
Deterministic: same torch / transformers version -> byte-identical outputs.
"""

import copy
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import transformers
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig,
                          Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig)

HERE = os.path.dirname(os.path.abspath(__file__))

N_NEW = 8                # greedy tokens
MARGIN_REL = 1e-3        # top1 - top2 must exceed MARGIN_REL * max|logit| of the row
ROUTER_MARGIN_REL = 1e-3 # k-th minus (k+1)-th router logit, relative to max|router logit|
MAX_SEED_TRIES = 200
MIN_DISTINCT_NEW = 4     # greedy tokens (and prompt argmaxes) must have >= 4 distinct ids

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)  # the build machine is shared; 2 cores max


# --------------------------------------------------------------------------
# AutoAWQ GEMM packing
# --------------------------------------------------------------------------

# AutoAWQ awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear: nibble i
# (bits 4i..4i+3) of packed word c holds column 8c + AWQ_ORDER[i].
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# vLLM awq_triton.py: column 8c + j is found at nibble AWQ_REVERSE_ORDER[j],
# i.e. shift = 4 * AWQ_REVERSE_ORDER[j]. It is the inverse permutation.
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_pack(codes):
    """Packs 4-bit codes into AutoAWQ GEMM int32 words.

    codes: integer array [rows, cols], values 0..15, cols % 8 == 0.
           For qweight rows = in_features and cols = out_features (the weight
           is TRANSPOSED relative to nn.Linear's [out, in]); for qzeros rows =
           in_features / group_size.
    Returns int32 array [rows, cols / 8].

    Step by step:
      1. split the columns into blocks of 8: block c = columns 8c .. 8c+7;
      2. inside a block, the value written into nibble i (bits 4i .. 4i+3,
         nibble 0 = least significant) is column 8c + AWQ_ORDER[i], with
         AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  — even columns go to the low
         four nibbles, odd columns to the high four;
      3. the eight nibbles are OR-ed into one 32-bit word, built as uint32
         and stored as int32 (two's complement), so a code >= 8 in nibble 7
         makes the stored int32 negative.
    Example: codes [0, 1, 2, 3, 4, 5, 6, 7] pack to 0x75316420.
    """
    codes = np.asarray(codes, dtype=np.int64)
    rows, cols = codes.shape
    assert cols % 8 == 0, "AWQ packs 8 columns per int32"
    assert codes.min() >= 0 and codes.max() <= 15, "codes must be 4-bit"
    blocks = codes.reshape(rows, cols // 8, 8).astype(np.uint32)      # step 1
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for i in range(8):                                                # step 2
        words |= blocks[:, :, AWQ_ORDER[i]] << np.uint32(4 * i)
    return words.view(np.int32)                                       # step 3


def awq_unpack(words):
    """Inverse of awq_pack: int32 [rows, n] -> codes [rows, 8n] (int64).

    Column 8c + j = (word_c >> (4 * AWQ_REVERSE_ORDER[j])) & 0xF — exactly
    what vLLM's awq_triton dequantize kernel does.
    """
    w = np.asarray(words, dtype=np.int32).view(np.uint32)
    rows, n = w.shape
    out = np.zeros((rows, n, 8), dtype=np.int64)
    for j in range(8):
        out[:, :, j] = (w >> np.uint32(4 * AWQ_REVERSE_ORDER[j])) & np.uint32(0xF)
    return out.reshape(rows, n * 8)


def awq_selfcheck():
    """The packing must be the one AutoAWQ writes and vLLM reads."""
    # the reverse order is the inverse permutation of the pack order
    assert [AWQ_ORDER.index(j) for j in range(8)] == AWQ_REVERSE_ORDER
    # hand-computed word
    w = awq_pack(np.arange(8).reshape(1, 8))
    assert int(w.view(np.uint32)[0, 0]) == 0x75316420, hex(int(w.view(np.uint32)[0, 0]))
    # vLLM's gemv shift formula: (j // 2) * 4 + (j % 2) * 16
    assert all(4 * AWQ_REVERSE_ORDER[j] == (j // 2) * 4 + (j % 2) * 16 for j in range(8))
    # round trip on random codes, including the sign bit of the int32
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(37, 64))
    codes[0, :] = 15
    packed = awq_pack(codes)
    assert packed.dtype == np.int32 and (packed < 0).any()
    assert np.array_equal(awq_unpack(packed), codes)


def awq_quantize(weight, group_size):
    """Asymmetric 4-bit round-to-nearest quantization, AutoAWQ conventions.

    weight: float tensor [out, in] (nn.Linear layout), in % group_size == 0.
    For every output row o and input group g (columns g*G .. g*G+G-1):
      s = (max - min) / 15, rounded to float16 (AutoAWQ stores f16 scales;
          we round BEFORE computing codes so codes and scales agree exactly)
      z = clamp(round(-min / s), 0, 15)
      q = clamp(round(w / s) + z, 0, 15)
    Dequantized weight: (q - z) * s  (exact in float32 too: an 11-bit f16
    mantissa times a 5-bit integer).
    Returns (qweight int32 [in, out/8], qzeros int32 [in/G, out/8],
             scales f16 [in/G, out], dequantized float64 [out, in], codes, zeros).
    """
    w = weight.detach().to(torch.float64)
    out_f, in_f = w.shape
    assert in_f % group_size == 0 and out_f % 8 == 0
    ng = in_f // group_size
    wg = w.reshape(out_f, ng, group_size)
    wmax = wg.amax(dim=2)
    wmin = wg.amin(dim=2)
    s = ((wmax - wmin).clamp(min=1e-5) / 15.0).to(torch.float16)      # [out, ng]
    s64 = s.to(torch.float64)
    z = torch.clamp(torch.round(-wmin / s64), 0, 15)                  # [out, ng]
    q = torch.clamp(torch.round(wg / s64[:, :, None]) + z[:, :, None], 0, 15)
    deq = ((q - z[:, :, None]) * s64[:, :, None]).reshape(out_f, in_f)
    codes = q.reshape(out_f, in_f).to(torch.int64).numpy()            # [out, in]
    zeros = z.to(torch.int64).numpy()                                 # [out, ng]
    qweight = awq_pack(codes.T)                                       # [in, out/8]
    qzeros = awq_pack(zeros.T)                                        # [ng, out/8]
    scales = s.T.contiguous()                                         # [ng, out] f16
    assert np.array_equal(awq_unpack(qweight), codes.T)
    assert np.array_equal(awq_unpack(qzeros), zeros.T)
    return qweight, qzeros, scales, deq, codes, zeros


def awq_dequantize(qweight, qzeros, scales, group_size):
    """Checkpoint tensors -> float64 weight [out, in] (nn.Linear layout)."""
    q = awq_unpack(np.asarray(qweight))                               # [in, out]
    z = awq_unpack(np.asarray(qzeros))                                # [ng, out]
    s = torch.as_tensor(scales).to(torch.float64).numpy()             # [ng, out]
    zi = np.repeat(z, group_size, axis=0)
    si = np.repeat(s, group_size, axis=0)
    return torch.from_numpy(((q - zi) * si).T.copy())


AWQ_LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


# --------------------------------------------------------------------------
# fixture specifications
# --------------------------------------------------------------------------

SMALL_ROPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.15,
                  bos_token_id=1, eos_token_id=2)

FIXTURES = {
    "llama": dict(
        config=lambda: LlamaConfig(
            vocab_size=311, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False, initializer_range=0.08, bos_token_id=1, eos_token_id=2),
        prompt_len=13, seed=1000, rope_form="old", save_dtype=torch.float32,
        also_awq="llama_awq",
        notes="GQA 8 q heads / 2 kv heads, explicit head_dim 16 (8*16=128 != hidden 96). "
              "intermediate_size is 160, not 136: AWQ group 32 must divide every in_features "
              "(down_proj in = intermediate). Old-style config: top-level rope_theta, "
              "rope_scaling null, torch_dtype."),
    "llama_tied_rope3": dict(
        config=lambda: LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
            initializer_range=0.15, bos_token_id=1, eos_token_id=2,
            rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32)),
        prompt_len=40, seed=2000, rope_form="old", save_dtype=torch.bfloat16,
        notes="Tied embeddings (no lm_head.weight tensor). llama3 RoPE: with head_dim 16, "
              "theta 1e4, original 32, low 1, high 4 the 8 frequencies cover all three "
              "branches (1 kept, 1 smoothed, 6 divided by 8). Weights stored bf16; the "
              "reference is the f64 forward of the bf16 values (exact upcast). "
              "Old-style config: top-level rope_theta + rope_scaling{rope_type: llama3}, "
              "torch_dtype bfloat16."),
    "llama_yarn": dict(
        config=lambda: LlamaConfig(
            **SMALL_ROPE, max_position_embeddings=128,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=32)),
        prompt_len=40, seed=3000, rope_form="new", save_dtype=torch.float32,
        notes="YaRN factor 4, original 32, beta_fast 32 / beta_slow 1 (defaults), "
              "truncate true (default): correction range [0, 2] over the 8 frequencies. "
              "attention_factor = 0.1*ln(4)+1 = 1.13863 multiplies BOTH cos and sin (so "
              "q.k scales by its square). New-style config (rope_parameters)."),
    "llama_dynamic": dict(
        config=lambda: LlamaConfig(
            **SMALL_ROPE, max_position_embeddings=16,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
        prompt_len=40, seed=4000, rope_form="new", save_dtype=torch.float32,
        dynamic=True,
        notes="Dynamic NTK factor 2. HF uses max_position_embeddings (16) as the original "
              "length (no original_max_position_embeddings key) and, for a forward whose "
              "largest position is p, seq_len = p+1 and, when seq_len > 16, "
              "base = theta * (factor*seq_len/16 - (factor-1)) ** (d/(d-2)), d = head_dim; "
              "inv_freq = 1/base**(2i/d) computed in float32. logits.f64 = ONE full-prompt "
              "forward (seq_len 40) with that base for every position. Greedy tokens are "
              "full recomputes (seq_len = 40+k at step k). New-style config."),
    "llama_linear": dict(
        config=lambda: LlamaConfig(
            **SMALL_ROPE, max_position_embeddings=64,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
        prompt_len=40, seed=5000, rope_form="old_type", save_dtype=torch.float32,
        notes="Linear RoPE scaling factor 2 (inv_freq / 2). Oldest config form: top-level "
              "rope_theta + rope_scaling {\"type\": \"linear\", \"factor\": 2.0}."),
    "qwen2": dict(
        config=lambda: Qwen2Config(
            vocab_size=307, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.15,
            bos_token_id=1, eos_token_id=2),
        prompt_len=13, seed=6000, rope_form="new", save_dtype=torch.float32,
        notes="q/k/v bias (random), o_proj no bias, GQA 4/2, head_dim = hidden/heads "
              "(no head_dim key; hidden 48 / 4 heads = 12), tied embeddings, rope_theta 1e6, rms_norm_eps 1e-6. "
              "New-style config."),
    "mixtral": dict(
        config=lambda: MixtralConfig(
            vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False, initializer_range=0.15, bos_token_id=1, eos_token_id=2),
        prompt_len=13, seed=7000, rope_form="new", save_dtype=torch.float32, moe=True,
        notes="8 experts top-2: softmax over the 8 router logits, top-2, renormalised to "
              "sum 1. head_dim null in config.json -> hidden/heads = 8. Expert intermediate 24. Experts w1=gate, "
              "w3=up, w2=down. New-style config."),
    "qwen2_moe": dict(
        config=lambda: Qwen2MoeConfig(
            vocab_size=256, hidden_size=32, intermediate_size=88, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
            shared_expert_intermediate_size=56, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[1], rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=True, initializer_range=0.15, bos_token_id=1, eos_token_id=2),
        prompt_len=13, seed=8000, rope_form="new", save_dtype=torch.float32, moe=True,
        notes="Layers 0 and 2 MoE (8 experts top-2, softmax then top-2, NOT renormalised: "
              "norm_topk_prob false) + shared expert (intermediate 56) scaled by "
              "sigmoid(shared_expert_gate . x); layer 1 dense (mlp_only_layers [1], "
              "intermediate_size 88, tensors mlp.gate_proj/up_proj/down_proj). q/k/v bias. "
              "head_dim = 32/4 = 8. Tied embeddings. New-style config."),
    "qwen3_moe": dict(
        config=lambda: Qwen3MoeConfig(
            vocab_size=256, hidden_size=32, head_dim=16, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1,
            rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False, initializer_range=0.15, bos_token_id=1, eos_token_id=2),
        prompt_len=13, seed=9000, rope_form="new", save_dtype=torch.float32, moe=True,
        notes="8 experts top-2, norm_topk_prob true (top-2 probs renormalised). Per-head "
              "RMSNorm on q and k (q_norm/k_norm weight [head_dim], random) applied BEFORE "
              "RoPE. Explicit head_dim 16 (4*16=64 != hidden 32). No attention bias. "
              "config.json uses num_experts (hub form; transformers writes num_local_experts). "
              "New-style config."),
}


# --------------------------------------------------------------------------
# model building
# --------------------------------------------------------------------------

def randomize(model, seed, init_range):
    """Deterministic random weights with real scale.

    Matrices ~ N(0, init_range); norm weights ~ 1 + 0.2 N(0,1); biases ~ 0.1 N(0,1).
    Parameters are visited in sorted-name order so the stream of random numbers
    does not depend on module construction order.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda t: t[0]):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("bias"):
                v = 0.1 * r
            elif p.ndim == 1 and "norm" in name:
                v = 1.0 + 0.2 * r
            else:
                v = init_range * r
            p.copy_(v.to(p.dtype))


def load(folder, dtype):
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()


def reset_dynamic_rope(model):
    """HF's dynamic-NTK rotary embedding keeps state between forwards (it only
    grows its cached length, and only resets below the original length). Put it
    back to its freshly-constructed state so every full forward computes
    inv_freq from that forward's own sequence length, like a fresh model."""
    rot = model.model.rotary_emb
    if "dynamic" in rot.rope_type:
        rot.inv_freq = rot.original_inv_freq.clone()
        rot.max_seq_len_cached = rot.original_max_seq_len


class RouterTap:
    """Collects router logits of every MoE layer during a forward."""

    def __init__(self, model):
        self.logits = []
        self.handles = []
        self.k = getattr(model.config, "num_experts_per_tok", 0)
        for _, m in model.named_modules():
            if type(m).__name__.endswith("TopKRouter"):
                self.handles.append(m.register_forward_hook(self.hook))

    def hook(self, mod, inp, out):
        self.logits.append(out[0].detach().to(torch.float64).clone())

    def min_margin(self):
        """Smallest (k-th minus (k+1)-th) router logit gap / max|router logit|."""
        worst = math.inf
        for rl in self.logits:
            srt = rl.sort(dim=-1, descending=True).values
            gap = srt[:, self.k - 1] - srt[:, self.k]
            rel = gap / rl.abs().amax(dim=-1)
            worst = min(worst, float(rel.min()))
        return worst

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def full_logits(model, ids):
    reset_dynamic_rope(model)
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].to(torch.float64)


def row_margins(logits):
    """Per row: (top1 - top2) / max|logit| and the absolute gap."""
    top = logits.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    return gap / logits.abs().amax(dim=-1), gap


@torch.no_grad()
def reference(model, prompt, is_moe):
    """Full-prompt logits, greedy continuation by full recompute, margins."""
    tap = RouterTap(model) if is_moe else None
    logits = full_logits(model, prompt)
    rel, gap = row_margins(logits)
    rels, gaps = [rel], [gap]
    ids = list(prompt)
    new = []
    for _ in range(N_NEW):
        last = full_logits(model, ids)[-1:]
        r, g_ = row_margins(last)
        rels.append(r)
        gaps.append(g_)
        tok = int(last[0].argmax())
        new.append(tok)
        ids.append(tok)
    rel = torch.cat(rels)
    gap = torch.cat(gaps)
    router = tap.min_margin() if tap else None
    if tap:
        tap.close()
    return dict(logits=logits, new=new, min_margin=float(rel.min()),
                min_margin_abs=float(gap.min()), router_margin=router)


@torch.no_grad()
def cached_generate(model, prompt):
    """What model.generate (greedy, KV cache) returns — a cross-check only."""
    reset_dynamic_rope(model)
    x = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(x, max_new_tokens=N_NEW, do_sample=False, use_cache=True,
                         num_beams=1, pad_token_id=0, eos_token_id=None,
                         min_new_tokens=N_NEW)
    out = out[0, len(prompt):].tolist()
    reset_dynamic_rope(model)
    return out


def margins_ok(ref):
    """Safe margins, and a continuation that is not one token repeated (a
    random tiny model easily collapses onto one token; that would make the
    greedy test blind to KV-cache and position bugs)."""
    if len(set(ref["new"])) < MIN_DISTINCT_NEW:
        return False
    if len(set(ref["logits"].argmax(dim=-1).tolist())) < MIN_DISTINCT_NEW:
        return False
    if ref["min_margin"] <= MARGIN_REL:
        return False
    if ref["router_margin"] is not None and ref["router_margin"] <= ROUTER_MARGIN_REL:
        return False
    return True


# --------------------------------------------------------------------------
# checkpoint rewriting into the hub form
# --------------------------------------------------------------------------

def rewrite_config(folder, spec, extra=None):
    """Turns transformers-5 config.json into the form the corresponding hub
    checkpoints use where asked (rope_form), and adds extra keys."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    form = spec["rope_form"]
    if form in ("old", "old_type"):
        rp = cfg.pop("rope_parameters")
        theta = rp.pop("rope_theta")
        rtype = rp.pop("rope_type")
        cfg["rope_theta"] = theta
        if rtype == "default":
            cfg["rope_scaling"] = None
        elif form == "old_type":
            cfg["rope_scaling"] = dict(type=rtype, **rp)
        else:
            cfg["rope_scaling"] = dict(rope_type=rtype, **rp)
        cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    if extra:
        cfg.update(extra)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return cfg


CLASSIC_MOE = {
    # transformers-internal fused name -> per-expert hub names (gate, up, down)
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def ensure_classic_moe(folder, model_type, n_experts):
    """transformers 5 keeps experts fused in memory (experts.gate_up_proj
    [E, 2I, H], experts.down_proj [E, H, I]). save_pretrained 5.24 already
    reverts them to per-expert tensors; if a version writes them fused, split
    them here. Then assert the classic names are present."""
    path = os.path.join(folder, "model.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    prefix, gname, uname, dname = CLASSIC_MOE[model_type]
    changed = False
    for k in list(tensors):
        if k.endswith(".experts.gate_up_proj"):
            base = k[: -len(".experts.gate_up_proj")]
            base = base.replace(".mlp", "." + prefix) if prefix != "mlp" else base
            t = tensors.pop(k)
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{base}.experts.{e}.{gname}.weight"] = t[e, :inter].contiguous()
                tensors[f"{base}.experts.{e}.{uname}.weight"] = t[e, inter:].contiguous()
            changed = True
        elif k.endswith(".experts.down_proj"):
            base = k[: -len(".experts.down_proj")]
            base = base.replace(".mlp", "." + prefix) if prefix != "mlp" else base
            t = tensors.pop(k)
            for e in range(t.shape[0]):
                tensors[f"{base}.experts.{e}.{dname}.weight"] = t[e].contiguous()
            changed = True
        elif prefix != "mlp" and ".mlp.gate." in k:
            tensors[k.replace(".mlp.", "." + prefix + ".")] = tensors.pop(k)
            changed = True
    if changed:
        save_file(tensors, path, metadata=meta)
    keys = set(tensors)
    assert any(f".{prefix}.experts.0.{gname}.weight" in k for k in keys), sorted(keys)
    assert any(f".{prefix}.experts.{n_experts - 1}.{dname}.weight" in k for k in keys)
    assert any(f".{prefix}.gate.weight" in k for k in keys)
    assert not any("gate_up_proj" in k for k in keys)
    return changed


def write_awq_checkpoint(float_folder, out_folder, group_size):
    """Rewrites a float llama checkpoint into AutoAWQ GEMM form. Returns the
    dict {linear weight name: dequantized f64 weight} for the reference."""
    path = os.path.join(float_folder, "model.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        src = {k: f.get_tensor(k) for k in f.keys()}
    out, deq = {}, {}
    for k, t in src.items():
        stem = k[: -len(".weight")] if k.endswith(".weight") else None
        if stem and ".layers." in k and any(stem.endswith(n) for n in AWQ_LINEARS):
            qweight, qzeros, scales, d, _, _ = awq_quantize(t, group_size)
            out[stem + ".qweight"] = torch.from_numpy(qweight)
            out[stem + ".qzeros"] = torch.from_numpy(qzeros)
            out[stem + ".scales"] = scales
            deq[k] = d
            # the checkpoint must give the same weight back
            back = awq_dequantize(qweight, qzeros, scales, group_size)
            assert torch.equal(back, d), k
        else:
            out[k] = t
    os.makedirs(out_folder, exist_ok=True)
    save_file(out, os.path.join(out_folder, "model.safetensors"), metadata=meta)
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(float_folder, name)):
            shutil.copy(os.path.join(float_folder, name), os.path.join(out_folder, name))
    return deq


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

def prompt_for(name, vocab, n):
    # fixed per fixture (independent of the weight seed); ids >= 3 avoid 0..2
    rng = np.random.default_rng(hash_name(name))
    return [int(v) for v in rng.integers(3, vocab, size=n)]


def hash_name(name):
    # Python's hash() is salted per process; this one is stable
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % 1000003
    return h


def f32_rel_err(model32, prompt, ref_logits):
    l32 = full_logits(model32, prompt)
    err = (l32 - ref_logits).abs().amax(dim=-1) / ref_logits.abs().amax(dim=-1)
    return float(err.max())


def state_equal_logits(m_a, m_b, prompt):
    la = full_logits(m_a, prompt)
    lb = full_logits(m_b, prompt)
    return float((la - lb).abs().max())


def build_candidate(name, spec, seed, workdir):
    cfg = spec["config"]()
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", experts_implementation="eager").eval()
    randomize(model, seed, cfg.initializer_range)
    folder = os.path.join(workdir, name)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    if spec["save_dtype"] != torch.float32:
        # round the parameters only (model.to(bf16) would also round the RoPE
        # inv_freq buffer, which from_pretrained recomputes in float32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(spec["save_dtype"]).to(p.dtype))
        copy.deepcopy(model).to(spec["save_dtype"]).save_pretrained(folder)
    else:
        model.save_pretrained(folder)
    return model, folder


def write_outputs(folder, name, arch, prompt, ref, vocab, notes, extra):
    ref["logits"].contiguous().numpy().astype("<f8").tofile(os.path.join(folder, "logits.f64"))
    g = {
        "arch": arch,
        "prompt_ids": prompt,
        "logits_file": "logits.f64",
        "vocab_size": vocab,
        "n_positions": len(prompt),
        "greedy_new_tokens": ref["new"],
        "min_margin": ref["min_margin"],
        "notes": notes,
    }
    g.update(extra)
    with open(os.path.join(folder, "golden.json"), "w") as f:
        json.dump(g, f, indent=2)
        f.write("\n")


def make_fixture(name, spec, workdir):
    is_moe = spec.get("moe", False)
    cfg0 = spec["config"]()
    vocab = cfg0.vocab_size
    prompt = prompt_for(name, vocab, spec["prompt_len"])
    for seed in range(spec["seed"], spec["seed"] + MAX_SEED_TRIES):
        model, folder = build_candidate(name, spec, seed, workdir)
        if is_moe:
            ensure_classic_moe(folder, cfg0.model_type,
                               getattr(cfg0, "num_local_experts", None) or cfg0.num_experts)
        rewrite_config(folder, spec)
        m64 = load(folder, torch.float64)
        ref = reference(m64, prompt, is_moe)
        awq = None
        if margins_ok(ref) and spec.get("also_awq"):
            awq = make_awq_variant(spec["also_awq"], folder, m64, prompt, workdir)
            if awq is None:
                print(f"  {name}: seed {seed}: AWQ variant margin too small, retry")
                continue
        if not margins_ok(ref):
            print(f"  {name}: seed {seed}: margin {ref['min_margin']:.2e} "
                  f"router {ref['router_margin']} distinct {len(set(ref['new']))}, retry")
            continue
        break
    else:
        raise SystemExit(f"{name}: no seed with a safe margin")

    # the checkpoint on disk is the model we built (catches rewrite mistakes)
    m32 = load(folder, torch.float32)
    diff = state_equal_logits(model, m32, prompt)
    assert diff == 0.0, f"{name}: reloaded checkpoint differs from the built model by {diff}"
    f32err = f32_rel_err(m32, prompt, ref["logits"])
    # cross-check: greedy with KV cache (HF generate) in f64
    cached = cached_generate(m64, prompt)
    extra = {
        "seed": seed,
        "min_margin_abs": ref["min_margin_abs"],
        "hf_f32_max_rel_err": f32err,
        "weights_dtype": str(spec["save_dtype"]).replace("torch.", ""),
    }
    if ref["router_margin"] is not None:
        extra["min_router_margin"] = ref["router_margin"]
    notes = spec["notes"]
    if cached != ref["new"]:
        extra["hf_generate_cached_tokens"] = cached
        notes += (" HF generate() with KV cache gives different tokens (see "
                  "hf_generate_cached_tokens): with a cache each decode step recomputes "
                  "inv_freq for the new length but keeps keys rotated with the old one.")
    else:
        notes += " HF generate() with KV cache gives the same greedy tokens."
    arch = m64.config.architectures[0]
    write_outputs(folder, name, arch, prompt, ref, vocab, notes, extra)
    summary = [(name, seed, ref["min_margin"], ref["router_margin"], f32err)]
    if awq:
        write_outputs(awq["folder"], spec["also_awq"], arch, prompt, awq["ref"], vocab,
                      awq["notes"], dict(extra, seed=seed,
                                         min_margin_abs=awq["ref"]["min_margin_abs"],
                                         hf_f32_max_rel_err=awq["f32err"],
                                         weights_dtype="awq-int4 (float32 non-linear tensors)"))
        summary.append((spec["also_awq"], seed, awq["ref"]["min_margin"], None, awq["f32err"]))
    return summary


AWQ_GROUP = 32


def make_awq_variant(name, float_folder, m64_float, prompt, workdir):
    """AutoAWQ GEMM checkpoint of the float model in float_folder; the reference
    is the float model with every decoder linear replaced by its dequantized
    weight. Returns None when its margins are unsafe."""
    folder = os.path.join(workdir, name)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    deq = write_awq_checkpoint(float_folder, folder, AWQ_GROUP)
    rewrite_config(folder, dict(rope_form="as-is"), extra={"quantization_config": {
        "quant_method": "awq", "version": "gemm", "bits": 4,
        "group_size": AWQ_GROUP, "zero_point": True}})
    m64 = load(float_folder, torch.float64)
    m32 = load(float_folder, torch.float32)
    sd = dict(m64.named_parameters())
    with torch.no_grad():
        for k, d in deq.items():
            sd[k].copy_(d)
            dict(m32.named_parameters())[k].copy_(d.to(torch.float32))
            assert torch.equal(d.to(torch.float32).to(torch.float64), d)  # exact in f32
    n_q = len(deq)
    assert n_q == 7 * m64.config.num_hidden_layers, n_q
    ref = reference(m64, prompt, False)
    if not margins_ok(ref):
        return None
    f32err = f32_rel_err(m32, prompt, ref["logits"])
    notes = ("AutoAWQ GEMM checkpoint of the `llama` fixture (same seed, same prompt): every "
             "decoder linear (q/k/v/o, gate/up/down) -> qweight int32 [in, out/8], qzeros int32 "
             "[in/32, out/8], scales f16 [in/32, out]; asymmetric 4-bit RTN, group 32, "
             "nibble order AWQ_ORDER [0,2,4,6,1,3,5,7]. embed_tokens, norms, lm_head stay float32 "
             "(same bytes as `llama`). Reference = the float model with W := (q - z) * s.")
    return dict(folder=folder, ref=ref, f32err=f32err, notes=notes)


def main(argv):
    awq_selfcheck()
    names = argv or [n for n in FIXTURES]
    with tempfile.TemporaryDirectory() as workdir:
        summary = []
        for name in names:
            if name not in FIXTURES:
                raise SystemExit(f"unknown fixture {name} (AWQ is built with llama)")
            print(f"building {name}")
            summary += make_fixture(name, FIXTURES[name], workdir)
            out_names = [name] + ([FIXTURES[name]["also_awq"]] if FIXTURES[name].get("also_awq") else [])
            for n in out_names:
                dst = os.path.join(HERE, n)
                if os.path.exists(dst):
                    shutil.rmtree(dst)
                shutil.copytree(os.path.join(workdir, n), dst)
    print("\nfixture              seed  min_margin  router_margin  hf_f32_rel_err")
    for n, s, m, r, e in summary:
        rs = "-" if r is None else f"{r:.3e}"
        print(f"{n:20s} {s:5d}  {m:.3e}   {rs:>12s}   {e:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
