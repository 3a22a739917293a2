#!/usr/bin/env bash
# test_swap_generate.sh FLOTILLA SRC — preemption by swap through `flotilla
# generate`: a job whose KV cache (--kv-cache-mb 1) is too small for its 32
# sequences completes with swaps (the summary says how many, and the bytes
# moved) and gives the same greedy outputs as a run with a large cache;
# with --swap-space 0 it preempts by recompute only, and with a tiny pool
# by both, with the same outputs again; over an int8 (and an fp8) KV cache,
# swaps with the same outputs as that cache at a large size. Then the same under mpirun -np 2
# with tp 2, where every rank swaps its shard of the same blocks. The
# golden Llama fixture runs with a byte-level tokenizer (one token per
# character). Prints "N passed, M failed". FL_TEST_BACKEND=cuda runs the
# one-rank checks on a GPU instead (the mpirun ones need two GPUs: skipped).
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$src/tests/lib.sh"
fl_mpi_env
be=${FL_TEST_BACKEND:-cpu}
mpi() { timeout 300 mpirun --oversubscribe --bind-to none -np "$@"; }

m=$tmp/llama
fl_byte_model "$src" llama "$m"

# 32 requests of 21..51 prompt tokens and 72 generated ones (EOS ignored):
# about 3600 tokens, where a 1 MiB cache holds 1365 on one rank (768 bytes
# a token) and 2730 on each of two tp ranks (one KV head each)
python3 - >"$tmp/req.jsonl" <<'PY'
import json
for i in range(32):
    p = f"Request {i:02d}: " + "tell me a story " * (1 + i % 3)
    print(json.dumps({"custom_id": f"r{i}", "body": {"prompt": p[:51], "max_tokens": 72, "ignore_eos": True}}))
PY

# summary.json -> "preemptions swap recompute out_bytes in_bytes"
counts() {
  python3 -c "import json; s=json.load(open('$1')); print(s['preemptions'], s['preemptions_swap'], s['preemptions_recompute'], int(s['swap_out_bytes']), int(s['swap_in_bytes']))" 2>/dev/null
}

req=$tmp/req.jsonl
run() { # name launcher-prefix... -- extra-args...
  local name=$1
  shift
  local pre=()
  while [ "$1" != -- ]; do pre+=("$1"); shift; done
  shift
  rm -f "$tmp/$name.jsonl"
  "${pre[@]}" "$fl" generate --output-format compact --model "$m" --backend "$be" --input "$req" \
    --output "$tmp/$name.jsonl" --summary "$tmp/$name.json" --max-num-seqs 64 --progress-interval 0.01 "$@" \
    >"$tmp/$name.log" 2>&1 || { bad "$name: generate failed: $(tail -5 "$tmp/$name.log")"; return 1; }
}

same() { [ -s "$tmp/$1.jsonl" ] && [ "$(sort "$tmp/$1.jsonl")" = "$(sort "$tmp/$2.jsonl")" ]; }

check() { # name reference want(swap|recompute|both) what
  local c
  c=$(counts "$tmp/$1.json")
  read -r n sw rc out in <<<"${c:-x x x x x}"
  local good=1
  case $3 in
    swap) [ "$sw" -gt 0 ] 2>/dev/null && [ "$out" -gt 0 ] && [ "$in" -gt 0 ] || good=0 ;;
    recompute) [ "$rc" -gt 0 ] 2>/dev/null && [ "$sw" -eq 0 ] && [ "$out" -eq 0 ] || good=0 ;;
    both) [ "$sw" -gt 0 ] 2>/dev/null && [ "$rc" -gt 0 ] || good=0 ;;
  esac
  if [ $good = 1 ] && [ $((sw + rc)) -eq "$n" ] && same "$1" "$2" &&
     [ "$(wc -l <"$tmp/$1.jsonl")" -eq "$(wc -l <"$tmp/$2.jsonl")" ]; then
    ok "$4: $n preemptions ($sw swap, $rc recompute), $out bytes out, $in in; outputs equal the large cache's"
  else
    bad "$4: counts '${c:-none}' (want $3), outputs $(same "$1" "$2" && echo equal || echo differ): $(tail -4 "$tmp/$1.log")"
  fi
}

run big -- --kv-cache-mb 64 &&
  { [ "$(counts "$tmp/big.json" | cut -d' ' -f1)" = 0 ] && ok "large cache: no preemption" ||
    bad "large cache preempted: $(counts "$tmp/big.json")"; }
run swap -- --kv-cache-mb 1 && check swap big swap "one rank, swap"
run recompute -- --kv-cache-mb 1 --swap-space 0 && check recompute big recompute "one rank, --swap-space 0"
# 0.00005 GiB: about 4 blocks of 12 KiB: some preemptions find no room
run tiny -- --kv-cache-mb 1 --swap-space 0.00005 && check tiny big both "one rank, tiny pool"

# the text summary and the progress lines
if grep -Eq '^  preemption  [0-9]+ \([1-9][0-9]* by swap, [0-9]+ by recompute\); swapped [0-9.]+ MiB out, [0-9.]+ MiB in$' "$tmp/swap.log" &&
   grep -Eq '^flotilla generate: progress .*, preempted [1-9][0-9]* \([0-9]+ swap, [0-9]+ recompute\)$' "$tmp/swap.log"; then
  ok "text summary and progress lines report preemptions ($(grep '^  preemption' "$tmp/swap.log"))"
else
  bad "preemptions in the text: $(cat "$tmp/swap.log")"
fi

# a bad value is refused, naming the flag
"$fl" generate --model "$m" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/x.jsonl" --swap-space lots >"$tmp/x.log" 2>&1
if [ $? -ne 0 ] && grep -q -- "--swap-space must be a number of GiB" "$tmp/x.log"; then
  ok "--swap-space lots refused ($(grep -m1 -- '--swap-space' "$tmp/x.log"))"
else
  bad "--swap-space lots: $(cat "$tmp/x.log")"
fi

# int8 KV (a quarter of f32's bytes a token, so 64 requests to fill 1 MiB):
# the host pool holds int8 records as they are
python3 - >"$tmp/req64.jsonl" <<'PY'
import json
for i in range(64):
    p = f"Request {i:02d}: " + "tell me a story " * (1 + i % 3)
    print(json.dumps({"custom_id": f"r{i}", "body": {"prompt": p[:51], "max_tokens": 72, "ignore_eos": True}}))
PY
req=$tmp/req64.jsonl
run big8 -- --kv-cache-mb 64 --kv-cache-dtype int8 &&
  run swap8 -- --kv-cache-mb 1 --kv-cache-dtype int8 && check swap8 big8 swap "one rank, int8 KV, swap"
# fp8 (e4m3 codes in the same records)
run bigf8 -- --kv-cache-mb 64 --kv-cache-dtype fp8 &&
  run swapf8 -- --kv-cache-mb 1 --kv-cache-dtype fp8 && check swapf8 bigf8 swap "one rank, fp8 KV, swap"
req=$tmp/req.jsonl

[ "$be" = cpu ] || { finish; exit; } # finish returns the verdict, exit ends here
# tp 2: each rank's shard holds 2730 tokens; the rank-0 plan moves both
# shards (tp 2 gives this fixture one rank's tokens, test_prefix_generate.sh)
run mpi_swap mpi 2 -- --tp 2 --kv-cache-mb 1 && check mpi_swap big swap "mpirun -np 2 tp 2, swap"
run mpi_recompute mpi 2 -- --tp 2 --kv-cache-mb 1 --swap-space 0 &&
  check mpi_recompute big recompute "mpirun -np 2 tp 2, --swap-space 0"

finish
