#!/usr/bin/env python3
"""CPU cost of the Lynx KV data path of one request, as SGLang's `lynx` backend runs it.

Prefill side (`backend.prefill.writer.RoomWriter`, without the transport): every layer's Anchor
encoded straight into a staging numpy buffer (one fused C call per layer and kind, K and V on two
threads with `--encode-threads 2`), then the Residual: for target int8 in the same pass, for exact
in a second pass, as after the forward (`prefill`); `prefill_streamed` is the layer-streamed
writer's one pass (the default, `--lynx-layer-stream`: each layer's Residual with its Anchor).
Decode side (`backend.decode.applier`): every layer's Anchor applied into the decode
pool's slots, then the Residual (the layers found by walking the landed Residual's chunk headers),
K and V on two threads with `--apply-threads 2`; `decode_residual_only` skips the Anchor write, as
the applier does when both streams have landed by the time it looks.

Each is reported in wall-clock and in CPU seconds (the best of --repeats runs after a warm-up: the
least disturbed by other work on a shared machine); the wall-clock time also as a ratio to a plain
copy of the request's KV bytes (a gather of every layer's K and V slots into one buffer, what a
raw-bytes backend does) and to sending those bytes at 1 Gbit/s (bytes * 8 / 1e9 s).

    .venv/bin/python scripts/bench_kv_path.py --json out/bench_kv_path.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from lynx_kernels import CodecSpec, Target, preset
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.pool import KVPoolView
from lynx_sglang.backend.streams import (
    ResidualReader,
    anchor_layer,
    apply_anchor_layer,
    apply_full_layer,
    encode_layer_into,
)

LINK_BPS = 1e9


def timed(fn, repeats: int) -> tuple[float, float]:
    """Fewest wall-clock and fewest CPU seconds (this process, all threads) of `fn()` over
    `repeats` runs after one warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def make_pool(layers: int, heads: int, head_dim: int, slots: int, seed: int,
              dtype: torch.dtype) -> KVPoolView:
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(slots, heads, head_dim, generator=g).to(dtype)  # noqa: E731
    return KVPoolView([mk() for _ in range(layers)], [mk() for _ in range(layers)])


def encode_request(pool: KVPoolView, slots: torch.Tensor, spec: CodecSpec, chunk_tokens: int,
                   buf: np.ndarray, plan: StreamPlan, executor: Executor | None,
                   streamed: bool = False) -> int:
    """Every layer's chunks into `buf` (Anchor stream, then Residual stream), as the prefill
    sender writes them after the forward (an exact Residual in a second pass, after every
    Anchor); `streamed`: as it writes them layer-streamed (the default, `--lynx-layer-stream`),
    each layer's Residual in the Anchor's pass at the layer's bound-sized place. Returns the
    Residual's bytes (streamed: the bound, its layers are not back to back)."""
    a_layer, r_layer = plan.anchor_layer_bytes, plan.residual_layer_bytes
    one_pass = spec.target is Target.INT8 or streamed
    for layer in range(plan.num_layers):
        at = plan.anchor_offset(layer)
        r_at = plan.anchor_bytes + layer * r_layer
        encode_layer_into(pool, layer, slots, spec, chunk_tokens, 1, buf[at: at + a_layer],
                          buf[r_at: r_at + r_layer] if one_pass else None, executor)
    if one_pass:
        return plan.residual_bytes
    scratch = np.empty(a_layer, dtype=np.uint8)
    at = plan.anchor_bytes
    for layer in range(plan.num_layers):
        at += encode_layer_into(pool, layer, slots, spec, chunk_tokens, 1, scratch,
                                buf[at: at + r_layer], executor)[1]
    return at - plan.anchor_bytes


def decode_request(buf: np.ndarray, pool: KVPoolView, slots: torch.Tensor, spec: CodecSpec,
                   plan: StreamPlan, residual_bytes: int, executor: Executor | None,
                   with_anchor: bool = True) -> None:
    """Apply the Anchor, then the Residual; without `with_anchor`, the decode's path when both
    streams have landed before it looks (no Anchor-precision write)."""
    view = memoryview(buf)
    anchors = [anchor_layer(view, plan, layer) for layer in range(plan.num_layers)]
    if with_anchor:
        for layer, runs in enumerate(anchors):
            apply_anchor_layer(runs, pool, layer, slots, spec, 1, executor)
    reader = ResidualReader(plan.num_layers, len(slots))
    residual = view[plan.anchor_bytes: plan.anchor_bytes + residual_bytes]
    for layer, runs in reader.advance(residual, len(residual)):
        apply_full_layer(anchors[layer], runs, pool, layer, slots, spec, 1, executor)


def plain_copy(pool: KVPoolView, slots: torch.Tensor, out: torch.Tensor) -> None:
    for layer in range(len(pool.k)):
        torch.index_select(pool.k[layer], 0, slots, out=out[layer, 0])
        torch.index_select(pool.v[layer], 0, slots, out=out[layer, 1])


