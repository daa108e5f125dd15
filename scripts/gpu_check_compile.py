#!/usr/bin/env python3
"""Every Triton kernel of the codec compiled for real GPUs (sm_80, sm_90) on a machine without one,
with the specializations the serving calls launch, and what each costs in registers, spills and
shared memory: `results/gpu_compile.json`.

Run by tests/kernels/test_gpu_compile.py (CI: compiles everything and fails on any compile error
or on a result that differs from the committed JSON) and by hand after a kernel change:

    .venv/bin/python scripts/gpu_check_compile.py --write   # regenerate results/gpu_compile.json
    .venv/bin/python scripts/gpu_check_compile.py --check   # compare with it (exit 1 if it differs)

scripts/gpu_check.py reads the JSON on a lent device and prints it beside the figures of the
kernels that ran there.

Why recorded and not a table: the launch arguments come from the serving calls themselves
(`fused.encode_run_into`, `apply_anchor_run`, `apply_residual_run`, impl "triton") run on small
CPU pools with Triton's interpreter, for each serving case (`CASES`: SmolLM2-135M's 3 KV heads x 64
and Llama-3.1-8B's 8 x 128, bf16 / fp16 / fp32, targets int8 and exact, K and V, the 4-bit Anchor
of `CodecSpec()` and the 3-bit one `--lynx-anchor-width adaptive` may pick). Each kernel's `run`
is wrapped while they do, and its arguments bound by Triton's own binder, so a launcher that
changes a block size, a dtype or a constexpr changes what is compiled here. Then one process per
GPU target (no interpreter) compiles each distinct specialization with `triton.compile` and reads
the cubin's resource usage with the wheel's own cuobjdump. Triton's on-disk cache
(`~/.triton/cache`, TRITON_CACHE_DIR) keeps the compiled kernels, so a second run only records
and reads them back.

Token counts do not change what is compiled: the kernels' integer arguments are not specialized
(`do_not_specialize`), and every array argument is a fresh or contiguous tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "gpu_compile.json"
ARCHS = (80, 90)
# Where the project's @triton.jit functions live; `jit_sources` fails if one appears elsewhere.
TRITON_MODULES = ("lynx_kernels.ops_triton", "lynx_kernels.exact_triton")
SOURCE_DIRS = ("kernels", "lynx_sglang", "transport", "tools", "scripts")
MODELS = ("SmolLM2-135M", "Llama-3.1-8B")
DTYPES = ("bfloat16", "float16", "float32")
# A run of TOKENS tokens, 2 of them quantized (past the default 4 sink and 16 recent ones), in one
# chunk (K grouped per channel is cut on multiples of the group size, 64): every kernel of a run
# launches, and the interpreter's time, which grows with the values (the exact decode's most:
# ~0.1 s per block of 256), stays small.
TOKENS = 22
CHUNK_TOKENS = 64
# Per-target figures that must match the committed JSON (compile times are measured, not compared).
COMPARED = ("registers", "stack_bytes", "spill_stores", "spill_loads", "local_bytes",
            "shared_bytes", "num_warps")


@dataclass(frozen=True)
class ServingCase:
    """One (layer, kind) run of the serving calls: encode, apply the Anchor, apply the Residual."""

    model: str
    dtype: str
    target: str
    kind: str
    anchor_bits: int

    @property
    def label(self) -> str:
        return (f"{self.model} {self.dtype} {self.target} {self.kind.upper()} "
                f"{self.anchor_bits}-bit Anchor")


def serving_cases(models: tuple[str, ...] = MODELS) -> list[ServingCase]:
    from lynx_kernels import CodecSpec

    bits = CodecSpec().anchor_bits
    return [ServingCase(m, d, t, k, b) for m in models for d in DTYPES for t in ("int8", "exact")
            for k in "kv" for b in (bits, bits - 1)]


@dataclass(frozen=True)
class Launch:
    """One specialization of a kernel as Triton's binder makes it from a launch's arguments:
    `specialization` is the binder's list of (type, divisibility attribute or constexpr value)
    per parameter, `options` the launch's compile options (enable_fp_fusion, num_warps, ...)."""

    kernel: str
    specialization: tuple
    options: tuple

    def key(self) -> str:
        return json.dumps([self.kernel, self.specialization, self.options])


