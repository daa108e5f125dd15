"""`lynx-sglang`: SIGTERM ends a tool like Ctrl-C, so what it started (clusters, shaped links) is
stopped by its context managers instead of outliving it (a stand-in subcommand, no servers)."""

from __future__ import annotations

import signal
import subprocess
import sys

SLEEPER = '''
import pathlib, time
def add_arguments(parser):
    parser.add_argument("--mark")
    parser.add_argument("--cleanup-s", default="0")
def run(args):
    try:
        print("started", flush=True)
        time.sleep(60)
    finally:
        print("cleaning up", flush=True)
        time.sleep(float(args.cleanup_s))
        pathlib.Path(args.mark).write_text("cleaned up")
'''


def _start_sleeper(tmp_path, cleanup_s: float) -> tuple[subprocess.Popen, object]:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    mark = tmp_path / "mark"
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
            "from lynx_tools import cli; "
            "cli.SUBCOMMANDS += (cli.Subcommand('sleeper', 'sleeper', 'test'),); "
            f"sys.exit(cli.main(['sleeper', '--mark', {str(mark)!r}, "
            f"'--cleanup-s', '{cleanup_s}']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, mark


def test_sigterm_unwinds_the_tool_and_exits_130(tmp_path):
    proc, mark = _start_sleeper(tmp_path, cleanup_s=0)
    try:
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "sleeper: interrupted" in err
    assert mark.read_text() == "cleaned up"


def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path):
    """`timeout` and `pkill -f` together send two: the second came while the fault matrix stopped
    its cluster and left the router running."""
    proc, mark = _start_sleeper(tmp_path, cleanup_s=1.0)
    try:
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "cleaning up"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "SIGTERM again" in err
    assert mark.read_text() == "cleaned up"
