# lib.sh — shared by the script tests (sourced, never run): the TAP-like
# counters that end in "N passed, M failed", the environment Open MPI needs
# as root in CI, and the demo model's path.
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   - $1"; }
bad() { fail=$((fail + 1)); echo "FAIL - $1"; }
# Prints the closing line and returns the test's exit status.
finish() {
  echo "$pass passed, $fail failed"
  [ "$fail" -eq 0 ]
}

# mpirun as root, more ranks than cores, no leak checks inside MPI jobs
# (Open MPI keeps allocations LeakSanitizer cannot attribute).
fl_mpi_env() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
  export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
  export OMPI_MCA_mpi_yield_when_idle=1
  export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
}

# fl_byte_model SRC FIXTURE DIR: DIR = the golden FIXTURE's config and weights
# (links) with a byte-level tokenizer.json, so `flotilla generate` can run it.
fl_byte_model() {
  mkdir -p "$3"
  for f in config.json generation_config.json model.safetensors; do
    ln -sf "$(cd "$1/tests/golden/$2" && pwd)/$f" "$3/$f"
  done
  python3 "$1/tests/make_byte_tokenizer.py" "$3/tokenizer.json" \
    "$(python3 -c "import json; print(json.load(open('$3/config.json'))['vocab_size'])")"
}

# The demo model (scripts/fetch_demo_model.sh puts it there; tests/test.sh
# passes FL_DEMO_GGUF). Exits the test when it is missing.
fl_require_demo() {
  demo=${FL_DEMO_GGUF:-$1/models/SmolLM2-135M-Instruct.Q4_1.gguf}
  if [ ! -f "$demo" ]; then
    echo "FAIL - demo model missing at $demo (scripts/fetch_demo_model.sh)"
    exit 1
  fi
}

# fl_check_plot SCRIPT CSV PNG FOREIGN REFUSAL WORKDIR: SCRIPT (a gnuplot
# plot script) draws CSV into a real PNG, and refuses FOREIGN (a file of
# another kind) with a message holding REFUSAL. gnuplot comes from
# scripts/setup.sh: without it the checks fail in CI and skip elsewhere.
fl_check_plot() {
  local script=$1 csv=$2 png=$3 foreign=$4 refusal=$5 w=$6 name
  name=$(basename "$script")
  if ! command -v gnuplot >/dev/null; then
    if [ "${FL_CI:-0}" = 1 ]; then bad "gnuplot is missing (scripts/setup.sh installs gnuplot-nox)"
    else echo "SKIP: $name (no gnuplot)"; fi
    return
  fi
  if "$script" "$csv" "$png" >"$w/plot.out" 2>&1 &&
     [ "$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; then
    ok "$name writes a PNG"
  else
    bad "$name"; cat "$w/plot.out"
  fi
  if ! "$script" "$foreign" "$w/foreign.png" >"$w/plot2.out" 2>&1 && grep -q -- "$refusal" "$w/plot2.out"; then
    ok "$name refuses a file of another kind"
  else
    bad "$name on a foreign file"; cat "$w/plot2.out"
  fi
}

# fl_start_serve LOG CMD...: runs CMD (`flotilla serve --port 0 ...`, maybe
# under mpirun) in the background, its stderr to LOG; sets $spid and, once
# it listens, $port (up to 180 s). Fails when CMD exits first or never listens.
fl_start_serve() {
  local log=$1
  shift
  "$@" 2>"$log" &
  spid=$!
  port=
  for _ in $(seq 1 900); do
    port=$(sed -n 's|^flotilla serve: listening on http://[^:]*:\([0-9]*\) .*|\1|p' "$log")
    [ -n "$port" ] && return 0
    kill -0 "$spid" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}
