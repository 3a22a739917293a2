#!/usr/bin/env bash
# test_kv_offload_generate.sh FLOTILLA SRC — the KV cache's disk tier
# (--kv-offload-dir) through `flotilla generate`: a job of requests that
# share prefixes writes its prefix-cached blocks; a second job with the same
# folder reads them back (the summary counts the blocks) and gives the same
# greedy outputs as the first and as a job without the option. A truncated
# file and a garbage file under a block file's name are each reported and
# ignored, with the same outputs again. Then the same two runs under mpirun
# -np 2 with tp 2, where every rank writes and reads its own shard's files,
# with dp 2, where the replicas share the files, and with dp 2 x tp 2.
# The golden Llama fixture runs with a byte-level tokenizer. Prints
# "N passed, M failed".
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$src/tests/lib.sh"
fl_mpi_env
mpi() { timeout 300 mpirun --oversubscribe --bind-to none -np "$@"; }

m=$tmp/llama
fl_byte_model "$src" llama "$m"

# 8 requests behind one 64-character prefix, 64 tokens each: long enough for
# progress lines at 0.01 s on a fast build
python3 - >"$tmp/req.jsonl" <<'PY'
import json
prefix = "You answer in one word. Context: the sky is blue; grass is green. "[:64]
for i in range(8):
    q = f"Q{i}: colour{' of it' * (i % 3)}?"
    print(json.dumps({"custom_id": f"r{i}", "body": {"prompt": prefix + q, "max_tokens": 64}}))
PY

run() { # name launcher-prefix... -- extra-args...
  local name=$1
  shift
  local pre=()
  while [ "$1" != -- ]; do pre+=("$1"); shift; done
  shift
  rm -f "$tmp/$name.jsonl"
  "${pre[@]}" "$fl" generate --output-format compact --model "$m" --backend cpu --input "$tmp/req.jsonl" \
    --output "$tmp/$name.jsonl" --summary "$tmp/$name.json" --progress-interval 0.01 "$@" \
    >"$tmp/$name.log" 2>&1 || { bad "$name: generate failed: $(tail -5 "$tmp/$name.log")"; return 1; }
}
hits() { python3 -c "import json; print(int(json.load(open('$tmp/$1.json'))['kv_disk_hit_blocks']))" 2>/dev/null || echo x; }
same() { [ -s "$tmp/$1.jsonl" ] && [ "$(sort "$tmp/$1.jsonl")" = "$(sort "$tmp/$2.jsonl")" ]; }
# drop_inner FOLDER: deletes rank 1's file of the shared prefix's third block
# (a block that is read, behind two that still are): the header's block and
# parent hashes (kv_disk.h) at bytes 24 and 32 give the chain
drop_inner() {
  python3 - "$1" <<'PY'
import glob, os, struct, sys
files = glob.glob(os.path.join(sys.argv[1], "*", "*.r1"))
par = {}
for f in files:
    h, p = struct.unpack_from("<QQ", open(f, "rb").read(40), 24)
    par[h] = (p, f)
def depth(h):
    d = 0
    while par[h][0] in par:
        h, d = par[h][0], d + 1
    return d
kids = {p for p, _ in par.values()}
inner = [f for h, (p, f) in par.items() if depth(h) == 2 and h in kids]
os.remove(sorted(inner)[0])
PY
}

check_pair() { # first second reference what
  local h1 h2
  h1=$(hits "$1") h2=$(hits "$2")
  if [ "$h1" = 0 ] && [ "$h2" -gt 0 ] 2>/dev/null && same "$1" "$3" && same "$2" "$3"; then
    ok "$4: the second run read $h2 blocks from disk; outputs equal the run without the tier"
  else
    bad "$4: disk hits $h1 then $h2, outputs $(same "$2" "$3" && echo equal || echo differ): $(tail -4 "$tmp/$2.log")"
  fi
}

kv=$tmp/kv
run plain -- &&
  run first -- --kv-offload-dir "$kv" &&
  run second -- --kv-offload-dir "$kv" &&
  check_pair first second plain "one rank"

# the text summary and the progress lines
if grep -Eq '^  KV on disk  [1-9][0-9]* blocks \([0-9]+ prompt tokens\) read from --kv-offload-dir$' "$tmp/second.log" &&
   grep -Eq '^flotilla generate: progress .*, [1-9][0-9]* blocks from disk$' "$tmp/second.log"; then
  ok "text summary and progress lines count disk hits ($(grep '^  KV on disk' "$tmp/second.log"))"
else
  bad "disk hits in the text: $(cat "$tmp/second.log")"
fi

