"""One benchmark run of each mode for one workload, as table rows.

The prefill side runs on this host; the decode side on ``decode`` (this host
or another node's agent, see :mod:`benchmarks.hosts`), reached at the
addresses of ``link``. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import replace

import numpy as np

from benchmarks.hosts import Child, LocalHost, Link, forwarded_env
from benchmarks.pages import ArenaLayout, format_buffers
from benchmarks.workloads import Workload
from transfer.staging.hostmem import host_array
from harness.launch import BootstrapProcess, finish_ranks, results_of, start_ranks

KVFERRY_TIMEOUT_S = 900.0
READY_TIMEOUT_S = 120.0  # a receiver's set-up (engine, pre-faulting its pool)
SEND_TIMEOUT_S = 600.0
RAW_LIFETIME_S = 1800.0  # a remote raw receiver is killed after this, whatever happens here
_LOCAL = LocalHost()


def _pct(values, q) -> float:
    return round(float(np.percentile(values, q)), 3) if len(values) else 0.0


def row(w: Workload, mode: str, nbytes: int, seconds: float, latencies, descriptors: float, **extra) -> dict:
    return {"workload": w.name, "mode": mode, "tokens": w.tokens, "concurrency": w.concurrency,
            "bytes": int(nbytes), "gbps": round(nbytes / seconds / 1e9, 3) if seconds else 0.0,
            "p50_ms": _pct(latencies, 50), "p99_ms": _pct(latencies, 99),
            "descriptors_per_request": round(descriptors, 1),
            "load_1m": round(os.getloadavg()[0], 2),  # the machine may be shared: a disturbed run shows here
            **extra}


def run_kvferry(w: Workload, decode, link: Link, env: dict[str, str] | None = None, **labels) -> dict:
    """kvferry end to end: a bootstrap server and the prefill ranks here, the
    decode ranks on ``decode``; one process per rank. ``env`` goes to every
    rank (``KVFERRY_*`` config fields, ``UCX_*``); ``labels`` replace the
    row's ``mode`` and ``transport`` (default: ``kvferry``, Mooncake)."""
    env = env or {}
    spec = replace(w.spec(), protocol=link.protocol)
    runs = []
    with BootstrapProcess(host=link.hostname) as boot:
        spec = replace(spec, bootstrap=boot.address)
        deadline = time.monotonic() + KVFERRY_TIMEOUT_S
        prefill = [start_ranks(spec, "prefill", ["--tp-rank", str(t), "--dp-rank", str(d)],
                               env={**link.rank_env(False), **env})
                   for d in range(spec.prefill_dp) for t in range(spec.prefill_tp)]
        decode_children: list[Child] = []
        try:
            for t in range(spec.decode_tp):
                decode_children.append(decode.spawn("workload-decode", ["--tp-rank", str(t), "--spec", spec.to_json()],
                                                    {**forwarded_env(), **link.rank_env(True), **env},
                                                    lifetime_s=KVFERRY_TIMEOUT_S + 60))
            for child in decode_children:
                rc, log = child.finish(deadline - time.monotonic())
                runs += results_of(log, "decode", rc)
        except BaseException:
            deadline = time.monotonic()  # the prefill ranks are killed below, not waited on
            for child in decode_children:
                child.kill()
            raise
        finally:
            runs += [run for proc, out in prefill for run in finish_ranks(proc, out, "prefill", deadline)]
    for run in runs:
        r = run.result
        if r is None or r["failed"] or r["success"] != r["rooms"]:
            raise RuntimeError(f"kvferry run of {w.name} failed on {run.role} {run.tp_rank}:\n{run.log[-2000:]}")
    pre = [r.result for r in runs if r.role == "prefill"]
    dec = [r.result for r in runs if r.role == "decode"]
    nbytes = sum(d["bytes"] for d in dec)
    seconds = max(d["elapsed_s"] for d in dec)
    cpu = sum(r.result["cpu_s"] for r in runs)
    rooms = spec.num_rooms
    labels = {"mode": "kvferry", "transport": f"mooncake-{link.protocol}", **labels}
    return row(w, labels.pop("mode"), nbytes, seconds, [x for d in dec for x in d["latencies_ms"]],
               sum(p["descriptors"] for p in pre) / rooms, **labels,
               control_msgs_per_request=round(sum(r.result["control_msgs"] for r in runs) / rooms, 2),
               polls_per_request=round(sum(r.result.get("polls", 0) for r in runs) / rooms, 2),
               polls_if_all_per_request=round(sum(r.result.get("polls_if_all", 0) for r in runs) / rooms, 2),
               cpu_s_per_gb=round(cpu / (nbytes / 1e9), 3) if nbytes else None)


