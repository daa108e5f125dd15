"""`lynx_tools.faults`: the matrix's cells, what runs where and the sampled subset (no SGLang
servers; tests/sglang/test_fault_matrix.py runs cells)."""

from __future__ import annotations

import argparse

import pytest

from lynx_kernels import CodecSpec, model_shape
from lynx_sglang.backend.plan import StreamPlan
from lynx_tools.faults.cells import (
    FAULTS,
    MODES,
    PARKED_NEW_TOKENS,
    PHASES,
    TARGETS,
    Cell,
    CellResult,
    Timing,
    all_cells,
    brief,
    select_cells,
    table,
    windowed_staging_mib,
)
from lynx_tools.faults.matrix import stream_until_hang_up
from lynx_tools.faults.run import add_arguments, check_arguments, chosen_cells


def test_the_matrix_is_every_combination_of_its_axes():
    cells = all_cells()
    assert len(cells) == len(set(cells)) == len(TARGETS) * len(FAULTS) * len(PHASES) * len(MODES)


def test_link_cells_are_left_out_without_a_shaped_link():
    assert Cell("decode", "partition", "between", "greedy").unsupported(link=False)
    assert Cell("prefill", "sigkill", "mid-residual", "greedy").unsupported(link=False)
    assert Cell("prefill", "sigkill", "between", "greedy").unsupported(link=False) is None
    assert Cell("decode", "rst", "mid-residual", "sampled").unsupported(link=True) is None
    sample = select_cells(all_cells(), sample=50, seed=1, link=False)
    assert sample and all(c.unsupported(False) is None for c in sample)


def test_a_sample_covers_each_target_and_fault_before_repeating_and_depends_on_the_seed():
    four = select_cells(all_cells(), sample=4, seed=7, link=False)
    assert len({(c.target, c.fault) for c in four}) == 4
    ten = select_cells(all_cells(), sample=10, seed=7, link=True)
    assert {(c.target, c.fault) for c in ten} == {(t, f) for t in TARGETS for f in FAULTS}
    assert select_cells(all_cells(), sample=10, seed=7, link=True) == ten
    assert select_cells(all_cells(), sample=10, seed=8, link=True) != ten


def test_axes_filter_and_the_table_names_every_failed_check():
    only = select_cells(all_cells(), targets=("decode",), faults=("sigstop",),
                        phases=("between",), modes=("greedy", "sampled"))
    assert [c.name for c in only] == ["decode/sigstop/between/greedy",
                                      "decode/sigstop/between/sampled"]
    bad = CellResult("decode/sigstop/between/greedy", outcome="hung",
                     checks={"client answered or failed within the deadline": False,
                             "no staging held": True})
    skipped = CellResult("decode/rst/between/greedy", skipped="needs the shaped link")
    assert not bad.clean and skipped.clean
    text = table([bad, skipped])
    assert "FAIL: client answered or failed within the deadline" in text
    assert "skipped: needs the shaped link" in text


def test_verbs_runs_the_process_faults_only_and_says_why():
    verbs_reason = Cell("decode", "rst", "between", "greedy").unsupported(link=False,
                                                                         transport="verbs")
    assert verbs_reason and "soft-RoCE" in verbs_reason
    assert Cell("prefill", "slow", "between", "greedy").unsupported(True, "verbs")
    assert Cell("prefill", "sigkill", "mid-residual", "greedy").unsupported(False, "verbs")
    assert Cell("prefill", "sigstop", "between", "sampled").unsupported(False, "verbs") is None
    sample = select_cells(all_cells(), sample=8, seed=3, link=False, transport="verbs")
    assert len(sample) == 8 and {c.fault for c in sample} <= {"sigkill", "sigstop"}
    assert {(c.target, c.fault) for c in sample[:4]} == {
        (t, f) for t in TARGETS for f in ("sigkill", "sigstop")}


def test_timing_scales_every_clock_for_a_slower_machine():
    base = Timing()
    slow = base.scaled(8)
    assert slow.transfer_timeout_s == 8 * base.transfer_timeout_s
    assert slow.outage_s == 8 * base.outage_s > slow.transfer_timeout_s
    assert slow.startup_s == 8 * base.startup_s and slow.watchdog_s == 8 * base.watchdog_s
    with pytest.raises(ValueError, match="slow-factor"):
        base.scaled(0.5)


def test_windowed_leaves_out_verification_and_sizes_staging_between_the_two_requests():
    for phase in ("parked", "during-verification"):
        reason = Cell("decode", "sigkill", phase, "greedy").unsupported(link=True, windowed=True)
        assert reason and "does not speculate" in reason
    reason = Cell("prefill", "sigkill", "mid-anchor", "greedy").unsupported(True, windowed=True)
    assert reason and "`between`" in reason  # which already hits a segmented Anchor mid-way
    assert Cell("prefill", "sigstop", "between", "greedy").unsupported(True, windowed=True) is None
    sample = select_cells(all_cells(), sample=20, seed=5, link=True, windowed=True)
    assert len(sample) == 20
    assert all(c.phase not in ("parked", "during-verification", "mid-anchor") for c in sample)
    shape = model_shape("SmolLM2-135M", "bfloat16")
    need = {n: StreamPlan.build(CodecSpec(target="exact"), shape, n, 256).staging_bytes
            for n in (1500, 256)}
    mib = windowed_staging_mib("SmolLM2-135M", "bfloat16", 1500, 256)
    assert need[256] <= mib << 20 < need[1500]
    assert (mib - 1) << 20 < need[256]  # the least that holds the next request whole
    with pytest.raises(ValueError, match="longer --prompt-tokens"):
        windowed_staging_mib("SmolLM2-135M", "bfloat16", 260, 256)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lynx-sglang faults")
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    return args


