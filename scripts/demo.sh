#!/usr/bin/env bash
# The main job: install everything (scripts/install.sh), then run the CPU PD demo: Lynx vs SGLang's
# mooncake_tcp backend on one link (1 Gbit/s shaped when root), one long-context request each.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
scripts/install.sh
mkdir -p out
.venv/bin/lynx-sglang demo --out out "$@"
