#!/usr/bin/env bash
# test.sh — sets up, builds with AddressSanitizer + UndefinedBehaviorSanitizer
# and runs the whole test suite through ctest. FL_SANITIZE=0 builds without
# sanitizers (build/ instead of build-asan/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/fetch_demo_model.sh
# llama.cpp's ggml-vocab-* files: real vocabularies with Hugging Face's ids for
# test strings (tests/test_gguf_vocab.c; under FL_CI=1 their absence fails it)
scripts/llama-cpp-src.sh vocab >/dev/null
if [ "${FL_SANITIZE:-1}" = 1 ]; then
  dir=build-asan
  scripts/build.sh "$dir" -DFL_SANITIZE=ON -DFL_CUDA=OFF
else
  dir=build
  scripts/build.sh "$dir"
fi
export FL_DEMO_GGUF=$PWD/models/SmolLM2-135M-Instruct.Q4_1.gguf
# setup.sh installed the Slurm daemons and the demo model is fetched: the
# tests that would skip without them (test_slurm_cluster.sh, test_gguf's
# demo model check) fail instead under FL_CI=1
export FL_CI=${FL_CI:-1}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# throughput under sanitizers means nothing: keep the tokenizer benchmark's
# text small here (tests/test_tok_bench.c; run it unsanitized to measure)
export FL_TOK_BENCH_MB=${FL_TOK_BENCH_MB:-2}
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
# Open MPI's memory patcher rewrites the entry points of munmap and friends,
# which libasan has intercepted already: now and then a rank then calls
# through a null pointer in MPI_Init (open-mpi/ompi#13069, #1654). Its hooks
# serve RDMA registration caches, which these runs do not use.
export OMPI_MCA_memory=^patcher
export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp:print_suppressions=0
# hwloc's PCI plugin is dlclose'd with allocations LeakSanitizer can no longer
# name; CI machines have no GPU, so PCI discovery has nothing to find anyway.
export HWLOC_COMPONENTS=-pci
ctest --test-dir "$dir" --output-on-failure -j 2
# Every parser under libFuzzer for a short while (the seeds and past crashes
# were replayed by ctest above; this looks for new ones). The seed is fixed
# so a test run explores the same inputs every time and a red run is a
# regression, not luck; scripts/fuzz.sh 600 (random seeds) is the real
# search. FL_FUZZ_SECONDS=0 skips it.
if [ "${FL_FUZZ_SECONDS:-20}" != 0 ]; then
  FL_FUZZ_ARGS="-seed=${FL_FUZZ_SEED:-1} ${FL_FUZZ_ARGS:-}" scripts/fuzz.sh "${FL_FUZZ_SECONDS:-20}"
fi
# The CUDA backend compiles wherever nvcc exists (sanitizers and nvcc do not
# mix, so it gets its own build); without a GPU its tests check that the
# backend reports FL_ERR_UNSUPPORTED and skip the rest. On a GPU machine use
# scripts/gpu-check.sh.
if command -v nvcc >/dev/null 2>&1 && [ "${FL_SANITIZE:-1}" = 1 ]; then
  scripts/build.sh build-cuda -DFL_CUDA=ON
  # test_mem_plan_rss compares predicted with measured RSS, which only an
  # unsanitized build can measure.
  ctest --test-dir build-cuda --output-on-failure -R 'cuda|test_mem_plan_rss'
fi
