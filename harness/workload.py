"""A scripted prefill or decode rank for the demo, the end-to-end tests and
the benchmark: real processes, real Mooncake, random data, byte-exact checks.

``python -m harness.workload --role prefill|decode --tp-rank R --spec JSON``
runs one rank. Both sides derive everything from the spec's seed: the prefill
pools' content (each pool buffer is a slice of a seeded *global* tensor
``[num_pages, page_size, total_heads, head_dim]``, so any TP rank's heads can
be regenerated anywhere), each room's prefill pages and chunking, and the
decode side's page allocator. The decode rank checks every byte of every room
against the regenerated source, plus canary pages no room may touch, and
both print one JSON result line prefixed ``RESULT ``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from bootstrap.errors import BootstrapUnavailable
from bootstrap.messages import PoolRole
from harness.busywork import python_work
from harness.lines import emit
from transfer import tp
from transfer.config import Role, manager_config_from_env
from transfer.staging.hostmem import host_tensor
from transfer.manager import KVManager
from transfer.pools import MHAPool, MLAPool
from transfer.rooms.receiver import KVReceiver
from transfer.rooms.sender import KVSender
from transfer.state import KVPoll

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                 "float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}


@dataclass(frozen=True)
class PoolSpec:
    role: str = "target"
    attention: str = "mha"
    num_layers: int = 4
    total_heads: int = 8  # KV heads of the model (1 for MLA)
    head_dim: int = 128  # MLA: kv_lora_rank + rope_dim
    dtype: str = "bfloat16"
    page_layout: str = "nhd"  # MHA only: "nhd" token-major or "hnd" head-major pages


@dataclass(frozen=True)
class Spec:
    bootstrap: str
    prefill_pools: tuple[PoolSpec, ...]
    decode_pools: tuple[PoolSpec, ...]
    prefill_tp: int = 1
    decode_tp: int = 1
    page_size: int = 16
    prefill_pages: int = 256
    decode_pages: int = 512
    aux_slots: int = 64
    aux_slot_bytes: int = 64
    aux_regions: tuple[int, ...] = ()  # rankctl: row bytes of each aux region; empty: one of aux_slot_bytes
    num_rooms: int = 8
    concurrency: int = 4
    min_tokens: int = 256
    max_tokens: int = 2048
    chunk_pages: int = 0  # 0: one send per room; else chunks of this many pages
    layer_groups: int = 0  # 0: whole chunks; else each chunk as this many layer groups, the last layers first
    #: > 0: a modelled GPU forward pass (benchmarks.layerwise; one chunk per room): a room's layers are computed
    #: one after another from the moment its decode request arrived, each taking this long (a wait: on a GPU
    #: it costs the CPU nothing), and each layer group is sent when its last layer is done (whole: at the end)
    forward_layer_s: float = 0.0
    #: how the modelled forward hands its groups over: "due" (send() when a group's layers are done) or
    #: "launch" (every group at the forward's start, each with a ready event that completes when it is due,
    #: as an engine on a GPU launches the layers and records an event per group)
    forward_handover: str = "due"
    page_placement: str = "scattered"  # or "contiguous"
    seed: int = 1234
    timeout_s: float = 120.0
    protocol: str = "tcp"
    node_id: str = "prefill"
    allow_missing_draft: bool = False
    first_room: int = 1000
    decode_page_size: int = 0  # 0: the same as page_size (others test a mismatch)
    prefill_dp: int = 1  # DP groups of the prefill node, each with prefill_tp ranks
    dp_routing: str = "auto"  # "auto": decode leaves it to room % dp_size; "explicit": names the group
    slow_prefill_rank: int = -1  # this prefill TP rank holds each room's last chunk back...
    slow_delay_s: float = 0.0  # ...for this long (decode must wait for it)
    fill: str = "random"  # "random" bytes, or "constant" (cheap, for the benchmark)
    touch_staging: bool = False  # fault in the CPU staging buffer at start, as a warmed-up server has (benchmark)
    # the interpreter's GIL switch interval in the rank's process (0: CPython's 5 ms). A call that wants the
    # GIL while another thread runs Python waits up to one interval, so a bound on calls near 5 ms needs less.
    switch_interval_s: float = 0.0
    verify: bool = True  # decode checks every byte (the benchmark turns it off)
    warmup_rooms: int = 0  # leading rooms left out of timings (connection set-up)
    device: str = "cpu"  # where the KV pools live: "cpu", "cuda", "cuda:1" (filled on the host, then copied)
    aux_device: str = "cpu"  # where the aux tensor lives
    producer_sleep_cycles: int = 0  # CUDA: prefill writes each chunk late on a side stream (harness.producer)
    pass_ready: bool = True  # ...and passes its event to send() (False: the race the event prevents)
    prefill_hold_s: float = 0.0  # prefill stays registered this long after its last room ended
    #: > 0: a busy scheduler (benchmarks): each round of both loops spends this long in pure-Python work (an
    #: engine's step holding the interpreter lock) instead of waiting for progress
    busy_step_s: float = 0.0

    @staticmethod
    def from_json(text: str) -> Spec:
        raw = json.loads(text)
        raw.setdefault("decode_pools", raw["prefill_pools"])
        raw["prefill_pools"] = tuple(PoolSpec(**p) for p in raw["prefill_pools"])
        raw["decode_pools"] = tuple(PoolSpec(**p) for p in raw["decode_pools"])
        raw["aux_regions"] = tuple(raw.get("aux_regions", ()))
        return Spec(**raw)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


# --- deterministic content --------------------------------------------------------------


def _rng(*key: int | str) -> np.random.Generator:
    return np.random.default_rng([hash_str(k) if isinstance(k, str) else k for k in key])


def hash_str(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "little")


def global_buffer(spec: Spec, pool: PoolSpec, layer: int, comp: str, num_pages: int, seed_side: str) -> torch.Tensor:
    """Seeded random bytes shaped [num_pages, page_size, heads, head_dim]."""
    heads = pool.total_heads if pool.attention == "mha" else 1
    dtype = _TORCH_DTYPES[pool.dtype]
    shape = (num_pages, spec.page_size, heads, pool.head_dim)
    nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    # Huge-page host memory, touched, like the raw baselines' buffers (see transfer.staging.hostmem).
    buf = host_tensor(nbytes, fill=0x5A if spec.fill == "constant" else None)
    if spec.fill != "constant":  # the copy touches every page
        buf.numpy()[:] = np.frombuffer(_rng(spec.seed, seed_side, pool.role, layer, comp).bytes(nbytes), dtype=np.uint8)
    return buf.view(dtype).view(shape)


def rank_slice(t: torch.Tensor, pool: PoolSpec, rank: int, tp_size: int) -> torch.Tensor:
    """The heads a TP rank holds, in the pool's page layout."""
    if pool.attention != "mha":
        return _packed(t[:, :, 0, :])
    r = tp.heads_of(rank, tp_size, pool.total_heads)
    part = t[:, :, r.start:r.start + r.count, :]
    return _packed(part.permute(0, 2, 1, 3) if pool.page_layout == "hnd" else part)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous, else a contiguous copy in huge-page host memory."""
    if t.is_contiguous():
        return t
    out = host_tensor(t.numel() * t.element_size(), fill=None).view(t.dtype).view(t.shape)
    out.copy_(t)  # touches every page
    return out


def _components(pool: PoolSpec) -> tuple[str, ...]:
    return ("k", "v") if pool.attention == "mha" else ("latent",)


def build_pools(spec: Spec, pools: tuple[PoolSpec, ...], rank: int, tp_size: int, num_pages: int, side: str):
    """The rank's pool objects and their tensors, filled with seeded bytes."""
    out, tensors = [], {}
    if side == "decode" and spec.decode_page_size:
        spec = replace(spec, page_size=spec.decode_page_size)
    for pool in pools:
        bufs = {c: [on_device(rank_slice(global_buffer(spec, pool, l, c, num_pages, side), pool, rank, tp_size),
                              spec.device) for l in range(pool.num_layers)] for c in _components(pool)}
        tensors[pool.role] = bufs
        role = PoolRole(pool.role)
        if pool.attention == "mha":
            out.append(MHAPool(k=bufs["k"], v=bufs["v"], role=role, total_kv_heads=pool.total_heads,
                               layout=pool.page_layout))
        else:
            out.append(MLAPool(latent=bufs["latent"], role=role))
    return out, tensors


