"""The prefill side of the `lynx` transfer backend: `sender.PrefillSender` (built by
`backend.manager.LynxKVManager` on a prefill) takes each room's KV slots from SGLang and has one
destination worker per decode (`worker`) open the room's session (`sessions`), encode both streams
into staging (`writer`, `inflight`) and write them, the Anchor layer by layer while the forward
runs where that pays (`layer_stream`, `stream_policy`, `anchor_width`). `faults` injects the fault
matrix's prefill faults; `early_aborts` remembers aborts that arrived before their room.

Never imports the decode side (`tests/test_layout.py`); both use the parts beside them in
`backend/` (plan, streams, pool, staging, window, identity, pages, heads, rank keys).
"""
