"""Lynx server configuration: the `--lynx-*` flags of an SGLang server and how they reach its
worker processes.

`add_lynx_arguments(parser)` adds the flags (with --help text) to SGLang's own argument parser (the
plugin hooks `ServerArgs.add_cli_args`); `LynxConfig.from_namespace` reads them after parsing.
SGLang builds its `ServerArgs` record from its own fields only, so the Lynx settings travel to the
scheduler processes (spawned later, with this process's environment) as JSON in the environment
variable `LYNX_SGLANG_CONFIG`, written by `export_to_env` and read by `LynxConfig.from_env`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

CONFIG_ENV = "LYNX_SGLANG_CONFIG"
# Fault injection for tests only (prefill): seconds to hold a request's Residual back after its
# Anchor stream is finished, so a test can kill the prefill between the two.
FAULT_RESIDUAL_DELAY_ENV = "LYNX_SGLANG_FAULT_RESIDUAL_DELAY_S"
TRANSPORTS = ("tcp", "verbs")
TARGETS = ("int8", "exact")
K_GROUPINGS = ("channel", "token")
GROUP_SIZES = (32, 64, 128)


class LynxConfigError(ValueError):
    pass


@dataclass(frozen=True)
class LynxConfig:
    """Everything a Lynx prefill or decode server needs beyond SGLang's own arguments.

    Both ends must use the same codec settings; the decode side checks every chunk header against
    its own (a mismatch fails the request with the differing field named).
    """

    anchor_bits: int = 4
    group_size: int = 64
    target: str = "int8"
    k_grouping: str = "channel"
    # Anchor defaults from the anchor study (README "Anchor defaults: what we measured"): rotation +
    # 4 sink + 16 recent protected tokens cut the naive Anchor's disagreement with exact decoding
    # from 6.1% to 1.9% on SmolLM2 for +0.01 of BF16 bytes.
    sink_tokens: int = 4
    recent_tokens: int = 16
    rotate: bool = True
    transport: str = "tcp"
    ib_device: str | None = None
    chunk_tokens: int = 256
    staging_mib: int = 256
    connect_timeout_s: float = 30.0
    transfer_timeout_s: float = 120.0
    # Speculative decoding on the Anchor (decode side; lynx_sglang.speculation).
    speculate: bool = True
    # False: send the Anchor only and serve it as the final KV (a lossy benchmark baseline).
    residual: bool = True
    spec_max_tokens: int = 32
    spec_deadline_s: float = 30.0
    # Decode: publish speculative tokens and rollbacks on this port (0: off; spec_stream).
    spec_stream_port: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.anchor_bits <= 6:
            raise LynxConfigError(f"--lynx-anchor-bits must be in 2..6, got {self.anchor_bits}")
        if self.group_size not in GROUP_SIZES:
            raise LynxConfigError(
                f"--lynx-group-size must be one of {GROUP_SIZES}, got {self.group_size}"
            )
        if self.target not in TARGETS:
            raise LynxConfigError(f"--lynx-target must be one of {TARGETS}, got {self.target!r}")
        if self.k_grouping not in K_GROUPINGS:
            raise LynxConfigError(
                f"--lynx-k-grouping must be one of {K_GROUPINGS}, got {self.k_grouping!r}"
            )
        for name in ("sink_tokens", "recent_tokens"):
            if getattr(self, name) < 0:
                raise LynxConfigError(f"--lynx-{name.replace('_', '-')} must be >= 0")
        if self.transport not in TRANSPORTS:
            raise LynxConfigError(
                f"--lynx-transport must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.group_size:
            raise LynxConfigError(
                f"--lynx-chunk-tokens must be a positive multiple of --lynx-group-size "
                f"({self.group_size}): K grouped per channel is cut on group boundaries; "
                f"got {self.chunk_tokens}"
            )
        if self.staging_mib <= 0:
            raise LynxConfigError(f"--lynx-staging-mib must be positive, got {self.staging_mib}")
        for name in ("connect_timeout_s", "transfer_timeout_s", "spec_deadline_s"):
            if not getattr(self, name) > 0:
                raise LynxConfigError(f"--lynx-{name.replace('_', '-')} must be > 0")
        if self.speculate and not self.residual:
            raise LynxConfigError("--no-lynx-residual serves the Anchor as the final KV: there is "
                                  "nothing to verify, pass --no-lynx-speculate too")
        if not 0 <= self.spec_stream_port <= 65535:
            raise LynxConfigError(
                f"--lynx-spec-stream-port must be in 0..65535, got {self.spec_stream_port}")
        if self.spec_stream_port and not self.speculate:
            raise LynxConfigError("--lynx-spec-stream-port streams speculative tokens: it needs "
                                  "--lynx-speculate")
        if self.spec_max_tokens < 0:
            raise LynxConfigError(
                f"--lynx-spec-max-tokens must be >= 0, got {self.spec_max_tokens}"
            )

    def codec_spec(self):
        from lynx_kernels import CodecSpec

        return CodecSpec(
            anchor_bits=self.anchor_bits,
            group_size=self.group_size,
            target=self.target,
            k_grouping=self.k_grouping,
            sink_tokens=self.sink_tokens,
            recent_tokens=self.recent_tokens,
            rotate=self.rotate,
        )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> LynxConfig:
        return cls(**{f.name: getattr(ns, "lynx_" + f.name) for f in dataclasses.fields(cls)})

    def export_to_env(self) -> None:
        os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> LynxConfig | None:
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            return None
        try:
            return cls(**json.loads(raw))
        except (TypeError, json.JSONDecodeError) as exc:
            raise LynxConfigError(f"bad {CONFIG_ENV}={raw!r}: {exc}") from exc


def add_lynx_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `--lynx-*` flags (used only with --disaggregation-transfer-backend lynx)."""
    d = LynxConfig()
    g = parser.add_argument_group(
        "Lynx KV transfer (with --disaggregation-transfer-backend lynx; "
        "set the same values on prefill and decode)"
    )
    g.add_argument("--lynx-anchor-bits", type=int, default=d.anchor_bits,
                   help="top bits of each INT8 KV code sent in the high-priority Anchor stream "
                        f"(2..6, default {d.anchor_bits}); the Residual carries the rest")
    g.add_argument("--lynx-group-size", type=int, choices=GROUP_SIZES, default=d.group_size,
                   help=f"values per quantization scale/zero group (default {d.group_size})")
    g.add_argument("--lynx-target", choices=TARGETS, default=d.target,
                   help="what Anchor+Residual reconstruct on decode: 'int8' = the INT8-quantized "
                        "KV (about half the bytes of BF16), 'exact' = the prefill KV bit for bit "
                        f"(default {d.target})")
    g.add_argument("--lynx-k-grouping", choices=K_GROUPINGS, default=d.k_grouping,
                   help="K quantization groups: 'channel' (over tokens, KIVI-style) or 'token' "
                        f"(default {d.k_grouping}); V is always grouped per token")
    g.add_argument("--lynx-sink-tokens", type=int, default=d.sink_tokens,
                   help="first tokens of each request carried at full precision in the Anchor "
                        f"(default {d.sink_tokens})")
    g.add_argument("--lynx-recent-tokens", type=int, default=d.recent_tokens,
                   help="last tokens of each request carried at full precision in the Anchor "
                        f"(default {d.recent_tokens})")
    g.add_argument("--lynx-rotate", action=argparse.BooleanOptionalAction, default=d.rotate,
                   help="random-sign Hadamard rotation over head_dim before quantizing (needs a "
                        f"power-of-two head_dim; default {'on' if d.rotate else 'off'})")
    g.add_argument("--lynx-transport", choices=TRANSPORTS, default=d.transport,
                   help=f"data plane for the two KV streams (default {d.transport})")
    g.add_argument("--lynx-ib-device", default=d.ib_device,
                   help="RDMA device for --lynx-transport verbs (e.g. mlx5_0, rxe0; default: the "
                        "first device)")
    g.add_argument("--lynx-chunk-tokens", type=int, default=d.chunk_tokens,
                   help="tokens per wire chunk, a multiple of the group size "
                        f"(default {d.chunk_tokens})")
    g.add_argument("--lynx-staging-mib", type=int, default=d.staging_mib,
                   help="registered staging memory per server for in-flight requests' encoded "
                        f"KV, in MiB (default {d.staging_mib})")
    g.add_argument("--lynx-connect-timeout-s", type=float, default=d.connect_timeout_s,
                   help="deadline for the prefill to connect to a decode's data endpoint "
                        f"(default {d.connect_timeout_s:g} s)")
    g.add_argument("--lynx-transfer-timeout-s", type=float, default=d.transfer_timeout_s,
                   help="deadline on decode from a request's transfer start to its last Residual "
                        f"chunk; past it the request fails (default {d.transfer_timeout_s:g} s)")
    g.add_argument("--lynx-speculate", action=argparse.BooleanOptionalAction, default=d.speculate,
                   help="decode: start generating as soon as a request's Anchor has landed, then "
                        "verify the speculative tokens with one forward once the Residual is in "
                        "and roll back what the exact KV disagrees with; SGLang's own output only "
                        "ever carries verified tokens (see --lynx-spec-stream-port); greedy and "
                        "plain-temperature requests speculate; "
                        "top-k/top-p/min-p, logprob, grammar, penalty and hidden-state requests "
                        "wait for the Residual instead. "
                        f"Default {'on' if d.speculate else 'off'}")
    g.add_argument("--lynx-residual", action=argparse.BooleanOptionalAction, default=d.residual,
                   help="send the Residual stream; --no-lynx-residual sends only the Anchor and "
                        "the decode keeps Anchor-precision KV (lossy, like plain low-bit KV "
                        "quantization: a benchmark baseline, needs --no-lynx-speculate)")
    g.add_argument("--lynx-spec-max-tokens", type=int, default=d.spec_max_tokens,
                   help="cap on speculative tokens per request; a request that reaches it waits "
                        f"for its Residual (default {d.spec_max_tokens})")
    g.add_argument("--lynx-spec-deadline-s", type=float, default=d.spec_deadline_s,
                   help="stop speculating on a request whose Residual has not landed this long "
                        f"after its Anchor, and wait for it (default {d.spec_deadline_s:g} s)")
    g.add_argument("--lynx-spec-stream-port", type=int, default=d.spec_stream_port,
                   help="decode, opt-in: also publish every speculative token, and the outcome of "
                        "every verification (tokens accepted, rolled back, corrected), on a ZMQ "
                        "PUB socket at --host:PORT (plus the DP rank), one topic per request id, "
                        "for clients that want provisional tokens early (lynx_sglang.spec_stream "
                        "has the event format and a client). SGLang's own stream still carries "
                        "verified tokens only. Default 0: off")
