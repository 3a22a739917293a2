#!/usr/bin/env python3
"""make_moe_fixtures.py — GGUF copies of the MoE golden fixtures, for
tests/test_gguf_moe.c.

Converts tests/golden/qwen2_moe, qwen3_moe and mixtral (HF folders) into
tests/gguf/moe/<name>.gguf the way llama.cpp's convert_hf_to_gguf.py does for
Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / MixtralForCausalLM: architecture
qwen2moe / qwen3moe / llama (Mixtral: q/k rows permuted for llama.cpp's
interleaved RoPE, feed_forward_length = the experts' width),
every expert projection stacked into one 3-D tensor
(blk.N.ffn_{gate,up,down}_exps.weight, [n_expert, out, in]), the router as
ffn_gate_inp, the shared expert as *_shexp with its sigmoid gate
ffn_gate_inp_shexp as a 1-D [hidden] tensor, weights in F32 (as stored in
the fixture), qwen q/k rows not permuted (NEOX RoPE). A dense layer (HF
mlp_only_layers) keeps ffn_gate/ffn_up/ffn_down and has no router. The test
compares the logits to the fixture's logits.f64.

Usage: python3 tests/gguf/make_moe_fixtures.py   (needs: pip install gguf numpy safetensors)
"""
import json
import os

import numpy as np
import gguf
from safetensors.numpy import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "golden")

LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
         "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}


def permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (HF rows -> llama.cpp rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(name, arch):
    folder = os.path.join(GOLDEN, name)
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    w = load_file(os.path.join(folder, "model.safetensors"))
    wr = gguf.GGUFWriter(os.path.join(HERE, "moe", name + ".gguf"), arch)
    wr.add_name(name)
    wr.add_context_length(c["max_position_embeddings"])
    wr.add_embedding_length(c["hidden_size"])
    wr.add_block_count(c["num_hidden_layers"])
    wr.add_feed_forward_length(c["intermediate_size"])
    wr.add_head_count(c["num_attention_heads"])
    wr.add_head_count_kv(c["num_key_value_heads"])
    if c.get("head_dim"):
        wr.add_key_length(c["head_dim"])
        wr.add_value_length(c["head_dim"])
    wr.add_layer_norm_rms_eps(c["rms_norm_eps"])
    wr.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    if arch == "llama":
        wr.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    E = c.get("num_experts") or c["num_local_experts"]
    wr.add_expert_count(E)
    wr.add_expert_used_count(c["num_experts_per_tok"])
    if "moe_intermediate_size" in c:
        wr.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        wr.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])

    wr.add_tensor("token_embd.weight", w.pop("model.embed_tokens.weight"))
    wr.add_tensor("output_norm.weight", w.pop("model.norm.weight"))
    if "lm_head.weight" in w:
        wr.add_tensor("output.weight", w.pop("lm_head.weight"))
    mixtral = arch == "llama"
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        for proj, gg in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            if mixtral:
                proj = {"gate": "w1", "up": "w3", "down": "w2"}[gg]
                keys = [f"{p}block_sparse_moe.experts.{e}.{proj}.weight" for e in range(E)]
            else:
                keys = [f"{p}mlp.experts.{e}.{proj}.weight" for e in range(E)]
            if keys[0] in w:
                wr.add_tensor(f"blk.{l}.ffn_{gg}_exps.weight", np.stack([w.pop(k) for k in keys]))
        if mixtral:
            w[p + "mlp.gate.weight"] = w.pop(p + "block_sparse_moe.gate.weight")
            w[p + "self_attn.q_proj.weight"] = permute(w[p + "self_attn.q_proj.weight"], nh)
            w[p + "self_attn.k_proj.weight"] = permute(w[p + "self_attn.k_proj.weight"], nkv)
        g = p + "mlp.shared_expert_gate.weight"
        if g in w:
            wr.add_tensor(f"blk.{l}.ffn_gate_inp_shexp.weight", w.pop(g).reshape(-1))
        for hf, gg in LAYER.items():
            if p + hf in w:
                wr.add_tensor(f"blk.{l}.{gg}", w.pop(p + hf))
    assert not w, f"unconverted tensors: {sorted(w)}"
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    print(f"{name}.gguf ({arch})")


def tiny_kquant_moe():
    """tiny_kquant_moe.gguf: a few-KB qwen3moe file (1 layer, 4 experts of
    hidden 32) whose expert tensors are stacked and whose extra tensors are
    one of each K-quant / IQ4 kind: a seed for fuzz/corpus/gguf/ that reaches
    the expert split and the block decoders."""
    import kquant_quantize as kq
    from gguf import GGMLQuantizationType as QT
    rng = np.random.default_rng(7)
    H, F, E, V = 32, 8, 4, 16
    wr = gguf.GGUFWriter(os.path.join(HERE, "moe", "tiny_kquant_moe.gguf"), "qwen3moe")
    for k, v in (("context_length", 64), ("embedding_length", H), ("block_count", 1), ("feed_forward_length", F)):
        getattr(wr, "add_" + k)(v)
    wr.add_head_count(2)
    wr.add_head_count_kv(1)
    wr.add_key_length(16)
    wr.add_value_length(16)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_expert_count(E)
    wr.add_expert_used_count(2)
    wr.add_expert_feed_forward_length(F)

    def f(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    wr.add_tensor("token_embd.weight", f(V, H))
    wr.add_tensor("output_norm.weight", f(H))
    for n, s in (("attn_norm", (H,)), ("ffn_norm", (H,)), ("attn_q", (32, H)), ("attn_k", (16, H)),
                 ("attn_v", (16, H)), ("attn_output", (H, 32)), ("attn_q_norm", (16,)), ("attn_k_norm", (16,)),
                 ("ffn_gate_inp", (E, H)), ("ffn_gate_exps", (E, F, H)), ("ffn_up_exps", (E, F, H)),
                 ("ffn_down_exps", (E, H, F))):
        wr.add_tensor(f"blk.0.{n}.weight", f(*s))
    for qt in kq.QUANTIZERS:
        wr.add_tensor(f"test.{qt.name.lower()}", kq.quantize(f(1, 256), qt), raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def main():
    os.makedirs(os.path.join(HERE, "moe"), exist_ok=True)
    convert("qwen2_moe", "qwen2moe")
    convert("qwen3_moe", "qwen3moe")
    convert("mixtral", "llama")
    tiny_kquant_moe()


if __name__ == "__main__":
    main()
