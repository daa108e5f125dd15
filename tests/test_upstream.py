"""The one room for SGLang's internals (`lynx_sglang.upstream`) without importing SGLang: the hook
table, the release fingerprints on file, and how an installed release is identified, refused or
let through. Against the installed SGLang (its fingerprints, the subclasses' overrides, a hook
that failed to apply): tests/sglang/test_plugin.py."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest

from lynx_sglang.errors import UnsupportedSGLangError
from lynx_sglang.upstream import adapter, fingerprints, hook_table
from lynx_sglang.upstream.adapter import SchedulerLayout
from lynx_sglang.upstream.fingerprints import MISSING, Fingerprint


def test_every_hook_has_a_unique_logical_name_and_a_kind_sglang_knows():
    names = [h.name for h in hook_table.HOOKS]
    assert len(names) == len(set(names))
    assert {h.kind for h in hook_table.HOOKS} <= {"BEFORE", "AFTER", "AROUND"}
    assert all(h.target.startswith("sglang.") for h in hook_table.HOOKS)


def test_each_supported_release_has_a_fingerprint_of_everything_lynx_follows():
    releases = fingerprints.known_releases()
    assert {"0.5.21", "0.5.22", "0.5.23"} <= set(releases)
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
    for version in releases:
        found = fingerprints.identify(releases[version])
        assert found.release == version and found.changed == ()


@pytest.mark.parametrize(("has_row", "rows"), [(True, [0, 1, 5]), (False, [0, 0, 4])])
def test_token_ids_logprob_rows_count_the_prefills_token_only_where_the_release_has_its_row(
        has_row, rows):
    """0.5.23's decode reserves a requested-token-ids logprob row for the prefill's token, 0.5.22's
    does not: truncating to k output tokens keeps k rows there, k - 1 here."""
    assert [_layout(first_token_has_ids_logprob_row=has_row).token_ids_logprob_rows(k)
            for k in (0, 1, 5)] == rows


def _layout(**fields) -> SchedulerLayout:
    return SchedulerLayout(**{
        "all_reduce_flags": lambda f, g, o: f, "reasoning_state": ("reasoning_tokens",),
        "first_token_has_ids_logprob_row": True, "release_kv_cache": lambda r, t, k: None,
        "extend_bounds": lambda r: (0, None), "sampler_softmax": lambda x: x,
        "has_topk_shortcut": True, **fields})


@pytest.mark.parametrize("has_shortcut", [True, False])
def test_the_topk_shortcut_is_turned_off_only_where_the_sampler_has_it(has_shortcut):
    info = SimpleNamespace(max_top_k=20) if has_shortcut else SimpleNamespace()
    _layout(has_topk_shortcut=has_shortcut).disable_topk_shortcut(info)
    assert vars(info) == ({"max_top_k": None} if has_shortcut else {})


def test_a_requests_extend_is_read_from_either_releases_fields():
    """0.5.22 on: `prefix_len` and `extend_end`; 0.5.21: the prefix's slots and `extend_range`."""
    assert adapter._extend_bounds(SimpleNamespace(prefix_len=3, extend_end=8)) == (3, 8)
    old = SimpleNamespace(prefix_indices=[5, 6, 7], extend_range=SimpleNamespace(start=3, end=8))
    assert adapter._extend_range_bounds(old) == (3, 8)
    assert adapter._extend_range_bounds(SimpleNamespace(prefix_indices=[],
                                                        extend_range=None)) == (0, None)


def test_the_release_hook_takes_either_releases_keep_in_cache_flag(monkeypatch):
    """`release_kv_cache(req, cache, *, checkpoint)` from 0.5.22, `(req, cache, is_insert=True)`
    in 0.5.21: the BEFORE hook is called with whichever the release's callers pass."""
    from lynx_sglang.speculation import hooks

    released = []
    monkeypatch.setattr(hooks, "_spec", lambda rt: SimpleNamespace(on_release=released.append))
    monkeypatch.setattr(hooks.runtime, "of_kv_pool", lambda pool: None)
    cache = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: None))
    for call in ({"checkpoint": True}, {}, {"is_insert": False}):
        hooks.release_kv_cache_before("req", cache, **call)
    hooks.release_kv_cache_before("req", cache, False)
    assert released == ["req"] * 4
