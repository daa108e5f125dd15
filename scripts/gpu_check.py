#!/usr/bin/env python3
"""The codec on a CUDA device in one call, every result in one JSON file (`$OUT/gpu_check.json`).

Run by scripts/gpu_check.sh (which installs the package first). Checks, in order, each recorded
with `ok`, its seconds and its numbers (the JSON is rewritten after each, so a call cut short
still leaves the ones that finished):

  install         the editable install the shell script ran (or why it skipped it)
  environment     device name, torch / triton versions, nvidia-smi, the C codec, that
                  lynx_kernels is imported from this tree
  bit_identity    Triton on the device against the CPU torch reference (and the C codec when
                  built) on the same pool: every wire byte of both streams, and the pool values
                  after applying the Anchor and the Residual (target exact: the original bits);
                  targets int8 and exact, K and V, bf16 / fp16 / fp32, rotated or not; on
                  the device 1000-token runs of Llama-3.1-8B's 8 KV heads x 128
  throughput      scripts/bench_codec.py with impl triton, Llama-3.1-8B's layer shape (8 KV
                  heads x 128), targets int8 and exact, K and V, tensor and serving (fused) calls:
                  each call's rate as a ratio to a device copy of the same bytes (goal >= 0.8,
                  reported, not a pass condition)
  exact_sections  the exact Residual's section coder (`lynx_kernels.exact_triton`) on what the
                  wire layer hands it for a Llama-3.1-8B-shaped K run (bf16): the sections
                  byte for byte against the torch reference on the CPU, the values decoded back,
                  and the encode's and the decode's rates as ratios to a device copy of the
                  values' bytes (the issue's goal for exact: >= 0.5; reported, not a pass
                  condition), and how often one serving exact run (encode into page-locked
                  buffers, apply) makes the host wait for the device (`serving_host_syncs`,
                  torch's sync debug mode, targets int8 and exact; reported). The rehearsal runs the kernels
                  interpreted on its small shapes
  layer_streamed  a synthetic Llama-3.1-8B-shaped forward writes each layer's K and V into a
                  pool on one stream and records an event per layer; on a side stream that waits
                  on each layer's event, the serving calls (`fused.encode_run_start`, both
                  streams) encode that layer's K and V into page-locked host buffers, each
                  layer's copies finished once the next layer is encoded (as the prefill's room
                  writer does, `lynx_kernels.chunk_copy`), and the encode alone into pageable
                  buffers too (page_locked_speedup; the rehearsal's buffers are all pageable).
                  Reports the fraction of the encode hidden under the forward, (forward +
                  encode - both) / encode, and fails if the overlapped encode's bytes (or the
                  pageable one's) differ from encoding the finished pool (zeroed first: a layer
                  encoded before its KV landed would differ)
  compiled_kernels  each kernel's registers, spills and shared memory as compiled without a GPU
                  (results/gpu_compile.json, scripts/gpu_check_compile.py) beside those of the
                  same kernels loaded here (the checks above launched them); gpu_check_compiled.py
  kernel_tests    pytest tests/kernels (Triton compiled, not interpreted); the rehearsal runs
                  three of test_triton.py's

`--device cpu` is the rehearsal (scripts/gpu_check.sh with LYNX_GPU_CHECK_DEVICE=cpu): the same
steps on CPU tensors with Triton's interpreter and small shapes, nvidia-smi skipped, and a host
stand-in for CUDA events (`HostEvent`), so a bug in this script shows here and not on the few
device minutes. Its timings say nothing about a GPU.

The layer-streamed check lives in gpu_check_streamed.py, the shape and sizes every check uses in
gpu_check_common.py (both beside this script).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import bench_codec  # scripts/bench_codec.py: this script's folder is on sys.path
import numpy as np
import torch
import triton
from gpu_check_common import (
    SERVING_CHUNK_TOKENS,
    SETTINGS,
    SHAPE,
    Settings,
    host_buffer,
    host_syncs,
    sync,
)
from gpu_check_compiled import check_compiled_kernels
from gpu_check_streamed import check_layer_streamed

import lynx_kernels
from lynx_kernels import CodecSpec, exact, fused, ops_cpu

ROOT = Path(__file__).resolve().parents[1]
GOAL_RATIO = 0.8
CALLS = ("encode", "anchor_apply", "residual_apply")


class Report:
    """The JSON file: top-level facts, and one entry per check, rewritten after each check."""

    def __init__(self, path: Path, device: str):
        self.path = path
        self.data: dict = {"ok": False, "complete": False, "device": device,
                           "rehearsal": device == "cpu", "skipped": {}, "notes": [], "checks": {}}

    def write(self) -> None:
        checks = self.data["checks"].values()
        self.data["ok"] = self.data["complete"] and all(c["ok"] for c in checks)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)

    def check(self, name: str, fn, *args) -> None:
        """Run one check; an exception fails it (with the traceback) and the next ones still run."""
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            ok, details = fn(*args)
        except Exception:
            ok, details = False, {"error": traceback.format_exc()}
        entry = {"ok": bool(ok), "seconds": round(time.perf_counter() - t0, 3), **details}
        self.data["checks"][name] = entry
        print(f"   {name}: {'ok' if ok else 'FAILED'} ({entry['seconds']} s)", flush=True)
        if not ok:
            print(json.dumps(details, indent=2, default=str)[-4000:], flush=True)
        self.write()


def commit() -> str | None:
    """HEAD of this tree, or LYNX_GPU_CHECK_COMMIT where git is missing (the device's copy of the
    tree has no .git: the caller names the commit it sent)."""
    if shutil.which("git"):
        proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True)
        if proc.returncode == 0:
            return proc.stdout.strip()
    return os.environ.get("LYNX_GPU_CHECK_COMMIT")


def check_install(status: str):
    return status == "ok" or status.startswith("skipped"), {"status": status}


def check_environment(report: Report, device: str):
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    top = report.data
    top.update(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               commit=commit(), triton_interpret=interpret)
    details = {"c_codec": ops_cpu.isa() if ops_cpu.available() else ops_cpu.unavailable_reason(),
               "lynx_kernels": lynx_kernels.__file__}
    from_tree = Path(lynx_kernels.__file__).resolve().parent == ROOT / "kernels"
    if device == "cuda":
        top["device_name"] = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        details.update(capability=f"{props.major}.{props.minor}", memory_gib=props.total_memory / 2**30,
                       cuda=torch.version.cuda)
        smi = shutil.which("nvidia-smi")
        if smi:
            proc = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version",
                                   "--format=csv,noheader"], capture_output=True, text=True,
                                  timeout=60)
            details["nvidia_smi"] = proc.stdout.strip() or proc.stderr.strip()
        else:
            details["nvidia_smi"] = "not found"
        ok = not interpret and bool(smi) and proc.returncode == 0
    else:
        top["device_name"] = f"cpu ({platform.processor() or platform.machine()})"
        top["skipped"]["nvidia-smi"] = "needs CUDA (CPU rehearsal)"
        ok = interpret  # Triton kernels only run on CPU tensors in the interpreter
    return ok and from_tree, details


def encoded(pool: torch.Tensor, slots: torch.Tensor, spec: CodecSpec, kind: str, chunk_tokens: int,
            impl: str) -> tuple[bytes, bytes]:
    _, heads, head_dim = pool.shape
    sizes = fused.run_nbytes(spec, kind, pool.dtype, heads, head_dim, len(slots), chunk_tokens)
    anchor, residual = np.zeros(sizes.anchor, np.uint8), np.zeros(sizes.residual_bound, np.uint8)
    na, nr = fused.encode_run_into(pool, slots, spec, kind, 0, chunk_tokens, 1, anchor, residual,
                                   impl=impl)
    return anchor[:na].tobytes(), residual[:nr].tobytes()


def applied(streams: tuple[bytes, ...], pool: torch.Tensor, slots: torch.Tensor, spec: CodecSpec,
            kind: str, impl: str) -> torch.Tensor:
    """The bit patterns of a zeroed pool after applying the Anchor (one stream) or both, on CPU."""
    out = torch.zeros_like(pool)
    args = (out, slots, spec, kind, 0, 1, len(slots))
    if len(streams) == 1:
        fused.apply_anchor_run(streams[0], *args, impl=impl)
    else:
        fused.apply_residual_run(*streams, *args, impl=impl)
    return out.cpu().view(torch.uint8)


def bit_identity_case(s: Settings, device: str, dtype: torch.dtype, rotate: bool, kind: str,
                      target: str) -> dict:
    spec = CodecSpec(**s.bit_spec, target=target, rotate=rotate)
    gen = torch.Generator().manual_seed(7)
    rows = s.bit_tokens + 7  # the run's tokens at shuffled pool rows, among spare ones
    slots = torch.randperm(rows, generator=gen)[:s.bit_tokens]
    pool = (torch.randn(rows, *s.bit_heads, generator=gen) * 3).to(dtype)
    # Signed zeros and a subnormal, and for exact an infinity (target int8 refuses non-finite
    # input), in token 5: quantized, not protected.
    specials = [0.0, -0.0, 1e-40] + ([float("inf")] if target == "exact" else [])
    pool[slots[5], 1, :len(specials)] = torch.tensor(specials).to(dtype)
    ref = encoded(pool, slots, spec, kind, s.bit_chunk_tokens, "torch")
    dev_pool, dev_slots = pool.to(device), slots.to(device)
    tri = encoded(dev_pool, dev_slots, spec, kind, s.bit_chunk_tokens, "triton")
    impls = {"triton": (dev_pool, dev_slots), "torch": (pool, slots)}
    if ops_cpu.available():
        impls["cpu"] = (pool, slots)
    row: dict = {"dtype": str(dtype).removeprefix("torch."), "rotate": rotate, "kind": kind,
                 "target": target, "bytes_equal_torch": tri == ref,
                 "bytes_equal_c": tri == encoded(pool, slots, spec, kind, s.bit_chunk_tokens, "cpu")
                 if ops_cpu.available() else None,
                 "residual_fraction_of_raw": len(ref[1]) / (pool[slots].numel() * pool.element_size())}
    # Every implementation applies the reference bytes, so a decode difference shows on its own.
    values = {}
    for stage, streams in (("anchor", ref[:1]), ("full", ref)):
        values[stage] = {impl: applied(streams, *where, spec, kind, impl)
                         for impl, where in impls.items()}
        row[f"{stage}_values_equal"] = all(torch.equal(v, values[stage]["torch"])
                                           for v in values[stage].values())
    row["full_is_input"] = None  # target int8 reconstructs INT8 precision only
    if target == "exact":
        expected = torch.zeros_like(pool)
        expected[slots] = pool[slots]
        row["full_is_input"] = torch.equal(values["full"]["torch"], expected.view(torch.uint8))
    row["ok"] = all(row[k] is not False for k in ("bytes_equal_torch", "bytes_equal_c",
                                                  "anchor_values_equal", "full_values_equal",
                                                  "full_is_input"))
    return row


def check_bit_identity(s: Settings, device: str):
    cases = [bit_identity_case(s, device, dtype, rotate, kind, target)
             for target in ("int8", "exact")
             for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for rotate in (True, False) for kind in "kv"]
    failed = [c for c in cases if not c["ok"]]
    return not failed, {"tokens": s.bit_tokens, "kv_heads_x_head_dim": s.bit_heads,
                        "chunk_tokens": s.bit_chunk_tokens,
                        "spec": s.bit_spec or "CodecSpec() defaults", "c_compared": ops_cpu.available(),
                        "cases": len(cases), "failed": failed, "all_cases": cases}


def check_throughput(s: Settings, device: str, out: Path):
    details: dict = {"model": SHAPE.name, "tokens": s.tokens, "repeats": s.repeats,
                     "goal_ratio_to_copy": GOAL_RATIO, "ratio_to_copy": {}, "below_goal": []}
    ok = True
    for api in ("tensors", "fused"):
        path = out / f"bench_codec_{device}_{api}.json"
        rc = bench_codec.main(["--device", device, "--api", api, "--impls", "triton",
                               "--model", SHAPE.name, "--tokens", str(s.tokens),
                               "--repeats", str(s.repeats), "--json", str(path)])
        bench = json.loads(path.read_text())
        details[f"copy_gb_per_s_{api}"] = bench["copy"]["bytes_per_second"] / 1e9
        ok &= rc == 0 and len(bench["results"]) == 4  # triton x {int8, exact} x {k, v}
        for key, entry in bench["results"].items():
            ratios = {call: entry[call]["ratio_to_copy"] for call in CALLS}
            details["ratio_to_copy"][f"{api}/{key}"] = ratios
            ok &= all(math.isfinite(r) and r > 0 for r in ratios.values())
            details["below_goal"] += [f"{api}/{key}/{call}" for call, r in ratios.items()
                                      if r < GOAL_RATIO]
    return ok, details


def coder_inputs(pool: torch.Tensor, slots: torch.Tensor, spec: CodecSpec, kind: str,
                 chunk_tokens: int) -> tuple:
    """(zz, cls, x_bits, counts, coding): what the wire layer hands the section coder for the
    Residual of `pool[slots]` (the encode's own call to it, observed)."""
    from lynx_kernels import exact_triton

    # The coder `wire.section_coder` picks for the pool's device, looked up at each call.
    coder = exact_triton if pool.device.type == "cuda" else exact
    seen = []
    real = coder.encode_sections

    def spy(*args):
        seen.append(args)
        return real(*args)

    coder.encode_sections = spy
    try:
        encoded(pool, slots, spec, kind, chunk_tokens, "triton")
    finally:
        coder.encode_sections = real
    return seen[0]


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of `fn()` over `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_exact_sections(s: Settings, device: str):
    from lynx_kernels import exact_triton

    gen = torch.Generator().manual_seed(11)
    tokens = s.bit_tokens if device == "cpu" else s.tokens
    heads = s.bit_heads if device == "cpu" else (SHAPE.num_kv_heads, SHAPE.head_dim)
    pool = (torch.randn(tokens, *heads, generator=gen) * 3).to(torch.bfloat16).to(device)
    slots = torch.arange(tokens, device=device)
    spec = CodecSpec(**s.bit_spec, target="exact")
    chunk_tokens = s.bit_chunk_tokens if device == "cpu" else SERVING_CHUNK_TOKENS
    zz, cls, x_bits, counts, coding = coder_inputs(pool, slots, spec, "k", chunk_tokens)
    cpu_args = (zz.cpu(), cls.cpu(), x_bits.cpu(), counts, coding)
    ref = exact.encode_sections(*cpu_args)
    tri = exact_triton.encode_sections(zz, cls, x_bits, counts, coding)
    same = all(torch.equal(a.cpu(), b) for st, sr in zip(tri, ref, strict=True)
               for a, b in zip(st.parts(), sr.parts(), strict=True))
    r_bits = exact.from_ordinal(exact.ordinal(x_bits, coding) - exact.unzigzag(zz), coding)
    back = exact_triton.decode_sections(tri, cls, r_bits, counts, coding)
    values_back = torch.equal(back, x_bits)
    raw = torch.empty(x_bits.numel() * coding.width // 8, dtype=torch.uint8, device=device)
    copy_s = timed(lambda: raw.clone(), s.repeats, device)
    encode_s = timed(lambda: exact_triton.encode_sections(zz, cls, x_bits, counts, coding),
                     s.repeats, device)
    decode_s = timed(lambda: exact_triton.decode_sections(tri, cls, r_bits, counts, coding),
                     s.repeats, device)
    section_bytes = sum(st.nbytes for st in tri)
    syncs = serving_host_syncs(pool, slots, spec, chunk_tokens) if device == "cuda" else (
        "needs CUDA (the CPU rehearsal has no device to wait for)")
    return same and values_back, {
        "serving_host_syncs": syncs,
        "model": SHAPE.name, "tokens": tokens, "kv_heads_x_head_dim": heads, "values": len(zz),
        "chunks": len(counts), "sections_equal_reference": same, "values_decoded_back": values_back,
        "section_bytes_per_value": section_bytes / len(zz),
        "copy_s": copy_s, "encode_s": encode_s, "decode_s": decode_s,
        "encode_ratio_to_copy": copy_s / encode_s, "decode_ratio_to_copy": copy_s / decode_s}


def serving_host_syncs(pool: torch.Tensor, slots: torch.Tensor, spec: CodecSpec,
                       chunk_tokens: int) -> dict:
    """The host's waits for the device in one K run of the serving calls per target (reported,
    not a pass condition): the encode into page-locked buffers as the prefill's writer makes it
    (`encode_run_start`, which queues the run, then `finish`; its input checks are read there,
    `lynx_kernels.deferred_checks`), and the apply of both streams."""
    _, heads, head_dim = pool.shape
    counts = {}
    for target in ("int8", "exact"):
        spec = replace(spec, target=target)
        sizes = fused.run_nbytes(spec, "k", pool.dtype, heads, head_dim, len(slots), chunk_tokens)
        anchor = host_buffer(sizes.anchor, "cuda")
        residual = host_buffer(sizes.residual_bound, "cuda")
        run = (pool, slots, spec, "k", 0, chunk_tokens, 1, anchor, residual)
        fused.encode_run_into(*run, impl="triton")  # compiled outside the count
        pending, start = host_syncs(partial(fused.encode_run_start, *run, impl="triton"))
        (na, nr), finish = host_syncs(pending.finish)
        _, apply = host_syncs(partial(fused.apply_residual_run, anchor[:na], residual[:nr],
                                      torch.zeros_like(pool), slots, spec, "k", 0, 1, len(slots),
                                      impl="triton"))
        counts[target] = {"encode_start": start, "encode_finish": finish, "apply_residual": apply}
    return counts


def check_kernel_tests(s: Settings, out: Path):
    junit = out / "kernels-junit.xml"
    cmd = [sys.executable, "-m", "pytest", *s.pytest_args, "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=s.pytest_timeout_s)
    except subprocess.TimeoutExpired as exc:
        # What pytest printed before the kill (bytes: run() decodes only a finished process's).
        (out / "kernels-tests.log").write_bytes(exc.stdout or b"")
        return False, {"command": cmd, "error": f"timed out after {s.pytest_timeout_s} s"}
    (out / "kernels-tests.log").write_text(proc.stdout + proc.stderr)
    suite = ET.parse(junit).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return proc.returncode == 0 and counts["tests"] > 0, {
        "command": cmd, "returncode": proc.returncode, **counts,
        "summary": proc.stdout.strip().splitlines()[-1:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(SETTINGS), default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--install", default="ok",
                        help="the install step's outcome (gpu_check.sh): ok, failed, skipped: why")
    args = parser.parse_args(argv)
    s, device = SETTINGS[args.device], args.device
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "gpu_check.json", device)
    report.data["settings"] = asdict(s)
    if args.install.startswith("skipped"):
        report.data["skipped"]["install"] = args.install
    if device == "cpu":
        report.data["notes"].append("CPU rehearsal: Triton interpreted, small shapes; its timings "
                                    "and hidden fractions say nothing about a GPU")
    report.check("install", check_install, args.install)
    report.check("environment", check_environment, report, device)
    report.check("bit_identity", check_bit_identity, s, device)
    report.check("throughput", check_throughput, s, device, args.out)
    report.check("exact_sections", check_exact_sections, s, device)
    report.check("layer_streamed", check_layer_streamed, s, device)
    report.check("compiled_kernels", check_compiled_kernels, device)
    report.check("kernel_tests", check_kernel_tests, s, args.out)
    report.data["complete"] = True
    report.write()
    print(f"{'ok' if report.data['ok'] else 'FAILED'}: {report.path}", flush=True)
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
