#!/usr/bin/env python3
"""Codec throughput as a ratio to a plain copy of the same bytes, measured in one run.

For one layer's K and V of a model shape at a context length, times the serving path's three
calls (`lynx_kernels.fused`: encode into the two streams, apply the Anchor, apply the Residual)
per implementation and target, and a copy of the same KV bytes (`out.copy_(kv)`); reports seconds
(median and best of --repeats, after a warm-up), each call's ratio to the copy's rate, and the
bytes of each stream (the exact Residual: actual and bound). CPU runs use one thread (the
comparison is per core). `--api tensors` times the tensor-level calls instead (encode,
decode(stage="anchor"), refine_: no wire bytes), which is what a CUDA run measures by default.

    .venv/bin/python scripts/bench_codec.py --json out/bench_codec_cpu.json
    python scripts/bench_codec.py --device cuda --json $OUT/bench_codec_cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lynx_kernels import CodecSpec, decode, encode, fused, ops_cpu, preset, refine_


def timed(fn, device: torch.device, repeats: int) -> dict[str, float]:
    """Median and best seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return {"median": statistics.median(samples), "best": min(samples)}


def fused_calls(pool, slots, spec, kind, impl, chunk_tokens):
    """The three serving calls on `pool[slots]`, and the bytes they move."""
    _, heads, head_dim = pool.shape
    n = len(slots)
    sizes = fused.run_nbytes(spec, kind, pool.dtype, heads, head_dim, n, chunk_tokens)
    anchor = np.zeros(sizes.anchor, np.uint8)
    residual = np.zeros(sizes.residual_bound, np.uint8)
    out = torch.empty_like(pool)
    encode_args = (pool, slots, spec, kind, 0, chunk_tokens, 1, anchor, residual)
    na, nr = fused.encode_run_into(*encode_args, impl=impl)
    args = (out, slots, spec, kind, 0, 1, n)
    calls = {
        "encode": lambda: fused.encode_run_into(*encode_args, impl=impl),
        "anchor_apply": lambda: fused.apply_anchor_run(anchor[:na], *args, impl=impl),
        "residual_apply": lambda: fused.apply_residual_run(anchor[:na], residual[:nr], *args,
                                                           impl=impl),
    }
    return calls, {"anchor": na, "residual": nr, "residual_bound": sizes.residual_bound}


def tensor_calls(x, spec, kind, impl):
    """encode / Anchor dequant / refine on tensors of x's device (no wire bytes)."""
    enc = encode(x, spec, kind, impl=impl)
    slots = decode(enc, "anchor", impl=impl)
    calls = {
        "encode": lambda: encode(x, spec, kind, impl=impl),
        "anchor_apply": lambda: decode(enc, "anchor", impl=impl, out=slots),
        "residual_apply": lambda: refine_(slots, enc, impl=impl),
    }
    return calls, {"anchor": enc.nbytes("anchor"), "residual_bound": enc.nbytes("residual")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--kinds", default="k,v")
    parser.add_argument("--targets", default="int8,exact")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impls", default=None,
                        help="comma-separated; default: cpu,torch on CPU, triton on CUDA")
    parser.add_argument("--api", choices=["fused", "tensors"], default=None,
                        help="default: fused on CPU, tensors on CUDA")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-repeats", type=int, default=2,
                        help="repeats for impl=torch on CPU (it is slow)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    parser.add_argument("--json", type=Path, default=Path("out/bench_codec.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    api = args.api or ("tensors" if device.type == "cuda" else "fused")
    impls = (args.impls or ("triton" if device.type == "cuda" else "cpu,torch")).split(",")
    if api == "tensors" and "cpu" in impls:
        parser.error("--api tensors runs the torch/triton kernels; the C kernels serve the fused API")
    if "cpu" in impls and not ops_cpu.available():
        print(f"skipping impl=cpu: {ops_cpu.unavailable_reason()}", file=sys.stderr)
        impls.remove("cpu")
    dtype = getattr(torch, args.dtype)
    shape = preset(args.model)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn((args.tokens, shape.num_kv_heads, shape.head_dim), generator=gen).to(dtype)
    pool = pool.to(device)
    slots = torch.arange(args.tokens, device=device)
    kv_bytes = pool.numel() * pool.element_size()
    copy_out = torch.empty_like(pool)
    copy = timed(lambda: copy_out.copy_(pool), device, max(args.repeats, 10))
    results = {}
    for impl in impls:
        repeats = args.torch_repeats if impl == "torch" and device.type == "cpu" else args.repeats
        for target in args.targets.split(","):
            for kind in args.kinds.split(","):
                spec = CodecSpec(target=target)
                if api == "fused":
                    calls, nbytes = fused_calls(pool, slots, spec, kind, impl, args.chunk_tokens)
                else:
                    calls, nbytes = tensor_calls(pool, spec, kind, impl)
                entry = {"bytes": nbytes, "bytes_fraction_of_kv": {
                    name: value / kv_bytes for name, value in nbytes.items()}}
                for name, fn in calls.items():
                    seconds = timed(fn, device, repeats)
                    entry[name] = {"seconds": seconds,
                                   "ratio_to_copy": copy["median"] / seconds["median"],
                                   "ratio_to_copy_best": copy["best"] / seconds["best"]}
                results[f"{impl}/{target}/{kind}"] = entry
                print(f"{impl:>6} {target:>5} {kind}: " + "  ".join(
                    f"{name} {entry[name]['ratio_to_copy']:.3f}x" for name in calls)
                    + f"   anchor {nbytes['anchor'] / kv_bytes:.3f}, residual "
                    f"{nbytes.get('residual', nbytes['residual_bound']) / kv_bytes:.3f} of the KV bytes",
                    flush=True)
    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "c_isa": ops_cpu.isa() if ops_cpu.available() else None, "threads": args.threads,
        "api": api, "model": shape.name, "tokens": args.tokens, "dtype": args.dtype,
        "chunk_tokens": args.chunk_tokens, "kv_bytes": kv_bytes,
        "copy": {"seconds": copy, "bytes_per_second": kv_bytes / copy["median"]},
        "data": "Gaussian random values (exact Residual sizes depend on the data)",
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"copy {kv_bytes / copy['median'] / 1e9:.2f} GB/s   (wrote {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
