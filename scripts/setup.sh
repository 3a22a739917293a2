#!/usr/bin/env bash
# setup.sh — installs what a fresh Debian 12 machine needs to build and test
# flotilla. Idempotent: installs only what is missing and is quiet when all
# is there. Needs root (or sudo) only when something is missing.
set -euo pipefail

pkgs=(build-essential cmake pkg-config git python3 python3-pip
      libopenmpi-dev openmpi-bin libhwloc-dev libcmocka-dev
      libcjson-dev libpcre2-dev libutf8proc-dev libyaml-dev libmicrohttpd-dev
      slurmctld slurmd slurm-client munge libpmix-dev
      clang libclang-rt-14-dev gnuplot-nox)
# Slurm and munge: tests/test_slurm_cluster.sh starts a one-node cluster
# (--no-install-recommends: no daemon is started or enabled by installing).
# libpmix-dev: Debian 12's Slurm PMIx plug-in (mpi_pmix_v4, in
# slurm-wlm-basic-plugins) dlopens /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so,
# a file only the -dev package ships (libopenmpi-dev pulls it in too; named
# here because `srun --mpi=pmix` needs it, not the compiler).
# clang and libclang-rt-14-dev (libFuzzer and clang's sanitizer runtimes):
# scripts/fuzz.sh builds the fuzz targets.
# gnuplot-nox: scripts/plot-sweep.sh draws `bench --sweep-csv` files.
# libmicrohttpd-dev: the HTTP server of `flotilla serve`.

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq >/dev/null
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The official openai package: tests/check_openai_batch.py validates batch
# results with its Completion / ChatCompletion types (Debian 12 has no
# package for it; pip's --break-system-packages is needed outside a venv).
if ! python3 -c "import openai" 2>/dev/null; then
  echo "setup: installing the openai Python package" >&2
  python3 -m pip install --quiet --break-system-packages openai >/dev/null ||
    echo "setup: pip install openai failed; check_openai_batch.py runs its strict checks alone" >&2
fi

# prometheus_client: the serve tests read GET /metrics with its own text
# parser (tests/prom_check.py; under FL_CI=1 its absence fails them).
if ! python3 -c "import prometheus_client" 2>/dev/null; then
  echo "setup: installing the prometheus_client Python package" >&2
  python3 -m pip install --quiet --break-system-packages prometheus_client >/dev/null ||
    echo "setup: pip install prometheus_client failed; the serve tests need it under FL_CI=1" >&2
fi

# gguf-py (llama.cpp's Python package) and numpy: the generators of the GGUF
# fixtures (tests/gguf/make_*.py) write files and reference dequantizations
# with them. The tests only read the committed fixtures, so this is optional.
if ! python3 -c "import gguf, numpy" 2>/dev/null; then
  echo "setup: installing the gguf and numpy Python packages" >&2
  python3 -m pip install --quiet --break-system-packages "gguf==0.17.1" numpy >/dev/null ||
    echo "setup: pip install gguf failed; only regenerating GGUF fixtures needs it" >&2
fi