def _raw_result(sender: Child) -> dict:
    try:
        return json.loads(sender.wait_line("RAW_RESULT ", SEND_TIMEOUT_S))
    finally:
        sender.finish(30)


def _receiver_cpu(recv: Child, token: str) -> float:
    recv.send_line(f"cpu {token}")
    return float(recv.wait_line(f"RAW_CPU {token} ", READY_TIMEOUT_S))


def _raw_run(recv: Child, token: str, start_sender, measured_share: float) -> dict:
    """One raw sender run to its result. Its ``cpu_s`` (the sender's, over the
    measured requests) gains the receiver's CPU over the run, times
    ``measured_share`` (the warm-up requests' part left out), so that CPU
    per GB counts both processes as kvferry's does."""
    before = _receiver_cpu(recv, f"{token}-start")
    res = _raw_result(start_sender())
    res["receiver_cpu_s"] = (_receiver_cpu(recv, f"{token}-end") - before) * measured_share
    res["cpu_s"] += res["receiver_cpu_s"]
    return res


def _raw_row(w: Workload, res: dict, mode: str = "mooncake", **extra) -> dict:
    gb = res["bytes"] / 1e9
    return row(w, mode, res["bytes"], res["elapsed_s"], res["latencies_ms"], res["descriptors_per_request"],
               cpu_s_per_gb=round(res["cpu_s"] / gb, 3),
               receiver_cpu_s_per_gb=round(res["receiver_cpu_s"] / gb, 3), **extra)


def _best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["gbps"])


def merged_sweep(w: Workload, recv: Child, entry_sizes: list[int], token: str, start_sender, **row_extra) -> dict:
    """The ``merged`` baseline against a started raw receiver: for each entry
    size, one sender run (``start_sender(args)``, ``args`` the flags every raw
    sender takes: request and entry bytes, requests with one warm-up,
    concurrency) of ``w.requests`` measured requests; the fastest row."""
    size = w.request_bytes()
    rows = []
    for entry in entry_sizes:
        entry = min(entry, size)
        args = ["--request-bytes", str(size), "--entry-bytes", str(entry), "--requests", str(w.requests + 1),
                "--warmup", "1", "--concurrency", str(w.concurrency)]
        res = _raw_run(recv, f"{token}-{entry}", lambda: start_sender(args), w.requests / (w.requests + 1))
        rows.append(_raw_row(w, res, baseline="merged", entry_bytes=entry, **row_extra))
    return _best(rows)


def run_mooncake(w: Workload, decode, link: Link, entry_sizes: list[int]) -> dict:
    """Raw Mooncake, ``baseline="merged"``: each request's bytes from one
    contiguous buffer into another, as entries of each size given; the best kept."""
    size = w.request_bytes()
    recv = decode.spawn("mc-recv", ["--bytes", str(size * w.concurrency), "--pool-device", w.device,
                                    *link.engine_args(True)],
                        forwarded_env(), lifetime_s=RAW_LIFETIME_S)
    try:
        session, addr = recv.wait_line("RAW_READY ", READY_TIMEOUT_S).split()
        return merged_sweep(w, recv, entry_sizes, "merged", lambda args: _LOCAL.spawn("mc-send", [
            "--session", session, "--addr", addr, *args, "--pool-device", w.device, *link.engine_args(False)]),
            transport=f"mooncake-{link.protocol}")
    finally:
        recv.finish(30)


