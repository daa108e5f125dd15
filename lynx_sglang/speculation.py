"""Speculative decoding on the Anchor inside SGLang's PD decode scheduler: park, verify, roll back.

The Lynx KV manager (`conn.LynxKVManager`, speculative mode) reports a room Success as soon as its
Anchor and aux data (the exact first token from prefill) are in the decode KV pool, so SGLang
commits the request and decodes it like any other, reading Anchor-precision prompt KV. This module
owns what happens to such a request until its Residual has refined the pool:

- `SpecState` rides on the request (`req.lynx_spec`) from the commit until verification.
- Speculative tokens are provisional: the output streamer only ever sees the verified prefix
  (`accept_around`), and a speculative EOS / stop string / length finish is held back
  (`update_finish_state_around`) and parks the request instead.
- A request is parked (taken out of the running batch, its KV kept) when it must not or need not
  speculate further: not speculable (sampled, logprobs, grammar, penalties, ...: it waits for the
  Residual with no speculative token at all), a held-back finish, the token cap, or the deadline.
- When the manager says the Residual is applied, one forward (an EXTEND over the speculative
  positions [first token, spec tokens...) on top of the refined prompt KV, which also rewrites their
  KV at full precision) gives the exact next-token logits at every speculative position. Greedy:
  the longest agreeing prefix is kept, the first disagreeing token is replaced by the exact one,
  the KV slots of rejected positions are freed. Then the request either finishes (the finish check
  runs over the verified tokens) or rejoins the running batch as an ordinary request.
- A Residual that fails aborts the request; a request released early (client abort, a first token
  that already finishes it) cancels its transfer before its slots can be reused
  (`release_kv_cache_before`).

Called from the SGLang hooks registered by `lynx_sglang.plugin` in a decode scheduler process:
`Scheduler.process_decode_queue` (BEFORE: `step`), `process_batch_result_prebuilt` (AFTER: park
the non-speculable), `DecodeTransferQueue._commit_transfer_to_req` (AFTER: attach the state),
`Req.update_finish_state`, `_GenerationStreamAccumulator.accept`, `release_kv_cache`,
`Scheduler.is_fully_idle`, `Scheduler.abort_request` and `ModelRunner.sample` (the full list, with reasons, is
`plugin.SPEC_HOOKS` and patches/README.md). Single scheduler thread: no locking here (the
manager's outcome calls are thread-safe).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING

import torch

from . import metrics
from .acceptance import Acceptance, accept_greedy, accept_sampled
from .residual_state import ResidualState
from .spec_stream import SpecStreamPublisher

if TYPE_CHECKING:
    from .conn import LynxKVManager

logger = logging.getLogger(__name__)


@dataclass
class SpecState:
    """Speculation bookkeeping of one request (attribute `lynx_spec` of SGLang's Req)."""

    room: int
    t_committed: float = field(default_factory=time.monotonic)
    # Tokens of output_ids known exact: the first token comes from the prefill's exact forward.
    verified_len: int = 1
    # Tokens of output_ids already on the spec stream (--lynx-spec-stream-port).
    published_len: int = 1
    # Why this request does not speculate at all (None: it does).
    no_spec_reason: str | None = None
    finish_pending: bool = False
    parked_reason: str | None = None
    t_parked: float | None = None
    # Sampled requests: the logits each speculative token was drawn from (one row per token, in
    # order), captured before SGLang's sampler (`sample_before`).
    sampled: bool = False
    draft_logits: list = field(default_factory=list)
    # SGLang's reasoning-token counters of the request at commit (`REASONING_STATE`): speculative
    # tokens advance them, so verification recounts them over the verified tokens.
    reasoning: tuple = ()


@dataclass
class SpecCounters:
    """Totals since start-up, logged with every verification (`lynx spec` line)."""

    verifications: int = 0
    verify_forwards: int = 0
    # Model forward passes run while verifying (SGLang's ModelRunner.forward_pass_id): one per
    # verification batch, whatever the number of speculative tokens.
    verify_model_passes: int = 0
    speculated_tokens: int = 0
    accepted_tokens: int = 0
    rolled_back_tokens: int = 0


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one request's speculative tokens."""

    speculated: int
    accepted: int
    corrected_token: int | None


# Req attributes SGLang's reasoning-token accounting advances token by token (Req.
# update_reasoning_tokens); reasoning_tokens also decides how much `--strip-thinking-cache` strips.
REASONING_STATE = ("reasoning_tokens", "_is_reasoning_over", "_think_end_match_len",
                   "_think_start_match_len")


def is_greedy(req) -> bool:
    sp = req.sampling_params
    return sp.temperature == 0 or sp.top_k == 1


def not_speculable_reason(req) -> str | None:
    """Why a request must wait for its Residual instead of decoding on the Anchor (None if it
    may speculate). Verification reproduces greedy decoding and plain temperature sampling
    exactly; top-k/top-p/min-p truncation, logprobs, grammars and penalties would need more
    (truncated draft distributions, logprob rewriting, grammar rollback)."""
    sp = req.sampling_params
    if not is_greedy(req) and (sp.top_p < 1.0 or 1 < sp.top_k < (1 << 30) or sp.min_p > 0):
        return "sampled with top-k/top-p/min-p"
    if req.return_logprob:
        return "returns logprobs"
    if req.grammar is not None:
        return "grammar-constrained"
    if req.return_hidden_states:
        return "returns hidden states"
    if (sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0
            or sp.logit_bias or sp.min_new_tokens or getattr(sp, "custom_params", None)
            or req.custom_logit_processor):
        return "penalties, logit bias, min_new_tokens or a custom logit processor"
    return None


class SpecController:
    """Per-decode-scheduler controller. `step` runs at the top of every scheduler iteration."""

    def __init__(self, kv_mgr: LynxKVManager):
        self.kv_mgr = kv_mgr
        self.max_tokens = kv_mgr.lynx.spec_max_tokens
        self.deadline_s = kv_mgr.lynx.spec_deadline_s
        self.parked: list = []
        self.counters = SpecCounters()
        self.publisher = spec_stream_publisher(kv_mgr)

    # ---- hook entry points ------------------------------------------------------------------
    def on_commit(self, req) -> None:
        """SGLang committed a transferred request (first token appended)."""
        room = req.bootstrap_room
        if room is None or self.kv_mgr.residual_outcome(room) is None:
            return  # not reported at Anchor time: its KV is already exact
        reason = not_speculable_reason(req)
        if reason is None and self.max_tokens == 0:
            reason = "--lynx-spec-max-tokens 0"
        st = SpecState(room=room, no_spec_reason=reason, sampled=not is_greedy(req),
                       reasoning=tuple(getattr(req, a) for a in REASONING_STATE))
        req.lynx_spec = st
        if st.sampled and reason is None:
            _sampled_by_pool_idx[req.kv.req_pool_idx] = st

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
        if len(keep) != len(batch.reqs):
            batch.filter_batch(keep_indices=keep)

    def step(self, scheduler) -> None:
        running = scheduler.running_batch
        now = time.monotonic()
        active = [(i, req) for i, req in enumerate(running.reqs)
                  if getattr(req, "lynx_spec", None) is not None and not req.finished()]
        candidates = [req for _, req in active] + self.parked
        if not candidates:
            return
        if self.publisher is not None:
            for req in candidates:
                self._publish_speculative(req, req.lynx_spec)
        outcomes = [self._outcome(req.lynx_spec) for req in candidates]
        park = [self._park_reason(req, req.lynx_spec, now) for _, req in active]
        failed, applied, parked = self._agree(
            scheduler, [int(state is ResidualState.FAILED) for state, _ in outcomes],
            [int(state is ResidualState.APPLIED) for state, _ in outcomes],
            [int(why is not None) for why in park])
        verify, abort, remove = [], [], set()
        for k, req in enumerate(candidates):
            in_batch = k < len(active)
            if failed[k]:
                abort.append((req, outcomes[k][1] or "failed on another TP rank"))
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
        from sglang.srt.disaggregation.utils import all_reduce_flags

        group = scheduler.tp_cpu_group
        return (all_reduce_flags(failed, group, dist.ReduceOp.MAX),
                all_reduce_flags(applied, group, dist.ReduceOp.MIN),
                all_reduce_flags(parked, group, dist.ReduceOp.MAX))

    # ---- decisions ----------------------------------------------------------------------------
    def _outcome(self, st: SpecState) -> tuple[ResidualState, str]:
        out = self.kv_mgr.residual_outcome(st.room)
        if out is None:
            return ResidualState.FAILED, "Residual transfer cancelled"
        return out.state, out.reason

    def _park_reason(self, req, st: SpecState, now: float) -> str | None:
        if st.finish_pending:
            return "speculative finish (EOS, stop or length) held for verification"
        if len(req.output_ids) - st.verified_len >= self.max_tokens:
            return f"speculative token cap ({self.max_tokens}) reached"
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
        logger.info("lynx spec: %s parked: %s", req.rid, reason)

    def _detach(self, req) -> SpecState:
        """The request stops speculating: drop its state here and the manager's room."""
        st = req.lynx_spec
        req.lynx_spec = None
        self.kv_mgr.forget_room(st.room)
        _sampled_by_pool_idx.pop(req.kv.req_pool_idx, None)
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
            self.kv_mgr.cancel_residual(req.lynx_spec.room)
            st = self._detach(req)
            logger.info("lynx spec: parked request %s (room %s) aborted (abort_request)",
                        req.rid, st.room)
            self._finish_aborted(scheduler, req, st, "Aborted by AbortReq.", None)

    def _finish_aborted(self, scheduler, req, st: SpecState, message: str, status_code) -> None:
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.mem_cache.common import release_kv_cache

        metrics.record_verification(0, 0, "aborted")
        # Roll back to the verified prefix first: a partial answer must not contain a token
        # the exact KV never confirmed.
        del req.output_ids[st.verified_len:]
        if self.publisher is not None:
            self.publisher.aborted(req.rid, req.output_ids, message)
        prepare_abort(req, message, status_code=status_code)
        release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
        scheduler.output_streamer.stream_output([req], req.return_logprob)

    # ---- verification -------------------------------------------------------------------------
    def _verify_and_resume(self, scheduler, reqs: list) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        to_check = [r for r in reqs if len(r.output_ids) > r.lynx_spec.verified_len]
        runner = scheduler.tp_worker.model_runner
        passes_before = runner.forward_pass_id
        t0 = time.monotonic()
        logits = verify_forward(scheduler, to_check) if to_check else []
        verify_s = time.monotonic() - t0
        passes = runner.forward_pass_id - passes_before
        if to_check:
            self.counters.verify_forwards += 1
            self.counters.verify_model_passes += passes
            metrics.record_verify_time(verify_s)
        by_req = dict(zip((id(r) for r in to_check), logits, strict=True))
        resume = []
        for req in reqs:
            checked = id(req) in by_req
            st = self._detach(req)
            result = VerifyResult(0, 0, None)
            if checked:
                result = apply_acceptance(req, st, decide(req, st, by_req[id(req)]))
                rollback(scheduler, req, st.verified_len, result)
                recount_reasoning(scheduler, req, st)
            self._record(req, st, result, verify_s if checked else 0.0, passes if checked else 0,
                         len(to_check))
            if len(req.output_ids) > st.verified_len:
                req.update_finish_state(len(req.output_ids) - st.verified_len)
            if self.publisher is not None:
                self.publisher.verified(req.rid, req.output_ids, st.verified_len,
                                        result.speculated, result.accepted,
                                        result.corrected_token is not None, req.finished())
            if req.finished():
                release_kv_cache(req, scheduler.tree_cache, checkpoint=True)
                req.time_stats.set_completion_time()
            else:
                resume.append(req)
        scheduler.output_streamer.stream_output(reqs, any(r.return_logprob for r in reqs))
        if resume:
            batch = scheduler._build_hisparse_decode_batch(resume)
            if scheduler.running_batch.is_empty():
                scheduler.running_batch = batch
            else:
                scheduler.running_batch.merge_batch(batch)

    def _record(self, req, st: SpecState, result: VerifyResult, verify_s: float,
                model_passes: int, batch_size: int) -> None:
        c = self.counters
        c.verifications += 1
        c.speculated_tokens += result.speculated
        c.accepted_tokens += result.accepted
        c.rolled_back_tokens += result.speculated - result.accepted
        metrics.record_verification(result.speculated, result.accepted,
                                    "not_speculable" if st.no_spec_reason else "verified")
        now = time.monotonic()
        logger.info("lynx spec %s", json.dumps({
            "t": round(time.time(), 6), "rid": req.rid, "room": st.room, "speculated": result.speculated,
            "accepted": result.accepted, "rolled_back": result.speculated - result.accepted,
            "corrected": result.corrected_token is not None,
            "no_spec_reason": st.no_spec_reason, "parked_reason": st.parked_reason,
            "verify_ms": round(verify_s * 1e3, 3), "verify_model_passes": model_passes,
            "verify_batch": batch_size,
            "committed_to_verified_s": round(now - st.t_committed, 6),
            "parked_s": None if st.t_parked is None else round(now - st.t_parked, 6),
            "totals": {"verifications": c.verifications, "speculated": c.speculated_tokens,
                       "accepted": c.accepted_tokens, "rolled_back": c.rolled_back_tokens,
                       "verify_forwards": c.verify_forwards,
                       "verify_model_passes": c.verify_model_passes}}))


def verify_forward(scheduler, reqs: list) -> list[torch.Tensor]:
    """One EXTEND forward over every request's speculative positions on top of its (refined)
    prompt KV; returns, per request, the logits [n, vocab] predicting output_ids[1..n].

    Request i has prompt length P and output_ids [t0 .. tn]; KV slots for t0..t(n-1) exist at
    positions P..P+n-1 (written during speculation). The extend feeds t0..t(n-1) at those
    positions into the same slots, so their KV is rewritten at full precision.
    """
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    device = scheduler.req_to_token_pool.device
    req_to_token = scheduler.req_to_token_pool.req_to_token
    tokens, locs, prefix_lens, extend_lens, seq_lens = [], [], [], [], []
    for req in reqs:
        p = len(req.origin_input_ids)
        n = len(req.output_ids) - 1
        if req.kv.kv_committed_len != p + n:
            raise RuntimeError(f"lynx verify: request {req.rid} holds KV for "
                               f"{req.kv.kv_committed_len} positions, expected {p + n}")
        tokens.extend(req.output_ids[:n])
        locs.append(req_to_token[req.kv.req_pool_idx, p: p + n].to(torch.int64))
        prefix_lens.append(p)
        extend_lens.append(n)
        seq_lens.append(p + n)
    batch = ScheduleBatch.init_new(
        reqs=reqs, req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tree_cache=scheduler.tree_cache, model_config=scheduler.model_config,
        enable_overlap=False, spec_algorithm=scheduler.spec_algorithm,
    )
    batch.forward_mode = ForwardMode.EXTEND
    batch.return_logprob = False
    batch.input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
    pool_idx = [r.kv.req_pool_idx for r in reqs]
    batch.req_pool_indices = torch.tensor(pool_idx, dtype=torch.int64, device=device)
    batch.req_pool_indices_cpu = torch.tensor(pool_idx, dtype=torch.int64)
    batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    batch.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    batch.orig_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    batch.seq_lens_sum = sum(seq_lens)
    batch.out_cache_loc = torch.cat(locs)
    batch.prefix_lens = prefix_lens
    batch.extend_lens = extend_lens
    batch.extend_num_tokens = sum(extend_lens)
    batch.extend_logprob_start_lens = list(extend_lens)
    batch.multimodal_inputs = [None] * len(reqs)
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch,
                                                                scheduler.model_config.vocab_size)
    result = scheduler.tp_worker.forward_batch_generation(
        batch, is_verify=True, capture_hidden_mode=CaptureHiddenMode.FULL)
    hidden = result.logits_output.hidden_states
    model = scheduler.tp_worker.model_runner.model
    logits = model.logits_processor._get_logits(
        hidden, model.lm_head, LogitsMetadata(forward_mode=ForwardMode.DECODE),
        use_logits_buffer=False,
    )[:, : scheduler.model_config.vocab_size]
    return list(torch.split(logits, extend_lens))


