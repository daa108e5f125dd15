"""The `lynx` KV transfer backend of SGLang PD disaggregation, its folders by role.

The face SGLang sees:
    manager   LynxKVManager: SGLang's KV manager; picks one role object and delegates to it,
              reports every status (`report_status`)
    conn      LynxKVSender / LynxKVReceiver / LynxKVBootstrapServer: SGLang's per-request classes
prefill/ (never imports decode/):
    role      PrefillRole: the prefill's side of the manager (sender, rank rows and leases,
              early aborts)
    sender    PrefillSender: take SGLang's KV slots of each request, hand the room to its
              decode's worker (at the last chunk, or layer-streamed as its forward starts)
    worker, writer, inflight, sessions, job, link, layer_stream, stream_policy, anchor_width,
    faults, early_aborts: one concern each (see each module)
decode/ (never imports prefill/):
    role      DecodeRole: the decode's side of the manager (applier, speculation controller)
    applier   DecodeApplier: the decode's applier loop and SGLang's interface to the parts below
    rooms, room, sessions, bindings, admission, progress, apply, windowed, policy, report,
    outcome: one concern each (see each module)
What both sides use:
    plan      StreamPlan: one request's stream sizes and per-layer offsets (both ends)
    streams   encode a pool's slots into chunks / parse and apply landed chunks
    pool      KVPoolView: SGLang's per-layer K/V tensors
    staging   StagingPool: registered staging memory handed out as byte ranges
    window, pages, heads, aux, identity, rank_key, registration, peer_sockets, transport_setup

SGLang itself is reached only through `lynx_sglang.upstream` (its `kv_transfer` has the classes'
bases); everything but the face and the roles is testable without a server.
"""
