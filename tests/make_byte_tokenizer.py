"""make_byte_tokenizer.py OUT.json VOCAB_SIZE — a byte-level BPE tokenizer.json
with the 256 byte tokens and no merges, the ids from 256 to VOCAB_SIZE as
added special tokens: any golden fixture (vocabularies >= 256) can then run
`flotilla generate` on text (tests/test_mpi_golden.sh, scripts/gpu-multi-check.sh).
"""
import json
import sys

bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs, n = bs[:], 0
for b in range(256):
    if b not in bs:
        bs.append(b)
        cs.append(256 + n)
        n += 1
vocab = {chr(c): b for b, c in zip(bs, cs)}
added = [{"id": i, "content": f"<x{i}>", "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": False, "special": True} for i in range(256, int(sys.argv[2]))]
bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
json.dump({"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": bl,
           "post_processor": None, "decoder": bl,
           "model": {"type": "BPE", "vocab": vocab, "merges": []}}, open(sys.argv[1], "w"))