def decide(req, st: SpecState, exact_logits: torch.Tensor) -> Acceptance:
    """Greedy: compare argmaxes. Sampled: speculative sampling with the exact distribution p and
    the one each draft token was drawn from, q (both at the request's temperature)."""
    drafts = list(req.output_ids[st.verified_len:])
    if not st.sampled:
        return accept_greedy(exact_logits, drafts)
    from sglang.kernels.ops.sampling import softmax as sampler_softmax

    temperature = req.sampling_params.temperature
    p = sampler_softmax(exact_logits.float() / temperature)
    generator = None
    seed = req.sampling_params.sampling_seed
    if seed is not None:
        generator = torch.Generator().manual_seed(hash((seed, st.room)) & 0x7FFF_FFFF_FFFF_FFFF)
    if len(st.draft_logits) != len(drafts):
        # The draft distributions are incomplete: keep no draft, draw the first token from p,
        # which is what exact decoding does.
        logger.warning("lynx spec: %s has %d draft distributions for %d speculative tokens; "
                       "resampling from the first", req.rid, len(st.draft_logits), len(drafts))
        y = int(torch.multinomial(p[0].float(), 1, generator=generator))
        return Acceptance(0, y)
    q = sampler_softmax(torch.stack(st.draft_logits).float() / temperature)
    return accept_sampled(p, q, drafts, generator)


