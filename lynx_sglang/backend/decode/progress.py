"""How far one decode room's transfer has come (`TransferProgress`, the room's `progress`): the
Anchor layers landed (parsed into views of staging) and written into the KV pool, the Residual's
parser and its complete layers, the layers at their final precision, and a windowed room's segment
cursor.

Changed only through its methods, by the applier thread while it works on the room
(`backend.decode.apply`, `backend.decode.windowed`; announcing a segment also from
`StagingAdmission.try_announce` under the room table's lock, before the applier can see the room
announced). Its counts are read from any thread (one int each). Buffers: the layer views point
into the room's staging range and are dropped (`drop_views`) before that range is freed
(`StagingAdmission.release`).
"""

from __future__ import annotations

from lynx_kernels import StreamKind

from ..plan import StreamPlan
from ..pool import KINDS
from ..streams import LayerRuns, ResidualReader, anchor_layer


class TransferProgress:
    def __init__(self, num_layers: int, num_tokens: int, *, windowed: bool,
                 kinds: tuple[StreamKind, ...] = KINDS):
        self._num_layers = num_layers
        self._windowed = windowed
        # Per layer: the landed Anchor's views, until the layer is final.
        self._anchor: list[LayerRuns | None] = [None] * num_layers
        self._anchor_landed = 0  # layers [0, n) landed, in order
        self._anchor_written = 0  # layers [0, n) looked at for writing their Anchor to the pool
        self._final = 0  # layers at their final precision in the pool
        self._reader = ResidualReader(num_layers, num_tokens, kinds=kinds)
        # Layers whose Residual is complete and not yet applied (waiting for their Anchor).
        self._ready: list[tuple[int, LayerRuns]] = []
        self._residual_at_anchor: int | None = None  # Residual bytes in when the Anchor was
        # A windowed room (`backend.window`): segments [applied, announced) are announced and
        # not yet released (at most one per window).
        self._seg_announced = 0
        self._seg_applied = 0
        self._seg_residual_bytes = 0  # Residual bytes of the segments written so far

    # ---- reads --------------------------------------------------------------------------------
    @property
    def anchor_layers_landed(self) -> int:
        return self._anchor_landed

    @property
    def anchor_written(self) -> int:
        return self._anchor_written

    @property
    def final_layers(self) -> int:
        return self._final

    @property
    def all_final(self) -> bool:
        return self._final == self._num_layers

    @property
    def seg_announced(self) -> int:
        return self._seg_announced

    @property
    def seg_applied(self) -> int:
        return self._seg_applied

    @property
    def residual_done(self) -> bool:
        """Every layer of the (whole room's) Residual stream has been found."""
        return self._reader.done

    @property
    def residual_parsed(self) -> int:
        """Bytes of the Residual stream parsed into complete chunks."""
        return self._reader.pos

    @property
    def residual_next_layer(self) -> int:
        return self._reader.next_layer

    @property
    def residual_since_anchor(self) -> int | None:
        """Residual bytes parsed since the whole Anchor was in (None before it was)."""
        if self._residual_at_anchor is None:
            return None
        return self._reader.pos - self._residual_at_anchor

    @property
    def residual_bytes(self) -> int:
        """Residual bytes landed and parsed so far."""
        return self._seg_residual_bytes if self._windowed else self._reader.pos

    # ---- a whole room's streams ---------------------------------------------------------------
    def land_anchor(self, view: memoryview, plan: StreamPlan, landed: int) -> bool:
        """Parse every Anchor layer whose bytes are all among the first `landed` of `view` (the
        room's staging; the Anchor lands as a prefix). True if any new layer was."""
        start = self._anchor_landed
        while self._anchor_landed < plan.num_layers \
                and plan.anchor_offset(self._anchor_landed + 1) <= landed:
            self._anchor[self._anchor_landed] = anchor_layer(view, plan, self._anchor_landed)
            self._anchor_landed += 1
        return self._anchor_landed > start

    def take_unwritten_anchor(self) -> list[tuple[int, LayerRuns]]:
        """The landed Anchor layers not looked at yet, but those already final: the caller writes
        them into the pool now. Counts every landed layer written."""
        todo = [(layer, self._anchor[layer])
                for layer in range(self._anchor_written, self._anchor_landed)
                if layer >= self._final]
        self._anchor_written = self._anchor_landed
        return todo

    def take_residual(self, view: memoryview, landed: int) -> list[tuple[int, LayerRuns, LayerRuns]]:
        """Parse the first `landed` bytes of the Residual stream (`view`) as far as they go, and
        hand out the layers whose Residual is complete and whose Anchor has landed, in order:
        (layer, Anchor runs, Residual chunks). The caller writes each at full precision and then
        says so (`finalized`)."""
        self._ready.extend(self._reader.advance(view, landed))
        todo = []
        while self._ready and self._ready[0][0] < self._anchor_landed:
            layer, chunks = self._ready.pop(0)
            todo.append((layer, self._anchor[layer], chunks))
        return todo

    def finalized(self, layer: int) -> None:
        """`layer` is at full precision in the pool: its Anchor views are no longer needed."""
        self._anchor[layer] = None
        self._final += 1

    def anchor_complete(self, residual_landed: int) -> None:
        """The whole Anchor is in, with `residual_landed` bytes of the Residual stream."""
        self._residual_at_anchor = residual_landed

    # ---- a windowed room's segments -----------------------------------------------------------
    def segment_announced(self) -> None:
        self._seg_announced += 1

    def segment_written(self, layers: int, residual_bytes: int) -> None:
        """The oldest announced segment's `layers` are final in the pool."""
        self._final += layers
        self._seg_residual_bytes += residual_bytes

    def segment_released(self) -> None:
        """The oldest announced segment's announcement is withdrawn: its window is free."""
        self._seg_applied += 1

    # ---- release --------------------------------------------------------------------------
    def drop_views(self) -> None:
        """Let go of every view into staging (the room's range is about to be freed)."""
        self._anchor = []
        self._ready = []
