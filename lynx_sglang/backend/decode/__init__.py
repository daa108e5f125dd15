"""The decode side of the `lynx` transfer backend: `applier.DecodeApplier` (built by
`backend.manager.LynxKVManager` on a decode) admits each room into staging (`admission`, `rooms`,
`room`), accepts the prefill ranks' sessions (`sessions`, checked against the bootstrap's rank
keys: `bindings`), applies the landed Anchor and Residual into SGLang's KV pool (`apply`,
`windowed`, `progress`), decides whether a room speculates (`policy`), and reports each room's
outcome to SGLang and to the speculation controller (`report`, `outcome`).

Never imports the prefill side (`tests/test_layout.py`); both use the parts beside them in
`backend/` (plan, streams, pool, staging, window, identity, pages, heads, rank keys).
"""
