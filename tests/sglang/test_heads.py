"""A decode of a larger attention TP size than the prefill's (`backend.heads`, `KVPoolView.heads`):
which KV heads each decode rank holds, checked against SGLang's own head slicing, and the streams
a prefill encodes from its pool's head slice: byte for byte those of a pool holding only those
heads (what the decode rank's own plan expects; test_kv_streams.py applies such streams)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lynx_kernels import CodecSpec
from lynx_sglang.backend.heads import check_tp_sizes, head_range, source_slices
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.pool import KVPoolView
from lynx_sglang.backend.prefill.link import destination_of
from lynx_sglang.backend.streams import encode_layer_into
from lynx_sglang.errors import KVStreamError, SettingsMismatchError

GRID = [(p, d, heads) for p in (1, 2, 4) for d in (1, 2, 4, 8) if d >= p and d % p == 0
        for heads in (8, 16, 32) if heads % d == 0]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), GRID)
def test_head_ranges_are_sglangs(sglang_in_process, prefill_tp, decode_tp, heads):
    """Every decode rank reads its heads from the prefill rank SGLang maps it to
    (target_tp_rank = d * P // D), at the offset SGLang's Mooncake backend slices."""
    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

    covered = []
    for d in range(decode_tp):
        p = d * prefill_tp // decode_tp
        got = head_range(prefill_tp, decode_tp, p, d, heads)
        if prefill_tp == decode_tp:
            assert got is None
            continue
        start, count, dst_start, _ = compute_head_slice_params(prefill_tp, decode_tp, p, d, heads)
        assert got == (start, count) and dst_start == 0
        covered += [p * heads // prefill_tp + start + i for i in range(count)]
        if prefill_tp > 1:
            with pytest.raises(SettingsMismatchError, match="does not hold"):
                head_range(prefill_tp, decode_tp, (p + 1) % prefill_tp, d, heads)
    if prefill_tp != decode_tp:
        assert covered == list(range(heads))  # every head to exactly one decode rank


def test_what_lynx_cannot_pair_is_refused_with_the_reason():
    with pytest.raises(SettingsMismatchError, match="multiple"):
        check_tp_sizes(2, 3)
    with pytest.raises(SettingsMismatchError, match="multiple"):
        check_tp_sizes(6, 4)
    check_tp_sizes(1, 2)
    check_tp_sizes(4, 2)
    with pytest.raises(SettingsMismatchError, match="replicates"):
        head_range(1, 4, 0, 0, 2)  # 2 KV heads over 4 decode ranks
    with pytest.raises(SettingsMismatchError, match="replicates"):
        source_slices(4, 1, 2)  # a decode rank of 2 heads fed by 4 prefill ranks


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"),
                         [(p, d, h) for p in (2, 4, 8) for d in (1, 2, 4) if p > d and p % d == 0
                          for h in (8, 16, 32) if h % p == 0])
def test_a_smaller_decode_tp_takes_each_prefill_ranks_heads_in_order(prefill_tp, decode_tp,
                                                                    heads):
    """A decode rank reads from SGLang's target_tp_ranks (consecutive prefill ranks, each
    holding the next heads): source i fills slice i of its heads, together all of them once,
    and each prefill rank sends every head it holds (`head_range` None)."""
    per_decode = heads // decode_tp
    slices = source_slices(prefill_tp, decode_tp, per_decode)
    assert len(slices) == prefill_tp // decode_tp
    covered = [h for first, count in slices for h in range(first, first + count)]
    assert covered == list(range(per_decode))
    for d in range(decode_tp):
        for p in range(d * prefill_tp // decode_tp, (d + 1) * prefill_tp // decode_tp):
            assert head_range(prefill_tp, decode_tp, p, d, heads) is None


def _info(session: str = "10.0.0.2:7000", pages: int = 12):
    """SGLang's TransferInfo fields the sender reads."""
    return SimpleNamespace(mooncake_session_id=session, dst_kv_indices=list(range(pages)),
                           endpoint="10.0.0.2", dst_port=7001)


def test_a_destination_carries_the_head_slice_its_registration_implies():
    """The prefill's view of one decode rank (`destination_of`): all heads at equal TP or before
    the rank registered, its slice under a larger decode TP, a refusal naming both sizes else."""
    same = destination_of(_info(), SimpleNamespace(dst_attn_tp_size=1, dst_tp_rank=0), 1, 0, 8)
    assert (same.heads, same.refusal, same.num_pages, same.notify) == (None, None, 12,
                                                                       ("10.0.0.2", 7001))
    assert destination_of(_info(), None, 2, 1, 8).heads is None
    second = destination_of(_info(), SimpleNamespace(dst_attn_tp_size=4, dst_tp_rank=3), 2, 1, 8)
    assert (second.heads, second.refusal) == ((2, 2), None)
    wrong = destination_of(_info(), SimpleNamespace(dst_attn_tp_size=4, dst_tp_rank=0), 2, 1, 8)
    assert wrong.heads is None and "does not hold" in wrong.refusal
    larger = destination_of(_info(), SimpleNamespace(dst_attn_tp_size=1, dst_tp_rank=0), 2, 0, 8)
    assert (larger.heads, larger.refusal) == (None, None)  # all of this rank's heads
    odd = destination_of(_info(), SimpleNamespace(dst_attn_tp_size=3, dst_tp_rank=0), 2, 0, 6)
    assert odd.heads is None and "multiple" in odd.refusal
    # An MLA latent is whole on every rank: any pairing of TP sizes, nothing sliced.
    for decode_tp, rank in ((1, 0), (4, 3)):
        latent = destination_of(_info(), SimpleNamespace(dst_attn_tp_size=decode_tp,
                                                         dst_tp_rank=rank), 2, 1, 1, latent=True)
        assert (latent.heads, latent.refusal) == (None, None)


def _pool(heads: int, seed: int, slots: int = 300, layers: int = 2) -> KVPoolView:
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(slots, heads, 64, generator=g).to(torch.bfloat16)  # noqa: E731
    return KVPoolView([mk() for _ in range(layers)], [mk() for _ in range(layers)])


@pytest.mark.parametrize("target", ["exact", "int8"])
def test_a_head_slice_encodes_as_a_pool_of_those_heads(target):
    spec = CodecSpec(anchor_bits=4, group_size=64, target=target)
    full = _pool(4, 0)
    half = full.heads(2, 2)
    alone = KVPoolView([t[:, 2:4].contiguous() for t in full.k],
                       [t[:, 2:4].contiguous() for t in full.v])
    assert half.shape == alone.shape and half.shape.num_kv_heads == 2
    slots = torch.randperm(300)[:200]
    plan = StreamPlan.build(spec, half.shape, len(slots), 256)
    for layer in range(2):
        outs = []
        for pool in (half, alone):
            a = bytearray(plan.anchor_layer_bytes)
            r = bytearray(plan.residual_bytes)
            sizes = encode_layer_into(pool, layer, slots, spec, 256, 7, memoryview(a),
                                      memoryview(r))
            outs.append((bytes(a[:sizes[0]]), bytes(r[:sizes[1]])))
        assert outs[0] == outs[1]
    assert torch.equal(half.read(1, half.kinds[1], slots), alone.read(1, alone.kinds[1], slots))


def test_a_head_slice_outside_the_pool_is_refused():
    pool = _pool(4, 0)
    for first, count in ((3, 2), (-1, 1), (0, 0)):
        with pytest.raises(KVStreamError, match="no KV heads"):
            pool.heads(first, count)
