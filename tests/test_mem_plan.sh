# test_mem_plan.sh FLOTILLA SRC — `flotilla plan` and the engine's memory
# sizing: the table and JSON of a preset and of a fixture, tensor
# parallelism halving a rank's shard, a budget below the weights refused
# with the numbers, the host swap pool (--swap-space) as the engine sizes
# it, and a generate job whose KV cache, swap pool, max_num_seqs and logged
# breakdown come from memory (no --kv-cache-mb) as the plan predicted, with
# the peak concurrency in its summary.
fl=$1
src=$2
. "$src/tests/lib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$fl" plan --model llama-3-8b --max-model-len 8192 --output "$tmp/p1.json" >"$tmp/p1.txt" 2>&1
[ $? -eq 0 ] && ok "plan llama-3-8b exit 0" || bad "plan llama-3-8b exit 0: $(cat "$tmp/p1.txt")"
# 32 layers x 8 KV heads x 128 x (K + V) x 2 bytes
grep -q "KV per token (all layers) *131072 B" "$tmp/p1.txt" && ok "llama-3-8b: 128 KiB of KV per token" \
  || bad "llama-3-8b KV per token: $(grep 'KV per token' "$tmp/p1.txt")"
grep -q "(estimate)" "$tmp/p1.txt" && ok "CUDA estimates are labelled" || bad "no estimate label"

"$fl" plan --model llama-3-8b --tp 2 --output "$tmp/p2.json" >"$tmp/p2.txt" 2>&1
python3 - "$tmp/p1.json" "$tmp/p2.json" <<'EOF' && ok "tp 2: two ranks, each half the attention, MLP and KV" || bad "tp 2 JSON"
import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
r1, r2 = a["ranks"][0], b["ranks"]
assert len(a["ranks"]) == 1 and len(r2) == 2, (len(a["ranks"]), len(r2))
for k in ("attention", "mlp/experts", "lm_head"):
    assert 2 * r2[1]["weight_bytes"][k] == r1["weight_bytes"][k], k
assert r2[0]["weight_bytes"]["embeddings"] == r1["weight_bytes"]["embeddings"]  # whole on every rank
assert 2 * r2[0]["kv_bytes_per_token"] == r1["kv_bytes_per_token"]
assert r1["weight_bytes"]["total"] == sum(r1["weight_bytes"][k] for k in ("attention", "mlp/experts", "embeddings", "lm_head", "norms"))
assert b["kv_blocks_min"] == min(r["kv_blocks"] for r in r2) and b["fits"]
EOF

"$fl" plan --model llama-3-8b --memory-budget 10G >"$tmp/p3.txt" 2>&1
rc=$?
[ $rc -ne 0 ] && grep -q "weights alone need 15317.0 MiB but the budget is 9216.0 MiB" "$tmp/p3.txt" \
  && ok "a budget below the weights is refused with the numbers" || bad "10G budget: rc $rc: $(tail -1 "$tmp/p3.txt")"

# a deepseek2 GGUF (MLA split into attn_k_b / attn_v_b by llama.cpp's converter) plans as its HF folder
for m in gguf/deepseek/deepseek_v2.gguf golden/deepseek_v2; do
  "$fl" plan --model "$src/tests/$m" --tp 2 --ep 2 --output "$tmp/ds_${m%%/*}.json" >"$tmp/ds.txt" 2>&1 \
    || bad "plan $m: $(tail -1 "$tmp/ds.txt")"
done
python3 - "$tmp/ds_gguf.json" "$tmp/ds_golden.json" <<'EOF' && ok "deepseek2 GGUF plans as its HF folder" || bad "deepseek2 GGUF plan"
import json, sys
g = json.load(open(sys.argv[1])); h = json.load(open(sys.argv[2]))
assert len(g["ranks"]) == len(h["ranks"]) == 2
for a, b in zip(g["ranks"], h["ranks"]):
    assert a["weight_bytes"] == b["weight_bytes"], (a["weight_bytes"], b["weight_bytes"])
    assert a["kv_bytes_per_token"] == b["kv_bytes_per_token"]
EOF

"$fl" plan --model "$src/tests/golden/qwen2_moe" --backend cpu --memory-budget 1G --kv-cache-dtype int8 \
  >"$tmp/p4.txt" 2>&1 && grep -q "int8" "$tmp/p4.txt" && grep -q "KV capacity" "$tmp/p4.txt" \
  && ok "plan a fixture on the CPU backend" || bad "plan qwen2_moe: $(cat "$tmp/p4.txt")"
