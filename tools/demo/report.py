"""What `lynx-sglang demo` (tools/demo/run.py) prints and writes about one or more links, from
bench-ttft's measured `VariantResult`s (`tools.ttft.results`): the headline (TTFT from the send and
the 16th / 64th token per variant, with R and the GPU deployments it stands for), whether the
comparison was fair (each variant's prefill forward), the outputs' agreement, the fast-link case in
the README's words, `demo.json` and the timeline PNG.

Pure: no servers. Called by `tools.demo.run`; tests/sglang/test_demo_report.py runs it on canned
results.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from ..regimes import Deployment, nearest
from ..ttft.regime import Regime, regime_json, wire_bytes
from ..ttft.report import result_json
from ..ttft.results import (
    LYNX_CLIENT,
    BenchConfig,
    RequestTiming,
    VariantResult,
    medians,
    metric_values,
    ratios,
    same_text_as_baseline,
)
from ..variants import Variant

TOKEN_MARKS = (16, 64)
# Variants whose median forwards differ by more than this share are not compared fairly: TTFT
# from the send includes the forward, whatever the transfer did.
FAIR_FORWARD_SPREAD = 0.10
# A TTFT ratio within this share of 1 reads "even": two requests per variant on a shared box
# move by about that much (docs/benchmarks.md).
EVEN_WITHIN = 0.10
# Below this R the forward hides the wire on this box (docs/benchmarks.md, "What Lynx's gain
# depends on"): the fast-link case.
FAST_LINK_R = 0.3
# The README's words for that case (tests/test_demo_readme.py keeps the README saying them).
FAST_LINK_WORDS = "where the forward hides the wire (R ≪ 1), Lynx changes nothing on TTFT"
# The README's measurement of it, quoted when a demo run did not measure a fast link itself.
FAST_LINK_MEASURED = ("measured at 1 Gbit/s (R ≈ 0.06), 8 requests each, interleaved: "
                      "mooncake-nospin 5.18 s, Lynx 4.77 s from the send (paired 0.97), "
                      "2026-12-07, 57197f1")
FAST_LINK_COMMAND = "lynx-sglang demo --regime 0.06"


@dataclass(frozen=True)
class DemoRun:
    """One link's interleaved requests. `regime`: the R the link was shaped for (`bench-ttft
    --regime`'s record; None with a fixed --link or loopback); `link_bps`: the shaped rate (None:
    loopback); `kv_bytes`: one prompt's BF16 KV, R's numerator."""

    link_desc: str
    link_bps: float | None
    kv_bytes: int
    cfg: BenchConfig
    results: list[VariantResult]
    regime: Regime | None = None

    def forwards_s(self) -> dict[str, float]:
        """Variant -> median send -> its prefill's forward done (SGLang's bootstrap included)."""
        return {r.variant.name: statistics.median(done) for r in self.results
                if (done := [q.prefill_done_s for q in _client(r)
                             if q.prefill_done_s is not None])}

    @property
    def wire_s(self) -> float | None:
        """The BF16 KV's wire time at this link's rate."""
        return None if not self.link_bps else self.kv_bytes * 8 / self.link_bps

    @property
    def r(self) -> float | None:
        """R achieved: the BF16 KV's wire time ÷ the baseline's median forward in this run."""
        forward = self.forwards_s().get(self.cfg.baseline)
        return None if self.wire_s is None or not forward else self.wire_s / forward

    def deployments(self) -> list[Deployment]:
        return nearest(self.r, k=2) if self.r else []


@dataclass(frozen=True)
class Fairness:
    """Each variant's median forward; unfair when they differ by more than
    FAIR_FORWARD_SPREAD."""

    forwards_s: dict[str, float]

    @property
    def spread(self) -> float:
        values = list(self.forwards_s.values())
        return max(values) / min(values) - 1 if values and min(values) > 0 else 0.0

    @property
    def fair(self) -> bool:
        return self.spread <= FAIR_FORWARD_SPREAD

    def describe(self) -> str:
        each = ", ".join(f"{name} {s:.2f} s" for name, s in self.forwards_s.items())
        if self.fair:
            return (f"fair: every variant's prefill forward within {FAIR_FORWARD_SPREAD * 100:.0f} % of "
                    f"the others' ({each})")
        slow = max(self.forwards_s, key=self.forwards_s.get)
        fast = min(self.forwards_s, key=self.forwards_s.get)
        gap = self.forwards_s[slow] - self.forwards_s[fast]
        return (f"NOT A FAIR COMPARISON: the prefill forwards differ by {self.spread * 100:.0f} % "
                f"({each}). TTFT from the send includes the forward, so {slow}'s TTFT carries "
                f"{gap:.2f} s more forward than {fast}'s whatever the transfer did, and the "
                f"comparison leans towards {fast}: the box's load changed between the requests "
                "(other work on its cores) or one variant's servers took CPU from the prefill. "
                "Compare the net TTFT (forward done -> first token), or run the demo again on a "
                "quieter box.")


def fairness(run: DemoRun) -> Fairness:
    return Fairness(run.forwards_s())


def label(variant: Variant) -> str:
    """What a variant is, in the headline's words."""
    if variant.transfer_backend != "lynx":
        return f"SGLang {variant.transfer_backend}"
    args = variant.server_args
    if "--no-lynx-residual" in args:
        text = "Lynx, Anchor only"
    elif "--lynx-target" in args:
        text = f"Lynx {args[args.index('--lynx-target') + 1]}"
    else:
        text = "Lynx"
    if "--no-lynx-speculate" in args and "--no-lynx-residual" not in args:
        text += ", no speculation"
    return text + ("" if variant.exact else " (lossy)")


def _client(r: VariantResult) -> list[RequestTiming]:
    return [q for q in r.requests if q.client == LYNX_CLIENT]


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _cell(values: list[float] | None) -> str:
    if not values:
        return "-"
    med = f"{statistics.median(values):.2f}"
    return f"{med} s" if len(values) < 2 else f"{med} s ({min(values):.2f}-{max(values):.2f})"


def compare(base_s: float | None, other_s: float | None) -> str:
    """`other` against the baseline: N× sooner, even (within EVEN_WITHIN), or N× later."""
    if not base_s or not other_s:
        return "n/a"
    ratio = base_s / other_s
    if abs(ratio - 1) <= EVEN_WITHIN:
        return f"even ({ratio:.2f}×)"
    return f"{ratio:.2f}× sooner" if ratio > 1 else f"{1 / ratio:.2f}× later"


def _spec(r: VariantResult) -> str:
    outcomes = [q.speculation for q in _client(r) if q.speculation]
    return ", ".join(f"{o['speculated']}/{o['accepted']}/{o['rolled_back']}"
                     for o in outcomes) or "-"


def _bytes(r: VariantResult, link_bps: float | None) -> str:
    nbytes = wire_bytes(r)
    if nbytes is None:
        return "-"
    text = f"{nbytes / 2**20:.1f} MiB"
    return text + (f" ({nbytes * 8 / link_bps:.2f} s)" if link_bps else "")


def _r_line(run: DemoRun) -> str:
    if run.link_bps is None:
        return (f"no shaped link ({run.link_desc}): R unknown, far below 1 on loopback, the "
                "fast-link case")
    how = (f"shaped for R {run.regime.rate.r_target:g} from a "
           f"{run.regime.calibration.forward_s:.2f} s calibration forward"
           if run.regime else "a fixed rate (--link)")
    r = f"R = {run.r:.2g}" if run.r else "R unavailable (no forward measured)"
    rate = (f"{run.link_bps / 1e9:.2f} Gbit/s" if run.link_bps >= 1e9 else
            f"{run.link_bps / 1e6:.3g} Mbit/s")
    return (f"{r} (the BF16 KV's wire time {run.wire_s:.2f} s ÷ {run.cfg.baseline}'s prefill "
            f"forward); link {rate}, {how}")


def headline_metrics(run: DemoRun) -> dict[str, dict[str, float | None]]:
    """Variant -> median forward, TTFT from the send, token 16 / 64 from the send, net TTFT."""
    forwards = run.forwards_s()
    out = {}
    for r in run.results:
        vals = metric_values(_client(r), run.cfg.token_marks)
        out[r.variant.name] = {"forward_s": forwards.get(r.variant.name),
                               "ttft_s": _median(vals.get(f"{LYNX_CLIENT}.ttft_s")),
                               **{f"t{k}_s": _median(vals.get(f"{LYNX_CLIENT}.t{k}_s"))
                                  for k in run.cfg.token_marks},
                               "net_ttft_s": _median(vals.get(f"{LYNX_CLIENT}.net_ttft_s"))}
    return out


def outputs_verdict(run: DemoRun) -> tuple[bool | None, str]:
    """(exact variants identical to the baseline on every prompt: True / False / None when none
    compared, the line that says so)."""
    base = run.cfg.baseline
    same = same_text_as_baseline(run.results, base)
    exact = {r.variant.name: r.variant.exact for r in run.results}
    parts, verdicts = [], []
    for name, ok in same.items():
        if exact[name]:
            verdicts.append(ok)
            parts.append(f"{name} {'identical' if ok else 'NOT IDENTICAL'}"
                         if ok is not None else f"{name} not compared (no prompt in common)")
        else:
            parts.append(f"{name} (lossy) {'the same text' if ok else 'other text'}"
                         if ok is not None else f"{name} (lossy) not compared")
    if not parts:
        return None, "outputs: nothing to compare (one variant)"
    known = [v for v in verdicts if v is not None]
    identical = all(known) if known else None
    return identical, f"outputs against {base}'s, prompt by prompt: " + "; ".join(parts)


def format_run(run: DemoRun) -> str:
    """One link's block: R and what it stands for, the table, the headline, fairness, outputs."""
    cfg, marks = run.cfg, run.cfg.token_marks
    lines = [_r_line(run)]
    if run.deployments():
        lines.append("  on GPUs that is about (estimates, docs/benchmarks.md): "
                     + "; ".join(d.label() for d in run.deployments()))
    lines.append(f"  {cfg.requests} request(s) per variant, {cfg.prompt_tokens}-token prompts, "
                 f"{cfg.max_new_tokens} new tokens, greedy; interleaved round by round with all "
                 f"{len(run.results)} clusters up; medians (min-max) from the client's send")
    forwards = run.forwards_s()
    head = ("variant", "what", "forward", "TTFT", *[f"token {k}" for k in marks], "net TTFT",
            "on the wire", "spec/acc/rb")
    rows = []
    for r in run.results:
        vals = metric_values(_client(r), marks)
        fwd = forwards.get(r.variant.name)
        rows.append((r.variant.name, label(r.variant), "-" if fwd is None else f"{fwd:.2f} s",
                     _cell(vals.get(f"{LYNX_CLIENT}.ttft_s")),
                     *[_cell(vals.get(f"{LYNX_CLIENT}.t{k}_s")) for k in marks],
                     _cell(vals.get(f"{LYNX_CLIENT}.net_ttft_s")), _bytes(r, run.link_bps),
                     _spec(r)))
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in (head, *rows)]
    metrics = headline_metrics(run)
    base = metrics.get(cfg.baseline)
    if base is not None:
        for key, what in (("ttft_s", "TTFT from the send"),
                          *[(f"t{k}_s", f"token {k} from the send") for k in marks]):
            others = [f"{name} {m[key]:.2f} s ({compare(base[key], m[key])})"
                      for name, m in metrics.items()
                      if name != cfg.baseline and m[key] is not None]
            if base[key] is not None and others:
                lines.append(f"  {what}: {cfg.baseline} {base[key]:.2f} s -> "
                             + ", ".join(others))
    lines.append("  " + fairness(run).describe())
    lines.append("  " + outputs_verdict(run)[1])
    for r in run.results:
        if r.failed:
            lines.append(f"  {r.variant.name}: {len(r.failed)} request(s) FAILED, left out: "
                         + "; ".join(f"prompt {f['prompt']}: {f['error'][:200]}"
                                     for f in r.failed))
    if run.r is not None and run.r < FAST_LINK_R:
        lines.append(f"  a fast link: {FAST_LINK_WORDS}")
    return "\n".join(lines)


def fast_link_note(runs: list[DemoRun]) -> str | None:
    """The fast-link case in the README's words, when no run measured it."""
    if any(run.r is not None and run.r < FAST_LINK_R for run in runs):
        return None
    return (f"On a fast link, {FAST_LINK_WORDS} (README: {FAST_LINK_MEASURED}); "
            f"`{FAST_LINK_COMMAND}` measures it here.")


def format_report(runs: list[DemoRun]) -> str:
    blocks = [format_run(run) for run in runs]
    note = fast_link_note(runs)
    return "\n\n".join(blocks + ([note] if note else []))


def exit_status(runs: list[DemoRun]) -> int:
    """1 when an exact variant's output differed from the baseline's or a request failed."""
    bad = any(outputs_verdict(run)[0] is False or any(r.failed for r in run.results)
              for run in runs)
    return 1 if bad else 0


def run_json(run: DemoRun, extra: dict) -> dict:
    """One link's record: the headline's numbers, fairness, outputs, and bench-ttft's document of
    the requests (`regime_json` for a shaped R, else `result_json`)."""
    fair = fairness(run)
    identical, outputs = outputs_verdict(run)
    ratio_table = ratios({r.variant.name: medians(r.requests, run.cfg.token_marks)
                          for r in run.results}, run.cfg.baseline)
    return {
        "link_desc": run.link_desc, "link_bps": run.link_bps, "kv_bf16_bytes": run.kv_bytes,
        "wire_bf16_s": run.wire_s, "r_achieved": run.r,
        "r_target": run.regime.rate.r_target if run.regime else None,
        "deployments": [d.label() for d in run.deployments()],
        "headline": headline_metrics(run),
        "forwards_s": fair.forwards_s, "forward_spread": round(fair.spread, 4),
        "fair": fair.fair, "exact_outputs_identical": identical, "outputs": outputs,
        "detail": (regime_json(run.regime, run.link_desc, extra) if run.regime else
                   result_json(run.results, run.cfg, run.link_desc, ratio_table, extra)),
    }


def demo_json(runs: list[DemoRun], extra: dict) -> dict:
    return {**extra, "fast_link_note": fast_link_note(runs),
            "runs": [run_json(run, extra) for run in runs]}


# The streams' landing on a Lynx row (label, marker, colour, height above the bar's centre): at
# two heights, since with layer streaming both can land within a few ms of the forward's end.
_LANDINGS = {"anchor_landed": ("Anchor landed", "v", "tab:orange", 0.3),
             "residual_landed": ("Residual landed", "v", "tab:green", 0.5)}


def marks_by_time(token_s: dict[int, float | None],
                   within_s: float = 0.3) -> list[tuple[float, list[int]]]:
    """The token marks that arrived, those within `within_s` of the previous one under one label
    (one verification can release the 16th and the 64th token together)."""
    groups: list[tuple[float, list[int]]] = []
    for k, t in sorted((k, t) for k, t in token_s.items() if t is not None):
        if groups and t - groups[-1][0] < within_s:
            groups[-1][1].append(k)
        else:
            groups.append((t, [k]))
    return groups


def plot_timeline(runs: list[DemoRun], path: Path) -> None:
    """One panel per link, one row per request: send -> forward done -> first token -> last
    mark, with the Anchor's and the Residual's landing on each Lynx row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_per = [sum(len(_client(r)) for r in run.results) for run in runs]
    fig, axes = plt.subplots(len(runs), 1, squeeze=False,
                             figsize=(11, 1.6 + sum(0.55 * n + 0.8 for n in rows_per)),
                             gridspec_kw={"height_ratios": [max(n, 1) for n in rows_per]})
    seen: set[str] = set()

    def once(name: str) -> str | None:
        if name in seen:
            return None
        seen.add(name)
        return name

    for ax, run in zip(axes[:, 0], runs, strict=True):
        names = []
        for r in run.results:
            for q in _client(r):
                y = len(names)
                names.append(f"{r.variant.name} #{q.index + 1}")
                done = q.prefill_done_s or 0.0
                last = max((t for t in q.token_s.values() if t is not None), default=q.ttft_s)
                ax.barh(y, done, height=0.4, color="tab:blue", label=once("send -> forward done"))
                ax.barh(y, q.ttft_s - done, left=done, height=0.4, color="tab:red", alpha=0.6,
                        label=once("forward done -> first token"))
                ax.barh(y, last - q.ttft_s, left=q.ttft_s, height=0.4, color="tab:gray",
                        alpha=0.5, label=once("first token -> last marked token"))
                for key, (name, marker, color, height) in _LANDINGS.items():
                    t = q.lynx_events_s.get(key)
                    if t is not None:
                        ax.plot(t, y - height, marker=marker, color=color, markersize=8,
                                linestyle="", label=once(name))
                for t, ks in marks_by_time(q.token_s):
                    ax.plot(t, y, marker="|", color="black", markersize=14, linestyle="",
                            label=once("token 16 / 64"))
                    ax.annotate("/".join(map(str, ks)), (t, y + 0.35), fontsize=7, ha="center")
                ax.annotate(f"TTFT {q.ttft_s:.2f} s", (q.ttft_s, y + 0.35), fontsize=7,
                            ha="right")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(len(names) - 0.4, -0.8)  # top to bottom in table order
        r_text = f"R = {run.r:.2g}" if run.r else "R unknown"
        ax.set_title(f"{r_text}: {run.link_desc}", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the client sent the request")
    # Each item is labelled once, on whichever panel drew it first: one legend for the figure.
    handles, names = [], []
    for ax in axes[:, 0]:
        h, n = ax.get_legend_handles_labels()
        handles += h
        names += n
    fig.legend(handles, names, fontsize=8, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
