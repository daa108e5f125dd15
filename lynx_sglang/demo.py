"""`lynx-sglang demo`: the README's main job. For each KV transfer backend (Lynx with target exact,
SGLang's own mooncake_tcp), start a local PD cluster (prefill + decode + router) on the same link,
send a warm-up request and one long-context streamed request, and report TTFT, network-exposed
TTFT, bytes per stream and total time side by side, whether the outputs are identical, as a table,
`<out>/demo.json` and a timeline PNG.

Times are wall-clock `time.time()` on this one machine: the client's send / first / last token,
the prefill's `lynx timeline` line (prefill forward done, `lynx_sglang.timeline`) and, for Lynx,
the decode's `lynx transfer` line (Anchor/Residual landed and applied). Clusters run one after
the other and each is stopped (whole process trees, link removed) before the next, also on error
or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .client import generate, generate_stream
from .cluster import Cluster, ClusterMode, ClusterSpec
from .netns import NETLAB
from .pd_measure import LYNX_EVENTS, TRANSFER_PREFIX, KVShape, transfer_lines
from .timeline import TIMELINE_ENV, prefill_done_events

BACKENDS = ("lynx", "mooncake_tcp")
BACKEND_ARGS = {"lynx": ("--lynx-target", "exact"), "mooncake_tcp": ()}
WARMUP_PROMPT = "The capital of France is"


class DemoError(RuntimeError):
    pass


@dataclass(frozen=True)
class BackendResult:
    """One backend's long request. Times are seconds relative to the client's send."""

    backend: str
    prompt_tokens: int
    output_ids: list[int]
    prefill_done_s: float
    first_token_s: float
    last_token_s: float
    # Bytes per stream: {"anchor": .., "residual": ..} for Lynx, {"kv": ..} for mooncake.
    stream_bytes: dict[str, int]
    bytes_measured: bool  # False: computed from the KV shape, not read from the backend
    lynx_events_s: dict[str, float | None]
    run_dir: str

    @property
    def ttft_s(self) -> float:
        return self.first_token_s

    @property
    def network_ttft_s(self) -> float:
        return self.first_token_s - self.prefill_done_s


def default_link() -> str | None:
    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc") and NETLAB.is_file():
        return "1gbit"
    return None


def build_prompt(tokenizer, prompt_tokens: int) -> list[int]:
    """A deterministic passkey document of exactly `prompt_tokens` tokens ending in a question."""
    question = tokenizer.encode(" Question: what is the value of key k17? Answer:",
                                add_special_tokens=False)
    body_len = prompt_tokens - len(question)
    if body_len < 16:
        raise DemoError(f"--prompt-tokens must be at least {len(question) + 16}")
    lines, ids = [], []
    i = 0
    while len(ids) < body_len:
        lines.append(" ".join(f"Item {j}: the value of key k{j} is {j * 37 % 101}."
                              for j in range(i, i + 50)))
        i += 50
        ids = tokenizer.encode(" ".join(lines), add_special_tokens=False)
    return ids[:body_len] + question


def _last_transfer_line(log_text: str) -> dict:
    lines = transfer_lines(log_text)
    if not lines:
        raise DemoError("the decode log has no `lynx transfer` line")
    return lines[-1]


def run_backend(backend: str, *, model_dir: Path, prompt_ids: list[int], max_new_tokens: int,
                link: str | None, run_dir: Path, kv_shape: KVShape,
                startup_timeout_s: float, request_timeout_s: float) -> BackendResult:
    spec = ClusterSpec(
        str(model_dir), ClusterMode.PD, backend, run_dir=run_dir,
        server_args=BACKEND_ARGS[backend], link=link, startup_timeout_s=startup_timeout_s,
        extra_env={TIMELINE_ENV: "1"},
    )
    print(f"[demo] {backend}: starting prefill + decode + router (logs {run_dir}) ...",
          flush=True)
    t0 = time.monotonic()
    with Cluster(spec) as cluster:
        print(f"[demo] {backend}: up in {time.monotonic() - t0:.0f} s; warm-up request",
              flush=True)
        generate(cluster.url, text=WARMUP_PROMPT, max_new_tokens=4, timeout_s=request_timeout_s)
        print(f"[demo] {backend}: long request ({len(prompt_ids)} prompt tokens, "
              f"{max_new_tokens} new, streamed)", flush=True)
        got = generate_stream(cluster.url, input_ids=prompt_ids, max_new_tokens=max_new_tokens,
                              timeout_s=request_timeout_s)
        # The servers log asynchronously; give the lines a moment to reach the files.
        deadline = time.monotonic() + 10
        while True:
            events = [e for e in prefill_done_events(
                cluster.log_path("prefill").read_text(errors="replace"))
                if e["tokens"] == got.prompt_tokens and e["t"] >= got.t_send]
            decode_log = cluster.log_path("decode").read_text(errors="replace")
            lynx_ok = backend != "lynx" or TRANSFER_PREFIX in decode_log
            if (events and lynx_ok) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    if not events:
        raise DemoError(f"{backend}: no `lynx timeline` prefill_done line in "
                        f"{run_dir / 'prefill.log'}")
    rel = lambda t: None if t is None else round(t - got.t_send, 6)  # noqa: E731
    if backend == "lynx":
        line = _last_transfer_line(decode_log)
        if line["tokens"] != got.prompt_tokens:
            raise DemoError(f"lynx transfer line is for {line['tokens']} tokens, "
                            f"expected {got.prompt_tokens}")
        stream_bytes = {"anchor": line["anchor_bytes"], "residual": line["residual_bytes"]}
        lynx_events = {k: rel(line[k]) for k in LYNX_EVENTS}
        measured = True
    else:
        stream_bytes = {"kv": kv_shape.bytes_for(got.prompt_tokens)}
        lynx_events = {}
        measured = False
    return BackendResult(
        backend, got.prompt_tokens, got.output_ids, rel(events[-1]["t"]),
        rel(got.t_first_token), rel(got.t_last_token), stream_bytes, measured, lynx_events,
        str(run_dir))


def _fmt_bytes(result: BackendResult) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    if "kv" in result.stream_bytes:
        return f"KV {mib(result.stream_bytes['kv'])} (computed)"
    return (f"Anchor {mib(result.stream_bytes['anchor'])} / "
            f"Residual {mib(result.stream_bytes['residual'])}")


def outputs_identical(results: list[BackendResult]) -> bool | None:
    """None when there is only one backend to compare."""
    if len(results) < 2:
        return None
    return len({tuple(r.output_ids) for r in results}) == 1


def format_table(results: list[BackendResult], link_desc: str) -> str:
    identical = outputs_identical(results)
    verdict = {True: "yes", False: "NO", None: "n/a (one backend)"}[identical]
    head = ("backend", "TTFT", "net TTFT", "bytes per stream", "total")
    rows = [(r.backend, f"{r.ttft_s * 1e3:.0f} ms", f"{r.network_ttft_s * 1e3:.0f} ms",
             _fmt_bytes(r), f"{r.last_token_s * 1e3:.0f} ms") for r in results]
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))  # noqa: E731
    lines = [f"link: {link_desc}; prompt {results[0].prompt_tokens} tokens, "
             f"{len(results[0].output_ids)} new tokens, greedy",
             fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows),
             f"outputs identical across backends: {verdict}",
             "TTFT: send -> first token at the client; net TTFT: prefill forward done (prefill "
             "log) -> first token at the client; total: send -> last token."]
    if any(not r.bytes_measured for r in results):
        lines.append("mooncake KV bytes are computed: prompt tokens x layers x 2 (K,V) x KV heads "
                     "x head dim x 4 bytes (fp32 pool).")
    return "\n".join(lines)


def plot_timeline(results: list[BackendResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.2 + 1.3 * len(results)))
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
        ax.annotate(f"TTFT {r.ttft_s * 1e3:.0f} ms", (r.first_token_s, y - 0.3),
                    fontsize=8, ha="left")
    ax.set_yticks(range(len(results)), [r.backend for r in results])
    ax.set_ylim(-0.7, len(results) - 0.3)
    ax.set_xlabel("seconds since the client sent the request (wall clock)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated, from {BACKENDS} (default: both)")
    parser.add_argument("--link", default="auto", metavar="RATE|auto|none",
                        help="shaped link between prefill and decode (two network namespaces, "
                             "root): a rate such as 1gbit; auto = 1gbit when root with ip/tc, "
                             "else loopback; none = loopback")
    parser.add_argument("--prompt-tokens", type=int, default=1500,
                        help="length of the long-context prompt (default 1500)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="folder for demo.json, demo_timeline.png and the cluster logs")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from .model import embedded_model_dir

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise DemoError(f"--backends: unknown {bad}; choose from {BACKENDS}")
    if args.max_new_tokens < 1:
        raise DemoError("--max-new-tokens must be at least 1")
    link = default_link() if args.link == "auto" else (None if args.link == "none" else args.link)
    link_desc = (f"{link} shaped veth between two network namespaces (prefill | decode)"
                 if link else "loopback (no shaped link: not root or no ip/tc)")
    model_dir = Path(args.model or embedded_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = build_prompt(tokenizer, args.prompt_tokens)
    kv_shape = KVShape.from_model_dir(model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] model {model_dir}; link: {link_desc}", flush=True)

    # SIGTERM ends the demo like Ctrl-C, so the running cluster's context manager stops it.
    def _on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.monotonic()
    results = []
    try:
        for backend in backends:
            results.append(run_backend(
                backend, model_dir=model_dir, prompt_ids=prompt_ids,
                max_new_tokens=args.max_new_tokens, link=link,
                run_dir=(args.out / "demo_runs" / backend).resolve(), kv_shape=kv_shape,
                startup_timeout_s=args.startup_timeout_s,
                request_timeout_s=args.request_timeout_s))
    except KeyboardInterrupt:
        print("[demo] interrupted; the running cluster was stopped", file=sys.stderr)
        return 130
    table = format_table(results, link_desc)
    print()
    print(table)
    identical = outputs_identical(results)
    (args.out / "demo.json").write_text(json.dumps({
        "link": link, "link_desc": link_desc, "model": str(model_dir),
        "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
        "outputs_identical": identical, "wall_s": round(time.monotonic() - t0, 1),
        "results": [asdict(r) | {"ttft_s": r.ttft_s, "network_ttft_s": r.network_ttft_s}
                    for r in results]}, indent=1))
    plot_timeline(results, args.out / "demo_timeline.png",
                  f"{results[0].prompt_tokens}-token prompt, {link_desc}")
    print(f"\n[demo] wrote {args.out / 'demo.json'} and {args.out / 'demo_timeline.png'} "
          f"({time.monotonic() - t0:.0f} s)")
    return 1 if identical is False else 0


