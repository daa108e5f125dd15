"""The sampled CI run's choice (tests/ci_sample.py): repeatable per seed, bounded, and naming only
modules that exist, so that a rename cannot silently drop a module from every CI run."""

from __future__ import annotations

import ci_sample
import pytest


def test_the_same_seed_gives_the_same_choice_and_seeds_vary_it():
    assert ci_sample.chosen("0cffb1e") == ci_sample.chosen("0cffb1e")
    choices = {frozenset(ci_sample.chosen(f"commit-{i}")) for i in range(50)}
    assert len(choices) > 10
    covered = set().union(*choices)
    assert covered == set(ci_sample.SAMPLED) | set(ci_sample.OCCASIONAL)


def test_a_run_takes_a_fixed_number_of_the_sampled_modules():
    for i in range(50):
        picked = ci_sample.chosen(str(i))
        assert len(picked & set(ci_sample.SAMPLED)) == ci_sample.SAMPLED_PER_RUN


def test_every_named_module_exists_and_is_named_once():
    named = [*ci_sample.ALWAYS, *ci_sample.SAMPLED, *ci_sample.OCCASIONAL]
    assert len(named) == len(set(named))
    for module in named:
        assert (ci_sample.TESTS / module).is_file(), module


def test_the_mode_is_checked(monkeypatch):
    monkeypatch.setenv(ci_sample.SAMPLE_ENV, "some")
    with pytest.raises(pytest.UsageError, match="'all' or 'ci'"):
        ci_sample.mode()