# one file cut short, one file of garbage under a block file's name
dir=$(ls -d "$kv"/*/ | head -1)
dir=${dir%/}
torn=$(ls "$dir"/*.r0 | head -1)
truncate -s 1000 "$torn"
head -c 5000 /dev/urandom >"$dir/0123456789abcdef.r0"
if run third -- --kv-offload-dir "$kv"; then
  h3=$(hits third)
  if grep -q "warning: KV offload: ignoring $torn: torn" "$tmp/third.log" &&
     grep -q "warning: KV offload: ignoring $dir/0123456789abcdef.r0: not a flotilla KV block file" "$tmp/third.log" &&
     same third plain && [ "$h3" -gt 0 ] 2>/dev/null; then
    ok "a torn and a foreign file are reported and ignored; $h3 blocks still read, outputs equal"
  else
    bad "torn/foreign files: hits $h3, outputs $(same third plain && echo equal || echo differ): $(grep -i warn "$tmp/third.log")"
  fi
fi
# the third run wrote the torn block again: a fourth run trusts it
run fourth -- --kv-offload-dir "$kv" &&
  { [ "$(grep -c "ignoring $torn" "$tmp/fourth.log")" = 0 ] && same fourth plain &&
    ok "the torn block was written again ($(hits fourth) blocks read)" || bad "fourth run: $(grep -i warn "$tmp/fourth.log")"; }

# another KV dtype writes other bytes: the same folder gives an int8 run no
# hits (the cache's identity names the dtype), its own folder holds them,
# and an fp8 run (records of the same size) finds none of int8's
run int8a -- --kv-offload-dir "$kv" --kv-cache-dtype int8 &&
  run int8b -- --kv-offload-dir "$kv" --kv-cache-dtype int8 &&
  run fp8a -- --kv-offload-dir "$kv" --kv-cache-dtype fp8 &&
  if [ "$(hits int8a)" = 0 ] && [ "$(hits int8b)" -gt 0 ] 2>/dev/null && [ "$(hits fp8a)" = 0 ] &&
     [ "$(ls -d "$kv"/*/ | wc -l)" = 3 ]; then
    ok "KV dtypes keep apart: int8 hits 0 then $(hits int8b), fp8 0; three cache folders"
  else
    bad "KV dtypes: int8 hits $(hits int8a) then $(hits int8b), fp8 $(hits fp8a), folders $(ls "$kv")"
  fi

# a folder name that cannot be created is an error naming it
touch "$tmp/file"
if ! "$fl" generate --model "$m" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/bad.jsonl" \
     --kv-offload-dir "$tmp/file/sub" >"$tmp/bad.log" 2>&1 && grep -q "kv-offload-dir: cannot create $tmp/file/sub" "$tmp/bad.log"; then
  ok "an unusable folder is refused ($(grep -m1 'kv-offload-dir' "$tmp/bad.log"))"
else
  bad "unusable folder: $(tail -3 "$tmp/bad.log")"
fi

# tp 2: each rank writes and reads its own shard's files
kv2=$tmp/kv2
run mpi_first mpi 2 -- --tp 2 --kv-offload-dir "$kv2" &&
  run mpi_second mpi 2 -- --tp 2 --kv-offload-dir "$kv2" &&
  check_pair mpi_first mpi_second plain "mpirun -np 2 tp 2"
n0=$(ls "$kv2"/*/*.r0 2>/dev/null | wc -l) n1=$(ls "$kv2"/*/*.r1 2>/dev/null | wc -l)
[ "$n0" -gt 0 ] && [ "$n0" = "$n1" ] && ok "tp 2: $n0 files per rank" || bad "tp 2: $n0 and $n1 files"
# a file missing on one rank: that block is not read (rank 0 keeps the
# blocks every rank has; reading it would fail the job), those before it are
drop_inner "$kv2"
run mpi_third mpi 2 -- --tp 2 --kv-offload-dir "$kv2" &&
  { h=$(hits mpi_third) h2=$(hits mpi_second); [ "$h" -gt 0 ] 2>/dev/null && [ "$h" -lt "$h2" ] && same mpi_third plain &&
    ok "tp 2, a file missing on rank 1: $h blocks read (of $h2), outputs equal" ||
    bad "tp 2 missing file: $h of $h2: $(tail -3 "$tmp/mpi_third.log")"; }

# dp 2: the replicas share the folder (one index on rank 0: a block two
# replicas compute is written once) and both read it in the next job
kv3=$tmp/kv3
run dp_first mpi 2 -- --dp 2 --kv-offload-dir "$kv3" &&
  run dp_second mpi 2 -- --dp 2 --kv-offload-dir "$kv3" &&
  check_pair dp_first dp_second plain "mpirun -np 2 dp 2"
# dp 2 x tp 2: a file missing on one rank of one replica keeps that block
# from every replica (reading it would fail the job), the others are read
kv4=$tmp/kv4
run dptp_first mpi 4 -- --dp 2 --tp 2 --kv-offload-dir "$kv4" &&
  run dptp_second mpi 4 -- --dp 2 --tp 2 --kv-offload-dir "$kv4" &&
  check_pair dptp_first dptp_second plain "mpirun -np 4 dp 2 tp 2"
nf=$(ls "$kv4"/*/*.r1 2>/dev/null | wc -l)
drop_inner "$kv4"
run dptp_third mpi 4 -- --dp 2 --tp 2 --kv-offload-dir "$kv4" &&
  { h=$(hits dptp_third) h2=$(hits dptp_second); [ "$h" -gt 0 ] 2>/dev/null && [ "$h" -lt "$h2" ] && same dptp_third plain &&
    ok "dp 2 tp 2, one of $nf files missing on one rank: $h blocks read (of $h2), outputs equal" ||
    bad "dp 2 tp 2 missing file: $h of $h2: $(tail -3 "$tmp/dptp_third.log")"; }

finish
