#!/usr/bin/env python3
"""Shaped-link transport benchmarks (root; network namespaces + veth + tc tbf).

For each link rate, in one run on the same link:
  * goodput of our tcp backend ÷ a raw-socket transfer of the same bytes (goal ≥ 0.95),
  * Mooncake TransferEngine (TCP, P2P handshake) moving the same bytes: ratio ours/mooncake,
  * ANCHOR completion time with a concurrent large RESIDUAL ÷ ANCHOR alone (goal ≤ 1.05),
    both "together" (RESIDUAL posted first, ANCHOR right after) and "midflight" (ANCHOR arrives
    while the RESIDUAL is streaming),
  * (1 Gbit/s) the chunk-size sweep: how long an ANCHOR waits behind RESIDUAL chunks,
  * with --tls: our tcp backend with its data connections in TLS 1.3, in the same rounds as the
    plain one (goodput ratio TLS ÷ plain, CPU s per GB) and the priority ratios over TLS.

    sudo .venv/bin/python scripts/bench_link.py --out out/bench_link.json [--quick] [--tls]
Writes JSON (and a PNG next to it unless --no-plot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lynx_tools.bench import link as lb
from lynx_tools.cluster.netns import ShapedLink, netns_available

MiB = 1 << 20


def run(args) -> dict:
    reason = netns_available()
    if reason:
        raise SystemExit(f"bench_link: cannot build shaped links: {reason}")
    rates = args.rates.split(",")
    out: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
                 "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "rates": {}}
    name = f"lxb{os.getpid() % 100000}"
    tls = None
    if args.tls:
        from lynx_tools.cluster.netns import RECEIVER_IP, SENDER_IP
        from lynx_tools.cluster.tls_certs import make_certs

        files = make_certs(Path(args.out).parent / "bench_link_tls",
                           [RECEIVER_IP, SENDER_IP, "127.0.0.1"])
        tls = {"cert_file": str(files.cert_file), "key_file": str(files.key_file),
               "ca_file": str(files.ca_file)}
    with ShapedLink(name) as lab:
        for rate in rates:
            gbit = float(rate.lower().replace("gbit", ""))
            lab.set_rate(rate)
            scale = max(1, int(gbit))
            bulk = (64 if args.quick else 256) * MiB * min(scale, 2)
            rep = 2 if args.quick else 3
            entry: dict = {"rate": rate}
            print(f"[{rate}] goodput: {bulk // MiB} MiB x{rep} (raw, lynx, mooncake)", flush=True)
            entry["goodput"] = lb.measure_goodput(lab, bulk, rep, mooncake=not args.no_mooncake,
                                                  tls=tls)
            g = entry["goodput"]
            if tls:
                print(f"   lynx over TLS {g['lynx_tls_gbps']:.3f} Gbit/s, ÷ plain "
                      f"{g['ratio_tls_over_plain']:.3f}; CPU s/GB [sender, receiver] plain "
                      f"{g['lynx_cpu_s_per_gb']}, TLS {g['lynx_tls_cpu_s_per_gb']}", flush=True)
            if gbit > 1 and not args.quick:
                entry["goodput_no_checksum"] = lb.measure_goodput(
                    lab, bulk, rep, mooncake=False, raw=False, checksum=False)
                print(f"   lynx without CRC32: {entry['goodput_no_checksum']['lynx_gbps']:.3f}",
                      flush=True)
            print(f"   raw {g['raw_gbps']:.3f}  lynx {g['lynx_gbps']:.3f}  "
                  f"mooncake {g.get('mooncake_gbps', float('nan')):.3f} Gbit/s  "
                  f"lynx/raw {g['goodput_ratio_lynx_over_raw']:.3f}  "
                  f"lynx/mooncake {g.get('ratio_lynx_over_mooncake', float('nan')):.3f}",
                  flush=True)
            anchor = (8 if args.quick else 32) * MiB * min(scale, 2)
            resid = 4 * anchor * (1 if args.quick else 2)
            print(f"[{rate}] priority: anchor {anchor // MiB} MiB vs residual {resid // MiB} MiB",
                  flush=True)
            prep = 3 if args.quick else 5
            entry["priority"] = lb.measure_priority(lab, anchor, resid, prep, delay=0.15)
            p = entry["priority"]
            if tls:
                pt = entry["priority_tls"] = lb.measure_priority(lab, anchor, resid, prep,
                                                                 delay=0.15, tls=tls)
                print(f"   over TLS: anchor alone {1e3 * min(pt['alone_s']):.1f} ms; ratio "
                      f"together {pt['ratio_together']:.3f}, midflight "
                      f"{pt['ratio_midflight']:.3f}", flush=True)
            crossing = max(p["together_residual_crossing_bytes"]
                           + p["midflight_residual_crossing_bytes"])
            print(f"   anchor alone {1e3 * min(p['alone_s']):.1f} ms; ratio together "
                  f"{p['ratio_together']:.3f}, midflight {p['ratio_midflight']:.3f}; residual "
                  f"bytes crossing during the anchor: {crossing / MiB:.2f} MiB", flush=True)
            # control: no priority (weighted 50/50 ~ what two FIFO-sharing connections get)
            fair = lb.measure_priority(lab, anchor, resid, 2, delay=0.15, mode="weighted",
                                       residual_share=0.5)
            entry["control_fair_share"] = fair
            print(f"   control (50/50 share): ratio together {fair['ratio_together']:.3f}, "
                  f"midflight {fair['ratio_midflight']:.3f}", flush=True)
            if not args.quick and rate == rates[0]:
                sweep = []
                for chunk in (256 * 1024, 4 * MiB):
                    pr = lb.measure_priority(lab, anchor, resid, 2, delay=0.15, chunk_bytes=chunk)
                    sweep.append({k: pr[k] for k in ("chunk_bytes", "alone_s", "together_s",
                                                     "midflight_s", "ratio_together",
                                                     "ratio_midflight")})
                    print(f"   chunk {chunk // 1024} KiB: together {pr['ratio_together']:.3f} "
                          f"midflight {pr['ratio_midflight']:.3f}", flush=True)
                entry["chunk_sweep"] = sweep
                lab.set_rate(rate, "prio")
                pr = lb.measure_priority(lab, anchor, resid, 2, delay=0.15)
                entry["priority_pfifo_fast"] = pr
                print(f"   with pfifo_fast (TOS bands): together {pr['ratio_together']:.3f} "
                      f"midflight {pr['ratio_midflight']:.3f}", flush=True)
                lab.set_rate(rate)
            out["rates"][rate] = entry
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out["loadavg_end"] = os.getloadavg()
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(res["rates"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    w = 0.25
    for i, (key, label) in enumerate((("raw_gbps", "raw socket"), ("lynx_gbps", "lynx tcp"),
                                      ("mooncake_gbps", "Mooncake TCP"))):
        vals = [res["rates"][r]["goodput"].get(key, 0) for r in rates]
        ax1.bar([j + (i - 1) * w for j in range(len(rates))], vals, w, label=label)
    ax1.set_xticks(range(len(rates)), rates)
    ax1.set_ylabel("Gbit/s")
    ax1.set_title("goodput on a tbf-shaped veth link")
    ax1.legend()
    w2 = 0.2
    bars = (("priority", "alone_s", "Anchor alone"),
            ("priority", "together_s", "+ Residual (together)"),
            ("priority", "midflight_s", "+ Residual (mid-flight)"),
            ("control_fair_share", "midflight_s", "no priority (50/50), mid-flight"))
    for i, (entry, key, label) in enumerate(bars):
        vals = [1e3 * float(np.median(res["rates"][r][entry][key])) for r in rates]
        ax2.bar([j + (i - 1.5) * w2 for j in range(len(rates))], vals, w2, label=label)
    ax2.set_xticks(range(len(rates)), rates)
    ax2.set_ylabel("Anchor completion, median (ms)")
    ax2.set_title("strict priority vs no priority")
    ax2.set_ylim(0, ax2.get_ylim()[1] * 1.45)  # room for the legend
    ax2.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--out", default="out/bench_link.json")
    ap.add_argument("--rates", default="1gbit,5gbit")
    ap.add_argument("--quick", action="store_true", help="smaller transfers, fewer repeats")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--tls", action="store_true",
                    help="also measure the tcp backend with TLS data connections (certificates "
                         "made next to --out)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier run")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    res = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    if not args.no_plot:
        plot(res, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
