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
    """GPT-2's byte -> printable-character map for ids 0..255, then filler
    control tokens up to the model's vocabulary size."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, k = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    table = dict(zip(bs, cs))
    toks = [chr(table[b]) for b in range(256)] + [f"<|fill{i}|>" for i in range(n - 256)]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * (n - 256)
    return toks, types


class Fixture(conv.DeepseekV2Model):
    model_arch = gguf.MODEL_ARCH.DEEPSEEK2

    def set_vocab(self):
        toks, types = byte_vocab(self.hparams["vocab_size"])
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list(toks)
        self.gguf_writer.add_token_types(types)
        self.gguf_writer.add_token_merges([])
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


def main():
    OUT.mkdir(exist_ok=True)
    convert("deepseek_v2", gguf.LlamaFileType.ALL_F32)
    convert("deepseek_v2", gguf.LlamaFileType.MOSTLY_Q8_0, ".q8_0")
    convert("deepseek_v2_lite", gguf.LlamaFileType.MOSTLY_F16, ".f16")
    convert("deepseek_v2", gguf.LlamaFileType.MOSTLY_Q8_0, ".kv_b.q8_0", OldLayout)


if __name__ == "__main__":
    main()