"$fl" plan --model no-such-model >"$tmp/p5.txt" 2>&1
[ $? -ne 0 ] && grep -q "no such file or folder, and unknown preset" "$tmp/p5.txt" \
  && ok "unknown model named" || bad "unknown model: $(cat "$tmp/p5.txt")"
"$fl" plan --model llama-3-8b --memory-budget lots >"$tmp/p6.txt" 2>&1
[ $? -ne 0 ] && grep -q "memory-budget must be a size" "$tmp/p6.txt" && ok "bad budget named" \
  || bad "bad budget: $(cat "$tmp/p6.txt")"

# the host swap pool: --swap-space GiB in whole blocks of the rank's KV
# block, at most 4x the cache's blocks (fl_kv_swap_pool_blocks, what the
# engine allocates); pinned on CUDA; on the CPU lazy host memory counted in
# the host total next to the budget
python3 - "$tmp/p1.json" "$tmp/p2.json" <<'EOF' && ok "CUDA: the default 4 GiB pool, 2048 blocks of 2 MiB, 4 GiB pinned per rank" || bad "swap pool JSON: $(cat "$tmp/p1.json")"
import json, sys
for f in sys.argv[1:]:
    a = json.load(open(f))
    assert a["swap_space_bytes"] == 4 << 30, a["swap_space_bytes"]
    for r in a["ranks"]:
        B = r["kv_bytes_per_block"]
        want = min((4 << 30) // B, 4 * r["kv_blocks"])
        assert r["swap_pool_blocks"] == want and r["swap_pool_bytes"] == want * B, (r["swap_pool_blocks"], want)
        assert r["swap_pool_tokens"] == 16 * want and r["swap_pool_memory"] == "pinned host", r
        assert "host_bytes_with_full_swap_pool" not in r
r = json.load(open(sys.argv[1]))["ranks"][0]
assert r["kv_bytes_per_block"] == 2 << 20 and r["swap_pool_blocks"] == 2048 and r["swap_pool_bytes"] == 4 << 30, r
EOF
grep -q "KV swap pool (pinned host memory) *4096.00 MiB" "$tmp/p1.txt" && grep -q "KV swap capacity *32768 tokens, 2048 blocks" "$tmp/p1.txt" \
  && ! grep -q "KV on disk" "$tmp/p1.txt" && ok "table: the pinned pool and its capacity, no disk line without --kv-offload-dir" \
  || bad "swap lines: $(grep -i swap "$tmp/p1.txt")"
qm=$src/tests/golden/qwen2_moe
for d in f32 int8; do
  "$fl" plan --model "$qm" --backend cpu --memory-budget 1G --kv-cache-dtype $d --swap-space 0.01 \
    --output "$tmp/s_$d.json" >"$tmp/s_$d.txt" 2>&1 || bad "plan --swap-space 0.01 ($d): $(cat "$tmp/s_$d.txt")"
done
python3 - "$tmp/s_f32.json" "$tmp/s_int8.json" <<'EOF' && ok "CPU: 0.01 GiB in whole f32 and int8 blocks, in the host total" || bad "CPU swap pool JSON"
import json, sys
S = int(0.01 * 2**30)
pools = []
for f in sys.argv[1:]:
    a = json.load(open(f))
    r = a["ranks"][0]
    B = r["kv_bytes_per_block"]
    assert a["swap_space_bytes"] == S and r["swap_pool_blocks"] == min(S // B, 4 * r["kv_blocks"]) > 0, (S, B, r)
    assert r["swap_pool_bytes"] == r["swap_pool_blocks"] * B and r["swap_pool_memory"] == "host, lazy", r
    fixed = r["weight_bytes"]["total"] + r["workspace_bytes"] + r["host_scratch_bytes"] + r["logits_bytes"]
    assert r["host_bytes_with_full_swap_pool"] == fixed + r["kv_blocks"] * B + r["swap_pool_bytes"], r
    pools.append((B, r["swap_pool_blocks"]))
(bf, nf), (bi, ni) = pools
assert bi < bf and ni > nf, pools  # int8 records: smaller blocks, more of them in the same bytes
EOF
grep -q "KV swap pool (host memory) .*(allocated lazily" "$tmp/s_int8.txt" && grep -q "host memory with a full pool" "$tmp/s_int8.txt" \
  && ok "CPU table: the lazy pool and the host total with it" || bad "CPU swap lines: $(grep -i 'swap\|host' "$tmp/s_int8.txt")"
"$fl" plan --model "$qm" --backend cpu --memory-budget 3M --swap-space 1 --output "$tmp/s_cap.json" >"$tmp/s_cap.txt" 2>&1
python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))['ranks'][0]
assert 0 < r['kv_blocks'] and r['swap_pool_blocks'] == 4 * r['kv_blocks'], r
assert r['host_bytes_with_full_swap_pool'] > 3 << 20, r" "$tmp/s_cap.json" \
  && grep -q "capped at 4x the cache" "$tmp/s_cap.txt" && grep -q "over the budget: the pool comes on top" "$tmp/s_cap.txt" \
  && ok "a pool over 4x the cache is capped there; the host total over the budget is flagged" \
  || bad "4x cap: $(cat "$tmp/s_cap.txt")"
