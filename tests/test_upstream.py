"""The one room for SGLang's internals (`lynx_sglang.upstream`) without importing SGLang: the hook
table, the release fingerprints on file, and how an installed release is identified, refused or
let through. Against the installed SGLang (its fingerprints, the subclasses' overrides, a hook
that failed to apply): tests/sglang/test_plugin.py."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from lynx_sglang.errors import UnsupportedSGLangError
from lynx_sglang.upstream import fingerprints, hook_table
from lynx_sglang.upstream.adapter import SchedulerLayout
from lynx_sglang.upstream.fingerprints import MISSING, Fingerprint


def test_every_hook_has_a_unique_logical_name_and_a_kind_sglang_knows():
    names = [h.name for h in hook_table.HOOKS]
    assert len(names) == len(set(names))
    assert {h.kind for h in hook_table.HOOKS} <= {"BEFORE", "AFTER", "AROUND"}
    assert all(h.target.startswith("sglang.") for h in hook_table.HOOKS)


def test_each_supported_release_has_a_fingerprint_of_everything_lynx_follows():
    releases = fingerprints.known_releases()
    assert {"0.5.22", "0.5.23"} <= set(releases)
    for version, prints in releases.items():
        assert set(prints) == set(hook_table.followed()), version
        assert all(f.signature != MISSING for f in prints.values()), version


def _installed_like(version: str, **changed: Fingerprint) -> dict[str, Fingerprint]:
    return {**fingerprints.known_releases()[version], **changed}


def test_a_release_is_identified_by_its_fingerprints_not_its_name(monkeypatch):
    monkeypatch.setattr(fingerprints, "installed_version", lambda: "0.5.23+my-build")
    same = fingerprints.identify(_installed_like("0.5.23"))
    assert same.known and same.release == "0.5.23" and same.changed == ()
    name = hook_table.SPEC_SAMPLE.target
    body = replace(fingerprints.known_releases()["0.5.23"][name], source="0" * 16)
    other = fingerprints.identify(_installed_like("0.5.23", **{name: body}))
    assert not other.known and other.nearest == "0.5.23" and other.changed == (name,)
    assert f"{name}: body changed" in fingerprints.describe_changes(
        other, _installed_like("0.5.23", **{name: body}))


def test_an_unknown_release_is_refused_with_what_changed_unless_allowed(monkeypatch, caplog):
    name = hook_table.SPEC_RELEASE.target
    then = fingerprints.known_releases()["0.5.23"][name]
    changed = _installed_like("0.5.23", **{name: replace(then, signature="(req, *, checkpoint)")})
    monkeypatch.setattr(fingerprints, "installed", lambda: changed)
    monkeypatch.setattr(fingerprints, "installed_version", lambda: "0.5.99")
    with pytest.raises(UnsupportedSGLangError) as refused:
        fingerprints.check_release(allow_unknown=False)
    text = str(refused.value)
    assert "SGLang 0.5.99 is not a release Lynx supports" in text
    assert f"{name}: signature {then.signature} -> (req, *, checkpoint)" in text
    assert "--lynx-allow-unknown-sglang" in text
    with caplog.at_level(logging.WARNING):
        assert not fingerprints.check_release(allow_unknown=True).known
    assert "running anyway (--lynx-allow-unknown-sglang)" in caplog.text


def test_a_missing_function_is_refused_even_when_unknown_releases_are_allowed(monkeypatch):
    name = hook_table.SPEC_ABORT.target
    gone = _installed_like("0.5.23", **{name: Fingerprint(MISSING, "")})
    monkeypatch.setattr(fingerprints, "installed", lambda: gone)
    with pytest.raises(UnsupportedSGLangError, match=rf"{name}: missing"):
        fingerprints.check_release(allow_unknown=True)


def test_the_releases_differ_in_what_lynx_follows_so_each_is_identified_apart():
    releases = fingerprints.known_releases()
    for version in ("0.5.22", "0.5.23"):
        found = fingerprints.identify(releases[version])
        assert found.release == version and found.changed == ()


@pytest.mark.parametrize(("has_row", "rows"), [(True, [0, 1, 5]), (False, [0, 0, 4])])
def test_token_ids_logprob_rows_count_the_prefills_token_only_where_the_release_has_its_row(
        has_row, rows):
    """0.5.23's decode reserves a requested-token-ids logprob row for the prefill's token, 0.5.22's
    does not: truncating to k output tokens keeps k rows there, k - 1 here."""
    layout = SchedulerLayout(lambda f, g, o: f, ("reasoning_tokens",), has_row)
    assert [layout.token_ids_logprob_rows(k) for k in (0, 1, 5)] == rows
