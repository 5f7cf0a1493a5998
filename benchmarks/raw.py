"""Baselines for the benchmark, with no kvferry code in the data path.

``python -m benchmarks.raw mc-recv --bytes N``: registers N pre-faulted
bytes with a Mooncake TransferEngine and prints ``RAW_READY <session>
<addr>``; answers each stdin line ``cpu TOKEN`` with ``RAW_CPU TOKEN
<seconds>`` (its process CPU time); exits when stdin closes, or after
``--lifetime-s``.

``python -m benchmarks.raw mc-send --session S --addr A ...``: writes
``requests`` requests of ``request_bytes`` each into that memory, at most
``concurrency`` in flight, as entries of ``entry_bytes``: the engine's best
pattern (submit, then check every id, sleeping 0.2 ms after a round without
progress: the blocking calls busy-spin; in-order checks with kvferry's
longer sleeps measured about 10% slower here).
Prints ``RAW_RESULT <json>`` with per-request latencies.

``python -m benchmarks.raw mc-pages --session S --addr A ...``: the
same-pages baseline. The receiver's memory is a decode pool (``--buffers``,
``--dst-pages``, see :mod:`benchmarks.pages`); each request writes the
pages a kvferry request of the workload writes (scattered source and
destination pages drawn as ``harness.workload`` draws them), one
descriptor per run of pages adjacent on both sides, per buffer. ``--pattern
submit``: one ``transfer_submit_write`` per descriptor, at most
``--max-inflight`` outstanding, polled in order with sleeps sized to the
outstanding bytes (kvferry's transport waits the same way); ``--pattern
batch``: ``batch_transfer_async_write`` batches, two outstanding, waited on
with ``get_batch_transfer_status``. Prints ``RAW_RESULT <json>``.

``python -m benchmarks.raw nixl-recv|nixl-send|nixl-pages``: the same two
baselines through bare NIXL agents (UCX); see :mod:`benchmarks.raw_nixl`.

``python -m benchmarks.raw sock-recv --bytes N [--host H]``: the link's
limit, a plain TCP stream read into a buffer; prints ``SOCK_READY port``.

This module uses the Mooncake engine directly on purpose: it is the
baseline that kvferry is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import time

from benchmarks.rawengine import make_engine, pool_buffer, prefaulted_buffer, register_region

ACCEPT_TIMEOUT_S = 120.0  # sock-recv gives up when no sender connects


def mc_recv(args) -> int:
    engine = make_engine(args.hostname, args.protocol, args.device)
    buf, addr = pool_buffer(args.bytes, args.pool_device)
    register_region(engine, addr, args.bytes)
    print(f"RAW_READY {args.hostname}:{engine.get_rpc_port()} {addr}", flush=True)
    serve_cpu_queries(args.lifetime_s)
    return 0


def serve_cpu_queries(lifetime_s: float) -> None:
    """A raw receiver's main loop: until the benchmark closes our stdin, or at
    most ``lifetime_s``. A line "cpu TOKEN" asks for this process's CPU time
    (the engine's receiving threads), which the benchmark adds to the sender's."""
    deadline, pending = time.monotonic() + lifetime_s, b""
    while select.select([sys.stdin], [], [], max(0.0, deadline - time.monotonic()))[0]:
        data = os.read(sys.stdin.fileno(), 4096)  # unbuffered: select sees every line
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for words in (line.split() for line in lines):
            if len(words) == 2 and words[0] == b"cpu":
                print(f"RAW_CPU {words[1].decode(errors='replace')} {time.process_time()}", flush=True)


def mc_send(args) -> int:
    engine = make_engine(args.hostname, args.protocol, args.device)
    src, base = pool_buffer(args.request_bytes, args.pool_device)
    register_region(engine, base, args.request_bytes)
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
    srv = socket.create_server((args.host, 0))
    srv.settimeout(ACCEPT_TIMEOUT_S)
    print(f"SOCK_READY {srv.getsockname()[1]}", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(ACCEPT_TIMEOUT_S)
    buf = prefaulted_buffer(min(args.bytes, 64 << 20))
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
    ap.add_argument("mode", choices=["mc-recv", "mc-send", "mc-pages", "sock-recv", "nixl-recv", "nixl-send",
                                     "nixl-pages"])
    ap.add_argument("--bytes", type=int, default=0)
    ap.add_argument("--hostname", default="127.0.0.1", help="this engine's address, as the peer reaches it")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--device", default="", help="RDMA NIC (empty: the engine picks)")
    ap.add_argument("--pool-device", default="cpu", help="mc-recv, mc-send: buffers on cpu, cuda or cuda:N")
    ap.add_argument("--host", default="127.0.0.1", help="sock-recv: the address to listen on")
    ap.add_argument("--lifetime-s", type=float, default=3600.0, help="mc-recv: exit after this long at most")
    ap.add_argument("--session", default="")
    ap.add_argument("--addr", type=int, default=0)
    ap.add_argument("--request-bytes", type=int, default=0)
    ap.add_argument("--entry-bytes", type=int, default=4 << 20)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=1)
    pages = ap.add_argument_group("mc-pages (see benchmarks.pages)")
    pages.add_argument("--buffers", default="", help="the pool's buffers, COUNTxPAGE_BYTES[,...]")
    pages.add_argument("--src-pages", type=int, default=0, help="pages of the source (prefill) pool")
    pages.add_argument("--dst-pages", type=int, default=0, help="pages of the destination (decode) pool")
    pages.add_argument("--page-size", type=int, default=16, help="tokens per page")
    pages.add_argument("--tokens", type=int, default=0, help="tokens per request")
    pages.add_argument("--seed", type=int, default=1234)
    pages.add_argument("--first-room", type=int, default=1000)
    pages.add_argument("--pattern", choices=["submit", "batch"], default="submit")
    pages.add_argument("--max-inflight", type=int, default=1024, help="descriptors outstanding at most")
    nixl = ap.add_argument_group("nixl-recv, nixl-send, nixl-pages (see benchmarks.raw_nixl)")
    nixl.add_argument("--meta", default="", help="nixl-send, nixl-pages: the receiver's agent metadata, hex")
    nixl.add_argument("--progress-delay-us", type=int, default=100,
                      help="the UCX progress threads' poll delay (NIXL's Python API uses 0: a busy spin)")
    nixl.add_argument("--timeout-s", type=float, default=600.0, help="nixl-send, nixl-pages: give up after this")
    args = ap.parse_args(argv)
    if args.mode.startswith("nixl-"):
        from benchmarks import raw_nixl
        code = {"nixl-recv": raw_nixl.nixl_recv, "nixl-send": raw_nixl.nixl_send,
                "nixl-pages": raw_nixl.nixl_pages}[args.mode](args)
    elif args.mode == "mc-pages":
        from benchmarks.raw_pages import mc_pages
        code = mc_pages(args)
    else:
        code = {"mc-recv": mc_recv, "mc-send": mc_send, "sock-recv": sock_recv}[args.mode](args)
    sys.stdout.flush()
    os._exit(code)  # skip the engine's slow destructor


if __name__ == "__main__":
    main()
