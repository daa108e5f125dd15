"""The `lynx` KV transfer backend of SGLang PD disaggregation.

    manager   LynxKVManager (+ sender/receiver/bootstrap classes): the face SGLang sees; builds the
              role's worker and reports every status
    prefill   PrefillSender: take SGLang's KV slots of each request, hand the room to its decode's
              worker (at the last chunk, or layer-streamed as its forward starts)
    prefill_worker    DestinationWorker: one thread per decode; opens, writes and reports rooms
    prefill_writer    RoomWriter / WindowedWriter: one room's two streams from prefill staging
    prefill_staging   InFlightStaging: a worker's staging ranges until the transport delivered them
    prefill_sessions  DecodeSessions: the prefill's transport session to each decode
    prefill_job       Job: a room being sent (and KeptRows, StreamedJobs)
    prefill_link      PrefillLink, Destination, SentBytes: the sender's interface with SGLang's side
    identity  the identity handshake opening every session, both ends (IDENTITY_REQUEST)
    rank_key  RankKey, Claimant: a prefill rank's proof that it is the rank it registered
    faults    FaultPlan: the tests' holds at named points of a prefill transfer (no-op by default)
    decode    DecodeApplier: the decode's applier loop and SGLang's interface to the parts below
    decode_rooms      RoomTable: the decode's rooms, and which one the applier is working on
    decode_sessions   PrefillSessions: the decode's transport session from each prefill rank
    decode_bindings   RankBindings: the rank key SGLang's bootstrap server lists for each rank
    decode_admission  StagingAdmission: a room's staging range (or queue), announcement, release
    decode_progress   TransferProgress: a room's landed and applied layers and segments
    decode_apply      StreamApplier: apply a room's landed Anchor and Residual to the pool
    decode_windowed   WindowedApplier: the same, segment by segment, for a windowed room
    decode_policy     Estimates, decide_speculation: whether a room speculates on its Anchor
    decode_report     StatusReporter, DecodeLink: every decode status that reaches SGLang
    room      DecodeRoom: one request's decode-side state machine
    plan      StreamPlan: one request's stream sizes and per-layer offsets (both ends)
    streams   encode a pool's slots into chunks / parse and apply landed chunks
    pool      KVPoolView: SGLang's per-layer K/V tensors
    staging   StagingPool: registered staging memory handed out as byte ranges
    aux       SGLang's aux data (first token, ...) on the wire
    outcome   ResidualOutcome: what the speculation controller learns about a Residual

Only `manager` imports SGLang; the rest is testable without a server.
"""
