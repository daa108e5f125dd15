"""The opt-in stream of speculative tokens, with every rollback reported (`--lynx-spec-stream-port`).

SGLang's client-facing output path (scheduler -> detokenizer -> tokenizer manager -> HTTP) assumes
a request's output only grows: the detokenizer keeps incremental decode offsets per request. So
that stream carries verified tokens only (`speculation.accept_around`), always, and speculative
tokens travel here instead: a ZMQ PUB socket of the decode scheduler, one topic per request id.
A client that wants tokens before verification subscribes with its request's rid before sending
the request, shows speculative tokens as provisional and replaces them when a `verified` event
says how many survived. Nothing is ever taken back silently: SGLang's stream never shows a
speculative token, and this one reports every rollback.

Events: ZMQ multipart [rid (utf-8), JSON body]. `seq` counts a request's events from 0; a gap
means this subscriber lost events (it joined late, or fell behind past the PUB high-water mark)
and `SpecView.apply` raises. Positions index the request's output tokens (position 0 is the
prefill's exact first token).

  Every request's first event (seq 0) also carries `prefix_ids`: the verified tokens before
  its `start`.
  speculative  {type, rid, seq, start, token_ids}
      output positions start .. start+len-1 hold these provisional tokens.
  verified     {type, rid, seq, start, token_ids, speculated, accepted, rolled_back,
                corrected, finished}
      output positions start .. start+len-1 are final and are `token_ids`; every provisional token
      at or after start+accepted that is not in token_ids was rolled back. `finished`: the request
      ended at verification; otherwise it goes on as an ordinary request and its further tokens
      come only through SGLang's own stream (this stream sends no more events for it).
  aborted      {type, rid, seq, verified_len, reason}
      the request failed or was aborted; output positions >= verified_len are void.

Publisher: `SpecStreamPublisher`, owned by the decode scheduler's `speculation.controller.SpecController`
(scheduler thread only). Subscribers: `SpecStreamClient` + `SpecView` (clients, tests).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from ..errors import SpecStreamError

logger = logging.getLogger(__name__)

# Events a slow subscriber may lag behind before PUB drops (then it sees a seq gap).
SEND_HWM = 100_000


class SpecStreamPublisher:
    """Decode scheduler side. Not thread-safe: the scheduler thread is the only caller."""

    def __init__(self, host: str, port: int):
        self.address = f"tcp://{host}:{port}"
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise SpecStreamError(f"--lynx-spec-stream-port: cannot bind {self.address}: {exc}") \
                from exc
        self._seq: dict[str, int] = {}
        logger.info("lynx spec-stream: publishing speculative tokens and rollbacks on %s",
                    self.address)

    def open_topics(self) -> int:
        """Requests with speculative events sent and no final one yet."""
        return len(self._seq)

    def speculative(self, rid: str, output_ids: Sequence[int], start: int) -> None:
        """output_ids[start:] are new provisional tokens (output_ids[:verified] are final)."""
        self._send("speculative", rid, output_ids, start,
                   {"start": start, "token_ids": list(output_ids[start:])})

    def verified(self, rid: str, output_ids: Sequence[int], start: int, speculated: int,
                 accepted: int, corrected: bool, finished: bool) -> None:
        """Verification made output_ids[start:] final (output_ids is the request's now)."""
        self._send("verified", rid, output_ids, start, {
            "start": start, "token_ids": list(output_ids[start:]), "speculated": speculated,
            "accepted": accepted, "rolled_back": speculated - accepted, "corrected": corrected,
            "finished": finished}, last=True)

    def aborted(self, rid: str, output_ids: Sequence[int], reason: str) -> None:
        """The request ended with output_ids (its verified prefix) and no more."""
        self._send("aborted", rid, output_ids, len(output_ids),
                   {"verified_len": len(output_ids), "reason": reason}, last=True)

    def _send(self, kind: str, rid: str, output_ids: Sequence[int], prefix_len: int, body: dict,
              last: bool = False) -> None:
        """`output_ids` is the request's own sequence (SGLang keeps an `array`): only the slices
        an event carries are converted, and nothing of it is kept."""
        first = rid not in self._seq
        seq = self._seq.pop(rid, 0) if last else self._seq.get(rid, 0)
        if not last:
            self._seq[rid] = seq + 1
        msg = {"type": kind, "rid": rid, "seq": seq, "t": round(time.time(), 6)} | body
        if first:
            msg["prefix_ids"] = list(output_ids[:prefix_len])
        try:
            self._sock.send_multipart([rid.encode(), json.dumps(msg).encode()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # PUB drops rather than blocks; anything else is logged
            logger.warning("lynx spec-stream: event for %s not sent: %s", rid, exc)

    def close(self) -> None:
        self._sock.close()


def scheduler_publisher(port: int, host: str, attn_tp_rank: int,
                        dp_rank: int) -> SpecStreamPublisher | None:
    """The spec stream of one decode scheduler, if `--lynx-spec-stream-port` asks for one (port
    0: off). TP ranks run the same batches, so only attention-TP rank 0 publishes; data-parallel
    ranks each publish on the port plus their DP rank."""
    if not port or attn_tp_rank != 0:
        return None
    return SpecStreamPublisher(host, port + dp_rank)


@dataclass
class SpecView:
    """A client's view of one request's output from the spec stream: `tokens` = the verified
    tokens followed by the provisional ones."""

    rid: str
    tokens: list[int] = field(default_factory=list)
    verified_len: int = 0
    next_seq: int = 0
    # (position, tokens taken back) for every verification that rolled something back.
    rollbacks: list[tuple[int, list[int]]] = field(default_factory=list)
    done: bool = False
    finished: bool = False
    abort_reason: str | None = None

    def apply(self, event: dict) -> None:
        if event.get("rid") != self.rid:
            raise SpecStreamError(f"event for {event.get('rid')!r} given to the view of {self.rid!r}")
        if event["seq"] != self.next_seq:
            raise SpecStreamError(f"spec stream of {self.rid}: expected event {self.next_seq}, got "
                                  f"{event['seq']} (events were lost: subscribe before sending "
                                  f"the request, and keep up)")
        self.next_seq += 1
        kind = event["type"]
        if "prefix_ids" in event:
            self.tokens = list(event["prefix_ids"])
            self.verified_len = len(self.tokens)
        if kind == "speculative":
            self._write(event["start"], event["token_ids"])
        elif kind == "verified":
            start, final = event["start"], event["token_ids"]
            if start != self.verified_len:
                raise SpecStreamError(f"spec stream of {self.rid}: verified from {start}, but "
                                      f"{self.verified_len} tokens were verified before")
            taken_back = self.tokens[start + event["accepted"]:]
            if event["rolled_back"]:
                self.rollbacks.append((start + event["accepted"], taken_back))
            self.tokens = self.tokens[:start] + list(final)
            self.verified_len = len(self.tokens)
            self.done, self.finished = True, event["finished"]
        elif kind == "aborted":
            del self.tokens[event["verified_len"]:]
            self.verified_len = len(self.tokens)
            self.done, self.abort_reason = True, event["reason"]
        else:
            raise SpecStreamError(f"unknown spec stream event type {kind!r}")

    def _write(self, start: int, token_ids: list[int]) -> None:
        if start > len(self.tokens):
            raise SpecStreamError(f"spec stream of {self.rid}: tokens from position {start}, but "
                                  f"only {len(self.tokens)} are known")
        self.tokens[start:start + len(token_ids)] = token_ids


class SpecStreamClient:
    """Subscribes to a decode's spec stream (`tcp://host:port`) for chosen request ids.

    Subscribe before the request is sent (ZMQ drops events for topics nobody subscribed yet, and
    a PUB-SUB connection takes a moment to set up: `subscribe` waits `settle_s`).
    """

    def __init__(self, address: str):
        self.address = address
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self.views: dict[str, SpecView] = {}
        self.events: list[dict] = []

    def subscribe(self, rid: str, settle_s: float = 0.5) -> SpecView:
        self._sock.setsockopt(zmq.SUBSCRIBE, rid.encode())
        view = self.views[rid] = SpecView(rid)
        time.sleep(settle_s)
        return view

    def poll(self, timeout_s: float) -> int:
        """Apply the events that arrive within `timeout_s` (returns early once every view is
        done); returns how many were applied."""
        n = 0
        deadline = time.monotonic() + timeout_s
        while not all(v.done for v in self.views.values()):
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                break
            topic, body = self._sock.recv_multipart()
            # SUBSCRIBE matches prefixes: "a" also receives "ab"'s events.
            view = self.views.get(topic.decode())
            if view is None:
                continue
            event = json.loads(body)
            view.apply(event)
            self.events.append(event)
            n += 1
        return n

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> SpecStreamClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