FL_SWAP_SPACE=0 "$fl" plan --model "$qm" --backend cpu --memory-budget 1G --kv-offload-dir "$tmp/kvd" \
  --output "$tmp/s0.json" >"$tmp/s0.txt" 2>&1
python3 -c "
import json, sys; a = json.load(open(sys.argv[1])); r = a['ranks'][0]
assert a['swap_space_bytes'] == 0 and r['swap_pool_blocks'] == 0 and r['swap_pool_bytes'] == 0 and a['kv_offload_dir'] == sys.argv[2], a" \
  "$tmp/s0.json" "$tmp/kvd" && grep -q "preemption recomputes" "$tmp/s0.txt" && grep -q "^KV on disk $tmp/kvd: " "$tmp/s0.txt" \
  && ok "FL_SWAP_SPACE=0: no pool; --kv-offload-dir: one disk line" || bad "no pool / disk: $(cat "$tmp/s0.txt")"
"$fl" plan --model llama-3-8b --swap-space lots >"$tmp/s1.txt" 2>&1
[ $? -ne 0 ] && grep -q -- "--swap-space must be a number of GiB" "$tmp/s1.txt" && ok "plan: bad --swap-space named" \
  || bad "plan --swap-space lots: $(cat "$tmp/s1.txt")"
"$fl" plan --help | grep -q -- "--swap-space VALUE *GIB: .*FL_SWAP_SPACE" && "$fl" plan --help | grep -q -- "--kv-offload-dir" \
  && ok "plan --help lists --swap-space and --kv-offload-dir as generate does" || bad "plan --help: $("$fl" plan --help)"

# the engine: a cache from memory on a fixture with a byte tokenizer
fl_byte_model "$src" llama "$tmp/m"
for i in 1 2 3 4 5; do echo "{\"custom_id\":\"r$i\",\"body\":{\"prompt\":\"abc $i\",\"max_tokens\":6}}"; done >"$tmp/req.jsonl"
"$fl" generate --model "$tmp/m" --input "$tmp/req.jsonl" --output "$tmp/out.jsonl" --backend cpu --verbose \
  --memory-budget 256M --summary "$tmp/sum.json" 2>"$tmp/gen.err"
[ $? -eq 0 ] && ok "generate without --kv-cache-mb" || bad "generate: $(tail -3 "$tmp/gen.err")"
grep -q "KV cache sized from memory" "$tmp/gen.err" && grep -q "memory plan (cpu backend" "$tmp/gen.err" \
  && grep -q "measured (resident set)" "$tmp/gen.err" && ok "verbose logs the plan and the measurements" \
  || bad "verbose memory log missing: $(grep -i memory "$tmp/gen.err")"