def test_cells_by_name_run_as_given_and_every_name_parses_back():
    assert all(Cell.parse(c.name) == c for c in all_cells())
    args = _parse(["--cells", "decode/sigstop/between/greedy", "prefill/rst/mid-residual/sampled",
                   "decode/sigstop/between/greedy"])
    # in the order given, once each; a cell this machine cannot run stays (run_cell reports it
    # skipped with its reason) instead of silently going missing
    assert [c.name for c in chosen_cells(args, link=False)] == [
        "decode/sigstop/between/greedy", "prefill/rst/mid-residual/sampled"]
    assert chosen_cells(_parse([]), link=False) == all_cells()


@pytest.mark.parametrize("name, says", [
    ("decode/sigstop/between", "TARGET/FAULT/PHASE/MODE"),
    ("decode/sigint/between/greedy", "faults 'sigint' is not one of"),
    ("decode/sigkill/after/greedy", "phases 'after'"),
])
def test_a_bad_cell_name_says_which_part(name, says, capsys):
    with pytest.raises(SystemExit):
        _parse(["--cells", name])
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [
    (["--sample", "3"], "--sample"),
    (["--targets", "decode"], "--targets"),
    (["--modes", "greedy", "--phases", "between"], "--phases, --modes"),
])
def test_cells_refuse_the_options_that_would_choose_others(extra, says, capsys):
    with pytest.raises(SystemExit):
        _parse(["--cells", "decode/sigkill/between/greedy", *extra])
    assert says in capsys.readouterr().err
    _parse(extra)  # each of them is fine without --cells


def test_mid_anchor_cells_run_anywhere_a_process_fault_runs():
    """The Anchor hold is the prefill's own, so mid-Anchor needs no shaped link (nor does it
    leave the verbs guest out); its link faults still need the link."""
    assert PHASES.index("before-anchor") < PHASES.index("mid-anchor") < PHASES.index("between")
    assert Cell("decode", "sigkill", "mid-anchor", "sampled").unsupported(link=False) is None
    assert Cell("prefill", "sigstop", "mid-anchor", "greedy").unsupported(False, "verbs") is None
    assert Cell("prefill", "rst", "mid-anchor", "greedy").unsupported(link=False)


def test_a_parked_cell_asks_fewer_tokens_so_that_its_request_parks():
    parked = [c for c in all_cells() if c.phase == "parked"]
    assert len(parked) == len(TARGETS) * len(FAULTS) * len(MODES)
    assert all(c.new_tokens(24) == PARKED_NEW_TOKENS < 24 for c in parked)
    assert all(c.new_tokens(2) == 2 for c in parked)  # never more than the matrix runs with
    assert {c.new_tokens(24) for c in all_cells() if c.phase != "parked"} == {24}
    assert Cell("decode", "sigkill", "parked", "greedy").unsupported(link=False) is None


def test_an_outcome_keeps_the_reason_at_the_end_of_a_long_abort_message():
    message = ("request aborted: Decode transfer failed for request rank=0 rid='" + "9" * 300
               + "' with exception KVTransferError(...): Anchor stream failed: peer_died")
    short = brief(message)
    assert len(short) == 300
    assert short.startswith("request aborted: Decode transfer failed")
    assert short.endswith("Anchor stream failed: peer_died")
    assert brief("short") == "short"
    row = table([CellResult("prefill/sigkill/mid-anchor/greedy", outcome=f"error: {short}",
                            phase_hit=True, checks={"servers alive": True})])
    assert "Anchor stream failed: peer_died |" in row  # the table keeps the reason too


def test_the_prefill_reads_its_fault_holds_from_the_environment(monkeypatch):
    from lynx_sglang.backend.prefill.faults import FaultPlan, Point
    from lynx_sglang.names import FAULT_ANCHOR_DELAY_ENV, FAULT_RESIDUAL_DELAY_ENV

    monkeypatch.delenv(FAULT_ANCHOR_DELAY_ENV, raising=False)
    monkeypatch.delenv(FAULT_RESIDUAL_DELAY_ENV, raising=False)
    plan = FaultPlan.from_env()
    assert plan == FaultPlan(0.0, 0.0)  # off unless a test asks
    assert not any(plan.holds(point) for point in Point)
    monkeypatch.setenv(FAULT_ANCHOR_DELAY_ENV, "3")
    monkeypatch.setenv(FAULT_RESIDUAL_DELAY_ENV, "4.5")
    assert FaultPlan.from_env() == FaultPlan(anchor_s=3.0, residual_s=4.5)
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(FAULT_ANCHOR_DELAY_ENV, bad)
        with pytest.raises(ValueError, match=FAULT_ANCHOR_DELAY_ENV):
            FaultPlan.from_env()


def test_a_client_abort_that_ends_by_itself_leaves_no_thread_error(monkeypatch):
    """The hang-up thread of a client-abort cell shuts the connection's socket; when the answer
    ends first, the client closes the connection as the thread wakes (a real local HTTP server)."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"data\n")

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    url, timing = f"http://127.0.0.1:{server.server_port}", Timing()
    try:
        for _ in range(30):
            out: dict = {}
            before = set(threading.enumerate())
            stream_until_hang_up(url, [1, 2, 3], 4, timing.outage_s + timing.request_s, out,
                                 threading.Event())
            assert out["result"] == "answer (before the hang-up)"
            for t in set(threading.enumerate()) - before:
                t.join(timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert errors == []
