#!/usr/bin/env python3
"""make_deepseek_fixtures.py — GGUF copies of the DeepSeek-V2 golden
fixtures, for tests/test_gguf_deepseek.c, made by llama.cpp's own converter.

Runs convert_hf_to_gguf.py's DeepseekV2Model (architecture "deepseek2") from
the llama.cpp tree vendored by llama-cpp-python 0.3.9 (its sdist's
vendor/llama.cpp, kept at .deps/llama.cpp-py0.3.9), with that tree's gguf-py,
on tests/golden/deepseek_v2 and deepseek_v2_lite. That converter writes MLA
the "absorbed" way: key_length_mla / value_length_mla, and kv_b_proj split
per head into attn_k_b (transposed) and attn_v_b. Outputs, in tests/gguf/deepseek/:

  deepseek_v2.gguf       F32 (q_lora_rank 24, group-limited routing)
  deepseek_v2.q8_0.gguf  the converter's Q8_0 (rows not a multiple of 32,
                         such as attn_k_b's, stay F16 / F32 as it decides)
  deepseek_v2_lite.f16.gguf  F16 (no q_lora: attn_q; YaRN keys)
  deepseek_v2.kv_b.q8_0.gguf  Q8_0 in the layout of converters before the
                         split (llama.cpp before April 2025): attn_kv_b
                         whole, key_length = nope + rope, value_length = v,
                         no *_mla keys (OldLayout below)
  deepseek/tiny_deepseek2.gguf  a 48 KB Q8_0 file of a random 2-layer model (a
                         dense layer, a MoE one): the fuzz_gguf seed that
                         reaches the deepseek2 config and the k_b/v_b join

Two departures from running the converter's command line, both because the
fixtures are not hub checkpoints:
  - set_vocab writes a byte-level "gpt2" vocabulary of the config's size
    (the fixtures have no tokenizer, and the tests feed token ids);
  - deepseek_v2 uses topk_method group_limited_greedy, which this converter
    does not record: the keys newer converters write for it,
    deepseek2.expert_group_count / expert_group_used_count (n_group,
    topk_group), are added so the file routes like the HF model.
The hparams are read from config.json (the converter's own fallback when
transformers' AutoConfig does not know the model type), less the head_dim
that transformers 5 saves and hub configs lack (see convert()).

Usage (torch, transformers, numpy, safetensors, sentencepiece in the venv):
  python3 tests/gguf/make_deepseek_fixtures.py [path/to/llama.cpp-py0.3.9]
"""
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "golden"
OUT = HERE / "deepseek"
LLAMA = Path(sys.argv[1] if len(sys.argv) > 1 else HERE.parent.parent / ".deps" / "llama.cpp-py0.3.9").resolve()
sys.path.insert(0, str(LLAMA / "gguf-py"))  # the converter's own gguf-py, not a newer installed one
sys.path.insert(0, str(LLAMA))

import gguf  # noqa: E402
import torch  # noqa: E402
import convert_hf_to_gguf as conv  # noqa: E402

assert Path(gguf.__file__).resolve().is_relative_to(LLAMA), f"gguf-py comes from {gguf.__file__}, not {LLAMA}"


