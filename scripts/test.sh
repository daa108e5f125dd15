#!/usr/bin/env bash
# Install everything (scripts/install.sh) and run the test suite: lint, then the tests this
# machine can run. Tests that need what the machine lacks (a GPU, root for network namespaces)
# skip with the reason; the soft-RoCE stage boots its own QEMU guest.
# pytest's "no tests collected" (exit 5) is a failure here, like any other non-zero exit.
#
# Sampled by default (tests/ci_sample.py): every fast test, the core end-to-end modules, and a
# seeded sample of the other SGLang cluster modules, so that the run stays near 30 minutes on a
# 2-core box. `LYNX_TEST_SAMPLE=all bash scripts/test.sh` runs every module (about an hour);
# `LYNX_TEST_SEED=X` repeats a sample (default: the checked-out commit). docs/testing.md says what
# runs where and how long each stage takes.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
START=$SECONDS
STAGE_START=$SECONDS
STAGE=""
stage() {
  [ -n "$STAGE" ] && printf '===== %s took %d s =====\n' "$STAGE" $((SECONDS - STAGE_START))
  STAGE=$*; STAGE_START=$SECONDS
  [ -n "$STAGE" ] && printf '\n===== %s =====\n' "$STAGE"
  return 0
}
stage "install"
scripts/install.sh
PY=.venv/bin/python
export LYNX_TEST_SAMPLE=${LYNX_TEST_SAMPLE:-ci}
export LYNX_TEST_SEED=${LYNX_TEST_SEED:-$(git rev-parse --short HEAD 2>/dev/null || date +%F)}

stage "ruff"
"$PY" -m ruff check .

stage "pytest (host)"
"$PY" -m pytest tests --durations=25 "$@"

stage "an older SGLang release (sampled)"
# One supported release besides the venv's, drawn by the seed: its wheel in front (PYTHONPATH), the
# in-process suites (~1 min). `scripts/sglang_matrix.sh` runs every release's full suites.
scripts/sglang_matrix.sh --sample "$LYNX_TEST_SEED"

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
  LYNX_TEST_SAMPLE="$LYNX_TEST_SAMPLE" LYNX_TEST_SEED="$LYNX_TEST_SEED" \
  "$PY" -m pytest -m rdma_vm tests/transport tests/sglang/test_conn_*.py \
  tests/sglang/test_pd_lynx_verbs.py -v
stage ""
printf '===== all stages: %d s =====\n' $((SECONDS - START))
