"""The simulated parts of ``python -m benchmarks.bootstrap_load``: prefill
ranks that re-register and decode ranks that send paced lookups, each in its
own process, over ZMQ DEALER sockets to 127.0.0.1 only. Requests carry a
request id frame (``[id, b"", payload]``), so replies are matched to their
send times whatever the order and whatever was lost in a restart."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

LOST_AFTER_S = 1.0  # a lookup unanswered for this long counts as lost
MAX_OUTSTANDING = 4000  # per client: beyond this a client stops sending (the rate is then not achieved)


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    ranks: int = 1000
    tp_size: int = 8
    layers: int = 61
    register_interval_s: float = 2.0
    lookup_rate: float = 10000.0
    steps: tuple[float, ...] = (2000.0, 5000.0, 10000.0, 20000.0, 40000.0)
    step_s: float = 3.0
    duration_s: float = 20.0
    clients: int = 2
    slo_ms: float = 50.0

    def __post_init__(self) -> None:
        if not (0 < self.ranks <= 20000 and 0 < self.clients <= 8 and self.duration_s <= 600 and self.step_s <= 60):
            raise ValueError("bounded: ranks in 1..20000, clients in 1..8, duration-s <= 600, step-s <= 60")
        if self.ranks % self.tp_size:
            raise ValueError("--ranks must be a multiple of --tp-size")


def make_rank(cfg: LoadConfig, i: int):
    from bootstrap.messages import (AttentionKind, BufferRef, Component, PageLayout, PoolDescriptor, PoolRole,
                                    RankInfo)
    node, tp = divmod(i, cfg.tp_size)
    page_bytes, num_pages = 64 * 576, 4096
    base = (1 << 40) + i * (1 << 34)
    pool = PoolDescriptor(role=PoolRole.TARGET, attention=AttentionKind.MLA, dtype="bfloat16", itemsize=2,
                          page_size=64, num_pages=num_pages, num_layers=cfg.layers, num_kv_heads=1, total_kv_heads=1,
                          head_dim=576, page_layout=PageLayout.NHD,
                          buffers=tuple(BufferRef(layer=layer, component=Component.LATENT,
                                                  addr=base + layer * (1 << 30), nbytes=page_bytes * num_pages * 2)
                                        for layer in range(cfg.layers)))
    return RankInfo(node_id=f"prefill-{node}", dp_rank=0, dp_size=1, tp_rank=tp, tp_size=cfg.tp_size,
                    session=f"127.0.0.1:{20000 + i}", control_endpoint=f"tcp://127.0.0.1:{30000 + i}",
                    pools=(pool,), aux=None)


def classify(reply: bytes) -> str:
    """ready | not_ready | unknown_node | error, by bytes (see the module doc)."""
    head = reply[:160]
    if b"\xa4kind\xaclookup_reply" not in head:
        return "error"
    if b"\xa5ready\xc3" in head:
        return "ready"
    return "unknown_node" if b"\xacunknown_node\xc3" in reply else "not_ready"  # small: no ranks


# --- simulated prefill ranks ---------------------------------------------------------


def registrar(cfg: LoadConfig, address: str, first: int, count: int, end_at: float, out) -> None:
    """Registers ranks first..first+count-1, each every register_interval_s
    (phases spread evenly), until ``end_at``; reports counts and latencies."""
    import zmq

    from bootstrap import codec
    from bootstrap.messages import Register
    payloads = [codec.encode(Register(rank=make_rank(cfg, i))) for i in range(first, first + count)]
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    step_s = cfg.register_interval_s / count  # rank k is due at k * step_s, then every interval
    next_due, k = time.monotonic(), 0
    sent_at: dict[int, float] = {}
    seq, latencies, errors = 0, [], 0
    while time.time() < end_at:
        now = time.monotonic()
        while next_due <= now:
            seq += 1
            sent_at[seq] = now
            sock.send_multipart([seq.to_bytes(8, "little"), b"", payloads[k]])
            k, next_due = (k + 1) % count, next_due + step_s
        wait_ms = max(1, int((next_due - now) * 1000))
        while sock.poll(wait_ms):
            wait_ms = 0
            rid, _, reply = sock.recv_multipart()
            t = sent_at.pop(int.from_bytes(rid, "little"), None)
            if t is not None:
                latencies.append(time.monotonic() - t)
            if b"registered" not in reply[:40]:
                errors += 1
        while sent_at:
            rid, t = next(iter(sent_at.items()))
            if now - t <= LOST_AFTER_S:
                break
            del sent_at[rid]
    out.put(("registrar", {"sent": seq, "answered": len(latencies), "errors": errors,
                           "latencies_s": latencies[::max(1, len(latencies) // 20000)]}))


# --- simulated decode ranks ----------------------------------------------------------


def lookup_client(cfg: LoadConfig, address: str, phases: list[tuple[str, float, float, float]], restart_at: float,
                  seed: int, out) -> None:
    """Sends lookups of random nodes at each phase's (name, rate, start,
    end) rate; per phase: sent, answered, lost, outcomes, latencies."""
    import zmq

    from bootstrap import codec
    from bootstrap.messages import Lookup
    rng = random.Random(seed)
    nodes = cfg.ranks // cfg.tp_size
    payloads = [codec.encode(Lookup(node_id=f"prefill-{n}", dp_rank=0)) for n in range(nodes)]
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, MAX_OUTSTANDING)
    sock.connect(f"tcp://{address}")
    results = {}
    seq = 0
    outstanding: dict[int, tuple[float, str]] = {}  # in send order
    offset = time.time() - time.monotonic()

    def account(entry: tuple[float, str], outcome: str) -> None:
        sent, phase = entry
        got = results[phase]
        got[outcome] += 1
        if outcome != "lost":
            got["latencies_s"].append(time.monotonic() - sent)
        after = sent + offset - restart_at  # > 0: sent after the restart began
        if after > 0 and outcome == "ready" and got["first_ready_after_s"] is None:
            got["first_ready_after_s"] = time.monotonic() + offset - restart_at
        if after > 0 and outcome != "ready":
            got["last_failed_sent_after_s"] = max(got["last_failed_sent_after_s"] or 0.0, after)

    for name, rate, start, end in phases:
        stats = results[name] = {"target_rate": rate, "sent": 0, "lost": 0, "skipped": 0, "latencies_s": [],
                                 "ready": 0, "not_ready": 0, "unknown_node": 0, "error": 0,
                                 "first_ready_after_s": None, "last_failed_sent_after_s": None}
        while time.time() < start:
            time.sleep(0.001)
        cpu_start = time.process_time()
        t0 = time.monotonic() - (time.time() - start)
        while time.time() < end:
            now = time.monotonic()
            for _ in range(min(int((now - t0) * rate) - stats["sent"] - stats["skipped"], 500)):
                if len(outstanding) >= MAX_OUTSTANDING:
                    stats["skipped"] += 1
                    continue
                try:
                    sock.send_multipart([(seq + 1).to_bytes(8, "little"), b"", payloads[rng.randrange(nodes)]],
                                        zmq.NOBLOCK)
                except zmq.Again:
                    stats["skipped"] += 1
                    continue
                seq += 1
                outstanding[seq] = (now, name)
                stats["sent"] += 1
            wait_ms = 1  # sends go out in batches of what fell due in a millisecond
            while sock.poll(wait_ms):
                wait_ms = 0
                rid, _, reply = sock.recv_multipart()
                entry = outstanding.pop(int.from_bytes(rid, "little"), None)
                if entry is not None:  # else: answered after it was counted lost
                    account(entry, classify(reply))
            while outstanding:
                rid, entry = next(iter(outstanding.items()))
                if now - entry[0] <= LOST_AFTER_S:
                    break
                del outstanding[rid]
                account(entry, "lost")
        stats["client_cpu_s"] = time.process_time() - cpu_start
    deadline = time.monotonic() + LOST_AFTER_S
    while outstanding and time.monotonic() < deadline and sock.poll(10):
        rid, _, reply = sock.recv_multipart()
        entry = outstanding.pop(int.from_bytes(rid, "little"), None)
        if entry is not None:
            account(entry, classify(reply))
    for entry in outstanding.values():
        account(entry, "lost")
    out.put(("lookups", results))