def apply_acceptance(req, st: SpecState, acc: Acceptance) -> VerifyResult:
    """Edit output_ids in place: keep the accepted drafts, then the correction if any."""
    n = len(req.output_ids) - st.verified_len
    if acc.correction is None:
        return VerifyResult(n, acc.accepted, None)
    del req.output_ids[st.verified_len + acc.accepted:]
    req.output_ids.append(acc.correction)
    return VerifyResult(n, acc.accepted, acc.correction)


def rollback(scheduler, req, verified_len: int, result: VerifyResult) -> None:
    """Free the KV slots of the rejected positions. After `apply_acceptance`, output_ids ends in
    the token the next decode step feeds, so the request keeps KV for prompt + output_ids[:-1]."""
    keep = len(req.origin_input_ids) + len(req.output_ids) - 1
    held = req.kv.kv_allocated_len
    if held > keep:
        scheduler.tree_cache.free_kv_row(req.kv, [(keep, held)])
        req.kv.kv_allocated_len = keep
    req.kv.kv_committed_len = keep


def spec_stream_publisher(kv_mgr: LynxKVManager) -> SpecStreamPublisher | None:
    """The spec stream of this decode scheduler, if --lynx-spec-stream-port asks for one. TP
    ranks run the same batches, so only attention-TP rank 0 publishes; data-parallel ranks each
    publish on the port plus their DP rank."""
    port = kv_mgr.lynx.spec_stream_port
    if not port or getattr(kv_mgr, "attn_tp_rank", 0) != 0:
        return None
    return SpecStreamPublisher(kv_mgr.bootstrap_host,
                               port + (getattr(kv_mgr, "system_dp_rank", 0) or 0))


