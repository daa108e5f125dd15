"""The fault matrix's runner: `Matrix` owns a PD cluster (and, for reference outputs, a single
server run once), and runs each cell on it: reach the cell's phase, inject its fault, heal, then
settle and check (what a cell checks: `lynx_tools.faults.run`). Used by `run.run_matrix` (the
`faults` CLI subcommand) and tests/sglang/test_fault_matrix.py.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import requests

from lynx_sglang.names import (
    FAULT_ANCHOR_DELAY_ENV,
    FAULT_ANCHOR_HOLD_LOG,
    FAULT_RESIDUAL_DELAY_ENV,
    FAULT_RESIDUAL_HOLD_LOG,
    FAULT_VERIFY_DELAY_ENV,
    FAULT_VERIFY_HOLD_LOG,
    SPEC_PARKED_LOG,
    WINDOWED_ROOM_LOG,
)

from ..client import GenerateError, generate, generate_stream
from ..cluster.local import Cluster
from ..cluster.netns import RECEIVER_IP, SENDER_IP
from ..cluster.process_tree import process_tree
from ..cluster.spec import ClusterMode, ClusterSpec, sglang_pd_timeouts_env
from ..measure import all_zero, metric_samples, metric_sum
from ..prompts import passkey_prompt
from .cells import (
    ANCHOR_LANDING_MAP,
    BASE_RATE,
    NEW_TOKENS,
    NEXT_PROMPT_TOKENS,
    PROMPT_TOKENS,
    RESIDUAL_RATE,
    SLOW_RATE,
    TARGETS,
    TRANSPORTS,
    Cell,
    CellResult,
    Timing,
    brief,
    fd_growth,
)

logger = logging.getLogger(__name__)


def _signal_tree(cluster: Cluster, name: str, sig: int) -> None:
    for proc in process_tree(cluster.proc(name)):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def _shutdown(sock) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def stream_until_hang_up(url: str, prompt: list[int], new_tokens: int, timeout_s: float,
                         out: dict, hang_up: threading.Event) -> None:
    """A streaming client (a client-abort cell's) that closes its connection when `hang_up` is
    set, even while no byte arrives (the server side may be stopped or cut off)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    body = json.dumps({"input_ids": prompt, "stream": True,
                       "sampling_params": {"max_new_tokens": new_tokens,
                                           "temperature": 0.0}})
    conn.connect()
    # The socket itself, not `conn.sock`: the `finally` below sets hang_up and closes the
    # connection, which sets conn.sock to None before the closer thread reads it.
    sock = conn.sock
    closer = threading.Thread(target=lambda: hang_up.wait() and _shutdown(sock), daemon=True)
    closer.start()
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        while resp.read1(4096) and not hang_up.is_set():
            pass
        out["result"] = "abandoned" if hang_up.is_set() else "answer (before the hang-up)"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # A shut-down socket surfaces as any of these, depending on where the read was.
        out["result"] = "abandoned" if hang_up.is_set() else f"error: {exc!r}"
    finally:
        hang_up.set()
        conn.close()


class Matrix:
    """Runs cells on one cluster (restarting what a cell killed); owns the cluster."""

    def __init__(self, model: str, run_dir: Path, link: bool, server_args: tuple[str, ...] = (),
                 *, transport: str = "tcp", ib_device: str | None = None,
                 timing: Timing | None = None, prompt_tokens: int = PROMPT_TOKENS,
                 new_tokens: int = NEW_TOKENS, staging_mib: int | None = None,
                 overlap_schedule: bool = True):
        from transformers import AutoTokenizer

        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "verbs" and link:
            raise ValueError("the verbs matrix runs without the shaped link (see Cell.unsupported)")
        self.t = t = timing or Timing()
        self.transport = transport
        self.windowed = staging_mib is not None
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.prompt = passkey_prompt(tokenizer, prompt_tokens)
        self.next_prompt = passkey_prompt(tokenizer, min(NEXT_PROMPT_TOKENS, prompt_tokens))
        self.link = link
        self.new_tokens = new_tokens
        common = ("--disable-radix-cache", "--enable-metrics",
                  "--watchdog-timeout", str(t.watchdog_s), *server_args)
        with Cluster(ClusterSpec(model, ClusterMode.SINGLE, run_dir=run_dir / "single",
                                 server_args=common, startup_timeout_s=t.startup_s,
                                 overlap_schedule=overlap_schedule)) as single:
            self.reference = {
                tuple(p): generate(single.url, input_ids=p, max_new_tokens=self.new_tokens,
                                   timeout_s=t.request_s + t.outage_s).output_ids
                for p in (self.prompt, self.next_prompt)}
        lynx = ("--lynx-target", "exact", "--lynx-spec-policy", "always",
                "--lynx-transfer-timeout-s", str(t.transfer_timeout_s),
                *(("--lynx-staging-mib", str(staging_mib)) if self.windowed else ()))
        if transport == "verbs":
            # bringing queue pairs up under CPU emulation takes far longer than a tcp connect
            lynx += ("--lynx-transport", "verbs", "--lynx-connect-timeout-s",
                     str(4 * t.transfer_timeout_s),
                     *(("--lynx-ib-device", ib_device) if ib_device else ()))
        self.spec = ClusterSpec(
            model, ClusterMode.PD, "lynx", run_dir=run_dir / "pd",
            link=BASE_RATE if link else None, startup_timeout_s=t.startup_s,
            server_args=(*common, *lynx), overlap_schedule=overlap_schedule,
            extra_env={FAULT_RESIDUAL_DELAY_ENV: str(t.residual_hold_s),
                       FAULT_ANCHOR_DELAY_ENV: str(t.anchor_hold_s),
                       FAULT_VERIFY_DELAY_ENV: str(t.verify_hold_s),
                       # Restarts are handled by Lynx (see tests/sglang/test_pd_lynx.py), not by
                       # SGLang's heartbeat verdict on a dead prefill.
                       "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1000",
                       **sglang_pd_timeouts_env(t.sglang_wait_s)})
        self.cluster = Cluster(self.spec)

    def __enter__(self) -> Matrix:
        try:
            self.cluster.start()
            self._warm_up()
        except BaseException:
            self.cluster.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.stop()

    def _warm_up(self) -> None:
        """One request through the pair, then the idle baselines."""
        got = generate(self.cluster.url, input_ids=self.next_prompt, max_new_tokens=self.new_tokens,
                       timeout_s=self.t.request_s + self.t.outage_s)
        if got.output_ids != self.reference[tuple(self.next_prompt)]:
            raise RuntimeError("the PD pair does not match the single server before any fault")
        self.slots = self.cluster.decode_used_tokens()
        self.resources = {n: self.cluster.resources(n) for n in TARGETS}
        self.fd_baseline = {n: self.cluster.fd_kinds(n) for n in TARGETS}

    # ---- one cell -----------------------------------------------------------------------------
    def run_cell(self, cell: Cell) -> CellResult:
        res = CellResult(cell.name)
        why = cell.unsupported(self.link, self.transport, self.windowed)
        if why is not None:
            res.skipped = why
            return res
        segmented = self._log("decode").count(WINDOWED_ROOM_LOG)
        t0 = time.monotonic()
        outcome: dict = {}
        client_done = threading.Event()
        hang_up = threading.Event()
        client = threading.Thread(target=self._client, args=(cell, outcome, client_done, hang_up),
                                  daemon=True)
        marks = self._marks()
        client.start()
        restarted = False
        try:
            res.phase_hit = self._reach_phase(cell, marks, client_done)
            if cell.mode == "client-abort":
                hang_up.set()
            restarted = self._inject(cell)
        finally:
            self._heal()
        deadline = self.t.outage_s + self.t.transfer_timeout_s + self.t.answer_margin_s
        client.join(timeout=deadline)
        res.outcome = ("hung" if client.is_alive() else outcome.get("result", "no result recorded"))
        res.checks["client answered or failed within the deadline"] = not client.is_alive()
        if cell.mode == "greedy" and "ids" in outcome:
            res.checks["greedy answer equals the single server's"] = (
                outcome["ids"] == self.reference[tuple(self.prompt)][:cell.new_tokens(self.new_tokens)])
        if self.windowed:
            res.checks["the request went in segments"] = (
                self._log("decode").count(WINDOWED_ROOM_LOG) > segmented)
        if restarted:
            self.cluster.restart(cell.target)
        self._settle(cell, res, restarted)
        res.seconds = round(time.monotonic() - t0, 1)
        return res

    def _client(self, cell: Cell, out: dict, done: threading.Event,
                hang_up: threading.Event) -> None:
        # A sampled answer may draw its end of sequence early and finish before the fault: in
        # the full run of 2026-12-01 the only cells that missed their phase were sampled ones.
        sampling = {"temperature": 0.7, "ignore_eos": True} if cell.mode == "sampled" else None
        new_tokens = cell.new_tokens(self.new_tokens)
        try:
            if cell.mode == "client-abort":
                stream_until_hang_up(self.cluster.url, self.prompt, new_tokens,
                                     self.t.outage_s + self.t.request_s, out, hang_up)
                return
            got = generate_stream(self.cluster.url, input_ids=self.prompt,
                                  max_new_tokens=new_tokens, sampling=sampling,
                                  timeout_s=self.t.outage_s + self.t.request_s)
            out["ids"] = got.output_ids
            out["result"] = "answer"
        except (GenerateError, requests.RequestException) as exc:
            out["result"] = f"error: {brief(str(exc))}"
        except Exception as exc:  # recorded, not lost with the thread
            out["result"] = f"client failed: {type(exc).__name__}: {brief(str(exc))}"
        finally:
            done.set()

    def _marks(self) -> dict[str, int]:
        return {"anchor": self._log("prefill").count(FAULT_ANCHOR_HOLD_LOG),
                "residual": self._log("prefill").count(FAULT_RESIDUAL_HOLD_LOG),
                "verify": self._log("decode").count(FAULT_VERIFY_HOLD_LOG),
                "parked": self._log("decode").count(SPEC_PARKED_LOG)}

    def _log(self, name: str) -> str:
        return self.cluster.log_path(name).read_text(errors="replace")

    def _wait_mark(self, name: str, text: str, before: int, done: threading.Event) -> bool:
        deadline = time.monotonic() + self.t.request_s
        while self._log(name).count(text) <= before:
            if done.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _reach_phase(self, cell: Cell, marks: dict[str, int], done: threading.Event) -> bool:
        """Wait until the request is in the cell's phase; False if it never got there (the
        fault is injected anyway)."""
        if cell.phase == "before-anchor":
            time.sleep(self.t.before_anchor_s)
            return (not done.is_set()
                    and self._log("prefill").count(FAULT_ANCHOR_HOLD_LOG) == marks["anchor"])
        if cell.phase == "mid-anchor":
            return (self._wait_mark("prefill", FAULT_ANCHOR_HOLD_LOG, marks["anchor"], done)
                    and self._wait_anchor_landing(done))
        if cell.phase == "during-verification":
            return self._wait_mark("decode", FAULT_VERIFY_HOLD_LOG, marks["verify"], done)
        hit = self._wait_mark("prefill", FAULT_RESIDUAL_HOLD_LOG, marks["residual"], done)
        if cell.phase == "parked" and hit:
            # parked while its Residual is held, and not yet verified
            hit = (self._wait_mark("decode", SPEC_PARKED_LOG, marks["parked"], done)
                   and self._log("decode").count(FAULT_VERIFY_HOLD_LOG) == marks["verify"])
        if cell.phase == "mid-residual" and hit:
            time.sleep(1.0)  # the Anchor lands at the base rate
            self.cluster.link.set_rate(RESIDUAL_RATE, self.spec.link_qdisc)
            time.sleep(self.t.residual_hold_s - 1.0 + 2.0)
            hit = not done.is_set()
        return hit

    def _wait_anchor_landing(self, done: threading.Event) -> bool:
        """Whether the decode counts a request whose Anchor has part landed within the Anchor
        hold (its count is published about once a second)."""
        deadline = time.monotonic() + self.t.anchor_hold_s
        while not done.is_set() and time.monotonic() < deadline:
            samples = metric_samples(self.cluster.decode_url, "lynx_tracked_requests",
                                     timeout_s=self.t.anchor_hold_s)
            if any(s.labels.get("map") == ANCHOR_LANDING_MAP and s.value > 0
                   for s in samples or ()):
                return True
            time.sleep(0.1)
        return False

    def _inject(self, cell: Cell) -> bool:
        """Apply the fault; True if the target was killed (to be restarted)."""
        logger.info("cell %s: injecting", cell.name)
        if cell.fault == "sigkill":
            self.cluster.kill(cell.target)
            return True
        if cell.fault == "sigstop":
            _signal_tree(self.cluster, cell.target, signal.SIGSTOP)
            try:
                time.sleep(self.t.outage_s)
            finally:
                _signal_tree(self.cluster, cell.target, signal.SIGCONT)
        elif cell.fault == "partition":
            self.cluster.link.set_up(False)
            try:
                time.sleep(self.t.outage_s)
            finally:
                self.cluster.link.set_up(True)
        elif cell.fault == "rst":
            link = self.cluster.link
            ns, peer = ((link.sender_ns, RECEIVER_IP) if cell.target == "prefill"
                        else (link.receiver_ns, SENDER_IP))
            subprocess.run(["ip", "netns", "exec", ns, "ss", "-K", "dst", peer],
                           capture_output=True, timeout=10, check=False)
        elif cell.fault == "slow":
            self.cluster.link.set_rate(SLOW_RATE, self.spec.link_qdisc)
            time.sleep(self.t.slow_s)  # run_cell's _heal restores the base rate
        return False

    def _heal(self) -> None:
        """The link back at its base rate (after a slow fault or a mid-Residual slow-down)."""
        if self.cluster.link is not None and self.cluster.link.rate != BASE_RATE:
            self.cluster.link.set_rate(BASE_RATE, self.spec.link_qdisc)

    def _settle(self, cell: Cell, res: CellResult, restarted: bool) -> None:
        urls = {"decode": self.cluster.decode_url, "prefill": self.cluster.prefill_url}
        deadline = time.monotonic() + self.t.settle_s
        loads_error = ""
        while True:
            try:
                slots = self.cluster.decode_used_tokens()
            except requests.RequestException as exc:
                slots, loads_error = -1, f"decode /v1/loads: {exc}"
            staging = {n: metric_sum(u, "lynx_staging_used_bytes") for n, u in urls.items()}
            tracked = {n: metric_sum(u, "lynx_tracked_requests") for n, u in urls.items()}
            res_now = {n: self.cluster.resources(n) for n in TARGETS}
            grown = {n: res_now[n] for n in TARGETS
                     if not (restarted and n == cell.target)
                     and res_now[n].grown_past(self.resources[n])}
            ok = (slots == self.slots and all_zero(staging) and all_zero(tracked) and not grown)
            if ok or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        res.checks["decode KV slots back to idle"] = slots == self.slots
        res.checks["no staging held"] = all_zero(staging)
        res.checks["no per-request map entries"] = all_zero(tracked)
        res.checks["threads and fds back to baseline"] = not grown
        res.resources = {n: {"threads": r.threads, "fds": r.fds} for n, r in res_now.items()}
        for n in grown:
            growth = fd_growth(self.fd_baseline[n], self.cluster.fd_kinds(n))
            res.details.append(f"{n} fds against its baseline: {growth}")
        if not ok:
            res.details.append(f"{loads_error} slots {slots} (idle {self.slots}), staging {staging}, "
                               f"tracked {tracked}, threads/fds {res_now} "
                               f"(baseline {self.resources})")
        res.checks["servers alive"] = all(self.cluster.proc(n).poll() is None for n in TARGETS)
        try:
            got = generate(self.cluster.url, input_ids=self.next_prompt,
                           max_new_tokens=self.new_tokens, timeout_s=self.t.outage_s + self.t.request_s)
            res.checks["next request equals the single server's"] = (
                got.output_ids == self.reference[tuple(self.next_prompt)])
        except GenerateError as exc:
            res.checks["next request equals the single server's"] = False
            res.details.append(f"next request: {exc}")
        if restarted:
            # A new process's baseline, taken once a request has gone through it: SGLang and
            # Lynx open sockets and start threads lazily (measured: +4 threads, +14-20 fds).
            self.resources[cell.target] = self.cluster.resources(cell.target)
            self.fd_baseline[cell.target] = self.cluster.fd_kinds(cell.target)
