#!/usr/bin/env bash
# Install everything (scripts/install.sh) and run the whole test suite: lint, then every test this
# machine can run. Tests that need what the machine lacks (a GPU, root for network namespaces)
# skip with the reason; the soft-RoCE stage boots its own QEMU guest.
# pytest's "no tests collected" (exit 5) is a failure here, like any other non-zero exit.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
scripts/install.sh
PY=.venv/bin/python
stage() { printf '\n===== %s =====\n' "$*"; }

stage "ruff"
"$PY" -m ruff check .

stage "pytest (host)"
"$PY" -m pytest tests "$@"

stage "soft-RoCE guest (verbs backend)"
# QEMU guest with rdma_rxe (scripts/rdma_vm.sh); runs the `rdma_vm` tests against a real RDMA device:
# the transport's verbs backend, Lynx's prefill/decode KV managers over verbs (SGLang's own KVArgs
# and KV pool), and one request through real SGLang servers (a single server, then prefill +
# decode + router with --lynx-transport verbs: under CPU emulation each server takes minutes to
# start: this stage took 18 min on an idle box, ~30 min under load). The guest's HOME is a tmpfs: it reads the
# embedded model the host converted (read-only, through the guest's 9p view of the host).
MODEL_CACHE=$("$PY" -c 'from lynx_tools.model import cache_dir, embedded_model_dir
embedded_model_dir(); print(cache_dir())')
scripts/rdma_vm.sh --timeout 3600 --mem 10240 -- env LYNX_SGLANG_CACHE="$MODEL_CACHE" \
  "$PY" -m pytest -m rdma_vm tests/transport tests/sglang/test_conn_loopback.py \
  tests/sglang/test_pd_lynx_verbs.py -v
