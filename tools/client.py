"""Minimal HTTP client for SGLang's native /generate endpoint (a server or the PD router).

Used by the tests and the demo to get greedy `output_ids`; every call has a timeout.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass

import requests

from lynx_sglang.errors import LynxError


class GenerateError(LynxError):
    pass


@dataclass(frozen=True)
class Generation:
    text: str
    output_ids: list[int]
    finish_reason: dict | None
    meta: dict


def generate(url: str, *, text: str | None = None, input_ids: list[int] | None = None,
             max_new_tokens: int = 16, timeout_s: float = 300.0,
             sampling: dict | None = None, rid: str | None = None,
             fields: dict | None = None) -> Generation:
    """Greedy (temperature 0) unless `sampling` overrides it; raises GenerateError on HTTP errors
    or an error reported by the server. `rid` names the request (its spec stream topic);
    `fields`: other /generate fields (e.g. return_logprob, top_logprobs_num)."""
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text / input_ids")
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    params.update(sampling or {})
    body = {**(fields or {}), "sampling_params": params}
    if rid is not None:
        body["rid"] = rid
    if text is not None:
        body["text"] = text
    else:
        body["input_ids"] = input_ids
    try:
        r = requests.post(url.rstrip("/") + "/generate", json=body, timeout=timeout_s)
    except requests.RequestException as exc:
        raise GenerateError(f"request to {url} failed: {exc}") from exc
    if not r.ok:
        raise GenerateError(f"HTTP {r.status_code}: {r.content[:2000]!r}")
    reply = r.json()
    meta = reply.get("meta_info", {})
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise GenerateError(f"request aborted: {finish.get('message')}")
    return Generation(reply.get("text", ""), list(reply.get("output_ids", [])), finish, meta)


@dataclass(frozen=True)
class StreamedGeneration:
    """A streamed /generate: wall-clock `time.time()` of the send, of the first chunk carrying a
    token and of the last one, when each output token arrived (`t_tokens[i]`: the chunk that
    carried token i), all output ids, the final text and the prompt tokens the server found in
    its prefix cache."""

    output_ids: list[int]
    prompt_tokens: int
    t_send: float
    t_first_token: float
    t_last_token: float
    t_tokens: tuple[float, ...] = ()
    text: str = ""
    cached_tokens: int = 0


def generate_stream(url: str, *, input_ids: list[int] | None = None, text: str | None = None,
                    max_new_tokens: int = 16, timeout_s: float = 300.0,
                    sampling: dict | None = None, rid: str | None = None,
                    fields: dict | None = None) -> StreamedGeneration:
    """Greedy /generate with `"stream": true` (unless `sampling` overrides it), reading SGLang's
    server-sent events. `timeout_s` bounds the connect and each socket read; `rid` names the
    request (for /abort_request); `fields`: other /generate fields (e.g. return_logprob); raises
    GenerateError on HTTP errors, aborts or an empty stream."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    params.update(sampling or {})
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text / input_ids")
    body = {**(fields or {}), "stream": True, "sampling_params": params}
    if rid is not None:
        body["rid"] = rid
    body.update({"text": text} if text is not None else {"input_ids": input_ids})
    chunks: list[list[int]] = []
    t_chunks: list[float] = []
    texts: list[str] = []
    t_first = t_last = None
    meta: dict = {}
    t_send = time.time()
    try:
        with requests.post(url.rstrip("/") + "/generate", json=body, stream=True,
                           timeout=timeout_s) as r:
            if not r.ok:
                raise GenerateError(f"HTTP {r.status_code}: {r.content[:2000]!r}")
            # SGLang sends each event as one HTTP chunk, and chunked reads return at a chunk's
            # end, so a token's time is when its chunk arrived, not when a read buffer filled.
            for raw in r.iter_lines():
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise GenerateError(f"server error: {event['error']}")
                meta = event.get("meta_info", meta)
                finish = meta.get("finish_reason")
                if isinstance(finish, dict) and finish.get("type") == "abort":
                    raise GenerateError(f"request aborted: {finish.get('message')}")
                ids = list(event.get("output_ids", []))
                if ids:
                    now = time.time()
                    t_first = t_first or now
                    t_last = now
                    chunks.append(ids)
                    t_chunks.append(now)
                    texts.append(event.get("text") or "")
    except requests.RequestException as exc:
        raise GenerateError(f"request to {url} failed: {exc}") from exc
    if t_first is None:
        raise GenerateError("the stream carried no output token")
    # SGLang streams either the new ids per chunk or all ids so far; completion_tokens tells which.
    n = meta.get("completion_tokens", 0)
    flat = [i for c in chunks for i in c]
    # Text follows the same setting (SGLang's --incremental-streaming-output).
    incremental = len(flat) == n
    text = "".join(texts) if incremental else texts[-1]
    output_ids = flat if incremental else chunks[-1]
    if not incremental:
        for before, after in itertools.pairwise(chunks):
            if after[: len(before)] != before:
                raise GenerateError("the stream took back tokens it had sent: a chunk does not "
                                    "extend the previous one")
    if len(output_ids) != n:
        raise GenerateError(f"stream gave {len(flat)} ids in {len(chunks)} chunks, "
                            f"server says {n} completion tokens")
    t_tokens: list[float] = []
    for ids, t in zip(chunks, t_chunks, strict=True):
        # Incremental chunks carry their new ids; cumulative ones all ids so far.
        new = len(ids) if incremental else len(ids) - len(t_tokens)
        t_tokens += [t] * new
    return StreamedGeneration(output_ids, int(meta.get("prompt_tokens", len(input_ids or ()))),
                              t_send, t_first, t_last, tuple(t_tokens), text,
                              int(meta.get("cached_tokens", 0)))