def on_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` on ``device`` (a copy there; ``t`` itself for the CPU). The copy
    from pageable memory returns once it landed, so a pool is complete
    before any manager reads it."""
    return t if device == "cpu" else t.to(device).contiguous()


def make_aux(spec: Spec) -> torch.Tensor:
    return torch.zeros(spec.aux_slots, spec.aux_slot_bytes, dtype=torch.uint8, device=spec.aux_device)


def dp_group(spec: Spec, room: int) -> int:
    """The prefill DP group that serves a room."""
    return room % spec.prefill_dp


def prefill_side(dp_rank: int) -> str:
    """The seed name of a prefill DP group's pool content."""
    return f"prefill-dp{dp_rank}"


def _forward_sends(spec: Spec, sender, chunks: list, total_layers: int) -> float | None:
    """The modelled forward pass of a room (``spec.forward_layer_s``): send
    the layer groups whose layers are done by now (the whole chunk once the
    last layer is); returns when the next group is due (None: all sent)."""
    pages, sizes, _, started = chunks[:4]
    if len(chunks) == 4:  # the forward's schedule: (due time, layers) per group, the first layers first
        done, schedule = 0, []
        for layers in sorted(layer_groups(spec), key=lambda g: -1 if g is None else g[0]):
            done += total_layers if layers is None else len(layers)
            schedule.append((started + done * spec.forward_layer_s, layers))
        chunks.append(schedule)
    schedule = chunks[4]
    if spec.forward_handover == "launch":
        for due, layers in schedule:
            sender.send(pages, last=True, layers=layers, ready=DueEvent(due))
        schedule.clear()
    while schedule and time.monotonic() >= schedule[0][0]:
        _, layers = schedule.pop(0)
        sender.send(pages, last=True, layers=layers)  # one chunk per room: every group is of the last chunk
    if schedule:
        return schedule[0][0]
    sizes.clear()
    return None


class DueEvent:
    """A modelled device event: complete from ``due`` (``time.monotonic()``) on."""

    def __init__(self, due: float) -> None:
        self.due = due

    def query(self) -> bool:
        return time.monotonic() >= self.due


def split_layers(total: int, groups: int) -> list[list[int]]:
    """``total`` room layers (the target's, then the draft's) as ``groups``
    groups, the last group first (any order is allowed)."""
    return [g.tolist() for g in reversed(np.array_split(np.arange(total), groups)) if g.size]


def layer_groups(spec: Spec) -> list:
    """The ``layers`` of each ``send()`` call of a chunk: [None] (whole
    chunks), or ``spec.layer_groups`` groups (:func:`split_layers`)."""
    if not spec.layer_groups:
        return [None]
    return split_layers(sum(p.num_layers for p in spec.prefill_pools), spec.layer_groups)


def room_plan(spec: Spec, room: int) -> tuple[np.ndarray, list[int]]:
    """A room's prefill pages (in request order) and its chunk sizes."""
    rng = _rng(spec.seed, "room", room)
    tokens = int(rng.integers(spec.min_tokens, spec.max_tokens + 1))
    n = -(-tokens // spec.page_size)
    if spec.page_placement == "contiguous":
        start = int(rng.integers(0, spec.prefill_pages - n + 1))
        pages = np.arange(start, start + n)
    else:
        pages = rng.permutation(spec.prefill_pages)[:n]
    step = spec.chunk_pages or n
    chunks = [min(step, n - i) for i in range(0, n, step)]
    return pages, chunks


def aux_region_bytes(spec: Spec) -> tuple[int, ...]:
    return tuple(spec.aux_regions) or (spec.aux_slot_bytes,)


def aux_row(spec: Spec, room: int) -> bytes:
    """The room's aux row: the rows of every aux region, back to back."""
    return _rng(spec.seed, "aux", room).bytes(sum(aux_region_bytes(spec)))


def aux_buffers(spec: Spec) -> list:
    """Zeroed aux regions ``[aux_slots, row bytes]``, one per entry of ``aux_region_bytes``."""
    return [torch.zeros(spec.aux_slots, n, dtype=torch.uint8, device=spec.aux_device) for n in aux_region_bytes(spec)]


def write_aux(regions, slot: int, row: bytes) -> None:
    off = 0
    for region in regions:
        n = region.shape[1]
        region[slot] = torch.frombuffer(bytearray(row[off:off + n]), dtype=torch.uint8)
        off += n


def read_aux(regions, slot: int) -> bytes:
    return b"".join(bytes(region[slot].cpu().numpy()) for region in regions)


# --- the two roles ------------------------------------------------------------------------


@dataclass
class Result:
    role: str
    tp_rank: int
    dp_rank: int = 0
    rooms: int = 0
    success: int = 0
    failed: list = field(default_factory=list)
    mismatches: list = field(default_factory=list)
    bytes: int = 0
    latencies_ms: list = field(default_factory=list)
    exposed_ms: list = field(default_factory=list)  # decode: per measured room, its exposed transfer time
    elapsed_s: float = 0.0  # from the first measured room's start to the last completion
    descriptors: int = 0
    cpu_s: float = 0.0  # process CPU time over the measured window
    control_msgs: int = 0  # control messages this rank received
    polls: int = 0  # poll() calls of the scheduler loop (it polls only rooms that changed)
    polls_if_all: int = 0  # what polling every live room on each iteration would have cost
    transport: str = ""  # the rank's transfer engine (RankInfo.transport)


def _manager(spec: Spec, role: Role, rank: int, dp_rank: int, pools, aux) -> KVManager:
    prefill = role is Role.PREFILL
    # KVFERRY_* variables tune what the spec leaves open (staging sizes, ...).
    base = manager_config_from_env(role)
    cfg = replace(base, bootstrap_addr=spec.bootstrap, node_id=spec.node_id, tp_rank=rank,
                  tp_size=spec.prefill_tp if prefill else spec.decode_tp,
                  dp_rank=dp_rank if prefill else 0, dp_size=spec.prefill_dp if prefill else 1,
                  engine=replace(base.engine, protocol=spec.protocol),
                  bootstrap_timeout_s=spec.timeout_s, transfer_timeout_s=spec.timeout_s,
                  allow_missing_draft=spec.allow_missing_draft,
                  # KVFERRY_METRICS_PORT is a base: prefill ranks serve base + rank, decode base + 100 + rank
                  metrics_port=base.metrics_port and base.metrics_port + (0 if prefill else 100) + rank
                  + (dp_rank * spec.prefill_tp if prefill else 0))
    mgr = KVManager(cfg, pools, aux=aux)
    if spec.touch_staging:
        mgr.touch_staging()
    return mgr


def wait_for_node(mgr: KVManager, spec: Spec) -> None:
    """Wait (at most ``spec.timeout_s``) until every DP group of the prefill
    node has a rank registered: decode and prefill processes start together
    here, and a lookup of a node not registered yet fails rooms at once once
    the bootstrap server is past its node grace time. Not until a group is
    whole: its ranks that serve other decode ranks may finish their rooms
    and leave before this rank looks (decode needs only the ranks its
    routes name, and waits for those itself)."""
    deadline = time.monotonic() + spec.timeout_s
    with mgr.bootstrap_client(spec.bootstrap) as client:
        for dp in range(spec.prefill_dp):
            while True:
                try:
                    if client.lookup(spec.node_id, dp, partial=True).ranks:
                        break
                except BootstrapUnavailable:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prefill node {spec.node_id!r} dp {dp} not registered within {spec.timeout_s} s")
                time.sleep(0.05)


def _rooms(spec: Spec) -> list[int]:
    return list(range(spec.first_room, spec.first_room + spec.num_rooms))


def run_prefill(spec: Spec, rank: int, dp_rank: int = 0) -> Result:
    pools, tensors = build_pools(spec, spec.prefill_pools, rank, spec.prefill_tp, spec.prefill_pages,
                                 prefill_side(dp_rank))
    producer = None
    if spec.producer_sleep_cycles:
        from harness.producer import SideStreamProducer
        producer = SideStreamProducer(tensors, spec.producer_sleep_cycles)
    aux = make_aux(spec)
    res = Result("prefill", rank, dp_rank)
    slow = rank == spec.slow_prefill_rank
    with _manager(spec, Role.PREFILL, rank, dp_rank, pools, aux) as mgr:
        rooms = [r for r in _rooms(spec) if dp_group(spec, r) == dp_rank]
        live: dict[int, tuple[KVSender, list | None, int]] = {}
        window = _Window(spec)
        mark, todo = mgr.progress, set()
        total_layers = sum(p.num_layers for p in spec.prefill_pools)
        if spec.forward_layer_s > 0 and spec.chunk_pages:
            raise ValueError("forward_layer_s models one forward per room: chunk_pages must be 0")
        while rooms or live:
            busy, sending = False, set()  # sending: rooms with chunks left, visited every round
            next_due = float("inf")  # the modelled forward's next layer group, if any
            while rooms and len(live) < spec.concurrency:
                room = rooms.pop(0)
                window.room_started(room)
                slot = room % spec.aux_slots
                aux[slot] = torch.frombuffer(bytearray(aux_row(spec, room)), dtype=torch.uint8)
                live[room] = (KVSender(mgr, spec.bootstrap, room), None, slot)
                todo.add(room)
            res.polls_if_all += len(live)
            for room in todo:  # new rooms, rooms that changed and rooms still sending: not every live room
                if room not in live:
                    continue
                sender, chunks, slot = live[room]
                state = sender.poll()
                res.polls += 1
                if state is KVPoll.WaitingForInput and chunks is None:
                    pages, sizes = room_plan(spec, room)
                    sender.init(len(pages), slot)
                    chunks = [pages, sizes, 0, time.monotonic()]
                    live[room] = (sender, chunks, slot)
                if spec.forward_layer_s > 0 and chunks is not None and chunks[1] \
                        and state in (KVPoll.WaitingForInput, KVPoll.Transferring):
                    due = _forward_sends(spec, sender, chunks, total_layers)
                    if due is not None:
                        next_due = min(next_due, due)
                        sending.add(room)
                elif chunks is not None and chunks[1] and state in (KVPoll.WaitingForInput, KVPoll.Transferring):
                    pages, sizes, off, ready_at = chunks
                    if not (slow and len(sizes) == 1 and time.monotonic() - ready_at < spec.slow_delay_s):
                        n = sizes.pop(0)  # one chunk per poll round, like chunked prefill
                        groups = layer_groups(spec)  # one call per group
                        if producer is None:
                            events = [None] * len(groups)
                        elif groups == [None]:
                            events = [producer.write(pages[off:off + n])]
                        else:  # a forward pass: the first layers first, each group with its own event
                            groups = sorted(groups)
                            events = producer.write_groups(pages[off:off + n], groups)
                        for layers, ready in zip(groups, events):
                            sender.send(pages[off:off + n], last=not sizes, ready=ready if spec.pass_ready else None,
                                        layers=layers)
                        chunks[2] = off + n
                    busy = busy or bool(sizes)
                    if sizes:
                        sending.add(room)
                if state in (KVPoll.Success, KVPoll.Failed):
                    _count(res, room, sender, state)
                    del live[room]
                    busy = busy or bool(rooms)  # a slot freed: start the next room now
            # Like a scheduler's idle loop: wake on any room's change of state
            # (a sleep-poll loop costs a fifth of a core on this VM); a busy one works its step.
            if spec.busy_step_s > 0:
                python_work(spec.busy_step_s)
            elif not busy:
                mgr.wait_for_progress(mark, max(0.0, min(0.005, next_due - time.monotonic())))
            mark, changed = mgr.changed_rooms(mark)  # None: fell behind, visit every room
            todo = set(live) if changed is None else {s.room for s, _ in changed} | sending
        res.elapsed_s, res.cpu_s = window.close()
        # A prefill node that leaves unregisters: a decode rank that looks it up
        # later learns only that it is gone, not why its rooms were refused.
        time.sleep(spec.prefill_hold_s)
        res.descriptors = mgr.transport.num_descriptors
        res.bytes = mgr.transport.num_bytes
        res.transport = mgr.rank.transport
        res.control_msgs = mgr.channel.num_received
    return res


def run_decode(spec: Spec, rank: int, dp_rank: int = 0) -> Result:
    pools, tensors = build_pools(spec, spec.decode_pools, rank, spec.decode_tp, spec.decode_pages, "decode")
    aux = make_aux(spec)
    prefill_roles = {q.role for q in spec.prefill_pools}
    expected = [] if not spec.verify else [{p.role: {c: [rank_slice(global_buffer(spec, p, l, c, spec.prefill_pages, prefill_side(g)), p,
                                         rank, spec.decode_tp) for l in range(p.num_layers)]
                          for c in _components(p)}
                 for p in spec.decode_pools if p.role in prefill_roles}
                for g in range(spec.prefill_dp)]
    rng = _rng(spec.seed, "decode-alloc", rank)
    canaries = list(range(spec.decode_pages - 4, spec.decode_pages))  # never allocated nor touched
    free = [int(x) for x in rng.permutation(spec.decode_pages - 4)]
    canary_bytes = {(role, c, l): t[canaries].clone() for role, bufs in tensors.items()
                    for c, ts in bufs.items() for l, t in enumerate(ts)}
    res = Result("decode", rank)
    with _manager(spec, Role.DECODE, rank, 0, pools, aux) as mgr:
        wait_for_node(mgr, spec)
        rooms = _rooms(spec)
        live: dict[int, tuple[KVReceiver, list[int], float, int]] = {}
        window = _Window(spec)
        mark, todo = mgr.progress, set()
        while rooms or live:
            busy = False
            while rooms and len(live) < spec.concurrency:
                room = rooms[0]
                n = len(room_plan(spec, room)[0])
                dst = _allocate(free, n, spec.page_placement == "contiguous")
                if dst is None:
                    if not live:
                        raise RuntimeError(f"decode pool of {spec.decode_pages} pages cannot hold room {room}")
                    break
                rooms.pop(0)
                window.room_started(room)
                group = dp_group(spec, room) if spec.dp_routing == "explicit" else None
                receiver = KVReceiver(mgr, spec.bootstrap, room, prefill_node=spec.node_id, prefill_dp_rank=group)
                slot = (room * 7) % spec.aux_slots
                receiver.init(dst, slot)
                live[room] = (receiver, dst, time.monotonic(), slot)
                todo.add(room)
            res.polls_if_all += len(live)
            for room in todo:  # new rooms and rooms that changed, not every live room
                if room not in live:
                    continue
                receiver, dst, started, slot = live[room]
                state = receiver.poll()
                res.polls += 1
                if state not in (KVPoll.Success, KVPoll.Failed):
                    continue
                if _count(res, room, receiver, state):
                    if window.measured(room):
                        res.latencies_ms.append((time.monotonic() - started) * 1e3)
                        exposed = receiver.stats().exposed_transfer_s
                        if exposed is not None:
                            res.exposed_ms.append(exposed * 1e3)
                        res.bytes += _room_bytes(tensors, dst, prefill_roles)
                    if spec.verify:
                        _verify(spec, room, dst, slot, tensors, expected[dp_group(spec, room)], aux, res.mismatches)
                free.extend(dst)
                del live[room]
                busy = busy or bool(rooms)  # a slot freed: start the next room now
            if spec.busy_step_s > 0:
                python_work(spec.busy_step_s)
            elif not busy:
                mgr.wait_for_progress(mark, 0.005)
            mark, changed = mgr.changed_rooms(mark)  # None: fell behind, visit every room
            todo = set(live) if changed is None else {r.room for r, _ in changed}
        res.elapsed_s, res.cpu_s = window.close()
        res.control_msgs = mgr.channel.num_received
        res.transport = mgr.rank.transport
        for (role, c, l), before in canary_bytes.items():
            if not torch.equal(tensors[role][c][l][canaries].view(torch.uint8), before.view(torch.uint8)):
                res.mismatches.append(f"canary pages of {role} {c} layer {l} were overwritten")
    return res


class _Window:
    """The measured part of a run: from the start of the first room after the
    warm-up ones to the last completion; wall and process CPU time."""

    def __init__(self, spec: Spec) -> None:
        self._first = spec.first_room + spec.warmup_rooms
        self._t0 = self._cpu0 = None

    def measured(self, room: int) -> bool:
        return room >= self._first

    def room_started(self, room: int) -> None:
        if room == self._first:
            self._t0, self._cpu0 = time.monotonic(), time.process_time()

    def close(self) -> tuple[float, float]:
        if self._t0 is None:
            return 0.0, 0.0
        return time.monotonic() - self._t0, time.process_time() - self._cpu0


def _room_bytes(tensors, dst, roles) -> int:
    """KV bytes a room's pages hold on this decode rank, over the pools the prefill sends."""
    return sum(len(dst) * t[0].numel() * t.element_size()
               for role, bufs in tensors.items() if role in roles for ts in bufs.values() for t in ts)


def _allocate(free: list[int], n: int, contiguous: bool) -> list[int] | None:
    """Take ``n`` pages off the free list: any (scattered) or a run of
    consecutive page ids (contiguous), like a serving engine's allocator."""
    if len(free) < n:
        return None
    if not contiguous:
        return [free.pop() for _ in range(n)]
    ordered = sorted(free)
    for i in range(len(ordered) - n + 1):
        if ordered[i + n - 1] - ordered[i] == n - 1:
            run = ordered[i:i + n]
            taken = set(run)
            free[:] = [p for p in free if p not in taken]
            return run
    return None


def _verify(spec, room, dst, slot, tensors, expected, aux, mismatches) -> None:
    src, _ = room_plan(spec, room)
    for role, bufs in expected.items():
        for c, ts in bufs.items():
            for l, want in enumerate(ts):
                got = tensors[role][c][l][dst].cpu()
                if not torch.equal(got.view(torch.uint8), want[src].view(torch.uint8)):
                    mismatches.append(f"room {room}: {role} {c} layer {l} differs")
    if bytes(aux[slot].cpu().numpy()) != aux_row(spec, room):
        mismatches.append(f"room {room}: aux row differs")


def _count(res: Result, room: int, obj, state: KVPoll) -> bool:
    """Record a room that ended; returns whether it succeeded."""
    res.rooms += 1
    if state is KVPoll.Success:
        res.success += 1
        return True
    res.failed.append([room, _why(obj)])
    return False


def _why(obj) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "unknown"


def _run_rank(spec: Spec, role: str, tp_rank: int, dp_rank: int) -> Result:
    try:
        if role == "prefill":
            return run_prefill(spec, tp_rank, dp_rank)
        return run_decode(spec, tp_rank)
    except Exception as exc:  # reported as a failed rank, not a silent thread death
        logging.getLogger("kvferry.workload").exception("%s rank %d crashed", role, tp_rank)
        res = Result(role, tp_rank, dp_rank)
        res.failed.append([-1, f"{type(exc).__name__}: {exc}"])
        return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--all-ranks", action="store_true",
                    help="run every rank of the role in this process, one thread each")
    ap.add_argument("--spec", required=True, help="the Spec as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"[{args.role}] %(name)s %(levelname)s %(message)s")
    spec = Spec.from_json(args.spec)
    if args.all_ranks:
        ranks = [(t, d) for d in range(spec.prefill_dp) for t in range(spec.prefill_tp)] \
            if args.role == "prefill" else [(t, 0) for t in range(spec.decode_tp)]
    else:
        ranks = [(args.tp_rank, args.dp_rank)]
    results: list[Result | None] = [None] * len(ranks)

    def work(i: int, tp_rank: int, dp_rank: int) -> None:
        results[i] = _run_rank(spec, args.role, tp_rank, dp_rank)

    threads = [threading.Thread(target=work, args=(i, t, d)) for i, (t, d) in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = True
    for (_tp_rank, dp_rank), res in zip(ranks, results):
        emit("RESULT", asdict(res))
        expect = sum(dp_group(spec, r) == dp_rank for r in _rooms(spec)) if args.role == "prefill" else spec.num_rooms
        ok &= res.success == res.rooms == expect and not res.mismatches and not res.failed
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every manager is closed by now; skip interpreter teardown, where each
    # Mooncake engine's destructor holds the GIL for about a second.
    os._exit(code)
