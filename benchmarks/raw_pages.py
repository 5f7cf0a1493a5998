"""``python -m benchmarks.raw mc-pages``: the same-pages raw baseline
(see :mod:`benchmarks.raw` for the command line, and
:mod:`benchmarks.pages` for the pool geometry and the page choice).

Bare Mooncake writing the pages a kvferry request of a scattered workload
writes, without a staging buffer: one descriptor per run of pages adjacent on
both sides, per buffer, in the engine's best patterns. ``submit`` is one
``transfer_submit_write`` per descriptor, at most ``--max-inflight``
outstanding (the engine's per-peer queue must never overflow), polled in
order with sleeps sized to the outstanding bytes, as kvferry's transport
waits; ``batch`` is ``batch_transfer_async_write`` batches of half that, two
outstanding, waited on with ``get_batch_transfer_status`` (which spins, and
is bounded by ``MC_TRANSFER_TIMEOUT``).
"""

from __future__ import annotations

import collections
import json
import time

from benchmarks.pages import ArenaLayout, DecodeAllocator, PageDraw, page_descriptors, parse_buffers, \
    room_source_pages
from benchmarks.rawengine import make_engine, prefaulted_buffer, register_buffer

_PENDING_WINDOW = 64  # pending ids one poll round looks at (as kvferry's transport)
_ASSUMED_BYTES_PER_S = 2e9
_MIN_SLEEP_S, _MAX_SLEEP_S = 20e-6, 1e-3


class _Requests:
    """The request stream of mc-pages: at most ``concurrency`` live; the
    first ``warmup`` ones are left out of the figures."""

    def __init__(self, args, plan) -> None:
        self._plan, self._num, self._warmup, self._conc = plan, args.requests, args.warmup, args.concurrency
        self._next = 0
        self._live: dict[int, tuple[float, list[int]]] = {}  # req -> (started, destination pages)
        self.latencies_ms: list[float] = []
        self.num_bytes = self.num_descriptors = 0
        self.t0 = self.cpu0 = None

    def more(self) -> bool:
        return self._next < self._num

    def can_start(self) -> bool:
        return self._next < self._num and len(self._live) < self._conc

    def start(self) -> tuple[int, tuple[list[int], list[int], list[int]]]:
        """The next request's descriptors (as lists, for the engine's calls);
        its time runs from here (address computation included)."""
        req, self._next = self._next, self._next + 1
        started = time.monotonic()
        if req == self._warmup:
            self.t0, self.cpu0 = started, time.process_time()
        dst_pages, (src, dst, lengths) = self._plan(req)
        if req >= self._warmup:
            self.num_bytes += int(lengths.sum())
            self.num_descriptors += len(lengths)
        self._live[req] = (started, dst_pages)
        return req, (src.tolist(), dst.tolist(), lengths.tolist())

    def finish(self, req: int) -> list[int]:
        """Record a request whose last descriptor landed; returns its destination pages."""
        started, dst_pages = self._live.pop(req)
        if req >= self._warmup:
            self.latencies_ms.append((time.monotonic() - started) * 1e3)
        return dst_pages


