"""`lynx-sglang bench-ttft --regime R1,R2,…`: the link rate that puts this box at a wire-to-forward
ratio R (the BF16 KV's wire time ÷ the prefill forward, docs/benchmarks.md), and the report of one
run per R: TTFT from the send as the headline, beside the net TTFT, token times, bytes, the R
actually achieved and the GPU deployments (`tools.regimes`) that R stands for.

Owner of the rate arithmetic, the `--regime` options and the report; pure (no servers). Callers:
`tools.ttft.bench` (the options) and `tools.ttft.regime_run` (which starts the clusters, measures
the forward, shapes the link and builds `Regime`s).
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import asdict, dataclass, replace

from ..regimes import Deployment, nearest
from ..variants import Variant, variant_names
from .bounds import Bound, byte_bounds
from .report import result_json
from .results import LYNX_CLIENT, BenchConfig, VariantResult, medians, metric_values, ratios

# tc tbf's rate limits for this benchmark: below 1 Mbit/s a 1500-token SmolLM2 KV (277 Mbit) takes
# minutes per request; above 10 Gbit/s this box's veth cannot carry the rate, so tbf no longer
# shapes anything. netlab.sh takes whole kbit (bash integer arithmetic).
MIN_RATE_BPS = 1_000_000
MAX_RATE_BPS = 10_000_000_000
# The link while the forward is measured: the calibration request's KV must not wait on a slow
# link left by the previous R (the forward itself does not depend on the link).
CALIBRATION_LINK = "1gbit"
# Calibration requests per R; the fastest is the forward: a request right after a cluster's idle
# spell took 19 s where the next one took 8 s (2026-12-06, a loaded box).
CALIBRATION_REQUESTS = 2
# Mooncake's TransferEngine fails a transfer that takes longer than this many seconds (default
# 30): at a slow enough R × forward (a 1500-token SmolLM2 KV below ~9 Mbit/s) its KV never lands.
MOONCAKE_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
# SGLang's decode fails every request of a prefill whose bootstrap server misses this many
# heartbeats in a row (default 2: a GET /health every 5 s, read timeout 3 s). On the shaped link
# the heartbeat queues behind the KV in up to ~1.7 s of tc buffer each way at 5 Mbit/s (R = 16
# here), and a Lynx request failed that way on 2026-12-07 with its prefill alive; 6 misses still
# find a dead prefill within 30 s.
HEARTBEAT_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
HEARTBEAT_FAILURES = 6
REGIME_VARIANTS = "mooncake-nospin,lynx"
REGIME_HELP = (
    "comma-separated wire-to-forward ratios R (e.g. 0.3,2,8): R = the BF16 KV's wire time ÷ the "
    "prefill forward, the ratio that decides what Lynx buys (docs/benchmarks.md). Measures this "
    "box's forward for the prompt (before each R, the fastest of "
    f"{CALIBRATION_REQUESTS} requests: send -> the prefill's forward done), computes the "
    "prompt's BF16 KV bytes from the model config, and shapes the "
    "link to KV bits ÷ (R × forward), clamped to 1 Mbit/s-10 Gbit/s (printed). All clusters stay "
    "up; the link is re-shaped between R values and the variants are interleaved within each R; "
    f"Mooncake may wait --request-timeout-s for a transfer ({MOONCAKE_TIMEOUT_ENV}). "
    "Implies --interleave --no-bench-serving; not with --link or --url. Defaults here: --variants "
    f"{REGIME_VARIANTS}, --baseline the first variant. Writes <out>/bench_ttft_regimes.json (one "
    "record per R) and prints, per R, the GPU deployments it stands for (estimates).")


def parse_regimes(text: str) -> tuple[float, ...]:
    """`--regime`'s argparse type: positive ratios, in the order given."""
    try:
        rs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not rs or any(r <= 0 for r in rs):
        raise argparse.ArgumentTypeError(f"every R must be a positive number: {text!r}")
    return rs


