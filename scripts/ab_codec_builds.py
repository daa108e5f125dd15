#!/usr/bin/env python3
"""Two builds of the C codec on the same KV path, interleaved in one process: is a change faster?

Builds kernels/csrc at git revision `--base` (default HEAD, i.e. without the working tree's
changes) and the working tree's kernels/csrc, both with the flags setup.py builds with, then
times bench_kv_path's request paths (the prefill's encode of every layer; the decode's Anchor
then Residual apply of every layer; targets exact and int8) with each build, alternating A, B,
B, A... for `--rounds` rounds on the same pools and slots, so that both see the same noise of a
shared machine; the base build's streams must be byte-identical to this tree's. Reports per
path the median of each build's per-round best wall-clock times and their ratio (base / this:
above 1 means this tree is faster); JSON out. The two builds must have the same C ABI
(lynx_params, entry points): this compares implementations, not formats.

    .venv/bin/python scripts/ab_codec_builds.py --base f9ecbbc --json out/ab_codec.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bench_kv_path as kvpath  # this script's folder is on sys.path
import numpy as np
import torch

from lynx_kernels import CodecSpec, ops_cpu, preset
from lynx_sglang.backend.plan import StreamPlan

ROOT = Path(__file__).resolve().parent.parent
# setup.py's extra_compile_args (IEEE-exact arithmetic), after Python's own flags, as setuptools
# puts them: both builds get exactly the flags a `pip install` gives.
EXTRA_CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math"]


def csrc_at(rev: str | None, out: Path) -> Path:
    """kernels/csrc at git revision `rev` (None: this working tree) copied into out/csrc."""
    src = out / "csrc"
    src.mkdir(parents=True)
    if rev is None:
        for f in (ROOT / "kernels" / "csrc").iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        return src
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:kernels/csrc"],
                             check=True, capture_output=True, text=True).stdout.split()
    for name in listing:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/csrc/{name}"],
                              check=True, capture_output=True).stdout
        (src / name).write_bytes(blob)
    return src


def build(src: Path) -> Path:
    """The C codec from `src` with setup.py's compiler flags, as src/../codec.so."""
    var = sysconfig.get_config_var
    cflags = [*var("CFLAGS").split(), *var("CCSHARED").split(), f"-I{sysconfig.get_paths()['include']}",
              *EXTRA_CFLAGS]
    objs = []
    for name in ("lynx_codec.c", "module.c"):
        obj = src / (name + ".o")
        subprocess.run([var("CC").split()[0], *cflags, "-c", str(src / name), "-o", str(obj)],
                       check=True)
        objs.append(str(obj))
    lib = src.parent / "codec.so"
    subprocess.run([*var("LDSHARED").split(), *objs, "-o", str(lib)], check=True)
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the base build")
    parser.add_argument("--base-lib", type=Path,
                        help="a built C codec to use as the base instead of building --base")
    parser.add_argument("--model", default="SmolLM2-135M")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per build and round")
    parser.add_argument("--threads", type=int, choices=(1, 2), default=2,
                        help="K and V on two threads, as the serving defaults (1: one core)")
    parser.add_argument("--json", type=Path, default=Path("out/ab_codec_builds.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    shape = preset(args.model)
    dtype = torch.bfloat16
    slots_total = 2 * args.tokens + 64
    src = kvpath.make_pool(shape.num_layers, shape.num_kv_heads, shape.head_dim, slots_total, 0, dtype)
    dst = kvpath.make_pool(shape.num_layers, shape.num_kv_heads, shape.head_dim, slots_total, 1, dtype)
    g = torch.Generator().manual_seed(2)
    src_slots = torch.randperm(slots_total, generator=g)[:args.tokens]
    dst_slots = torch.randperm(slots_total, generator=g)[:args.tokens]
    executor = ThreadPoolExecutor(1) if args.threads > 1 else None
    chunk = 256
    with tempfile.TemporaryDirectory() as tmp:
        base_lib = args.base_lib or build(csrc_at(args.base, Path(tmp) / "base"))
        this_lib = build(csrc_at(None, Path(tmp) / "this"))
        libs = {"base": str(base_lib), "this": str(this_lib)}
        paths = {}
        for target in ("exact", "int8"):
            spec = CodecSpec(anchor_bits=4, group_size=64, target=target, sink_tokens=4,
                             recent_tokens=16, rotate=True)
            plan = StreamPlan.build(spec, src.shape, args.tokens, chunk)
            buf = np.zeros(plan.staging_bytes, dtype=np.uint8)
            # The streams as this tree's build writes them; the base build must write the same.
            with ops_cpu.library_at(libs["this"]):
                rbytes = kvpath.encode_request(src, src_slots, spec, chunk, buf, plan, executor)
            reference = buf.copy()
            paths[f"{target}_prefill"] = (
                lambda s=spec, p=plan, b=buf: kvpath.encode_request(src, src_slots, s, chunk, b, p,
                                                                    executor),
                (buf, reference))
            streams = reference.copy()
            paths[f"{target}_decode"] = (
                lambda s=spec, p=plan, r=rbytes, b=streams: kvpath.decode_request(
                    b, dst, dst_slots, s, p, r, executor), None)
        times: dict[str, dict[str, list[float]]] = {p: {"base": [], "this": []} for p in paths}
        for r in range(args.rounds):
            for which in (("base", "this") if r % 2 == 0 else ("this", "base")):
                for name, (fn, check) in paths.items():
                    with ops_cpu.library_at(libs[which]):
                        best = kvpath.timed(fn, args.repeats)[0]
                    if check is not None and not np.array_equal(*check):
                        raise SystemExit(f"{name}: the {which} build wrote other bytes")
                    times[name][which].append(best)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    rows = {}
    for name, t in times.items():
        base, this = statistics.median(t["base"]), statistics.median(t["this"])
        rows[name] = {"base_s": base, "this_s": this, "speedup": base / this,
                      "base_all_s": t["base"], "this_all_s": t["this"]}
        print(f"{name:14s} base {base * 1e3:7.1f} ms  this {this * 1e3:7.1f} ms  "
              f"speedup {base / this:5.2f}x", file=sys.stderr)
    report = {"base": str(args.base_lib) if args.base_lib else args.base, "model": args.model,
              "tokens": args.tokens,
              "threads": args.threads, "rounds": args.rounds, "isa": ops_cpu.isa(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "paths": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
