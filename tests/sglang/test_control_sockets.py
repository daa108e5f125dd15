"""SGLang's cached control-plane sockets (the status/registration PUSH sockets of
`CommonKVManager._connect`) as LynxKVManager keeps them: a peer that has gone away (or was gone
before it was dialled) leaves no socket behind once another peer is dialled. Real zmq sockets
over loopback TCP; the manager is built without its SGLang start-up (only the socket cache is
exercised)."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import zmq

from lynx_sglang.backend.peer_sockets import PeerSockets


@pytest.fixture(scope="module")
def manager_class(sglang_in_process):
    from lynx_sglang.backend.manager import LynxKVManager

    return LynxKVManager


@pytest.fixture
def manager(manager_class):
    mgr = manager_class.__new__(manager_class)
    mgr._zmq_ctx = zmq.Context()
    mgr._socket_lock = threading.Lock()
    mgr._socket_cache, mgr._monitor_cache, mgr._socket_send_locks = {}, {}, {}
    mgr.defer_decode_allocation = False
    mgr.peer_sockets = PeerSockets()
    yield mgr
    for sock in [*mgr._socket_cache.values(), *mgr._monitor_cache.values()]:
        sock.close(linger=0)
    mgr._zmq_ctx.term()


@pytest.fixture
def new_peer():
    """new_peer() -> (PULL socket, its endpoint): a peer process's receiving socket, on a fresh
    port each time (as a restarted decode's)."""
    ctx = zmq.Context()

    def make() -> tuple[zmq.Socket, str]:
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        return pull, f"tcp://127.0.0.1:{port}"

    yield make
    ctx.destroy(linger=0)


def _send(mgr, endpoint: str, peer: zmq.Socket) -> None:
    mgr._send_multipart_locked(endpoint, [b"status"])
    assert peer.poll(5000), "the peer never got the message"
    assert peer.recv_multipart() == [b"status"]


def _fds() -> int:
    return psutil.Process().num_fds()


def test_a_departed_peer_socket_is_closed_when_another_peer_is_dialled(manager, new_peer):
    first, first_ep = new_peer()
    _send(manager, first_ep, first)
    first.close(linger=0)  # the peer process dies: its connection drops
    deadline = time.monotonic() + 10
    while manager._monitor_cache[first_ep].poll(0) == 0:
        assert time.monotonic() < deadline, "no disconnect event within 10 s"
        time.sleep(0.05)
    baseline = _fds()
    # Restarts on new ports, each time the old peer's socket is left unanswered.
    for _ in range(5):
        peer, endpoint = new_peer()
        _send(manager, endpoint, peer)
        assert first_ep not in manager._socket_cache
        peer.close(linger=0)
        time.sleep(0.3)
        first_ep = endpoint
    assert list(manager._socket_cache) in ([first_ep], [])
    assert _fds() <= baseline + 4  # one peer's socket and monitor, at most


def _dead_endpoint() -> str:
    """An endpoint nobody listens on: a decode killed before the prefill first dialled it."""
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as sock:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


def test_a_socket_dialled_to_a_dead_peer_is_closed_once_idle(manager, new_peer):
    """zmq reports a connection that never came up as EVENT_CLOSED, which SGLang's monitor (it
    watches disconnects) never sees: only the idle rule closes such a socket. Before it, each
    decode killed before its room's status went out left 3 fds on the prefill for good (the
    fault matrix's decode/sigkill/before-anchor cells)."""
    manager.peer_sockets.idle_close_s = 0.5
    live, live_ep = new_peer()
    _send(manager, live_ep, live)  # the context's I/O thread is up before the baseline
    time.sleep(0.3)
    baseline = _fds()
    dead = []
    for _ in range(6):
        endpoint = _dead_endpoint()
        manager._send_multipart_locked(endpoint, [b"failed"])  # "succeeds": nobody gets it
        dead.append(endpoint)
    time.sleep(0.3)
    assert all(manager._monitor_cache[e].poll(0) == 0 for e in dead), \
        "a monitor saw the failed connect: the idle rule would not be needed"
    assert _fds() >= baseline + 6
    time.sleep(0.6)
    _send(manager, live_ep, live)
    assert list(manager._socket_cache) == [live_ep]
    time.sleep(0.5)  # zmq's reaper closes sockets asynchronously
    assert _fds() <= baseline + 2


def test_a_live_peer_closed_for_idleness_still_gets_the_next_message(manager, new_peer):
    manager.peer_sockets.idle_close_s = 0.3
    a, a_ep = new_peer()
    b, b_ep = new_peer()
    _send(manager, a_ep, a)
    first = manager._socket_cache[a_ep]
    time.sleep(0.5)
    _send(manager, b_ep, b)
    assert a_ep not in manager._socket_cache
    _send(manager, a_ep, a)  # dialled again
    assert manager._socket_cache[a_ep] is not first


def test_a_live_peer_socket_is_kept(manager, new_peer):
    a, a_ep = new_peer()
    b, b_ep = new_peer()
    _send(manager, a_ep, a)
    sock = manager._socket_cache[a_ep]
    _send(manager, b_ep, b)
    _send(manager, a_ep, a)
    assert manager._socket_cache[a_ep] is sock


def test_a_socket_busy_sending_is_left_for_a_later_call(manager, new_peer):
    a, a_ep = new_peer()
    b, b_ep = new_peer()
    _send(manager, a_ep, a)
    a.close(linger=0)
    time.sleep(0.5)
    with manager._socket_send_locks[a_ep]:
        _send(manager, b_ep, b)
        assert a_ep in manager._socket_cache
    _send(manager, b_ep, b)
    assert a_ep not in manager._socket_cache


def test_a_dead_prefill_ranks_receiver_socket_closes_when_the_rank_is_forgotten(manager,
                                                                               new_peer):
    """The decode's side: SGLang's receivers share one PUSH socket per prefill rank endpoint
    (`CommonKVReceiver._connect`, class-level), which SGLang closes only when its heartbeat
    declares the prefill failed. Lynx forgets a dead rank itself
    (`DecodeRole.forget_prefill_rank`) and now closes that socket with it: a prefill restarted
    again and again, on a new rank port each time, leaves none behind (before: one socket per
    restart, for the life of the decode)."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    from lynx_sglang.backend.decode.role import DecodeRole

    manager.connection_lock = threading.Lock()
    manager.connection_pool = {}

    def restart_cycle() -> None:
        peer, endpoint = new_peer()
        port = int(endpoint.rsplit(":", 1)[1])
        manager.connection_pool[f"bootstrap-{port}"] = [{"rank_ip": "127.0.0.1",
                                                         "rank_port": port}]
        sock, lock = CommonKVReceiver._connect(endpoint)
        with lock:
            sock.send_multipart([b"kv indices"])
        assert peer.poll(5000) and peer.recv_multipart() == [b"kv indices"]
        peer.close(linger=0)  # the prefill dies
        DecodeRole(manager, lookup_prefill_rank=None).forget_prefill_rank(("127.0.0.1", port))
        assert endpoint not in CommonKVReceiver._socket_cache
        assert not manager.connection_pool

    restart_cycle()  # the shared context's I/O thread starts at its first socket
    time.sleep(0.5)
    baseline = _fds()
    for _ in range(8):
        restart_cycle()
    time.sleep(0.5)  # zmq's reaper closes sockets asynchronously
    assert _fds() <= baseline + 2
