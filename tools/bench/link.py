"""Link benchmarks for lynx_transport: raw sockets vs our tcp backend vs Mooncake, priority checks.

Used by `scripts/bench_link.py`, the `netns` tests and `lynx-sglang bench-transfer`. Each side of a
measurement runs in its own process (`python -m lynx_tools.bench.link ROLE JSON`),
normally inside a network namespace of a shaped veth link (`tools.cluster.netns.ShapedLink`); the driver
(`run_pair`) starts both, passes the receiver's address to the sender and collects one JSON line
from each.
Times are `time.monotonic()`, which all processes of one host share (namespaces do not change it).

Experiments (the `program`): a list of {"name", "anchor": bytes, "residual": bytes,
"anchor_delay": s (post the ANCHOR this long after the RESIDUAL; null = ANCHOR first, "alone"
when residual is 0), "repeat": n}. For each repetition the receiver announces one request, the
sender posts it and both record times; the request is released before the next one.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time

import numpy as np

from ..cluster.netns import RECEIVER_IP, SENDER_IP, ShapedLink


def _cpu() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _buffer(nbytes: int, seed: int = 0) -> np.ndarray:
    """A non-constant byte pattern, cheap to build for hundreds of MiB. Its period (1 MiB + 13)
    is no multiple of any chunk or extent size, so misplaced chunks do not compare equal."""
    period = (np.arange((1 << 20) + 13, dtype=np.uint32) * 2654435761 + seed).astype(np.uint8)
    return np.resize(period, nbytes)


# ----------------------------------------------------------------------------- raw sockets
def raw_recv(cfg: dict) -> None:
    n, reps = int(cfg["nbytes"]), int(cfg["repeat"])
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind((cfg["host"], 0))
    lst.listen(1)
    _emit({"address": f"{cfg['host']}:{lst.getsockname()[1]}"})
    conn, _ = lst.accept()
    buf = memoryview(bytearray(min(n, 64 << 20)))
    np.frombuffer(buf, np.uint8).fill(1)  # fault the pages in before timing (like lynx-recv)
    done = []
    cpu0 = _cpu()
    for _ in range(reps):
        got = 0
        while got < n:
            k = conn.recv_into(buf, min(len(buf), n - got))
            if not k:
                raise ConnectionError("closed")
            got += k
        done.append(time.monotonic())
        conn.sendall(b"k")  # let the sender start the next repetition
    _emit({"t_done": done, "cpu_s": _cpu() - cpu0})


def raw_send(cfg: dict) -> None:
    n, reps = int(cfg["nbytes"]), int(cfg["repeat"])
    host, port = cfg["address"].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(_buffer(n))
    starts = []
    cpu0 = _cpu()
    for _ in range(reps):
        starts.append(time.monotonic())
        sock.sendall(data)
        if sock.recv(1) != b"k":
            raise ConnectionError("no ack")
    _emit({"t_start": starts, "cpu_s": _cpu() - cpu0})


# ----------------------------------------------------------------------------- lynx tcp
def _policy(cfg):
    from lynx_transport import PriorityPolicy

    return PriorityPolicy(mode=cfg.get("mode", "strict"),
                          residual_share=float(cfg.get("residual_share", 0.1)),
                          chunk_bytes=int(cfg.get("chunk_bytes", 1 << 20)))


def lynx_recv(cfg: dict) -> None:
    from lynx_transport import Endpoint, Stream

    program = cfg["program"]
    cap_a = max(int(e["anchor"]) for e in program)
    cap_r = max(int(e["residual"]) for e in program)
    with Endpoint(host=cfg["host"], name="bench-rx", checksum=cfg.get("checksum", True),
                  allow_insecure=True,  # a benchmark between private network namespaces
                  policy=_policy(cfg), backend_options=_backend_options(cfg),
                  peer_timeout_s=float(cfg.get("peer_timeout_s", 5.0))) as ep:
        _emit({"address": ep.address})
        s = ep.accept(timeout=30)
        if s is None:
            raise TimeoutError("no sender")
        stage = np.zeros(cap_a + cap_r + 1, np.uint8)
        stage.fill(1)  # staging is pre-registered and reused in real use: fault its pages in now
        reg = ep.register(stage)
        out = []
        rid = 0
        cpu0 = _cpu()
        for e in program:
            for _ in range(int(e.get("repeat", 1))):
                rid += 1
                bounds = {}
                if e["anchor"]:
                    bounds[Stream.ANCHOR] = [(reg.id, 0, int(e["anchor"]))]
                if e["residual"]:
                    bounds[Stream.RESIDUAL] = [(reg.id, cap_a, int(e["residual"]))]
                s.announce(rid, bounds)
                rec = {"name": e["name"], "req": rid}
                for st in bounds:  # ANCHOR first
                    r = s.wait(rid, st, timeout=float(cfg.get("timeout", 120)))
                    if not r.ok and cfg.get("tolerate_failure"):
                        rec["failed"] = _failure(r)
                        _emit({"results": [*out, rec]})
                        return
                    if not r.ok:
                        raise RuntimeError(f"request {rid} {st.name}: {r}")
                    if cfg.get("progress"):
                        _emit({"progress": st.name.lower(), "req": rid})
                    rec[st.name.lower()] = {"t_first": r.t_first_byte, "t_done": r.t_done,
                                            "nbytes": r.nbytes}
                    if st is Stream.ANCHOR and Stream.RESIDUAL in bounds:
                        # RESIDUAL bytes that had landed when the ANCHOR completed
                        rec["residual_at_anchor_done"] = s.recv_state(rid, Stream.RESIDUAL).nbytes
                if cfg.get("verify"):
                    src = _buffer(cap_a + cap_r + 1, 1)
                    na, nr = int(e["anchor"]), int(e["residual"])
                    rec["verified"] = bool(
                        np.array_equal(stage[:na], src[:na])
                        and np.array_equal(stage[cap_a:cap_a + nr], src[cap_a:cap_a + nr]))
                s.release(rid)
                out.append(rec)
        _emit({"results": out, "cpu_s": _cpu() - cpu0})
        time.sleep(0.2)


def _backend_options(cfg: dict) -> dict:
    """The tcp backend's options from a peer's JSON config: TLS travels as the three file paths
    (`tls`: {cert_file, key_file, ca_file}) and both ends use it."""
    from lynx_transport.tls import TlsConfig

    opts = dict(cfg.get("backend_options") or {})
    if cfg.get("tls"):
        opts["tls"] = TlsConfig(**cfg["tls"])
    return opts


def lynx_send(cfg: dict) -> None:
    from lynx_transport import Endpoint, Stream

    program = cfg["program"]
    cap_a = max(int(e["anchor"]) for e in program)
    cap_r = max(int(e["residual"]) for e in program)
    with Endpoint(host=cfg["host"], name="bench-tx", checksum=cfg.get("checksum", True),
                  allow_insecure=True,  # a benchmark between private network namespaces
                  policy=_policy(cfg), backend_options=_backend_options(cfg),
                  peer_timeout_s=float(cfg.get("peer_timeout_s", 5.0))) as ep:
        s = ep.connect(cfg["address"], timeout=30)
        src = ep.register(_buffer(cap_a + cap_r + 1, 1))
        out = []
        rid = 0
        timeout = float(cfg.get("timeout", 120))
        cpu0 = _cpu()
        for e in program:
            for _ in range(int(e.get("repeat", 1))):
                rid += 1
                ann = s.wait_announcement(rid, timeout=timeout)
                na, nr = int(e["anchor"]), int(e["residual"])
                delay = e.get("anchor_delay")
                rec = {"name": e["name"], "req": rid}
                ann_streams = list(ann.bounds)

                def post_a(rec=rec, rid=rid, na=na):
                    rec["anchor_post"] = time.monotonic()
                    s.write_stream(rid, Stream.ANCHOR, src, 0, na)
                    s.finish(rid, Stream.ANCHOR)

                def post_r(rec=rec, rid=rid, nr=nr):
                    rec["residual_post"] = time.monotonic()
                    s.write_stream(rid, Stream.RESIDUAL, src, cap_a, nr)
                    s.finish(rid, Stream.RESIDUAL)

                if na and nr and delay is not None:
                    post_r()
                    time.sleep(float(delay))
                    # RESIDUAL bytes whose chunks were fully handed to the kernel before the
                    # ANCHOR was posted: they may land during the ANCHOR without breaking priority
                    rec["residual_sent_at_anchor_post"] = s.send_state(rid, Stream.RESIDUAL).nbytes
                    post_a()
                else:
                    if na:
                        post_a()
                    if nr:
                        post_r()
                for st in ann_streams:
                    r = s.wait_sent(rid, st, timeout=timeout)
                    if not r.ok and cfg.get("tolerate_failure"):
                        rec["failed"] = _failure(r)
                        _emit({"results": [*out, rec]})
                        return
                    if not r.ok:
                        raise RuntimeError(f"request {rid} {st.name}: {r}")
                s.release(rid)
                out.append(rec)
        _emit({"results": out, "cpu_s": _cpu() - cpu0})


def _failure(st) -> dict:
    return {"stream": st.stream.name.lower(), "status": st.status.value,
            "reason": st.reason.value if st.reason else None, "detail": st.detail}


# ----------------------------------------------------------------------------- mooncake
def mc_recv(cfg: dict) -> None:
    from mooncake.engine import TransferEngine

    n = int(cfg["nbytes"])
    te = TransferEngine()
    if te.initialize(cfg["host"], "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    dst = np.zeros(n, np.uint8)
    if te.register_memory(dst.ctypes.data, n) != 0:
        raise RuntimeError("mooncake register_memory failed")
    dst.fill(1)  # fault the pages in before timing (like the other receivers)
    _emit({"address": f"{cfg['host']}:{te.get_rpc_port()}", "ptr": int(dst.ctypes.data)})
    cpu0 = _cpu()
    sys.stdin.readline()  # the driver closes stdin when the sender is done
    cpu = _cpu() - cpu0
    ok = bool(np.array_equal(dst[:4096], _buffer(4096)))
    _emit({"check": ok, "cpu_s": cpu})


def mc_send(cfg: dict) -> None:
    from mooncake.engine import TransferEngine

    n, reps = int(cfg["nbytes"]), int(cfg["repeat"])
    te = TransferEngine()
    if te.initialize(cfg["host"], "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    src = _buffer(n)
    te.register_memory(src.ctypes.data, n)
    peer, ptr = cfg["address"], int(cfg["ptr"])
    if te.transfer_sync_write(peer, src.ctypes.data, ptr, 4096) != 0:  # open the segment
        raise RuntimeError("mooncake warm-up write failed")
    times = []
    cpu0 = _cpu()
    for _ in range(reps):
        t0 = time.monotonic()
        rc = te.transfer_sync_write(peer, src.ctypes.data, ptr, n)
        t1 = time.monotonic()
        if rc != 0:
            raise RuntimeError(f"mooncake transfer_sync_write returned {rc}")
        times.append([t0, t1])
    _emit({"times": times, "cpu_s": _cpu() - cpu0})


ROLES = {"raw-recv": raw_recv, "raw-send": raw_send, "lynx-recv": lynx_recv,
         "lynx-send": lynx_send, "mc-recv": mc_recv, "mc-send": mc_send}


# ----------------------------------------------------------------------------- driver side
def _spawn(role: str, cfg: dict, netns: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lynx_tools.bench.link", role, json.dumps(cfg)]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "GLOG_minloglevel": "2"})


def start_pair(kind: str, cfg: dict, lab: ShapedLink | None
               ) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Start `kind`-recv in the receiver namespace, then `kind`-send in the sender namespace
    (`kind` in raw | lynx | mc). The caller reads their stdout / waits for them."""
    rx_host = RECEIVER_IP if lab else "127.0.0.1"
    tx_host = SENDER_IP if lab else "127.0.0.1"
    rx = _spawn(f"{kind}-recv", {**cfg, "host": rx_host}, lab.receiver_ns if lab else None)
    try:
        first = json.loads(rx.stdout.readline() or "{}")
        if "address" not in first:
            raise RuntimeError(f"{kind}-recv did not start")
        tx = _spawn(f"{kind}-send", {**cfg, **first, "host": tx_host},
                    lab.sender_ns if lab else None)
    except BaseException:
        rx.kill()
        rx.wait()
        raise
    return rx, tx


