#!/usr/bin/env python3
"""make_golden_deepseek.py — DeepSeek-V2 (MLA + DeepSeekMoE) golden fixtures.

Same recipe, file format and margin rules as make_golden.py (whose helpers it
reuses): a tiny random DeepseekV2ForCausalLM saved by transformers 5.24,
reloaded from disk in float64 (eager attention, eager experts), full-prompt
logits -> logits.f64, greedy continuation by full recompute -> golden.json.

Two fixtures:
  deepseek_v2       q_lora_rank 24 (q_a_proj -> q_a_layernorm -> q_b_proj),
                    group_limited_greedy routing (8 experts in 4 groups, keep 2
                    groups, top-2), routed_scaling_factor 1.5, default RoPE,
                    new-style config (rope_parameters).
  deepseek_v2_lite  q_lora_rank null (plain q_proj), greedy routing, YaRN with
                    mscale 0.707 / mscale_all_dim 1.0 (so the cos/sin factor
                    and the softmax scale both differ from plain YaRN), hub-style
                    config (top-level rope_theta + rope_scaling {"type": "yarn"}).
Both: kv_lora_rank 32, qk_rope 16, qk_nope 16, v 16, 4 heads, hidden 64,
1 shared expert (moe_intermediate 24), first_k_dense_replace 1 (layer 0 dense,
intermediate 96), 3 layers, vocab 300.

The router margin (DeepSeek's routing is not plain top-k): for greedy, the
k-th minus (k+1)-th router logit; for group_limited_greedy, also the
topk_group-th minus next group score (group score = max logit in the group,
softmax being monotone), and the k-th minus (k+1)-th logit among the experts
of the kept groups — all relative to max |router logit| of the token.

Run: python3 tests/golden/make_golden_deepseek.py [fixture ...]
"""
import math
import os
import shutil
import sys
import tempfile

import torch
from transformers import DeepseekV2Config

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_golden as mg  # noqa: E402

mg.CLASSIC_MOE["deepseek_v2"] = ("mlp", "gate_proj", "up_proj", "down_proj")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              moe_intermediate_size=24, first_k_dense_replace=1, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.15, bos_token_id=1, eos_token_id=2)

FIXTURES = {
    "deepseek_v2": dict(
        config=lambda: DeepseekV2Config(
            **COMMON, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            routed_scaling_factor=1.5, max_position_embeddings=128,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        prompt_len=13, seed=11000, rope_form="new", save_dtype=torch.float32, moe=True,
        extra=dict(moe_layer_freq=1, scoring_func="softmax"),
        notes="MLA: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (q_lora_rank 24); "
              "kv_a_proj_with_mqa -> [latent 32 | k_pe 16]; latent -> kv_a_layernorm -> "
              "kv_b_proj -> per head [k_nope 16 | v 16]; RoPE on q_pe / k_pe is the COMPLEX "
              "(interleaved pairs 2i, 2i+1) rotation, k_pe one head shared by all heads; "
              "softmax scale (nope+rope)^-0.5. q_a_layernorm / kv_a_layernorm use eps 1e-6. "
              "Layer 0 dense (first_k_dense_replace 1), layers 1-2 MoE: softmax over 8 router "
              "logits, group_limited_greedy (4 groups of 2, group score = max prob, keep 2 groups), "
              "top-2 of the kept experts, weights * routed_scaling_factor 1.5, not renormalised; "
              "+ shared expert (no gate). New-style config."),
    "deepseek_v2_lite": dict(
        config=lambda: DeepseekV2Config(
            **COMMON, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
            routed_scaling_factor=1.0, max_position_embeddings=128,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=32, mscale=0.707,
                                 mscale_all_dim=1.0)),
        prompt_len=40, seed=12000, rope_form="old_type", save_dtype=torch.float32, moe=True,
        extra=dict(moe_layer_freq=1, scoring_func="softmax"),
        notes="MLA with q_lora_rank null (plain q_proj). Greedy top-2 routing, scaling 1.0. "
              "YaRN factor 4, original 32, dim = qk_rope_head_dim 16: cos/sin multiplied by "
              "attention_factor = mscale(4, 0.707) / mscale(4, 1.0) = 0.96433 (mscale(s, m) = "
              "0.1 m ln s + 1) and the softmax scale is (nope+rope)^-0.5 * mscale(4, 1.0)^2 = "
              "0.22919. Hub-style config: rope_theta + rope_scaling {type: yarn, ...}."),
}


class DSTap:
    """Router logits of every DeepSeek MoE layer; margin of every routing decision."""

    def __init__(self, model):
        c = model.config
        self.k, self.ng, self.kg, self.method = (c.num_experts_per_tok, c.n_group or 1,
                                                 c.topk_group or 1, c.topk_method)
        self.logits = []
        self.handles = [m.register_forward_hook(self.hook) for _, m in model.named_modules()
                        if type(m).__name__ == "DeepseekV2TopkRouter"]
        assert self.handles

    def hook(self, mod, inp, out):
        self.logits.append(out[0].detach().to(torch.float64).clone())

    @staticmethod
    def gap(v, k):
        s = v.sort(dim=-1, descending=True).values
        return s[..., k - 1] - s[..., k]

    def min_margin(self):
        worst = math.inf
        for rl in self.logits:
            scale = rl.abs().amax(dim=-1)
            if self.method == "group_limited_greedy":
                E = rl.shape[-1]
                gs = rl.view(-1, self.ng, E // self.ng).amax(dim=-1)
                worst = min(worst, float((self.gap(gs, self.kg) / scale).min()))
                keep = gs.topk(self.kg, dim=-1).indices
                mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
                mask = mask.unsqueeze(-1).expand(-1, self.ng, E // self.ng).reshape(-1, E)
                rl = rl.masked_fill(~mask, -1e30)
            worst = min(worst, float((self.gap(rl, self.k) / scale).min()))
        return worst

    def close(self):
        for h in self.handles:
            h.remove()


mg.RouterTap = DSTap
_rewrite = mg.rewrite_config


def main(argv):
    names = argv or list(FIXTURES)
    with tempfile.TemporaryDirectory() as workdir:
        summary = []
        for name in names:
            spec = FIXTURES[name]
            mg.rewrite_config = lambda folder, s, extra=None, _e=spec["extra"]: _rewrite(
                folder, s, dict(_e, **(extra or {})))
            print(f"building {name}")
            summary += mg.make_fixture(name, spec, workdir)
            dst = os.path.join(HERE, name)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            shutil.copytree(os.path.join(workdir, name), dst)
    print("\nfixture              seed  min_margin  router_margin  hf_f32_rel_err")
    for n, s, m, r, e in summary:
        print(f"{n:20s} {s:5d}  {m:.3e}   {r:.3e}   {e:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