def run_mooncake_pages(w: Workload, decode, link: Link, patterns: list[str]) -> dict:
    """Raw Mooncake, ``baseline="same-pages"``: the pages a kvferry request
    of ``w`` writes, between pools of kvferry's geometry (see
    :mod:`benchmarks.raw_pages`), in each pattern given; the best kept."""
    if not w.has_same_pages_baseline:
        raise ValueError(f"{w.name}: the same-pages baseline needs scattered pages and TP 1 -> 1")
    spec = w.spec()
    buffers = w.page_buffers()
    recv = decode.spawn("mc-recv", ["--bytes", str(ArenaLayout(buffers, spec.decode_pages).arena_bytes),
                                    *link.engine_args(True)], forwarded_env(), lifetime_s=RAW_LIFETIME_S)
    try:
        session, addr = recv.wait_line("RAW_READY ", READY_TIMEOUT_S).split()
        rows = []
        for pattern in patterns:
            res = _raw_run(recv, f"pages-{pattern}", lambda: _LOCAL.spawn("mc-pages", [
                "--session", session, "--addr", addr, "--buffers", format_buffers(buffers),
                "--src-pages", str(spec.prefill_pages), "--dst-pages", str(spec.decode_pages),
                "--page-size", str(spec.page_size), "--tokens", str(w.tokens), "--seed", str(spec.seed),
                "--first-room", str(spec.first_room), "--requests", str(spec.num_rooms),
                "--warmup", str(spec.warmup_rooms), "--concurrency", str(w.concurrency), "--pattern", pattern,
                *link.engine_args(False)]), (spec.num_rooms - spec.warmup_rooms) / spec.num_rooms)
            rows.append(_raw_row(w, res, baseline="same-pages", pattern=pattern,
                                 transport=f"mooncake-{link.protocol}"))
        return _best(rows)
    finally:
        recv.finish(30)


def run_limits(w: Workload, decode, link: Link) -> list[dict]:
    """The link's limits: a plain TCP stream to the decode host (TCP only: on
    RDMA raw Mooncake is the limit), and a memcpy on this host."""
    rows = [_tcp_stream(w, decode, link)] if link.protocol == "tcp" else []
    rows.append(_memcpy(w))
    if w.device != "cpu":
        rows.append(_device_copy(w))
    return rows


def _tcp_stream(w: Workload, decode, link: Link) -> dict:
    size = w.request_bytes()
    total = size * w.requests
    recv = decode.spawn("sock-recv", ["--bytes", str(total), "--host", link.peer_hostname], {},
                        lifetime_s=RAW_LIFETIME_S)
    try:
        port = int(recv.wait_line("SOCK_READY ", READY_TIMEOUT_S))
        chunk = np.full(min(size, 1 << 20), 0x5A, dtype=np.uint8)
        view = memoryview(chunk)
        latencies = []
        with socket.create_connection((link.peer_hostname, port), timeout=SEND_TIMEOUT_S) as sock:
            t0 = time.monotonic()
            for _ in range(w.requests):
                started, left = time.monotonic(), size
                while left:
                    n = min(left, len(view))
                    sock.sendall(view[:n])
                    left -= n
                latencies.append((time.monotonic() - started) * 1e3)
            sock.recv(1)  # the receiver has read every byte
            stream_s = time.monotonic() - t0
    finally:
        recv.finish(30)
    return row(w, "limit", total, stream_s, latencies, 0, baseline="tcp-stream", transport="tcp-socket")


def _memcpy(w: Workload) -> dict:
    n = min(w.request_bytes(), 1 << 30)
    src, dst = host_array(n, fill=0x5A), host_array(n, fill=1)
    reps = max(1, min(w.requests, (4 << 30) // n))
    t0 = time.monotonic()
    for _ in range(reps):
        np.copyto(dst, src)
    copy_s = time.monotonic() - t0
    return row(w, "limit", n * reps, copy_s, [copy_s / reps * 1e3], 0, baseline="memcpy", transport="memcpy")


def _device_copy(w: Workload) -> dict:
    """The device-to-device copy limit: one request's bytes copied between two
    buffers of the pools' GPU (what a staging gather costs at best)."""
    import torch
    n = min(w.request_bytes(), 1 << 30)
    src = torch.full((n,), 0x5A, dtype=torch.uint8, device=w.device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    torch.cuda.synchronize(src.device)
    reps = max(1, min(w.requests, (16 << 30) // n))
    t0 = time.monotonic()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize(src.device)
    copy_s = time.monotonic() - t0
    return row(w, "limit", n * reps, copy_s, [copy_s / reps * 1e3], 0, baseline="d2d-copy")
