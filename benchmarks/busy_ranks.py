"""The busy-scheduler benchmark's rank processes (see :mod:`benchmarks.busy`).

``python -m benchmarks.busy_ranks ROLE --config JSON``, ROLE one of:

- ``kvferry-prefill``, ``kvferry-decode``: one kvferry rank each (the
  bootstrap server is the driver's); ``kvferry-both``: both managers and
  one loop in one process, as ``examples/one_host.py`` runs them;
- ``mc-prefill``, ``mc-decode``: raw Mooncake. Decode sends each request
  (room, its pages) over a zmq pair; prefill, at its next step once the
  driver told it of the room too, writes the pages with one
  ``batch_transfer_async_write``, waits for it at the step after
  (``get_batch_transfer_status``) and answers ``done``;
- ``nixl-prefill``, ``nixl-decode``: raw NIXL (UCX) the same way, one
  prepared transfer per request, its state checked once per step;
- ``mc-both``: raw Mooncake with both sides, two engines and one loop in
  one process (``kvferry-both``'s reference): decode's ask and prefill's
  ``done`` are the loop's own lists instead of messages.

Every rank prints ``BUSY_READY <json>`` once set up (raw decode ranks:
where prefill reaches them), runs the scheduler loop of
:mod:`benchmarks.busy_loop` on the requests of its pipe
(:class:`~benchmarks.busy_loop.Feed`), says ``BUSY_DONE`` for each room a
side ends, and prints one ``BUSY_RESULT`` line per side at the end: per
room when it was opened, sent (prefill) and ended. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import replace

import numpy as np

from benchmarks import busy_explain
from benchmarks.busy_explain import ReferenceHolds
from benchmarks.busy_loop import (FIRST_ROOM, BusyConfig, DecodePages, Feed, Scheduler, SlowSteps, ThreadClock, ready,
                                  result_line, src_pages)

TIMEOUT_S = 600.0


# --- kvferry ---------------------------------------------------------------------------


def _kvferry_manager(cfg: BusyConfig, prefill: bool):
    import torch

    from transfer.config import Role, manager_config_from_env
    from transfer.manager import KVManager
    from transfer.pools import MHAPool
    from transfer.staging.hostmem import host_tensor

    role = Role.PREFILL if prefill else Role.DECODE
    base = manager_config_from_env(role)
    config = replace(base, bootstrap_addr=cfg.bootstrap, node_id=cfg.node_id,
                     engine=replace(base.engine, protocol="tcp"), bootstrap_timeout_s=120, transfer_timeout_s=120)
    num_pages = cfg.prefill_pages if prefill else cfg.decode_pages
    shape = (cfg.num_buffers, num_pages, cfg.page_size, cfg.heads, cfg.head_dim)
    pool = host_tensor(int(np.prod(shape)) * 2, fill=0x5A if prefill else 0).view(torch.bfloat16).view(shape)
    mhapool = MHAPool(k=[pool[2 * l] for l in range(cfg.layers)], v=[pool[2 * l + 1] for l in range(cfg.layers)],
                      total_kv_heads=cfg.heads)
    mgr = KVManager(config, [mhapool])
    mgr.touch_staging()
    return mgr


class _KVPrefill:
    """Prefill's side of the loop: a sender per room it is told of; on
    WaitingForInput, ``init`` and one ``send`` of every page."""

    side = "prefill"

    def __init__(self, cfg: BusyConfig, mgr) -> None:
        self.cfg, self.mgr = cfg, mgr
        self.live, self.created, self.sent, self.done, self.failed, self.errors = {}, {}, {}, {}, [], set()
        self.calls: dict[str, float] = {}

    def open(self, rooms) -> None:
        from transfer.rooms.sender import KVSender
        for room in rooms:
            self.created[room] = time.time()
            self.live[room] = [KVSender(self.mgr, self.cfg.bootstrap, room), False]

    def poll(self) -> None:
        from transfer.state import KVPoll
        calls = self.calls = {"kv_poll": 0.0, "kv_init": 0.0, "kv_send": 0.0}  # this pass's ms in each API call
        for room, entry in list(self.live.items()):
            sender, sent = entry
            t = time.perf_counter()
            state = sender.poll()
            calls["kv_poll"] += (time.perf_counter() - t) * 1e3
            if state is KVPoll.WaitingForInput and not sent:
                pages = src_pages(self.cfg, room - FIRST_ROOM)
                t = time.perf_counter()
                sender.init(len(pages))
                self.sent[room] = time.time()
                t1 = time.perf_counter()
                sender.send(pages, last=True)
                t2 = time.perf_counter()
                entry[1] = True
                state = sender.poll()
                calls["kv_init"] += (t1 - t) * 1e3
                calls["kv_send"] += (t2 - t1) * 1e3
                calls["kv_poll"] += (time.perf_counter() - t2) * 1e3
            if state in (KVPoll.Success, KVPoll.Failed):
                self.done[room] = time.time()
                if state is KVPoll.Failed:
                    self.failed.append(room)
                    self.errors.add(_error_of(sender))
                del self.live[room]
                Feed.done(self.side, room)


class _KVDecode:
    """Decode's side: a receiver and its pages per room it is told of."""

    side = "decode"

    def __init__(self, cfg: BusyConfig, mgr) -> None:
        self.cfg, self.mgr, self.alloc = cfg, mgr, DecodePages(cfg)
        self.live, self.created, self.sent, self.done, self.failed, self.errors = {}, {}, {}, {}, [], set()
        self.calls: dict[str, float] = {}

    def open(self, rooms) -> None:
        from transfer.rooms.receiver import KVReceiver
        for room in rooms:
            self.created[room] = time.time()
            receiver = KVReceiver(self.mgr, self.cfg.bootstrap, room, prefill_node=self.cfg.node_id)
            dst = self.alloc.take()
            receiver.init(dst)
            self.live[room] = (receiver, dst)

    def poll(self) -> None:
        from transfer.state import KVPoll
        calls = self.calls = {"kv_poll": 0.0}  # this pass's ms in each API call
        for room, (receiver, dst) in list(self.live.items()):
            t = time.perf_counter()
            state = receiver.poll()
            calls["kv_poll"] += (time.perf_counter() - t) * 1e3
            if state in (KVPoll.Success, KVPoll.Failed):
                self.done[room] = time.time()
                if state is KVPoll.Failed:
                    self.failed.append(room)
                    self.errors.add(_error_of(receiver))
                self.alloc.give(dst)
                del self.live[room]
                Feed.done(self.side, room)