@dataclass
class Resources:
    """What one compiled kernel needs per thread and block on one target (from the cubin)."""

    registers: int
    stack_bytes: int     # the stack frame: where ptxas puts spilled registers
    spill_stores: int    # local-memory store / load instructions in the SASS (STL / LDL)
    spill_loads: int
    local_bytes: int
    shared_bytes: int    # dynamic shared memory the launch asks for (Triton allocates it all so)
    num_warps: int
    compile_s: float


def jit_sources() -> list[str]:
    """The modules that define @triton.jit functions; RuntimeError if a file outside
    TRITON_MODULES has one (it would not be compiled here)."""
    found = set()
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if "@triton.jit" in path.read_text() and path != Path(__file__).resolve():
                found.add(path.relative_to(ROOT).with_suffix("").as_posix())
    expected = {"kernels/" + m.rsplit(".", 1)[1] for m in TRITON_MODULES}
    if found != expected:
        raise RuntimeError(f"@triton.jit functions in {sorted(found)}, but this script compiles "
                           f"the kernels of {sorted(expected)}: update TRITON_MODULES")
    return list(TRITON_MODULES)


def jit_functions() -> dict[str, object]:
    """Every @triton.jit function of TRITON_MODULES by "module.name" (JITFunction, or
    InterpretedFunction under TRITON_INTERPRET=1)."""
    import importlib

    from triton.runtime.jit import KernelInterface

    out = {}
    for name in jit_sources():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if isinstance(obj, KernelInterface) and obj.fn.__module__ == name:
                out[f"{name.rsplit('.', 1)[1]}.{attr}"] = obj
    return out


def helpers_of(functions: dict[str, object], launched: set[str]) -> dict[str, list[str]]:
    """For each @triton.jit function that is not launched, the launched kernels it is compiled
    into (called from their source, directly or through another helper)."""
    import inspect

    src = {name: inspect.getsource(f.fn) for name, f in functions.items()}
    calls = {name: {other for other in functions if other != name
                    and re.search(rf"\b{re.escape(other.split('.')[1])}\(", src[name])}
             for name in functions}
    out = {}
    for helper in sorted(set(functions) - launched):
        users = set()
        for kernel in launched:
            seen, todo = set(), [kernel]
            while todo:
                f = todo.pop()
                if f == helper:
                    users.add(kernel)
                for g in calls[f] - seen:
                    seen.add(g)
                    todo.append(g)
        out[helper] = sorted(users)
    return out


# --- recording (a child process with TRITON_INTERPRET=1) ---------------------------------------


def _binder(kernel, backend):
    from triton.runtime.jit import JITFunction, create_function_from_signature

    # Under the interpreter the kernel is an InterpretedFunction; a JITFunction of the same Python
    # function, with the same jit arguments (do_not_specialize), binds as the compiled one would.
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    return jit, create_function_from_signature(jit.signature, jit.params, backend)


