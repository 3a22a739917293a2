#!/usr/bin/env python3
"""make_gguf_decode_ref.py — what Hugging Face `tokenizers` decodes for the
added tokens of DeepSeek's GGUF vocabularies (tests/test_gguf_vocab.c).

DeepSeek LLM / V2 / Coder vocabularies carry added tokens next to their BPE
vocabulary: "ø", "ö", "ú", "ÿ", "õ", "÷", "û", "ý", "À", "ù", "Á", "þ", "ü"
(the byte-level characters of the bytes C0, C1, F5..FF, which never occur
in UTF-8 and so never got a token of their own), "[PAD...]" fillers and,
in Coder, "<｜fim▁hole｜>"-style markers. GGUF stores them as USER_DEFINED
(CONTROL for bos / eos) in plain UTF-8.

HF decodes an added token like any other token: its content goes through the
tokenizer's decoder (tokenizers' TokenizerImpl::decode; since 0.23 with the
normalizer's form of the content when a normalizer changes it, which none
here does). ByteLevel maps each character of a token back to its byte when
every character is in the byte-level alphabet, and keeps the token's own
UTF-8 otherwise; the bytes are then read as UTF-8 with U+FFFD for what is
invalid. So "ü" decodes to the byte FC, i.e. "\ufffd", the same with
normalized true or false, while "<｜fim▁hole｜>" (full-width bars are not in
the alphabet) comes back as written. (llama.cpp differs here: it copies
USER_DEFINED tokens' text unchanged, "ü".)

The hub's tokenizer.json files are out of reach on this machine, so each is
rebuilt from the GGUF that llama.cpp converted from it (scripts/llama-cpp-src.sh
vocab): BPE vocabulary and merges, the added tokens with their ids, the
pre-tokenizer that tokenizer.json holds (its Split regexes as llama.cpp's
llama-vocab.cpp lists them, read from there; Digits), ByteLevel decoder. The rebuild must give the ids HF
gave for every llama.cpp test string of the family (.gguf.out, made with the
real tokenizer.json; "Führer" there holds added token "ü"), and both values
of `normalized` must decode alike; then the decodes of id lists with added
tokens alone, inside words and next to special tokens (skip_special_tokens
off and on) are written to tests/tokenizer/gguf_decode.ref.json.

Usage: scripts/llama-cpp-src.sh vocab; scripts/llama-cpp-src.sh src;
       python3 scripts/make_gguf_decode_ref.py   (needs tokenizers, gguf)
"""
import json
import os
import re
import sys

import gguf
import tokenizers
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = os.path.join(ROOT, ".deps", "ggml-vocab-py0.3.9")
OUT = os.path.join(ROOT, "tests", "tokenizer", "gguf_decode.ref.json")
SEP = "\n__ggml_vocab_test__\n"

LLAMA_VOCAB_CPP = os.path.join(ROOT, ".deps", "llama.cpp-py0.3.9", "src", "llama-vocab.cpp")
# family -> llama-vocab.cpp's pre-tokenizer case: its Split regexes (the
# tokenizer.json's), the last one standing for Digits(individual_digits)
FAMILIES = {"deepseek-llm": "DEEPSEEK_LLM", "deepseek-coder": "DEEPSEEK_CODER"}


def pre_regexes(case):
    """The C string literals of `case LLAMA_VOCAB_PRE_TYPE_<case>: regex_exprs = {...}`, unescaped."""
    src = open(LLAMA_VOCAB_CPP, encoding="utf-8").read()
    body = src[src.index(f"case LLAMA_VOCAB_PRE_TYPE_{case}:"):]
    body = body[body.index("{") + 1:body.index("};")]
    lits = re.findall(r'"((?:[^"\\]|\\.)*)"', body)
    esc = {"\\": "\\", "r": "\r", "n": "\n", '"': '"'}
    return [re.sub(r"\\(.)", lambda m: esc[m.group(1)], x) for x in lits]


def split(pattern):
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def read_vocab(family):
    r = gguf.GGUFReader(os.path.join(VOCAB, f"ggml-vocab-{family}.gguf"))

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data]
    return strings("tokenizer.ggml.tokens"), types, strings("tokenizer.ggml.merges")


def rebuild(family, normalized):
    """tokenizer.json of the family from its GGUF; added tokens with the given `normalized`."""
    toks, types, merges = read_vocab(family)
    steps = [split(p) for p in pre_regexes(FAMILIES[family])[:-1]]
    steps.append({"type": "Digits", "individual_digits": True})
    steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False})
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": normalized, "special": types[i] == gguf.TokenType.CONTROL}
             for i, t in enumerate(toks) if types[i] != gguf.TokenType.NORMAL]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
          "normalizer": {"type": "Sequence", "normalizers": []},
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps}, "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": {t: i for i, t in enumerate(toks) if types[i] == gguf.TokenType.NORMAL},
                    "merges": merges}}
    return Tokenizer.from_str(json.dumps(tj)), toks, types


def check_ids(family, tok):
    """The rebuild gives the ids the real tokenizer.json gave for llama.cpp's test strings."""
    base = os.path.join(VOCAB, f"ggml-vocab-{family}.gguf")
    texts = open(base + ".inp", encoding="utf-8").read().split(SEP)[:-1]
    want = open(base + ".out", encoding="utf-8").read().split("\n")
    for text, line in zip(texts, want):
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == [int(x) for x in line.split()], (family, text, got, line)
    return len(texts)


def cases(family, toks, types, tok):
    """Id lists with added tokens: each alone, some inside words and next to special tokens."""
    user = [i for i, t in enumerate(types) if t == gguf.TokenType.USER_DEFINED]
    ctrl = [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL]
    alone = [i for i in user if not toks[i].startswith("[PAD")] + user[-2:] + ctrl
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    lists = [[i] for i in alone]
    latin = [i for i in user if len(toks[i]) == 1]
    lists.append(latin)
    lists.append(enc("Führer") + enc(" naïve"))
    lists.append(enc("Hello") + [latin[0]] + enc(" world") + [latin[-1]])
    lists.append([ctrl[0]] + enc("Gr") + [latin[1]] + enc("ße") + [ctrl[1]])
    lists.append(enc("x") + [i for i in user if not toks[i].isascii() and len(toks[i]) > 1][:3] + enc("y"))
    lists.append([user[-1]] + enc(" tail") + [user[-2]])
    return [{"ids": ids, "skip_special": skip} for ids in lists for skip in (False, True)]


def main():
    out = {"tokenizers": tokenizers.__version__, "families": {}}
    for family in FAMILIES:
        ref = {}
        for normalized in (True, False):
            tok, toks, types = rebuild(family, normalized)
            n = check_ids(family, tok)
            cs = cases(family, toks, types, tok)
            for c in cs:
                c["text"] = tok.decode(c["ids"], skip_special_tokens=c["skip_special"])
            ref[normalized] = cs
        assert ref[True] == ref[False], f"{family}: normalized changes what HF decodes"
        out["families"][family] = ref[True]
        bad = sum("\ufffd" in c["text"] for c in ref[True])
        print(f"{family}: HF ids of {n} test strings reproduced; {len(ref[True])} decodes, {bad} with U+FFFD")
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=0)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