def _error_of(obj) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    return ""


def _wait_for_node(mgr, cfg: BusyConfig) -> None:
    from transfer.errors import BootstrapUnavailable
    deadline = time.monotonic() + 120
    with mgr.bootstrap_client(cfg.bootstrap) as client:
        while True:
            try:
                if client.lookup(cfg.node_id, 0).ready:
                    return
            except BootstrapUnavailable:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the prefill node did not register")
            time.sleep(0.05)


class GcPauses:
    """The interpreter's garbage collections while it runs (``gc.callbacks``):
    how many, and the longest, in seconds: a collection stops every thread.
    Also by generation (0, 1, 2: 2 walks the whole heap), and the objects
    they found unreachable (garbage in reference cycles)."""

    def __init__(self) -> None:
        self._start = None
        self.by_generation, self.collected = [0, 0, 0], 0
        self.max_s_by_generation, self.max_cpu_s_by_generation = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        gc.callbacks.append(self._on)

    @property
    def count(self) -> int:
        return sum(self.by_generation)

    @property
    def max_s(self) -> float:
        return max(self.max_s_by_generation)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = (time.perf_counter(), time.thread_time())
        elif self._start is not None:
            wall, cpu = time.perf_counter() - self._start[0], time.thread_time() - self._start[1]
            g = info["generation"]
            self.by_generation[g] += 1
            self.max_s_by_generation[g] = max(self.max_s_by_generation[g], wall)
            self.max_cpu_s_by_generation[g] = max(self.max_cpu_s_by_generation[g], cpu)
            self.collected += info["collected"]
            self._start = None

    def stop(self) -> None:
        gc.callbacks.remove(self._on)


