#!/usr/bin/env bash
# The main job: install everything (scripts/install.sh), then run the CPU demo.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
scripts/install.sh
mkdir -p out
for model in SmolLM2-135M Llama-3.1-8B; do
  .venv/bin/lynx-sglang codec-report --model "$model" --json "out/codec_report_$model.json"
  echo
done
