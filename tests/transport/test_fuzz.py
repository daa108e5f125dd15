"""Runs each atheris harness (fuzz_control.py, fuzz_frames.py) from its kept seed corpus
(fuzz_corpus/), a few thousand inputs by hand and a minute each in a sampled CI run: any
exception other than the parsers' documented validation errors fails the test, with the
harness's report. The seeds themselves must stay valid messages, so that the corpus keeps
pointing the fuzzer at the real formats."""

from __future__ import annotations

import hashlib
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import ci_sample
import pytest

HERE = Path(__file__).parent
CORPUS = HERE / "fuzz_corpus"
RUNS = 4000
# A sampled CI run (tests/ci_sample.py) fuzzes each harness for this long, seeded by the run's seed,
# so that successive CI runs explore different inputs from the kept corpus; by hand, a quick fixed
# `RUNS`. A long run is a command (docs/testing.md).
CI_FUZZ_SECONDS = 60


def _budget() -> tuple[list[str], int]:
    """libFuzzer's budget flags for this run and the seconds it may take."""
    if ci_sample.mode() == "ci":
        seed = int.from_bytes(hashlib.sha256(ci_sample.seed().encode()).digest()[:4], "little") >> 1
        return [f"-max_total_time={CI_FUZZ_SECONDS}", f"-seed={seed or 1}"], CI_FUZZ_SECONDS + 40
    return [f"-runs={RUNS}", "-seed=1"], 50


@pytest.mark.timeout(CI_FUZZ_SECONDS + 60)
@pytest.mark.parametrize("harness, corpus, flags", [
    ("fuzz_control.py", "control", ["-max_len=8192", f"-dict={CORPUS / 'control.dict'}"]),
    ("fuzz_frames.py", "frames", ["-max_len=512"]),
])
def test_harness_finds_nothing(harness, corpus, flags, tmp_path):
    pytest.importorskip("atheris")
    work = tmp_path / corpus  # libFuzzer adds what it finds to the corpus: not to the kept one
    shutil.copytree(CORPUS / corpus, work)
    budget, timeout_s = _budget()
    # libFuzzer's RSS is the peak (ru_maxrss), which a child inherits from its parent across
    # fork and exec: under a full pytest run (SGLang, torch loaded: ~1.6 GB) a fixed 1 GiB limit
    # fails at libFuzzer's first check. The harness may use 1 GiB more than it started with.
    rss_limit_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + 1024
    proc = subprocess.run(
        [sys.executable, str(HERE / harness), *budget, "-timeout=10",
         f"-rss_limit_mb={rss_limit_mb}", *flags, str(work)],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert re.search(r"Done \d+ runs", proc.stderr), proc.stderr[-2000:]


def test_seeds_are_valid_messages():
    pytest.importorskip("atheris")  # the harness imports it
    from fuzz_control import split

    from lynx_transport import Stream, tcp_wire, verbs_wire, wire

    for seed in sorted((CORPUS / "control").iterdir()):
        assert wire.parse(wire.decode(split(seed.read_bytes()))) is not None, seed.name
    for seed in sorted((CORPUS / "frames").iterdir()):
        data = seed.read_bytes()
        parse = verbs_wire.parse_notice if seed.name.startswith("notice") else tcp_wire.parse_frame_header
        parse(data[1:], Stream(data[0] & 1))


FIN_TOTAL_MAX = CORPUS / "frames" / "fin_total_max"  # found by fuzz_frames.py after ~0.5M runs


def test_fin_with_the_largest_total_is_refused_by_the_receiver():
    """A FIN's offset field is its stream's total: 2^64-1 (with aux bytes) is a well-formed header,
    and the receiver refuses that total (beyond what it announced) without arithmetic on it."""
    from lynx_transport import Stream, tcp_wire
    from lynx_transport.receiver import RxStream

    data = FIN_TOTAL_MAX.read_bytes()
    h = tcp_wire.parse_frame_header(data[1:], Stream(data[0] & 1))
    assert h.kind == tcp_wire.KIND_FIN and h.offset == (1 << 64) - 1 and h.length > 0
    for counts_incoming in (True, False):  # tcp counts landed chunks; verbs trusts the FIN
        rs = RxStream(expected=1 << 20)
        with rs.lock:
            assert "FIN says" in rs.fin_locked(h.offset, b"token", counts_incoming)


def test_frames_harness_accepts_a_fin_with_the_largest_total():
    """fuzz_frames.py asserted offset + length < 2^64 for FINs too, whose offset is a total: it
    failed on this well-formed header, which the receiver handles (test above)."""
    pytest.importorskip("atheris")
    from fuzz_frames import check

    check(FIN_TOTAL_MAX.read_bytes())


NONCE_WITH_SPACES = CORPUS / "found" / "hello_nonce_with_spaces"  # fuzz_control.py, in CI


def test_a_hex_field_with_spaces_is_refused():
    """A HELLO whose nonce has the right length but holds spaces: bytes.fromhex skips them, so the
    parser took it as a shorter nonce that re-encoded differently. Only canonical hex passes now."""
    pytest.importorskip("atheris")
    from fuzz_control import check, split

    from lynx_transport import wire

    data = NONCE_WITH_SPACES.read_bytes()
    with pytest.raises(wire.WireError, match="nonce"):
        wire.parse(wire.decode(split(data)))
    check(data)
