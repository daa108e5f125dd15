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
# the transport's verbs backend, and Lynx's prefill/decode KV managers over verbs (SGLang's own
# KVArgs and KV pool, no servers: SGLang servers take far too long to start in the emulated guest).
scripts/rdma_vm.sh --timeout 1500 --mem 4096 -- "$PY" -m pytest -m rdma_vm tests/transport \
  tests/sglang/test_conn_loopback.py -v