def last_json(proc: subprocess.Popen, timeout: float) -> dict:
    """Wait for `proc` and return the last JSON line it printed (raises if it failed)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(proc.args[-2:-1])} failed ({proc.returncode})")
    return json.loads(lines[-1])


def run_pair(kind: str, cfg: dict, lab: ShapedLink | None,
             timeout: float = 300.0) -> tuple[dict, dict]:
    """Run `kind`-recv and `kind`-send to completion; (receiver's, sender's) last JSON line."""
    rx, tx = start_pair(kind, cfg, lab)
    try:
        tx_res = last_json(tx, timeout)
        rx_res = last_json(rx, 30)  # communicate() closes the receiver's stdin: "sender done"
        return rx_res, tx_res
    finally:
        for p in (rx, tx):
            if p.poll() is None:
                p.kill()
                p.wait()


def measure_goodput(lab: ShapedLink | None, nbytes: int, repeat: int, *, mooncake: bool = True,
                    chunk_bytes: int = 1 << 20, checksum: bool = True,
                    backend_options: dict | None = None, raw: bool = True,
                    stream: str = "residual", tls: dict | None = None) -> dict:
    """Seconds and Gbit/s to move `nbytes` with raw sockets, our tcp backend and Mooncake.

    The systems take turns, one transfer each per round, so a change in machine load during the
    run hits all of them alike; medians over `repeat` rounds. `tls` ({cert_file, key_file,
    ca_file}): each round also moves the bytes with our tcp backend's data connections in TLS
    (`lynx_tls_*`, and `ratio_tls_over_plain` of the goodputs)."""
    out: dict = {"nbytes": nbytes, "repeat": repeat, "raw_s": [], "lynx_s": [],
                 "mooncake_s": [], "stream": stream, "checksum": checksum,
                 "lynx_tls_s": [], "raw_cpu_s": [], "lynx_cpu_s": [],
                 "lynx_tls_cpu_s": []}  # [sender, receiver] CPU seconds
    prog = [{"name": "bulk", "anchor": nbytes if stream == "anchor" else 0,
             "residual": 0 if stream == "anchor" else nbytes, "repeat": 1}]
    for _ in range(repeat):
        if raw:
            rx, tx = run_pair("raw", {"nbytes": nbytes, "repeat": 1}, lab)
            out["raw_s"].append(rx["t_done"][0] - tx["t_start"][0])
            out["raw_cpu_s"].append([tx["cpu_s"], rx["cpu_s"]])
        for key, with_tls in (("lynx", None), ("lynx_tls", tls)):
            if key == "lynx_tls" and not tls:
                continue
            rx, tx = run_pair("lynx", {"program": prog, "chunk_bytes": chunk_bytes,
                                       "checksum": checksum, "tls": with_tls,
                                       "backend_options": backend_options or {}}, lab)
            out[f"{key}_s"].append(rx["results"][0][stream]["t_done"]
                                   - tx["results"][0][f"{stream}_post"])
            out[f"{key}_cpu_s"].append([tx["cpu_s"], rx["cpu_s"]])
        if mooncake:
            rx, tx = run_pair("mc", {"nbytes": nbytes, "repeat": 1}, lab)
            out["mooncake_s"].append(tx["times"][0][1] - tx["times"][0][0])
            out.setdefault("mooncake_cpu_s", []).append([tx["cpu_s"], rx["cpu_s"]])
            out["mooncake_check"] = bool(rx.get("check")) and out.get("mooncake_check", True)
    for k in ("raw", "lynx", "lynx_tls", "mooncake"):
        if out[f"{k}_s"]:
            out[f"{k}_gbps"] = nbytes * 8 / 1e9 / float(np.median(out[f"{k}_s"]))
        cpu = out.get(f"{k}_cpu_s")
        if cpu:  # CPU seconds per GB moved, [sender, receiver]: less load-sensitive than time
            out[f"{k}_cpu_s_per_gb"] = [float(np.median([c[i] for c in cpu])) / (nbytes / 1e9)
                                        for i in (0, 1)]
    if raw:
        out["goodput_ratio_lynx_over_raw"] = out["lynx_gbps"] / out["raw_gbps"]
    if tls:
        out["ratio_tls_over_plain"] = out["lynx_tls_gbps"] / out["lynx_gbps"]
    if mooncake:
        out["ratio_lynx_over_mooncake"] = out["lynx_gbps"] / out["mooncake_gbps"]
    return out


def measure_priority(lab: ShapedLink | None, anchor: int, residual: int, repeat: int, *,
                     delay: float = 0.2, chunk_bytes: int = 1 << 20, mode: str = "strict",
                     residual_share: float = 0.1, backend_options: dict | None = None,
                     tls: dict | None = None) -> dict:
    """Anchor completion (post → landed) alone vs with a concurrent large Residual."""
    # interleaved (alone, together, midflight) x repeat, so load changes hit all three alike
    prog = [
        {"name": "alone", "anchor": anchor, "residual": 0, "repeat": 1},
        {"name": "together", "anchor": anchor, "residual": residual, "anchor_delay": 0.0,
         "repeat": 1},
        {"name": "midflight", "anchor": anchor, "residual": residual, "anchor_delay": delay,
         "repeat": 1},
    ] * repeat
    cfg = {"program": prog, "chunk_bytes": chunk_bytes, "mode": mode,
           "residual_share": residual_share, "backend_options": backend_options or {},
           "tls": tls}
    rx, tx = run_pair("lynx", cfg, lab)
    res: dict = {"anchor": anchor, "residual": residual, "repeat": repeat, "delay_s": delay,
                 "chunk_bytes": chunk_bytes, "mode": mode}
    for name in ("alone", "together", "midflight"):
        times, r_times = [], []
        for r, t in zip(rx["results"], tx["results"], strict=True):
            if r["name"] != name:
                continue
            times.append(r["anchor"]["t_done"] - t["anchor_post"])
            if "residual" in r:
                r_times.append(r["residual"]["t_done"] - t["residual_post"])
        res[f"{name}_s"] = times
        if r_times:
            res[f"{name}_residual_s"] = r_times
            pairs = [(r, t) for r, t in zip(rx["results"], tx["results"], strict=True)
                     if r["name"] == name]
            res[f"{name}_residual_bytes_at_anchor_done"] = [
                r["residual_at_anchor_done"] for r, _ in pairs]
            # RESIDUAL bytes that crossed the link while the ANCHOR was queued or being sent
            res[f"{name}_residual_crossing_bytes"] = [
                r["residual_at_anchor_done"] - t["residual_sent_at_anchor_post"]
                for r, t in pairs]
    med = {k: float(np.median(res[f"{k}_s"])) for k in ("alone", "together", "midflight")}
    res["ratio_together"] = med["together"] / med["alone"]
    res["ratio_midflight"] = med["midflight"] / med["alone"]
    res["ratio_worst"] = max(res["ratio_together"], res["ratio_midflight"])
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    role, cfg = argv[0], json.loads(argv[1])
    ROLES[role](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
