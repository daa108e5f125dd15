"""A decode room whose KV comes from several prefill ranks (a prefill attention TP size larger than
the decode's): one `DecodeRoom` per source in the `RoomTable`, keyed (room, part), and the
`StatusReporter` telling SGLang once for the room: Success when the last part's KV is final and
the prefill's Success has come (in either order), Failed once when any part fails, which fails
the other parts and gives back what they hold. Real table, reporter and rooms; SGLang's side is a
recording `DecodeLink`. test_pd_lynx_tp.py runs such rooms through real TP servers."""

from __future__ import annotations

import torch

from lynx_kernels import CodecSpec, preset
from lynx_sglang.backend.decode.policy import not_speculating
from lynx_sglang.backend.decode.report import DecodeLink, StatusReporter
from lynx_sglang.backend.decode.room import DecodeRoom, RoomState
from lynx_sglang.backend.decode.rooms import RoomTable
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.staging import StagingRange
from lynx_sglang.config import LynxConfig
from lynx_sglang.failures import FailureKind
from lynx_sglang.recorder import Recorder

ROOM = 41
PLAN = StreamPlan.build(CodecSpec(), preset("SmolLM2-135M"), 8, 256)


class Sglang:
    """What the reporter tells SGLang, and what it gives back."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, str | None]] = []
        self.released: list[DecodeRoom] = []

    def link(self) -> DecodeLink:
        return DecodeLink(report=lambda room, failure: self.reports.append((room, failure)),
                          write_aux=lambda *a: None, forget_prefill_rank=lambda rank: None,
                          progress=lambda: None, lookup_prefill_rank=lambda *a: None)


def _parts(table: RoomTable, n: int = 2) -> list[DecodeRoom]:
    rooms = [DecodeRoom(ROOM, ("10.0.0.1", 7000 + p), torch.arange(8), 0, PLAN,
                        StagingRange(p * 1024, 1024), part=p, parts=n, heads=(p, 1))
             for p in range(n)]
    with table.lock:
        for room in rooms:
            table.add(room)
    return rooms


def _final(room: DecodeRoom) -> None:
    """Announced, Anchor in (not speculating), every layer final: awaiting the prefill."""
    room.announced(None)
    room.decide(not_speculating("test"))
    room.anchor_complete(None)
    room.final_kv()


def _reporter(table: RoomTable, sglang: Sglang) -> StatusReporter:
    return StatusReporter(LynxConfig(), table, sglang.link(), Recorder.for_process(),
                          sglang.released.append, lambda: None)


def test_parts_are_keyed_by_room_and_part():
    table = RoomTable()
    rooms = _parts(table, 3)
    assert [r.key for r in rooms] == [(ROOM, 0), (ROOM, 1), (ROOM, 2)]
    assert table.get(ROOM) is None  # SGLang's id alone names no part
    with table.lock:
        assert table.parts_of(ROOM) == rooms
        table.pop((ROOM, 1))
        assert table.parts_of(ROOM) == [rooms[0], rooms[2]]
        table.forget(rooms[0])
        table.forget(rooms[2])
        assert table.parts_of(ROOM) == []
    single = DecodeRoom(ROOM, ("10.0.0.1", 7000), torch.arange(8), 0, PLAN, StagingRange(0, 64))
    with table.lock:
        table.add(single)  # the same id again, one source: keyed by the id
        assert single.key == ROOM and table.parts_of(ROOM) == [single]


def test_success_reaches_sglang_with_the_last_part_in_either_order():
    # The prefill's Success (SGLang's, over all prefill ranks) before the last part is final.
    table, sglang = RoomTable(), Sglang()
    reporter = _reporter(table, sglang)
    first, second = _parts(table)
    _final(first)
    reporter.conclude(first)
    assert sglang.reports == []  # awaiting the prefill
    assert reporter.on_prefill_success(ROOM) is True  # held: the second part is not final
    assert first.state is RoomState.DONE and second.prefill_success
    _final(second)
    reporter.conclude(second)
    assert sglang.reports == [(ROOM, None)]
    with table.lock:
        assert table.parts_of(ROOM) == []
    # Every part final before the prefill's Success: that Success goes through, nothing else.
    table, sglang = RoomTable(), Sglang()
    reporter = _reporter(table, sglang)
    for room in _parts(table):
        _final(room)
        reporter.conclude(room)
    assert sglang.reports == []
    assert reporter.on_prefill_success(ROOM) is False
    with table.lock:
        assert table.parts_of(ROOM) == []


def test_one_failed_part_fails_the_room_once_and_stops_the_others():
    table, sglang = RoomTable(), Sglang()
    reporter = _reporter(table, sglang)
    first, second, third = _parts(table, 3)
    for room in (first, second):
        room.announced(None)
    _final(third)
    reporter.conclude(third)
    reporter.fail(second, "Anchor stream failed: peer_died", FailureKind.PEER_DIED)
    assert sglang.reports == [(ROOM, "Anchor stream failed: peer_died")]
    assert first.state is RoomState.FAILED and "part 2 of 3" in first.failure
    assert third.state is RoomState.FAILED  # its KV was final, but the room is not whole
    assert {id(r) for r in sglang.released} >= {id(first), id(second), id(third)}
    with table.lock:
        assert table.parts_of(ROOM) == []
    assert reporter.on_prefill_success(ROOM) is False  # SGLang keeps its Failed
