"""The errors of the SGLang glue. Every error `lynx_sglang` raises on purpose derives from
`LynxError`, so a caller can tell Lynx's refusals from anything else; the codec (`CodecError`) and
the transport (`TransportError`) keep their own bases because they never import this package.
"""

from __future__ import annotations


class LynxError(RuntimeError):
    """Base of the SGLang glue's errors (runtime and tools)."""


class LynxConfigError(LynxError, ValueError):
    """A `--lynx-*` setting (or its combination with SGLang's) that cannot work; raised at launch."""


class UnsupportedSGLangError(LynxError):
    """The installed SGLang, or an SGLang option, is one Lynx cannot run with."""


class KVStreamError(LynxError):
    """A request's KV streams do not fit its plan (sizes, chunks, codec settings, aux data)."""


class SettingsMismatchError(KVStreamError):
    """The prefill and the decode cannot serve a request together: their `--lynx-*` flags, models,
    TP sizes or SGLang options differ (or the decode refused the prefill's session)."""


class RoomDroppedError(LynxError):
    """SGLang let a room go (its request aborted or timed out) while Lynx was still moving it:
    counted as `aborted`, not as bad data."""


class StagingFullError(LynxError):
    """No staging memory for a request within its deadline."""


class SpecStreamError(LynxError):
    """The opt-in speculative-token stream lost events or was given a wrong event."""

