"""`lynx-sglang doctor`: each check says OK / WARN / FAIL with what to do, and the exit status is 1
only when Lynx cannot run as configured."""

from __future__ import annotations

import argparse

from lynx_tools import doctor
from lynx_tools.cli import main


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_staging_is_sized_against_the_flag():
    ok = doctor.check_staging("SmolLM2-135M", 1500, 256)
    assert ok.verdict is doctor.Verdict.OK and "holds 5 at once" in ok.detail
    windowed = doctor.check_staging("Llama-3.1-8B", 32768, 256)
    assert windowed.verdict is doctor.Verdict.WARN and "in segments of" in windowed.detail
    assert "5252 would hold it whole" in windowed.detail
    short = doctor.check_staging("Llama-3.1-8B", 1 << 20, 256)  # one layer exceeds the pool
    assert short.verdict is doctor.Verdict.FAIL and "one layer of this request" in short.detail
    unknown = doctor.check_staging("no-such-model", 10, 256)
    assert unknown.verdict is doctor.Verdict.FAIL and "known:" in unknown.detail


def test_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("LYNX_SGLANG_SECRET", raising=False)
    assert doctor.check_secret(None).verdict is doctor.Verdict.WARN
    key = tmp_path / "k"
    key.write_bytes(b"x" * 32)
    key.chmod(0o600)
    assert doctor.check_secret(str(key)).verdict is doctor.Verdict.OK
    assert doctor.check_secret(str(tmp_path / "missing")).verdict is doctor.Verdict.FAIL


def test_a_secret_file_others_may_access_fails_as_the_servers_would_refuse_it(tmp_path):
    key = tmp_path / "k"
    key.write_text("ab" * 16 + "\n")
    key.chmod(0o600)
    ok = doctor.check_secret(str(key))
    assert ok.verdict is doctor.Verdict.OK and ok.detail == f"16 bytes from {key} (hex digits)"
    key.chmod(0o644)
    loose = doctor.check_secret(str(key))
    assert loose.verdict is doctor.Verdict.FAIL, loose
    assert f"{key} has mode 0644" in loose.detail and f"`chmod 600 {key}`" in loose.detail
    allowed = doctor.check_secret(str(key), insecure=True)
    assert allowed.verdict is doctor.Verdict.WARN and "mode 0644" in allowed.detail, allowed
    link = tmp_path / "link"
    link.symlink_to(key)
    key.chmod(0o600)
    linked = doctor.check_secret(str(link))
    assert linked.verdict is doctor.Verdict.FAIL and "symbolic link" in linked.detail, linked
    assert doctor.check_secret(str(link), insecure=True).verdict is doctor.Verdict.WARN
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    args = parser.parse_args(["--secret-file", str(link), "--insecure"])
    assert {c.name: c for c in doctor.run_checks(args)}["secret"].verdict is doctor.Verdict.WARN


def test_this_install_is_found_and_the_exit_status_follows_failures(capsys):
    checks = {c.name: c for c in doctor.run_checks(_args())}
    assert checks["plugin"].verdict is doctor.Verdict.OK  # the editable install registers it
    assert set(checks) == {"sglang", "plugin", "C codec", "rdma", "gpudirect", "secret", "tls"}
    assert main(["doctor", "--model", "Llama-3.1-8B", "--context-tokens", "1048576"]) == 1
    assert "FAIL  staging" in capsys.readouterr().out


def test_the_gpudirect_line_says_what_was_found_and_that_staging_is_host_memory(tmp_path):
    from lynx_transport.gpu_direct import Probes

    (tmp_path / "infiniband" / "mlx5_0").mkdir(parents=True)
    (tmp_path / "modules").write_text("mlx5_ib 471040 0 - Live 0x0000000000000000\n")
    fake = Probes(sys_module=tmp_path / "module", proc_modules=tmp_path / "modules",
                  infiniband=tmp_path / "infiniband", pyverbs=lambda: None)
    host = doctor.check_gpu_direct(None, fake)
    assert host.verdict is doctor.Verdict.OK  # host staging works everywhere
    assert host.detail.startswith("verbs staging in host memory: on RDMA device mlx5_0 neither")
    (tmp_path / "module" / "nvidia_peermem").mkdir(parents=True)
    peer = doctor.check_gpu_direct("mlx5_0", fake)
    assert peer.detail.startswith("GPUDirect RDMA available (nvidia_peermem)")
    assert "not implemented yet" in peer.detail
    missing = doctor.check_gpu_direct("mlx5_9", fake)
    assert "mlx5_9 not found" in missing.detail


def test_tls_files_are_handshaken_as_peers_would(tmp_path):
    from lynx_tools.cluster.tls_certs import make_certs

    assert doctor.check_tls(None, None, None).verdict is doctor.Verdict.WARN
    good = make_certs(tmp_path / "ca1", ["10.0.0.1"])
    ok = doctor.check_tls(str(good.cert_file), str(good.key_file), str(good.ca_file))
    assert ok.verdict is doctor.Verdict.OK and "10.0.0.1" in ok.detail, ok.detail
    other = make_certs(tmp_path / "ca2", ["10.0.0.1"])
    # a certificate of another CA than the one the servers check against
    bad = doctor.check_tls(str(other.cert_file), str(other.key_file), str(good.ca_file))
    assert bad.verdict is doctor.Verdict.FAIL and "handshake" in bad.detail, bad.detail
    # the key of another certificate
    mixed = doctor.check_tls(str(good.cert_file), str(other.key_file), str(good.ca_file))
    assert mixed.verdict is doctor.Verdict.FAIL and "--lynx-tls-cert" in mixed.detail
    short = make_certs(tmp_path / "ca1", ["10.0.0.1"], name="short", days=10)
    soon = doctor.check_tls(str(short.cert_file), str(short.key_file), str(short.ca_file))
    assert soon.verdict is doctor.Verdict.WARN and "valid 9 more days" in soon.detail
    missing = doctor.check_tls(str(good.cert_file), None, None)
    assert missing.verdict is doctor.Verdict.FAIL and "all three" in missing.detail
