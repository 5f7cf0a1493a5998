"""Raw NIXL baselines (``python -m benchmarks.raw nixl-recv|nixl-send|nixl-pages``):
two processes with NIXL agents on the UCX backend, no kvferry code in the
data path. The UCX transports are UCX's choice unless ``UCX_TLS`` is set
(``UCX_TLS=tcp`` keeps same-host shortcuts such as shared memory and
cross-memory attach out).

``nixl-recv --bytes N``: an agent holding N registered, pre-faulted bytes;
prints ``RAW_READY <addr> <metadata hex>`` (its agent metadata, which the
sender loads with ``add_remote_agent``); then answers ``cpu TOKEN`` lines as
``mc-recv`` does. Its progress thread moves the bytes that arrive (on TCP
nothing lands without it), so its CPU is the receiving side's cost.

``nixl-send``: the ``merged`` baseline: each request's bytes from one
contiguous buffer into a slot of the receiver's, as entries of
``--entry-bytes``. ``nixl-pages``: the ``same-pages`` baseline: the pages a
kvferry request writes (chosen as :mod:`benchmarks.pages` chooses them),
between pools of kvferry's geometry, one descriptor per page and buffer in
the prepared lists (NIXL merges descriptors adjacent on both sides).

NIXL's best pattern, both: each side's descriptors prepared once
(``prep_xfer_dlist``), then per request one ``make_prepped_xfer`` of the
request's indices and one ``transfer``, at most ``--concurrency`` requests
in flight, polled with ``check_xfer_state`` and sleeps sized to the bytes in
flight (the progress threads move the data meanwhile). Prints
``RAW_RESULT <json>``.

The progress threads' poll delay: NIXL's Python API builds every agent with
``pthrDelay`` 0, and its UCX progress thread then never sleeps: on a small
machine it takes a core from the copies (measured on 2 cores: 0.3 GB/s over
UCX_TLS=tcp with 0, 0.8-1.2 GB/s with 100 us). ``--progress-delay-us`` sets
it on both agents (default 100; the row says which). Their UCX backend gets
the parameters kvferry's transport gives its own
(:func:`transfer.transport.nixl.api.backend_params`: UCX's worker lock a
mutex, not a spin lock), so the raw rows and kvferry's differ in the data
path only; ``UCX_USE_MT_MUTEX=n`` in the environment spins again on both.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from benchmarks.pages import ArenaLayout, DecodeAllocator, PageDraw, page_descriptors, parse_buffers, \
    room_source_pages
from benchmarks.rawengine import prefaulted_buffer

_ASSUMED_BYTES_PER_S = 2e9
_MIN_SLEEP_S, _MAX_SLEEP_S = 20e-6, 1e-3
DEFAULT_PROGRESS_DELAY_US = 100


def make_agent(name: str, progress_delay_us: int):
    """A NIXL agent with the UCX backend and a progress thread that waits
    ``progress_delay_us`` between polls (kvferry's transport builds its own the same way)."""
    from transfer.storage.nixl.probe import import_nixl
    from transfer.transport.nixl.api import backend_params, new_agent
    api = import_nixl()
    agent = new_agent(api, name, api.nixl_agent_config(backends=[], enable_prog_thread=True), progress_delay_us)
    agent.create_backend("UCX", backend_params("UCX", {}))
    return agent


def _register(agent, addr: int, nbytes: int) -> None:
    agent.register_memory([(addr, nbytes, 0, "")], "DRAM", backends=["UCX"])


def _descs(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """An Nx3 (address, length, device 0) array, as ``prep_xfer_dlist`` takes."""
    return np.stack([addrs, lengths, np.zeros_like(addrs)], axis=1).astype(np.uint64)


def nixl_recv(args) -> int:
    from benchmarks.raw import serve_cpu_queries
    agent = make_agent(f"kvferry-bench-recv-{os.getpid()}", args.progress_delay_us)
    buf = prefaulted_buffer(args.bytes)
    _register(agent, buf.ctypes.data, args.bytes)
    print(f"RAW_READY {buf.ctypes.data} {agent.get_agent_metadata().hex()}", flush=True)
    serve_cpu_queries(args.lifetime_s)
    return 0


class _Sender:
    """One sender agent, the receiver loaded as its remote, and the request loop."""

    def __init__(self, args) -> None:
        self.agent = make_agent(f"kvferry-bench-send-{os.getpid()}", args.progress_delay_us)
        self.remote = self.agent.add_remote_agent(bytes.fromhex(args.meta))
        self.args = args

    def prep(self, local: np.ndarray, remote: np.ndarray) -> None:
        self.local_side = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM", backends=["UCX"])
        self.remote_side = self.agent.prep_xfer_dlist(self.remote, remote, "DRAM", backends=["UCX"])

    def run(self, plan, done=lambda token: None) -> dict:
        """Every request: ``plan(req)`` -> (local indices, remote indices,
        bytes, descriptors, token), one prepared transfer each; ``done(token)``
        after it lands. Returns the figures over the measured requests."""
        args, agent = self.args, self.agent
        deadline = time.monotonic() + args.timeout_s
        live: dict[int, tuple[float, object, int, object]] = {}
        latencies, nbytes_total, descriptors, inflight = [], 0, 0, 0
        t0 = cpu0 = None
        next_req = 0
        while next_req < args.requests or live:
            while next_req < args.requests and len(live) < args.concurrency:
                started = time.monotonic()
                if next_req == args.warmup:
                    t0, cpu0 = started, time.process_time()
                local_idx, remote_idx, nbytes, num_desc, token = plan(next_req)
                handle = agent.make_prepped_xfer("WRITE", self.local_side, local_idx, self.remote_side, remote_idx,
                                                 backends=["UCX"])
                if agent.transfer(handle) == "ERR":
                    raise SystemExit(f"NIXL refused request {next_req}")
                if next_req >= args.warmup:
                    nbytes_total += nbytes
                    descriptors += num_desc
                live[next_req] = (started, handle, nbytes, token)
                inflight += nbytes
                next_req += 1
            progressed = False
            for req, (started, handle, nbytes, token) in list(live.items()):
                state = agent.check_xfer_state(handle)
                if state == "PROC":
                    continue
                if state != "DONE":
                    raise SystemExit(f"NIXL write of request {req} failed ({state})")
                agent.release_xfer_handle(handle)
                del live[req]
                inflight -= nbytes
                progressed = True
                if req >= args.warmup:
                    latencies.append((time.monotonic() - started) * 1e3)
                done(token)
            if live and not progressed:
                if time.monotonic() > deadline:
                    raise SystemExit(f"NIXL writes did not finish in {args.timeout_s:.0f} s")
                time.sleep(min(_MAX_SLEEP_S, max(_MIN_SLEEP_S, inflight / _ASSUMED_BYTES_PER_S / 4)))
        measured = args.requests - args.warmup
        return {"elapsed_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0, "latencies_ms": latencies,
                "bytes": nbytes_total, "descriptors_per_request": descriptors / measured}


def nixl_send(args) -> int:
    sender = _Sender(args)
    size, entry = args.request_bytes, args.entry_bytes
    src = prefaulted_buffer(size)
    _register(sender.agent, src.ctypes.data, size)
    offsets = np.arange(0, size, entry, dtype=np.int64)
    lengths = np.minimum(entry, size - offsets)
    k = len(offsets)
    slots = np.arange(args.concurrency, dtype=np.int64)[:, None] * size
    sender.prep(_descs(src.ctypes.data + offsets, lengths),
                _descs((args.addr + slots + offsets[None, :]).ravel(), np.tile(lengths, args.concurrency)))
    local_idx = np.arange(k, dtype=np.int32)

    def plan(req: int):
        return local_idx, local_idx + (req % args.concurrency) * k, size, k, None

    result = sender.run(plan)
    print("RAW_RESULT " + json.dumps(result), flush=True)
    return 0


def nixl_pages(args) -> int:
    sender = _Sender(args)
    buffers = parse_buffers(args.buffers)
    src_layout, dst_layout = ArenaLayout(buffers, args.src_pages), ArenaLayout(buffers, args.dst_pages)
    draw = PageDraw(args.seed, args.tokens, args.tokens, args.page_size, args.src_pages, args.dst_pages)
    src = prefaulted_buffer(src_layout.arena_bytes)
    _register(sender.agent, src.ctypes.data, src_layout.arena_bytes)
    sender.prep(*(page_descs(layout, base) for layout, base in ((src_layout, src.ctypes.data),
                                                                  (dst_layout, args.addr))))
    alloc = DecodeAllocator(draw)

    def plan(req: int):
        src_pages = room_source_pages(draw, args.first_room + req)
        dst_pages = alloc.take(len(src_pages))
        local_idx, remote_idx = page_indices(src_layout, dst_layout, src_pages, dst_pages)
        # descriptors as the Mooncake same-pages row counts them: runs adjacent on both sides, per buffer
        runs = len(page_descriptors(src_layout, dst_layout, 0, 0, src_pages, dst_pages)[2])
        return local_idx, remote_idx, src_layout.request_page_bytes * len(src_pages), runs, dst_pages

    result = sender.run(plan, alloc.give_back)
    print("RAW_RESULT " + json.dumps(result), flush=True)
    return 0


def page_indices(src: ArenaLayout, dst: ArenaLayout, src_pages, dst_pages) -> tuple[np.ndarray, np.ndarray]:
    """The indices, into the lists of :func:`page_descs`, that write page
    ``src_pages[i]`` of every buffer onto ``dst_pages[i]``, buffers in order."""
    buffer_ids = np.arange(len(src.page_bytes), dtype=np.int64)[:, None]
    s, d = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
    return ((buffer_ids * src.num_pages + s[None, :]).ravel().astype(np.int32),
            (buffer_ids * dst.num_pages + d[None, :]).ravel().astype(np.int32))


def page_descs(layout: ArenaLayout, base_addr: int) -> np.ndarray:
    """One descriptor per (buffer, page), buffer-major: index ``b * num_pages + p``."""
    page_bytes = np.array(layout.page_bytes, dtype=np.int64)[:, None]
    pages = np.arange(layout.num_pages, dtype=np.int64)[None, :]
    addrs = base_addr + layout.region_offsets[:, None] + pages * page_bytes
    return _descs(addrs.ravel(), np.broadcast_to(page_bytes, addrs.shape).ravel())
