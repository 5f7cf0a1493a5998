"""Fresh prefill -> decode pairs and neighbours on a rank's handshake port:
what :mod:`benchmarks.cold_start` measures and ``tests/scale`` checks.

:func:`run_pair` starts a NEW prefill and a NEW decode process
(:mod:`harness.rankctl`), puts a :class:`Neighbour` on decode's handshake
port, and runs two 4 MiB rooms one after the other (random bytes, every byte
checked by decode), each timed from decode's ``KVReceiver(...)`` to the
``poll()`` that returned Success; prefill reports the longest of its
scheduler calls.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness.ranks import Rank
from harness.workload import PoolSpec, Spec

VARIANTS = ("none", "probe", "idle1", "idle2")
# 4 layers of 8 KV heads x 128 x bf16: 16 KiB per token, 256 tokens: 4 MiB in one send.
MODEL = PoolSpec(role="target", attention="mha", num_layers=4, total_heads=8, head_dim=128)


def pair_spec(bootstrap: str, node: str) -> Spec:
    return Spec(bootstrap=bootstrap, prefill_pools=(MODEL,), decode_pools=(MODEL,), page_size=16,
                prefill_pages=64, decode_pages=256, aux_slots=64, min_tokens=256, max_tokens=256,
                chunk_pages=0, page_placement="scattered", timeout_s=60.0, seed=7, node_id=node)


class Neighbour:
    """What another process on the host does to one port, ``variant``:
    ``none``; ``probe``, a connect-and-close every 100 ms (a TCP health
    check); ``idleN``, N connections opened and left idle (a port scanner, a
    probe that never closes). ``close()`` stops it and closes its sockets."""

    def __init__(self, variant: str, port: int, host: str = "127.0.0.1") -> None:
        self.variant, self.addr = variant, (host, port)
        self.sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = None
        self.num_connects = 0
        if variant.startswith("idle"):
            for _ in range(int(variant[4:])):
                self.sockets.append(socket.create_connection(self.addr, timeout=2.0))
                self.num_connects += 1
        elif variant == "probe":
            # The first touch before the pair's first room, whatever the
            # thread's schedule: both rooms can end inside the first 100 ms.
            self._touch()
            self._thread = threading.Thread(target=self._probe, daemon=True)
            self._thread.start()
        elif variant != "none":
            raise ValueError(f"unknown neighbour {variant!r} (one of {', '.join(VARIANTS)})")

    def _touch(self) -> None:
        try:
            socket.create_connection(self.addr, timeout=1.0).close()
            self.num_connects += 1
        except OSError:
            pass

    def _probe(self) -> None:
        while not self._stop.wait(0.1):
            self._touch()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        for s in self.sockets:
            s.close()


def handshake_port(ready: dict) -> int:
    """Decode's handshake port from rankctl's READY (older transports: the session's port)."""
    return int(ready.get("handshake_port") or ready["session"].rpartition(":")[2])


def run_pair(bootstrap: str, index: int, variant: str, config: dict | None = None) -> dict:
    """One fresh pair: both ranks started, the neighbour on decode's
    handshake port, two rooms one after the other; what each took."""
    spec = pair_spec(bootstrap, f"cold-{variant}-{index}-{os.getpid()}")
    prefill = decode = neighbour = None
    try:
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(Rank, role, spec, config) for role in ("prefill", "decode")]
            prefill, decode = (f.result() for f in starting)
        neighbour = Neighbour(variant, handshake_port(decode.ready))
        rooms = []
        for room in (spec.first_room + 2 * index, spec.first_room + 2 * index + 1):
            with ThreadPoolExecutor(2) as pool:
                sent = pool.submit(prefill.rooms, [room], 60.0)
                got = decode.rooms([room], 60.0)
                sent = sent.result()
            d, p = got["results"][str(room)], sent["results"][str(room)]
            rooms.append({"room": room, "state": d["state"], "prefill_state": p["state"],
                          "latency_s": d["ended_at"] - d["created_at"], "error": d["error"] or p["error"],
                          "error_type": d["error_type"] or p["error_type"],
                          "mismatches": d.get("mismatches", []),
                          "prefill_max_call_s": sent["max_call_s"], "prefill_slowest_call": sent["slowest_call"],
                          "prefill_max_held_s": sent["max_held_s"], "prefill_slowest_calls": sent["slowest_calls"],
                          "decode_max_call_s": got["max_call_s"], "decode_slowest_call": got["slowest_call"]})
        return {"variant": variant, "pair": index, "rooms": rooms,
                "neighbour_connects": neighbour.num_connects}
    finally:
        if neighbour is not None:
            neighbour.close()
        for r in (prefill, decode):
            if r is not None:
                r.close()


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(pairs: list[dict]) -> list[dict]:
    """Per variant and room (first, second): min / median / p99 / max
    latency of the rooms that succeeded, failures, and prefill's longest
    scheduler call: its wall time, the longest it held its caller up
    (wall minus the thread's wait for a CPU) and the worst room's five
    slowest calls."""
    rows = []
    for variant in dict.fromkeys(p["variant"] for p in pairs):
        mine = [p for p in pairs if p["variant"] == variant]
        for k, which in enumerate(("first", "second")):
            rooms = [p["rooms"][k] for p in mine if len(p["rooms"]) > k]
            ok = [r["latency_s"] for r in rooms if r["state"] == "Success" and not r["mismatches"]]
            calls = [r["prefill_max_call_s"] for r in rooms]
            worst = max(rooms, key=lambda r: r["prefill_max_call_s"], default=None)
            rows.append({"variant": variant, "room": which, "num": len(rooms), "failed": len(rooms) - len(ok),
                         "min_s": min(ok, default=float("nan")), "median_s": statistics.median(ok) if ok else float("nan"),
                         "p99_s": _q(ok, 0.99) if ok else float("nan"), "max_s": max(ok, default=float("nan")),
                         "prefill_max_call_s": max(calls, default=0.0),
                         "prefill_max_held_s": max((r["prefill_max_held_s"] for r in rooms), default=0.0),
                         "prefill_slowest_calls": worst["prefill_slowest_calls"] if worst else [],
                         "errors": sorted({f"{r['error_type']}: {r['error']}"[:300] for r in rooms
                                           if r["state"] != "Success" or r["mismatches"]})})
    return rows


