"""A scripted rank driven over stdin, for the fault, abort and soak tests.

``python -m harness.rankctl --role prefill|decode --spec JSON [--config JSON]``
builds one rank's pools from the spec (the content of :mod:`harness.workload`,
so decode can check every byte; its TP rank's heads, with ``tp_rank`` and
``tp_size`` in the config), creates its KVManager, prints ``READY
{...}`` and then answers one JSON command per stdin line with one ``REPLY
{...}`` line:

- ``{"op": "rooms", "rooms": [...], ...}`` runs those rooms to a terminal
  state and reports each one: state, error type and message, wall-clock end
  time (``time.time()``, comparable across processes on one host), and on
  decode the byte check. Options: ``abort`` (room -> seconds after start at
  which this side aborts it), ``chunk_delay_s`` (prefill: pause between
  chunks, so a fault lands mid-transfer), ``guard_s`` (decode: fill a
  failed room's pages with a sentinel at once, as a scheduler reusing them
  would, and check after this many seconds that no late write touched them),
  ``abort_on_first_byte`` (decode: rooms to abort as soon as their first
  page shows transferred bytes, i.e. with writes surely in flight),
  ``timeout_s`` (bounds the whole command), ``abort_at_once`` (decode:
  rooms to abort right after creating their receiver, before ``init`` and
  any ``poll``), ``bad_pages`` (decode: rooms whose ``init`` gets a page id
  outside the pool). ``stop_after_descriptors``
  (prefill: SIGSTOP this process as soon as the transport completed that
  many more descriptors, i.e. with a chunk's writes in flight) and
  ``cont_pid`` (decode: SIGCONT that process right after the sentinel of a
  failed room is written) make the late-write test of the write fence.
  ``hold_gil`` ([after_s, seconds], either side): that long into the
  command, a C call holds this process's interpreter lock for that many
  seconds (every Python thread of the rank waits; its C threads, libzmq's
  and the engine's, go on); the reply says when (``held_gil``).
  ``plans`` (room -> prefill page ids) replaces the seeded page choice of
  a room on both sides; ``announce_requested`` (prefill: print ``EVENT
  {"requested": wall-clock time}`` once every room's decode request has
  arrived, i.e. no room is bootstrapping: a fault after it cannot land
  before a request); ``tokens`` (true: pass each room's prompt to
  ``init`` for the storage tier; ``tail_tokens``: how many the last page
  holds, default all). A room's prompt is derived from its
  prefill pages (the same page always holds the same tokens, as a prefix
  cache would), so rooms sharing leading pages share a prefix.
- ``{"op": "stats"}``: threads, open file descriptors, RSS, counters (on
  prefill also the room table's refusals: ``refused_hellos``, ...).
  (``READY`` also says ``metrics_port``: the rank's /metrics port, 0: none;
  set it with ``--config '{"metrics_port": N}'``.)
- ``{"op": "digest"}``: a SHA-256 of every pool buffer (to show that
  nothing wrote into this rank's own pages).
- ``{"op": "exit"}``.

Every wait is bounded; end of stdin exits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import torch

from harness.lines import emit
from transfer.config import Role, manager_config_from_env
from transfer.manager import KVManager
from transfer.rooms.receiver import KVReceiver
from transfer.rooms.sender import KVSender
from transfer.state import KVPoll
from harness.workload import (Spec, _allocate, _components, aux_buffers, aux_row, build_pools, global_buffer,
                              prefill_side, rank_slice, read_aux, room_plan, split_layers, write_aux)

SENTINEL = 0xA5


def _plan(spec: Spec, cmd: dict, room: int):
    plan = cmd.get("plans", {}).get(str(room))
    if plan is not None:
        return np.asarray(plan, dtype=np.int64)
    return room_plan(spec, room)[0]


def prompt_of(spec: Spec, pages, cmd: dict) -> np.ndarray | None:
    """A room's prompt, if the command asks for tokens: each of its prefill
    pages holds a seeded set of tokens; the last page holds ``tail_tokens``
    of them (default: full)."""
    if not cmd.get("tokens"):
        return None
    tokens = np.concatenate([np.random.default_rng([spec.seed, 11, int(p)]).integers(0, 2**31, spec.page_size)
                             for p in pages])
    return tokens[:len(tokens) - spec.page_size + int(cmd.get("tail_tokens", spec.page_size))]


def _stats(mgr: KVManager) -> dict:
    totals = mgr.stats()
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    return {"threads": threading.active_count(), "fds": fds, "rss": rss,
            "malformed": mgr.channel.num_malformed, "unauthenticated": mgr.channel.num_unauthenticated,
            "received": mgr.channel.num_received, "bytes_sent": mgr.transport.num_bytes,
            "pages_written": mgr.storage.num_pages_written if mgr.storage else 0,
            "fenced": mgr.rank.fenced, "peers_lost": totals.peers_lost,
            "arenas_retired": getattr(mgr.context.staging.area, "num_retired", 0) if mgr.context.staging else 0,
            "pages_read": mgr.storage.num_pages_read if mgr.storage else 0,
            "handshake_stale_writes": mgr.transport.handshake_counts().get("handshake_stale_writes", 0),
            "rooms_relinked": totals.rooms_relinked,
            "periodic_max_cpu_ms": {k: round(v * 1e3, 3) for k, v in totals.periodic_max_cpu_s.items()},
            **{name.removeprefix("num_"): getattr(mgr.rooms, name) for name in _ROOM_COUNTERS
               if hasattr(mgr.rooms, name)}}


_ROOM_COUNTERS = ("num_refused_hellos", "num_refused_unhandshaken", "num_refused_duplicates", "num_dropped_replays",
                  "num_refused_aborts", "num_early_rooms")


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for bufs in tensors.values():
        for ts in bufs.values():
            for t in ts:
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _stop_after(mgr: KVManager, num_descriptors: int, deadline: float) -> None:
    """SIGSTOP this process once the transport completed ``num_descriptors``
    more descriptors (a thread; gives up at ``deadline``)."""
    base = mgr.transport.num_descriptors

    def watch() -> None:
        while time.monotonic() < deadline:
            if mgr.transport.num_descriptors >= base + num_descriptors:
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            time.sleep(0.0002)

    threading.Thread(target=watch, name="stop-after", daemon=True).start()


def _hold_gil(after_s: float, seconds: float, out: dict) -> threading.Thread:
    """After ``after_s``, hold the interpreter lock for ``seconds`` in a C
    call (libc's ``sleep`` through ``ctypes.PyDLL``, which keeps the lock),
    from a thread; ``out["held_gil"]`` gets the wall-clock [start, end]."""
    import ctypes

    libc = ctypes.PyDLL(None)

    def hold() -> None:
        time.sleep(after_s)
        start = time.time()
        libc.usleep(int(seconds * 1e6))
        out["held_gil"] = [start, time.time()]

    thread = threading.Thread(target=hold, name="hold-gil", daemon=True)
    thread.start()
    return thread


class _CallTimer:
    """The scheduler calls a command made (``poll``, ``send``, ``init``, the
    room constructors), timed: what a scheduler loop would have been held up
    by. Per call also the part the kernel kept the thread runnable but off
    the CPU (its run-queue wait, from ``/proc/thread-self/schedstat``: other
    processes on a busy machine), so that ``max_call_s`` can be told from
    ``max_held_s``, the longest a call held its caller up by its own work or
    by waiting (a lock, the interpreter lock, the network): wall minus run-queue wait."""

    def __init__(self) -> None:
        self.max_s, self.slowest = 0.0, ""
        self.max_held_s, self.most_held = 0.0, ""
        self.num_calls = 0
        self.top: list[tuple[float, str]] = []  # the five slowest, (seconds, what)

    def time(self, name: str, fn, *args, **kwargs):
        q0, t0 = _run_queue_s(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - t0
            queued = _run_queue_s() - q0
            held = max(0.0, took - queued)
            self.num_calls += 1
            if took > self.max_s:
                self.max_s, self.slowest = took, name
            if held > self.max_held_s:
                self.max_held_s, self.most_held = held, name
            if len(self.top) < 5 or took > self.top[-1][0]:
                what = f"{name} {took * 1e3:.2f} ms ({queued * 1e3:.2f} of them waiting for a CPU)"
                self.top = sorted(self.top + [(took, what)], reverse=True)[:5]

    def report(self) -> dict:
        return {"max_call_s": self.max_s, "slowest_call": self.slowest, "max_held_s": self.max_held_s,
                "most_held_call": self.most_held, "num_calls": self.num_calls,
                "slowest_calls": [what for _, what in self.top]}


def _run_queue_s() -> float:
    """This thread's time runnable but waiting for a CPU so far (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


def _error(obj) -> tuple[str, str]:
    try:
        obj.failure_exception()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


class PrefillRank:
    def __init__(self, spec: Spec, mgr: KVManager, aux) -> None:
        self.spec, self.mgr, self.aux = spec, mgr, aux

    def rooms(self, cmd: dict) -> dict:
        spec, mgr = self.spec, self.mgr
        abort = {int(k): v for k, v in cmd.get("abort", {}).items()}
        delay = float(cmd.get("chunk_delay_s", 0.0))  # between sends (with layer groups: between groups)
        groups = int(cmd.get("layer_groups", 0))  # each chunk as this many layer groups (0: whole chunks)
        layers = sum(p.num_layers for p in mgr.rank.pools)
        deadline = time.monotonic() + float(cmd.get("timeout_s", 60.0))
        if cmd.get("stop_after_descriptors"):
            _stop_after(mgr, int(cmd["stop_after_descriptors"]), deadline)
        reply: dict = {}
        hold = _hold_gil(*cmd["hold_gil"], reply) if cmd.get("hold_gil") else None
        live, out = {}, {}
        calls = _CallTimer()

        def start(room: int) -> None:
            slot = room % spec.aux_slots
            write_aux(self.aux, slot, aux_row(spec, room))
            live[room] = {"s": calls.time("KVSender", KVSender, mgr, spec.bootstrap, room), "t0": time.monotonic(),
                          "chunks": None, "next_at": 0.0, "slot": slot}

        # ``window``: at most this many of ``rooms`` live at once, in order (a scheduler taking a stream of
        # requests; 0: all at once); the ``eager`` rooms all at once besides
        window = int(cmd.get("window", 0)) or len(cmd["rooms"])
        eager = set(cmd.get("eager", []))
        queued = list(cmd["rooms"])
        announce = bool(cmd.get("announce_requested"))
        for room in eager:
            start(room)
        while (live or queued) and time.monotonic() < deadline:
            while queued and sum(1 for r in live if r not in eager) < window:
                start(queued.pop(0))
            seen = mgr.progress
            now = time.monotonic()
            for room, r in list(live.items()):
                s = r["s"]
                state = calls.time("poll", s.poll)
                if room in abort and now - r["t0"] >= abort[room] and state not in (KVPoll.Success, KVPoll.Failed):
                    s.abort("aborted by the test's prefill scheduler")
                    state = s.poll()
                if state is KVPoll.WaitingForInput and r["chunks"] is None:
                    pages = _plan(spec, cmd, room)
                    step = spec.chunk_pages or len(pages)
                    sizes = [min(step, len(pages) - i) for i in range(0, len(pages), step)]
                    calls.time("init", s.init, len(pages), r["slot"], token_ids=prompt_of(spec, pages, cmd))
                    r["chunks"] = [pages, sizes, 0]
                if r["chunks"] is not None and r["chunks"][1] and now >= r["next_at"] \
                        and state in (KVPoll.WaitingForInput, KVPoll.Transferring):
                    pages, sizes, off = r["chunks"]
                    n = sizes[0]
                    if groups:  # layer-wise: the chunk's layer groups one per round, the last layers first
                        if not r.get("groups"):
                            r["groups"] = split_layers(layers, groups)
                        calls.time("send", s.send, pages[off:off + n], last=len(sizes) == 1,
                                   layers=r["groups"].pop(0))
                        chunk_done = not r["groups"]
                    else:
                        calls.time("send", s.send, pages[off:off + n], last=len(sizes) == 1)
                        chunk_done = True
                    if chunk_done:
                        sizes.pop(0)
                        r["chunks"][2] = off + n
                    r["next_at"] = now + delay
                if state in (KVPoll.Success, KVPoll.Failed):
                    kind, msg = _error(s)
                    out[room] = {"state": state.name, "error_type": kind, "error": msg, "ended_at": time.time()}
                    del live[room]
            if announce and not queued and all(r["chunks"] is not None for r in live.values()):
                emit("EVENT", {"requested": time.time()})
                announce = False
            mgr.wait_for_progress(seen, 0.01)
        for room in [*live, *queued]:
            out[room] = {"state": "Stuck", "error_type": "", "error": "command timed out", "ended_at": time.time()}
        if hold is not None:
            hold.join(max(0.0, deadline - time.monotonic()))
        return {"results": out, **reply, **calls.report()}


class DecodeRank:
    def __init__(self, spec: Spec, mgr: KVManager, tensors, aux) -> None:
        self.spec, self.mgr, self.tensors, self.aux = spec, mgr, tensors, aux
        rng = np.random.default_rng([spec.seed, 7])
        self.free = [int(x) for x in rng.permutation(spec.decode_pages)]
        prefill_roles = {p.role for p in spec.prefill_pools}
        tp_rank, tp_size = mgr.config.tp_rank, mgr.config.tp_size
        self.expected = {p.role: {c: [rank_slice(global_buffer(spec, p, l, c, spec.prefill_pages, prefill_side(0)),
                                                 p, tp_rank, tp_size) for l in range(p.num_layers)]
                                  for c in _components(p)}
                         for p in spec.decode_pools if p.role in prefill_roles}

    def _check(self, room: int, dst, slot, src) -> list[str]:
        bad = [f"room {room}: {role} {c} layer {l} differs"
               for role, bufs in self.expected.items() for c, ts in bufs.items() for l, want in enumerate(ts)
               if not torch.equal(self.tensors[role][c][l][dst].cpu().view(torch.uint8), want[src].view(torch.uint8))]
        if read_aux(self.aux, slot) != aux_row(self.spec, room):
            bad.append(f"room {room}: aux row differs")
        return bad

    def _fill(self, dst, value: int) -> None:
        for bufs in self.tensors.values():
            for ts in bufs.values():
                for t in ts:
                    t.view(torch.uint8)[dst] = value

    def _intact(self, dst, value: int) -> bool:
        return all(bool((t.view(torch.uint8)[dst] == value).all())
                   for bufs in self.tensors.values() for ts in bufs.values() for t in ts)

    def rooms(self, cmd: dict) -> dict:
        spec, mgr = self.spec, self.mgr
        abort = {int(k): v for k, v in cmd.get("abort", {}).items()}
        guard_s = float(cmd.get("guard_s", 0.0))
        on_first_byte = set(cmd.get("abort_on_first_byte", []))
        first = next(iter(next(iter(self.tensors.values())).values()))[0].view(torch.uint8)
        deadline = time.monotonic() + float(cmd.get("timeout_s", 60.0))
        reply: dict = {}
        hold = _hold_gil(*cmd["hold_gil"], reply) if cmd.get("hold_gil") else None
        live, out, guarded = {}, {}, []
        calls = _CallTimer()
        for room in cmd["rooms"]:
            src = _plan(spec, cmd, room)
            n = len(src)
            dst = _allocate(self.free, n, spec.page_placement == "contiguous")
            if dst is None:
                raise RuntimeError(f"decode pool of {spec.decode_pages} pages is full")
            dst = torch.as_tensor(dst, dtype=torch.int64)
            self._fill(dst, 0)  # stale bytes must not pass for transferred ones
            slot = (room * 7) % spec.aux_slots
            for region in self.aux:
                region[slot] = 0
            created_at = time.time()
            r = calls.time("KVReceiver", KVReceiver, mgr, spec.bootstrap, room, prefill_node=spec.node_id)
            if room in cmd.get("abort_at_once", ()):
                r.abort("aborted by the test's decode scheduler before its first poll")
            elif room in cmd.get("bad_pages", ()):
                r.init(np.append(dst.numpy()[:-1], spec.decode_pages + 5), slot)
            else:
                calls.time("init", r.init, dst.numpy(), slot, token_ids=prompt_of(spec, src, cmd))
            live[room] = {"r": r, "dst": dst, "slot": slot, "t0": time.monotonic(), "src": src,
                          "created_at": created_at}
        while live and time.monotonic() < deadline:
            seen = mgr.progress
            now = time.monotonic()
            for room, x in list(live.items()):
                state = calls.time("poll", x["r"].poll)
                due = (room in abort and now - x["t0"] >= abort[room]) or \
                    (room in on_first_byte and bool(first[x["dst"][0]].any()))
                if due and state not in (KVPoll.Success, KVPoll.Failed):
                    x["r"].abort("aborted by the test's decode scheduler")
                    state = x["r"].poll()
                if state not in (KVPoll.Success, KVPoll.Failed):
                    continue
                kind, msg = _error(x["r"])
                res = {"state": state.name, "error_type": kind, "error": msg, "ended_at": time.time(),
                       "created_at": x["created_at"], "from_storage": x["r"].pages_from_storage, "pages": len(x["src"]),
                       "mismatches": self._check(room, x["dst"], x["slot"], x["src"])
                       if state is KVPoll.Success else []}
                out[room] = res
                del live[room]
                if state is KVPoll.Failed and guard_s:
                    self._fill(x["dst"], SENTINEL)  # the scheduler reuses the pages at once
                    guarded.append((room, x["dst"]))
                    if cmd.get("cont_pid"):
                        os.kill(int(cmd["cont_pid"]), signal.SIGCONT)
                else:
                    self.free.extend(int(p) for p in x["dst"])
            mgr.wait_for_progress(seen, 0.0005 if on_first_byte & live.keys() else 0.01)
        for room in live:
            out[room] = {"state": "Stuck", "error_type": "", "error": "command timed out", "ended_at": time.time(),
                         "mismatches": []}
        if guarded:
            time.sleep(guard_s)
            for room, dst in guarded:
                out[room]["late_write"] = not self._intact(dst, SENTINEL)
                self.free.extend(int(p) for p in dst)
        if hold is not None:
            hold.join(max(0.0, deadline - time.monotonic()))
        return {"results": out, **reply, **calls.report()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--config", default="{}", help="ManagerConfig fields as JSON (peer_timeout_s, secret, ...)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format=f"[{args.role}] %(name)s %(levelname)s %(message)s")
    spec = Spec.from_json(args.spec)
    if spec.switch_interval_s:
        sys.setswitchinterval(spec.switch_interval_s)
    role = Role(args.role)
    prefill = role is Role.PREFILL
    base = manager_config_from_env(role)
    cfg = replace(base, bootstrap_addr=spec.bootstrap, node_id=spec.node_id,
                  engine=replace(base.engine, protocol=spec.protocol),
                  bootstrap_timeout_s=spec.timeout_s, transfer_timeout_s=spec.timeout_s,
                  **json.loads(args.config))
    # the config's TP rank holds its slice of the heads (every rank of an MLA pool: all of it)
    pools, tensors = build_pools(spec, spec.prefill_pools if prefill else spec.decode_pools, cfg.tp_rank,
                                 cfg.tp_size, spec.prefill_pages if prefill else spec.decode_pages,
                                 prefill_side(0) if prefill else "decode")
    aux = aux_buffers(spec)  # one region unless spec.aux_regions names several
    mgr = KVManager(cfg, pools, aux=aux)
    if spec.touch_staging:  # a warmed-up server's staging: no first-touch page faults inside a scheduler call
        mgr.touch_staging()
    rank = PrefillRank(spec, mgr, aux) if prefill else DecodeRank(spec, mgr, tensors, aux)
    emit("READY", {"session": mgr.rank.session, "endpoint": mgr.rank.control_endpoint,
                   "handshake_port": getattr(mgr.transport, "handshake_port", 0),
                   "metrics_port": mgr.metrics.port if mgr.metrics is not None else 0, **_stats(mgr)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = rank.rooms(cmd) if cmd["op"] == "rooms" else \
                {"digest": _digest(tensors)} if cmd["op"] == "digest" else {}
        except Exception as exc:
            reply = {"crash": f"{type(exc).__name__}: {exc}"}
        reply.update(_stats(mgr))
        emit("REPLY", reply)
    mgr.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip the Mooncake engine's slow destructor