def recount_reasoning(scheduler, req, st: SpecState) -> None:
    """SGLang counted reasoning tokens over the speculative tokens as they were generated,
    rejected ones included: restore the counters of commit time and count the verified tokens."""
    for name, value in zip(REASONING_STATE, st.reasoning, strict=True):
        setattr(req, name, value)
    if len(req.output_ids) > st.verified_len:
        scheduler.batch_result_processor._maybe_update_reasoning_tokens(
            req, list(req.output_ids[st.verified_len:]))


# ---- hook functions (registered by lynx_sglang.plugin in decode scheduler processes) ----------

_controller: SpecController | None = None
# Speculating sampled requests by their req_to_token row, for `sample_before` (which sees batch
# rows, not requests).
_sampled_by_pool_idx: dict[int, SpecState] = {}


def controller() -> SpecController | None:
    """The process's controller, created once the decode Lynx KV manager exists (speculative)."""
    global _controller
    if _controller is None:
        from .conn import LynxKVManager

        mgr = LynxKVManager.decode_instance
        if mgr is not None and mgr.lynx.speculate:
            _controller = SpecController(mgr)
    return _controller


def process_decode_queue_before(scheduler):
    ctl = controller()
    if ctl is not None:
        ctl.step(scheduler)
        if ctl.parked and scheduler.running_batch.is_empty():
            time.sleep(0.001)  # waiting on Residuals only: leave the CPU to the applier thread