#: What joins the streaming pair's prefill rank (:func:`run_streaming`).
JOINS = ("new", "restarted", "held")


def run_streaming(bootstrap: str, *, events: int = 8, config: dict | None = None, env: dict | None = None,
                  gap_s: float = 0.3) -> dict:
    """One prefill rank P streams rooms to decode rank D1, one after another,
    while other decode ranks join P: ``new`` (a fresh process), ``restarted``
    (the previous joiner killed and a fresh one in its place), ``held`` (a
    fresh one with two idle connections on its handshake port), each
    ``events`` times, with quiet stretches between. Every room is byte-exact
    or reported. Returns D1's rooms (``created_at``, ``latency_s``) and each
    join's window: from the joiner being up (its process and manager built:
    not kvferry's to speed up) to its first room done, i.e. its lookup, hello,
    open and first room."""
    base = pair_spec(bootstrap, f"stream-{os.getpid()}")
    spec = Spec(**{**base.__dict__, "aux_slots": 4096, "timeout_s": 600.0})
    n_streamed = 4000
    d1_rooms = list(range(spec.first_room, spec.first_room + n_streamed))
    join_rooms = [spec.first_room + n_streamed + i for i in range(events * len(JOINS))]
    prefill = d1 = joiner = None
    stop = threading.Event()
    d1_out: list[dict] = []
    windows: list[dict] = []
    try:
        prefill = Rank("prefill", spec, config, env=env)
        d1 = Rank("decode", spec, config, env=env)
        # P takes D1's rooms as a scheduler takes a stream of requests (a few live at once, in order), and
        # holds the joiners' rooms from the start
        prefill.send(op="rooms", rooms=d1_rooms, eager=join_rooms, window=4, timeout_s=spec.timeout_s)

        def stream() -> None:
            for room in d1_rooms:
                if stop.is_set():
                    return
                r = d1.rooms([room], 60.0)["results"][str(room)]
                d1_out.append({"room": room, "state": r["state"], "mismatches": r.get("mismatches", []),
                               "created_at": r["created_at"], "ended_at": r["ended_at"],
                               "latency_s": r["ended_at"] - r["created_at"], "error": r["error"]})

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        time.sleep(2 * gap_s)
        k = 0
        for _ in range(events):
            for kind in JOINS:
                time.sleep(gap_s)
                if kind != "restarted" and joiner is not None:
                    joiner.close()
                elif joiner is not None:
                    joiner.kill()
                    joiner.close()
                joiner = Rank("decode", spec, config, env=env)
                neighbour = Neighbour("idle2" if kind == "held" else "none", handshake_port(joiner.ready))
                try:
                    up = time.time()
                    room = join_rooms[k]
                    k += 1
                    r = joiner.rooms([room], 60.0)["results"][str(room)]
                finally:
                    neighbour.close()
                windows.append({"kind": kind, "start": up, "end": r["ended_at"], "room": room, "state": r["state"],
                                "latency_s": r["ended_at"] - r["created_at"], "error": r["error"],
                                "mismatches": r.get("mismatches", [])})
        time.sleep(2 * gap_s)
        stop.set()
        streamer.join(120)
    finally:
        stop.set()
        for r in (joiner, d1, prefill):
            if r is not None:
                r.close()
    return {"d1": d1_out, "joins": windows}


def streaming_summary(run: dict) -> list[dict]:
    """D1's latency (p50 / p99 / max) over its rooms that overlap no join
    window (``quiet``) and over those that overlap a window of each kind,
    and each kind's first-room latency; failures counted."""
    d1, joins = run["d1"], run["joins"]

    def overlaps(room: dict, w: dict) -> bool:
        return room["created_at"] < w["end"] and room["ended_at"] > w["start"]

    rows = []
    groups = {"quiet": [r for r in d1 if not any(overlaps(r, w) for w in joins)]}
    for kind in JOINS:
        groups[kind] = [r for r in d1 if any(overlaps(r, w) for w in joins if w["kind"] == kind)]
    for name, rooms in groups.items():
        ok = [r["latency_s"] for r in rooms if r["state"] == "Success" and not r["mismatches"]]
        joined = [w["latency_s"] for w in joins if w["kind"] == name and w["state"] == "Success"
                  and not w["mismatches"]]
        rows.append({"while": name, "num": len(rooms), "failed": len(rooms) - len(ok),
                     "p50_s": statistics.median(ok) if ok else float("nan"),
                     "p99_s": _q(ok, 0.99) if ok else float("nan"), "max_s": max(ok, default=float("nan")),
                     "joins": len([w for w in joins if w["kind"] == name]),
                     "joins_failed": len([w for w in joins if w["kind"] == name]) - len(joined),
                     "join_first_room_max_s": max(joined, default=float("nan"))})
    return rows
