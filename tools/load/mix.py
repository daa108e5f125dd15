"""The kinds of request a `lynx-sglang load` round mixes (what chat and RAG clients send: greedy,
logprobs, temperature, top-p/top-k/min-p, penalties, a grammar) and what the decode's speculation
did with each kind (`SpecTally`, from its `lynx spec` lines).

Used by `lynx_tools.load.run` (the runner) and its tests; no servers here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..measure import spec_lines


@dataclass(frozen=True)
class RequestKind:
    """One kind of request: its sampling parameters and other /generate fields. `exact`: its
    answer is deterministic, so a completed one must equal the single server's token for token;
    a sampled kind is checked for completing only (its distribution is
    tests/sglang/test_pd_lynx_sampling.py's subject)."""

    name: str
    sampling: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)
    exact: bool = True


KINDS = (
    RequestKind("greedy"),
    RequestKind("logprobs", fields={"return_logprob": True, "top_logprobs_num": 2}),
    RequestKind("temperature", {"temperature": 0.7}, exact=False),
    RequestKind("top-p", {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.02},
                exact=False),
    # Greedy, so deterministic; but under the overlap scheduler SGLang feeds the penalizers one
    # step late, at points that depend on batching, so the same request's tokens may differ
    # between the PD decode and the single server without any KV difference: checked for
    # completing only.
    RequestKind("penalties", {"frequency_penalty": 0.4, "presence_penalty": 0.3,
                              "repetition_penalty": 1.1}, exact=False),
    # Structured output (SGLang's xgrammar backend): the tokens the grammar allows, greedy.
    RequestKind("regex", {"regex": r"[A-Za-z0-9 ,.:'-]{1,400}"}),
)
KIND_NAMES = tuple(k.name for k in KINDS)


def kinds_by_name(names: str) -> tuple[RequestKind, ...]:
    """`--kinds greedy,logprobs`: the kinds named, in that order; ValueError names the others."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in KIND_NAMES]
    if unknown or not wanted:
        raise ValueError(f"unknown request kind(s) {unknown or names!r}: choose from "
                         f"{', '.join(KIND_NAMES)}")
    return tuple(next(k for k in KINDS if k.name == n) for n in dict.fromkeys(wanted))


def reference_key(kind: RequestKind) -> str:
    """Kinds with the same sampling parameters share a single server's reference output."""
    return json.dumps(kind.sampling, sort_keys=True)


def request_id(round_no: int, index: int, kind: RequestKind) -> str:
    """The rid a load request is sent with: its kind is read back from the decode's log."""
    return f"load-r{round_no}-{index}.{kind.name}"


@dataclass
class SpecTally:
    """Per kind, of the requests the decode committed at Anchor time (the ones that could
    speculate; a request whose Residual was in first has no `lynx spec` line): how many were
    allowed to speculate, how many did produce speculative tokens, and why the others waited."""

    committed_early: int = 0
    speculated: int = 0
    with_tokens: int = 0
    waited: dict[str, int] = field(default_factory=dict)

    @property
    def fraction(self) -> float | None:
        return self.speculated / self.committed_early if self.committed_early else None


def tally(decode_log: str, round_no: int) -> dict[str, SpecTally]:
    """What speculation did with each kind of round `round_no`'s requests."""
    prefix = f"load-r{round_no}-"
    out: dict[str, SpecTally] = {}
    for rec in spec_lines(decode_log):
        rid = rec.get("rid") or ""
        if not rid.startswith(prefix):
            continue
        t = out.setdefault(rid.partition(".")[2], SpecTally())
        t.committed_early += 1
        reason = rec.get("no_spec_reason")
        if reason is None:
            t.speculated += 1
            t.with_tokens += rec.get("speculated", 0) > 0
        else:
            t.waited[reason] = t.waited.get(reason, 0) + 1
    return out


def merged_tallies(rounds) -> dict[str, SpecTally]:
    """Several rounds' tallies summed per kind."""
    out: dict[str, SpecTally] = {}
    for per_kind in rounds:
        for kind, t in per_kind.items():
            m = out.setdefault(kind, SpecTally())
            m.committed_early += t.committed_early
            m.speculated += t.speculated
            m.with_tokens += t.with_tokens
            for reason, n in t.waited.items():
                m.waited[reason] = m.waited.get(reason, 0) + n
    return out


def speculation_summary(per_kind: dict[str, SpecTally]) -> str:
    """One line: overall and per kind, speculated / committed at Anchor time, and why the rest
    waited."""
    if not per_kind:
        return "no request was committed at Anchor time"
    total = sum(t.committed_early for t in per_kind.values())
    took = sum(t.speculated for t in per_kind.values())
    parts = [f"{took}/{total} speculated ({100 * took / total:.0f} %)"]
    for kind, t in sorted(per_kind.items()):
        waited = "; ".join(f"{n} waited: {why}" for why, n in sorted(t.waited.items()))
        parts.append(f"{kind} {t.speculated}/{t.committed_early}" + (f" ({waited})" if waited
                                                                      else ""))
    return ", ".join(parts)
