#!/usr/bin/env bash
# The main job: install everything (scripts/install.sh), then the CPU PD demo: SGLang's
# mooncake_tcp (no idle spin) vs Lynx exact and int8, interleaved, on a link shaped for R = 4 when
# root (lynx-sglang demo --help; extra arguments go to it).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
scripts/install.sh
mkdir -p out
.venv/bin/lynx-sglang demo --out out "$@"
