"""The report of `lynx-sglang bench-ttft` (tools/ttft/bench.py): the table it prints, the plot
(PNG) and the JSON document it writes, from the measured `VariantResult`s (`tools.ttft.results`)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path

from .results import (
    BENCH_SERVING,
    CLIENTS,
    LYNX_CLIENT,
    BenchConfig,
    VariantResult,
    medians,
    metric_values,
    same_text_as_baseline,
    spreads,
)


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def format_table(results: list[VariantResult], cfg: BenchConfig, link_desc: str,
                 ratio_table: dict[str, dict]) -> str:
    marks = cfg.token_marks
    tokens_from = BENCH_SERVING if cfg.use_bench_serving else LYNX_CLIENT
    cols = [(f"{BENCH_SERVING}.ttft_s", "TTFT (bench_serving)"),
            (f"{LYNX_CLIENT}.ttft_s", "TTFT (client)"),
            (f"{LYNX_CLIENT}.net_ttft_s", "net TTFT (client)"),
            *[(f"{tokens_from}.t{k}_s", f"token {k} ({tokens_from})") for k in marks],
            *[(f"{LYNX_CLIENT}.t{k}_from_done_s", f"token {k} from prefill done") for k in marks],
            (f"{LYNX_CLIENT}.tpot_s", f"per token, tokens {min(marks, default=0)}-"
                                      f"{max(marks, default=0)}")]
    # The client's own measures get their spread: the goals compare them, and one shared box
    # varies a lot from request to request.
    spread_of = {f"{LYNX_CLIENT}.net_ttft_s", f"{LYNX_CLIENT}.tpot_s",
                 *[f"{LYNX_CLIENT}.t{k}_from_done_s" for k in marks]}
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    values = [metric_values(r.requests, marks) for r in results]
    # A measure no variant has (bench_serving not run, no prefill line) gets no column.
    cols = [c for c in cols if any(c[0] in vals for vals in values)]
    head = ("variant", *[c[1] for c in cols], "bytes per stream")
    rows = []
    for r, vals in zip(results, values, strict=True):
        cells = [("-" if k not in vals else
                  f"{ms(statistics.median(vals[k]))} ms" if k not in spread_of or len(vals[k]) < 2
                  else f"{ms(statistics.median(vals[k]))} ms ({ms(min(vals[k]))}-{ms(max(vals[k]))})")
                 for k, _ in cols]
        b = r.stream_bytes
        if not b:
            nbytes = "unavailable"
        elif "kv" in b:
            nbytes = f"KV {_mib(b['kv'])} (computed)"
        else:
            nbytes = f"Anchor {_mib(b['anchor'])} / Residual {_mib(b['residual'])}"
        rows.append((r.variant.name, *cells, nbytes))
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))  # noqa: E731
    lines = [f"link: {link_desc}; {cfg.requests} request(s) per client per variant, "
             f"{cfg.pacing}; {cfg.prompt_tokens}-token prompts, {cfg.max_new_tokens} new tokens, "
             "greedy; medians",
             fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    for pair, vals in ratio_table.items():
        shown = ", ".join(f"{k} {v:.2f}" for k, v in vals.items()
                          if k.endswith(("ttft_s", f"t{marks[-1]}_s",
                                         f"t{marks[-1]}_from_done_s")))
        lines.append(f"{pair} (> 1: faster than {cfg.baseline}): {shown}")
    if cfg.use_bench_serving:
        same = {r.variant.name: r.same_text_both_clients for r in results}
        lines.append(f"same output text from both clients (same prompts): {same}")
    same = same_text_as_baseline(results, cfg.baseline)
    if same:
        exact = {r.variant.name: r.variant.exact for r in results}
        lines.append(f"same output text as {cfg.baseline}, prompt by prompt: " + ", ".join(
            f"{name} {ok}" + ("" if exact[name] else " (lossy variant)")
            for name, ok in same.items()))
    spec = {r.variant.name: [q.speculation for q in r.requests if q.speculation]
            for r in results}
    if any(spec.values()):
        lines.append("speculated/accepted/rolled back tokens per request (lynx client): " + "; ".join(
            f"{name} " + ", ".join(f"{o['speculated']}/{o['accepted']}/{o['rolled_back']}"
                                   for o in outcomes)
            for name, outcomes in spec.items() if outcomes))
    lines.append("TTFT: send -> first token at that client; net TTFT: prefill forward done (prefill "
                 "log) -> first token at lynx_tools.client (bench_serving keeps no wall-clock "
                 "send time); token k: send -> k-th streamed token; from prefill done: the same "
                 "minus the prefill's forward; per token: between the first and last token mark "
                 "(a speculative request's verified tokens reach the client at once, so there it "
                 "is below the decode's pace); (min-max) over the requests.")
    for r in results:
        if r.unavailable:
            lines.append(f"{r.variant.name}: unavailable for an already running cluster "
                         "(only HTTP reaches it):")
            lines += [f"  - {why}" for why in r.unavailable]
    return "\n".join(lines)


def plot(results: list[VariantResult], cfg: BenchConfig, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The network-exposed TTFT gets its own panel: it is far smaller than the end-to-end times.
    values = [metric_values(r.requests, cfg.token_marks) for r in results]
    # A client that sent nothing (`--no-bench-serving`) gets no empty groups.
    panels = [[f"{LYNX_CLIENT}.net_ttft_s"],
              [k for k in (f"{BENCH_SERVING}.ttft_s", f"{LYNX_CLIENT}.ttft_s",
                           *[f"{c}.t{m}_s" for m in cfg.token_marks for c in CLIENTS],
                           *[f"{LYNX_CLIENT}.t{m}_from_done_s" for m in cfg.token_marks])
               if any(vals.get(k) for vals in values)]]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(panels[1]), 4.5),
                             gridspec_kw={"width_ratios": [1.6, 1.6 * len(panels[1])]})
    width = 0.8 / len(results)
    for ax, keys in zip(axes, panels, strict=True):
        for i, (r, vals) in enumerate(zip(results, values, strict=True)):
            xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(keys))]
            meds = [statistics.median(vals[k]) if vals.get(k) else 0.0 for k in keys]
            ax.bar(xs, meds, width, label=r.variant.name)
            for x, k in zip(xs, keys, strict=True):  # each request as a dot over its median bar
                ax.plot([x] * len(vals.get(k, [])), vals.get(k, []), "k.", markersize=3)
        ax.set_xticks(range(len(keys)),
                      [k.removesuffix("_s").replace(".", "\n") for k in keys], fontsize=8)
    axes[0].set_ylabel("seconds (median; dots: requests)")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def result_json(results: list[VariantResult], cfg: BenchConfig, link_desc: str,
                ratio_table: dict[str, dict], extra: dict) -> dict:
    same = same_text_as_baseline(results, cfg.baseline)
    return {
        "config": asdict(cfg) | {"link_desc": link_desc,
                                 "variant_specs": [asdict(r.variant) for r in results]} | extra,
        "variants": {r.variant.name: {
            "stream_bytes": r.stream_bytes, "bytes_measured": r.bytes_measured,
            "same_text_both_clients": r.same_text_both_clients, "run_dir": r.run_dir,
            "warmup_attempts": r.warmup_attempts, "server_config": r.server_config,
            "unavailable": list(r.unavailable), "failed": list(r.failed),
            "medians": medians(r.requests, cfg.token_marks),
            "spreads": spreads(r.requests, cfg.token_marks),
            "same_text_as_baseline": same.get(r.variant.name),
            "requests": {c: [asdict(q) for q in r.requests if q.client == c] for c in CLIENTS},
        } for r in results},
        "ratios": ratio_table,
    }

