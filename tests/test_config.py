"""`LynxConfig` from the `--lynx-*` flags and `--lynx-config` (no SGLang needed: the flags are
added to a plain argparse parser, as the plugin adds them to SGLang's)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
from pathlib import Path

import pytest

from lynx_sglang.config import LynxConfig, add_lynx_arguments, wire_mismatch
from lynx_sglang.errors import LynxConfigError
from lynx_sglang.names import SECRET_ENV


def _config(*argv: str) -> LynxConfig:
    parser = argparse.ArgumentParser()
    add_lynx_arguments(parser)
    return LynxConfig.from_namespace(parser.parse_args(list(argv)))


def test_defaults_are_the_recommended_config():
    assert _config() == LynxConfig()
    assert _config().codec.target.value == "exact"


def test_config_file_and_inline_json_and_flags_win(tmp_path):
    path = tmp_path / "lynx.json"
    path.write_text(json.dumps({"target": "int8", "lynx-staging-mib": 1024,
                                "--lynx-speculate": False}))
    cfg = _config("--lynx-config", str(path))
    assert (cfg.codec.target.value, cfg.staging_mib, cfg.speculate) == ("int8", 1024, False)
    assert _config("--lynx-config", '{"chunk_tokens": 128}').chunk_tokens == 128
    both = _config("--lynx-config", str(path), "--lynx-staging-mib", "64")
    assert both.staging_mib == 64 and both.codec.target.value == "int8"


@pytest.mark.parametrize(("source", "message"), [
    ('{"targte": "int8"}', r"unknown settings \['targte'\]"),
    ("[1, 2]", "JSON object"),
    ("{not json", "--lynx-config"),
    ("/no/such/file.json", "No such file"),
    ('{"anchor_bits": 9}', "anchor-bits"),
])
def test_bad_config_sources_are_named(source, message):
    with pytest.raises(LynxConfigError, match=message):
        _config("--lynx-config", source)


def test_wire_mismatch_names_flags():
    decode = LynxConfig().wire_settings()
    prefill = LynxConfig.build(rotate=False).wire_settings()
    assert wire_mismatch(decode, prefill) == ["--lynx-rotate: prefill False, decode True"]
    assert wire_mismatch(decode, decode) == []


def test_rdma_path_flags_reach_the_verbs_options():
    cfg = _config("--lynx-ib-gid-index", "3", "--lynx-ib-anchor-sl", "5", "--lynx-ib-anchor-tc", "106",
                  "--lynx-ib-residual-sl", "1", "--lynx-ib-residual-tc", "0")
    assert cfg.verbs_options("mlx5_1") == {"device": "mlx5_1", "gid_index": 3, "anchor_sl": 5,
                                           "residual_sl": 1, "anchor_tc": 106, "residual_tc": 0}
    assert _config().verbs_options(None)["gid_index"] is None


@pytest.mark.parametrize(("argv", "message"), [
    (("--lynx-ib-anchor-sl", "16"), r"--lynx-ib-anchor-sl must be in \[0, 15\]"),
    (("--lynx-ib-residual-tc", "256"), r"--lynx-ib-residual-tc must be in \[0, 255\]"),
    (("--lynx-ib-gid-index", "-1"), "--lynx-ib-gid-index must be >= 0"),
])
def test_bad_rdma_path_flags_are_refused_by_name(argv, message):
    with pytest.raises(LynxConfigError, match=message):
        _config(*argv)


def _flag_table() -> list[str]:
    """The flags table of docs/operators.md, one row per `--lynx-*` flag, from the parser."""
    parser = argparse.ArgumentParser()
    add_lynx_arguments(parser)
    rows = []
    for action in parser._actions:
        flag = action.option_strings[0] if action.option_strings else ""
        if not flag.startswith("--lynx-") or flag == "--lynx-config":
            continue
        text, _, shown = action.help.rpartition(" (default ")
        rows.append(f"| `{flag}` | `{shown.rstrip(')')}` | {text} |")
    return rows


def test_operators_doc_lists_every_flag_as_the_parser_explains_it():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operators.md").read_text().splitlines()
    missing = [row for row in _flag_table() if row not in doc]
    assert not missing, "docs/operators.md flag table is stale; rows to put in:\n" + "\n".join(missing)


def test_tls_flags_reach_the_transport_and_bad_ones_are_named(tmp_path):
    from lynx_tools.cluster.tls_certs import make_certs

    files = make_certs(tmp_path, ["127.0.0.1"])
    cfg = _config(*files.flags(), "--no-lynx-tls-check-hostname")
    tls = cfg.tls_config()
    assert (tls.cert_file, tls.key_file, tls.ca_file) == (str(files.cert_file), str(files.key_file),
                                                        str(files.ca_file))
    assert tls.check_hostname is False
    assert _config().tls_config() is None
    with pytest.raises(LynxConfigError, match="all three of --lynx-tls-cert"):
        _config("--lynx-tls-cert", str(files.cert_file))
    with pytest.raises(LynxConfigError, match="TLS covers the tcp transport"):
        _config(*files.flags(), "--lynx-transport", "verbs")
    with pytest.raises(LynxConfigError, match=r"--lynx-tls-cert: .*no such file"):
        _config("--lynx-tls-cert", str(tmp_path / "nope.pem"), "--lynx-tls-key",
                str(files.key_file), "--lynx-tls-ca", str(files.ca_file)).tls_config()
    # the config reaches the schedulers through the environment with the TLS files in it
    assert LynxConfig.build(**{k: v for k, v in cfg.flat().items()}).tls_config() == tls


def _secret_file(tmp_path: Path, data: bytes, mode: int = 0o600, name: str = "lynx.key") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _load_secret(path: Path, *flags: str) -> bytes | None:
    return _config("--lynx-secret-file", str(path), *flags).load_secret()


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_secret_file_only_its_owner_may_access_is_read(tmp_path, mode):
    secret = os.urandom(32)
    assert _load_secret(_secret_file(tmp_path, secret, mode)) == secret


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o666, 0o777, 0o620, 0o604, 0o602], ids=oct)
def test_a_secret_file_others_may_access_is_refused_naming_mode_and_fix(tmp_path, mode):
    path = _secret_file(tmp_path, os.urandom(32), mode)
    with pytest.raises(LynxConfigError) as refused:
        _load_secret(path)
    message = str(refused.value)
    assert message.startswith(f"--lynx-secret-file: {path} has mode {mode:04o}"), message
    assert f"`chmod 600 {path}`" in message and "--lynx-insecure" in message


def test_a_symlinked_secret_file_is_refused(tmp_path):
    target = _secret_file(tmp_path, os.urandom(32))
    link = tmp_path / "link.key"
    link.symlink_to(target)
    with pytest.raises(LynxConfigError, match=rf"{link} is a symbolic link \(to {target}\).*"
                                              r"chmod 600.*--lynx-insecure"):
        _load_secret(link)


def test_lynx_insecure_accepts_an_unsafe_secret_file_with_a_warning(tmp_path, caplog):
    secret = os.urandom(32)
    loose = _secret_file(tmp_path, secret, 0o644)
    link = tmp_path / "link.key"
    link.symlink_to(loose)
    for path, why in ((loose, "has mode 0644"), (link, "is a symbolic link")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lynx_sglang.config"):
            assert _load_secret(path, "--lynx-insecure") == secret
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert f"{path} {why}" in warning and "used anyway (--lynx-insecure)" in warning


def test_random_binary_secrets_load_byte_for_byte(tmp_path):
    """Whatever bytes a binary secret has (leading or trailing whitespace, NULs, a newline at the
    end) are the secret: stripping them refused 4.4% of random 16-byte secrets and changed
    others."""
    rng = random.Random(42)
    path = _secret_file(tmp_path, b"")
    edges = [b" " * 16, b"\n" + bytes(15), bytes(16) + b"\n", b"\t\r\n\x0b\x0c " * 3]
    for secret in edges + [rng.randbytes(rng.choice((16, 17, 32, 64))) for _ in range(5000)]:
        path.write_bytes(secret)
        assert LynxConfig(secret_file=str(path)).load_secret() == secret


@pytest.mark.parametrize("text", ["{}", "{}\n", "{}\r\n", "{upper}\n"])
def test_a_secret_file_of_hex_digits_holds_the_bytes_they_spell(tmp_path, monkeypatch, text):
    secret = os.urandom(32)
    data = text.format(secret.hex(), upper=secret.hex().upper()).encode()
    assert _load_secret(_secret_file(tmp_path, data)) == secret
    monkeypatch.setenv(SECRET_ENV, secret.hex())  # the same text as the environment variable
    assert LynxConfig().load_secret() == secret


@pytest.mark.parametrize("data", [b"ab" * 16 + b"\n\n", b"ab" * 16 + b" ", b"0x" + b"ab" * 16,
                                  b"correct horse battery staple\n"])
def test_other_text_is_the_secret_byte_for_byte(tmp_path, data):
    assert _load_secret(_secret_file(tmp_path, data)) == data


@pytest.mark.parametrize("data, message", [
    (b"", "the secret is 0 B"),
    (b"x" * 15, "the secret is 15 B"),
    (b"ab" * 15 + b"\n", r"\(hex digits\): the secret is 15 B"),
    (b"ab" * 16 + b"a\n", "33 hex digits, an odd number"),
])
def test_a_short_or_odd_secret_is_refused(tmp_path, data, message):
    with pytest.raises(LynxConfigError, match=message):
        _load_secret(_secret_file(tmp_path, data))


# ---- the secret file is checked before it is read (issue 56, hole 5)
@pytest.mark.timeout(10)  # a FIFO used to hang the start-up here, waiting for a writer
@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory"])
def test_a_secret_file_that_is_no_regular_file_is_refused_before_a_byte_is_read(tmp_path, kind):
    """/dev/zero used to be read to the end of memory and a FIFO to block the server's start-up;
    both are refused, also with --lynx-insecure."""
    if kind == "fifo":
        path = tmp_path / "lynx.key"
        os.mkfifo(path, 0o600)
        what = "a FIFO"
    elif kind == "directory":
        path = tmp_path / "keys"
        path.mkdir(mode=0o700)
        what = "a directory"
    else:
        path = Path(kind)
        what = "a character device"
    for flags in ((), ("--lynx-insecure",)):
        with pytest.raises(LynxConfigError, match=rf"{path} is {what}, not a regular file"):
            _load_secret(path, *flags)


def test_an_oversized_secret_file_is_refused_without_reading_it(tmp_path):
    from lynx_sglang.secret_file import MAX_SECRET_FILE_BYTES

    path = _secret_file(tmp_path, os.urandom(MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(LynxConfigError, match=rf"is {MAX_SECRET_FILE_BYTES + 1} B, more than a"):
        _load_secret(path)
    path.write_bytes(os.urandom(MAX_SECRET_FILE_BYTES))
    assert len(_load_secret(path)) == MAX_SECRET_FILE_BYTES


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root")
def test_a_secret_file_of_another_owner_is_refused(tmp_path):
    path = _secret_file(tmp_path, os.urandom(32))
    os.chown(path, 65534, 65534)  # nobody
    with pytest.raises(LynxConfigError, match=r"owned by uid 65534, not by this user.*"
                                              r"--lynx-insecure"):
        _load_secret(path)


def test_a_secret_file_behind_a_symlinked_or_open_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    secret = os.urandom(32)
    _secret_file(real, secret)
    (tmp_path / "via").symlink_to(real)
    with pytest.raises(LynxConfigError, match=r"directory .*via is reached through a symbolic "
                                              r"link.*--lynx-insecure"):
        _load_secret(tmp_path / "via" / "lynx.key")
    real.chmod(0o777)  # anyone may swap the file
    with pytest.raises(LynxConfigError, match=r"has mode 0777: others may replace the file"):
        _load_secret(real / "lynx.key")
    real.chmod(0o1777)  # sticky, as /tmp: only the file's owner may replace it
    assert _load_secret(real / "lynx.key") == secret
