"""kquant_quantize.py — simple numpy quantizers for ggml's K-quant and IQ4
blocks, used only to build test models (gguf-py can decode these kinds but
not encode them).

Each quantizer takes float32 rows [n, k*block] and returns uint8 blocks
[n, k*bytes] in ggml's layout. They pick scales by plain min/max rules rather
than llama.cpp's error-minimizing search, so they are a little less accurate
than llama-quantize, but every block they write is a valid block that
gguf-py's dequantize (and ggml) decodes. roundtrip_check() verifies each one
against gguf-py so a packing mistake cannot go unnoticed.
"""
import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

QK_K = 256
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def f16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def f16_bytes(x):
    return f16(x).reshape(-1, 1).view(np.uint8)


def safe_div(a, b):
    return np.where(b != 0, a / np.where(b != 0, b, 1), 0)


def affine_subblocks(x, levels, scale_bits):
    """x [n, S, L] -> (d, dmin as f16, sc, m codes [n, S], q [n, S, L]) for
    value = (d*sc) * q - (dmin*m), q in 0..levels."""
    mn = np.minimum(x.min(-1), 0)
    mx = x.max(-1)
    scale = (mx - mn) / levels
    mins = -mn
    top = (1 << scale_bits) - 1
    d = f16(scale.max(-1) / top).astype(np.float32)
    dmin = f16(mins.max(-1) / top).astype(np.float32)
    sc = np.clip(np.rint(safe_div(scale, d[:, None])), 0, top).astype(np.uint8)
    m = np.clip(np.rint(safe_div(mins, dmin[:, None])), 0, top).astype(np.uint8)
    ds = (d[:, None] * sc.astype(np.float32))[..., None]
    dm = (dmin[:, None] * m.astype(np.float32))[..., None]
    q = np.clip(np.rint(safe_div(x + dm, ds)), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def symmetric_subblocks(x, qmax, scale_max):
    """value = (d*sc) * q, q in -qmax-1..qmax, sc in -scale_max..scale_max."""
    amax_i = np.abs(x).argmax(-1)
    peak = np.take_along_axis(x, amax_i[..., None], -1)[..., 0]
    scale = -peak / (qmax + 1)  # the extreme maps to -(qmax + 1), like ggml
    d = f16(np.abs(scale).max(-1) / scale_max).astype(np.float32)
    sc = np.clip(np.rint(safe_div(scale, d[:, None])), -scale_max, scale_max).astype(np.int8)
    ds = (d[:, None] * sc.astype(np.float32))[..., None]
    q = np.clip(np.rint(safe_div(x, ds)), -qmax - 1, qmax).astype(np.int16)
    return d, sc, q


def pack_k4_scales(sc, m):
    """8 six-bit scales and mins -> 12 bytes (inverse of Q4_K.get_scale_min)."""
    s = np.zeros(sc.shape[:-1] + (12,), dtype=np.uint8)
    s[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    s[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return s


def pack_nibbles_32(q):
    """q [n, 256] -> qs [n, 128]: byte 32c + l = q[64c + l] | q[64c + 32 + l] << 4."""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128).astype(np.uint8)


def pack_2bit(q):
    """q [n, 256] in 0..3 -> [n, 64]: byte 32h + l, bits 2j = q[128h + 32j + l]."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    out = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for j in range(4):
        out |= q[:, :, j, :] << (2 * j)
    return out.reshape(-1, 64)


def pack_bitplanes(bits):
    """bits [n, 256] in 0..1 -> [n, 32]: byte l, bit b = bits[32b + l]."""
    bits = bits.reshape(-1, 8, 32).astype(np.uint8)
    out = np.zeros((bits.shape[0], 32), dtype=np.uint8)
    for b in range(8):
        out |= bits[:, b, :] << b
    return out


def q2_k(x):
    x = x.reshape(-1, 16, 16)
    d, dmin, sc, m, q = affine_subblocks(x, 3, 4)
    return np.concatenate([sc | (m << 4), pack_2bit(q.reshape(-1, 256)), f16_bytes(d), f16_bytes(dmin)], -1)


def q3_k(x):
    x = x.reshape(-1, 16, 16)
    d, sc, q = symmetric_subblocks(x, 3, 31)
    u = (q + 4).reshape(-1, 256).astype(np.uint8)  # 0..7: low 2 bits + the hmask bit
    s6 = (sc.astype(np.int16) + 32).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    for k in range(16):
        scales[:, k % 8] |= (s6[:, k] & 15) << (4 * (k // 8))
        scales[:, 8 + k % 4] |= (s6[:, k] >> 4) << (2 * (k // 4))
    return np.concatenate([pack_bitplanes(u >> 2), pack_2bit(u & 3), scales, f16_bytes(d)], -1)


def q4_k(x):
    d, dmin, sc, m, q = affine_subblocks(x.reshape(-1, 8, 32), 15, 6)
    return np.concatenate([f16_bytes(d), f16_bytes(dmin), pack_k4_scales(sc, m), pack_nibbles_32(q.reshape(-1, 256))], -1)


def q5_k(x):
    d, dmin, sc, m, q = affine_subblocks(x.reshape(-1, 8, 32), 31, 6)
    q = q.reshape(-1, 256)
    return np.concatenate([f16_bytes(d), f16_bytes(dmin), pack_k4_scales(sc, m), pack_bitplanes(q >> 4),
                           pack_nibbles_32(q & 15)], -1)


def q6_k(x):
    d, sc, q = symmetric_subblocks(x.reshape(-1, 16, 16), 31, 127)
    u = (q + 32).reshape(-1, 2, 2, 64).astype(np.uint8)  # [n, half, 64-group, l]
    ql = (u[:, :, 0, :] & 15) | ((u[:, :, 1, :] & 15) << 4)
    hi = (u >> 4).reshape(-1, 2, 4, 32)
    qh = np.zeros((u.shape[0], 2, 32), dtype=np.uint8)
    for k in range(4):
        qh |= hi[:, :, k, :] << (2 * k)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), f16_bytes(d)], -1)


def q8_k(x):
    x = x.reshape(-1, 256)
    amax_i = np.abs(x).argmax(-1)
    peak = np.take_along_axis(x, amax_i[:, None], -1)[:, 0]
    d = (-peak / 128).astype(np.float32)
    q = np.clip(np.rint(safe_div(x, d[:, None])), -128, 127).astype(np.int8)
    bsums = q.reshape(-1, 16, 16).astype(np.int16).sum(-1).astype(np.int16)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)], -1)


def iq4_codes(x, dl):
    """nearest IQ4 level of x / dl: x [..., L], dl [..., 1]."""
    r = safe_div(x, dl)
    return np.abs(r[..., None] - IQ4_LEVELS).argmin(-1).astype(np.uint8)


def iq4_nl(x):
    x = x.reshape(-1, 32)
    amax_i = np.abs(x).argmax(-1)
    peak = np.take_along_axis(x, amax_i[:, None], -1)[:, 0]
    d = f16(peak / -127.0).astype(np.float32)
    q = iq4_codes(x, d[:, None])
    return np.concatenate([f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], -1)


def iq4_xs(x):
    x = x.reshape(-1, 8, 32)
    amax_i = np.abs(x).argmax(-1)
    peak = np.take_along_axis(x, amax_i[..., None], -1)[..., 0]
    scale = peak / -127.0
    d = f16(np.abs(scale).max(-1) / 31).astype(np.float32)
    sc = np.clip(np.rint(safe_div(scale, d[:, None])), -32, 31).astype(np.int16)
    q = iq4_codes(x, (d[:, None] * sc.astype(np.float32))[..., None])
    s6 = (sc + 32).astype(np.uint16)
    sh = np.zeros(x.shape[0], dtype=np.uint16)
    for j in range(8):
        sh |= (s6[:, j] >> 4) << (2 * j)
    s6 = s6.astype(np.uint8)
    sl = (s6[:, 0::2] & 15) | ((s6[:, 1::2] & 15) << 4)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(-1, 128)
    return np.concatenate([f16_bytes(d), sh.reshape(-1, 1).view(np.uint8), sl, qs], -1)


QUANTIZERS = {QT.Q2_K: q2_k, QT.Q3_K: q3_k, QT.Q4_K: q4_k, QT.Q5_K: q5_k, QT.Q6_K: q6_k, QT.Q8_K: q8_k,
              QT.IQ4_NL: iq4_nl, QT.IQ4_XS: iq4_xs}


def quantize(w, qt):
    """w float32 [rows, cols] -> uint8 [rows, row_bytes] of kind qt."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    blocks = QUANTIZERS[qt](w.reshape(-1, gguf.GGML_QUANT_SIZES[qt][0]))
    return blocks.reshape(w.shape[0], -1).astype(np.uint8)


def dequantize(q, qt, shape):
    """The reference decode: gguf-py's, except Q8_K (which gguf-py lacks):
    ggml's dequantize_row_q8_K, d * q in f32."""
    if qt == QT.Q8_K:
        b = q.reshape(-1, 292)
        d = b[:, 0:4].copy().view(np.float32)
        return (d * b[:, 4:260].copy().view(np.int8).astype(np.float32)).reshape(shape)
    return gguf.quants.dequantize(q, qt).reshape(shape).astype(np.float32)


def roundtrip_check(rng):
    """Each quantizer's error must be a fraction of a step: a wrong bit
    position would make it O(1)."""
    x = rng.standard_normal((4, 512)).astype(np.float32)
    bound = {QT.Q2_K: 1.3, QT.Q3_K: 0.8, QT.Q4_K: 0.25, QT.Q5_K: 0.12, QT.Q6_K: 0.06, QT.Q8_K: 0.02,
             QT.IQ4_NL: 0.35, QT.IQ4_XS: 0.35}
    for qt, f in QUANTIZERS.items():
        y = dequantize(quantize(x, qt), qt, x.shape)
        err = np.abs(y - x).max()
        assert err < bound[qt], f"{qt.name}: round-trip error {err}"
