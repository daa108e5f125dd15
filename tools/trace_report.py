"""Where a request's network-exposed TTFT went: the trace records of every server process
(`lynx_sglang.trace`), joined by request id and room, turned into the critical path from "prefill
forward done" to "first token at the client", one row per stage.

Used by `tools.demo.run` and `tools.ttft.bench` (the stage breakdown they print and store); reads
only the trace directory the servers wrote (`names.TRACE_DIR_ENV`), never a log.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from lynx_sglang.trace import read_records

# The critical path's marks, in order: (record kind, mark, what the stage that ENDS here is).
# Speculating requests go Anchor -> Success; the others wait for the Residual first.
_PATH_SPECULATIVE = (
    ("timeline", "prefill_done", ""),
    ("prefill", "submitted", "prefill forward done -> handed to Lynx"),
    ("prefill", "dequeued", "in the sender's queue"),
    ("prefill", "announcement", "waiting for the decode's announcement"),
    ("prefill", "anchor_posted", "encoding the Anchor (the wire overlaps)"),
    ("decode", "anchor_landed", "the Anchor's last bytes on the wire"),
    ("decode", "anchor_applied", "applying the rest of the Anchor"),
    ("decode", "reported", "reporting Success"),
    ("request", "committed", "Success -> SGLang's first step on it"),
    ("request", "first_token_out", "first step -> first token out"),
)
_PATH_WAITING = (
    *_PATH_SPECULATIVE[:6],
    ("decode", "residual_landed", "the Residual on the wire"),
    ("decode", "residual_applied", "applying the rest of the Residual"),
    ("decode", "reported", "reporting Success"),
    *_PATH_SPECULATIVE[8:],
)
CLIENT_STAGE = "first token out -> at the client (detokenizer, HTTP, router)"
# Layer streaming (`backend.prefill.layer_stream`): most of the Anchor went out during the forward.
LAYER_STREAMED_ANCHOR_STAGE = "the Anchor's last layers and aux (the rest went during the forward)"


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    share: float  # of the network-exposed TTFT


@dataclass
class Breakdown:
    """One request's critical path. `wire_alone_s`: what the bytes on that path would take at the
    link rate alone (None when the rate is unknown)."""

    rid: str
    room: int | None
    network_ttft_s: float
    speculated: bool | None
    stages: list[Stage] = field(default_factory=list)
    wire_alone_s: float | None = None
    facts: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def records_by_request(trace_dir: str | Path, rid: str) -> dict[str, dict]:
    """The last record of each kind for the request `rid` (its room found through the records
    that name the rid)."""
    records = read_records(trace_dir)
    rooms = {r["room"] for r in records if r["facts"].get("rid") == rid}
    out: dict[str, dict] = {}
    for r in records:
        if r["facts"].get("rid") == rid or (r["room"] in rooms and r["room"]):
            out[r["kind"]] = r
    return out


def breakdown(records: dict[str, dict], rid: str, client_first_token: float,
              link_bps: float | None = None) -> Breakdown:
    """The critical path of one request from its records (`records_by_request`) and the client's
    wall-clock first-token time."""
    start = records.get("timeline", {}).get("marks", {}).get("prefill_done")
    if start is None:
        raise ValueError(f"request {rid}: no prefill_done record (was the trace dir set on the "
                         "prefill?)")
    decode = records.get("decode")
    speculated = None if decode is None else bool(decode["facts"].get("speculate"))
    total = client_first_token - start
    result = Breakdown(rid, records["timeline"]["room"] or None, total, speculated)
    if decode is None:
        # Not a Lynx transfer (e.g. SGLang's mooncake): no stages to tell apart.
        result.stages.append(Stage("KV transfer, SGLang's first step and first token", total,
                                   1.0))
        return result
    path = _PATH_SPECULATIVE if speculated else _PATH_WAITING
    layer_streamed = bool(records.get("prefill", {}).get("facts", {}).get("layer_streamed"))
    last = start
    for kind, mark, what in path[1:]:
        t = records.get(kind, {}).get("marks", {}).get(mark)
        if t is None or t < last:
            continue  # not on this request's path (or overlapped by an earlier stage)
        if mark == "anchor_posted" and layer_streamed:
            what = LAYER_STREAMED_ANCHOR_STAGE
        result.stages.append(Stage(what, t - last, (t - last) / total if total > 0 else 0.0))
        last = t
    result.stages.append(Stage(CLIENT_STAGE, client_first_token - last,
                               (client_first_token - last) / total if total > 0 else 0.0))
    if decode is not None:
        facts = decode["facts"]
        result.facts = {k: facts.get(k) for k in ("anchor_bytes", "residual_bytes", "why",
                                                  "residual_eta_s", "speculation_cost_s")}
        if link_bps:
            wire = facts.get("anchor_bytes", 0) + (0 if speculated else
                                                   facts.get("residual_bytes", 0))
            result.wire_alone_s = wire * 8 / link_bps
    return result


def format_breakdown(b: Breakdown) -> str:
    lines = [f"  stage breakdown of the network-exposed TTFT ({b.network_ttft_s * 1e3:.0f} ms; "
             + ("speculated" if b.speculated else "waited for the Residual" if b.speculated
                is False else "no Lynx records") + "):"]
    for s in b.stages:
        lines.append(f"    {s.name:<62} {s.seconds * 1e3:8.1f} ms  {s.share * 100:5.1f} %")
    if b.wire_alone_s is not None:
        lines.append(f"    {'(the wire alone would take)':<62} {b.wire_alone_s * 1e3:8.1f} ms")
    if b.facts.get("why"):
        lines.append(f"    speculation: {b.facts['why']}")
    return "\n".join(lines)


def parse_rate(rate: str | None) -> float | None:
    """Bits per second of a tc rate like '1gbit', '10mbit', '500kbit' (None: unshaped)."""
    if not rate or rate == "none":
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"unknown rate {rate!r} (e.g. 1gbit, 10mbit)")
