#!/usr/bin/env bash
# test_env.sh — `flotilla env` and the option registry as a user meets it:
# every FL_ variable the registry declares (core/option_list.h) and every
# registry option the source reads (FL_OPT_ ids) is listed, in text and in
# JSON, with the environment's values marked; the launcher variables are
# listed with their values; a malformed variable stops every subcommand at
# start-up with one line naming it (exit 2); and a user-facing setting takes
# the flag over the --config key over the variable over the default.
# Usage: test_env.sh FLOTILLA SOURCE_DIR
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
# check FILE EXPR: a Python expression over the JSON as j
check() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1"; }

# the names: declared in the list, and read through ids in the product
declared=$(grep -o '"FL_[A-Z0-9_]*"' "$src/core/option_list.h" | tr -d '"' | sort -u)
used=$(grep -rhoE 'FL_OPT_[A-Z0-9_]+' "$src/core" "$src/kernels" "$src/parallel" "$src/runtime" "$src/launcher" \
         --include='*.c' --include='*.h' --include='*.cu' |
       grep -vE '^FL_OPT_(COUNT|KIND_.*|ENUM|CHOICE|EXTERNAL|H)$' | sed 's/^FL_OPT_/FL_/' | sort -u)
# the listing's expectations below assume none of them is set already
for name in $declared; do unset "$name"; done
[ "$(echo "$declared" | wc -l)" -ge 15 ] && ok "$(echo "$declared" | wc -l) options declared" ||
  bad "too few options found in core/option_list.h: $declared"

# the registry is the one reader of the environment, in every layer and in
# the kernel benchmark
stray=$(cd "$src" && grep -rn 'getenv *(' --include='*.c' --include='*.h' --include='*.cu' --include='*.cuh' \
          core kernels parallel runtime launcher bench | grep -v '^core/option\.c:')
[ -z "$stray" ] && ok "no getenv outside core/option.c" || bad "getenv outside the registry: $stray"

"$fl" env >"$T/env.txt" 2>"$T/env.err" && ok "env: exit 0" || bad "env: $(cat "$T/env.err")"
"$fl" env --json >"$T/env.json" 2>"$T/env.err" && ok "env --json: exit 0" || bad "env --json: $(cat "$T/env.err")"
missing=""
for name in $declared $used; do
  grep -q "^$name " "$T/env.txt" || missing="$missing $name(text)"
  check "$T/env.json" "any(o['name']=='$name' for o in j['options'])" || missing="$missing $name(json)"
done
[ -z "$missing" ] && ok "every declared and used option listed" || bad "not listed:$missing"
check "$T/env.json" "all(o['doc'] and o['source']=='default' and 'value' in o and 'default' in o for o in j['options'])" &&
  ok "JSON: doc, default and value of each; nothing from the environment" || bad "JSON fields: $(head -c 600 "$T/env.json")"
check "$T/env.json" "[o for o in j['options'] if o['name']=='FL_MOE_OVERLAP'][0]['choices']=='off|on|serial|alternate'" &&
  ok "JSON: a choice option's choices" || bad "JSON choices"

# the environment's values, marked; launcher variables with theirs
FL_MOE_OVERLAP=2 FL_CUDA_GRAPHS=off CUDA_VISIBLE_DEVICES=3,1 "$fl" env --json >"$T/set.json" 2>"$T/set.err"
if check "$T/set.json" "(lambda o: o['FL_MOE_OVERLAP']['value']=='serial' and o['FL_MOE_OVERLAP']['source']=='environment' \
and o['FL_CUDA_GRAPHS']['value']=='off' and o['FL_STEP_TIMING']['source']=='default')({o['name']: o for o in j['options']}) \
and any(e['name']=='CUDA_VISIBLE_DEVICES' and e['value']=='3,1' for e in j['external']) \
and all(e['doc'] for e in j['external'])"; then
  ok "env --json: environment values marked, launcher variables with values"
else
  bad "env --json with values: $(cat "$T/set.err") $(head -c 800 "$T/set.json")"
fi
FL_CUDA_GRAPHS=off "$fl" env >"$T/set.txt" 2>&1
grep -q "^FL_CUDA_GRAPHS .*off .*\[environment\]" "$T/set.txt" && grep -q "^CUDA_VISIBLE_DEVICES " "$T/set.txt" &&
  grep -q "^SLURM_LOCALID " "$T/set.txt" && ok "env: text marks the environment, lists launcher variables" ||
  bad "env text: $(head -20 "$T/set.txt")"

# malformed: named, exit 2; env still lists it
FL_CUDA_GRAPHS=maybe "$fl" env >"$T/bad.txt" 2>"$T/bad.err"
rc=$?
if [ $rc -eq 2 ] && grep -q "FL_CUDA_GRAPHS=maybe" "$T/bad.err" && grep -q "FL_CUDA_GRAPHS=maybe does not parse" "$T/bad.txt"; then
  ok "env: FL_CUDA_GRAPHS=maybe listed and refused (rc 2)"
else
  bad "env FL_CUDA_GRAPHS=maybe (rc=$rc): $(cat "$T/bad.err")"
fi
for cmd in "bench --preset tiny --backend cpu --gen-len 2" "inspect --model $src/tests/golden/llama" "tokenize --help"; do
  FL_CUDA_GRAPHS=maybe FL_MOE_DEVICE_MAX_N=lots $fl $cmd >"$T/out" 2>"$T/err"
  rc=$?
  if [ $rc -eq 2 ] && [ "$(wc -l <"$T/err")" -eq 1 ] && grep -q "FL_CUDA_GRAPHS=maybe: expected 0 or 1" "$T/err" &&
     grep -q "1 more malformed" "$T/err" && [ ! -s "$T/out" ]; then
    ok "${cmd%% *}: a malformed variable stops it at start-up, named (rc 2)"
  else
    bad "${cmd%% *} with FL_CUDA_GRAPHS=maybe (rc=$rc): $(cat "$T/err")"
  fi
