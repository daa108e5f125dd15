#!/usr/bin/env bash
# One-call check of the codec on a CUDA machine (the `device` tool's H100 / H200): the Triton
# kernels bit for bit against the CPU references, their throughput as ratios to a device copy, a
# layer-streamed encode with CUDA events under a synthetic forward, and the codec's tests with
# Triton compiled. Everything lands in $OUT/gpu_check.json (scripts/gpu_check.py says what each
# check measures); exit status 1 if any check fails. Never run on a GPU yet.
#
#   OUT=/tmp/gpu-out bash scripts/gpu_check.sh                                # on the CUDA machine
#   LYNX_GPU_CHECK_DEVICE=cpu OUT=/tmp/gpu-rehearsal bash scripts/gpu_check.sh  # the rehearsal
#
# The rehearsal runs the same steps on CPU tensors (Triton interpreted, small shapes, nvidia-smi
# skipped, a host stand-in for CUDA events) so that a bug in this script costs no device minutes;
# tests/kernels/test_gpu_check.py runs it. The GPU machine has torch, triton, pytest and hypothesis
# but nothing from this project's other dependencies, no network and no .git: set
# LYNX_GPU_CHECK_COMMIT to the commit sent to record it. gcc may be missing there: the C codec is
# then not built and the comparisons with it are left out (null in the JSON).
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the script runs from the repository root
DEVICE=${LYNX_GPU_CHECK_DEVICE:-cuda}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
case $DEVICE in
  cuda)
    PY=${PYTHON:-python3}
    # Offline, into the machine's own environment (a lent machine is thrown away afterwards, so
    # a system Python's "externally managed" guard is overridden; older pips ignore the variable).
    if PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install -q --no-deps --no-build-isolation \
        --no-index -e . >"$OUT/install.log" 2>&1; then
      install=ok
    else
      # Go on rather than lose the call: lynx_kernels straight from this tree (the package is
      # kernels/) without the C codec; the install check fails and install.log says why.
      install="failed: see install.log"
      shim=$(mktemp -d)
      ln -s "$PWD/kernels" "$shim/lynx_kernels"
      export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
    fi ;;
  cpu)
    PY=${PYTHON:-.venv/bin/python}
    export TRITON_INTERPRET=1
    install="skipped: the CPU rehearsal runs in the environment that has this tree installed" ;;
  *)
    echo "LYNX_GPU_CHECK_DEVICE must be cuda or cpu, got $DEVICE" >&2
    exit 2 ;;
esac
exec "$PY" scripts/gpu_check.py --device "$DEVICE" --out "$OUT" --install "$install"
