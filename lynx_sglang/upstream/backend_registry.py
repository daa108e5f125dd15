"""Making `lynx` one of SGLang's transfer backends: the `--disaggregation-transfer-backend` choice,
a `TransferBackend` member added to SGLang's enum in place (SGLang compares members by identity
and builds them with `TransferBackend(name)`; it has no registry for new backends), and the
answer of `get_kv_class` for that member (an AROUND hook that defers to SGLang for every other
backend).

Called by `lynx_sglang.plugin` (`add_cli_choice` in every process at plugin load;
`add_backend_member` and `kv_class_around` where Lynx is selected).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BackendClasses:
    """The classes SGLang builds for one transfer backend (its KV args stay SGLang's own)."""

    manager: type
    sender: type
    receiver: type
    bootstrap_server: type


def add_cli_choice(name: str) -> None:
    """Accept `name` as a `--disaggregation-transfer-backend` value."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )

    if name not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([name])


def add_backend_member(member_name: str, value: str) -> bool:
    """Give SGLang's `TransferBackend` a member `member_name` = `value`; False if it has one with
    that value already (the member is the mark that this was done: no flag of ours records it)."""
    from sglang.srt.disaggregation.utils import TransferBackend

    if value in TransferBackend._value2member_map_:
        return False
    member = object.__new__(TransferBackend)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = TransferBackend
    TransferBackend._member_map_[member_name] = member
    TransferBackend._value2member_map_[value] = member
    TransferBackend._member_names_.append(member_name)
    type.__setattr__(TransferBackend, member_name, member)
    return True


def kv_class_around(member_name: str, classes: Callable[[], BackendClasses]) -> Callable:
    """The AROUND adapter of `get_kv_class`: for member `member_name` the class `classes()` names
    for the asked type (imported only when asked), SGLang's own answer otherwise."""

    def get_kv_class_around(original, transfer_backend, class_type):
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

        if (transfer_backend is not getattr(TransferBackend, member_name)
                or class_type == KVClassType.KVARGS):
            return original(transfer_backend, class_type)
        found = classes()
        return {
            KVClassType.MANAGER: found.manager,
            KVClassType.SENDER: found.sender,
            KVClassType.RECEIVER: found.receiver,
            KVClassType.BOOTSTRAP_SERVER: found.bootstrap_server,
        }.get(class_type)

    return get_kv_class_around