def is_fully_idle_around(original, scheduler, *args, **kwargs):
    # Parked requests hold KV outside SGLang's queues: the scheduler is not idle (its idle path
    # would report their slots as a leak, or sleep until the next request arrives).
    ctl = controller()
    if ctl is not None and ctl.parked and not kwargs.get("for_health_check", False):
        return False
    return original(scheduler, *args, **kwargs)


def abort_request_after(result, scheduler, recv_req):
    ctl = controller()
    if ctl is not None and ctl.parked:
        ctl.abort_parked(scheduler, recv_req)
    return result


def commit_transfer_after(result, queue, decode_req):
    ctl = controller()
    if ctl is not None and decode_req.req.finished_reason is None:
        ctl.on_commit(decode_req.req)
    return result


def process_batch_result_prebuilt_after(result, processor, batch):
    ctl = controller()
    if ctl is not None:
        ctl.on_prebuilt(batch)
    return result


def sample_before(runner, logits_output, forward_batch):
    """Record the logits each speculative token of a sampled request is drawn from, before the
    sampler turns them into probabilities in place."""
    if not _sampled_by_pool_idx or not forward_batch.forward_mode.is_decode():
        return None
    rows = forward_batch.req_pool_indices.tolist()
    for row, pool_idx in enumerate(rows):
        st = _sampled_by_pool_idx.get(pool_idx)
        if st is not None:
            st.draft_logits.append(logits_output.next_token_logits[row].detach().float().clone())
    return None


def update_finish_state_around(original, req, new_accepted_len: int = 1):
    st = getattr(req, "lynx_spec", None)
    if st is None or req.to_finish is not None or len(req.output_ids) <= st.verified_len:
        return original(req, new_accepted_len)
    original(req, new_accepted_len)
    if req.finished_reason is not None:
        # A finish decided on unverified tokens: hold it; verification decides for real.
        req.finished_reason = None
        req.finished_len = None
        st.finish_pending = True
    return None


def accept_around(original, accumulator, *, req):
    st = getattr(req, "lynx_spec", None)
    if st is None or len(req.output_ids) <= st.verified_len:
        return original(accumulator, req=req)
    full = req.output_ids
    req.output_ids = full[: st.verified_len]
    try:
        return original(accumulator, req=req)
    finally:
        req.output_ids = full


def release_kv_cache_before(req, tree_cache, *, checkpoint: bool):
    from .conn import LynxKVManager

    mgr = LynxKVManager.decode_instance
    room = getattr(req, "bootstrap_room", None)
    if mgr is not None and room is not None:
        mgr.cancel_residual(room)
