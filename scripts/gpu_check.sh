#!/usr/bin/env bash
# One-call GPU check for the `device` tool's H200 (or any CUDA machine): the codec's tests on CUDA
# (Triton kernels compiled, not interpreted), the exact Residual's round trip on the GPU and its
# bytes against the CPU reference, and codec throughput as ratios to a device copy; JSON into $OUT.
#
#   OUT=/tmp/gpu-out bash scripts/gpu_check.sh
#
# The GPU machine has torch, triton, pytest and hypothesis but nothing from this project's
# other dependencies, and no network: only the codec (lynx_kernels) is exercised there. gcc may be
# missing: the C codec is then not built and its tests skip.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0

"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install failed"; cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" || status=1
"$PY" -c 'import lynx_kernels.ops_cpu as c; print("C codec:", c.isa() if c.available() else c.unavailable_reason())'

echo "== exact Residual on CUDA: round trip, and the same bytes as the CPU reference"
"$PY" - "$OUT/exact_cuda.json" <<'EOF' || status=1
import json, sys
import numpy as np, torch
from lynx_kernels import CodecSpec, fused, ops_cpu

def stream(pool, slots, spec, kind, impl):
    sizes = fused.run_nbytes(spec, kind, pool.dtype, pool.shape[1], pool.shape[2], len(slots), 256)
    a, r = np.zeros(sizes.anchor, np.uint8), np.zeros(sizes.residual_bound, np.uint8)
    na, nr = fused.encode_run_into(pool, slots, spec, kind, 0, 256, 1, a, r, impl=impl)
    return a[:na].tobytes(), r[:nr].tobytes(), sizes.residual_bound

results, ok = [], True
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for rotate in (True, False):
        for kind in "kv":
            spec = CodecSpec(target="exact", rotate=rotate)
            x = (torch.randn(1000, 8, 128, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
            x[5, 2, :4] = torch.tensor([0.0, -0.0, float("inf"), 1e-40]).to(dtype)
            slots = torch.randperm(1000)
            cpu = stream(x, slots, spec, kind, "torch")
            gpu = stream(x.cuda(), slots.cuda(), spec, kind, "triton")
            c = stream(x, slots, spec, kind, "cpu") if ops_cpu.available() else None
            pool = torch.zeros_like(x).cuda()
            fused.apply_residual_run(gpu[0], gpu[1], pool, slots.cuda(), spec, kind, 0, 1, 1000, impl="triton")
            exact = torch.equal(pool.cpu().view(torch.uint8), x.view(torch.uint8))
            anchor_pool = torch.zeros_like(x).cuda()
            fused.apply_anchor_run(gpu[0], anchor_pool, slots.cuda(), spec, kind, 0, 1, 1000, impl="triton")
            ref_pool = torch.zeros_like(x)
            fused.apply_anchor_run(cpu[0], ref_pool, slots, spec, kind, 0, 1, 1000, impl="torch")
            row = {"dtype": str(dtype), "rotate": rotate, "kind": kind, "roundtrip_exact": exact,
                   "bytes_equal_cpu_torch": gpu[:2] == cpu[:2],
                   "bytes_equal_cpu_c": None if c is None else gpu[:2] == c[:2],
                   "anchor_values_equal_cpu": torch.equal(anchor_pool.cpu().view(torch.uint8),
                                                          ref_pool.view(torch.uint8)),
                   "residual_fraction_of_bound": len(gpu[1]) / cpu[2]}
            ok &= exact and row["bytes_equal_cpu_torch"] and row["anchor_values_equal_cpu"] \
                and row["bytes_equal_cpu_c"] is not False
            results.append(row)
            print(row)
json.dump({"ok": ok, "cases": results}, open(sys.argv[1], "w"), indent=2)
sys.exit(0 if ok else 1)
EOF

echo "== codec tests on CUDA"
"$PY" -m pytest tests/kernels -q -p no:cacheprovider --junitxml="$OUT/kernels-junit.xml" \
  2>&1 | tee "$OUT/kernels-tests.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== codec throughput vs a device copy (goal >= 0.8): Triton, bf16, Llama-3.1-8B layer, 32k tokens"
"$PY" scripts/bench_codec.py --device cuda --api tensors --tokens 32768 --repeats 20 \
  --json "$OUT/bench_codec_cuda_tensors.json" || status=1
echo "== the serving calls (wire bytes in host memory, exact coding as torch ops on the GPU)"
"$PY" scripts/bench_codec.py --device cuda --api fused --impls triton --tokens 8192 --repeats 5 \
  --json "$OUT/bench_codec_cuda_fused.json" || status=1
exit $status
