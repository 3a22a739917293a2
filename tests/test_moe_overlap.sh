#!/usr/bin/env bash
# test_moe_overlap.sh FLOTILLA SRC — the two-micro-batch MoE exchange
# (runtime/model/forward_moe.c, FL_MOE_OVERLAP) on the CPU backend under mpirun.
# With dp > 1 the MoE layers exchange routed tokens all-to-all; FL_MOE_OVERLAP
# 0 (default) runs one exchange each way, 1 two micro-batches (the rows for
# each rank's first / second half of its experts; on the CPU in program
# order, as 2 does everywhere). Every expert sees the same rows in the same
# order, so the logits must be bitwise equal across modes — and within 1e-5
# relative of one rank.
# Covered: ep 2 and 4 (2 and 1 experts per micro-batch), odd row counts (11
# and 3 tokens), one token (micro-batches and ranks with no rows; with tp 2 a
# tp rank with no rows; with dp 2 an idle replica), greedy generate equal
# to one rank in modes on and alternate (off and on by turns, step by
# step), a mode set on one rank only (the group agrees on one exchange,
# nothing hangs), bad values refused, and bench's MoE exchange fields
# (alternate: off and on steps of one run, the fraction hidden).
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
. "$src/tests/lib.sh" # fl_byte_model (its counters are redefined below, the same)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
# Open MPI keeps allocations LeakSanitizer cannot attribute (see tests/CMakeLists.txt)
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
unset FL_MOE_OVERLAP
# generous: under ASan on a 2-core CI machine one bench run takes ~100 s
mpi() { timeout 360 mpirun --oversubscribe --bind-to none -np "$@"; }
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   - $1"; }
bad() { fail=$((fail + 1)); echo "FAIL - $1"; }

# cmp.py REF A [B...]: A, B... bitwise equal to each other and within 1e-5
# relative (per position, max |diff| / max |ref|) of REF
cat >"$tmp/cmp.py" <<'PY'
import array, sys
V = int(sys.argv[1])
def load(p):
    a = array.array("f")
    a.frombytes(open(p, "rb").read())
    return a
ref, runs = load(sys.argv[2]), [load(p) for p in sys.argv[3:]]
for i, r in enumerate(runs):
    assert len(r) == len(ref) and len(r) % V == 0 and len(r) > 0, (i, len(r), len(ref))
    if r.tobytes() != runs[0].tobytes():
        sys.exit(f"mode run {i} differs from mode run 0 (not bitwise)")
