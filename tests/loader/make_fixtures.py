#!/usr/bin/env python3
"""make_fixtures.py — regenerates the checkpoint-loader fixtures in tests/loader/.

Run from anywhere:  python3 tests/loader/make_fixtures.py
(needs torch, transformers 5.x, safetensors, numpy; deterministic seeds.)

What it writes and why:
  tiny_llama/        a real LlamaForCausalLM saved by transformers
                     save_pretrained (bf16), so the loader is tested against
                     exactly what the library writes; plus a tokenizer_config.json
                     with the list-of-{name,template} chat_template form.
  tiny_llama_sharded/  the same model saved with max_shard_size="12KB":
                     model.safetensors.index.json + shards, as transformers writes them.
  tiny_llama_ref.safetensors  the same tensors in f32 (bf16 -> f32 is exact).
  awq/               an AutoAWQ GEMM checkpoint: random weights quantized with
                     AutoAWQ's zero-point min/max quantizer and packed exactly
                     like awq/modules/linear/gemm.py WQLinear_GEMM.from_linear
                     (order_map [0, 2, 4, 6, 1, 3, 5, 7]); config.json carries
                     quantization_config. One float linear (lm_head) stays
                     unquantized, as in real AWQ checkpoints.
  awq_ref.safetensors  the dequantized f32 matrices (q - z) * s, [out, in].
  configs/*.json     config.json of each supported architecture as written by
                     transformers 5.x save_pretrained, plus hand-written
                     transformers-4.x style files (top-level rope_theta +
                     rope_scaling) for the older form.
"""
import json
import os
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out = os.path.join(HERE, "tiny_llama")
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for f in os.listdir(out):
        if f not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(out, f))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": [
            {"name": "tool_use", "template": "TOOLS {{ messages }}"},
            {"name": "default", "template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"},
        ]}, f, indent=2)
    # the same model as transformers shards it (index.json + 3 shards)
    sharded = os.path.join(HERE, "tiny_llama_sharded")
    shutil.rmtree(sharded, ignore_errors=True)
    model.save_pretrained(sharded, max_shard_size="12KB")
    for f in os.listdir(sharded):
        if f != "config.json" and not f.startswith("model"):
            os.remove(os.path.join(sharded, f))
    ref = {k: v.float().contiguous() for k, v in model.state_dict().items()}
    save_file(ref, os.path.join(HERE, "tiny_llama_ref.safetensors"))


def awq_quantize(w, group):
    """AutoAWQ pseudo_quantize_tensor (zero_point=True, 4 bits), returning
    integer codes [out, in], zeros and scales [out, in/group]."""
    out_f, in_f = w.shape
    wg = w.reshape(-1, group)
    max_val = wg.amax(dim=1, keepdim=True)
    min_val = wg.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / 15
    zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
    scales = scales.view(out_f, -1)
    zeros = zeros.view(out_f, -1)
    # WQLinear_GEMM.from_linear: scales become f16, codes are recomputed
    # from them (clamped here so the packing below cannot overflow a nibble).
    scales_h = scales.half()
    s_full = scales_h.float().repeat_interleave(group, dim=1)
    z_full = zeros.repeat_interleave(group, dim=1)
    q = torch.clamp(torch.round(w / s_full) + z_full, 0, 15).to(torch.int32)
    return q, zeros.to(torch.int32), scales_h


def awq_pack(intweight_t):
    """Packs [rows, cols] int codes (cols % 8 == 0) like from_linear."""
    rows, cols = intweight_t.shape
    packed = torch.zeros((rows, cols // 8), dtype=torch.int64)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= intweight_t[:, col * 8 + AWQ_ORDER[i]].to(torch.int64) << (i * 4)
    # reinterpret as int32 (two's complement), as torch does with int32 |=
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def awq():
    from transformers import LlamaConfig

    torch.manual_seed(1)
    group = 64
    hidden, inter, vocab = 64, 192, 40
    out = os.path.join(HERE, "awq")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    d = cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    d["quantization_config"] = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group,
                                "zero_point": True, "modules_to_not_convert": None}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)

    tensors, ref = {}, {}
    # down_proj: [out=hidden, in=inter]; up_proj: [out=inter, in=hidden]
    for name, (o, i) in {"model.layers.0.mlp.down_proj": (hidden, inter),
                         "model.layers.0.mlp.up_proj": (inter, hidden)}.items():
        w = torch.randn(o, i) * 0.05
        q, z, s = awq_quantize(w, group)
        tensors[name + ".qweight"] = awq_pack(q.t().contiguous())          # [in, out/8]
        tensors[name + ".qzeros"] = awq_pack(z.t().contiguous())           # [in/g, out/8]
        tensors[name + ".scales"] = s.t().contiguous()                     # [in/g, out] f16
        z_full = z.repeat_interleave(group, dim=1)
        s_full = s.float().repeat_interleave(group, dim=1)
        ref[name] = ((q - z_full).float() * s_full).contiguous()           # [out, in]
    lm = (torch.randn(vocab, hidden) * 0.05).half()
    tensors["lm_head.weight"] = lm
    ref["lm_head"] = lm.float()
    save_file(tensors, os.path.join(out, "model.safetensors"))
    save_file(ref, os.path.join(HERE, "awq_ref.safetensors"))


def configs():
    import transformers as tf

    out = os.path.join(HERE, "configs")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    small = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 max_position_embeddings=4096)
    made = {
        "llama3": tf.LlamaConfig(**small, num_key_value_heads=2, intermediate_size=128, bos_token_id=128000,
                                 eos_token_id=[128001, 128008, 128009], tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 2048}),
        "mistral": tf.MistralConfig(**small, num_key_value_heads=2, intermediate_size=160),
        "qwen2": tf.Qwen2Config(**small, num_key_value_heads=2, intermediate_size=96, eos_token_id=7,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 1024}),
        "mixtral": tf.MixtralConfig(**small, num_key_value_heads=2, intermediate_size=112, num_local_experts=4,
                                    num_experts_per_tok=2),
        "qwen2_moe": tf.Qwen2MoeConfig(**small, num_key_value_heads=4, intermediate_size=96,
                                       moe_intermediate_size=32, shared_expert_intermediate_size=80,
                                       num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
                                       mlp_only_layers=[3], norm_topk_prob=False),
        "qwen3_moe": tf.Qwen3MoeConfig(**small, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                                       moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                       norm_topk_prob=True),
    }
    archs = {"llama3": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM"}
    for key, cfg in made.items():
        cfg.architectures = [archs[key]]
        tmp = tempfile.mkdtemp()
        cfg.save_pretrained(tmp)
        shutil.copy(os.path.join(tmp, "config.json"), os.path.join(out, key + ".json"))
        shutil.rmtree(tmp)
    # transformers 4.x style (as found on the Hub): top-level rope_theta,
    # rope_scaling with "type", null head_dim, eos as a list.
    v4 = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "intermediate_size": 14336, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "attention_bias": True,
        "bos_token_id": 128000, "eos_token_id": [128001, 128009], "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "llama_v4_linear.json"), "w") as f:
        json.dump(v4, f, indent=2)
    v4q = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": 151645,
        "quantization_config": {"quant_method": "awq", "version": "GEMM", "bits": 4, "group_size": 128,
                                "zero_point": True},
    }
    with open(os.path.join(out, "qwen2_v4_awq.json"), "w") as f:
        json.dump(v4q, f, indent=2)


if __name__ == "__main__":
    np.random.seed(0)
    tiny_llama()
    awq()
    configs()
    print("fixtures written to", HERE)
