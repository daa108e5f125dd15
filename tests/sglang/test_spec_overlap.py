"""`SpecController.step` under SGLang's overlap schedule, on stand-in scheduler / request objects
(tests/sglang/test_pd_lynx_overlap.py covers the real scheduler end to end): a request with a
decode step in flight (in `Scheduler.result_queue`, its result not processed yet) is not verified
in that step but taken out of the running batch and verified at the next, the speculative token
cap counts the token in flight, a request SGLang is aborting is left to SGLang, and the token of a
step that overshot a held finish is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from lynx_sglang.backend.decode.outcome import ResidualOutcome, ResidualState
from lynx_sglang.config import LynxConfig
from lynx_sglang.recorder import Recorder
from lynx_sglang.speculation.controller import (
    IN_FLIGHT_PARK_REASON,
    SpecController,
)
from lynx_sglang.speculation.hooks import update_finish_state_around
from lynx_sglang.speculation.state import SpecState

CAP = 4


@dataclass
class _Req:
    rid: str
    output_ids: list[int]
    lynx_spec: SpecState
    to_finish: object = None
    grammar: object = None

    def finished(self) -> bool:
        return False


@dataclass
class _Batch:
    reqs: list

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


@dataclass
class _Scheduler:
    running_batch: _Batch
    result_queue: list = field(default_factory=list)
    tp_size: int = 1


class _Transfers:
    def __init__(self, state: ResidualState):
        self.state = state
        self.waited: list[int] = []  # rooms the controller said wait on their Residual

    def residual_outcome(self, room: int) -> ResidualOutcome:
        return ResidualOutcome(self.state)

    def waiting(self, room: int) -> None:
        self.waited.append(room)


def _setup(state: ResidualState, n_output: int, sampled: bool = False, **settings):
    req = _Req("r", list(range(n_output)), SpecState(room=7, sampled=sampled))
    sched = _Scheduler(_Batch([req]))
    # The decode step launched last iteration, whose result SGLang processes after this step.
    sched.result_queue.append((_Batch([req]), None))
    ctl = SpecController(_Transfers(state),
                         LynxConfig.build(**({"spec_max_tokens": CAP} | settings)),
                         Recorder.for_process())
    verified: list = []
    ctl._verify_and_resume = lambda scheduler, reqs: verified.extend(reqs)
    return req, sched, ctl, verified


def test_residual_applied_during_a_step_in_flight_verifies_at_the_next_step():
    req, sched, ctl, verified = _setup(ResidualState.APPLIED, 3)
    ctl.step(sched)
    assert verified == [] and ctl.parked == [req] and sched.running_batch.reqs == []
    assert req.lynx_spec.parked_reason == IN_FLIGHT_PARK_REASON
    # SGLang processes that step's result (one more token), then runs the next step.
    req.output_ids.append(99)
    sched.result_queue.clear()
    ctl.step(sched)
    assert verified == [req] and ctl.parked == []


def test_the_cap_counts_the_token_in_flight():
    # 1 verified + CAP - 1 speculative tokens in output_ids, one more in flight: the cap.
    req, sched, ctl, verified = _setup(ResidualState.PENDING, CAP)
    ctl.step(sched)
    assert ctl.parked == [req] and verified == []
    assert req.lynx_spec.parked_reason == f"speculative token cap ({CAP}) reached"
    assert ctl.transfers.waited == [7]  # the prefill is told the request waits now
    # Without a step in flight, the same request may take one more.
    req, sched, ctl, verified = _setup(ResidualState.PENDING, CAP)
    sched.result_queue.clear()
    ctl.step(sched)
    assert ctl.parked == [] and sched.running_batch.reqs == [req]
    assert ctl.transfers.waited == []


def test_a_sampled_request_parks_at_the_sampled_cap():
    # It keeps a vocabulary-wide draft row per speculative token: a tighter cap than greedy's.
    req, sched, ctl, _ = _setup(ResidualState.PENDING, 3, sampled=True, spec_max_sampled_tokens=2)
    sched.result_queue.clear()
    ctl.step(sched)
    assert ctl.parked == [req]
    assert req.lynx_spec.parked_reason == "speculative token cap (2) reached"
    req, sched, ctl, _ = _setup(ResidualState.PENDING, 3, spec_max_sampled_tokens=2)
    sched.result_queue.clear()
    ctl.step(sched)
    assert ctl.parked == [] and sched.running_batch.reqs == [req]  # greedy: CAP applies
    # The sampled cap never exceeds the general one.
    _, _, ctl, _ = _setup(ResidualState.PENDING, 1, spec_max_sampled_tokens=CAP + 10)
    assert ctl.max_sampled_tokens == CAP


def test_a_token_after_a_held_finish_is_dropped():
    req = _Req("r", [1, 2, 3], SpecState(room=7, finish_pending=True))
    called = []
    # SGLang appended the token of the step launched before the finish was held (4).
    req.output_ids.append(4)
    update_finish_state_around(lambda *args: called.append(args), req, 1)
    assert req.output_ids == [1, 2, 3] and called == []


def test_a_request_sglang_is_aborting_stays_in_the_batch():
    # SGLang's abort_request marks a running request (`to_finish`); the step in flight ends it.
    req, sched, ctl, verified = _setup(ResidualState.APPLIED, 3)
    req.to_finish = "abort"
    ctl.step(sched)
    assert verified == [] and ctl.parked == [] and sched.running_batch.reqs == [req]


def _penalized_request(presence_penalty: float, reasoning_state: tuple[str, ...]):
    sp = SimpleNamespace(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, frequency_penalty=0.0,
                         presence_penalty=presence_penalty, repetition_penalty=1.0,
                         logit_bias=None, min_new_tokens=0, custom_params=None)
    return SimpleNamespace(bootstrap_room=7, sampling_params=sp, return_logprob=False,
                           grammar=None, return_hidden_states=False,
                           custom_logit_processor=None,
                           **dict.fromkeys(reasoning_state))


def test_a_penalized_request_speculates_under_either_scheduler_and_says_which(standin_release):
    """Under overlap SGLang feeds each output token to the penalizers one step late; the request
    speculates and its state says so, for verification to rebuild that order
    (test_spec_penalties.py checks the rows and the resumed state)."""
    ctl = SpecController(_Transfers(ResidualState.PENDING), LynxConfig.build(),
                         Recorder.for_process())
    for overlap, penalty in ((True, 0.5), (False, 0.5), (True, 0.0)):
        req = _penalized_request(penalty, standin_release.reasoning_state)
        ctl.on_commit(req, overlap=overlap)
        st = req.lynx_spec
        assert (st.no_spec_reason, st.overlap, st.logit_transforms) == (
            None, overlap, bool(penalty)), (overlap, penalty)