def record_launches(model: str) -> dict:
    """Run `model`'s serving cases with impl "triton" and return {"launches": [[Launch fields,
    [case labels]], ...], "kernels": [...], "helpers": {...}, "arg_names": {...}}."""
    import inspect

    import numpy as np
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from lynx_kernels import CodecSpec, exact_triton, fused, preset, wire, wire_write

    backend = make_backend(GPUTarget("cuda", max(ARCHS), 32))
    functions = jit_functions()
    seen: dict[str, tuple[Launch, list[str]]] = {}
    current: list[str] = []
    originals = {}

    def recorder(name, kernel):
        jit, bind = _binder(kernel, backend)
        original = kernel.run
        params = {p.name for p in jit.params}

        def run(*args, grid, warmup, **kwargs):
            _, specialization, options = bind(*args, **kwargs)
            launch = Launch(name, tuple(tuple(s) for s in specialization),
                            tuple(sorted((k, v) for k, v in options.items() if k not in params)))
            entry = seen.setdefault(launch.key(), (launch, []))
            if current[0] not in entry[1]:
                entry[1].append(current[0])
            return original(*args, grid=grid, warmup=warmup, **kwargs)

        return run

    for name, kernel in functions.items():
        originals[name] = kernel.run
        kernel.run = recorder(name, kernel)
    # The exact Residual's section coder as a CUDA pool gets it (a CPU pool gets the reference).
    coder = wire.section_coder
    wire.section_coder = wire_write.section_coder = (
        lambda device: (exact_triton.encode_sections, exact_triton.decode_sections))
    try:
        for case in serving_cases((model,)):
            current[:] = [case.label]
            shape = preset(case.model)
            spec = CodecSpec(target=case.target, anchor_bits=case.anchor_bits)
            gen = torch.Generator().manual_seed(1)
            rows = TOKENS + 5  # the run at shuffled rows of a larger pool, as in a server
            pool = (torch.randn(rows, shape.num_kv_heads, shape.head_dim, generator=gen) * 3).to(
                getattr(torch, case.dtype))
            slots = torch.randperm(rows, generator=gen)[:TOKENS]
            sizes = fused.run_nbytes(spec, case.kind, pool.dtype, shape.num_kv_heads,
                                     shape.head_dim, TOKENS, CHUNK_TOKENS)
            anchor = np.zeros(sizes.anchor, np.uint8)
            residual = np.zeros(sizes.residual_bound, np.uint8)
            na, nr = fused.encode_run_into(pool, slots, spec, case.kind, 0, CHUNK_TOKENS, 1,
                                           anchor, residual, impl="triton")
            out = torch.zeros_like(pool)
            args = (out, slots, spec, case.kind, 0, 1, TOKENS)
            fused.apply_anchor_run(anchor[:na], *args, impl="triton")
            fused.apply_residual_run(anchor[:na], residual[:nr], *args, impl="triton")
    finally:
        wire.section_coder = wire_write.section_coder = coder
        for name, kernel in functions.items():
            kernel.run = originals[name]
    launched = {launch.kernel for launch, _ in seen.values()}
    return {"launches": [[asdict(launch), cases] for launch, cases in seen.values()],
            "kernels": sorted(functions), "helpers": helpers_of(functions, launched),
            "arg_names": {name: list(inspect.signature(f.fn).parameters)
                          for name, f in functions.items()}}


# --- compiling (one child process per target, no interpreter) ----------------------------------


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def cubin_resources(cubin: bytes) -> dict:
    """Registers, stack, shared and local memory (cuobjdump --dump-resource-usage), and the
    SASS's local-memory stores and loads (spills: Triton kernels keep no other local arrays),
    counted only where there is a stack frame or local memory for them (the SASS dump takes
    ~0.35 s a kernel, the resource usage ~0.01 s)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)",
                                                   usage.split("Function", 1)[1])}
        sass = ""
        if fields["STACK"] or fields["LOCAL"]:
            sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name],
                                  capture_output=True, text=True, check=True).stdout
    return {"registers": fields["REG"], "stack_bytes": fields["STACK"],
            "static_shared": fields["SHARED"], "local_bytes": fields["LOCAL"],
            "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            "spill_loads": len(re.findall(r"\bLDL\b", sass))}


def compile_launches(arch: int, launches: list[dict]) -> list[dict]:
    """Compile each launch for sm_`arch`: a list of Resources as dicts, or {"error": ...}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    functions = jit_functions()
    out = []
    for entry in launches:
        launch = Launch(entry["kernel"], tuple(tuple(s) for s in entry["specialization"]),
                        tuple(tuple(o) for o in entry["options"]))
        kernel = functions[launch.kernel]
        params = [p.name for p in kernel.params]
        values = [s[1] if s[0] == "constexpr" else None for s in launch.specialization]
        options = dict(launch.options)
        # The launch's own path from binder output to compiler input (`JITFunction.run`).
        options_obj, signature, constexprs, attrs = kernel._pack_args(
            backend, {**options, **{p: v for p, v in zip(params, values, strict=True)
                                    if v is not None}},
            dict(zip(params, values, strict=True)), list(launch.specialization), options)
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=target, options=options_obj.__dict__)
        except Exception as exc:  # a compile error is this script's finding: reported, not raised
            out.append({"error": f"{type(exc).__name__}: {exc}"[-3000:]})
            continue
        seconds = time.perf_counter() - t0
        res = cubin_resources(compiled.asm["cubin"])
        out.append(asdict(Resources(
            registers=res["registers"], stack_bytes=res["stack_bytes"],
            spill_stores=res["spill_stores"], spill_loads=res["spill_loads"],
            local_bytes=res["local_bytes"],
            shared_bytes=compiled.metadata.shared + res["static_shared"],
            num_warps=compiled.metadata.num_warps, compile_s=round(seconds, 3))))
    return out


