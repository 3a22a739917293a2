"""make_corpus.py — writes the seed corpora fuzz/corpus/<target>/ from the
tests' own fixtures (small files only, trimmed where the originals are big),
so each fuzz target starts from inputs its parser accepts.

    python3 fuzz/make_corpus.py          (from the repository root)

Deterministic; rerun after a fixture changes. Files are named by what they
are; libFuzzer adds its own finds under build-fuzz/, not here.
"""
import json
import os
import shutil
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fuzz", "corpus")


_fresh = set()


def put(target, name, data):
    d = os.path.join(OUT, target)
    if target not in _fresh:  # only the folders made here are replaced
        shutil.rmtree(d, ignore_errors=True)
        _fresh.add(target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def src(*p):
    return os.path.join(ROOT, *p)


def raw(*p):
    return open(src(*p), "rb").read()


# ---- binary checkpoints ------------------------------------------------------
def safetensors_file(tensors, meta=None):
    header, off, blob = {}, 0, b""
    if meta:
        header["__metadata__"] = meta
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        blob += data
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + blob


def checkpoints():
    put("gguf", "synthetic.gguf", raw("tests/gguf/synthetic.gguf"))
    put("gguf", "qwen2.gguf", raw("tests/gguf/qwen2.gguf"))
    put("gguf", "tiny_kquant_moe.gguf", raw("tests/gguf/moe/tiny_kquant_moe.gguf"))
    put("gguf", "tiny_deepseek2.gguf", raw("tests/gguf/deepseek/tiny_deepseek2.gguf"))
    put("safetensors", "tiny_llama.safetensors", raw("tests/loader/tiny_llama/model.safetensors"))
    put("safetensors", "awq.safetensors", raw("tests/loader/awq/model.safetensors"))
    put("safetensors", "small.safetensors", safetensors_file(
        [("a.weight", "F32", [2, 3], bytes(24)), ("b", "BF16", [4], bytes(8)),
         ("c", "I32", [1, 1, 2], bytes(8)), ("empty", "F16", [0, 5], b"")],
        meta={"format": "pt"}))
    put("safetensors", "scalar.safetensors", safetensors_file([("s", "F64", [], bytes(8))]))


# ---- JSONL requests ----------------------------------------------------------
REQUESTS = [
    {"custom_id": "r1", "body": {"prompt": "Once upon a time"}},
    {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "x", "messages": [{"role": "system", "content": "Be terse."},
                                         {"role": "user", "content": "Hi"}],
              "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
              "repetition_penalty": 1.1, "seed": 7, "stop": ["\n\n", "END"]}},
    {"custom_id": "r3", "body": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "part one "}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
        "max_completion_tokens": 5, "stop": "x", "top_k": -1}},
    {"custom_id": "r4", "body": {"prompt": "caf\u00e9 \u65e5\u672c \ud83d\ude00", "temperature": None,
                                 "seed": None, "stop": None, "max_tokens": None}},
    {"custom_id": "bad1", "body": {"messages": "not a list"}},
    {"custom_id": "bad2", "body": {"prompt": "a", "messages": []}},
    {"custom_id": "bad3", "body": {"prompt": "a", "max_tokens": 0, "top_p": 2}},
    {"custom_id": "", "body": {"prompt": "a"}},
    {"body": {"prompt": "no id"}},
]


def requests():
    for i, r in enumerate(REQUESTS):
        put("request", f"req{i}.json", json.dumps(r))
    put("request", "not_json.txt", "this line is not json")
    put("request", "trailing.json", '{"custom_id": "t", "body": {"prompt": "p"}} x')
    put("request", "array.json", '[{"custom_id": "t"}]')


# ---- tokenizer.json ----------------------------------------------------------
def trim_tokenizer(path, keep):
    """The fixture with its vocabulary cut to ids < keep (and the merges
    among them): same components, a fraction of the size."""
    j = json.load(open(path))
    m = j["model"]
    vocab = {t: i for t, i in m["vocab"].items() if i < keep}
    merges = []
    for mg in m.get("merges", []):
        a, b = mg.split(" ", 1) if isinstance(mg, str) else mg
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(mg)
    m["vocab"], m["merges"] = vocab, merges[:200]
    j["added_tokens"] = [t for t in j.get("added_tokens", []) if t["id"] < keep] or \
        [dict(t, id=keep - 1 - k) for k, t in enumerate(j.get("added_tokens", [])[:2])]
    return json.dumps(j, ensure_ascii=False)


