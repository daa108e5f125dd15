"""A transport peer in its own process, for fault tests (kill/stop it mid-transfer).

usage: python peer_proc.py sender ADDRESS NBYTES THROTTLE_BPS
       python peer_proc.py receiver NBYTES
The sender connects to ADDRESS, waits for request 1's announcement, writes a patterned ANCHOR
(finish) and RESIDUAL (finish), prints progress lines and then sleeps until killed.
The receiver prints its address, accepts one session, announces request 1 (ANCHOR 1 MiB, RESIDUAL
NBYTES), prints "announced" and sleeps until killed.
"""

import sys
import time

import numpy as np

from lynx_transport import Endpoint, PriorityPolicy, Stream


def main() -> None:
    role = sys.argv[1]
    if role == "sender":
        address, nbytes, throttle = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        ep = Endpoint(name="peer-tx", policy=PriorityPolicy(chunk_bytes=256 * 1024),
                      peer_timeout_s=2.0, backend_options={"_throttle_bps": throttle})
        s = ep.connect(address, timeout=10)
        src = np.arange(nbytes + (1 << 20), dtype=np.uint64).view(np.uint8)[: nbytes + (1 << 20)]
        reg = ep.register(src)
        s.wait_announcement(1, timeout=10)
        s.write_stream(1, Stream.ANCHOR, reg, 0, 1 << 20)
        s.finish(1, Stream.ANCHOR, aux=b"first-token")
        s.write_stream(1, Stream.RESIDUAL, reg, 1 << 20, nbytes)
        s.finish(1, Stream.RESIDUAL)
        print("posted", flush=True)
        while True:
            time.sleep(1)
    elif role == "receiver":
        nbytes = int(sys.argv[2])
        ep = Endpoint(name="peer-rx", peer_timeout_s=2.0)
        print(ep.address, flush=True)
        s = ep.accept(timeout=20)
        stage = np.zeros(nbytes + (1 << 20), np.uint8)
        reg = ep.register(stage)
        s.announce(1, {Stream.ANCHOR: [(reg.id, 0, 1 << 20)],
                       Stream.RESIDUAL: [(reg.id, 1 << 20, nbytes)]})
        print("announced", flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