# --- orchestration ------------------------------------------------------------------------------


def _child(args: list[str], interpret: bool, stdin: str = "") -> subprocess.Popen:
    """This script in a child process (with Triton's interpreter or without), reading `stdin`
    from a file: the children run side by side, none waits for its input to be read."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryFile("w+") as f:
        f.write(stdin)
        f.seek(0)
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], env=env,
                                stdin=f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT)


def _result(proc: subprocess.Popen, what: str):
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{stderr[-6000:]}")
    return json.loads(stdout)


def generate() -> dict:
    """Record the serving launches, compile them for every target (in parallel), and return the
    results document."""
    import triton

    t0 = time.perf_counter()
    # One process per model and then per target: this box has 2 cores.
    procs = {model: _child(["--record", model], interpret=True) for model in MODELS}
    recorded = {model: _result(proc, f"recording {model}'s serving launches")
                for model, proc in procs.items()}
    record_s = time.perf_counter() - t0
    merged: dict[str, tuple[dict, list[str]]] = {}
    for part in recorded.values():
        for entry, cases in part["launches"]:
            merged.setdefault(json.dumps(entry, sort_keys=True), (entry, []))[1].extend(cases)
    launches = list(merged.values())
    payload = json.dumps([entry for entry, _ in launches])
    t1 = time.perf_counter()
    procs = {arch: _child(["--compile", str(arch)], interpret=False, stdin=payload)
             for arch in ARCHS}
    per_arch = {arch: _result(proc, f"compiling for sm_{arch}")
                for arch, proc in procs.items()}
    compile_s = time.perf_counter() - t1
    helpers = {helper: sorted({u for part in recorded.values() for u in part["helpers"][helper]})
               for helper in recorded[MODELS[0]]["helpers"]}
    kernels = []
    arg_names = recorded[MODELS[0]]["arg_names"]
    for i, (entry, cases) in enumerate(launches):
        spec = list(zip(arg_names[entry["kernel"]], entry["specialization"], strict=True))
        kernels.append({
            "kernel": entry["kernel"],
            "signature": {name: s[0] for name, s in spec if s[0] != "constexpr"},
            "constexprs": {name: s[1] for name, s in spec if s[0] == "constexpr"},
            "specialization": entry["specialization"], "options": dict(entry["options"]), "used_by": cases,
            **{f"sm_{arch}": per_arch[arch][i] for arch in ARCHS}})
    kernels.sort(key=lambda k: (k["kernel"], json.dumps(k["specialization"])))
    return {
        "what": "every Triton kernel launch of the serving calls, compiled for CUDA targets "
                "without a GPU (scripts/gpu_check_compile.py; tests/kernels/test_gpu_compile.py)",
        "triton": triton.__version__, "targets": [f"sm_{a}" for a in ARCHS],
        "cases": [c.label for c in serving_cases()],
        "jit_functions": recorded[MODELS[0]]["kernels"], "helpers_compiled_into": helpers,
        "seconds": {"record": round(record_s, 1), "compile": round(compile_s, 1)},
        "kernels": kernels}


def errors(doc: dict) -> list[str]:
    """Compile errors, and @triton.jit functions compiled into no launched kernel."""
    out = [f"{k['kernel']} {k['constexprs']} sm_{a}: {k[f'sm_{a}']['error']}"
           for k in doc["kernels"] for a in ARCHS if "error" in k[f"sm_{a}"]]
    out += [f"{helper}: neither launched by a serving call nor called by a launched kernel"
            for helper, users in doc["helpers_compiled_into"].items() if not users]
    return out


def comparable(doc: dict) -> list:
    """What must match between a run and the committed JSON: each launch and its figures."""
    return [[k["kernel"], k["specialization"], k["options"], sorted(k["used_by"]),
             {f"sm_{a}": {f: k[f"sm_{a}"].get(f) for f in COMPARED} for a in ARCHS}]
            for k in doc["kernels"]] + [doc["triton"], doc["helpers_compiled_into"]]


def differences(new: dict, old: dict) -> list[str]:
    new = json.loads(json.dumps(new))  # as it would be read back (lists, not tuples)
    if new["triton"] != old.get("triton"):
        return [f"Triton {new['triton']} here, the JSON was made with {old.get('triton')}"]
    a, b = comparable(new), comparable(old)
    if a == b:
        return []
    old_keys = {json.dumps(x[:3]): x for x in b[:-2]}
    new_keys = {json.dumps(x[:3]): x for x in a[:-2]}
    out = [f"new launch {k}" for k in new_keys.keys() - old_keys.keys()]
    out += [f"launch gone {k}" for k in old_keys.keys() - new_keys.keys()]
    out += [f"changed {k}: {old_keys[k][3:]} -> {new_keys[k][3:]}"
            for k in new_keys.keys() & old_keys.keys() if new_keys[k] != old_keys[k]]
    if a[-1] != b[-1]:
        out.append(f"helpers: {b[-1]} -> {a[-1]}")
    return out or ["the JSON differs"]


def table(doc: dict) -> str:
    rows = [f"{'kernel':30} {'constexprs':72} " + " ".join(
        f"{'sm_' + str(a) + ' reg/stack/spill/smem':>26}" for a in ARCHS)]
    for k in doc["kernels"]:
        cells = []
        for a in ARCHS:
            r = k[f"sm_{a}"]
            cells.append(f"{'ERROR':>26}" if "error" in r else
                         f"{r['registers']:>8}/{r['stack_bytes']}/{r['spill_stores'] + r['spill_loads']}"
                         f"/{r['shared_bytes']:<8}".rjust(26))
        consts = " ".join(f"{n}={v}" for n, v in k["constexprs"].items()
                          if n not in ("BLOCK", "ESC_Q", "NCLS", "TILE", "U_TILES", "NO_ERROR"))
        rows.append(f"{k['kernel']:30} {consts[:72]:72} " + " ".join(cells))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="compare with the committed JSON")
    mode.add_argument("--record", choices=MODELS, help=argparse.SUPPRESS)
    mode.add_argument("--compile", type=int, metavar="ARCH", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.record:
        json.dump(record_launches(args.record), sys.stdout)
        return 0
    if args.compile is not None:
        json.dump(compile_launches(args.compile, json.load(sys.stdin)), sys.stdout)
        return 0
    doc = generate()
    print(table(doc))
    print(f"recorded in {doc['seconds']['record']} s, compiled {len(doc['kernels'])} launches "
          f"x {len(ARCHS)} targets in {doc['seconds']['compile']} s")
    text = json.dumps(doc, indent=1) + "\n"
    if args.json:
        args.json.write_text(text)
    bad = errors(doc)
    for line in bad:
        print(f"ERROR {line}", file=sys.stderr)
    if args.write:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text)
    elif args.check:
        old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        diff = differences(doc, old)
        for line in diff:
            print(f"DIFFERS {line}", file=sys.stderr)
        if diff:
            print("regenerate: .venv/bin/python scripts/gpu_check_compile.py --write",
                  file=sys.stderr)
            return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
