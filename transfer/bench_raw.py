"""Baselines for the benchmark, with no kvferry code in the data path.

``python -m transfer.bench_raw mc-recv --bytes N``: registers N pre-faulted
bytes with a Mooncake TransferEngine and prints ``RAW_READY <session>
<addr>``; exits when stdin closes.

``python -m transfer.bench_raw mc-send --session S --addr A ...``: writes
``requests`` requests of ``request_bytes`` each into that memory, at most
``concurrency`` in flight, as entries of ``entry_bytes``: the engine's best
pattern (submit, then poll with short sleeps: the blocking calls busy-spin).
Prints ``RAW_RESULT <json>`` with per-request latencies.

``python -m transfer.bench_raw sock-recv --bytes N``: the link's limit on
loopback, a plain TCP stream read into a buffer; prints ``SOCK_READY port``.

This module uses the Mooncake engine directly on purpose: it is the
baseline that kvferry is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np


def _engine(hostname: str, protocol: str):
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    for key in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
        os.environ.setdefault(key, "65535")
    os.environ.setdefault("MC_TCP_ADMISSION_TIMEOUT_MS", "60000")
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    if engine.initialize(hostname, "P2PHANDSHAKE", protocol, "") != 0:
        raise SystemExit("mooncake initialize failed")
    return engine


def _buffer(nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0x5A)  # pre-fault
    return buf


def mc_recv(args) -> int:
    engine = _engine(args.hostname, args.protocol)
    buf = _buffer(args.bytes)
    addr = buf.ctypes.data
    if engine.register_memory(addr, args.bytes) != 0:
        raise SystemExit("register_memory failed")
    print(f"RAW_READY {args.hostname}:{engine.get_rpc_port()} {addr}", flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    return 0


def mc_send(args) -> int:
    engine = _engine(args.hostname, args.protocol)
    src = _buffer(args.request_bytes)
    base = src.ctypes.data
    offsets = list(range(0, args.request_bytes, args.entry_bytes))
    lengths = [min(args.entry_bytes, args.request_bytes - o) for o in offsets]
    submit, check = engine.transfer_submit_write, engine.transfer_check_status
    latencies, cpu0 = [], time.process_time()
    pending = list(range(args.requests))
    live: dict[int, tuple[float, list[int]]] = {}
    t0 = None
    while pending or live:
        while pending and len(live) < args.concurrency:
            req = pending.pop(0)
            if req == args.warmup and t0 is None:
                t0, cpu0 = time.monotonic(), time.process_time()
            slot = req % args.concurrency
            dst = args.addr + slot * args.request_bytes
            ids = [submit(args.session, base + o, dst + o, n) for o, n in zip(offsets, lengths)]
            if 0 in ids:
                raise SystemExit("transfer_submit_write failed")
            live[req] = (time.monotonic(), ids)
        progressed = False
        for req, (started, ids) in list(live.items()):
            rest = []
            for tid in ids:
                status = check(tid)
                if status == 0:
                    rest.append(tid)
                elif status != 1:
                    raise SystemExit(f"write failed with status {status}")
            progressed |= len(rest) != len(ids)
            if rest:
                live[req] = (started, rest)
            else:
                del live[req]
                if req >= args.warmup:
                    latencies.append((time.monotonic() - started) * 1e3)
        if not progressed:
            time.sleep(0.0002)
    elapsed = time.monotonic() - t0
    print("RAW_RESULT " + json.dumps({"elapsed_s": elapsed, "cpu_s": time.process_time() - cpu0,
                                      "latencies_ms": latencies,
                                      "bytes": args.request_bytes * (args.requests - args.warmup),
                                      "descriptors_per_request": len(offsets)}), flush=True)
    return 0


def sock_recv(args) -> int:
    srv = socket.create_server(("127.0.0.1", 0))
    print(f"SOCK_READY {srv.getsockname()[1]}", flush=True)
    conn, _ = srv.accept()
    buf = _buffer(min(args.bytes, 64 << 20))
    view = memoryview(buf)
    left = args.bytes
    while left:
        n = conn.recv_into(view[:min(left, len(view))])
        if n == 0:
            break
        left -= n
    conn.sendall(b"k")
    conn.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="kvferry benchmark baselines")
    ap.add_argument("mode", choices=["mc-recv", "mc-send", "sock-recv"])
    ap.add_argument("--bytes", type=int, default=0)
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--session", default="")
    ap.add_argument("--addr", type=int, default=0)
    ap.add_argument("--request-bytes", type=int, default=0)
    ap.add_argument("--entry-bytes", type=int, default=4 << 20)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=1)
    args = ap.parse_args(argv)
    code = {"mc-recv": mc_recv, "mc-send": mc_send, "sock-recv": sock_recv}[args.mode](args)
    sys.stdout.flush()
    os._exit(code)  # skip the engine's slow destructor


if __name__ == "__main__":
    main()
