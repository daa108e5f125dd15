"""`VerbsOptions`: the `verbs` backend's `backend_options`, checked once at construction.

Built by `verbs.VerbsBackend` from the Endpoint's `backend_options` (unknown keys or values out of
range raise ValueError); read by its QP setup (`verbs_qp`), sender (`verbs_send`) and completion
handling (`verbs_recv`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .types import Stream


@dataclass(frozen=True)
class VerbsOptions:
    """`backend_options` of the verbs backend (unknown keys raise ValueError).

    device: RDMA device name (like SGLang's --disaggregation-ib-device, e.g. "mlx5_0" or "rxe0");
    None picks the only/first device. gid_index: None picks the GID whose IPv4-mapped address is
    the Endpoint's `host`, else the first IPv4-mapped (RoCE v2) GID, else index 0.
    anchor_sl/residual_sl: service levels; anchor_tc/residual_tc: GRH traffic class (DSCP << 2;
    0xb8 = EF, 0x20 = CS1). max_outstanding: chunks in flight on the Anchor QP;
    residual_outstanding: on the Residual QP (keeps an arriving Anchor behind few Residual chunks).
    ack_timeout: IB local ACK timeout exponent (4.096 µs × 2^n); retry_cnt: transport retries
    (6 by default: soft-RoCE treats 7 as "retry forever", so a dead peer would never be noticed).
    keepalive_s: probe interval for idle sessions. path_mtu: bytes (256…4096) or None for the
    port's active MTU. _corrupt_notice: test-only fault injection, given (session id, stream,
    notice bytes) of every notice about to be posted, returns the bytes to post (None = off).
    """

    device: str | None = None
    gid_index: int | None = None
    anchor_sl: int = 3
    residual_sl: int = 0
    anchor_tc: int = 0xB8
    residual_tc: int = 0x20
    max_outstanding: int = 16
    residual_outstanding: int = 2
    ack_timeout: int = 15
    retry_cnt: int = 6
    keepalive_s: float = 1.0
    path_mtu: int | None = None
    _corrupt_notice: Callable[[bytes, Stream, bytes], bytes] | None = None

    @classmethod
    def from_dict(cls, options: dict) -> VerbsOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown verbs backend option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**options)
        for name in ("anchor_sl", "residual_sl"):
            if not 0 <= getattr(opts, name) <= 15:
                raise ValueError(f"{name} must be in [0, 15]")
        for name in ("anchor_tc", "residual_tc"):
            if not 0 <= getattr(opts, name) <= 255:
                raise ValueError(f"{name} must be in [0, 255]")
        if opts.max_outstanding < 1 or opts.residual_outstanding < 1:
            raise ValueError("max_outstanding and residual_outstanding must be >= 1")
        if not 0 <= opts.ack_timeout <= 31 or not 0 <= opts.retry_cnt <= 7:
            raise ValueError("ack_timeout must be in [0, 31] and retry_cnt in [0, 7]")
        if opts.keepalive_s <= 0:
            raise ValueError("keepalive_s must be > 0")
        if opts.path_mtu is not None and opts.path_mtu not in (256, 512, 1024, 2048, 4096):
            raise ValueError("path_mtu must be one of 256, 512, 1024, 2048, 4096")
        if opts.gid_index is not None and opts.gid_index < 0:
            raise ValueError("gid_index must be >= 0")
        return opts
