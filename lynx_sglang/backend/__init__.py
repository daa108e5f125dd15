"""The `lynx` KV transfer backend of SGLang PD disaggregation.

    manager   LynxKVManager (+ sender/receiver/bootstrap classes): the face SGLang sees; builds the
              role's worker and reports every status
    prefill   PrefillSender: encode a finished request's KV into staging, write both streams
    decode    DecodeApplier: announce staging, apply the landed Anchor and Residual to the pool
    room      DecodeRoom: one request's decode-side state machine
    plan      StreamPlan: one request's stream sizes and per-layer offsets (both ends)
    streams   encode a pool's slots into chunks / parse and apply landed chunks
    pool      KVPoolView: SGLang's per-layer K/V tensors
    staging   StagingPool: registered staging memory handed out as byte ranges
    aux       SGLang's aux data (first token, ...) on the wire
    outcome   ResidualOutcome: what the speculation controller learns about a Residual

Only `manager` imports SGLang; the rest is testable without a server.
"""
