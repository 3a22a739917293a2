#!/usr/bin/env bash
# test_slurm_script.sh FLOTILLA SRC — `flotilla slurm` (issue 5, the batch
# script part; no Slurm daemons are started here): the script it writes from
# launcher/slurm/job.sbatch.in is valid bash with the #SBATCH lines and the
# `srun --mpi=pmix ... generate ... --resume` line the flags ask for, quotes
# awkward paths, and, run with a stand-in srun (one task, the command as
# given) on the demo model, completes the job and resumes it when run again.
# --submit pipes the same script to sbatch (a stand-in recording its stdin).
# Bad flags and a template with an unknown placeholder are refused.
# Prints "N passed, M failed".
set -u
fl=$1
src=$(cd "$2" && pwd)
demo=${FL_DEMO_GGUF:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmpl=$src/launcher/slurm/job.sbatch.in
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   - $1"; }
bad() { fail=$((fail + 1)); echo "FAIL - $1"; }
has() { grep -qxF -- "$2" "$1" || { echo "  missing line: $2"; return 1; }; }

# an awkward output path: a space, a quote, a dollar
odir="$tmp/it's \$HOME out"
mkdir -p "$odir"
cd "$tmp" || exit 1
"$fl" slurm --template "$tmpl" --model /models/m.gguf --input req.jsonl --output "$odir/res.jsonl" \
  --nodes 2 --gpus-per-node 4 --partition gpu --time 4:00:00 --account proj1 --job-name batch7 --tp 8 \
  -- --backend cuda --max-num-seqs 64 >"$tmp/job.sbatch" 2>"$tmp/err"
rc=$?
if [ $rc -eq 0 ] && bash -n "$tmp/job.sbatch"; then ok "script written, bash -n passes"; else bad "script (rc=$rc): $(cat "$tmp/err")"; fi
if has "$tmp/job.sbatch" "#!/bin/bash" && has "$tmp/job.sbatch" "#SBATCH --nodes=2" &&
   has "$tmp/job.sbatch" "#SBATCH --ntasks-per-node=4" && has "$tmp/job.sbatch" "#SBATCH --gpus-per-node=4" &&
   has "$tmp/job.sbatch" "#SBATCH --partition=gpu" && has "$tmp/job.sbatch" "#SBATCH --time=4:00:00" &&
   has "$tmp/job.sbatch" "#SBATCH --account=proj1" && has "$tmp/job.sbatch" "#SBATCH --job-name=batch7" &&
   has "$tmp/job.sbatch" "#SBATCH --signal=TERM@120" && has "$tmp/job.sbatch" "srun --mpi=pmix --kill-on-bad-exit=1 \\" &&
   ! grep -q "@[A-Z_]*@" "$tmp/job.sbatch"; then
  ok "#SBATCH lines and srun --mpi=pmix"
else
  bad "#SBATCH lines: $(cat "$tmp/job.sbatch")"
fi
# all #SBATCH lines come before the first command (sbatch stops reading there)
if awk '/^#SBATCH/ { if (cmd) bad = 1 } /^[^#]/ && NF { cmd = 1 } END { exit bad }' "$tmp/job.sbatch"; then
  ok "#SBATCH directives precede the first command"
else
  bad "an #SBATCH line after a command"
fi
# the generate line, as bash parses it: absolute paths, --resume, pass-through
genline=$(grep -A1 '^srun ' "$tmp/job.sbatch" | tail -1)
if msg=$(python3 - "$genline" "$odir" "$tmp" "$fl" <<'PY' 2>&1
import shlex, sys, os
line, odir, cwd, fl = sys.argv[1:]
args = shlex.split(line)
assert os.path.realpath(args[0]) == os.path.realpath(fl), args[0]
args = args[1:]
assert args[0] == "generate", args
def val(flag):
    return args[args.index(flag) + 1]
assert val("--model") == "/models/m.gguf"
assert os.path.realpath(val("--input")) == os.path.realpath(cwd + "/req.jsonl"), val("--input")
assert val("--output") == odir + "/res.jsonl", val("--output")
assert val("--summary") == odir + "/res.jsonl.summary.json"
assert "--resume" in args and val("--tp") == "8" and val("--backend") == "cuda" and val("--max-num-seqs") == "64"
print(" ".join(args[:3]))
PY
); then
  ok "generate line parses back to the arguments ($msg ...)"
else
  bad "generate line: $genline: $msg"
fi

# run it with a stand-in srun on the demo model (CPU, one task), twice
if [ -f "$demo" ]; then
  mkdir -p "$tmp/bin"
  cat >"$tmp/bin/srun" <<'SH'
#!/bin/bash
# stand-in for srun: one task; drop srun's own options, run the command
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
echo "$@" >"$FAKE_SRUN_LOG"
SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 exec "$@"
SH
  chmod +x "$tmp/bin/srun"
  for i in 1 2 3 4 5; do echo "{\"custom_id\": \"j$i\", \"body\": {\"prompt\": \"Hello $i\", \"max_tokens\": 3}}"; done >"$tmp/req.jsonl"
  "$fl" slurm --template "$tmpl" --model "$demo" --input req.jsonl --output "$odir/res.jsonl" --gpus-per-node 0 \
    -- --backend cpu >"$tmp/cpu.sbatch" 2>"$tmp/err"
  PATH=$tmp/bin:$PATH FAKE_SRUN_LOG=$tmp/srun.log bash "$tmp/cpu.sbatch" >"$tmp/run.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && [ "$(wc -l <"$odir/res.jsonl")" -eq 5 ] && [ -s "$odir/res.jsonl.summary.json" ] &&
     grep -q "output $odir/res.jsonl" "$tmp/run.log" && ! grep -q "gpus-per-node" "$tmp/cpu.sbatch"; then
    ok "the script runs the job (stand-in srun): 5 results and a summary"
  else
    bad "running the script (rc=$rc): $(tail -5 "$tmp/run.log") $(cat "$tmp/err")"
  fi
  cp "$odir/res.jsonl" "$tmp/first.jsonl"
  PATH=$tmp/bin:$PATH FAKE_SRUN_LOG=$tmp/srun.log bash "$tmp/cpu.sbatch" >"$tmp/run.log" 2>&1
  if [ $? -eq 0 ] && cmp -s "$odir/res.jsonl" "$tmp/first.jsonl" && grep -q "0 requests to go" "$tmp/run.log"; then
    ok "resubmitting the same script resumes (nothing redone)"
  else
    bad "resubmission: $(cat "$tmp/run.log")"
  fi
else
  bad "demo model missing at $demo"
fi

# --submit: the same script goes to sbatch's stdin
mkdir -p "$tmp/sb"
printf '#!/bin/bash\ncat >"$FAKE_SBATCH_IN"; echo "Submitted batch job 42"; exit ${FAKE_SBATCH_RC:-0}\n' >"$tmp/sb/sbatch"
chmod +x "$tmp/sb/sbatch"
args=(slurm --template "$tmpl" --model /models/m.gguf --input req.jsonl --output out.jsonl)
"$fl" "${args[@]}" >"$tmp/printed.sbatch"
out=$(PATH=$tmp/sb:$PATH FAKE_SBATCH_IN=$tmp/submitted.sbatch "$fl" "${args[@]}" --submit 2>&1)
if [ $? -eq 0 ] && cmp -s "$tmp/printed.sbatch" "$tmp/submitted.sbatch" && [ "$out" = "Submitted batch job 42" ]; then
  ok "--submit pipes the script to sbatch"
else
  bad "--submit: $out"
fi
out=$(PATH=$tmp/sb:$PATH FAKE_SBATCH_IN=/dev/null FAKE_SBATCH_RC=3 "$fl" "${args[@]}" --submit 2>&1)
if [ $? -ne 0 ] && echo "$out" | grep -q "sbatch failed (exit status 3)"; then ok "sbatch failure reported"; else bad "sbatch failure: $out"; fi

# the default template lookup (FL_SLURM_TEMPLATE) and refusals
if FL_SLURM_TEMPLATE=$tmpl "$fl" slurm --model m --input i --output o | cmp -s - <("$fl" slurm --template "$tmpl" --model m --input i --output o); then
  ok "FL_SLURM_TEMPLATE"
else
  bad "FL_SLURM_TEMPLATE"
fi
expect_error() { # name pattern cmd...
  local name=$1 pat=$2
  shift 2
  "$@" >/dev/null 2>"$tmp/err"
  local rc=$?
  if [ $rc -ne 0 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grep -q -- "$pat" "$tmp/err"; then ok "$name"; else bad "$name (rc=$rc): $(cat "$tmp/err")"; fi
}
expect_error "missing --model" "are required" "$fl" slurm --template "$tmpl" --input i --output o
expect_error "bad --nodes" "nodes" "$fl" slurm --template "$tmpl" --model m --input i --output o --nodes zero
expect_error "line break in --partition" "line break" "$fl" slurm --template "$tmpl" --model m --input i --output o --partition $'gpu\n#SBATCH --x'
expect_error "missing template" "$tmp/none.in" "$fl" slurm --template "$tmp/none.in" --model m --input i --output o
{ head -n 3 "$tmpl"; echo "#SBATCH --qos=@QOS@"; } >"$tmp/typo.in"
expect_error "unknown placeholder named with its line" "typo.in:4: unknown placeholder @QOS@" "$fl" slurm --template "$tmp/typo.in" --model m --input i --output o

# --config: one YAML file for the whole job (generate options at the top,
# Slurm's under slurm:); flags override it; the script hands the file on to
# generate, which skips the slurm: section.
cat >"$tmp/job.yaml" <<EOF
model: $demo
input: $tmp/req1.jsonl
output: $tmp/cfg-out.jsonl
max_tokens: 2
backend: cpu
slurm:
  nodes: 3
  gpus_per_node: 0
  tasks_per_node: 2
  partition: batch
  time: "2:00:00"
EOF
echo '{"custom_id": "x", "body": {"prompt": "Hi", "max_tokens": 2}}' >"$tmp/req1.jsonl"
if "$fl" slurm --template "$tmpl" --config "$tmp/job.yaml" --time 0:30:00 >"$tmp/cfg.sbatch" 2>"$tmp/err" &&
   has "$tmp/cfg.sbatch" "#SBATCH --nodes=3" && has "$tmp/cfg.sbatch" "#SBATCH --ntasks-per-node=2" &&
   has "$tmp/cfg.sbatch" "#SBATCH --partition=batch" && has "$tmp/cfg.sbatch" "#SBATCH --time=0:30:00" &&
   ! grep -q "gpus-per-node" "$tmp/cfg.sbatch" &&
   grep -A1 '^srun ' "$tmp/cfg.sbatch" | tail -1 | grep -qF -- "generate --config $tmp/job.yaml --model $demo" &&
   grep -A1 '^srun ' "$tmp/cfg.sbatch" | tail -1 | grep -qF -- "--backend cpu"; then
  ok "--config: Slurm options from its slurm: section, flags win, the file passed on to generate"
else
  bad "--config script: $(cat "$tmp/err") $(cat "$tmp/cfg.sbatch")"
fi
if "$fl" generate --config "$tmp/job.yaml" >"$tmp/gen.log" 2>&1 && [ "$(wc -l <"$tmp/cfg-out.jsonl")" = 1 ]; then
  ok "generate reads the same job file (skips its slurm: section)"
else
  bad "generate --config job file: $(tail -3 "$tmp/gen.log")"
fi
printf 'model: m\ninput: i\noutput: o\nslurm:\n  nodes: 2\n  gpus: 4\n' >"$tmp/bad-slurm.yaml"
expect_error "unknown key in the slurm: section, with its line" "bad-slurm.yaml:6: unknown key 'gpus' in the slurm: section" \
  "$fl" slurm --template "$tmpl" --config "$tmp/bad-slurm.yaml"
printf 'model: m\ninput: i\noutput: o\nnodes: 2\n' >"$tmp/top-slurm.yaml"
expect_error "a Slurm option at the top level is sent under slurm:" "top-slurm.yaml:4: 'nodes' is a Slurm option: put it under slurm:" \
  "$fl" slurm --template "$tmpl" --config "$tmp/top-slurm.yaml"
printf 'model: m\nsampling:\n  top_k: 4\n' >"$tmp/nested.yaml"
expect_error "another nested mapping is refused" "nested.yaml:3: key 'sampling' has a nested mapping" \
  "$fl" generate --config "$tmp/nested.yaml" --input i --output o

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
