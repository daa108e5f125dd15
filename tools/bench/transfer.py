"""`lynx-sglang bench-transfer`: network-exposed TTFT of Lynx vs single-stream KV transfers.

Emulates one request's KV for a model shape (presets SmolLM2-135M, Llama-3.1-8B) and context
length, sizes the Anchor and Residual streams with the codec's byte accounting
(`lynx_kernels.stream_nbytes_per_token`) and BF16/INT8/INT4 single-stream baselines, then moves the
bytes with `lynx_transport` (tcp backend) over a link of the given rate:

  --link netns     two network namespaces + veth + tc tbf at --rate (root; tools/cluster/netns.py)
  --link throttle  loopback, the sender paced at --rate (works anywhere; less faithful)
  --link auto      netns when possible, else throttle (default)

Reports time-to-Anchor (decode can start speculating) and time-to-Residual (exact KV complete),
each ÷ the time of a BF16/INT8/INT4 single-stream transfer of the same KV: the network-exposed
TTFT ratios. `--json PATH` writes everything.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger("lynx_tools.bench.transfer")


def _rate_bps(rate: str) -> float:
    r = rate.lower().strip()
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if r.endswith(unit):
            return float(r[: -len(unit)]) * mult
    return float(r)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="SmolLM2-135M",
                   help="KV shape preset: SmolLM2-135M or Llama-3.1-8B")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens whose KV moves")
    p.add_argument("--rate", default="1gbit", help="link rate (e.g. 1gbit, 5gbit, 500mbit)")
    p.add_argument("--link", choices=("auto", "netns", "throttle"), default="auto")
    p.add_argument("--anchor-bits", type=int, default=4)
    p.add_argument("--target", default="int8", help="codec target: int8 or exact")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--sink-tokens", type=int, default=0)
    p.add_argument("--recent-tokens", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", dest="json_out", default=None, help="write results here")


def sizes(model: str, context: int, anchor_bits: int = 4, target: str = "int8",
          group_size: int = 64, sink: int = 0, recent: int = 0) -> dict:
    """Bytes of one request's KV (all layers, K+V) per stream and per baseline format."""
    from lynx_kernels import CodecSpec, preset, quantized_nbytes_per_token, stream_nbytes_per_token

    shape = preset(model)
    spec = CodecSpec(anchor_bits=anchor_bits, group_size=group_size, target=target,
                     sink_tokens=sink, recent_tokens=recent)
    sb = stream_nbytes_per_token(spec, shape.num_kv_heads, shape.head_dim, 2, context)
    per_a = sb["anchor"] if isinstance(sb, dict) else sb.anchor
    per_r = sb["residual"] if isinstance(sb, dict) else sb.residual
    L = shape.num_layers

    def q(bits: int) -> int:
        return round(quantized_nbytes_per_token(bits, shape.num_kv_heads, shape.head_dim,
                                                group_size) * L * context)

    return {
        "model": shape.name, "context": context, "layers": L,
        "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
        "spec": {"anchor_bits": anchor_bits, "target": str(target), "group_size": group_size,
                 "sink_tokens": sink, "recent_tokens": recent},
        "anchor": round(per_a * L * context),
        "residual": round(per_r * L * context),
        "bf16": shape.with_dtype("bfloat16").bytes_for(context),
        "int8": q(8),
        "int4": q(4),
    }


def measure(sz: dict, rate: str, link: str, repeat: int) -> dict:
    import numpy as np

    from ..cluster.netns import ShapedLink, netns_available
    from . import link as lb

    if link == "auto":
        link = "netns" if netns_available() is None else "throttle"
    if link == "netns" and (reason := netns_available()):
        raise SystemExit(f"--link netns unavailable: {reason}")
    bps = _rate_bps(rate)
    # interleaved rounds (lynx, bf16, int8, int4) x repeat: load changes hit all of them alike
    prog = [
        {"name": "lynx", "anchor": sz["anchor"], "residual": sz["residual"],
         "anchor_delay": None, "repeat": 1},
        *({"name": k, "anchor": sz[k], "residual": 0, "repeat": 1}
          for k in ("bf16", "int8", "int4")),
    ] * repeat
    cfg: dict = {"program": prog}
    if link == "throttle":
        cfg["backend_options"] = {"_throttle_bps": bps / 8}
        rx, tx = lb.run_pair("lynx", cfg, None, timeout=3600)
    else:
        import os

        with ShapedLink(f"lxbt{os.getpid() % 10000}") as lab:
            lab.set_rate(rate)
            rx, tx = lb.run_pair("lynx", cfg, lab, timeout=3600)
    times: dict[str, list] = {}
    for r, t in zip(rx["results"], tx["results"], strict=True):
        name = r["name"]
        if name == "lynx":
            times.setdefault("time_to_anchor", []).append(r["anchor"]["t_done"] - t["anchor_post"])
            times.setdefault("time_to_residual", []).append(
                r["residual"]["t_done"] - t["anchor_post"])
        else:
            times.setdefault(name, []).append(r["anchor"]["t_done"] - t["anchor_post"])
    med = {k: float(np.median(v)) for k, v in times.items()}
    ratios = {}
    for stage in ("time_to_anchor", "time_to_residual"):
        for base in ("bf16", "int8", "int4"):
            ratios[f"{stage}/{base}"] = med[stage] / med[base]
    ideal = {k: sz[k] * 8 / bps for k in ("anchor", "bf16", "int8", "int4")}
    ideal["anchor+residual"] = (sz["anchor"] + sz["residual"]) * 8 / bps
    return {"link": link, "rate": rate, "rate_bps": bps, "times_s": times, "median_s": med,
            "ratios": ratios, "ideal_s": ideal}


def run(args: argparse.Namespace) -> int:
    sz = sizes(args.model, args.context, args.anchor_bits, args.target, args.group_size,
               args.sink_tokens, args.recent_tokens)
    res = measure(sz, args.rate, args.link, args.repeat)
    out = {"sizes": sz, **res}
    mib = 1 << 20
    print(f"{sz['model']}, {sz['context']} tokens, link {res['rate']} ({res['link']})")
    print(f"  bytes: anchor {sz['anchor'] / mib:.2f} MiB, residual {sz['residual'] / mib:.2f} MiB,"
          f" BF16 {sz['bf16'] / mib:.2f}, INT8 {sz['int8'] / mib:.2f}, INT4 {sz['int4'] / mib:.2f}")
    m = res["median_s"]
    print(f"  time-to-Anchor {1e3 * m['time_to_anchor']:.1f} ms, time-to-Residual "
          f"{1e3 * m['time_to_residual']:.1f} ms; BF16 {1e3 * m['bf16']:.1f} ms, "
          f"INT8 {1e3 * m['int8']:.1f} ms, INT4 {1e3 * m['int4']:.1f} ms")
    for k, v in res["ratios"].items():
        print(f"  {k:28s} {v:.3f}")
    if args.json_out:
        p = Path(args.json_out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(out, indent=1))
        print(f"wrote {p}")
    return 0