# the plan of the same model and budget predicts the cache and the pool the
# engine made (the cache capped at max-model-len x 256 sequences, the pool
# at 4x the cache), and the verbose table shows the pool as made
"$fl" plan --model "$tmp/m" --backend cpu --memory-budget 256M --output "$tmp/pm.json" >"$tmp/pm.txt" 2>&1
made_kv=$(sed -n 's/.*KV cache sized from memory: \([0-9]*\) blocks.*/\1/p' "$tmp/gen.err")
made_sw=$(sed -n 's/.*KV swap space: \([0-9]*\) blocks.*/\1/p' "$tmp/gen.err")
python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))['ranks'][0]
assert (r['kv_blocks'], r['swap_pool_blocks']) == (int(sys.argv[2]), int(sys.argv[3])) and r['swap_pool_blocks'] > 0, (r['kv_blocks'], r['swap_pool_blocks'], sys.argv[2:])" \
  "$tmp/pm.json" "${made_kv:-0}" "${made_sw:-0}" \
  && grep -q "KV swap capacity *$((made_sw * 16)) tokens, $made_sw blocks" "$tmp/gen.err" \
  && ok "plan predicts the engine's cache ($made_kv blocks) and swap pool ($made_sw blocks)" \
  || bad "plan vs engine: plan $(grep -i 'swap capacity\|KV cache' "$tmp/pm.txt"), engine $made_kv / $made_sw"
python3 - "$tmp/sum.json" <<'EOF' && ok "summary: peak concurrency 5 of max_num_seqs" || bad "summary: $(cat "$tmp/sum.json")"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["peak_running_sequences"] == 5, s["peak_running_sequences"]
assert 5 <= s["max_num_seqs"] <= 256, s["max_num_seqs"]
EOF
grep -q "concurrency 5 sequences at peak" "$tmp/gen.err" && ok "summary line" || bad "no concurrency line"

"$fl" generate --model "$tmp/m" --input "$tmp/req.jsonl" --output "$tmp/o2.jsonl" --backend cpu \
  --memory-budget 64K 2>"$tmp/g2.err"
[ $? -ne 0 ] && grep -q "no memory is left for the KV cache" "$tmp/g2.err" && ok "too small a budget refused" \
  || bad "64K budget: $(tail -2 "$tmp/g2.err")"
"$fl" generate --model "$tmp/m" --input "$tmp/req.jsonl" --output "$tmp/o3.jsonl" --backend cpu \
  --kv-cache-dtype bf16 --kv-cache-mb 1 --verbose 2>"$tmp/g3.err"
rc=$?
f32_tok=$(sed -n 's/.*KV per token (all layers) *\([0-9]*\) B.*(f32.*/\1/p' "$tmp/gen.err")
[ $rc -eq 0 ] && [ "$(wc -l <"$tmp/o3.jsonl")" = 5 ] && grep -q "memory plan (cpu backend, KV bf16)" "$tmp/g3.err" \
  && grep -q "KV per token (all layers) *$((f32_tok / 2)) B *(bf16" "$tmp/g3.err" \
  && ok "a bf16 cache on the CPU: half the bytes a token (${f32_tok:-?} B in f32)" \
  || bad "bf16 on cpu: $(grep -i "KV" "$tmp/g3.err" | head -5)"
# an explicit cache still wins
"$fl" generate --model "$tmp/m" --input "$tmp/req.jsonl" --output "$tmp/o4.jsonl" --backend cpu --verbose \
  --kv-cache-mb 1 --max-num-seqs 2 --summary "$tmp/s4.json" 2>"$tmp/g4.err"
[ $? -eq 0 ] && ! grep -q "sized from memory" "$tmp/g4.err" \
  && python3 -c "import json,sys; s=json.load(open(sys.argv[1])); assert s['max_num_seqs']==2 and s['peak_running_sequences']==2" "$tmp/s4.json" \
  && ok "--kv-cache-mb and --max-num-seqs still apply" || bad "explicit cache: $(tail -2 "$tmp/g4.err")"
# the keys in a --config file, and an int8 cache end to end
printf 'memory_budget: 128M\nkv_cache_dtype: int8\nverbose: true\n' >"$tmp/c.yaml"
"$fl" generate --model "$tmp/m" --input "$tmp/req.jsonl" --output "$tmp/o5.jsonl" --backend cpu \
  --config "$tmp/c.yaml" 2>"$tmp/g5.err"
[ $? -eq 0 ] && grep -q "memory plan (cpu backend, KV int8)" "$tmp/g5.err" && grep -q "budget *128.00 MiB" "$tmp/g5.err" \
  && [ "$(wc -l <"$tmp/o5.jsonl")" -eq 5 ] && ok "YAML keys memory_budget, kv_cache_dtype: int8 cache end to end" \
  || bad "config keys: $(grep -i 'memory\|error' "$tmp/g5.err" | head -5)"
finish
