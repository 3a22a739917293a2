#!/usr/bin/env bash
# llama-cpp-src.sh src|vocab — the pinned llama.cpp source that the
# llama-cpp-python sdist vendors (vendor/llama.cpp), fetched once from PyPI
# into .deps/ (git-ignored); prints the directory it made.
#   src    the whole tree at .deps/llama.cpp-py$VER (scripts/llama-bench-side.sh)
#   vocab  only models/ggml-vocab-* (real vocabularies and the token ids Hugging
#          Face tokenizers gave for their test strings) at
#          .deps/ggml-vocab-py$VER (tests/test_gguf_vocab.c)
# Pinned so every comparison and test uses the same llama.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=0.3.9
what=${1:-}
case "$what" in
  src) dest=.deps/llama.cpp-py$ver; member="llama_cpp_python-$ver/vendor/llama.cpp" ;;
  vocab) dest=.deps/ggml-vocab-py$ver; member="llama_cpp_python-$ver/vendor/llama.cpp/models/ggml-vocab-*" ;;
  *) echo "usage: $0 src|vocab" >&2; exit 2 ;;
esac
if [ -e "$dest/.complete" ]; then echo "$dest"; exit 0; fi
sdist=.deps/dl/llama_cpp_python-$ver.tar.gz
if [ ! -s "$sdist" ]; then
  mkdir -p .deps/dl
  python3 -m pip download -q --no-binary :all: --no-deps -d .deps/dl "llama-cpp-python==$ver" >&2
fi
tmp=$(mktemp -d .deps/extract.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$sdist" -C "$tmp" --wildcards "$member"
rm -rf "$dest"
if [ "$what" = src ]; then
  mv "$tmp/llama_cpp_python-$ver/vendor/llama.cpp" "$dest"
else
  mv "$tmp/llama_cpp_python-$ver/vendor/llama.cpp/models" "$dest"
fi
touch "$dest/.complete"
echo "$dest"