def _send_submit(engine, session: str, reqs: _Requests, max_inflight: int, done) -> None:
    submit, check = engine.transfer_submit_write, engine.transfer_check_status
    queued: collections.deque[list] = collections.deque()  # [req, src, dst, lengths, next index]
    outstanding: collections.deque[tuple[int, int, int]] = collections.deque()  # (id, req, bytes)
    left: dict[int, int] = {}
    inflight_bytes = 0
    while reqs.more() or queued or outstanding:
        while reqs.can_start():
            req, (src, dst, lengths) = reqs.start()
            queued.append([req, src, dst, lengths, 0])
            left[req] = len(lengths)
        while queued and len(outstanding) < max_inflight:
            job = queued[0]
            req, src, dst, lengths, i = job
            while i < len(src) and len(outstanding) < max_inflight:
                tid = submit(session, src[i], dst[i], lengths[i])
                if tid == 0:
                    raise SystemExit(f"transfer_submit_write refused descriptor {i} of request {req}")
                outstanding.append((tid, req, lengths[i]))
                inflight_bytes += lengths[i]
                i += 1
            job[4] = i
            if i == len(src):
                queued.popleft()
        pending = 0
        for _ in range(len(outstanding)):  # in order: the engine finishes roughly in order
            if pending >= _PENDING_WINDOW:
                break
            tid, req, nbytes = outstanding.popleft()
            status = check(tid)
            if status == 0:
                outstanding.append((tid, req, nbytes))
                pending += 1
                continue
            if status != 1:
                raise SystemExit(f"write failed with status {status}")
            inflight_bytes -= nbytes
            left[req] -= 1
            if left[req] == 0:
                del left[req]
                done(req)
        if pending >= _PENDING_WINDOW:
            outstanding.rotate(-(len(outstanding) - pending))
        if outstanding:
            time.sleep(min(_MAX_SLEEP_S, max(_MIN_SLEEP_S, inflight_bytes / _ASSUMED_BYTES_PER_S / 4)))


def _send_batch(engine, session: str, reqs: _Requests, max_inflight: int, done) -> None:
    per_batch = max(1, max_inflight // 2)
    queued: collections.deque[list] = collections.deque()
    waiting: collections.deque[tuple[int, int, int]] = collections.deque()  # (batch id, req, entries)
    left: dict[int, int] = {}
    while reqs.more() or queued or waiting:
        while reqs.can_start():
            req, (src, dst, lengths) = reqs.start()
            queued.append([req, src, dst, lengths, 0])
            left[req] = len(lengths)
        while queued and len(waiting) < 2:  # one batch moving while the next is queued behind it
            job = queued[0]
            req, src, dst, lengths, i = job
            j = min(len(src), i + per_batch)
            bid = engine.batch_transfer_async_write(session, src[i:j], dst[i:j], lengths[i:j])
            if bid == 0:
                raise SystemExit(f"batch_transfer_async_write refused request {req}")
            waiting.append((bid, req, j - i))
            job[4] = j
            if j == len(src):
                queued.popleft()
        bid, req, count = waiting.popleft()
        if engine.get_batch_transfer_status([bid]) != 0:  # bounded by MC_TRANSFER_TIMEOUT
            raise SystemExit(f"batch of request {req} failed")
        left[req] -= count
        if left[req] == 0:
            del left[req]
            done(req)


def mc_pages(args) -> int:
    engine = make_engine(args.hostname, args.protocol, args.device)
    buffers = parse_buffers(args.buffers)
    src_layout, dst_layout = ArenaLayout(buffers, args.src_pages), ArenaLayout(buffers, args.dst_pages)
    draw = PageDraw(args.seed, args.tokens, args.tokens, args.page_size, args.src_pages, args.dst_pages)
    src = prefaulted_buffer(src_layout.arena_bytes)
    register_buffer(engine, src)
    alloc = DecodeAllocator(draw)

    def plan(req: int):
        src_pages = room_source_pages(draw, args.first_room + req)
        dst_pages = alloc.take(len(src_pages))
        return dst_pages, page_descriptors(src_layout, dst_layout, src.ctypes.data, args.addr, src_pages, dst_pages)

    reqs = _Requests(args, plan)
    send = _send_submit if args.pattern == "submit" else _send_batch
    send(engine, args.session, reqs, args.max_inflight, lambda req: alloc.give_back(reqs.finish(req)))
    measured = args.requests - args.warmup
    print("RAW_RESULT " + json.dumps({"elapsed_s": time.monotonic() - reqs.t0,
                                      "cpu_s": time.process_time() - reqs.cpu0,
                                      "latencies_ms": reqs.latencies_ms, "bytes": reqs.num_bytes,
                                      "descriptors_per_request": reqs.num_descriptors / measured}), flush=True)
    return 0
