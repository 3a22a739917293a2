"""same_weights.py AWQ_DIR CT_DIR — checks that the AutoAWQ checkpoint and the
compressed-tensors checkpoint `flotilla quantize` wrote from the same model,
calibration file and options decode to the same weights, exactly: every
linear dequantized in float64 from each format's documented layout, every
other tensor byte for byte. numpy only (tests/test_quantize.sh runs it).

The layouts, read here independently of flotilla's loaders:
  AutoAWQ GEMM: qweight int32 [in, out/8] and qzeros int32 [in/group, out/8],
    8 nibbles a word, nibble k being output 8j + [0, 2, 4, 6, 1, 3, 5, 7][k]
    (AutoAWQ's AWQ_ORDER); scales f16 [in/group, out]; W = (q - z) * s.
  compressed-tensors pack-quantized (the package's pack_to_int32): weight_packed
    int32 [out, in/8], element 8j + k of a row in nibble k of word j, stored as
    the signed code plus 8; weight_zero_point int32 [ceil(out/8), in/group]
    packed the same way along the outputs (packed_dim=0); weight_scale
    [out, in/group]; weight_shape int64 [out, in]; W = (q - zp) * scale, the
    offsets of q and zp cancelling.
"""
import json
import struct
import sys

import numpy as np

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
DTYPES = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "BF16": "<u2"}


def read_safetensors(path):
    """name -> numpy array (BF16 as its raw uint16 bits)."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def as_f64(a):
    if a.dtype == np.uint16:  # BF16 bits
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def nibbles(words):
    """int32 [r, c] -> uint8 [r, 8c], nibble k of word j at column 8j + k."""
    w = words.view(np.uint32)
    return np.stack([(w >> (4 * k)) & 0xF for k in range(8)], axis=-1).reshape(w.shape[0], -1).astype(np.uint8)


def awq_unpack(words, n_out):
    """AutoAWQ GEMM words [rows, n_out/8] -> codes [rows, n_out]."""
    w = words.view(np.uint32)
    out = np.zeros((w.shape[0], n_out), np.uint8)
    for k in range(8):
        out[:, AWQ_ORDER[k]::8] = (w >> (4 * k)) & 0xF
    return out


def awq_dequant(qweight, qzeros, scales):
    """-> float64 W [out, in]."""
    n_in, n_out = qweight.shape[0], scales.shape[1]
    group = n_in // scales.shape[0]
    q = awq_unpack(qweight, n_out).astype(np.float64)
    z = np.repeat(awq_unpack(qzeros, n_out).astype(np.float64), group, axis=0)
    s = np.repeat(scales.astype(np.float64), group, axis=0)
    return ((q - z) * s).T


def ct_dequant(packed, scale, zero_point, shape):
    """-> float64 W [out, in]."""
    n_out, n_in = int(shape[0]), int(shape[1])
    group = n_in // scale.shape[1]
    q = nibbles(packed)[:, :n_in].astype(np.float64)
    z = nibbles(zero_point.T.copy()).T[:n_out].astype(np.float64)  # packed along the outputs
    return (q - np.repeat(z, group, axis=1)) * np.repeat(as_f64(scale), group, axis=1)


def decode(path):
    """model.safetensors of either format -> {name: float64 weight or raw array}."""
    st = read_safetensors(path)
    out = {}
    for name, t in st.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            out[p + ".weight"] = awq_dequant(t, st[p + ".qzeros"], st[p + ".scales"])
        elif name.endswith(".weight_packed"):
            p = name[: -len(".weight_packed")]
            out[p + ".weight"] = ct_dequant(t, st[p + ".weight_scale"], st[p + ".weight_zero_point"],
                                            st[p + ".weight_shape"])
        elif not name.endswith((".qzeros", ".scales", ".weight_scale", ".weight_zero_point", ".weight_shape")):
            out[name] = t
    return out


def compare_logits(fl_path, ref, what, out_ref=None):
    """flotilla's float32 logits (fl_path) against a reference [positions, vocab]:
    prints the worst position's max |diff| / max |ref| after `what`, writes the
    reference as float32 to out_ref when given; -> exit status (0: <= 1e-4)."""
    got = np.fromfile(fl_path, dtype="<f4").reshape(ref.shape)
    rel = (np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)).max()
    print(f"{what}; flotilla vs transformers: max rel err {rel:.2e} over {ref.shape[0]} positions")
    if out_ref:
        ref.astype("<f4").tofile(out_ref)
    return 0 if rel <= 1e-4 else 1


def check_same(awq_dir, ct_dir):
    """Asserts both checkpoints decode to the same tensors; -> a line saying so."""
    a = decode(awq_dir + "/model.safetensors")
    c = decode(ct_dir + "/model.safetensors")
    assert sorted(a) == sorted(c), f"different tensors: {sorted(set(a) ^ set(c))}"
    n_lin = 0
    for name in a:
        assert a[name].shape == c[name].shape and np.array_equal(a[name], c[name]), f"{name} differs"
        n_lin += a[name].dtype == np.float64
    return f"{n_lin} linears decode to the same weights in both formats; {len(a) - n_lin} other tensors equal"


def main():
    print(check_same(sys.argv[1], sys.argv[2]))

if __name__ == "__main__":
    main()
