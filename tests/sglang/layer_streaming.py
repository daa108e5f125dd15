"""Server flags of the PD tests that check layer streaming itself: every room streamed whatever
the link. By default (`--lynx-layer-stream-min-share`) a prefill sends a room after its forward
where the link is fast against the forward, as on the tests' loopback or 1 Gbit/s links."""

ALWAYS_STREAM = ("--lynx-layer-stream-min-share", "0")
