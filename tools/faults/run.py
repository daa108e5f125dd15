"""`lynx-sglang faults`: the fault matrix. One request at a time goes through a real PD cluster
(prefill + decode + router, Lynx exact target, speculation always on) while one fault hits one
server at one point of the request's transfer; each cell then checks that nothing was lost.

Axes (`Cell`):
- target: the prefill or the decode server (its whole process tree);
- fault: `sigkill` (then restarted), `sigstop` (held past the transfer timeout, then SIGCONT),
  `partition` (the link between the two goes down, no FIN or RST, then comes back), `rst` (every
  TCP connection of the target to its peer reset: `ss -K`), `slow` (the link drops to
  `SLOW_RATE` for a while). The last three need the shaped link of two network namespaces (root);
- phase: `before-anchor` (the prefill is still computing), `mid-anchor` (the first half of the
  Anchor's layers is out and part landed at the decode, the rest held by the prefill's Anchor
  hold), `between` (the Anchor is out, the
  Residual held back by the prefill's fault-injection hold), `parked` (as `between`, the request
  asking only `PARKED_NEW_TOKENS`, so that it reaches its length speculatively and speculation has
  parked it to wait for the Residual: the fault hits a parked request), `mid-residual` (the
  Residual on a link slowed to `RESIDUAL_RATE`; shaped link only), `during-verification` (the
  decode's scheduler held before its verification forward by the decode's fault-injection hold);
- mode: `greedy` (a completed answer must equal the single server's), `sampled` (temperature 0.7,
  every one of the new tokens: its end of sequence ignored),
  `client-abort` (the client hangs up as the fault is injected).

What each cell checks (`CellResult.checks`): the client got its answer or an error within the
deadline; a greedy answer equals the single server's; within `Timing.settle_s` the decode's KV slots and
every server's Lynx staging and per-request maps (`lynx_tracked_requests`) are back to their idle
values; the threads and file descriptors of the servers that were not restarted are back to their
baseline (+`process_tree.THREAD_SLACK`/`FD_SLACK`: SGLang's own pools start threads lazily); every server is
alive; and the next request equals the single server's.

Phases are reached by observable events (the hold lines the three fault-injection knobs log, the
decode's count of requests whose Anchor has part landed) plus fixed offsets (`Timing`), so timing
under heavy load can miss a phase; `CellResult.phase_hit` says whether the request was still in
flight when the fault hit (and, mid-Anchor, whether the decode had part of its Anchor); `--cells`
reruns cells by name. Used
by the `faults` CLI subcommand and by tests/sglang/test_fault_matrix.py (a sample of cells).

Transports: `tcp` (default, here over the shaped link) or `verbs` (`--transport verbs`: inside the
soft-RoCE guest of scripts/rdma_vm.sh, whose one rxe device is not inside the shaped link's
namespaces, so only the process faults run there; its emulated CPU wants `--slow-factor`).

Windowed (`--windowed`): both servers get less staging than the faulted request needs
(`windowed_staging_mib`), so it goes in segments through windows of staging (`backend.window`);
`between` is then after its first segment (where the prefill's hold sits for such a room, which
is also mid-Anchor for the request: `mid-anchor` is not run), and `during-verification` does not
exist (a windowed room does not speculate). The next request still fits whole.

Scheduler: every server runs SGLang's default overlap scheduler (batch N+1 launched before batch
N's results are processed), as deployments do; `--disable-overlap-schedule` runs the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..cluster.netns import netns_available
from ..measure import add_kv_dtype_argument, kv_dtype_server_args
from ..model import embedded_model_dir
from .cells import (
    AXES,
    NEW_TOKENS,
    NEXT_PROMPT_TOKENS,
    PROMPT_TOKENS,
    TRANSPORTS,
    Cell,
    CellResult,
    Timing,
    all_cells,
    select_cells,
    table,
    windowed_staging_mib,
)
from .matrix import Matrix

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def axis(name: str, values: tuple[str, ...]) -> None:
        parser.add_argument(f"--{name}", nargs="+", choices=values, default=list(values),
                            help=f"{name} to run (default: all of {', '.join(values)})")

    for name, values in AXES.items():
        axis(name, values)

    def cell(name: str) -> Cell:
        try:
            return Cell.parse(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument("--cells", nargs="+", type=cell, default=None, metavar="CELL",
                        help="run exactly these cells, in this order, each named as the report "
                             "names it (TARGET/FAULT/PHASE/MODE, e.g. decode/sigstop/between/"
                             "greedy): to rerun the ones a run failed; not with --sample or the "
                             "axis options")
    parser.add_argument("--sample", type=int, default=None,
                        help="run only this many cells, drawn with --seed (each target and fault "
                             "before any repeats; cells this machine cannot run are left out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-link", action="store_true",
                        help="loopback instead of the shaped link even as root (link faults and "
                             "mid-residual are then skipped)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                        help="the Lynx data plane; verbs runs inside the soft-RoCE guest "
                             "(scripts/rdma_vm.sh), without the shaped link: its link cells are "
                             "skipped with the reason")
    parser.add_argument("--ib-device", default=os.environ.get("LYNX_RDMA_DEVICE"),
                        help="RDMA device for --transport verbs (default: $LYNX_RDMA_DEVICE, which "
                             "the guest sets)")
    parser.add_argument("--slow-factor", type=float, default=1.0,
                        help="stretch every timeout, hold and deadline of the matrix this many "
                             "times (the guest's emulated CPU is ~10x slower than this box)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help="tokens of the faulted request's prompt")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                        help="tokens each request generates")
    parser.add_argument("--windowed", action="store_true",
                        help="give both servers less staging than the faulted request needs, so "
                             "that it goes in segments (between: after its first segment; "
                             "during-verification is skipped: such a room does not speculate)")
    parser.add_argument("--out", type=Path, default=Path("out/faults.json"),
                        help="JSON report (default out/faults.json); the table goes to stdout")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="pass SGLang's --disable-overlap-schedule to every server, the "
                             "reference single server included (default: SGLang's overlap "
                             "scheduler, what a deployment runs)")
    add_kv_dtype_argument(parser)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.cells is None:
        return
    narrowed = [f"--{name}" for name, values in AXES.items() if getattr(args, name) != list(values)]
    if args.sample is not None:
        narrowed.append("--sample")
    if narrowed:
        parser.error(f"--cells names its cells whole; {', '.join(narrowed)} would choose others: "
                     "give one or the other")


def chosen_cells(args: argparse.Namespace, *, link: bool) -> list[Cell]:
    """--cells as given (a cell this machine cannot run is reported skipped, with its reason),
    or the axes' cells, sampled with --sample."""
    if args.cells is not None:
        return list(dict.fromkeys(args.cells))
    return select_cells(all_cells(), targets=args.targets, faults=args.faults,
                        phases=args.phases, modes=args.modes, sample=args.sample,
                        seed=args.seed, link=link, transport=args.transport,
                        windowed=args.windowed)


