"""Which RDMA device and which GID of its port the `verbs` backend uses.

Called once by `verbs.VerbsBackend` at construction, with the pyverbs namespace it imported.
"""

from __future__ import annotations

import contextlib
import ipaddress
from typing import Any

from .types import BackendUnavailableError
from .verbs_qp import PORT


def pick_device(v: Any, wanted: str | None) -> str:
    """`wanted`, or with None the first device; BackendUnavailableError if there is none or
    `wanted` is not one of them."""
    try:
        devices = v.get_device_list()
    except v.PyverbsError as exc:  # no uverbs support in this kernel at all
        raise BackendUnavailableError(f"no RDMA device: {exc}") from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise BackendUnavailableError("no RDMA device found (ibv_get_device_list is empty)")
    if wanted is None:
        return names[0]
    if wanted not in names:
        raise BackendUnavailableError(f"RDMA device {wanted!r} not found; present: {names}")
    return wanted


def pick_gid(v: Any, ctx: Any, gid_index: int | None, host: str, table_len: int) -> int:
    """`gid_index` if given, else the GID whose IPv4-mapped address is `host`, else the first
    IPv4-mapped (RoCE v2) GID, else 0."""
    if gid_index is not None:
        if gid_index >= table_len:
            raise ValueError(f"gid_index {gid_index} >= GID table size {table_len}")
        return gid_index
    want = None
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host)
        if ip.version == 4 and not ip.is_unspecified and not ip.is_loopback:
            want = ipaddress.IPv6Address("::ffff:" + str(ip))
    first_v4 = None
    for i in range(min(table_len, 256)):
        try:
            gid = ipaddress.IPv6Address(str(ctx.query_gid(PORT, i)))
        except (v.PyverbsError, ValueError):
            continue
        if gid.ipv4_mapped is not None:
            if gid == want:
                return i
            if first_v4 is None:
                first_v4 = i
    return first_v4 if first_v4 is not None else 0
