#!/usr/bin/env python3
"""make_kquant_fixtures.py — block fixtures for tests/test_kquant.c.

For every GGUF super-block kind flotilla decodes (Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, Q8_K, IQ4_NL, IQ4_XS) writes, into tests/gguf/kquant/:

  <TYPE>.blocks   N_BLOCKS raw blocks: random bytes, then the f16 d / dmin
                  fields (f32 d for Q8_K) overwritten with edge values —
                  zero, negative zero, negative, f16 subnormals, the largest
                  finite f16 — and ordinary values;
  <TYPE>.f32      the reference dequantization, little-endian float32, from
                  gguf-py's gguf.quants.dequantize (ggml's own Python port).
                  gguf-py has no Q8_K decoder; its reference here is
                  ggml's dequantize_row_q8_K restated in numpy (d * q in f32).

Random bytes give every nibble / 2-bit / 6-bit code and both signs of the
signed sub-block scales (Q3_K, Q6_K, IQ4_XS) across the blocks.
Usage: python3 tests/gguf/make_kquant_fixtures.py   (needs: pip install gguf numpy)
"""
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kquant")
N_BLOCKS = 8

# byte offsets of the f16 scale fields inside one block
F16_FIELDS = {
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
    "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
}
# f16 bit patterns: +0, -0, smallest subnormal, a mid subnormal, largest
# subnormal, smallest normal, negative subnormal, 65504, -1.5, 2^-10
F16_EDGES = [0x0000, 0x8000, 0x0001, 0x0155, 0x03FF, 0x0400, 0x8203, 0x7BFF, 0xBE00, 0x1400]


def f16_field(rng, b, k):
    """An edge value for block b's field k, or an ordinary small one."""
    i = (b * 2 + k) % (len(F16_EDGES) + 4)
    if i < len(F16_EDGES):
        return F16_EDGES[i]
    return int(np.float16(rng.uniform(-0.05, 0.05)).view(np.uint16))


def main():
    os.makedirs(HERE, exist_ok=True)
    rng = np.random.default_rng(20251205)
    for name in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS"]:
        qt = QT[name]
        _, bsize = gguf.GGML_QUANT_SIZES[qt]
        blocks = rng.integers(0, 256, size=(N_BLOCKS, bsize), dtype=np.uint8)
        for b in range(N_BLOCKS):
            if name == "Q8_K":
                d = [0.0, -0.0, 1e-40, -3e-39, 1.0, -2.5e-3, 7.0e3, 1.2345e-2][b]
                blocks[b, 0:4] = np.frombuffer(np.float32(d).tobytes(), dtype=np.uint8)
                continue
            for k, off in enumerate(F16_FIELDS[name]):
                blocks[b, off:off + 2] = np.frombuffer(np.uint16(f16_field(rng, b, k)).tobytes(), dtype=np.uint8)
        if name == "Q8_K":
            d = blocks[:, 0:4].copy().view(np.float32)
            q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
            ref = (d * q).astype(np.float32)
        else:
            ref = gguf.quants.dequantize(blocks, qt).astype(np.float32)
        assert np.all(np.isfinite(ref)), name
        blocks.tofile(os.path.join(HERE, name + ".blocks"))
        ref.reshape(-1).astype("<f4").tofile(os.path.join(HERE, name + ".f32"))
        print(f"{name}: {N_BLOCKS} blocks of {bsize} bytes, {ref.size} values")


if __name__ == "__main__":
    main()
