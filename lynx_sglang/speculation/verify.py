"""The verification forward and what follows it: one EXTEND forward over a batch of requests'
speculative positions on exact (refined) prompt KV (`verify_forward`), the acceptance decision
per request (`sampler_rows`, then `decide` with the rules of `speculation.acceptance`), the edit
of its output
(`apply_acceptance`), the freeing of rejected positions' KV (`rollback`) and SGLang's reasoning
counters recounted over the verified tokens (`recount_reasoning`).

Called by `speculation.controller.SpecController` on the decode scheduler thread. Every SGLang
internal used here is listed in patches/README.md.
"""

from __future__ import annotations

import logging

import torch

from ..backend.pages import page_ceil
from ..upstream import adapter as upstream_adapter
from ..upstream import scheduler_api
from ..upstream.sampling_filter import filter_probs
from .acceptance import Acceptance, accept_greedy, accept_sampled
from .grammar import rewind
from .penalties import exact_rows, has_logit_transforms
from .state import SpecState, VerifyResult

logger = logging.getLogger(__name__)

def extend_attention_as_decode(original, backend, query, output, k_cache, v_cache, req_to_token,
                               req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                               encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                               is_cross_attn=False, sliding_window_size=None):
    """SGLang's CPU (torch-native) extend attention pads every request's queries to its whole
    sequence and runs causal attention over all of it: for a verification of n positions on a
    prompt of P tokens that is O((P+n)^2) per layer, a prefill's worth of attention (measured: ten
    decode steps for 2 positions on 1.5k tokens). During a verification forward the n speculative
    positions attend to their prefixes in one masked SDPA call per request and layer, O(n * P),
    each position seeing exactly the keys its decode step saw. Called during a verification
    forward only (`speculation.hooks.extend_attention_around`); an extend this does not cover
    (cross attention, a sliding window, ...) goes to SGLang's own code."""
    if (encoder_lens is not None or is_cross_attn or not causal
            or (sliding_window_size is not None and sliding_window_size > -1)):
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                        seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens,
                        scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    from torch.nn.functional import scaled_dot_product_attention

    q = query.movedim(0, query.dim() - 2)  # [heads, tokens, head_dim]
    start = 0
    for i in range(seq_lens.shape[0]):
        n, p = int(extend_seq_lens[i]), int(extend_prefix_lens[i])
        slots = req_to_token[req_pool_indices[i], : p + n]
        keys = k_cache[slots].movedim(0, q.dim() - 2)
        values = v_cache[slots].movedim(0, q.dim() - 2)
        if not q.dtype == keys.dtype == values.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        # Position j (0-based among the n) sees keys [0, p + j]: SDPA's is_causal aligns the
        # mask top-left, which is wrong when there are more keys than queries.
        visible = (torch.arange(p + n, device=q.device)[None, :]
                   <= torch.arange(p, p + n, device=q.device)[:, None])
        out = scaled_dot_product_attention(
            q[:, start: start + n].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=visible, enable_gqa=enable_gqa, scale=scaling)
        output[start: start + n] = out.squeeze(0).movedim(q.dim() - 2, 0)
        start += n
    return output