worst = 0.0
for t in range(len(ref) // V):
    ra, rb = ref[t * V:(t + 1) * V], runs[0][t * V:(t + 1) * V]
    den = max(abs(x) for x in ra) or 1.0
    worst = max(worst, max(abs(x - y) for x, y in zip(ra, rb)) / den)
print(f"modes bitwise equal, max rel diff to one rank {worst:.2e}")
sys.exit(0 if worst <= 1e-5 else 1)
PY

echo '[7, 100, 33, 250, 1, 99, 42, 180, 5, 77, 13]' >"$tmp/ids11.json"
echo '[42, 7, 250]' >"$tmp/ids3.json"
echo '[99]' >"$tmp/ids1.json"
# fixture np,tp,ep input  (dp = np / tp > 1 everywhere)
cases="mixtral,4,2,4,ids11 mixtral,4,2,4,ids1 qwen3_moe,4,1,4,ids3 qwen2_moe,2,1,2,ids11
deepseek_v2,4,2,4,ids3 deepseek_v2,2,1,2,ids1"
for c in $cases; do
  IFS=, read -r fx np tp ep ids <<<"$c"
  model=$src/tests/golden/$fx
  V=$(python3 -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")
  name="$fx np=$np tp=$tp dp=$((np / tp)) ep=$ep, $ids"
  "$fl" logits --model "$model" --input-ids "$tmp/$ids.json" --output "$tmp/one.f32" --backend cpu \
    >"$tmp/log" 2>&1 || { bad "$name: single rank: $(tail -3 "$tmp/log")"; continue; }
  outs=()
  failed=
  for mode in 0 1; do # 2 (serial) runs the same calls as 1 on the CPU
    rm -f "$tmp/m$mode.f32"
    if ! FL_MOE_OVERLAP=$mode mpi "$np" -x FL_MOE_OVERLAP "$fl" logits --model "$model" \
         --input-ids "$tmp/$ids.json" --output "$tmp/m$mode.f32" --backend cpu --tp "$tp" --ep "$ep" \
         --dp $((np / tp)) >"$tmp/log" 2>&1; then
      failed="FL_MOE_OVERLAP=$mode: $(tail -3 "$tmp/log")"
      break
    fi
    outs+=("$tmp/m$mode.f32")
  done
  if [ -z "$failed" ] && msg=$(python3 "$tmp/cmp.py" "$V" "$tmp/one.f32" "${outs[@]}" 2>&1); then
    ok "$name: FL_MOE_OVERLAP 0/1 ($msg)"
  else
    bad "$name: ${failed:-$msg}"
  fi
done

# more micro-batches (ep 2: 4 experts per rank, so 3 and 4 split them):
# bitwise the logits of one exchange; a count outside 2..8 is refused
model=$src/tests/golden/qwen2_moe
V=$(python3 -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")
largs=(logits --model "$model" --input-ids "$tmp/ids11.json" --backend cpu --tp 1 --ep 2 --dp 2)
"$fl" logits --model "$model" --input-ids "$tmp/ids11.json" --output "$tmp/one.f32" --backend cpu >/dev/null 2>&1
FL_MOE_OVERLAP=0 mpi 2 -x FL_MOE_OVERLAP "$fl" "${largs[@]}" --output "$tmp/off.f32" >"$tmp/log" 2>&1
for nmb in 3 4; do
  rm -f "$tmp/n.f32"
  if FL_MOE_OVERLAP=1 FL_MOE_MICRO_BATCHES=$nmb mpi 2 -x FL_MOE_OVERLAP -x FL_MOE_MICRO_BATCHES "$fl" "${largs[@]}" --output "$tmp/n.f32" \
       >"$tmp/log" 2>&1 && msg=$(python3 "$tmp/cmp.py" "$V" "$tmp/one.f32" "$tmp/off.f32" "$tmp/n.f32" 2>&1); then
    ok "qwen2_moe ep 2, FL_MOE_MICRO_BATCHES=$nmb vs off ($msg)"
  else
    bad "qwen2_moe FL_MOE_MICRO_BATCHES=$nmb: $(tail -3 "$tmp/log") ${msg:-}"
  fi
done
FL_MOE_MICRO_BATCHES=9 mpi 2 -x FL_MOE_MICRO_BATCHES "$fl" "${largs[@]}" --output "$tmp/x.f32" >"$tmp/log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "FL_MOE_MICRO_BATCHES=9: must be 2 to 8" "$tmp/log"; then
  ok "FL_MOE_MICRO_BATCHES=9 refused (rc=$rc)"
else
  bad "FL_MOE_MICRO_BATCHES=9 (rc=$rc): $(cat "$tmp/log")"
fi

# greedy generate: overlap on and off give the one-rank text (byte tokenizer)
mdir=$tmp/mixtral
fl_byte_model "$src" mixtral "$mdir"
cat >"$tmp/req.jsonl" <<'JSONL'
{"custom_id": "a", "body": {"prompt": "Hello world, this is", "max_tokens": 9}}
{"custom_id": "b", "body": {"prompt": "abc", "max_tokens": 12}}
{"custom_id": "c", "body": {"prompt": "The quick brown fox", "max_tokens": 5}}
JSONL
rm -f "$tmp/g1.jsonl"
if "$fl" generate --output-format compact --model "$mdir" --input "$tmp/req.jsonl" --output "$tmp/g1.jsonl" --backend cpu >"$tmp/log" 2>&1; then
  for mode in 1 3; do
    rm -f "$tmp/gn.jsonl"
    FL_MOE_OVERLAP=$mode mpi 4 -x FL_MOE_OVERLAP "$fl" generate --output-format compact --model "$mdir" --input "$tmp/req.jsonl" \
      --output "$tmp/gn.jsonl" --backend cpu --tp 2 --ep 4 --dp 2 >"$tmp/log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && [ -s "$tmp/gn.jsonl" ] && [ "$(sort "$tmp/gn.jsonl")" = "$(sort "$tmp/g1.jsonl")" ]; then
      ok "mixtral generate tp 2 dp 2 ep 4, FL_MOE_OVERLAP=$mode, equals 1 rank"
    else
      bad "mixtral generate FL_MOE_OVERLAP=$mode (rc=$rc): $(tail -3 "$tmp/log") / $(cat "$tmp/gn.jsonl" 2>/dev/null)"
    fi
  done
else
  bad "mixtral generate on one rank: $(cat "$tmp/log")"
fi

# one rank asks for one micro-batch, the other for two: they agree on one
model=$src/tests/golden/qwen3_moe
V=$(python3 -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")
args=(logits --model "$model" --input-ids "$tmp/ids11.json" --backend cpu --tp 1 --ep 2 --dp 2)
"$fl" logits --model "$model" --input-ids "$tmp/ids11.json" --output "$tmp/one.f32" --backend cpu >/dev/null 2>&1
rm -f "$tmp/mixed.f32"
if timeout 120 mpirun --oversubscribe --bind-to none -np 1 env FL_MOE_OVERLAP=0 "$fl" "${args[@]}" \
     --output "$tmp/mixed.f32" : -np 1 env FL_MOE_OVERLAP=1 "$fl" "${args[@]}" --output "$tmp/mixed.f32" \
     >"$tmp/log" 2>&1 && msg=$(python3 "$tmp/cmp.py" "$V" "$tmp/one.f32" "$tmp/mixed.f32" 2>&1); then
  ok "FL_MOE_OVERLAP 0 on one rank, 1 on the other: agreed, no hang ($msg)"
else
  bad "mixed FL_MOE_OVERLAP: $(tail -3 "$tmp/log") ${msg:-}"
fi

# a bad value fails the job on every rank, naming the variable (a hang would
# end in the timeout: rc 124)
FL_MOE_OVERLAP=maybe mpi 2 -x FL_MOE_OVERLAP "$fl" "${args[@]}" --output "$tmp/x.f32" >"$tmp/log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "FL_MOE_OVERLAP=maybe: expected off|on|serial|alternate" "$tmp/log"; then
  ok "FL_MOE_OVERLAP=maybe refused (rc=$rc)"
else
  bad "FL_MOE_OVERLAP=maybe (rc=$rc): $(cat "$tmp/log")"
fi
# only one rank's value is bad: the other must not hang in the exchange
rm -f "$tmp/x.f32"
timeout 120 mpirun --oversubscribe --bind-to none -np 1 env FL_MOE_OVERLAP=2 "$fl" "${args[@]}" \
  --output "$tmp/x.f32" : -np 1 env FL_MOE_OVERLAP=x "$fl" "${args[@]}" --output "$tmp/x.f32" >"$tmp/log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "FL_MOE_OVERLAP" "$tmp/log"; then
  ok "FL_MOE_OVERLAP=x on one rank: the job ends (rc=$rc)"
else
  bad "FL_MOE_OVERLAP=x on one rank (rc=$rc): $(cat "$tmp/log")"
fi

# bench: the exchange's fields, each mode (numbers meaningless on the CPU)
check() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1"; }
for mode in on off; do
  rm -f "$tmp/b.json"
  if mpi 2 "$fl" bench --preset tiny-moe --backend cpu --gen-len 5 --batch 3 --tp 1 --dp 2 --ep 2 \
       --moe-overlap $mode --output "$tmp/b.json" >"$tmp/b.out" 2>&1 &&
     check "$tmp/b.json" "j['moe_overlap']=='$mode' and j['moe_overlap_events'] is False and \
j['moe_exchange_layers_per_step']==j['layers'] and j['moe_exchange_ms_per_step']>0 and \
j['moe_control_ms_per_step']>0 and j['moe_micro_batches']==(1 if '$mode'=='off' else 2)" &&
     grep -q "moe exchange ($mode, in order, " "$tmp/b.out"; then
    ok "bench --moe-overlap $mode: exchange fields ($(grep 'moe exchange' "$tmp/b.out"))"
  else
    bad "bench --moe-overlap $mode: $(cat "$tmp/b.out") $(cat "$tmp/b.json" 2>/dev/null)"
  fi
done
# alternate: off and on decode steps by turns in one run, both timed
if mpi 2 "$fl" bench --preset tiny-moe --backend cpu --gen-len 9 --batch 3 --tp 1 --dp 2 --ep 2 \
     --moe-overlap alternate --output "$tmp/b.json" >"$tmp/b.out" 2>&1 &&
   check "$tmp/b.json" "j['moe_overlap']=='alternate' and j['moe_steps_off']>=3 and j['moe_steps_on']>=3 and \
j['moe_steps_off']+j['moe_steps_on']==j['decode_steps'] and j['moe_step_ms_off']>0 and j['moe_step_ms_on']>0 and \
j['moe_exchange_ms_per_step']>0 and abs(j['moe_exchange_hidden_fraction'] - (j['moe_step_ms_off']-j['moe_step_ms_on'])/j['moe_exchange_ms_per_step']) <= 1e-3 * (1 + abs(j['moe_exchange_hidden_fraction']))" &&
   grep -q "moe overlap: .* off steps .* on steps .* of the exchange hidden" "$tmp/b.out"; then
  ok "bench --moe-overlap alternate: $(grep 'moe overlap:' "$tmp/b.out")"
else
  bad "bench --moe-overlap alternate: $(cat "$tmp/b.out") $(cat "$tmp/b.json" 2>/dev/null)"
fi
# ep 1 (each rank all 4 experts, the exchange within itself): 3 micro-batches
if FL_MOE_MICRO_BATCHES=3 mpi 2 -x FL_MOE_MICRO_BATCHES "$fl" bench --preset tiny-moe --backend cpu --gen-len 4 \
     --batch 3 --tp 1 --dp 2 --ep 1 --moe-overlap on --output "$tmp/b.json" >"$tmp/b.out" 2>&1 &&
   check "$tmp/b.json" "j['moe_micro_batches']==3 and j['moe_overlap']=='on'"; then
  ok "bench FL_MOE_MICRO_BATCHES=3 with 4 experts per rank: 3 micro-batches"
else
  bad "bench FL_MOE_MICRO_BATCHES=3: $(cat "$tmp/b.out") $(cat "$tmp/b.json" 2>/dev/null)"
fi
if "$fl" bench --preset tiny-moe --backend cpu --gen-len 3 --output "$tmp/b1.json" >"$tmp/b.out" 2>&1 &&
   check "$tmp/b1.json" "j['moe_overlap'] is None and j['moe_exchange_ms_per_step'] is None"; then
  ok "bench on one rank: no exchange, fields null"
else
  bad "bench one rank: $(cat "$tmp/b.out")"
fi
if "$fl" bench --preset tiny-moe --backend cpu --moe-overlap sometimes >"$tmp/b.out" 2>&1; then
  bad "bench --moe-overlap sometimes accepted"
elif grep -q "moe-overlap must be off | on | serial | alternate, got 'sometimes'" "$tmp/b.out"; then
  ok "bench --moe-overlap sometimes refused"
else
  bad "bench --moe-overlap sometimes: $(cat "$tmp/b.out")"
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
