"""Which KV heads of this prefill rank one decode rank holds, when the two sides run different
attention TP sizes.

SGLang splits a layer's KV heads evenly over the attention TP ranks. A decode with more ranks
than the prefill holds fewer heads per rank: each decode rank takes one contiguous slice of
one prefill rank's heads (SGLang's Mooncake backend does the same with
`compute_head_slice_params`; the prefill ranks a decode rank asks are SGLang's
`_resolve_rank_mapping`'s). A Lynx prefill encodes only that slice for that decode (the codec's
groups never cross a head, so the bytes are what a prefill holding only those heads would send).

Not supported, refused with the reason: a decode with fewer ranks than the prefill (each decode
rank would take several prefill ranks' streams into one room) and replicated heads (fewer KV
heads than decode ranks, or a count the decode TP size does not divide). An MLA pool has no heads
to slice (every rank holds the whole latent) and does not come here.

Called by `backend.prefill_link.destination_of` (prefill) and
`backend.conn.LynxKVReceiver.init` (decode).
"""

from __future__ import annotations

from ..errors import SettingsMismatchError


def check_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    """SettingsMismatchError unless Lynx can pair these attention TP sizes."""
    if prefill_tp > decode_tp:
        raise SettingsMismatchError(
            f"lynx does not support a prefill attention TP size ({prefill_tp}) larger than the "
            f"decode attention TP size ({decode_tp}) yet: run the decode with as many ranks as "
            "the prefill or more")
    if decode_tp % prefill_tp:
        raise SettingsMismatchError(
            f"lynx needs the decode attention TP size ({decode_tp}) to be a multiple of the "
            f"prefill's ({prefill_tp})")


def head_range(prefill_tp: int, decode_tp: int, prefill_rank: int, decode_rank: int,
               total_heads: int) -> tuple[int, int] | None:
    """(first local head, count) of prefill rank `prefill_rank`'s KV heads that decode rank
    `decode_rank` holds; None when the TP sizes are equal (every head). SettingsMismatchError
    for what Lynx cannot pair (see the module docstring) or a decode rank that does not read
    from this prefill rank."""
    if prefill_tp == decode_tp:
        return None
    check_tp_sizes(prefill_tp, decode_tp)
    if total_heads < decode_tp or total_heads % decode_tp:
        raise SettingsMismatchError(
            f"lynx cannot split {total_heads} KV heads over {decode_tp} decode ranks (SGLang "
            "replicates heads there); use a decode TP size that divides the KV heads")
    per_decode = total_heads // decode_tp
    per_prefill = total_heads // prefill_tp
    first = (decode_rank % decode_tp) * per_decode
    if first // per_prefill != prefill_rank % prefill_tp:
        raise SettingsMismatchError(
            f"decode rank {decode_rank} holds KV heads {first}..{first + per_decode - 1}, which "
            f"prefill rank {prefill_rank} (of {prefill_tp}) does not hold")
    return first % per_prefill, per_decode
