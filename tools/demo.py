"""`lynx-sglang demo`: the README's main job. For each PD cluster variant of
`tools.variants.VARIANTS` (by name; default mooncake, lynx-nospec, lynx, int4-anchor), start
a local PD cluster (prefill + decode + router) on the same link, send a warm-up request and one
long-context streamed greedy request, and report side by side: TTFT, network-exposed TTFT, the
time to the 16th and 64th token, bytes per stream, speculated / accepted / rolled-back tokens
(speculative Lynx), total time, ratios of the network-exposed TTFT, and whether the exact
variants' outputs are identical (lossy ones are only scored against them), as a table,
`<out>/demo.json` and a timeline PNG.

Every server runs SGLang's default overlap scheduler unless `--disable-overlap-schedule` (or
`--variants NAME@no-overlap` for one variant): each variant sends one request at a time, so the
scheduler does not change its greedy tokens and the exact variants' outputs still compare token
for token. A Lynx prefill streams its KV layer by layer under either scheduler
(`lynx_sglang.backend.layer_stream`); the configuration line says which scheduler ran.

Times are wall-clock `time.time()` on this one machine: the client's send and each streamed token,
and the servers' trace records (`lynx_sglang.trace`, written to `<run dir>/trace`): the prefill
forward done (any backend), and for Lynx every stage of the transfer, SGLang's first step and
first token, and the verification. Each Lynx request also gets a stage breakdown of its
network-exposed TTFT (`tools.trace_report`). Clusters run one after the other and each is stopped
(whole process trees, link removed) before the next, also on error or Ctrl-C. Progress (variant
i/N, start-up waits, the request, an ETA) goes to stderr (`tools.progress`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lynx_kernels import KVShape
from lynx_sglang.errors import LynxError
from lynx_sglang.names import TIMELINE_ENV, TRACE_DIR_ENV

from .client import GenerateError, generate, generate_stream
from .cluster import Cluster
from .cluster_spec import ClusterMode, ClusterSpec
from .measure import (
    LYNX_EVENTS,
    add_kv_dtype_argument,
    kv_dtype_server_args,
    model_kv_shape,
    wait_for,
)
from .netns import netns_available
from .progress import Progress
from .prompts import WARMUP_PROMPT, passkey_prompt
from .regimes import nearest
from .trace_report import Breakdown, breakdown, format_breakdown, parse_rate, records_by_request
from .variants import (
    DISABLE_OVERLAP_HELP,
    NO_OVERLAP_SUFFIX,
    VARIANTS,
    WARMUP_ATTEMPTS,
    Variant,
    VariantError,
    scheduler_note,
    without_overlap,
)
from .variants import select_variants as _select

DEFAULT_VARIANTS = ("mooncake", "lynx-nospec", "lynx", "int4-anchor")
# (numerator, denominator) of the network-exposed TTFT ratios, shown when both ran.
RATIO_PAIRS = (("mooncake", "lynx"), ("lynx-nospec", "lynx"), ("lynx", "int4-anchor"))
TOKEN_MARKS = (16, 64)


class DemoError(LynxError):
    pass


@dataclass(frozen=True)
class SpecOutcome:
    """The speculation record of one request that speculated."""

    speculated: int
    accepted: int
    rolled_back: int
    verify_ms: float


@dataclass(frozen=True)
class DemoResult:
    """One variant's long request. Times are seconds relative to the client's send."""

    variant: str
    exact: bool
    prompt_tokens: int
    output_ids: list[int]
    prefill_done_s: float
    first_token_s: float
    last_token_s: float
    # Output token number (1-based, TOKEN_MARKS) -> arrival; None when fewer tokens streamed.
    token_s: dict[int, float | None]
    # Bytes per stream: {"anchor": .., "residual": ..} for Lynx, {"kv": ..} for mooncake.
    stream_bytes: dict[str, int]
    bytes_measured: bool  # False: computed from the KV shape, not read from the backend
    lynx_events_s: dict[str, float | None] = field(default_factory=dict)
    spec: SpecOutcome | None = None
    verified_s: float | None = None
    breakdown: Breakdown | None = None
    run_dir: str = ""
    # Lynx: whether its prefill streamed the KV layer by layer during the forward; not with
    # --no-lynx-layer-stream (`layer_streams`), nor where its stream policy found the link fast
    # enough to send after the forward (--lynx-layer-stream-min-share).
    layer_stream: bool = True

    @property
    def ttft_s(self) -> float:
        return self.first_token_s

    @property
    def network_ttft_s(self) -> float:
        return self.first_token_s - self.prefill_done_s


def default_link() -> str | None:
    return "1gbit" if netns_available() is None else None


def select_variants(names: str) -> list[Variant]:
    try:
        return _select(names)
    except VariantError as exc:
        raise DemoError(str(exc)) from exc


def layer_streams(variant: Variant) -> bool:
    """Whether a Lynx variant's prefill streams the KV during its forward (the default, under
    either scheduler; lynx_sglang.backend.layer_stream)."""
    return (variant.transfer_backend == "lynx"
            and "--no-lynx-layer-stream" not in variant.server_args)


def run_variant(variant: Variant, *, model_dir: Path, prompt_ids: list[int], max_new_tokens: int,
                link: str | None, run_dir: Path, kv_shape: KVShape, kv_dtype: str,
                startup_timeout_s: float, request_timeout_s: float,
                progress: Progress) -> DemoResult:
    trace_dir = run_dir / "trace"
    spec = ClusterSpec(
        str(model_dir), ClusterMode.PD, variant.transfer_backend, run_dir=run_dir,
        server_args=variant.server_args + kv_dtype_server_args(kv_dtype), link=link,
        startup_timeout_s=startup_timeout_s, tls=variant.tls,
        overlap_schedule=variant.overlap_schedule,
        extra_env={**dict(variant.env), TIMELINE_ENV: "1", TRACE_DIR_ENV: str(trace_dir)},
    )
    progress.start_variant(variant.name, f"starting cluster: prefill + decode + router "
                                         f"({variant.description}; logs {run_dir})")
    is_lynx = variant.transfer_backend == "lynx"
    t0 = time.monotonic()
    rid = f"demo-{variant.name}-{time.time_ns()}"
    with Cluster(spec, on_wait=progress.waiting) as cluster:
        # The warm-up also opens the transport session (see variants.WARMUP_ATTEMPTS).
        for attempt in range(1, WARMUP_ATTEMPTS + 1):
            progress.note(f"up in {time.monotonic() - t0:.0f} s; warm-up request, "
                          f"attempt {attempt}")
            try:
                generate(cluster.url, text=WARMUP_PROMPT, max_new_tokens=4,
                         timeout_s=request_timeout_s)
                break
            except GenerateError as exc:
                progress.note(f"warm-up failed: {exc}")
                if attempt == WARMUP_ATTEMPTS:
                    raise
        progress.request(1, 1, f"({len(prompt_ids)} prompt tokens, {max_new_tokens} new, "
                               "streamed)")
        # ignore_eos: every variant streams exactly max_new_tokens, so token 64 exists.
        got = generate_stream(cluster.url, input_ids=prompt_ids, max_new_tokens=max_new_tokens,
                              timeout_s=request_timeout_s, sampling={"ignore_eos": True},
                              rid=rid)
        needed = ("timeline", "decode", "request", "prefill") if is_lynx else ("timeline",)
        # The servers write their records asynchronously: give them a moment.
        wait_for(lambda: all(k in records_by_request(trace_dir, rid) for k in needed))
        records = records_by_request(trace_dir, rid)
    missing = [k for k in needed if k not in records]
    if missing:
        raise DemoError(f"{variant.name}: no {missing} trace record for request {rid} in "
                        f"{trace_dir}")
    rel = lambda t: None if t is None else round(t - got.t_send, 6)  # noqa: E731
    token_s = {k: rel(got.t_tokens[k - 1]) if k <= len(got.t_tokens) else None
               for k in TOKEN_MARKS}
    done = records["timeline"]["marks"]["prefill_done"]
    outcome = verified = None
    if is_lynx:
        facts, marks = records["decode"]["facts"], records["decode"]["marks"]
        stream_bytes = {"anchor": facts["anchor_bytes"], "residual": facts["residual_bytes"]}
        events = {k: rel(marks.get(k)) for k in LYNX_EVENTS}
        spec_rec = records.get("spec")
        if spec_rec is not None and spec_rec["facts"]["speculated"]:
            f, m = spec_rec["facts"], spec_rec["marks"]
            outcome = SpecOutcome(f["speculated"], f["accepted"], f["speculated"] - f["accepted"],
                                  round((m["verify_end"] - m["verify_start"]) * 1e3, 3))
            verified = rel(m["verify_end"])
    else:
        stream_bytes, events = {"kv": kv_shape.bytes_for(got.prompt_tokens)}, {}
    parts = breakdown(records, rid, got.t_first_token, parse_rate(link))
    progress.finish_variant()
    return DemoResult(
        variant.name, variant.exact, got.prompt_tokens, got.output_ids,
        rel(done), rel(got.t_first_token), rel(got.t_last_token), token_s, stream_bytes,
        is_lynx, events, outcome, verified, parts, str(run_dir),
        # What the prefill did with this room (its stream policy may send it after the forward).
        layer_streams(variant) and bool(records.get("prefill", {}).get("facts", {})
                                        .get("layer_streamed")))


def _fmt_bytes(result: DemoResult) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    if "kv" in result.stream_bytes:
        return f"KV {mib(result.stream_bytes['kv'])} (computed)"
    if not result.stream_bytes["residual"]:
        return f"Anchor {mib(result.stream_bytes['anchor'])} / no Residual"
    return (f"Anchor {mib(result.stream_bytes['anchor'])} / "
            f"Residual {mib(result.stream_bytes['residual'])}")


def _fmt_spec(result: DemoResult) -> str:
    if result.spec is None:
        return "-"
    s = result.spec
    return f"{s.speculated}/{s.accepted}/{s.rolled_back}"


def outputs_identical(results: list[DemoResult]) -> bool | None:
    """Among the exact variants; None when fewer than two of them ran."""
    exact = [r for r in results if r.exact]
    if len(exact) < 2:
        return None
    return len({tuple(r.output_ids) for r in exact}) == 1


def token_match(ids: list[int], reference: list[int]) -> tuple[int, int]:
    """(leading tokens identical, positions equal) of `ids` against `reference`."""
    prefix = 0
    for a, b in zip(ids, reference, strict=False):
        if a != b:
            break
        prefix += 1
    return prefix, sum(a == b for a, b in zip(ids, reference, strict=False))


def network_ttft_ratios(results: list[DemoResult]) -> dict[str, float]:
    """`a/b` -> a's network-exposed TTFT ÷ b's for RATIO_PAIRS that both ran (> 1: b faster)."""
    by = {r.variant: r.network_ttft_s for r in results}
    return {f"{a}/{b}": round(by[a] / by[b], 3) for a, b in RATIO_PAIRS
            if a in by and b in by and by[b] > 0}


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.0f}"


def format_table(results: list[DemoResult], link_desc: str) -> str:
    identical = outputs_identical(results)
    verdict = {True: "yes", False: "NO", None: "n/a (fewer than two exact variants)"}[identical]
    head = ("variant", "TTFT", "net TTFT", *[f"token {k} (pf)" for k in TOKEN_MARKS],
            "bytes per stream", "spec/acc/rb", "total")
    rows = []
    for r in results:
        marks = [f"{_ms(t)} ({_ms(None if t is None else t - r.prefill_done_s)}) ms"
                 for t in (r.token_s.get(k) for k in TOKEN_MARKS)]
        rows.append((r.variant, f"{_ms(r.ttft_s)} ms", f"{_ms(r.network_ttft_s)} ms", *marks,
                     _fmt_bytes(r), _fmt_spec(r), f"{_ms(r.last_token_s)} ms"))
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))  # noqa: E731
    lines = [f"link: {link_desc}; prompt {results[0].prompt_tokens} tokens, "
             f"{len(results[0].output_ids)} new tokens, greedy, ignore_eos",
             fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    for pair, ratio in network_ttft_ratios(results).items():
        lines.append(f"net TTFT {pair.replace('/', ' ÷ ')}: {ratio:.2f}")
    lines.append(f"outputs identical across exact variants "
                 f"({', '.join(r.variant for r in results if r.exact)}): {verdict}")
    reference = next((r.output_ids for r in results if r.exact), None)
    for r in results:
        if r.exact:
            continue
        if reference is None:
            lines.append(f"{r.variant}: lossy, not compared (no exact variant ran)")
        else:
            prefix, equal = token_match(r.output_ids, reference)
            lines.append(f"{r.variant}: lossy, not compared; vs the exact output: first {prefix}, "
                         f"{equal} of {len(reference)} positions equal")
    lines.append("TTFT: send -> first token at the client; net TTFT: prefill forward done "
                 "(prefill trace) -> first token; token k: send -> k-th streamed token (pf: from "
                 "prefill done); spec/acc/rb: speculative tokens decoded on the Anchor / accepted "
                 "/ rolled back at verification; total: send -> last token.")
    for r in results:
        if r.breakdown is not None and r.breakdown.speculated is not None:
            lines.append(f"{r.variant}:")
            lines.append(format_breakdown(r.breakdown))
    if any(not r.bytes_measured for r in results):
        lines.append("mooncake KV bytes are computed: prompt tokens x layers x 2 (K,V) x KV heads "
                     "x head dim x bytes per value of the KV pool's dtype.")
    return "\n".join(lines)


def regime_note(results: list[DemoResult], link_bps: float | None) -> str | None:
    """Where Lynx paid in this run, and where it would not, from its measured times: whether the
    prefill forward was long enough to hide Lynx's streams (layer streaming), or the link was
    the slow part (the Anchor first and speculation carry the first token)."""
    lynx = next((r for r in results if r.exact and "anchor" in r.stream_bytes), None)
    if lynx is None or not link_bps:
        return None
    wire_s = (lynx.stream_bytes["anchor"] + lynx.stream_bytes["residual"]) * 8 / link_bps
    head = (f"Where Lynx pays in this run: its forward took {lynx.prefill_done_s:.1f} s and its "
            f"streams need {wire_s * 1e3:.0f} ms of wire; ")
    whole = next((r for r in results if "kv" in r.stream_bytes), None)
    if whole is not None and lynx.prefill_done_s > 0:
        # R, the ratio every benchmark here is read by (docs/benchmarks.md), and what it stands
        # for on GPUs (tools/regimes.py: estimates).
        r = whole.stream_bytes["kv"] * 8 / link_bps / lynx.prefill_done_s
        head = (f"R (the whole KV's wire time / the forward) = {r:.2g}; on H100s that is about "
                + "; ".join(d.label() for d in nearest(r, k=2)) + ". " + head)
    if not lynx.layer_stream:
        return head + ("its prefill sent them after the forward, as mooncake_tcp sends its whole "
                       "transfer (--no-lynx-layer-stream, or a link fast enough against the "
                       "forward that streaming would not pay: --lynx-layer-stream-min-share), so "
                       "Lynx saves the bytes it leaves out and, on a link slower than the "
                       "forward, the wait for the Residual.")
    if wire_s < lynx.prefill_done_s:
        return head + ("layer streaming sent them while the forward ran, so after it only the "
                       "last layer was left; mooncake_tcp starts its whole transfer after the "
                       "forward. A link slower than the forward leaves the rest to the "
                       "Anchor-first stream and speculation.")
    return head + ("the link is the slow part: the Anchor goes first, the decode speculates on "
                   "it, and the Residual's bytes are what is left after the forward.")


def plot_timeline(results: list[DemoResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 1.4 + 1.3 * len(results)))
    markers = {"anchor_landed": ("Anchor landed", "o", "tab:orange"),
               "anchor_applied": ("Anchor applied", "s", "tab:orange"),
               "residual_landed": ("Residual landed", "o", "tab:green"),
               "residual_applied": ("Residual applied", "s", "tab:green")}
    seen = set()

    def label(name):
        if name in seen:
            return None
        seen.add(name)
        return name

    for y, r in enumerate(results):
        ax.barh(y, r.prefill_done_s, left=0, height=0.35, color="tab:blue",
                label=label("send -> prefill done"))
        ax.barh(y, r.network_ttft_s, left=r.prefill_done_s, height=0.35, color="tab:red",
                alpha=0.6, label=label("prefill done -> first token (network-exposed)"))
        ax.barh(y, r.last_token_s - r.first_token_s, left=r.first_token_s, height=0.35,
                color="tab:gray", alpha=0.6, label=label("first -> last token"))
        for key, t in r.lynx_events_s.items():
            if t is not None:
                name, marker, color = markers[key]
                ax.plot(t, y + 0.3, marker=marker, color=color, markersize=8, linestyle="",
                        label=label(name))
        if r.verified_s is not None:
            ax.plot(r.verified_s, y + 0.3, marker="D", color="tab:purple", markersize=8,
                    linestyle="", label=label("speculative tokens verified"))
        for k, t in r.token_s.items():
            if t is not None:
                ax.plot(t, y, marker="|", color="black", markersize=16, linestyle="",
                        label=label("token 16 / 64 arrived"))
                ax.annotate(str(k), (t, y + 0.2), fontsize=7, ha="center")
        ax.annotate(f"TTFT {r.ttft_s * 1e3:.0f} ms, net {r.network_ttft_s * 1e3:.0f} ms",
                    (r.first_token_s, y - 0.35), fontsize=8, ha="left")
    ax.set_yticks(range(len(results)), [r.variant for r in results])
    ax.set_ylim(-0.7, len(results) - 0.3)
    ax.invert_yaxis()  # top to bottom in table order
    ax.set_xlabel("seconds since the client sent the request (wall clock)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", "--backends", dest="variants",
                        default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {[v.name for v in VARIANTS]} "
                             f"(lynx_tools.variants.VARIANTS; default "
                             f"{','.join(DEFAULT_VARIANTS)}); --backends is an alias")
    parser.add_argument("--link", default="auto", metavar="RATE|auto|none",
                        help="shaped link between prefill and decode (two network namespaces, "
                             "root): a rate such as 1gbit; auto = 1gbit when root with ip/tc, "
                             "else loopback; none = loopback")
    parser.add_argument("--prompt-tokens", type=int, default=1500,
                        help="length of the long-context prompt (default 1500)")
    parser.add_argument("--max-new-tokens", type=int, default=max(TOKEN_MARKS),
                        help=f"streamed tokens (default {max(TOKEN_MARKS)}, so the "
                             f"{max(TOKEN_MARKS)}th token exists)")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="folder for demo.json, demo_timeline.png and the cluster logs")
    add_kv_dtype_argument(parser)
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help=DISABLE_OVERLAP_HELP + f"; NAME{NO_OVERLAP_SUFFIX} in --variants does "
                             "it for one variant")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from .model import embedded_model_dir

    variants = select_variants(args.variants)
    if args.disable_overlap_schedule:
        variants = [without_overlap(v, rename=False) for v in variants]
    if args.max_new_tokens < 1:
        raise DemoError("--max-new-tokens must be at least 1")
    link = default_link() if args.link == "auto" else (None if args.link == "none" else args.link)
    link_desc = (f"{link} shaped veth between two network namespaces (prefill | decode)"
                 if link else "loopback (no shaped link: not root or no ip/tc)")
    link_desc += f", {args.kv_dtype} KV"
    model_dir = Path(args.model or embedded_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = passkey_prompt(tokenizer, args.prompt_tokens)
    kv_shape = model_kv_shape(model_dir, args.kv_dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] model {model_dir}; link: {link_desc}; variants {[v.name for v in variants]}; "
          f"{scheduler_note(variants)}", flush=True)

    t0 = time.monotonic()
    results = []
    progress = Progress("demo", len(variants))
    try:
        for variant in variants:
            results.append(run_variant(
                variant, model_dir=model_dir, prompt_ids=prompt_ids,
                max_new_tokens=args.max_new_tokens, link=link,
                run_dir=(args.out / "demo_runs" / variant.name).resolve(), kv_shape=kv_shape,
                kv_dtype=args.kv_dtype,
                startup_timeout_s=args.startup_timeout_s,
                request_timeout_s=args.request_timeout_s, progress=progress))
    except KeyboardInterrupt:
        print("[demo] interrupted; the running cluster was stopped", file=sys.stderr)
        return 130
    table = format_table(results, link_desc)
    print()
    print(table)
    note = regime_note(results, parse_rate(link))
    if note:
        print(note)
    identical = outputs_identical(results)
    (args.out / "demo.json").write_text(json.dumps({
        "link": link, "link_desc": link_desc, "model": str(model_dir),
        "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
        "variants": [asdict(v) for v in variants],
        "exact_outputs_identical": identical,
        "network_ttft_ratios": network_ttft_ratios(results),
        "wall_s": round(time.monotonic() - t0, 1),
        "results": [asdict(r) | {"ttft_s": r.ttft_s, "network_ttft_s": r.network_ttft_s}
                    for r in results]}, indent=1))
    plot_timeline(results, args.out / "demo_timeline.png",
                  f"{results[0].prompt_tokens}-token prompt, {args.max_new_tokens} new tokens, "
                  f"{link_desc}")
    print(f"\n[demo] wrote {args.out / 'demo.json'} and {args.out / 'demo_timeline.png'} "
          f"({time.monotonic() - t0:.0f} s)")
    return 1 if identical is False else 0