def run_matrix(cells: list[Cell], *, link: bool, run_dir: Path,
               server_args: tuple[str, ...] = (),
               on_result: Callable[[list[CellResult]], None] = lambda _: None,
               **matrix_kw) -> list[CellResult]:
    """Run CELLS in order; ON_RESULT gets the results so far after each cell."""
    model = str(embedded_model_dir())
    results = []
    with Matrix(model, run_dir, link, server_args, **matrix_kw) as matrix:
        for i, cell in enumerate(cells):
            logger.info("cell %d/%d: %s", i + 1, len(cells), cell.name)
            results.append(matrix.run_cell(cell))
            logger.info("cell %s: %s", cell.name, results[-1])
            on_result(results)
    return results


def run(args: argparse.Namespace) -> int:
    verbs = args.transport == "verbs"
    link = (not verbs and not args.no_link and netns_available() is None
            and os.geteuid() == 0)
    cells = chosen_cells(args, link=link)
    staging_mib = (windowed_staging_mib(str(embedded_model_dir()), args.kv_dtype,
                                        args.prompt_tokens, min(NEXT_PROMPT_TOKENS,
                                                                args.prompt_tokens))
                   if args.windowed else None)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    where = f"verbs on {args.ib_device or 'the first RDMA device'}" if verbs else (
        "tcp, shaped link" if link else "tcp, loopback")
    if staging_mib is not None:
        where += f", windowed: --lynx-staging-mib {staging_mib}"
    overlap = not args.disable_overlap_schedule
    where += ", overlap scheduler" if overlap else ", --disable-overlap-schedule"
    print(f"{len(cells)} cells ({where}; timing x{args.slow_factor:g})", flush=True)

    def write_report(results: list[CellResult]) -> None:
        # Written before the first cell and after every cell, so that a run stopped part-way
        # (a guest past its deadline, an operator's ^C) keeps the cells it finished.
        out.write_text(json.dumps({"link": link, "transport": args.transport,
                                   "windowed_staging_mib": staging_mib,
                                   "slow_factor": args.slow_factor,
                                   "overlap_schedule": overlap,
                                   "prompt_tokens": args.prompt_tokens,
                                   "cells_planned": len(cells),
                                   # a report of a run stopped part-way is not clean
                                   "clean": (len(results) == len(cells)
                                             and all(r.clean for r in results)),
                                   "cells": [dataclasses.asdict(r) for r in results]},
                                  indent=1))

    write_report([])
    results = run_matrix(cells, link=link, run_dir=out.parent / (out.stem + "_runs"),
                         server_args=kv_dtype_server_args(args.kv_dtype),
                         on_result=write_report,
                         transport=args.transport, ib_device=args.ib_device,
                         timing=Timing().scaled(args.slow_factor),
                         prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                         staging_mib=staging_mib, overlap_schedule=overlap)
    clean = all(r.clean for r in results)
    print(table(results))
    ran = [r for r in results if r.skipped is None]
    print(f"{sum(r.clean for r in ran)}/{len(ran)} cells clean, "
          f"{len(results) - len(ran)} skipped (report: {out})")
    return 0 if clean else 1