def check_regime_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--regime's own defaults and what it implies, before `bench.check_arguments` fills in
    the other launch defaults (it has refused --regime with --url already)."""
    if args.regime is None:
        return
    if args.link is not None:
        parser.error("--regime shapes the link itself for each R; leave out --link")
    args.variants = args.variants or REGIME_VARIANTS
    args.baseline = args.baseline or variant_names(args.variants)[0]
    args.interleave = True
    args.use_bench_serving = False


def slow_link_variant(variant: Variant, timeout_s: float) -> Variant:
    """`variant` for a slow shaped link: its Mooncake transfers allowed `timeout_s` (the request's
    own timeout) instead of 30 s, and SGLang's heartbeat from decode to prefill allowed
    `HEARTBEAT_FAILURES` misses in a row instead of 2, for every backend alike."""
    env = (*variant.env, (HEARTBEAT_ENV, str(HEARTBEAT_FAILURES)))
    if variant.transfer_backend.startswith("mooncake"):
        env = (*env, (MOONCAKE_TIMEOUT_ENV, str(math.ceil(timeout_s))))
    return replace(variant, env=env)


@dataclass(frozen=True)
class LinkRate:
    """The shaped link for one R: `wanted_bps` puts the BF16 KV's wire time at R × forward;
    `bps` is what tc gets (whole kbit, clamped to MIN_RATE_BPS..MAX_RATE_BPS)."""

    r_target: float
    wanted_bps: float
    bps: int

    @property
    def clamped(self) -> bool:
        return self.wanted_bps < MIN_RATE_BPS or self.wanted_bps > MAX_RATE_BPS

    @property
    def tc(self) -> str:
        return f"{self.bps // 1000}kbit"

    def describe(self) -> str:
        text = f"{self.bps / 1e6:.2f} Mbit/s (tc {self.tc})"
        if self.clamped:
            text += f", clamped: R {self.r_target:g} wanted {self.wanted_bps / 1e6:.3g} Mbit/s"
        return text


def link_rate_for(r: float, kv_bytes: int, forward_s: float) -> LinkRate:
    """The rate at which `kv_bytes` take `r` × `forward_s` on the wire."""
    if r <= 0 or kv_bytes <= 0 or forward_s <= 0:
        raise ValueError(f"R, KV bytes and forward must be positive: {r}, {kv_bytes}, {forward_s}")
    wanted = kv_bytes * 8 / (r * forward_s)
    kbit = min(max(round(wanted / 1000), MIN_RATE_BPS // 1000), MAX_RATE_BPS // 1000)
    return LinkRate(r, wanted, kbit * 1000)


@dataclass(frozen=True)
class Calibration:
    """The forward R is set from: per calibration request (`rids`), send -> the prefill's forward
    done (its `prefill_done` trace mark; SGLang's bootstrap handshake and queueing included); the
    fastest of them counts (see CALIBRATION_REQUESTS)."""

    variant: str
    rids: tuple[str, ...]
    samples_s: tuple[float, ...]

    @property
    def forward_s(self) -> float:
        return min(self.samples_s)


@dataclass(frozen=True)
class Regime:
    """One R's run: the link it was shaped to, from which forward, and what each variant gave."""

    rate: LinkRate
    calibration: Calibration
    kv_bytes: int  # the prompt's BF16 KV
    cfg: BenchConfig  # link = rate.tc
    results: list[VariantResult]

    @property
    def wire_s(self) -> float:
        return self.kv_bytes * 8 / self.rate.bps

    @property
    def measured_forward_s(self) -> float | None:
        """Median send -> forward done of the baseline's requests in this R (the calibration's
        forward drifts with the box's speed)."""
        done = [q.prefill_done_s for r in self.results if r.variant.name == self.cfg.baseline
                for q in r.requests if q.client == LYNX_CLIENT and q.prefill_done_s is not None]
        return statistics.median(done) if done else None

    @property
    def r_achieved(self) -> float | None:
        forward = self.measured_forward_s
        return None if not forward else self.wire_s / forward

    def deployments(self) -> list[Deployment]:
        return nearest(self.rate.r_target)

    def bounds(self) -> dict[str, Bound]:
        """Each variant's byte bound in this R (`bounds`), from the measured forward."""
        return byte_bounds(self.results, self.cfg.baseline, self.measured_forward_s,
                           self.rate.bps)

    def ratio_table(self) -> dict[str, dict]:
        return ratios({r.variant.name: medians(r.requests, self.cfg.token_marks)
                       for r in self.results}, self.cfg.baseline)


def wire_bytes(result: VariantResult) -> int | None:
    """One request's bytes on the link (measured for Lynx, computed for a full-KV transfer)."""
    return sum(result.stream_bytes.values()) if result.stream_bytes else None


def _cell(values: list[float] | None) -> str:
    if not values:
        return "-"
    med = f"{statistics.median(values):.2f} s"
    return med if len(values) < 2 else f"{med} ({min(values):.2f}-{max(values):.2f})"


def format_regime(g: Regime) -> str:
    """One R's block of the text report."""
    cfg, marks = g.cfg, g.cfg.token_marks
    achieved = (f"achieved R {g.r_achieved:.2f} (forward {g.measured_forward_s:.2f} s in this R's "
                f"{cfg.baseline} requests)" if g.r_achieved else "achieved R unavailable")
    lines = [f"R {g.rate.r_target:g}: link {g.rate.describe()}; BF16 KV on the wire "
             f"{g.wire_s:.2f} s vs forward {g.calibration.forward_s:.2f} s (calibration); "
             + achieved,
             "  stands for (estimates, docs/benchmarks.md): "
             + "; ".join(d.label() for d in g.deployments())]
    keys = [("ttft_s", "TTFT from send"), ("net_ttft_s", "net TTFT"),
            *[(f"t{k}_s", f"token {k} from send") for k in marks]]
    head = ("variant", *[h for _, h in keys], "bytes (wire time at this rate)")
    rows = []
    for r in g.results:
        vals = metric_values(r.requests, marks)
        nbytes = wire_bytes(r)
        rows.append((r.variant.name, *[_cell(vals.get(f"{LYNX_CLIENT}.{k}")) for k, _ in keys],
                     "-" if nbytes is None else
                     f"{nbytes / 2**20:.2f} MiB ({nbytes * 8 / g.rate.bps:.2f} s)"))
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
              for row in (head, *rows)]
    for r in g.results:
        if r.failed:
            lines.append(f"  {r.variant.name}: {len(r.failed)} request(s) failed, left out: "
                         + "; ".join(f"prompt {f['prompt']}: {f['error'][:200]}" for f in r.failed))
    for pair, vals in g.ratio_table().items():
        if f"{LYNX_CLIENT}.ttft_s" in vals:
            lines.append(f"  {pair.replace('/', ' ÷ ')}, TTFT from send: "
                         f"{vals[f'{LYNX_CLIENT}.ttft_s']:.2f} (> 1: faster than {cfg.baseline})")
    bounds = g.bounds()
    if bounds:
        lines.append("  TTFT from send ÷ its byte bound (forward, the bytes the first token waits "
                     "for, the baseline's fixed cost; docs/benchmarks.md): " + "; ".join(
                         f"{name} {b.ratio:.2f} (bound {b.bound_s:.2f} s)"
                         for name, b in bounds.items() if b.ratio is not None))
    return "\n".join(lines)


