"""One process of the scale test (:mod:`harness.scale`): several prefill or
decode managers, one scheduler thread each, driving rooms that arrive on a
seeded schedule, some aborted on purpose; a sampler thread records the
process's CPU time, RSS, threads and file descriptors.

``python -m harness.scale_rank --role prefill|decode --index 0,1 --spec JSON``
builds its managers, prints ``READY``, waits for ``START <epoch>`` on stdin,
runs, and prints one ``RESULT <json>`` line. Both sides derive everything
from the spec's seed: which prefill and decode rank serve each room, when it
arrives, its pages, whether (and by which side) it is aborted, and the
prefill pools' bytes, which the decode side regenerates to check every page
of every room that succeeded.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from harness.lines import emit
from transfer import KVManager, KVPoll, KVReceiver, KVSender, ManagerConfig, MHAPool, Role
from transfer.config import EngineConfig


@dataclass(frozen=True)
class ScaleSpec:
    bootstrap: str = ""
    seed: int = 2026
    num_prefill: int = 1  # prefill ranks, one prefill node (TP 1) each
    num_decode: int = 1
    num_rooms: int = 4096
    arrival_s: float = 0.0  # rooms arrive uniformly at random over this window (0: in waves)
    waves: int = 1  # arrival_s 0: the rooms come in this many waves, each all at once when the last ended
    abort_fraction: float = 0.0  # of the rooms, aborted by one side or the other, 0-10 ms after arrival
    page_size: int = 4
    num_layers: int = 2
    num_heads: int = 1
    head_dim: int = 16
    min_pages: int = 1
    max_pages: int = 8
    prefill_pages: int = 4096
    decode_pages: int = 40000
    timeout_s: float = 60.0  # bootstrap and transfer timeouts of every room
    sample_s: float = 0.5

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one buffer (bf16)."""
        return self.page_size * self.num_heads * self.head_dim * 2


@dataclass(frozen=True)
class Room:
    room: int
    prefill: int
    decode: int
    arrival_s: float
    wave: int
    src_pages: np.ndarray
    abort_by: str  # "", "prefill" or "decode"
    abort_after_s: float


