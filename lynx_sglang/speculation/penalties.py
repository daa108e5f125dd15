"""Penalties, logit bias and min_new_tokens under speculation: the logits SGLang's sampler really
draws from (or takes the argmax of) at each speculative position, and the penalty state a request
resumes with after verification.

SGLang (0.5.23) transforms a request's logits before sampling with its batch's `SamplingBatchInfo`
(`apply_logits_bias`): additive penalties (frequency, presence, and min_new_tokens' -inf on stop
tokens while the output is shorter), then the repetition penalty's scaling, then the logit bias.
The penalty state is per batch (`BatchedPenalizerOrchestrator`): a new batch starts it empty, and
each decode step first feeds the request's last output token (`ScheduleBatch.
cumulate_penalty_output_tokens`, from `prepare_for_decode`). Without the overlap schedule the step
predicting output token k has seen output tokens 0..k-1. With it (SGLang's default) the decode
prepares step k before it has processed step k-1's result, so that step feeds what was last then:
t0 at steps 1 and 2, then t_{k-2}; the step predicting t_k has seen [t0, t0, t1, ..., t_{k-2}]
(`penalty_feed`: k tokens either way, which is also min_new_tokens' count). A request stays in the
running batch at every step from its prebuilt batch on, so the pattern holds for one that waited
for its Residual; verification reproduces it for the exact rows and for the state it resumes with.

- `exact_rows` (called by `verify.sampler_rows`): verification logits row i predicts output token
  start+i; it is transformed with a one-request `SamplingBatchInfo` whose orchestrator has seen
  output tokens 0..start+i-1 (and, for a grammar request, the mask of its matcher at that
  position), with SGLang's own classes, so p is what exact decoding samples from.
- `draft_row` (called by `controller.SpecController.record_draft_logits`, from the sampler hook):
  the draft step's own transformation of one batch row, from the forward's `SamplingBatchInfo`,
  so q is what the draft was really drawn from, whatever penalty state that step had.
- `resume_batches` (called by `controller.SpecController._verify_and_resume`): the batches a
  verified request rejoins the running batch with. SGLang would start their penalty state empty;
  each request with output tokens is put in its own batch whose orchestrator is fed `penalty_feed`
  but its last token, which the next decode step feeds, so its state is what it would be had no
  rolled-back token ever been generated. Under overlap that step is not lagging (nothing of the
  request is in flight), so it would feed t_{m-1} where a request that never paused feeds t_{m-2}:
  `RESUME_FEED_ATTR` tells `cumulate_penalty_output_tokens_around` (a hook) to feed t_{m-2} once.
"""

from __future__ import annotations

import dataclasses

import torch

from ..upstream import scheduler_api


def has_logit_transforms(sp) -> bool:
    """Whether SGLang's sampler changes this request's logits beyond temperature and filtering."""
    return bool(sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0
                or sp.logit_bias or sp.min_new_tokens)


class _OneRequest:
    """The part of a ScheduleBatch SGLang's SamplingBatchInfo and penalizers read (a class:
    the orchestrator keeps a weak reference to its batch)."""

    def __init__(self, req, device):
        self.reqs = [req]
        self.device = device


def penalty_feed(output_ids: list[int], overlap: bool) -> list[int]:
    """The tokens SGLang's decode steps feed the penalizers, in order: entry k-1 is fed by the
    step that predicts output_ids[k] (so the state predicting output k has seen the first k)."""
    if overlap and output_ids:
        return [output_ids[0], *output_ids[:-1]]
    return list(output_ids)


# Set on a Req resumed under the overlap schedule: the token its next penalty feed must be.
RESUME_FEED_ATTR = "lynx_resume_penalty_feed"


def exact_rows(req, logits: torch.Tensor, start: int, overlap: bool = False) -> torch.Tensor:
    """Rows [n, vocab] predicting req.output_ids[start], [start+1], ... -> the same rows as SGLang's
    sampler sees them after penalties, min_new_tokens, a grammar's mask and logit bias, each with
    the penalty state SGLang's decode has when it predicts that position (`penalty_feed`; without
    overlap output_ids[:start+i]; a row past output_ids, the bonus row, has seen all of them).
    A grammar must stand at output_ids[:start] (`grammar.rewind`): it is fed each
    token past `start` after its row's mask is taken, and ends where it stood before the rewind."""
    batch = _OneRequest(req, logits.device)
    info = scheduler_api.sampling_info(batch, logits.shape[1])
    grammar = req.grammar
    if grammar is not None:
        info.grammars = [grammar]  # SGLang sets this per forward (ForwardBatch.init_new)
    orchestrator = info.penalizer_orchestrator
    feed = penalty_feed(req.output_ids, overlap)
    out = logits.clone()
    for k in range(start + logits.shape[0]):
        i = k - start
        if i >= 0:
            if grammar is not None:
                info.update_regex_vocab_mask()
            info.copy_for_forward().apply_logits_bias(out[i: i + 1])
        if k < len(feed) and orchestrator.is_required:
            orchestrator.cumulate_output_tokens(
                torch.tensor([feed[k]], dtype=torch.int64, device=logits.device))
        if grammar is not None and start <= k < len(req.output_ids):
            grammar.accept_token(req.output_ids[k])  # a terminated matcher ignores it
    return out


