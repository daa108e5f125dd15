"""The speculation controller of one decode scheduler: park, verify, roll back, abort.

The decode applier (`backend.decode.applier`, speculative mode) reports a room Success as soon as its
Anchor and aux data (the exact first token from prefill) are in the decode KV pool, so SGLang
commits the request and decodes it like any other, reading Anchor-precision prompt KV.
`SpecController` owns what happens to such a request until its Residual has refined the pool:

- `SpecState` (`speculation.state`) rides on the request (`req.lynx_spec`) from the commit until
  verification.
- Speculative tokens are provisional: the output streamer only ever sees the verified prefix, and
  a speculative EOS / stop string / length finish is held back and parks the request instead (the
  hooks in `speculation.hooks`).
- A request is parked (taken out of the running batch, its KV kept) when it must not or need not
  speculate further: not speculable (a custom logit processor, ...: it waits
  for the Residual with no speculative token at all), a held-back finish, the token cap, or the
  deadline. Parking tells the applier (`Transfers.waiting`), which tells the prefill that the
  request now waits on its Residual.
- When the applier says the Residual is applied, one forward verifies every speculative position
  (`speculation.verify`), the output logprobs of a request that asked for them become the exact
  ones (`upstream.logprob_layout`), a grammar's matcher is rolled back to the verified output
  (`speculation.grammar`); then the request either finishes or rejoins the running batch.
- A Residual that fails aborts the request; a request released early (client abort, a first token
  that already finishes it) cancels its transfer before its slots can be reused (`on_release`).
- Under SGLang's overlap schedule, `step` runs while the last decode step is in flight (launched,
  its result not processed): that step's token counts towards the cap, a request in it is
  verified only at the next step (`IN_FLIGHT_PARK_REASON`), and its token after a held finish is
  dropped (`hooks.update_finish_state_around`).

Built by the decode KV manager when it gets its pool (`LynxKVManager.attach_kv_pool`, held in the
process's `runtime.LynxRuntime`), with the applier's `Transfers` interface, the config and the
spec-stream publisher. Single scheduler thread: no
locking here (the applier's calls are thread-safe).
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import Protocol

from ..backend.decode.outcome import ResidualOutcome, ResidualState
from ..config import LynxConfig
from ..names import FAULT_VERIFY_HOLD_LOG, SPEC_PARKED_LOG
from ..recorder import Recorder
from ..upstream import adapter as upstream_adapter
from ..upstream import scheduler_api
from ..upstream.logprob_layout import replace_speculative_logprobs, truncate_logprobs
from .grammar import resync, rollback_cap
from .penalties import draft_row, has_logit_transforms, resume_batches
from .record import log_verification
from .state import SpecCounters, SpecState, VerifyResult, is_greedy, not_speculable_reason
from .stream import SpecStreamPublisher
from .verify import (
    apply_acceptance,
    decide,
    free_kv_past_output,
    recount_reasoning,
    rollback,
    sampler_rows,
    verify_forward,
)

logger = logging.getLogger(__name__)


class Transfers(Protocol):
    """What the controller asks the decode applier (`backend.decode.applier.DecodeApplier`)."""

    def residual_outcome(self, room: int) -> ResidualOutcome | None: ...

    def forget(self, room: int) -> None: ...

    def cancel(self, room: int) -> bool: ...

    def note_verification(self, seconds: float) -> None: ...

    def waiting(self, room: int) -> None: ...


# Why a request whose Residual is applied waits one more step (`SpecController.step`).
IN_FLIGHT_PARK_REASON = "Residual applied during an in-flight decode step (overlap schedule)"


def _in_flight(scheduler) -> set[int]:
    """ids of the requests in a batch that SGLang's overlap schedule ran and whose results it has
    not processed yet (`Scheduler.result_queue`; empty without the overlap schedule)."""
    return {id(req) for batch, _ in getattr(scheduler, "result_queue", ()) for req in batch.reqs}


class SpecController:
    """Per-decode-scheduler controller. `step` runs at the top of every scheduler iteration."""

    def __init__(self, transfers: Transfers, config: LynxConfig, recorder: Recorder,
                 publisher: SpecStreamPublisher | None = None, fault_verify_delay_s: float = 0.0):
        self.transfers = transfers
        self.recorder = recorder  # the process's: `spec` records and the speculation metrics
        self.max_tokens = config.spec_max_tokens
        # A sampled request keeps a vocabulary-wide row per speculative token: a tighter cap.
        self.max_sampled_tokens = min(config.spec_max_sampled_tokens, config.spec_max_tokens)
        self.deadline_s = config.spec_deadline_s
        self.parked: list = []
        self.counters = SpecCounters()
        self.publisher = publisher
        # Speculating sampled requests by their req_to_token row, for the sampler hook (which
        # sees batch rows, not requests).
        self.sampled_by_pool_idx: dict[int, SpecState] = {}
        # True while a verification forward runs: the attention hook then attends as decode steps
        # did (`speculation.hooks.extend_attention_around`).
        self.verifying = False
        self._fault_verify_delay_s = fault_verify_delay_s

    def tracked(self) -> dict[str, int]:
        """Requests speculation still holds (0 on an idle decode; `lynx_tracked_requests`)."""
        return {"spec_parked": len(self.parked),
                "spec_sampled_rows": len(self.sampled_by_pool_idx),
                "spec_stream_topics": self.publisher.open_topics() if self.publisher else 0}

    # ---- hook entry points ------------------------------------------------------------------
    def on_commit(self, req, overlap: bool = False) -> None:
        """SGLang committed a transferred request (first token appended); `overlap`: the decode
        runs SGLang's overlap scheduler."""
        room = req.bootstrap_room
        if room is None or self.transfers.residual_outcome(room) is None:
            return  # not reported at Anchor time: its KV is already exact
        reason = not_speculable_reason(req)
        sampled = not is_greedy(req)
        if reason is None and self._cap_of(sampled) == 0:
            reason = ("--lynx-spec-max-sampled-tokens 0" if sampled and self.max_tokens
                      else "--lynx-spec-max-tokens 0")
        st = SpecState(room=room, no_spec_reason=reason, sampled=sampled, overlap=overlap,
                       logit_transforms=(has_logit_transforms(req.sampling_params)
                                         or req.grammar is not None),
                       reasoning=tuple(getattr(req, a)
                                       for a in upstream_adapter.scheduler().reasoning_state))
        req.lynx_spec = st
        if st.sampled and reason is None:
            self.sampled_by_pool_idx[req.kv.req_pool_idx] = st

    def on_prebuilt(self, batch) -> None:
        """After the prebuilt batch's first tokens went out: park the requests that must not
        take a single speculative step, before SGLang merges the batch into the running one."""
        keep = []
        for i, req in enumerate(batch.reqs):
            st = getattr(req, "lynx_spec", None)
            if st is not None and st.no_spec_reason is not None and not req.finished():
                self._park(req, st.no_spec_reason)
            else:
                keep.append(i)
                if st is not None and req.grammar is not None:
                    # The prebuilt batch has fed the grammar the first token: speculation
                    # starts here, and verification rewinds the matcher to this point.
                    st.grammar_base = len(req.grammar.accepted_tokens)
        if len(keep) != len(batch.reqs):
            batch.filter_batch(keep_indices=keep)

    def step(self, scheduler) -> None:
        running = scheduler.running_batch
        now = time.monotonic()
        # A request SGLang is aborting (`to_finish`: its next processed step finishes it and frees
        # its KV) stays in the batch: parked or verified here, under the overlap schedule the step
        # in flight would still finish it and free its KV under the controller.
        active = [(i, req) for i, req in enumerate(running.reqs)
                  if getattr(req, "lynx_spec", None) is not None and not req.finished()
                  and req.to_finish is None]
        candidates = [req for _, req in active] + self.parked
        if not candidates:
            return
        if self.publisher is not None:
            for req in candidates:
                self._publish_speculative(req, req.lynx_spec)
        outcomes = [self._outcome(req.lynx_spec) for req in candidates]
        in_flight = _in_flight(scheduler)
        park = [self._park_reason(req, req.lynx_spec, now, id(req) in in_flight)
                for _, req in active]
        failed, applied, parked = self._agree(
            scheduler, [int(state is ResidualState.FAILED) for state, _ in outcomes],
            [int(state is ResidualState.APPLIED) for state, _ in outcomes],
            [int(why is not None) for why in park])
        verify, abort, remove = [], [], set()
        for k, req in enumerate(candidates):
            in_batch = k < len(active)
            if failed[k]:
                abort.append((req, outcomes[k][1] or "failed on another TP rank"))
            elif applied[k] and in_batch and id(req) in in_flight:
                # SGLang's overlap schedule runs this step before it processes the results of
                # the decode step now in flight, which holds a KV slot and will append a token
                # to this request: verifying now would check a state that step then changes
                # (verify_forward refused it). Out of the running batch, the request joins no
                # further step; that one's result is processed in this iteration, and the next
                # step verifies the request parked.
                self._park(req, IN_FLIGHT_PARK_REASON)
            elif applied[k]:
                verify.append(req)
            elif in_batch and parked[k]:
                self._park(req, park[k] or "parked on another TP rank")
            else:
                continue
            if in_batch:
                remove.add(active[k][0])
            else:
                self.parked.remove(req)
        if remove:
            running.filter_batch(keep_indices=[i for i in range(len(running.reqs))
                                               if i not in remove])
        for req, reason in abort:
            self._abort(scheduler, req, reason)
        if verify:
            self._verify_and_resume(scheduler, verify)

    @staticmethod
    def _agree(scheduler, failed: list[int], applied: list[int], parked: list[int]):
        """Every TP rank must take the same decisions (they run the same batches): a request fails
        or parks if it does on any rank, and is verified only once its Residual is applied on
        every rank. Candidates are in the same order on every rank (replicated scheduler state)."""
        if getattr(scheduler, "tp_size", 1) <= 1:
            return failed, applied, parked
        import torch.distributed as dist

        all_reduce_flags = upstream_adapter.scheduler().all_reduce_flags
        group = scheduler.tp_cpu_group
        return (all_reduce_flags(failed, group, dist.ReduceOp.MAX),
                all_reduce_flags(applied, group, dist.ReduceOp.MIN),
                all_reduce_flags(parked, group, dist.ReduceOp.MAX))

    # ---- decisions ----------------------------------------------------------------------------
    def _outcome(self, st: SpecState) -> tuple[ResidualState, str]:
        out = self.transfers.residual_outcome(st.room)
        if out is None:
            return ResidualState.FAILED, "Residual transfer cancelled"
        return out.state, out.reason

    def _cap_of(self, sampled: bool) -> int:
        """Speculative tokens a request may take before it waits for its Residual."""
        return self.max_sampled_tokens if sampled else self.max_tokens

    def _park_reason(self, req, st: SpecState, now: float, in_flight: bool) -> str | None:
        if st.finish_pending:
            return "speculative finish (EOS, stop or length) held for verification"
        # Under the overlap schedule, a token of the step in flight is not in output_ids yet.
        cap = self._cap_of(st.sampled)
        if req.grammar is not None:
            cap = min(cap, rollback_cap())
        if len(req.output_ids) + in_flight - st.verified_len >= cap:
            return f"speculative token cap ({cap}) reached"
        if now - st.t_committed > self.deadline_s:
            return f"Residual later than --lynx-spec-deadline-s {self.deadline_s:g} s"
        return None

    def _publish_speculative(self, req, st: SpecState) -> None:
        if len(req.output_ids) > st.published_len:
            self.publisher.speculative(req.rid, req.output_ids, st.published_len)
            st.published_len = len(req.output_ids)

    def _park(self, req, reason: str) -> None:
        st = req.lynx_spec
        st.parked_reason = reason
        st.t_parked = time.monotonic()
        self.parked.append(req)
        # Its tokens wait on the Residual from now: the prefill's link order may send it before
        # newer requests' Anchors (lynx_transport.link_order, rule 6; nothing if already in).
        self.transfers.waiting(st.room)
        logger.info("lynx spec: %s %s %s", req.rid, SPEC_PARKED_LOG, reason)

    def _detach(self, req) -> SpecState:
        """The request stops speculating: drop its state here and the manager's room."""
        st = req.lynx_spec
        req.lynx_spec = None
        self.transfers.forget(st.room)
        self.sampled_by_pool_idx.pop(req.kv.req_pool_idx, None)
        return st

    # ---- abort --------------------------------------------------------------------------------
    def _abort(self, scheduler, req, reason: str) -> None:
        st = self._detach(req)
        logger.error("lynx spec: request %s (room %s) aborted: %s", req.rid, st.room, reason)
        self._finish_aborted(scheduler, req, st,
                             f"Lynx: the Residual KV of this request did not arrive: {reason}",
                             HTTPStatus.INTERNAL_SERVER_ERROR)

    def abort_parked(self, scheduler, recv_req) -> None:
        """SGLang's `abort_request` (client disconnect, /abort_request) only searches its own
        queues; a parked request lives here, so without this it would hold its KV until its
        verification. Same rid matching as SGLang's."""
        hit = [req for req in self.parked
               if recv_req.abort_all or req.rid.startswith(recv_req.rid)]
        for req in hit:
            self.parked.remove(req)
            # Stop the transfer before the slots are freed (a barrier, see cancel_residual).
            self.transfers.cancel(req.lynx_spec.room)
            st = self._detach(req)
            logger.info("lynx spec: parked request %s (room %s) aborted (abort_request)",
                        req.rid, st.room)
            self._finish_aborted(scheduler, req, st, "Aborted by AbortReq.", None)

    def _finish_aborted(self, scheduler, req, st: SpecState, message: str, status_code) -> None:
        self.recorder.metrics.record_verification(0, 0, "aborted")
        # Roll back to the verified prefix first: a partial answer must not contain a token
        # the exact KV never confirmed.
        del req.output_ids[st.verified_len:]
        if req.return_logprob:
            truncate_logprobs(req, st.verified_len)
        if self.publisher is not None:
            self.publisher.aborted(req.rid, req.output_ids, message)
        scheduler_api.prepare_abort(req, message, status_code)
        scheduler_api.release_kv_cache(req, scheduler.tree_cache, keep_in_cache=False)
        scheduler.output_streamer.stream_output([req], req.return_logprob)

    # ---- verification -------------------------------------------------------------------------
    def _verify_and_resume(self, scheduler, reqs: list) -> None:
        if scheduler.enable_overlap:
            # The forward of the step in flight may still run on the forward stream (on a GPU;
            # on CPU it has returned): the verification forward writes the same KV pool after it.
            scheduler.schedule_stream.wait_stream(scheduler.forward_stream)
        for req in reqs:
            # A step that overshot a held finish (overlap schedule) left its token dropped
            # (`hooks.update_finish_state_around`) and its KV slot and draft logits here.
            free_kv_past_output(scheduler, req)
            del req.lynx_spec.draft_logits[len(req.output_ids) - req.lynx_spec.verified_len:]
        to_check = [r for r in reqs if len(r.output_ids) > r.lynx_spec.verified_len]
        runner = scheduler.tp_worker.model_runner
        passes_before = runner.forward_pass_id
        t0, wall0 = time.monotonic(), time.time()
        # The forward also does the decode step that follows it (the bonus token), unless the
        # request's drafts end in a held-back finish or it has no room for another token.
        if to_check and self._fault_verify_delay_s:
            logger.warning("lynx: verifying %d request(s); %s %.1f s (test fault injection)",
                           len(to_check), FAULT_VERIFY_HOLD_LOG, self._fault_verify_delay_s)
            time.sleep(self._fault_verify_delay_s)
        bonus = [not r.lynx_spec.finish_pending
                 and len(r.output_ids) < r.sampling_params.max_new_tokens for r in to_check]
        logits = self._verify_forward(scheduler, to_check, bonus) if to_check else []
        verify_s = time.monotonic() - t0
        passes = runner.forward_pass_id - passes_before
        if to_check:
            self.transfers.note_verification(verify_s)
            self.counters.verify_forwards += 1
            self.counters.verify_model_passes += passes
            self.recorder.metrics.record_verify_time(verify_s)
        by_req = dict(zip((id(r) for r in to_check), logits, strict=True))
        resume = []
        for req in reqs:
            checked = id(req) in by_req
            st = self._detach(req)
            result = VerifyResult(0, 0, None)
            if checked:
                rows = sampler_rows(req, st, by_req[id(req)])
                result = apply_acceptance(req, st, decide(req, st, rows))
                if st.grammar_base is not None:
                    resync(req, st.grammar_base, st.verified_len)
                if req.return_logprob:
                    replace_speculative_logprobs(req, st.verified_len, rows, not st.sampled)
                rollback(scheduler, req, st.verified_len, result)
                recount_reasoning(scheduler, req, st)
            log_verification(self.recorder, self.counters, req, st, result,
                             verify_s if checked else 0.0, passes if checked else 0,
                             len(to_check), wall0 if checked else None)
            if len(req.output_ids) > st.verified_len:
                req.update_finish_state(len(req.output_ids) - st.verified_len)
            if req.grammar is not None:
                req.grammar.finished = req.finished()  # as SGLang's decode step sets it
            if self.publisher is not None:
                self.publisher.verified(req.rid, req.output_ids, st.verified_len,
                                        result.speculated, result.accepted,
                                        result.corrected_token is not None, req.finished())
            if req.finished():
                scheduler_api.release_kv_cache(req, scheduler.tree_cache, keep_in_cache=True)
                req.time_stats.set_completion_time()
            else:
                resume.append(req)
        scheduler.output_streamer.stream_output(reqs, any(r.return_logprob for r in reqs))
        for batch in resume_batches(scheduler, resume, overlap=scheduler.enable_overlap):
            if scheduler.running_batch.is_empty():
                scheduler.running_batch = batch
            else:
                scheduler.running_batch.merge_batch(batch)

    def _verify_forward(self, scheduler, reqs: list, bonus: list[bool]) -> list:
        self.verifying = True
        try:
            return verify_forward(scheduler, reqs, bonus)
        finally:
            self.verifying = False

    # ---- other hook entry points ---------------------------------------------------------------
    def on_release(self, req) -> None:
        """SGLang frees the request's KV slots: stop its Residual first (a barrier), and forget
        its draft logits (an aborted sampled request would otherwise leave them for the next
        request on the same row to grow)."""
        room = getattr(req, "bootstrap_room", None)
        if room is not None:
            self.transfers.cancel(room)
        st = getattr(req, "lynx_spec", None)
        kv = getattr(req, "kv", None)
        if kv is not None and st is not None and self.sampled_by_pool_idx.get(
                kv.req_pool_idx) is st:
            del self.sampled_by_pool_idx[kv.req_pool_idx]

    def record_draft_logits(self, pool_indices: list[int], logits, sampling_info=None) -> None:
        """The sampler is about to draw the next token of these batch rows: keep, for each
        speculating sampled request, the logits its draft token is drawn from (after its
        penalties, min_new_tokens and logit bias as the step's `sampling_info` applies them;
        only requests with such transforms need it)."""
        for row, pool_idx in enumerate(pool_indices):
            st = self.sampled_by_pool_idx.get(pool_idx)
            # A parked request takes no more speculative steps; one row per speculative token
            # at most, so a stale entry can never grow without bound.
            if st is not None and len(st.draft_logits) <= self.max_sampled_tokens:
                drawn = (draft_row(sampling_info, logits, row) if st.logit_transforms
                         else logits[row])
                st.draft_logits.append(drawn.detach().float().clone())
