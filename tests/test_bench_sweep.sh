#!/usr/bin/env bash
# test_bench_sweep.sh — `flotilla bench --workload --sweep-concurrency`:
# one CSV row per (input length, concurrency) point, each point's requests
# all completed, concurrency bounded by the point's, the Pareto column true
# exactly where no other point has at least the throughput and at most the
# median per-token latency; scripts/plot-sweep.sh draws it as a PNG; bad
# lists are named.
# Usage: test_bench_sweep.sh FLOTILLA SOURCE_DIR
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
wl() { "$fl" bench --workload --preset tiny --layers 1 --backend cpu --max-model-len 256 "$@"; }

if wl --num-prompts 8 --input-len 16 --output-len 6 --sweep-concurrency 1,4,8 --sweep-input-len 16,48 \
     --sweep-csv "$T/sweep.csv" >"$T/sweep.out" 2>&1 &&
   python3 - "$T/sweep.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [(int(r["input_len"]), int(r["max_concurrency"])) for r in rows] == \
    [(16, 1), (16, 4), (16, 8), (48, 1), (48, 4), (48, 8)], rows
for r in rows:
    assert int(r["requests"]) == int(r["completed"]) == 8, r
    assert 1 <= int(r["peak_running"]) <= int(r["max_concurrency"]), r
    assert float(r["output_tok_s"]) > 0 and float(r["total_tok_s"]) > float(r["output_tok_s"]), r
    assert float(r["tpot_p50_ms"]) <= float(r["tpot_p99_ms"]) and float(r["ttft_p50_ms"]) <= float(r["ttft_p99_ms"]), r
    assert float(r["prefix_hit_rate"]) == 0, r  # each point draws its own prompts
# concurrency 1 runs one request at a time
assert all(int(r["peak_running"]) == 1 for r in rows if r["max_concurrency"] == "1")
def beats(a, b):
    ta, tb = float(a["output_tok_s"]), float(b["output_tok_s"])
    la, lb = float(a["tpot_p50_ms"]), float(b["tpot_p50_ms"])
    return ta >= tb and la <= lb and (ta > tb or la < lb)
for r in rows:
    front = not any(beats(o, r) for o in rows if o is not r)
    assert (r["pareto"] == "1") == front, (r, front)
assert any(r["pareto"] == "1" for r in rows)
PY
then
  ok "sweep: 6 points, every request completed, concurrency bounded, Pareto column right"
else
  bad "sweep"; cat "$T/sweep.out"; cat "$T/sweep.csv" 2>/dev/null
fi
if grep -q "sweep: 6 points written to" "$T/sweep.out"; then ok "sweep summary"; else bad "sweep summary"; fi

fl_check_plot "$src/scripts/plot-sweep.sh" "$T/sweep.csv" "$T/sweep.png" "$T/sweep.out" "is not a --sweep-csv file" "$T"

for bad_args in "--sweep-concurrency 0,4:positive integers" "--sweep-concurrency 1,:ends with a comma" \
                "--sweep-concurrency 1,x:positive integers" "--sweep-concurrency 4:needs --sweep-csv" \
                "--sweep-input-len 8 --sweep-csv $T/x.csv:needs --sweep-concurrency"; do
  args=${bad_args%%:*} want=${bad_args#*:}
  # shellcheck disable=SC2086
  if ! wl --num-prompts 2 $args >"$T/bad.out" 2>&1 && grep -q -- "$want" "$T/bad.out"; then
    ok "refused: $args"
  else
    bad "not refused as '$want': $args"; cat "$T/bad.out"
  fi
done
if ! "$fl" bench --preset tiny --backend cpu --sweep-concurrency 1 --sweep-csv "$T/x.csv" >"$T/bad.out" 2>&1 &&
   grep -q -- "--sweep-concurrency applies to --workload only" "$T/bad.out"; then
  ok "refused without --workload"
else
  bad "sweep without --workload"; cat "$T/bad.out"
fi
finish
