#!/usr/bin/env bash
# test_bench_workload.sh — `flotilla bench --workload` on the CPU backend,
# one rank: every request gets exactly its drawn completion length, the
# counts and rates agree with each other, percentiles are ordered, the
# shared prefix is served from the prefix cache (and not with
# --no-prefix-caching), Poisson arrivals spread the run, a small cache
# preempts and still finishes everything, and bad flags are named.
# Usage: test_bench_workload.sh FLOTILLA SOURCE_DIR
set -u
fl=$1
. "$2/tests/lib.sh"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# check FILE EXPR: a Python expression over the JSON as j
check() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1"; }
# one layer: under ASan on two cores each run stays a few seconds
wl() { "$fl" bench --workload --preset tiny --layers 1 --backend cpu --max-model-len 256 "$@"; }

# What every run's JSON must satisfy: each request finished with the
# completion it drew, token totals are sums of the per-request lengths,
# rates are totals over the duration, percentiles ordered, KV peak within
# the cache.
consistent="j['completed']==j['workload']['num_prompts'] and j['failed']==0 and
  j['output_lens']==j['expected_output_lens'] and
  j['total_output_tokens']==sum(j['output_lens'])==j['expected_output_tokens'] and
  j['total_input_tokens']==sum(j['input_lens']) and
  all(a+b<=j['engine']['max_model_len'] for a,b in zip(j['input_lens'],j['output_lens'])) and
  j['duration_s']>0 and j['request_throughput']>0 and j['output_throughput']>0 and
  abs(j['total_token_throughput']*j['duration_s']-j['total_input_tokens']-j['total_output_tokens'])<1e-6*j['total_input_tokens']+1 and
  abs(j['output_throughput']*j['duration_s']-j['total_output_tokens'])<1e-6*j['total_output_tokens']+1 and
  all(0<=j[k]['p50']<=j[k]['p90']<=j[k]['p99'] and j[k]['mean']>0 for k in ('ttft_ms','tpot_ms','itl_ms','e2e_latency_ms')) and
  j['ttft_ms']['n']==j['completed'] and j['itl_ms']['n']==j['total_output_tokens']-j['completed'] and
  j['e2e_latency_ms']['p99']<=j['duration_s']*1e3+1e-6 and
  0<j['peak_kv_blocks_used']<=j['kv_blocks']==j['engine']['n_blocks'] and
  0<j['peak_running']<=j['engine']['max_num_seqs'] and j['steps']>0 and
  0<j['prefill_steps']<=j['steps'] and 0<=j['prefill_forward_share']<=1 and
  j['prefill_rows']>=j['total_input_tokens']-j['cached_prompt_tokens'] and
  abs(j['prefill_forward_ms_per_step']*j['prefill_steps']+j['decode_forward_ms_per_step']*(j['steps']-j['prefill_steps'])
      -j['forward_ms_per_step']*j['steps'])<=1e-6*j['forward_ms_per_step']*j['steps']+1e-9 and
  j['engine']['block_size']==16 and j['copy_ceiling_GBps']>0"

# uniform lengths around 32 / 8 with ranges; the cache sized from memory
lens="--num-prompts 24 --input-len 32 --output-len 8 --input-len-range 0.5 --output-len-range 0.5"
if wl $lens --output "$T/base.json" >"$T/base.out" 2>&1 &&
   check "$T/base.json" "$consistent" &&
   check "$T/base.json" "all(16<=n<=48 for n in j['input_lens']) and len(set(j['input_lens']))>3 and
     all(4<=n<=12 for n in j['expected_output_lens']) and len(set(j['expected_output_lens']))>3 and
     j['workload']['request_rate']=='inf' and j['last_arrival_s']==0 and j['clipped']==0 and j['preemptions']==0"; then
  ok "uniform lengths: every request its drawn length, totals and rates consistent, percentiles ordered"
else
  bad "uniform lengths"; cat "$T/base.out"
fi
if grep -q "^throughput: .* req/s" "$T/base.out" && grep -q "^TTFT " "$T/base.out" &&
   grep -q "^inter-token " "$T/base.out" && grep -q "KV blocks peak" "$T/base.out"; then
  ok "summary block"
else
  bad "summary block"; cat "$T/base.out"
fi