def bench(tokens: int, args, spec: CodecSpec) -> dict:
    shape = preset(args.model)
    dtype = getattr(torch, args.dtype)
    slots_total = 2 * tokens + 64
    src = make_pool(shape.num_layers, shape.num_kv_heads, shape.head_dim, slots_total, 0, dtype)
    dst = make_pool(shape.num_layers, shape.num_kv_heads, shape.head_dim, slots_total, 1, dtype)
    g = torch.Generator().manual_seed(2)
    src_slots = torch.randperm(slots_total, generator=g)[:tokens]
    dst_slots = torch.randperm(slots_total, generator=g)[:tokens]
    plan = StreamPlan.build(spec, src.shape, tokens, args.chunk_tokens)
    buf = np.zeros(plan.staging_bytes, dtype=np.uint8)
    kv_bytes = 2 * shape.num_layers * tokens * shape.num_kv_heads * shape.head_dim * dtype.itemsize
    copy_out = torch.empty(shape.num_layers, 2, tokens, shape.num_kv_heads, shape.head_dim,
                           dtype=dtype)
    executor = ThreadPoolExecutor(1) if args.encode_threads > 1 else None
    apply_helper = ThreadPoolExecutor(1) if args.apply_threads > 1 else None

    t_copy = timed(lambda: plain_copy(src, src_slots, copy_out), args.repeats)
    t_prefill = timed(lambda: encode_request(src, src_slots, spec, args.chunk_tokens, buf, plan,
                                             executor), args.repeats)
    t_streamed = timed(lambda: encode_request(src, src_slots, spec, args.chunk_tokens, buf, plan,
                                              executor, streamed=True), args.repeats)
    residual_bytes = encode_request(src, src_slots, spec, args.chunk_tokens, buf, plan, executor)
    t_decode = timed(lambda: decode_request(buf, dst, dst_slots, spec, plan, residual_bytes,
                                            apply_helper), args.repeats)
    t_residual_only = timed(lambda: decode_request(buf, dst, dst_slots, spec, plan,
                                                   residual_bytes, apply_helper, False),
                            args.repeats)
    for layer in range(shape.num_layers):  # the bytes it times must also be the right ones
        for a, b in ((dst.k, src.k), (dst.v, src.v)):
            if spec.target is Target.EXACT and not torch.equal(a[layer][dst_slots],
                                                               b[layer][src_slots]):
                raise SystemExit(f"layer {layer}: decoded KV differs from the prefill's")
    link_s = kv_bytes * 8 / LINK_BPS
    row = {"tokens": tokens, "kv_bytes": kv_bytes,
           "anchor_bytes": plan.anchor_bytes, "residual_bytes": residual_bytes,
           "copy_s": t_copy[0], "copy_cpu_s": t_copy[1], "link_1gbit_s": link_s}
    for name, (wall, cpu) in (("prefill", t_prefill), ("prefill_streamed", t_streamed),
                              ("decode", t_decode),
                              ("decode_residual_only", t_residual_only)):
        row[f"{name}_s"] = wall
        row[f"{name}_cpu_s"] = cpu
        row[f"{name}_vs_copy"] = wall / t_copy[0]
        row[f"{name}_vs_link"] = wall / link_s
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1500, 4000])
    parser.add_argument("--target", choices=["int8", "exact"], nargs="+", default=["exact", "int8"])
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: SGLang CPU servers run 1-2)")
    parser.add_argument("--encode-threads", type=int, choices=(1, 2), default=2,
                        help="as --lynx-encode-threads (default 2)")
    parser.add_argument("--apply-threads", type=int, choices=(1, 2), default=2,
                        help="as --lynx-apply-threads (default 2)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="KV pool dtype (default bfloat16, the demo's)")
    parser.add_argument("--json", type=Path, default=Path("out/bench_kv_path.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    rows = []
    for target in args.target:
        # The serving defaults (lynx_sglang.config): 4 Anchor bits, K per channel, rotation on.
        spec = CodecSpec(anchor_bits=4, group_size=64, target=target, sink_tokens=4,
                         recent_tokens=16, rotate=True)
        for tokens in args.tokens:
            row = {"target": target, **bench(tokens, args, spec)}
            rows.append(row)
            print(f"{target:5s} {tokens:5d} tok: prefill {row['prefill_s'] * 1e3:7.1f} ms "
                  f"({row['prefill_vs_copy']:6.1f}x copy, {row['prefill_vs_link']:5.2f}x 1 Gbit/s; "
                  f"streamed {row['prefill_streamed_s'] * 1e3:.1f} ms, "
                  f"{row['prefill_streamed_vs_copy']:.1f}x copy)"
                  f"  decode {row['decode_s'] * 1e3:7.1f} ms ({row['decode_vs_copy']:6.1f}x copy, "
                  f"{row['decode_vs_link']:5.2f}x 1 Gbit/s)  copy {row['copy_s'] * 1e3:.2f} ms  "
                  f"(cpu: prefill {row['prefill_cpu_s'] * 1e3:.1f} ms, decode "
                  f"{row['decode_cpu_s'] * 1e3:.1f} ms)",
                  file=sys.stderr)
    report = {"model": args.model, "threads": args.threads, "dtype": args.dtype,
              "encode_threads": args.encode_threads,
              "apply_threads": args.apply_threads, "chunk_tokens": args.chunk_tokens,
              "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