def byte_vocab(n):
    """GPT-2's byte -> printable-character map for ids 0..255, then merged
    pairs of lowercase letters up to the model's vocabulary size; returns
    tokens, types and merges."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, k = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    table = dict(zip(bs, cs))
    nb = min(n, 256)
    letters = "etaoinshrdlu"
    merges = [f"{a} {b}" for a in letters for b in letters][:n - nb]
    toks = [chr(table[b]) for b in range(nb)] + [m.replace(" ", "") for m in merges]
    return toks, [gguf.TokenType.NORMAL] * n, merges


class Fixture(conv.DeepseekV2Model):
    model_arch = gguf.MODEL_ARCH.DEEPSEEK2

    def set_vocab(self):
        toks, types, merges = byte_vocab(self.hparams["vocab_size"])
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list(toks)
        self.gguf_writer.add_token_types(types)
        self.gguf_writer.add_token_merges(merges)
        self.gguf_writer.add_bos_token_id(self.hparams["bos_token_id"])
        self.gguf_writer.add_eos_token_id(self.hparams["eos_token_id"])

    def set_gguf_parameters(self):
        super().set_gguf_parameters()
        h = self.hparams
        if h.get("topk_method") == "group_limited_greedy":
            arch = self.gguf_writer.arch
            self.gguf_writer.add_uint32(f"{arch}.expert_group_count", h["n_group"])
            self.gguf_writer.add_uint32(f"{arch}.expert_group_used_count", h["topk_group"])


class OldLayout(Fixture):
    """What DeepseekV2Model wrote before MLA absorption: kv_b_proj mapped
    as is, and the per-head key/value lengths in key_length/value_length."""
    model_arch = gguf.MODEL_ARCH.DEEPSEEK2

    def modify_tensors(self, data_torch, name, bid):
        if name.endswith("kv_b_proj.weight"):
            return [(self.map_tensor_name(name), data_torch)]
        return super().modify_tensors(data_torch, name, bid)

    def set_gguf_parameters(self):
        super().set_gguf_parameters()
        h, kv, arch = self.hparams, self.gguf_writer.kv_data[0], self.gguf_writer.arch
        del kv[f"{arch}.attention.key_length_mla"], kv[f"{arch}.attention.value_length_mla"]
        kv[f"{arch}.attention.key_length"].value = h["qk_nope_head_dim"] + h["qk_rope_head_dim"]
        kv[f"{arch}.attention.value_length"].value = h["v_head_dim"]


def convert(name, ftype, suffix="", cls=Fixture):
    folder = GOLDEN / name
    with open(folder / "config.json") as f:
        hparams = json.load(f)
    # transformers 5 saves DeepseekV2Config's head_dim (= qk_rope_head_dim);
    # the hub configs have none, and the base class would write key_length
    # from it before DeepseekV2Model writes its own (a duplicate key)
    hparams.pop("head_dim", None)
    out = OUT / f"{name}{suffix}.gguf"
    with torch.inference_mode():
        m = cls(folder, ftype, out, hparams=hparams, model_name=name, eager=True)
        m.write()
    print(f"{out.relative_to(HERE)}: {out.stat().st_size} bytes")


def tiny_seed(tmp):
    """A random 2-layer DeepSeek-V2 HF folder with every row a multiple of
    32 wide (so Q8_0 applies throughout, attn_k_b included)."""
    from safetensors.torch import save_file
    H, NH, QL, KVL, NOPE, ROPE, VD, E, FF, V = 32, 2, 32, 32, 32, 32, 32, 2, 32, 16
    c = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": V,
         "hidden_size": H, "intermediate_size": FF, "moe_intermediate_size": FF, "num_hidden_layers": 2,
         "num_attention_heads": NH, "num_key_value_heads": NH, "q_lora_rank": QL, "kv_lora_rank": KVL,
         "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": VD, "n_routed_experts": E,
         "n_shared_experts": 1, "num_experts_per_tok": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
         "routed_scaling_factor": 1.0, "norm_topk_prob": False, "scoring_func": "softmax", "topk_method": "greedy",
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": 1,
         "eos_token_id": 2, "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1
    w = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H), "lm_head.weight": r(V, H)}
    for l in range(2):
        p = f"model.layers.{l}."
        w |= {p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
              p + "self_attn.q_a_proj.weight": r(QL, H), p + "self_attn.q_a_layernorm.weight": r(QL),
              p + "self_attn.q_b_proj.weight": r(NH * (NOPE + ROPE), QL),
              p + "self_attn.kv_a_proj_with_mqa.weight": r(KVL + ROPE, H),
              p + "self_attn.kv_a_layernorm.weight": r(KVL),
              p + "self_attn.kv_b_proj.weight": r(NH * (NOPE + VD), KVL), p + "self_attn.o_proj.weight": r(H, NH * VD)}
        mlps = [p + "mlp."] if l == 0 else [p + f"mlp.experts.{e}." for e in range(E)] + [p + "mlp.shared_experts."]
        for m in mlps:
            w |= {m + "gate_proj.weight": r(FF, H), m + "up_proj.weight": r(FF, H), m + "down_proj.weight": r(H, FF)}
        if l == 1:
            w[p + "mlp.gate.weight"] = r(E, H)
    tmp.mkdir(exist_ok=True)
    with open(tmp / "config.json", "w") as f:
        json.dump(c, f)
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp / "model.safetensors"))
    with torch.inference_mode():
        Fixture(tmp, gguf.LlamaFileType.MOSTLY_Q8_0, OUT / "tiny_deepseek2.gguf", hparams=c,
                model_name="tiny_deepseek2", eager=True).write()
    print(f"tiny_deepseek2.gguf: {(OUT / 'tiny_deepseek2.gguf').stat().st_size} bytes")


def main():
    OUT.mkdir(exist_ok=True)
    convert("deepseek_v2", gguf.LlamaFileType.ALL_F32)
    convert("deepseek_v2", gguf.LlamaFileType.MOSTLY_Q8_0, ".q8_0")
    convert("deepseek_v2_lite", gguf.LlamaFileType.MOSTLY_F16, ".f16")
    convert("deepseek_v2", gguf.LlamaFileType.MOSTLY_Q8_0, ".kv_b.q8_0", OldLayout)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tiny_seed(Path(d) / "tiny")


if __name__ == "__main__":
    main()
