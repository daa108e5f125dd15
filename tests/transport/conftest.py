"""Fixtures shared by the transport test modules: `pair`, a connected endpoint pair, closed after
each test. Over the `verbs` backend in the soft-RoCE guest modules (test_verbs_datapath.py,
test_verbs_faults.py: their `pytestmark` is `verbs_guest.GUEST_MARKS`, with `rdma_vm`), over tcp
in the loopback ones (test_loopback_*.py). A module that needs another pair defines its own
`pair` (test_hostile_peer.py: with a secret), which pytest prefers to this one."""

from __future__ import annotations

import pytest
from session_pair import tcp_pair
from verbs_guest import verbs_pair


@pytest.fixture
def pair(request):
    """(receiver endpoint, sender endpoint, receiver session, sender session)."""
    if request.node.get_closest_marker("rdma_vm") is not None:
        yield from verbs_pair()
    else:
        yield from tcp_pair()
