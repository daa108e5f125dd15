"""Windowed staging: how a request too large for the whole staging pool is still sent, in segments
of whole layers that take turns in one or two windows of staging.

Segment j holds layers [bounds[j], bounds[j + 1]) of both streams, laid out as a `StreamPlan` of
those layers alone (Anchor, then room for the Residual's bound), and is its own transport
request: its own announcement, bounds, deadline and release, so a window is reused only after
`Session.release` of the segment before returned (no late byte of it can land there). Segment 0
goes by the room's id and its announcement carries the `Segments` (`meta`); segment j >= 1 goes
by `first_id + j - 1`, ids the decode draws from `SEGMENT_IDS` (above every SGLang bootstrap room,
below the identity announcement), so they never collide with a room's.

The decode (`backend.decode.applier.DecodeApplier`) chooses the segments and windows (`choose`), announces
the first segments into its windows and each next one into the window the segment before freed;
the prefill (`backend.prefill.worker`) parses and checks the announcement (`Segments.parse`:
anything a peer sends is untrusted) and writes the segments in order, each from its own prefill staging range.
Both streams of a segment travel together, because its Residual is applied with its Anchor: so a
windowed room never speculates (its whole Anchor is in only near the end of the transfer).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace

from lynx_transport.types import MAX_REQUEST_ID

from ..errors import KVStreamError, StagingFullError
from .plan import StreamPlan

# Transport request ids of segments 1.. of windowed rooms: SGLang's bootstrap rooms are < 2**63,
# the identity announcement is MAX_REQUEST_ID.
SEGMENT_IDS = range(1 << 63, MAX_REQUEST_ID)
# Windows tried in order, as (count, fraction of the pool): two windows of a quarter leave half
# the pool to other rooms; a layer too large for that gets larger windows, at last one window of
# the whole pool.
_WINDOW_CHOICES = ((2, 4), (2, 2), (1, 1))


@dataclass(frozen=True)
class Segments:
    """How one windowed room is cut: layer bounds [0, b1, ..., L] and segment 1's request id."""

    bounds: tuple[int, ...]
    first_id: int

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def layers(self, j: int) -> range:
        return range(self.bounds[j], self.bounds[j + 1])

    def request_id(self, room: int, j: int) -> int:
        return room if j == 0 else self.first_id + j - 1

    def plan(self, room_plan: StreamPlan, j: int) -> StreamPlan:
        """Segment j's byte layout: the room's plan for its layers alone (every layer's Anchor
        and Residual bound are the same size)."""
        n = len(self.layers(j))
        share = room_plan.residual_bytes_expected * n // room_plan.num_layers
        return replace(room_plan, num_layers=n, residual_bytes_expected=share)

    def meta(self) -> bytes:
        return json.dumps({"segments": list(self.bounds), "first_id": self.first_id}).encode()

    @classmethod
    def parse(cls, meta: bytes, num_layers: int) -> Segments | None:
        """The segments a decode announced with a room (None: the room is not windowed). Raises
        `KVStreamError` for anything but whole-layer segments tiling [0, num_layers) in order
        with ids inside `SEGMENT_IDS`."""
        if not meta:
            return None
        try:
            doc = json.loads(bytes(meta))
            bounds, first_id = doc["segments"], doc["first_id"]
        except (ValueError, TypeError, KeyError) as exc:
            raise KVStreamError(f"the decode's announcement carries malformed meta: {exc}") from exc
        ok = (isinstance(bounds, list) and 2 <= len(bounds) <= num_layers + 1
              and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
              and bounds[0] == 0 and bounds[-1] == num_layers
              and all(a < b for a, b in itertools.pairwise(bounds))
              and isinstance(first_id, int) and not isinstance(first_id, bool)
              and first_id in SEGMENT_IDS and first_id + max(len(bounds) - 3, 0) in SEGMENT_IDS)
        if not ok:
            raise KVStreamError(f"the decode announced segments {str(bounds)[:200]} (first id "
                                f"{str(first_id)[:40]}) that do not tile the {num_layers} "
                                "layers in order")
        return cls(tuple(bounds), first_id)


@dataclass(frozen=True)
class Windows:
    """A windowed room's staging: `count` windows of `nbytes` each, back to back in one range."""

    count: int
    nbytes: int
    layers_per_segment: int

    @property
    def staging_bytes(self) -> int:
        return self.count * self.nbytes


def choose(plan: StreamPlan, pool_bytes: int, align: int) -> Windows:
    """The windows for a room whose plan does not fit `pool_bytes` of staging: the first of
    `_WINDOW_CHOICES` that holds at least one whole layer. Raises `StagingFullError` if not even
    the whole pool holds one layer."""
    layer_bytes = plan.anchor_layer_bytes + plan.residual_layer_bytes
    for count, fraction in _WINDOW_CHOICES:
        window = pool_bytes // fraction // align * align
        per_segment = min(window // layer_bytes, plan.num_layers)
        if per_segment >= 1:
            nbytes = -(-per_segment * layer_bytes // align) * align
            segments = -(-plan.num_layers // per_segment)
            return Windows(min(count, segments), nbytes, per_segment)
    raise StagingFullError(f"one layer of this request needs {layer_bytes} B of staging, more "
                           f"than the whole pool ({pool_bytes} B); raise --lynx-staging-mib")


def cut(num_layers: int, layers_per_segment: int, first_id: int) -> Segments:
    bounds = (*range(0, num_layers, layers_per_segment), num_layers)
    return Segments(bounds, first_id)
