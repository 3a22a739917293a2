#!/usr/bin/env bash
# test_scaling_table.sh — the scaling table of scripts/gpu-scaling.sh
# (scripts/scaling-table.py, scripts/plot-scaling.sh) from real `flotilla
# bench` JSON: the tiny dense preset on one rank and at tp 2, the tiny MoE
# preset on one rank and at tp 2 / ep 2 (mpirun, CPU backend). One row per
# multi-rank run with its one-rank partner (a run without one is left out),
# speed-up and efficiency from the two runs' tokens/s, the CSV and the PNG;
# an empty folder and a foreign CSV are refused by name.
# Usage: test_scaling_table.sh FLOTILLA SOURCE_DIR
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
fl_mpi_env
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
b() { timeout 120 "$fl" bench --backend cpu --layers 2 --batch 4 --gen-len 8 "$@"; }
m() { timeout 180 mpirun -np 2 "$fl" bench --backend cpu --layers 2 --batch 4 --gen-len 8 "$@"; }

if b --preset tiny --output "$T/np1-tiny-none-b4.json" >"$T/b1.out" 2>&1 &&
   m --preset tiny --tp 2 --output "$T/np2-tiny-none-b4-ep1.json" >"$T/b2.out" 2>&1 &&
   b --preset tiny-moe --output "$T/np1-tiny-moe-none-b4.json" >"$T/b3.out" 2>&1 &&
   m --preset tiny-moe --tp 2 --ep 2 --output "$T/np2-tiny-moe-none-b4-ep2.json" >"$T/b4.out" 2>&1; then
  ok "bench: tiny and tiny-moe on 1 rank and on 2"
else
  bad "bench runs"; tail -5 "$T"/b*.out
fi
# a multi-rank run whose one-rank run is missing
cp "$T/np2-tiny-none-b4-ep1.json" "$T/np2-orphan.json"
python3 - "$T/np2-orphan.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); j["batch"] = 64; json.dump(j, open(sys.argv[1], "w"))
PY

if python3 "$src/scripts/scaling-table.py" "$T" 2 --csv "$T/scaling.csv" >"$T/table.md" 2>"$T/table.err" &&
   [ "$(grep -c '^| tiny' "$T/table.md")" = 2 ] &&
   python3 - "$T" <<'PY'
import csv, json, sys
d = sys.argv[1]
rows = list(csv.DictReader(open(f"{d}/scaling.csv")))
# in file-name order: np2-tiny-moe-... before np2-tiny-none-...
assert [(r["preset"], r["ep"]) for r in rows] == [("tiny-moe", "2"), ("tiny", "1")], rows
for r, one, two in ((rows[0], "np1-tiny-moe-none-b4", "np2-tiny-moe-none-b4-ep2"),
                    (rows[1], "np1-tiny-none-b4", "np2-tiny-none-b4-ep1")):
    a, b = json.load(open(f"{d}/{one}.json")), json.load(open(f"{d}/{two}.json"))
    s = b["decode_tok_s"] / a["decode_tok_s"]
    assert abs(float(r["tok_s_1"]) - a["decode_tok_s"]) <= 1e-5 * a["decode_tok_s"], r
    assert abs(float(r["tok_s_np"]) - b["decode_tok_s"]) <= 1e-5 * b["decode_tok_s"], r
    assert abs(float(r["speedup"]) - s) <= 1e-5 * s and abs(float(r["efficiency"]) - s / 2) <= 1e-5 * s, r
    assert r["np"] == "2" and r["batch"] == "4" and r["allreduce"] == "compute", r
    assert float(r["allreduce_us"]) > 0 and float(r["allreduce_busbw_GBps"]) > 0, r
PY
then
  ok "table and CSV: one row per run with its one-rank partner, speed-up and efficiency from the JSON"
else
  bad "scaling-table.py"; cat "$T/table.md" "$T/table.err" "$T/scaling.csv" 2>/dev/null
fi

fl_check_plot "$src/scripts/plot-scaling.sh" "$T/scaling.csv" "$T/scaling.png" "$T/np1-tiny-none-b4.json" \
  "is not a scaling-table.py --csv file" "$T"

mkdir "$T/empty"
if ! python3 "$src/scripts/scaling-table.py" "$T/empty" 2 >"$T/e.out" 2>&1 && grep -q "in $T/empty has its np1 run" "$T/e.out"; then
  ok "an empty folder is refused by name"
else
  bad "empty folder"; cat "$T/e.out"
fi
finish