done

# precedence of a user-facing setting: flag > --config key > variable > default
# (greedy_on_device: bench counts the steps whose argmax ran where the logits are)
greedy() { # expected-greedy-steps-nonzero(0/1) name -- env... -- bench args...
  local want=$1 name=$2
  shift 2
  env "$@" --preset tiny --backend cpu --gen-len 4 --output "$T/g.json" >"$T/g.out" 2>&1
  if check "$T/g.json" "(j['greedy_steps'] > 0) == bool($want) and j['decode_steps'] == 3"; then
    ok "greedy_on_device: $name"
  else
    bad "greedy_on_device: $name: $(cat "$T/g.out") $(head -c 300 "$T/g.json" 2>/dev/null)"
  fi
}
printf 'greedy_on_device: on\n' >"$T/on.yaml"
printf 'greedy_on_device: off\n' >"$T/off.yaml"
greedy 1 "default on" "$fl" bench
greedy 0 "FL_GREEDY_ON_DEVICE=0 over the default" FL_GREEDY_ON_DEVICE=0 "$fl" bench
greedy 1 "config key over the variable" FL_GREEDY_ON_DEVICE=0 "$fl" bench --config "$T/on.yaml"
greedy 0 "config key over the default" "$fl" bench --config "$T/off.yaml"
greedy 0 "flag over the config key" "$fl" bench --config "$T/on.yaml" --greedy-on-device off
greedy 1 "flag over the variable" FL_GREEDY_ON_DEVICE=0 "$fl" bench --greedy-on-device on
# every setting in bench's JSON, from each source at once
printf 'moe_micro_batches: 5\ncuda_graphs: off\np2p_allreduce: on\n' >"$T/mix.yaml"
if FL_MOE_OVERLAP=on FL_STEP_TIMING=1 FL_P2P_AR_MAX_BYTES=4096 FL_P2P_AR=0 FL_NCCL_OWN_STREAM=yes \
     "$fl" bench --preset tiny --backend cpu --gen-len 3 --config "$T/mix.yaml" --moe-overlap 2 \
     --sample-on-device off --output "$T/mix.json" >"$T/mix.out" 2>&1 &&
   check "$T/mix.json" "j['settings']=={'cuda_graphs': False, 'graph_ctx_buckets': True, 'step_timing': True, \
'moe_overlap': 'serial', 'moe_micro_batches': 5, 'greedy_on_device': True, 'sample_on_device': False, \
'p2p_allreduce': True, 'p2p_allreduce_max_bytes': 4096, 'nccl_own_stream': True}"; then
  ok "bench JSON: every setting from its flag, key, variable or default"
else
  bad "bench settings: $(cat "$T/mix.out") $(head -c 600 "$T/mix.json" 2>/dev/null)"
fi
if "$fl" bench --preset tiny --backend cpu --greedy-on-device maybe >"$T/out" 2>"$T/err"; then
  bad "--greedy-on-device maybe accepted"
else
  grep -q -- "--greedy-on-device must be on | off, got 'maybe'" "$T/err" && ok "a bad flag value named" ||
    bad "bad flag value: $(cat "$T/err")"
fi
printf 'moe_micro_batches: 9\n' >"$T/mb.yaml"
if "$fl" bench --preset tiny --backend cpu --config "$T/mb.yaml" >"$T/out" 2>"$T/err"; then
  bad "moe_micro_batches: 9 accepted"
else
  grep -q -- "$T/mb.yaml:1: moe_micro_batches must be 2..8, got '9'" "$T/err" && ok "a bad config value named with its file and line" ||
    bad "bad config value: $(cat "$T/err")"
fi
FL_MOE_MICRO_BATCHES=0 "$fl" bench --preset tiny --backend cpu >"$T/out" 2>"$T/err"
rc=$?
[ $rc -ne 0 ] && grep -q "FL_MOE_MICRO_BATCHES=0: must be 2 to 8" "$T/err" && ok "an out-of-range variable named" ||
  bad "FL_MOE_MICRO_BATCHES=0 (rc=$rc): $(cat "$T/err")"

# the help states the precedence; bench's lists every preset of synth.c's table
"$fl" generate --help >"$T/help" 2>&1
grep -q "the flag wins, then the --config key, then the" "$T/help" && grep -q -- "--moe-overlap VALUE" "$T/help" &&
  ok "generate --help: the settings and their precedence" || bad "generate --help: $(cat "$T/help")"
"$fl" bench --help >"$T/bhelp" 2>&1
presets=$(sed -n '/^static const struct preset {/,/^};/p' "$src/runtime/load/synth.c" | grep -oE '^    \{"[a-z0-9.-]+"' | tr -d ' {"')
nmiss=""
for p in $presets; do grep -q "^  $p " "$T/bhelp" || nmiss="$nmiss $p"; done
if [ "$(echo "$presets" | wc -w)" -ge 8 ] && [ -z "$nmiss" ] && grep -q "moe-overlap.*default off" "$T/bhelp"; then
  ok "bench --help: all $(echo "$presets" | wc -w) presets, the MoE overlap's default off"
else
  bad "bench --help: missing$nmiss: $(cat "$T/bhelp")"
fi

finish
