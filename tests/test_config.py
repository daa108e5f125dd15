"""`LynxConfig` from the `--lynx-*` flags and `--lynx-config` (no SGLang needed: the flags are
added to a plain argparse parser, as the plugin adds them to SGLang's)."""

from __future__ import annotations

import argparse
import json

import pytest

from lynx_sglang.config import LynxConfig, add_lynx_arguments, wire_mismatch
from lynx_sglang.errors import LynxConfigError


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