def verify_forward(scheduler, reqs: list, bonus: list[bool]) -> list[torch.Tensor]:
    """One EXTEND forward over every request's speculative positions on top of its (refined)
    prompt KV; returns, per request, the logits [n, vocab] predicting output_ids[1..n], plus a
    last row predicting the token after tn where `bonus` asks for it and a KV slot was free.

    Request i has prompt length P and output_ids [t0 .. tn]; KV slots for t0..t(n-1) exist at
    positions P..P+n-1 (written during speculation). The extend feeds t0..t(n-1) at those
    positions into the same slots, so their KV is rewritten at full precision. With the bonus it
    also feeds tn at position P+n, in a newly allocated slot: the decode step that would follow
    the verification, done in the same forward (the slot is freed by `rollback` if a draft is
    rejected, like every position past the kept prefix).
    """
    req_to_token = scheduler.req_to_token_pool.req_to_token
    for req in reqs:
        n = len(req.output_ids) - 1
        if req.kv.kv_committed_len != len(req.origin_input_ids) + n:
            raise RuntimeError(f"lynx verify: request {req.rid} holds KV for "
                               f"{req.kv.kv_committed_len} positions, expected "
                               f"{len(req.origin_input_ids) + n}")
    bonus = _bonus_slots(scheduler, reqs, bonus)
    tokens, locs, prefix_lens, extend_lens, seq_lens = [], [], [], [], []
    for req, extra in zip(reqs, bonus, strict=True):
        p = len(req.origin_input_ids)
        n = len(req.output_ids) - 1 + extra
        tokens.extend(req.output_ids[:n])
        locs.append(req_to_token[req.kv.req_pool_idx, p: p + n].to(torch.int64))
        prefix_lens.append(p)
        extend_lens.append(n)
        seq_lens.append(p + n)
    logits = scheduler_api.extend_forward(
        scheduler, reqs, scheduler_api.ExtendRows(tokens, locs, prefix_lens, extend_lens, seq_lens))
    return list(torch.split(logits, extend_lens))


def _bonus_slots(scheduler, reqs: list, wanted: list[bool]) -> list[int]:
    """Allocate the KV slot at position P+n of each request that wants a bonus token; 1 where
    one was allocated. Without free slots for all of them, none gets one (the verification is
    then the plain one; nothing is evicted for it). With pages (`--page-size` > 1) a position
    inside the request's last page takes the page's next slot, as SGLang's `alloc_decode` does;
    one at a page boundary takes the first slot of a new page."""
    # A request holding slots past its committed KV gets no bonus: position P+n must be the next
    # one allocated. None does here: SGLang's decode commits each slot as it allocates it, and
    # under its overlap schedule a request is verified only once no step of it is in flight
    # (`controller.IN_FLIGHT_PARK_REASON`).
    wanted = [w and r.kv.kv_allocated_len == r.kv.kv_committed_len
              for r, w in zip(reqs, wanted, strict=True)]
    want = [r for r, w in zip(reqs, wanted, strict=True) if w]
    if not want:
        return [0] * len(reqs)
    allocator = scheduler.token_to_kv_pool_allocator
    page = allocator.page_size
    req_to_token = scheduler.req_to_token_pool.req_to_token
    new_page = [r for r in want if r.kv.kv_allocated_len % page == 0]
    pages = allocator.alloc(len(new_page) * page) if new_page else None
    if new_page and pages is None:
        return [0] * len(reqs)
    firsts = iter(pages[::page].tolist() if new_page else ())
    for req in want:
        pos = req.kv.kv_allocated_len
        slot = (next(firsts) if pos % page == 0
                else int(req_to_token[req.kv.req_pool_idx, pos - 1]) + 1)
        req_to_token[req.kv.req_pool_idx, pos] = slot
        req.kv.kv_allocated_len += 1
    return [int(w) for w in wanted]


def sampler_rows(req, st: SpecState, exact_logits: torch.Tensor) -> torch.Tensor:
    """The verification's logits as SGLang's sampler would see them at each position: with
    penalties, logit bias, min_new_tokens or a grammar transformed as at that position
    (`speculation.penalties`, with the grammar's matcher rewound to the verified prefix and
    stepped through the drafts again: `speculation.grammar`; the draft rows were recorded so),
    else unchanged. Taken while output_ids still holds every draft; row i then depends only on
    output_ids[:verified_len + i], so the rows stay valid for the tokens `apply_acceptance`
    keeps or adds."""
    if req.grammar is not None:
        if st.grammar_base is None:
            raise RuntimeError(f"lynx verify: request {req.rid} has a grammar but no record of "
                               "where its speculation began")
        rewind(req, st.grammar_base)
    elif not has_logit_transforms(req.sampling_params):
        return exact_logits
    return exact_rows(req, exact_logits, st.verified_len, st.overlap)


