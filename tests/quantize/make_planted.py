"""make_planted.py — the `planted` fixture of tests/test_quantize.sh: a tiny
random float32 llama (hidden 128, 4 heads of 32 without GQA, so o_proj's
scales fold into v_proj, intermediate 256, 2 layers, byte vocabulary 256)
with a few planted large-activation input channels, the case AWQ exists for.

Planting leaves the float model's function unchanged: hidden channels
PLANT_D of both RMSNorm weights are multiplied by K and the matching input
columns of q/k/v and gate/up divided by K; intermediate channels PLANT_FF of
up_proj's rows are multiplied by K and down_proj's matching columns divided
by K. The large inputs then meet small weights, which plain round-to-nearest
quantizes coarsely relative to their effect on the output.

Writes config.json, model.safetensors (written by hand: numpy only),
tokenizer.json (tests/make_byte_tokenizer.py), calib.txt (calibration text)
and eval_ids.json (a held-out prompt). Deterministic:
python3 tests/quantize/make_planted.py [OUT_DIR]

hf_awq_logits.f32 (transformers on the checkpoint flotilla quantize writes
with the test's flags) is made afterwards by
  flotilla quantize --model planted --calib planted/calib.txt --output AWQ --n-samples 4 --seq-len 128
  flotilla logits --model AWQ --input-ids planted/eval_ids.json --output fl.f32
  python3 tests/quantize/check_awq_hf.py AWQ planted/eval_ids.json fl.f32 planted/hf_awq_logits.f32
and hf_ct_logits.f32 (transformers with compressed-tensors on the
--format compressed-tensors checkpoint of the same run) by
  flotilla quantize ... --output CT --format compressed-tensors   (the flags above)
  flotilla logits --model CT --input-ids planted/eval_ids.json --output ct.f32
  python3 tests/quantize/check_ct_hf.py CT planted/eval_ids.json ct.f32 AWQ planted/hf_ct_logits.f32
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np

D, H, HD, FF, L, V = 128, 4, 32, 256, 2, 256
PLANT_D, PLANT_FF, K = [5, 37, 64, 100], [10, 99, 200], 30.0


def write_safetensors(path, tensors):
    header, off, blobs = {}, 0, []
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "planted")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20240533)
    w = lambda *s: rng.normal(0, 0.08, s).astype(np.float32)
    t = {"model.embed_tokens.weight": rng.normal(0, 1.0, (V, D)).astype(np.float32)}
    for l in range(L):
        p = f"model.layers.{l}."
        n_in = (1 + 0.2 * rng.normal(size=D)).astype(np.float32)
        n_post = (1 + 0.2 * rng.normal(size=D)).astype(np.float32)
        q, k, v, o = w(H * HD, D), w(H * HD, D), w(H * HD, D), w(D, H * HD)
        g, u, dn = w(FF, D), w(FF, D), w(D, FF)
        for c in PLANT_D:
            n_in[c] *= K
            n_post[c] *= K
            for m in (q, k, v, g, u):
                m[:, c] /= K
        for c in PLANT_FF:
            u[c, :] *= K
            dn[:, c] /= K
        t.update({p + "input_layernorm.weight": n_in, p + "post_attention_layernorm.weight": n_post,
                  p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                  p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": o,
                  p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u, p + "mlp.down_proj.weight": dn})
    t["model.norm.weight"] = (1 + 0.2 * rng.normal(size=D)).astype(np.float32)
    t["lm_head.weight"] = w(V, D) * 4
    write_safetensors(os.path.join(out, "model.safetensors"), t)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
           "bos_token_id": 1, "eos_token_id": 2, "head_dim": HD, "hidden_act": "silu", "hidden_size": D,
           "intermediate_size": FF, "max_position_embeddings": 512, "mlp_bias": False,
           "num_attention_heads": H, "num_hidden_layers": L, "num_key_value_heads": H, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": V}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.check_call([sys.executable, os.path.join(here, "..", "make_byte_tokenizer.py"),
                           os.path.join(out, "tokenizer.json"), str(V)])
    words = ("the of and to in is was for that on as with by at from his an were are which this be "
             "quantization weights activations model layer channel scale group error output input").split()
    lines = [" ".join(rng.choice(words, size=12)).capitalize() + "." for _ in range(120)]
    with open(os.path.join(out, "calib.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "eval_ids.json"), "w") as f:
        json.dump([int(x) for x in rng.integers(32, 127, size=48)], f)


if __name__ == "__main__":
    main()