def format_report(regimes: list[Regime]) -> str:
    if not regimes:
        return "no R measured"
    cfg = regimes[0].cfg
    return "\n\n".join([
        f"{cfg.prompt_tokens}-token prompts (BF16 KV {regimes[0].kv_bytes / 2**20:.1f} MiB, "
        f"{regimes[0].kv_bytes * 8 / 1e6:.0f} Mbit), {cfg.max_new_tokens} new tokens, greedy; "
        f"{cfg.requests} request(s) per variant per R, {cfg.pacing}; medians (min-max). "
        "R = BF16 KV wire time ÷ prefill forward (send -> forward done).",
        *map(format_regime, regimes)])


def regime_json(g: Regime, link_desc: str, extra: dict) -> dict:
    """One R's record: the rate and forward it was set from, the R achieved, the deployments it
    stands for, and bench-ttft's usual document of the variants (`result_json`)."""
    return {
        "r_target": g.rate.r_target, "rate": asdict(g.rate) | {"tc": g.rate.tc,
                                                                "clamped": g.rate.clamped},
        "calibration": asdict(g.calibration) | {"forward_s": g.calibration.forward_s},
        "kv_bf16_bytes": g.kv_bytes,
        "wire_bf16_s": round(g.wire_s, 6), "measured_forward_s": g.measured_forward_s,
        "r_achieved": None if g.r_achieved is None else round(g.r_achieved, 4),
        "variant_wire": {r.variant.name: {"bytes": wire_bytes(r), "bytes_measured":
                                          r.bytes_measured, "wire_s_at_rate": None if
                                          wire_bytes(r) is None else
                                          round(wire_bytes(r) * 8 / g.rate.bps, 6)}
                         for r in g.results},
        "deployments": [{"label": d.label(), "model": d.model.name, "tokens": d.tokens,
                         "h100s": d.model.gpus, "link_gbps": d.link_gbps, "mfu": d.mfu,
                         "forward_s_estimate": round(d.forward_s, 4),
                         "r_estimate": round(d.r, 4)} for d in g.deployments()],
        "byte_bounds": {name: asdict(b) | {"ratio": b.ratio} for name, b in g.bounds().items()},
        "bench": result_json(g.results, g.cfg, link_desc, g.ratio_table(), extra),
    }
