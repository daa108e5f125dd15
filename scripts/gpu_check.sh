#!/usr/bin/env bash
# One-call GPU check for the `device` tool's H200 (or any CUDA machine): the codec's tests on CUDA
# (Triton kernels compiled, not interpreted) and the codec bandwidth benchmark, JSON into $OUT.
#
#   OUT=/tmp/gpu-out bash scripts/gpu_check.sh
#
# The GPU machine has torch, triton, pytest and hypothesis but nothing from this project's
# other dependencies, and no network: only the codec (lynx_kernels) is exercised there.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0

"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install failed"; cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" || status=1

echo "== codec tests on CUDA"
"$PY" -m pytest tests/kernels -q -p no:cacheprovider --junitxml="$OUT/kernels-junit.xml" \
  2>&1 | tee "$OUT/kernels-tests.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== codec bandwidth vs copy (Triton, bf16, Llama-3.1-8B layer at 32k tokens)"
for kind in k v; do
  for target in int8 exact; do
    "$PY" scripts/bench_codec.py --device cuda --impl auto --kind "$kind" --target "$target" \
      --tokens 32768 --repeats 20 --json "$OUT/bench_codec_${kind}_${target}.json" || status=1
  done
done
exit $status