def run_kvferry(cfg: BusyConfig, role: str) -> int:
    if cfg.explain:
        busy_explain.install()
    sides = []
    if role in ("kvferry-prefill", "kvferry-both"):
        sides.append(_KVPrefill(cfg, _kvferry_manager(cfg, True)))
    if role in ("kvferry-decode", "kvferry-both"):
        decode = _KVDecode(cfg, _kvferry_manager(cfg, False))
        _wait_for_node(decode.mgr, cfg)
        sides.append(decode)
    ready()
    feed, sched, pauses, steps, clock = Feed(), Scheduler(cfg), GcPauses(), SlowSteps(), ThreadClock()
    reference = ReferenceHolds() if cfg.explain else None
    cpu0, deadline = time.process_time(), time.monotonic() + TIMEOUT_S
    while not (feed.closed and not any(side.live for side in sides)) and time.monotonic() < deadline:
        start, before = time.perf_counter(), clock.read()
        rooms = feed.take()
        taken = time.perf_counter()
        for side in sorted(sides, key=lambda s: s.side):  # decode's receiver first, as the request reaches it first
            side.open(rooms)
        opened = time.perf_counter()
        sched.step()
        stepped = time.perf_counter()
        for side in sides:
            side.poll()
        end, after = time.perf_counter(), clock.read()
        steps.add(start, ("take", taken), ("open", opened), ("step", stepped), ("poll", end),
                  calls={f"{side.side}_{k}": v for side in sides for k, v in side.calls.items()}, clock=(before, after))
    sched.stop()
    clock.close()
    pauses.stop()
    if reference is not None:
        reference.stop()
    cpu = time.process_time() - cpu0
    process = dict(gc_collections=pauses.count, gc_max_ms=pauses.max_s * 1e3, gc_by_generation=pauses.by_generation,
                   gc_collected=pauses.collected,
                   gc_max_ms_by_generation=[round(v * 1e3, 3) for v in pauses.max_s_by_generation],
                   gc_max_cpu_ms_by_generation=[round(v * 1e3, 3) for v in pauses.max_cpu_s_by_generation],
                   loop_slowest=steps.slowest())
    if reference is not None:
        process.update(reference_max_cpu_ms=reference.max_s * 1e3, reference_blocks=reference.blocks,
                       reference_slow=reference.slow, reference_ticked=reference.ticked,
                       long_slices=busy_explain.long_slices())
    for i, side in enumerate(sides):
        stats = side.mgr.stats()
        print(result_line(side.side, side.created, side.done, sent=side.sent, failed=side.failed + sorted(side.live),
                          errors=sorted(side.errors)[:5], cpu_s=cpu / len(sides),
                          control_msgs=side.mgr.channel.num_received,
                          handed_over=getattr(side.mgr.channel, "num_handed_over", 0),
                          periodic_rounds=stats.periodic_rounds,
                          periodic_max_cpu_ms={k: v * 1e3 for k, v in stats.periodic_max_cpu_s.items()},
                          periodic_max_ms_by_kind={kind: {k: v * 1e3 for k, v in by_task.items()}
                                                   for kind, by_task in stats.periodic_max_by_kind_s.items()},
                          **(process if i == 0 else {})), flush=True)  # the process's, once
    for side in sides:
        side.mgr.close()
    return 0 if all(not side.failed and not side.live for side in sides) else 1


# --- raw engines ----------------------------------------------------------------------


def _arena(cfg: BusyConfig, num_pages: int, fill: int) -> np.ndarray:
    from transfer.staging.hostmem import host_array
    return host_array(cfg.num_buffers * num_pages * cfg.page_bytes, fill=fill)


def _page_addrs(cfg: BusyConfig, base: int, num_pages: int, pages: np.ndarray) -> np.ndarray:
    """The address of page ``pages[i]`` of every buffer, buffer-major."""
    buffers = np.arange(cfg.num_buffers, dtype=np.int64)[:, None]
    return (base + (buffers * num_pages + pages[None, :]) * cfg.page_bytes).ravel()


def _pair(bind: bool, endpoint: str = ""):
    import zmq
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return sock, f"tcp://127.0.0.1:{port}"
    sock.connect(endpoint)
    return sock, endpoint