# a shared prefix: served from the prefix cache, and not without it
if wl --num-prompts 16 --input-len 8 --output-len 4 --shared-prefix-len 64 --output "$T/pc.json" >"$T/pc.out" 2>&1 &&
   check "$T/pc.json" "$consistent and j['engine']['prefix_caching'] and j['prefix_hit_rate']>0.5 and
     j['cached_prompt_tokens']%16==0 and j['admitted_prompt_tokens']==j['total_input_tokens'] and
     all(n==72 for n in j['input_lens'])"; then
  ok "--shared-prefix-len: prefix hits with caching on"
else
  bad "--shared-prefix-len"; cat "$T/pc.out"
fi
if wl --num-prompts 16 --input-len 8 --output-len 4 --shared-prefix-len 64 --no-prefix-caching \
     --kv-cache-dtype int8 --output "$T/nopc.json" >"$T/nopc.out" 2>&1 &&
   check "$T/nopc.json" "$consistent and not j['engine']['prefix_caching'] and j['prefix_hit_rate']==0 and
     j['cached_prompt_tokens']==0 and j['engine']['kv_dtype']=='int8'" &&
   check "$T/base.json" "j['engine']['kv_dtype']=='f32'"; then
  ok "--no-prefix-caching: no hits (--kv-cache-dtype int8 applies)"
else
  bad "--no-prefix-caching"; cat "$T/nopc.out"
fi

# Poisson arrivals: the run lasts at least until the last arrival; the
# lengths are those of the same seed at any rate (separate random streams)
if wl $lens --request-rate 40 --output "$T/rate.json" >"$T/rate.out" 2>&1 &&
   check "$T/rate.json" "$consistent and j['workload']['request_rate']==40 and j['last_arrival_s']>0 and
     j['duration_s']>=j['last_arrival_s']" &&
   python3 -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); \
     sys.exit(0 if a['input_lens']==b['input_lens'] and a['expected_output_lens']==b['expected_output_lens'] else 1)" \
     "$T/base.json" "$T/rate.json"; then
  ok "--request-rate: duration >= last arrival, same lengths as at rate inf"
else
  bad "--request-rate"; cat "$T/rate.out"
fi

# a 1 MiB cache (64 blocks of one layer) and 16 sequences allowed: preemptions,
# everything still finishes; --max-concurrency bounds the requests in flight
if wl --num-prompts 16 --input-len 64 --output-len 24 --kv-cache-mb 1 --max-num-seqs 16 --max-concurrency 14 \
     --output "$T/pre.json" >"$T/pre.out" 2>&1 &&
   check "$T/pre.json" "$consistent and j['kv_blocks']==64 and j['preemptions']>0 and j['peak_running']<=14 and
     j['peak_kv_blocks_used']==64 and j['workload']['max_concurrency']==14"; then
  ok "small cache: preemptions, every request complete, concurrency bounded"
else
  bad "small cache"; cat "$T/pre.out"
fi

# log-normal lengths, clipped so prompt + completion fit max_model_len
if "$fl" bench --workload --preset tiny --layers 1 --backend cpu --max-model-len 64 --num-prompts 24 --input-len 40 \
     --output-len 8 --length-dist lognormal --output "$T/ln.json" >"$T/ln.out" 2>&1 &&
   check "$T/ln.json" "$consistent and j['workload']['length_dist']=='lognormal' and j['clipped']>0 and
     max(a+b for a,b in zip(j['input_lens'],j['output_lens']))<=64 and len(set(j['input_lens']))>5"; then
  ok "--length-dist lognormal: long tail clipped to max_model_len"
else
  bad "--length-dist lognormal"; cat "$T/ln.out"
fi

# bad input: non-zero exit and the flag named
badflag() {
  local want=$1
  shift
  if ! "$fl" bench --preset tiny --backend cpu "$@" >"$T/bad.out" 2>&1 && grep -q -- "$want" "$T/bad.out"; then
    ok "refused: $* ($want)"
  else
    bad "not refused: $*"; cat "$T/bad.out"
  fi
}
badflag "--num-prompts" --workload --num-prompts 0
badflag "--input-len-range" --workload --input-len-range 2
badflag "--output-len" --workload --output-len x
badflag "--length-dist" --workload --length-dist zipf
badflag "--input-len-range" --workload --length-dist lognormal --input-len-range 0.1
badflag "--request-rate" --workload --request-rate 0
badflag "--max-num-seqs" --workload --max-num-seqs 0
badflag "--shared-prefix-len" --workload --max-model-len 64 --shared-prefix-len 63
badflag "--batch" --workload --batch 4
badflag "--num-prompts applies to --workload" --num-prompts 4
badflag "--no-prefix-caching applies to --workload" --no-prefix-caching
badflag "--kv-cache-mb applies to --workload" --kv-cache-mb 4

finish
