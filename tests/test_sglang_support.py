"""An option the CLI check refuses, and `lynx-sglang --version` (no SGLang import); which SGLang
releases Lynx runs on: tests/test_upstream.py."""

from __future__ import annotations

import argparse

import pytest

from lynx_sglang.errors import UnsupportedSGLangError
from lynx_sglang.sglang_support import check_server_options
from lynx_tools.cli import main


def test_version_reports_what_it_found(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("lynx-sglang ")
    assert "sglang " in out and "codec on CPU pools:" in out and "pyverbs:" in out


def test_the_rust_server_is_refused(monkeypatch):
    """Its registry stands in for Lynx's bootstrap server and drops the prefills' rank keys."""
    monkeypatch.setenv("SGLANG_RUST_SERVER", "false")
    check_server_options(argparse.Namespace())
    monkeypatch.setenv("SGLANG_RUST_SERVER", "1")
    with pytest.raises(UnsupportedSGLangError, match=r"SGLANG_RUST_SERVER=1: .*rank key"):
        check_server_options(argparse.Namespace())


@pytest.mark.parametrize("spelling", [{"enable_dp_attention": True, "dp_size": 2},
                                      {"attn_dp_size": 2}])
def test_dp_attention_is_refused_with_the_reason(monkeypatch, spelling):
    """Both spellings as SGLang's parser leaves them (the deprecated one is resolved later): the
    verification forward would run on one attention-DP rank outside SGLang's MLP sync."""
    monkeypatch.delenv("SGLANG_RUST_SERVER", raising=False)
    check_server_options(argparse.Namespace(enable_dp_attention=False, attn_dp_size=1, dp_size=2))
    with pytest.raises(UnsupportedSGLangError,
                       match=r"--enable-dp-attention/--attn-dp-size > 1: .*MLP sync.*mooncake"):
        check_server_options(argparse.Namespace(**spelling))


@pytest.mark.parametrize("off", [1.0, 0.0])
def test_decode_host_receive_is_refused_at_any_value_but_the_one_that_disables_it(monkeypatch,
                                                                                  off):
    """1 disables it from SGLang 0.5.22, 0 in 0.5.21 (`upstream.adapter.launch`)."""
    from lynx_sglang.upstream import adapter

    monkeypatch.delenv("SGLANG_RUST_SERVER", raising=False)
    monkeypatch.setattr(adapter, "launch", lambda: adapter.LaunchLayout(host_receive_off=off))
    check_server_options(argparse.Namespace(disaggregation_decode_host_receive_threshold=off))
    with pytest.raises(UnsupportedSGLangError, match=r"host-receive-threshold 0\.5: "):
        check_server_options(argparse.Namespace(disaggregation_decode_host_receive_threshold=0.5))