def decide(req, st: SpecState, exact_logits: torch.Tensor) -> Acceptance:
    """Greedy: compare argmaxes. Sampled: speculative sampling with the exact distribution p and
    the one each draft token was drawn from, q: both at the request's temperature and filtered
    by its top-k/top-p/min-p as SGLang's sampler filters them (`upstream.sampling_filter`).
    `exact_logits`: the verification's rows as the sampler sees them (`sampler_rows`)."""
    drafts = list(req.output_ids[st.verified_len:])
    if not st.sampled:
        return accept_greedy(exact_logits, drafts)
    sp = req.sampling_params
    p = _sampler_probs(exact_logits, sp)
    generator = None
    seed = sp.sampling_seed
    if seed is not None:
        generator = torch.Generator().manual_seed(hash((seed, st.room)) & 0x7FFF_FFFF_FFFF_FFFF)
    if len(st.draft_logits) != len(drafts):
        # The draft distributions are incomplete: keep no draft, draw the first token from p,
        # which is what exact decoding does.
        logger.warning("lynx spec: %s has %d draft distributions for %d speculative tokens; "
                       "resampling from the first", req.rid, len(st.draft_logits), len(drafts))
        y = int(torch.multinomial(p[0].float(), 1, generator=generator))
        return Acceptance(0, y)
    q = _sampler_probs(torch.stack(st.draft_logits), sp)
    return accept_sampled(p, q, drafts, generator)


def _sampler_probs(logits: torch.Tensor, sp) -> torch.Tensor:
    """The rows SGLang's sampler draws from for these logits: divided by a float32 temperature
    tensor as `Sampler.forward` divides them (the same rounding, so a filter keeps the tokens
    the sampler kept), its softmax, then top-k/top-p/min-p."""
    temperature = torch.tensor(sp.temperature, dtype=torch.float32, device=logits.device)
    probs = scheduler_api.sampler_softmax(logits.float() / temperature)
    return filter_probs(probs, sp.top_k, sp.top_p, sp.min_p)


def apply_acceptance(req, st: SpecState, acc: Acceptance) -> VerifyResult:
    """Edit output_ids in place: keep the accepted drafts, then the exact next token if any (a
    correction, or the bonus when every draft was kept)."""
    n = len(req.output_ids) - st.verified_len
    if acc.next_token is None:
        return VerifyResult(n, acc.accepted, None)
    del req.output_ids[st.verified_len + acc.accepted:]
    req.output_ids.append(acc.next_token)
    if acc.accepted < n:
        return VerifyResult(n, acc.accepted, acc.next_token)
    return VerifyResult(n, acc.accepted, None, bonus_token=acc.next_token)


def rollback(scheduler, req, verified_len: int, result: VerifyResult) -> None:
    """Free the KV slots of the rejected positions. After `apply_acceptance`, output_ids ends in
    the token the next decode step feeds (`free_kv_past_output`)."""
    free_kv_past_output(scheduler, req)


def free_kv_past_output(scheduler, req) -> None:
    """Keep KV for prompt + output_ids[:-1], what the next decode step (or a verification)
    needs, and free the request's slots past it. With pages only whole pages past the kept
    positions go back: the rest of the last kept page stays the request's, and SGLang's next
    `alloc_decode` writes into it (it takes the slot after the last kept one)."""
    keep = len(req.origin_input_ids) + len(req.output_ids) - 1
    held = req.kv.kv_allocated_len
    free_from = page_ceil(keep, scheduler.token_to_kv_pool_allocator.page_size)
    if held > free_from:
        scheduler.tree_cache.free_kv_row(req.kv, [(free_from, held)])
    if held > keep:
        req.kv.kv_allocated_len = keep
    req.kv.kv_committed_len = keep



def recount_reasoning(scheduler, req, st: SpecState) -> None:
    """SGLang counted reasoning tokens over the speculative tokens as they were generated,
    rejected ones included: restore the counters of commit time and count the verified tokens."""
    for name, value in zip(upstream_adapter.scheduler().reasoning_state, st.reasoning, strict=True):
        setattr(req, name, value)
    if len(req.output_ids) > st.verified_len:
        scheduler_api.count_reasoning_tokens(scheduler, req, list(req.output_ids[st.verified_len:]))
