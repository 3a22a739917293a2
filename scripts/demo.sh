#!/usr/bin/env bash
# demo.sh — sets up, builds, fetches SmolLM2-135M-Instruct and runs an
# offline batch generation over examples/prompts.jsonl, printing the
# completions.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
scripts/fetch_demo_model.sh
mkdir -p out
build/flotilla generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --input examples/prompts.jsonl --output out/demo.jsonl --overwrite --max-tokens 64 --verbose
python3 - <<'PY'
import json
for line in open("out/demo.jsonl"):  # OpenAI Batch output lines
    r = json.loads(line)
    body = r["response"]["body"]
    if "error" in body:
        print(f"--- {r['custom_id']} (error)\n{body['error']['message']}")
        continue
    c = body["choices"][0]
    print(f"--- {r['custom_id']} ({c['finish_reason']}, {body['usage']['completion_tokens']} tokens)")
    print(c["text"] if "text" in c else c["message"]["content"])
PY