def tokenizers():
    for name in ["gpt2", "llama2", "llama3", "misc_bl", "misc_spm", "mistral", "qwen2"]:
        p = src("tests", "tokenizer", f"{name}.tokenizer.json")
        keep = 300 if name in ("gpt2", "llama3", "misc_bl", "qwen2") else 400
        put("tokenizer", f"{name}.json", trim_tokenizer(p, keep))
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [{"id": 256, "content": "<|im_start|>", "special": True, "single_word": False,
              "lstrip": False, "rstrip": False, "normalized": False}]
    put("tokenizer", "bytes.json", json.dumps(
        {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": bl,
         "post_processor": None, "decoder": bl, "model": {"type": "BPE", "vocab": vocab, "merges": []}},
        ensure_ascii=False))


# ---- config.json -------------------------------------------------------------
def model_configs():
    d = src("tests", "loader", "configs")
    for f in sorted(os.listdir(d)):
        put("model_config", f, raw("tests", "loader", "configs", f))
    g = src("tests", "golden")
    for fx in sorted(os.listdir(g)):
        p = os.path.join(g, fx, "config.json")
        if os.path.isfile(p):
            put("model_config", f"golden_{fx}.json", open(p, "rb").read())
    put("model_config", "awq.json", raw("tests", "loader", "awq", "config.json"))


# ---- YAML config (first byte: 0 = a subcommand's file, 1 = flotilla slurm) ---
def config_files():
    d = src("configs")
    for f in sorted(os.listdir(d)):
        if f.endswith(".yaml"):
            body = raw("configs", f)
            put("config_file", f"{f}.cmd", b"\0" + body)
            put("config_file", f"{f}.slurm", b"\1" + body)
    put("config_file", "flags.yaml", b"\0model: m.gguf\nverbose: true\nresume: no\nmax_num_seqs: 8\n")
    put("config_file", "nested.yaml", b"\1model: m\ntp: 2\nslurm:\n  nodes: 2\n  gpus-per-node: 4\n"
        b"  time: '01:00:00'\n")
    put("config_file", "list.yaml", b"\0model: [a, b]\n")
    put("config_file", "anchors.yaml", b"\0model: &a x\ninput: *a\noutput: \"y\"\n")


# ---- chat templates ----------------------------------------------------------
ROLE = {"system": b"\0", "user": b"\1", "assistant": b"\2"}


def chat_templates():
    d = src("tests", "chat")
    for f in sorted(os.listdir(d)):
        j = json.load(open(os.path.join(d, f)))
        for k, case in enumerate(j["cases"][:3]):
            parts = [j["template"].encode(), (j.get("bos_token") or "").encode()]
            for m in case["messages"]:
                c = m["content"]
                if not isinstance(c, str):
                    continue
                parts += [ROLE.get(m["role"], m["role"].encode()), c.encode()]
            put("chat_template", f"{f[:-5]}_{k}", b"\0" + b"\0".join(parts))
    # no source: each family's plain form, forced
    for fam in (1, 2, 3):
        put("chat_template", f"plain_{fam}", bytes([fam]) + b"-\0<s>\0\0sys\0\1hi\0\2yo\0\1again")


# ---- the resume scan: result files as a killed job leaves them --------------
def resume_files():
    recs = [
        {"custom_id": "r0", "text": " the end", "prompt_tokens": 5, "completion_tokens": 3,
         "finish_reason": "stop"},
        {"custom_id": "r1", "text": "caf\u00e9 \ufffd", "prompt_tokens": 4, "completion_tokens": 4,
         "finish_reason": "length"},
        {"custom_id": "bad7", "error": {"line": 8, "message": "body.messages must be an array"}},
        {"custom_id": None, "error": {"line": 12, "message": "not valid JSON"}},
    ]
    lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs)
    put("resume", "complete.jsonl", lines)
    put("resume", "torn.jsonl", lines + '{"custom_id":"r2","text":" half a rec')
    put("resume", "invalid_last.jsonl", lines + '{"custom_id":"r3","text":"trunc\n')
    put("resume", "foreign.jsonl", lines[:40] + "\ngarbage\n" + lines)
    put("resume", "requests.jsonl", "".join(json.dumps(r) + "\n" for r in REQUESTS[:4]) +
        json.dumps(REQUESTS[0]) + "\n")


def main():
    checkpoints()
    requests()
    tokenizers()
    model_configs()
    config_files()
    chat_templates()
    resume_files()
    for t in sorted(_fresh):
        files = os.listdir(os.path.join(OUT, t))
        size = sum(os.path.getsize(os.path.join(OUT, t, f)) for f in files)
        print(f"{t}: {len(files)} files, {size} bytes")


if __name__ == "__main__":
    main()