def schedule(spec: ScaleSpec) -> list[Room]:
    """Every room, in arrival order (room ids from 1)."""
    rng = np.random.default_rng([spec.seed, 1])
    arrivals = np.sort(rng.uniform(0, spec.arrival_s, spec.num_rooms)) if spec.arrival_s else \
        np.zeros(spec.num_rooms)
    rooms, per_wave = [], -(-spec.num_rooms // spec.waves)
    for i, t in enumerate(arrivals):
        n = int(rng.integers(spec.min_pages, spec.max_pages + 1))
        aborted = rng.random() < spec.abort_fraction
        rooms.append(Room(room=i + 1, prefill=int(rng.integers(spec.num_prefill)),
                          decode=int(rng.integers(spec.num_decode)), arrival_s=float(t), wave=i // per_wave,
                          src_pages=rng.choice(spec.prefill_pages, n, replace=False),
                          abort_by=str(rng.choice(["prefill", "decode"])) if aborted else "",
                          abort_after_s=float(rng.uniform(0, 0.01))))
    return rooms


def prefill_buffers(spec: ScaleSpec, index: int) -> list[torch.Tensor]:
    """Prefill rank ``index``'s K then V buffers, one per layer, seeded random bytes."""
    rng = np.random.default_rng([spec.seed, 2, index])
    shape = (spec.prefill_pages, spec.page_size, spec.num_heads, spec.head_dim)
    nbytes = spec.prefill_pages * spec.page_bytes
    return [torch.frombuffer(bytearray(rng.bytes(nbytes)), dtype=torch.bfloat16).view(shape)
            for _ in range(2 * spec.num_layers)]


def node_name(index: int) -> str:
    return f"prefill-{index}"


@dataclass
class Outcome:
    role: str
    index: int
    rooms: int = 0
    success: int = 0
    aborted_failed: int = 0  # aborted on purpose, ended Failed
    aborted_success: int = 0  # aborted too late: it had succeeded
    unexpected: list = field(default_factory=list)  # [room, why] of rooms that failed without an abort
    mismatches: list = field(default_factory=list)
    bytes: int = 0  # page bytes checked (decode) or sent in rooms that succeeded (prefill)
    max_live: int = 0


def _manager(spec: ScaleSpec, role: Role, index: int, pools) -> KVManager:
    config = ManagerConfig(role=role, bootstrap_addr=spec.bootstrap, node_id=node_name(index),
                           engine=EngineConfig(protocol="tcp"), bootstrap_timeout_s=spec.timeout_s,
                           transfer_timeout_s=spec.timeout_s, staging_bytes=8 << 20, stage_part_bytes=1 << 20)
    return KVManager(config, pools)


def _record(out: Outcome, room: Room, obj, state: KVPoll) -> bool:
    out.rooms += 1
    if state is KVPoll.Success:
        out.success += 1
        if room.abort_by:
            out.aborted_success += 1
        return True
    if room.abort_by:
        out.aborted_failed += 1
    else:
        try:
            obj.failure_exception()
        except Exception as exc:
            out.unexpected.append([room.room, f"{type(exc).__name__}: {exc}"])
    return False


@dataclass
class Side:
    """One manager of this process and what its scheduler loop needs."""

    mgr: KVManager
    role: Role
    index: int
    rooms: list[Room]
    bufs: list[torch.Tensor]  # K then V buffers of its pool
    out: Outcome


#: The scheduler loop's shortest step: it acts on what changed at most this often (a serving
#: engine's step is 10-50 ms; waking for every single change costs a wakeup per change).
STEP_S = 0.001


def drive(spec: ScaleSpec, side: Side, start: float, expected: dict[int, list[torch.Tensor]] | None) -> None:
    """One manager's scheduler loop: start rooms as they arrive, abort the
    marked ones, act on the rooms that changed (``changed_rooms``) at most
    every :data:`STEP_S`; checks every page of every decode room that
    succeeded against ``expected``."""
    mgr, role, index, rooms, bufs, out = side.mgr, side.role, side.index, side.rooms, side.bufs, side.out
    pending = list(reversed(rooms))  # pop() gives the next arrival
    free = list(np.random.default_rng([spec.seed, 3, index]).permutation(spec.decode_pages)) \
        if role is Role.DECODE else []
    live: dict[int, tuple[Room, object, np.ndarray | None]] = {}
    aborts: list[tuple[float, int]] = []
    mark, todo, wave = mgr.progress, set(), 0
    deadline = start + (spec.arrival_s + 3 * spec.waves * spec.timeout_s + 30)
    while (pending or live) and time.time() < deadline:
        now = time.time() - start
        while pending and pending[-1].arrival_s <= now and (pending[-1].wave == wave or not live):
            room = pending[-1]
            wave = room.wave
            if role is Role.PREFILL:
                obj, dst = KVSender(mgr, spec.bootstrap, room.room), None
            else:
                if len(free) < room.src_pages.size:
                    break  # waits for pages
                dst = np.array([free.pop() for _ in range(room.src_pages.size)])
                obj = KVReceiver(mgr, spec.bootstrap, room.room, prefill_node=node_name(room.prefill))
                obj.init(dst)
            pending.pop()
            live[room.room] = (room, obj, dst)
            todo.add(room.room)
            if room.abort_by == role.value:
                heapq.heappush(aborts, (room.arrival_s + room.abort_after_s, room.room))
        out.max_live = max(out.max_live, len(live))
        while aborts and aborts[0][0] <= now:
            _, r = heapq.heappop(aborts)
            if r in live:
                live[r][1].abort("aborted by the scale test")
        for r in todo:
            if r not in live:
                continue
            room, obj, dst = live[r]
            state = obj.poll()
            if role is Role.PREFILL and state is KVPoll.WaitingForInput:
                obj.init(room.src_pages.size)
                obj.send(room.src_pages, last=True)
            elif state in (KVPoll.Success, KVPoll.Failed):
                if _record(out, room, obj, state):
                    n = room.src_pages.size * spec.page_bytes * len(bufs)
                    out.bytes += n
                    if expected is not None:
                        src = torch.as_tensor(room.src_pages)
                        idx = torch.as_tensor(dst)
                        for want, got in zip(expected[room.prefill], bufs):
                            if not torch.equal(got.index_select(0, idx).view(torch.int16),
                                               want.index_select(0, src).view(torch.int16)):
                                out.mismatches.append(f"room {room.room}: pages differ")
                                break
                if dst is not None:
                    free.extend(dst.tolist())
                del live[r]
        waits = [0.05]
        if pending:
            waits.append(pending[-1].arrival_s - now)
        if aborts:
            waits.append(aborts[0][0] - now)
        step_left = STEP_S - (time.time() - start - now)
        if step_left > 0:
            time.sleep(step_left)
        mgr.wait_for_progress(mark, max(0.0, min(waits) - max(step_left, 0.0)))
        mark, changed = mgr.changed_rooms(mark)
        todo = set(live) if changed is None else {c.room for c, _ in changed}
    for r in live:
        out.unexpected.append([r, "not terminal when the run's deadline passed"])


def python_cpu_s() -> float:
    """CPU seconds of this process's live Python threads (the schedulers',
    kvferry's own; not the engine's or libzmq's C threads): what needs the
    interpreter lock."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):  # exited meanwhile, or not started
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def _sample(start: float, stop: threading.Event, samples: list, sides: list) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        t = os.times()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        samples.append(dict(t_s=round(time.time() - start, 3), cpu_s=round(t.user + t.system, 3),
                            python_cpu_s=round(python_cpu_s(), 3), rss_bytes=rss,
                            threads=len(os.listdir("/proc/self/task")), fds=len(os.listdir("/proc/self/fd")),
                            rooms_done=sum(s.out.rooms for s in sides), bytes=sum(s.out.bytes for s in sides),
                            msgs=sum(s.mgr.channel.num_received for s in sides)))
        if stop.wait(0.5):
            return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--index", required=True, help="comma-separated rank indices of this role")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    spec = ScaleSpec(**json.loads(args.spec))
    role = Role(args.role)
    indices = [int(i) for i in args.index.split(",")]
    everything = schedule(spec)
    mine = {i: [r for r in everything if (r.prefill if role is Role.PREFILL else r.decode) == i] for i in indices}
    expected = None
    if role is Role.DECODE:
        wanted = sorted({r.prefill for i in indices for r in mine[i]})
        expected = {p: prefill_buffers(spec, p) for p in wanted}
    sides = []
    shape = (spec.decode_pages, spec.page_size, spec.num_heads, spec.head_dim)
    for i in indices:
        bufs = prefill_buffers(spec, i) if role is Role.PREFILL else \
            [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * spec.num_layers)]
        pool = MHAPool(k=bufs[:spec.num_layers], v=bufs[spec.num_layers:], total_kv_heads=spec.num_heads)
        sides.append(Side(_manager(spec, role, i, [pool]), role, i, mine[i], bufs, Outcome(role.value, i)))
    emit("READY")
    line = sys.stdin.readline().split()
    start = float(line[1])
    while time.time() < start:
        time.sleep(min(0.01, max(0.0, start - time.time())))
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(start, stop, samples, sides), daemon=True)

    def work(side: Side) -> None:
        try:
            drive(spec, side, start, expected)
        except Exception as exc:  # reported, not a silent thread death
            side.out.unexpected.append([-1, f"{type(exc).__name__}: {exc}"])

    threads = [threading.Thread(target=work, args=(s,), name=f"scheduler-{s.index}") for s in sides]
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    for s in sides:
        s.mgr.close()
    emit("RESULT", dict(role=role.value, indices=indices, pid=os.getpid(),
                        outcomes=[asdict(s.out) for s in sides], samples=samples))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip teardown: each Mooncake engine's destructor holds the GIL for about a second
