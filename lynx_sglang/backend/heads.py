"""Which KV heads of a prefill rank one decode rank holds, when the two sides run different
attention TP sizes.

SGLang splits a layer's KV heads evenly over the attention TP ranks. A decode with more ranks
than the prefill holds fewer heads per rank: each decode rank takes one contiguous slice of
one prefill rank's heads (`head_range`; SGLang's Mooncake backend does the same with
`compute_head_slice_params`; the prefill ranks a decode rank asks are SGLang's
`_resolve_rank_mapping`'s). A Lynx prefill encodes only that slice for that decode (the codec's
groups never cross a head, so the bytes are what a prefill holding only those heads would send).
A decode with fewer ranks than the prefill holds several prefill ranks' heads per rank: each of
those prefill ranks sends all of its heads, and the decode rank puts each one's stream into its
own contiguous slice of its heads (`source_slices`, in the order SGLang lists the prefill ranks).

Refused with the reason: TP sizes of which neither divides the other, and replicated heads (fewer
KV heads than ranks on either side, or a count a TP size does not divide). An MLA pool has no
heads to slice (every rank holds the whole latent) and does not come here.

Called by `backend.prefill.link.destination_of` (prefill), `backend.conn.LynxKVReceiver.init`
and `backend.manager.LynxKVManager.register_rx_room` (decode).
"""

from __future__ import annotations

from ..errors import SettingsMismatchError


def check_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    """SettingsMismatchError unless Lynx can pair these attention TP sizes."""
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise SettingsMismatchError(
            f"lynx needs one of the prefill and decode attention TP sizes ({prefill_tp}, "
            f"{decode_tp}) to be a multiple of the other")


def _check_split(total_heads: int, tp: int, side: str) -> None:
    if total_heads < tp or total_heads % tp:
        raise SettingsMismatchError(
            f"lynx cannot split {total_heads} KV heads over {tp} {side} ranks (SGLang "
            f"replicates heads there); use a {side} TP size that divides the KV heads")


def source_slices(prefill_tp: int, decode_tp: int, decode_heads: int) -> list[tuple[int, int]]:
    """For a decode rank of a smaller attention TP size than the prefill's, holding
    `decode_heads` KV heads: (first local head, count) of the slice each prefill rank it reads
    from fills, in the order of those ranks (SGLang's `target_tp_ranks`: consecutive prefill
    ranks, each holding the next heads)."""
    check_tp_sizes(prefill_tp, decode_tp)
    if prefill_tp <= decode_tp:
        raise ValueError(f"one prefill rank per decode rank at TP {prefill_tp} -> {decode_tp}")
    sources = prefill_tp // decode_tp
    if decode_heads < sources or decode_heads % sources:
        raise SettingsMismatchError(
            f"lynx cannot split this decode rank's {decode_heads} KV heads over the {sources} "
            f"prefill ranks it reads from (prefill TP {prefill_tp}, decode TP {decode_tp}: SGLang "
            "replicates heads there); use TP sizes that divide the KV heads")
    per_prefill = decode_heads // sources
    return [(i * per_prefill, per_prefill) for i in range(sources)]


def head_range(prefill_tp: int, decode_tp: int, prefill_rank: int, decode_rank: int,
               total_heads: int) -> tuple[int, int] | None:
    """(first local head, count) of prefill rank `prefill_rank`'s KV heads that decode rank
    `decode_rank` holds; None when the decode's TP size is not larger (every head: at equal sizes
    the decode rank holds them all, at a smaller one it places them). SettingsMismatchError
    for what Lynx cannot pair (see the module docstring) or a decode rank that does not read
    from this prefill rank."""
    check_tp_sizes(prefill_tp, decode_tp)
    if prefill_tp >= decode_tp:
        return None  # every head of this rank: the decode rank places them (`source_slices`)
    _check_split(total_heads, decode_tp, "decode")
    per_decode = total_heads // decode_tp
    per_prefill = total_heads // prefill_tp
    first = (decode_rank % decode_tp) * per_decode
    if first // per_prefill != prefill_rank % prefill_tp:
        raise SettingsMismatchError(
            f"decode rank {decode_rank} holds KV heads {first}..{first + per_decode - 1}, which "
            f"prefill rank {prefill_rank} (of {prefill_tp}) does not hold")
    return first % per_prefill, per_decode
