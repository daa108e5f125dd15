"""`lynx-sglang bench-verify`: what one verification forward costs, in ordinary decode steps of the
same request, through a real SGLang PD cluster.

For each speculation depth n (`--positions`), a Lynx cluster whose decode speculates up to n tokens
on every request (`--lynx-spec-policy always --lynx-spec-max-tokens n`) and whose prefill holds
each Residual back `--residual-hold-s` after its Anchor (the sender's fault-injection knob, so the
decode reaches n speculative tokens before it can verify). Each request streams n + 1 + `--after`
tokens: the first, the n verified ones (plus the verification's bonus token), then `--after`
ordinary decode steps on the exact KV. The verification's time comes from the decode's
`lynx spec` record (`verify_ms`); a decode step's is the median gap between the last `--after`
streamed tokens, on the same request, at about the same context length. The ratio of the two is
issue 12's goal: at most 2 for up to 33 positions.

    sudo .venv/bin/lynx-sglang bench-verify --out out/bench_verify
Writes <out>/bench_verify.json and prints a table; about two minutes per depth on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lynx_sglang.errors import LynxError
from lynx_sglang.names import FAULT_RESIDUAL_DELAY_ENV

from ..client import generate, generate_stream
from ..cluster.local import Cluster
from ..cluster.spec import ClusterMode, ClusterSpec
from ..measure import add_kv_dtype_argument, kv_dtype_server_args, spec_lines, wait_for
from ..progress import Progress
from ..prompts import WARMUP_PROMPT, passkey_prompt


class BenchVerifyError(LynxError):
    pass


@dataclass(frozen=True)
class VerifyRun:
    """One request: its verification (from the decode's `lynx spec` record) and the decode steps
    streamed after it."""

    speculated: int
    accepted: int
    verify_ms: float
    step_ms: float  # median gap between the streamed tokens after the verification

    @property
    def steps(self) -> float:
        return self.verify_ms / self.step_ms


@dataclass(frozen=True)
class DepthResult:
    positions: int  # speculative tokens allowed (--lynx-spec-max-tokens)
    runs: list[VerifyRun]

    def summary(self) -> dict:
        def med(xs):
            return round(statistics.median(xs), 3)

        steps = [r.steps for r in self.runs]
        return {"positions": self.positions,
                "speculated": [r.speculated for r in self.runs],
                "accepted": [r.accepted for r in self.runs],
                "verify_ms_median": med([r.verify_ms for r in self.runs]),
                "step_ms_median": med([r.step_ms for r in self.runs]),
                "verify_in_steps_median": med(steps),
                "verify_in_steps_min_max": [round(min(steps), 3), round(max(steps), 3)]}


def step_ms_after(t_tokens: list[float] | tuple[float, ...], after: int) -> float:
    """Median gap (ms) between the last `after` streamed tokens: ordinary decode steps, one token
    each, once the verified burst has been streamed."""
    if after < 2 or len(t_tokens) < after:
        raise BenchVerifyError(f"need at least {max(after, 2)} streamed tokens after the "
                               f"verification to time a decode step, got {len(t_tokens)} in all")
    tail = t_tokens[-after:]
    return statistics.median(b - a for a, b in itertools.pairwise(tail)) * 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--positions", default="1,32,128",
                        help="speculation depths to measure, comma-separated (each its own "
                             "cluster; default 1,32,128: the sampled and greedy caps, "
                             "--lynx-spec-max-sampled-tokens and --lynx-spec-max-tokens; a "
                             "verification of n speculative tokens feeds n + 1 positions)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--requests", type=int, default=3, help="requests per depth (default 3)")
    parser.add_argument("--after", type=int, default=16,
                        help="decode steps streamed after the verification, to time a step "
                             "(default 16)")
    parser.add_argument("--residual-hold-s", type=float, default=0.0,
                        help="how long the prefill holds each Residual after its Anchor "
                             "(default: 3 s + 0.4 s per speculative position)")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="shaped link between prefill and decode (root), e.g. 1gbit; "
                             "default loopback: the link does not change a verification's cost")
    add_kv_dtype_argument(parser)
    parser.add_argument("--model", default=None,
                        help="HF model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=Path("out/bench_verify"),
                        help="folder for bench_verify.json and the clusters' logs")


def _positions(text: str) -> list[int]:
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchVerifyError(f"--positions: comma-separated integers, got {text!r}") from None
    if not depths or any(n < 1 for n in depths):
        raise BenchVerifyError(f"--positions: each at least 1, got {text!r}")
    return depths


def measure_depth(n: int, *, args: argparse.Namespace, model_dir: Path, prompt_ids: list[int],
                  progress: Progress) -> DepthResult:
    hold = args.residual_hold_s or 3.0 + 0.4 * n
    run_dir = (args.out / "runs" / f"n{n}").resolve()
    spec = ClusterSpec(
        str(model_dir), ClusterMode.PD, "lynx", run_dir=run_dir, link=args.link,
        server_args=("--lynx-spec-policy", "always", "--lynx-spec-max-tokens", str(n),
                     *kv_dtype_server_args(args.kv_dtype)),
        startup_timeout_s=args.startup_timeout_s,
        extra_env={FAULT_RESIDUAL_DELAY_ENV: str(hold)})
    progress.start_variant(f"n={n}", f"starting cluster (Residual held {hold:.1f} s; logs "
                                     f"{run_dir})")
    runs = []
    with Cluster(spec, on_wait=progress.waiting) as cluster:
        generate(cluster.url, text=WARMUP_PROMPT, max_new_tokens=2,
                 timeout_s=args.request_timeout_s)
        log = cluster.log_path("decode")
        for i in range(1, args.requests + 1):
            progress.request(i, args.requests, f"({len(prompt_ids)} prompt tokens, "
                                               f"{n + 1 + args.after} new)")
            rid = f"bench-verify-{n}-{i}-{time.time_ns()}"
            # A distinct first token per request: no prefix-cache hit on the prefill.
            ids = [prompt_ids[0] + i, *prompt_ids[1:]]
            got = generate_stream(cluster.url, input_ids=ids, max_new_tokens=n + 1 + args.after,
                                  timeout_s=args.request_timeout_s,
                                  sampling={"ignore_eos": True}, rid=rid)

            def record(rid=rid):
                return next((r for r in spec_lines(log.read_text(errors="replace"))
                             if r.get("rid") == rid), None)

            wait_for(lambda: record() is not None)
            rec = record()
            if rec is None or not rec["speculated"]:
                raise BenchVerifyError(
                    f"n={n}: request {rid} was not verified after speculating "
                    f"({'no lynx spec record' if rec is None else rec.get('no_spec_reason')}); "
                    f"see {log}")
            runs.append(VerifyRun(rec["speculated"], rec["accepted"], rec["verify_ms"],
                                  step_ms_after(got.t_tokens, args.after)))
    progress.finish_variant()
    return DepthResult(n, runs)


def format_table(results: list[DepthResult]) -> str:
    lines = ["| speculated | verify (ms, median) | decode step (ms, median) | verify in steps "
             "(median, min-max) |", "|---|---|---|---|"]
    for r in results:
        s = r.summary()
        lo, hi = s["verify_in_steps_min_max"]
        lines.append(f"| {r.positions} | {s['verify_ms_median']:.0f} | "
                     f"{s['step_ms_median']:.0f} | {s['verify_in_steps_median']:.2f} "
                     f"({lo:.2f}-{hi:.2f}) |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..model import embedded_model_dir

    depths = _positions(args.positions)
    if args.requests < 1:
        raise BenchVerifyError("--requests must be at least 1")
    if args.after < 2:
        raise BenchVerifyError("--after must be at least 2 (a step is the gap between tokens)")
    model_dir = Path(args.model or embedded_model_dir())
    prompt_ids = passkey_prompt(AutoTokenizer.from_pretrained(str(model_dir)), args.prompt_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress("bench-verify", len(depths))
    results = [measure_depth(n, args=args, model_dir=model_dir, prompt_ids=prompt_ids,
                             progress=progress) for n in depths]
    report = {"prompt_tokens": args.prompt_tokens, "kv_dtype": args.kv_dtype, "link": args.link,
              "after": args.after, "depths": [r.summary() for r in results],
              "runs": {r.positions: [asdict(x) for x in r.runs] for r in results}}
    path = args.out / "bench_verify.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(results))
    print(f"[bench-verify] wrote {path}", file=sys.stderr)
    return 0
