"""scripts/gpu_check.py's `compiled_kernels` check: what the compiler promised for each Triton
kernel without a GPU (results/gpu_compile.json, written by scripts/gpu_check_compile.py: registers,
spills, shared memory for sm_80 and sm_90) beside what the kernels that ran in this process were
loaded with on the device (`CompiledKernel.n_regs`, `n_spills`, `metadata.shared`), matched by
kernel and constexprs. Reported, not a pass condition: the check fails only if the JSON is
missing or unreadable. The CPU rehearsal prints the promised figures alone (interpreted kernels
have no cubin)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "gpu_compile.json"


def _loaded_kernels() -> dict[tuple[str, str], dict]:
    """(kernel, constexprs as JSON) -> the device's figures, for every kernel this process has
    compiled and loaded (Triton's per-device JIT caches)."""
    from gpu_check_compile import jit_functions  # this folder is on sys.path

    out = {}
    device = torch.cuda.current_device()
    for name, kernel in jit_functions().items():
        caches = getattr(kernel, "device_caches", {})
        if device not in caches:
            continue
        for compiled in caches[device][0].values():
            src = compiled.src
            consts = {src.fn.arg_names[k[0]]: v for k, v in sorted(src.constants.items())}
            compiled._init_handles()  # loaded at its first launch already; fills n_regs
            out[(name, json.dumps(consts))] = {
                "registers": compiled.n_regs, "spills": compiled.n_spills,
                "shared_bytes": compiled.metadata.shared}
    return out


def check_compiled_kernels(device: str):
    doc = json.loads(RESULTS.read_text())
    arch = "sm_90"
    loaded: dict = {}
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
        loaded = _loaded_kernels()
    promised_arch = arch if arch in doc["targets"] else doc["targets"][-1]
    rows, lines = [], [f"{'kernel':30} {'constexprs':60} promised ({promised_arch}) | "
                       f"{'device (' + arch + ')' if device == 'cuda' else 'device: n/a'}"]
    for k in doc["kernels"]:
        promised = k[promised_arch]
        ran = loaded.get((k["kernel"], json.dumps(k["constexprs"])))
        rows.append({"kernel": k["kernel"], "constexprs": k["constexprs"],
                     "promised": promised, "device": ran})
        consts = " ".join(f"{n}={v}" for n, v in k["constexprs"].items())[:60]
        cell = ("not launched here" if ran is None else
                f"reg {ran['registers']} spills {ran['spills']} smem {ran['shared_bytes']}")
        lines.append(f"{k['kernel']:30} {consts:60} reg {promised['registers']} stack "
                     f"{promised['stack_bytes']} smem {promised['shared_bytes']} | "
                     f"{cell if device == 'cuda' else 'interpreted'}")
    print("\n".join(lines), flush=True)
    differ = [r for r in rows if r["device"] is not None and (
        r["device"]["registers"] != r["promised"]["registers"]
        or r["device"]["shared_bytes"] != r["promised"]["shared_bytes"]
        or r["device"]["spills"] != 0)]
    return True, {"json": str(RESULTS.relative_to(ROOT)), "triton_of_json": doc["triton"],
                  "device_arch": arch if device == "cuda" else "needs CUDA (CPU rehearsal)",
                  "promised_arch": promised_arch,
                  "launched_here": sum(r["device"] is not None for r in rows),
                  "differ_from_promise": differ, "kernels": rows}
