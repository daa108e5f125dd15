"""Which Anchor width a room is sent with under `--lynx-anchor-width adaptive`: `choose_width`,
called by a prefill destination worker as it opens a room to a decode (`backend.prefill.worker`),
before anything of the room is encoded.

A narrower Anchor lands sooner (SmolLM2, 1500 tokens: 3 bits are 0.23 of the BF16 bytes, 4 bits
0.30), so the first token comes sooner where the Anchor's wire time is what it waits for. It
costs elsewhere: the decode's speculation on a coarser Anchor disagrees with the exact KV more
often (more tokens rolled back at verification), and the Residual carries the bit the Anchor left
out. So the narrower width is picked only where it brings the first token sooner by at least
`GAIN_SHARE` of the room's forward:

- sent after its forward, the room's Anchor delivery (encode and wire, per byte as measured to
  this decode, `backend.prefill.stream_policy`) is all delay: the gain is that time per byte times the
  bytes saved;
- layer-streamed, the Anchor goes out while the forward computes and only what outlasts the
  forward delays the first token: the gain is max(0, wide - F) - max(0, narrow - F), with each
  width's delivery time and F the forward's predicted time (the last layer's own share, sent after
  the forward either way, is left out).

Where this decode's link or the forward pace is not measured yet, the wider width (the configured
`--lynx-anchor-bits`): it is the recommended one where the link does not dominate.
"""

from __future__ import annotations

from dataclasses import dataclass

# The least gain, as a share of the room's forward, for which the narrower Anchor is picked: below
# it, the rollbacks of a coarser speculation and the larger Residual are not worth it.
GAIN_SHARE = 0.05


@dataclass(frozen=True)
class WidthChoice:
    anchor_bits: int
    why: str


def choose_width(widths: tuple[int, ...], anchor_bytes: dict[int, int],
                 s_per_byte: float | None, forward_s: float | None,
                 streamed: bool) -> WidthChoice:
    """The Anchor width of a room from the widths allowed (narrowest first; one: that one), its
    Anchor's bytes at each, the link's Anchor delivery time per byte and the forward's predicted
    time (None: not measured), and whether the room is layer-streamed."""
    wide = widths[-1]
    if len(widths) == 1:
        return WidthChoice(wide, "fixed")
    if s_per_byte is None or forward_s is None or forward_s <= 0:
        return WidthChoice(wide, "link or forward not measured yet")
    narrow = widths[0]

    def delay(bits: int) -> float:
        wire = s_per_byte * anchor_bytes[bits]
        return max(0.0, wire - forward_s) if streamed else wire

    gain = delay(wide) - delay(narrow)
    share = gain / forward_s
    if share >= GAIN_SHARE:
        return WidthChoice(narrow, f"{narrow} bits bring the first token {gain:.3f} s sooner, "
                                   f"{share:.2f} of the forward's {forward_s:.2f} s")
    return WidthChoice(wide, f"{narrow} bits would gain {gain:.3f} s, {share:.2f} of the "
                             f"forward's {forward_s:.2f} s")
