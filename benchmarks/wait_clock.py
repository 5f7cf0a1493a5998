"""``python -m benchmarks.wait_clock``: what a thread's CPU clock counts
while the thread waits with the interpreter lock released.

A thread waits on an event, 10 ms at a time, and reads its CPU clock
(``time.thread_time``, what :class:`~transfer.round_times.RoundTimes`
measures a hold with) and its scheduler counters
(``/proc/self/task/TID/schedstat``: time on a CPU, time runnable, times
scheduled in) on either side of each wait. Loads, each in processes of their
own: ``none``; ``tcp``, a loopback TCP stream (a sender and a receiver, as
Mooncake's TCP transport moves pages); ``cpu``, two processes spinning in
Python. Each load runs twice: the waiting thread alone in its process, and
beside a second thread that runs pure Python meanwhile, so that each
wake-up waits for the interpreter lock.

The thread runs no Python between the two readings but the event's own few
lines, so whatever its clock gains there is not a hold of the interpreter
lock (docs/threads.md, "The clock inside a wait"). Prints a JSON list, one
object per load and thread: the clock per wait (p50, p99, max, ms), the
waits over 1 ms, and the longest five with their wall time and scheduler
counters (which count the thread's own reads of them too).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time

WAIT_S = 0.010
_CHUNK = 4 << 20


def _schedstat(tid: int) -> tuple[int, int, int]:
    """(ns on a CPU, ns runnable but waiting, times scheduled in) of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, delay, slices = map(int, f.read().split()[:3])
    return run, delay, slices


def _receive(listener: socket.socket, stop) -> None:
    conn, _ = listener.accept()
    buf = bytearray(1 << 20)
    while not stop.is_set() and conn.recv_into(buf):
        pass


def _send(port: int, stop) -> None:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5)
    data = bytes(_CHUNK)
    try:
        while not stop.is_set():
            conn.sendall(data)
    except OSError:  # the receiver stopped first
        pass


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(1000))


def _start_load(load: str, stop) -> list[mp.Process]:
    if load == "none":
        return []
    if load == "cpu":
        procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    elif load == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        procs = [mp.Process(target=_receive, args=(listener, stop), daemon=True),
                 mp.Process(target=_send, args=(port, stop), daemon=True)]
    else:
        raise SystemExit(f"unknown load {load!r}: none, tcp or cpu")
    for proc in procs:
        proc.start()
    if load == "tcp":
        listener.close()
    return procs


def _waits(n: int, busy_thread: bool) -> list[dict]:
    """``n`` waits of :data:`WAIT_S` on an event that is never set, each measured."""
    event, rows, done = threading.Event(), [], threading.Event()

    def waiter() -> None:
        tid = threading.get_native_id()
        for _ in range(n):
            sched0, wall0, cpu0 = _schedstat(tid), time.perf_counter(), time.thread_time()
            event.wait(WAIT_S)
            cpu1, wall1, sched1 = time.thread_time(), time.perf_counter(), _schedstat(tid)
            rows.append({"cpu_ms": (cpu1 - cpu0) * 1e3, "wall_ms": (wall1 - wall0) * 1e3,
                         "on_cpu_ms": (sched1[0] - sched0[0]) / 1e6, "runnable_ms": (sched1[1] - sched0[1]) / 1e6,
                         "scheduled_in": sched1[2] - sched0[2]})
        done.set()

    thread = threading.Thread(target=waiter, name="wait-clock")
    thread.start()
    while not done.wait(0 if busy_thread else 0.05):
        if busy_thread:
            sum(range(2000))
    thread.join()
    return rows


def run(load: str, n: int, busy_thread: bool) -> dict:
    stop = mp.Event()
    procs = _start_load(load, stop)
    try:
        time.sleep(0.5 if procs else 0)  # the load under way
        rows = _waits(n, busy_thread)
    finally:
        stop.set()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    cpu = sorted(r["cpu_ms"] for r in rows)
    longest = sorted(rows, key=lambda r: -r["cpu_ms"])[:5]
    return {"load": load, "busy_thread": busy_thread, "waits": n,
            "cpu_ms_p50": round(statistics.median(cpu), 3), "cpu_ms_p99": round(cpu[int(0.99 * (n - 1))], 3),
            "cpu_ms_max": round(cpu[-1], 3), "waits_over_1ms": sum(c > 1.0 for c in cpu),
            "wall_ms_p50": round(statistics.median(r["wall_ms"] for r in rows), 2),
            "longest": [{k: round(v, 3) for k, v in r.items()} for r in longest]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="none,tcp,cpu")
    ap.add_argument("--waits", type=int, default=500)
    args = ap.parse_args()
    print(json.dumps([run(load, args.waits, busy) for load in args.loads.split(",") for busy in (False, True)],
                     indent=1))


if __name__ == "__main__":
    main()
