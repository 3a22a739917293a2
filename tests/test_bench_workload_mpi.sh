#!/usr/bin/env bash
# test_bench_workload_mpi.sh — `flotilla bench --workload` under mpirun on
# the CPU backend: tensor-parallel (rank 0 schedules and reports, rank 1
# follows its steps) and data-parallel (two replicas, each its own KV cache
# and prefix cache). Usage: test_bench_workload_mpi.sh FLOTILLA SOURCE_DIR
set -u
fl=$1
. "$2/tests/lib.sh"
fl_mpi_env
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

check() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1"; }
consistent="j['completed']==16 and j['failed']==0 and j['world']==2 and
  j['output_lens']==j['expected_output_lens'] and j['total_output_tokens']==sum(j['output_lens']) and
  j['total_input_tokens']==sum(j['input_lens']) and j['output_throughput']>0 and
  all(0<=j[k]['p50']<=j[k]['p90']<=j[k]['p99'] for k in ('ttft_ms','tpot_ms','itl_ms','e2e_latency_ms')) and
  0<j['peak_kv_blocks_used']<=j['kv_blocks']"

run() { timeout 300 mpirun -np 2 "$fl" bench --workload --preset tiny --backend cpu --max-model-len 256 \
  --num-prompts 16 --input-len 24 --output-len 6 --input-len-range 0.5 --shared-prefix-len 32 "$@"; }

if run --tp 2 --output "$T/tp.json" >"$T/tp.out" 2>&1 &&
   check "$T/tp.json" "$consistent and j['tp']==2 and j['dp']==1 and j['prefix_hit_rate']>0" &&
   [ "$(grep -c '^throughput:' "$T/tp.out")" = 1 ]; then
  ok "mpirun -np 2 --tp 2: rank 0 schedules and reports once"
else
  bad "mpirun -np 2 --tp 2"; cat "$T/tp.out"
fi

# dp 2: two caches (the blocks of both), the first prompt of each replica misses the prefix
if run --dp 2 --output "$T/dp.json" >"$T/dp.out" 2>&1 &&
   check "$T/dp.json" "$consistent and j['dp']==2 and j['kv_blocks']==2*j['engine']['n_blocks'] and
     j['cached_prompt_tokens']==(16-2)*32"; then
  ok "mpirun -np 2 --dp 2: two replicas, prefix cached per replica"
else
  bad "mpirun -np 2 --dp 2"; cat "$T/dp.out"
fi

# dp 2, two prefix groups drawn at random: a group gathers on one replica
# (placement follows the prefix) until the loads differ by 4 x its prefix,
# so the two prefixes are computed 2 or 3 times (12 x 64 cached tokens when
# placement follows the load alone: each prefix on both replicas)
if run --dp 2 --num-prefixes 2 --shared-prefix-len 64 --output "$T/dpk.json" >"$T/dpk.out" 2>&1 &&
   check "$T/dpk.json" "$consistent and j['workload']['num_prefixes']==2 and
     j['cached_prompt_tokens']>=(16-3)*64"; then
  ok "mpirun -np 2 --dp 2 --num-prefixes 2: $(python3 -c "import json; print(json.load(open('$T/dpk.json'))['cached_prompt_tokens'])") prompt tokens cached"
else
  bad "mpirun -np 2 --dp 2 --num-prefixes 2: $(python3 -c "import json; j=json.load(open('$T/dpk.json')); print(j['cached_prompt_tokens'])" 2>&1)"
  cat "$T/dpk.out"
fi

finish
