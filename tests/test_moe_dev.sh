#!/usr/bin/env bash
# test_moe_dev.sh FLOTILLA SRC — experts routed on the device
# (runtime/model/forward_moe_dev.c) against experts routed on the host
# (forward_moe.c), on the CPU backend. Both compute every pair's rows with the
# same matmul and add a token's experts in ascending expert order, so the
# logits must be bitwise equal (DeepSeek-V2's group-limited routing and
# shared experts included): one rank, and under mpirun with the experts
# split over ep ranks (each rank's moe_group keeps only its own experts) and
# their columns split over ex ranks (tp 4, ep 2). Also: a prefill longer than
# FL_MOE_DEVICE_MAX_N (host path) followed by device-routed decode gives the
# same greedy text as the host path throughout, and bad values are refused
# with the variable's name.
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
fl_mpi_env
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset FL_MOE_DEVICE FL_MOE_DEVICE_MAX_N
mpi() { timeout 360 mpirun --oversubscribe --bind-to none -np "$@"; }

echo '[7, 100, 33, 250, 1, 99, 42, 180, 5, 77, 13]' >"$tmp/ids11.json"
echo '[99]' >"$tmp/ids1.json"
# fixture np tp ep input (dp = 1)
cases="mixtral,1,1,1,ids11 mixtral,1,1,1,ids1 qwen2_moe,1,1,1,ids11 qwen3_moe,1,1,1,ids11
mixtral,2,2,2,ids11 qwen3_moe,4,4,4,ids11 qwen2_moe,4,4,2,ids11 mixtral,4,4,2,ids1
deepseek_v2,1,1,1,ids11 deepseek_v2_lite,1,1,1,ids11 deepseek_v2,2,2,2,ids11"
for c in $cases; do
  IFS=, read -r fx np tp ep ids <<<"$c"
  model=$src/tests/golden/$fx
  name="$fx np=$np tp=$tp ep=$ep $ids"
  failed=
  for dev in 0 1; do
    rm -f "$tmp/d$dev.f32"
    if [ "$np" = 1 ]; then
      FL_MOE_DEVICE=$dev "$fl" logits --model "$model" --input-ids "$tmp/$ids.json" --output "$tmp/d$dev.f32" \
        --backend cpu >"$tmp/log" 2>&1
    else
      FL_MOE_DEVICE=$dev mpi "$np" -x FL_MOE_DEVICE "$fl" logits --model "$model" --input-ids "$tmp/$ids.json" \
        --output "$tmp/d$dev.f32" --backend cpu --tp "$tp" --ep "$ep" >"$tmp/log" 2>&1
    fi
    rc=$?
    if [ $rc -ne 0 ] || [ ! -s "$tmp/d$dev.f32" ]; then
      failed="FL_MOE_DEVICE=$dev (rc=$rc): $(tail -3 "$tmp/log")"
      break
    fi
  done
  if [ -n "$failed" ]; then
    bad "$name: $failed"
  elif cmp -s "$tmp/d0.f32" "$tmp/d1.f32"; then
    ok "$name: device routing bitwise equal to host routing"
  else
    bad "$name: device and host routing differ"
  fi
done

# greedy generate (byte tokenizer): prompts of 20+ tokens prefill through the
# host path at FL_MOE_DEVICE_MAX_N=8, decode steps (3 rows) on the device
mdir=$tmp/mixtral
fl_byte_model "$src" mixtral "$mdir"
cat >"$tmp/req.jsonl" <<'JSONL'
{"custom_id": "a", "body": {"prompt": "Hello world, this is a longer prompt", "max_tokens": 9}}
{"custom_id": "b", "body": {"prompt": "abc", "max_tokens": 12}}
{"custom_id": "c", "body": {"prompt": "The quick brown fox jumps", "max_tokens": 5}}
JSONL
for v in 0 1; do
  rm -f "$tmp/g$v.jsonl"
  FL_MOE_DEVICE=$v FL_MOE_DEVICE_MAX_N=8 "$fl" generate --output-format compact --model "$mdir" --input "$tmp/req.jsonl" \
    --output "$tmp/g$v.jsonl" --backend cpu >"$tmp/log$v" 2>&1 || bad "generate FL_MOE_DEVICE=$v: $(tail -3 "$tmp/log$v")"
done
if [ -s "$tmp/g0.jsonl" ] && [ "$(sort "$tmp/g0.jsonl")" = "$(sort "$tmp/g1.jsonl")" ] &&
   [ "$(grep -c '"finish_reason"' "$tmp/g1.jsonl")" = 3 ]; then
  ok "mixtral generate: host-routed prefill + device-routed decode equals the host path"
else
  bad "mixtral generate differs: $(cat "$tmp/g0.jsonl" "$tmp/g1.jsonl" 2>/dev/null | head -6)"
fi

for bad_v in abc -3 5000; do
  FL_MOE_DEVICE_MAX_N=$bad_v "$fl" logits --model "$src/tests/golden/mixtral" --input-ids "$tmp/ids1.json" \
    --output "$tmp/x.f32" --backend cpu >"$tmp/log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && grep -q "FL_MOE_DEVICE_MAX_N" "$tmp/log"; then
    ok "FL_MOE_DEVICE_MAX_N=$bad_v refused with its name"
  else
    bad "FL_MOE_DEVICE_MAX_N=$bad_v (rc=$rc): $(tail -2 "$tmp/log")"
  fi
done
finish
