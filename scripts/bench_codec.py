#!/usr/bin/env python3
"""Codec throughput as a ratio to a plain tensor copy of the same bytes, measured in one run.

For one layer's K (or V) of a model shape at a context length, times encode, Anchor dequant and
Residual refine (median of --repeats runs, after a warm-up), and a `clone()` of the input tensor;
reports each as bytes of input KV per second and as a fraction of the copy's rate. On CUDA the
Triton kernels run (`--impl auto`), with CUDA events for timing; on CPU the torch reference.

    .venv/bin/python scripts/bench_codec.py --device cpu --json out/bench_codec_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lynx_kernels import CodecSpec, decode, encode, preset, refine_


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
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
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--kind", choices=["k", "v"], default="k")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU (the pools' dtypes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument("--target", choices=["int8", "exact"], default="int8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    parser.add_argument("--json", type=Path, default=Path("out/bench_codec.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = preset(args.model)
    x = torch.randn((args.tokens, shape.num_kv_heads, shape.head_dim), device=device).to(dtype)
    spec = CodecSpec(target=args.target)
    input_bytes = x.numel() * x.element_size()

    enc = encode(x, spec, args.kind, impl=args.impl)
    slots = decode(enc, "anchor", impl=args.impl)
    seconds = {
        "copy": timed(lambda: x.clone(), device, args.repeats),
        "encode": timed(lambda: encode(x, spec, args.kind, impl=args.impl), device, args.repeats),
        "anchor_dequant": timed(lambda: decode(enc, "anchor", impl=args.impl, out=slots), device,
                                args.repeats),
        "refine": timed(lambda: refine_(slots, enc, impl=args.impl), device, args.repeats),
    }
    rate = {name: input_bytes / s for name, s in seconds.items()}
    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "impl": args.impl, "model": shape.name, "tokens": args.tokens, "kind": args.kind,
        "dtype": str(dtype), "target": args.target, "input_bytes": input_bytes,
        "anchor_bytes": enc.nbytes("anchor"), "residual_bytes": enc.nbytes("residual"),
        "seconds": seconds, "bytes_per_second": rate,
        "ratio_to_copy": {name: rate[name] / rate["copy"] for name in seconds if name != "copy"},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    for name, value in result["ratio_to_copy"].items():
        print(f"{name:<16}{rate[name] / 1e9:8.2f} GB/s  {value:6.3f} x copy")
    print(f"copy            {rate['copy'] / 1e9:8.2f} GB/s   (wrote {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