def draft_row(sampling_info, logits: torch.Tensor, row: int) -> torch.Tensor:
    """Batch row `row` of a decode step's logits as that step's sampler transformed it:
    `sampling_info` is the forward's copy (SGLang's `copy_for_forward`: penalties accumulated,
    no orchestrator). SGLang fills the grammar mask inside `ModelRunner.sample`, after the hook
    that calls this: the row's mask is taken here from its grammar, which stands where that mask
    will (a grammar batch is not overlapped: SGLang processes the previous step first)."""
    def one(t):
        return None if t is None else t[row: row + 1]

    grammar = sampling_info.grammars[row] if sampling_info.grammars else None
    info = dataclasses.replace(
        sampling_info, acc_additive_penalties=one(sampling_info.acc_additive_penalties),
        acc_scaling_penalties=one(sampling_info.acc_scaling_penalties),
        logit_bias=one(sampling_info.logit_bias), penalizer_orchestrator=None, grammar_mask=None,
        temperatures=one(sampling_info.temperatures),
        grammars=[grammar] if grammar is not None else None)
    if grammar is not None:
        info.update_regex_vocab_mask()
    out = logits[row: row + 1].clone()
    info.apply_logits_bias(out)
    return out[0]


def seed_penalties(batch, req, overlap: bool = False) -> None:
    """Feed a fresh one-request batch's penalizers `penalty_feed` but its last token: the next
    decode step (`prepare_for_decode`) feeds that one (under overlap through
    `RESUME_FEED_ATTR`, since it would feed req.output_ids[-1])."""
    orchestrator = batch.sampling_info.penalizer_orchestrator
    if not orchestrator.is_required:
        return
    feed = penalty_feed(req.output_ids, overlap)
    for token in feed[:-1]:
        orchestrator.cumulate_output_tokens(
            torch.tensor([token], dtype=torch.int64, device=batch.device))
    if overlap:
        setattr(req, RESUME_FEED_ATTR, feed[-1])


def cumulate_penalty_output_tokens_around(original, batch):
    """`ScheduleBatch.cumulate_penalty_output_tokens`: a request `seed_penalties` resumed under
    the overlap schedule feeds the token its uninterrupted decoding would feed, once; every
    other step is SGLang's (the same list of last tokens it builds otherwise)."""
    feeds = [getattr(req, RESUME_FEED_ATTR, None) for req in batch.reqs]
    if all(f is None for f in feeds):
        return original(batch)
    last = []
    for req, feed in zip(batch.reqs, feeds, strict=True):
        if feed is not None:
            delattr(req, RESUME_FEED_ATTR)
            last.append(feed)
        else:
            last.append(req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1])
    batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(
        torch.tensor(last, dtype=torch.int64, device=batch.device))
    return None


def resume_batches(scheduler, reqs: list, overlap: bool = False) -> list:
    """Decode batches for verified requests rejoining the running batch (SGLang's
    `_build_hisparse_decode_batch`): requests with penalties and more than one output token go
    one per batch, their penalty state fed by `seed_penalties`; the others together."""
    def seeded(req) -> bool:
        return has_logit_transforms(req.sampling_params) and len(req.output_ids) > 1

    plain = [r for r in reqs if not seeded(r)]
    groups = ([plain] if plain else []) + [[r] for r in reqs if seeded(r)]
    batches = []
    for group in groups:
        batch = scheduler_api.decode_batch(scheduler, group)
        # A decode batch carries one entry per request here (SGLang's prebuilt batches do);
        # left None, merging it into a running batch that has the list crashed the scheduler.
        batch.multimodal_inputs = [r.multimodal_inputs for r in group]
        if seeded(group[0]):
            seed_penalties(batch, group[0], overlap)
        batches.append(batch)
    return batches
