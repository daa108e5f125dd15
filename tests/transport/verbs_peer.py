"""A `verbs`-backend transport peer in its own process, for the peer-death tests (killed mid-run).

usage: python verbs_peer.py sender ADDRESS ANCHOR_BYTES RESIDUAL_BYTES
       python verbs_peer.py receiver ANCHOR_BYTES RESIDUAL_BYTES
sender: connects to ADDRESS, waits for request 1's announcement, writes the ANCHOR (finish, aux
b"first-token") and the RESIDUAL (finish), prints "posted", sleeps until killed.
receiver: prints its control address, accepts one session, announces request 1 (ANCHOR then
RESIDUAL, back to back in one region), prints "announced", sleeps until killed.
The RDMA device and GID come from LYNX_RDMA_DEVICE / LYNX_RDMA_GID_INDEX (set by rdma_vm.sh).
"""

import os
import sys
import time

import numpy as np

from lynx_transport import Endpoint, PriorityPolicy, Stream


def verbs_options() -> dict:
    opts: dict = {"device": os.environ.get("LYNX_RDMA_DEVICE") or None}
    if os.environ.get("LYNX_RDMA_GID_INDEX"):
        opts["gid_index"] = int(os.environ["LYNX_RDMA_GID_INDEX"])
    return opts


def main() -> None:
    role = sys.argv[1]
    policy = PriorityPolicy(chunk_bytes=64 << 10)
    if role == "sender":
        address, n_a, n_r = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        ep = Endpoint(backend="verbs", name="peer-tx", policy=policy, peer_timeout_s=30.0,
                      backend_options=verbs_options())
        s = ep.connect(address, timeout=30)
        reg = ep.register(np.full(n_a + n_r, 7, np.uint8))
        s.wait_announcement(1, timeout=30)
        s.write_stream(1, Stream.ANCHOR, reg, 0, n_a)
        s.finish(1, Stream.ANCHOR, aux=b"first-token")
        s.write_stream(1, Stream.RESIDUAL, reg, n_a, n_r)
        s.finish(1, Stream.RESIDUAL)
        print("posted", flush=True)
    elif role == "receiver":
        n_a, n_r = int(sys.argv[2]), int(sys.argv[3])
        ep = Endpoint(backend="verbs", name="peer-rx", policy=policy, peer_timeout_s=30.0,
                      backend_options=verbs_options())
        print(ep.address, flush=True)
        s = ep.accept(timeout=60)
        if s is None:
            sys.exit("no session within 60 s")
        reg = ep.register(np.zeros(n_a + n_r, np.uint8))
        s.announce(1, {Stream.ANCHOR: [(reg.id, 0, n_a)], Stream.RESIDUAL: [(reg.id, n_a, n_r)]})
        print("announced", flush=True)
    else:
        sys.exit(f"unknown role {role!r}")
    # stay alive until the test kills us; bounded so an orphan cannot linger forever
    time.sleep(300)


if __name__ == "__main__":
    main()
