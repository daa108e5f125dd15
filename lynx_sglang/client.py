"""Minimal HTTP client for SGLang's native /generate endpoint (a server or the PD router).

Used by the tests and the demo to get greedy `output_ids`; every call has a timeout.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass


class GenerateError(RuntimeError):
    pass


@dataclass(frozen=True)
class Generation:
    text: str
    output_ids: list[int]
    finish_reason: dict | None
    meta: dict


def generate(url: str, *, text: str | None = None, input_ids: list[int] | None = None,
             max_new_tokens: int = 16, timeout_s: float = 300.0,
             sampling: dict | None = None) -> Generation:
    """Greedy (temperature 0) unless `sampling` overrides it; raises GenerateError on HTTP errors
    or an error reported by the server."""
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text / input_ids")
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    params.update(sampling or {})
    body = {"sampling_params": params}
    if text is not None:
        body["text"] = text
    else:
        body["input_ids"] = input_ids
    req = urllib.request.Request(
        url.rstrip("/") + "/generate", data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise GenerateError(f"HTTP {exc.code}: {exc.read()[:2000]!r}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise GenerateError(f"request to {url} failed: {exc}") from exc
    meta = reply.get("meta_info", {})
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise GenerateError(f"request aborted: {finish.get('message')}")
    return Generation(reply.get("text", ""), list(reply.get("output_ids", [])), finish, meta)