def _messages(sock) -> list[dict]:
    import zmq
    out = []
    while True:
        try:
            out.append(json.loads(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return out


def run_raw_decode(cfg: BusyConfig, engine: str) -> int:
    """Either raw engine's decode side: it only asks and waits for ``done``."""
    arena = _arena(cfg, cfg.decode_pages, 0)
    where: dict = {}
    if engine == "mc":
        from benchmarks.rawengine import make_engine, register_region
        eng = make_engine("127.0.0.1", "tcp")
        register_region(eng, arena.ctypes.data, arena.nbytes)
        where = {"session": f"127.0.0.1:{eng.get_rpc_port()}", "addr": arena.ctypes.data}
    else:
        from benchmarks.raw_nixl import _register, make_agent
        agent = make_agent(f"kvferry-busy-recv-{os.getpid()}", 100)
        _register(agent, arena.ctypes.data, arena.nbytes)
        where = {"addr": arena.ctypes.data, "meta": agent.get_agent_metadata().hex()}
    sock, endpoint = _pair(bind=True)
    ready(json.dumps({"endpoint": endpoint, **where}))
    if not sock.poll(120_000):
        raise SystemExit("no prefill connected")
    assert json.loads(sock.recv())["op"] == "hello"
    alloc, sched, feed = DecodePages(cfg), Scheduler(cfg), Feed()
    created, done, live = {}, {}, {}
    deadline = time.monotonic() + TIMEOUT_S
    while not (feed.closed and not live) and time.monotonic() < deadline:
        for room in feed.take():
            created[room] = time.time()
            live[room] = alloc.take()
            sock.send(json.dumps({"op": "req", "room": room, "pages": live[room].tolist()}).encode())
        sched.step()
        for msg in _messages(sock):
            done[msg["room"]] = time.time()
            alloc.give(live.pop(msg["room"]))
            Feed.done("decode", msg["room"])
    sched.stop()
    print(result_line("decode", created, done, failed=[r for r in created if r not in done]), flush=True)
    return 0 if not live else 1


def run_raw_prefill(cfg: BusyConfig, engine: str, peer: dict) -> int:
    arena = _arena(cfg, cfg.prefill_pages, 0x5A)
    sizes = np.full(cfg.num_buffers * cfg.pages, cfg.page_bytes, dtype=np.int64)
    if engine == "mc":
        from benchmarks.rawengine import make_engine, register_region
        eng = make_engine("127.0.0.1", "tcp")
        register_region(eng, arena.ctypes.data, arena.nbytes)
    else:
        from benchmarks.raw_nixl import _descs, _register, make_agent
        agent = make_agent(f"kvferry-busy-send-{os.getpid()}", 100)
        _register(agent, arena.ctypes.data, arena.nbytes)
        remote = agent.add_remote_agent(bytes.fromhex(peer["meta"]))
    sock, _ = _pair(bind=False, endpoint=peer["endpoint"])
    sock.send(json.dumps({"op": "hello"}).encode())
    ready()
    sched, feed = Scheduler(cfg), Feed()
    # told: rooms the driver gave this rank, asked: decode's pages of each; a room is written once both came
    created, sent, done, told, asked, pending, waiting = {}, {}, {}, set(), {}, [], []
    deadline = time.monotonic() + TIMEOUT_S
    while not (feed.closed and not told and not waiting) and time.monotonic() < deadline:
        for room in feed.take():
            created[room] = time.time()
            told.add(room)
        sched.step()
        if engine == "mc" and waiting:  # submitted a step ago: wait for them (the engine spins, GIL released)
            if eng.get_batch_transfer_status([bid for _, bid in waiting]) != 0:
                raise SystemExit("a raw Mooncake batch failed")
            pending, waiting = pending + [room for room, _ in waiting], []
        elif engine == "nixl":
            for room, handle in list(waiting):
                state = agent.check_xfer_state(handle)
                if state == "DONE":
                    agent.release_xfer_handle(handle)
                    pending.append(room)
                    waiting.remove((room, handle))
                elif state != "PROC":
                    raise SystemExit(f"a raw NIXL write failed ({state})")
        for room in pending:
            done[room] = time.time()
            sock.send(json.dumps({"op": "done", "room": room}).encode())
            Feed.done("prefill", room)
        pending = []
        for msg in _messages(sock):
            asked[msg["room"]] = msg["pages"]
        for room in sorted(told & asked.keys()):
            told.discard(room)
            src = _page_addrs(cfg, arena.ctypes.data, cfg.prefill_pages, src_pages(cfg, room - FIRST_ROOM))
            dst = _page_addrs(cfg, peer["addr"], cfg.decode_pages, np.asarray(asked.pop(room), dtype=np.int64))
            sent[room] = time.time()
            if engine == "mc":
                bid = eng.batch_transfer_async_write(peer["session"], src.tolist(), dst.tolist(), sizes.tolist())
                if bid == 0:
                    raise SystemExit("Mooncake refused a batch")
                waiting.append((room, bid))
            else:
                handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(_descs(src, sizes), "DRAM"),
                                               agent.get_xfer_descs(_descs(dst, sizes), "DRAM"), remote,
                                               backends=["UCX"])
                if agent.transfer(handle) == "ERR":
                    raise SystemExit("NIXL refused a write")
                waiting.append((room, handle))
    sched.stop()
    print(result_line("prefill", created, done, sent=sent, failed=sorted(told)), flush=True)
    return 0 if not told and not waiting else 1


def run_raw_both(cfg: BusyConfig) -> int:
    """Raw Mooncake, both sides in this process: each step, prefill waits
    for the batches it wrote a step ago and says them done (decode sees it
    in the same step), then writes the rooms opened before the step."""
    from benchmarks.rawengine import make_engine, register_region
    src, dst = _arena(cfg, cfg.prefill_pages, 0x5A), _arena(cfg, cfg.decode_pages, 0)
    src[:] = np.frombuffer(np.random.default_rng(cfg.seed).bytes(src.nbytes), dtype=np.uint8)  # pages tell apart
    writer, reader = make_engine("127.0.0.1", "tcp"), make_engine("127.0.0.1", "tcp")
    register_region(writer, src.ctypes.data, src.nbytes)
    register_region(reader, dst.ctypes.data, dst.nbytes)
    session = f"127.0.0.1:{reader.get_rpc_port()}"
    sizes = np.full(cfg.num_buffers * cfg.pages, cfg.page_bytes, dtype=np.int64).tolist()
    ready()
    alloc, sched, feed = DecodePages(cfg), Scheduler(cfg), Feed()
    created, sent, pre_done, dec_done, live, asked, waiting = {}, {}, {}, {}, {}, [], []
    last = None  # the room that ended last and its decode pages
    deadline = time.monotonic() + TIMEOUT_S
    while not (feed.closed and not live) and time.monotonic() < deadline:
        for room in feed.take():  # decode opens the room and asks; prefill is told of it
            created[room] = time.time()
            live[room] = alloc.take()
            asked.append(room)
        sched.step()
        if waiting:  # written a step ago: wait for them (the engine spins, GIL released)
            if writer.get_batch_transfer_status([bid for _, bid in waiting]) != 0:
                raise SystemExit("a raw Mooncake batch failed")
            for room, _ in waiting:
                pre_done[room] = time.time()
                Feed.done("prefill", room)
            for room, _ in waiting:  # decode's poll, the same step
                dec_done[room] = time.time()
                last = (room, live[room])
                alloc.give(live.pop(room))
                Feed.done("decode", room)
            waiting = []
        for room in asked:
            s = _page_addrs(cfg, src.ctypes.data, cfg.prefill_pages, src_pages(cfg, room - FIRST_ROOM))
            d = _page_addrs(cfg, dst.ctypes.data, cfg.decode_pages, live[room])
            sent[room] = time.time()
            bid = writer.batch_transfer_async_write(session, s.tolist(), d.tolist(), sizes)
            if bid == 0:
                raise SystemExit("Mooncake refused a batch")
            waiting.append((room, bid))
        asked = []
    sched.stop()
    wrong = _wrong_bytes(cfg, src, dst, last)
    failed, errors = sorted(live) + wrong, [f"room {r}: its pages on decode differ from prefill's" for r in wrong]
    print(result_line("prefill", created, pre_done, sent=sent, failed=failed, errors=errors), flush=True)
    print(result_line("decode", created, dec_done, failed=failed, errors=errors), flush=True)
    return 0 if not failed else 1


def _wrong_bytes(cfg: BusyConfig, src: np.ndarray, dst: np.ndarray, last: tuple | None) -> list[int]:
    """The last room written (its decode pages are not reused after it), if
    its pages on decode differ from its pages on prefill: checked once the
    loop ended, off the clock."""
    if last is None:
        return []
    room, pages = last
    src_view = src.reshape(cfg.num_buffers, cfg.prefill_pages, cfg.page_bytes)
    dst_view = dst.reshape(cfg.num_buffers, cfg.decode_pages, cfg.page_bytes)
    same = np.array_equal(dst_view[:, pages], src_view[:, src_pages(cfg, room - FIRST_ROOM)])
    return [] if same else [room]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["kvferry-prefill", "kvferry-decode", "kvferry-both", "mc-prefill", "mc-decode",
                                     "mc-both", "nixl-prefill", "nixl-decode"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--peer", default="{}", help="raw prefill: decode's BUSY_READY line")
    args = ap.parse_args(argv)
    cfg = BusyConfig.from_json(args.config)
    if args.role.startswith("kvferry"):
        return run_kvferry(cfg, args.role)
    engine, _, side = args.role.partition("-")
    if side == "both":
        return run_raw_both(cfg)
    if side == "decode":
        return run_raw_decode(cfg, engine)
    return run_raw_prefill(cfg, engine, json.loads(args.peer))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip the engines' slow destructors
