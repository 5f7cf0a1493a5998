"""The benchmark's NIXL modes for one workload, as table rows: raw NIXL
(``mode="nixl"``, baselines ``merged`` and ``same-pages``, see
:mod:`benchmarks.raw_nixl`) and kvferry's ranks on the NIXL transport
(``mode="kvferry-nixl"``). Each runs under one UCX transport selection
(``ucx_tls``): ``default`` (UCX picks: on one host, shared memory and
cross-memory attach) or a ``UCX_TLS`` value such as ``tcp``; every row names
its transport and ``ucx_tls``.
"""

from __future__ import annotations

import os

from benchmarks.hosts import LocalHost, Link, forwarded_env
from benchmarks.pages import ArenaLayout, format_buffers
from benchmarks.raw_nixl import DEFAULT_PROGRESS_DELAY_US
from benchmarks.runs import READY_TIMEOUT_S, RAW_LIFETIME_S, _raw_row, _raw_run, merged_sweep, run_kvferry
from benchmarks.workloads import Workload

# kvferry's NIXL transport is chosen by this one EngineConfig field (set in
# the ranks as KVFERRY_<FIELD>, read by manager_config_from_env).
NIXL_TRANSPORT_FIELD, NIXL_TRANSPORT_VALUE = "backend", "nixl"
TRANSPORT = "nixl-ucx"
_LOCAL = LocalHost()


def ucx_env(tls: str) -> tuple[dict[str, str], str]:
    """(the environment for the processes, the row's ``ucx_tls`` label) for
    ``tls``: ``default`` sets nothing (an inherited ``UCX_TLS`` is named)."""
    if tls == "default":
        return {}, os.environ.get("UCX_TLS", "default")
    return {"UCX_TLS": tls}, tls


def kvferry_nixl_missing() -> str:
    """Why kvferry's ranks cannot run on NIXL here ("" when they can)."""
    from dataclasses import fields

    from transfer.config import EngineConfig
    from transfer.storage.nixl.probe import nixl_missing_reason
    if NIXL_TRANSPORT_FIELD not in {f.name for f in fields(EngineConfig)}:
        return f"this kvferry has no NIXL transport (EngineConfig has no {NIXL_TRANSPORT_FIELD!r} field)"
    return nixl_missing_reason()


def run_kvferry_nixl(w: Workload, decode, link: Link, tls: str) -> dict:
    """kvferry end to end with every rank on the NIXL transport."""
    env, label = ucx_env(tls)
    env[f"KVFERRY_{NIXL_TRANSPORT_FIELD.upper()}"] = NIXL_TRANSPORT_VALUE
    return run_kvferry(w, decode, link, env, mode="kvferry-nixl", transport=TRANSPORT, ucx_tls=label)


def _receiver(decode, nbytes: int, env: dict[str, str], delay_us: int):
    recv = decode.spawn("nixl-recv", ["--bytes", str(nbytes), "--progress-delay-us", str(delay_us)],
                        {**forwarded_env(), **env}, lifetime_s=RAW_LIFETIME_S)
    addr, meta = recv.wait_line("RAW_READY ", READY_TIMEOUT_S).split()
    return recv, addr, meta


def run_nixl(w: Workload, decode, link: Link, entry_sizes: list[int], tls: str,
             delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> dict:
    """Raw NIXL, ``baseline="merged"``: each request's bytes from one
    contiguous buffer into another, as entries of each size given; the best kept."""
    if w.device != "cpu":
        raise ValueError(f"{w.name}: the raw NIXL baselines use host memory only")
    env, label = ucx_env(tls)
    size = w.request_bytes()
    recv, addr, meta = _receiver(decode, size * w.concurrency, env, delay_us)
    try:
        return merged_sweep(w, recv, entry_sizes, "nixl-merged", lambda args: _LOCAL.spawn("nixl-send", [
            "--meta", meta, "--addr", addr, *args, "--progress-delay-us", str(delay_us)], env),
            mode="nixl", transport=TRANSPORT, ucx_tls=label, progress_delay_us=delay_us)
    finally:
        recv.finish(30)


def run_nixl_pages(w: Workload, decode, link: Link, tls: str, delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> dict:
    """Raw NIXL, ``baseline="same-pages"``: the pages a kvferry request of
    ``w`` writes, between pools of kvferry's geometry."""
    if not w.has_same_pages_baseline or w.device != "cpu":
        raise ValueError(f"{w.name}: the same-pages baseline needs scattered host pages and TP 1 -> 1")
    env, label = ucx_env(tls)
    spec = w.spec()
    buffers = w.page_buffers()
    recv, addr, meta = _receiver(decode, ArenaLayout(buffers, spec.decode_pages).arena_bytes, env, delay_us)
    try:
        res = _raw_run(recv, "nixl-pages", lambda: _LOCAL.spawn("nixl-pages", [
            "--meta", meta, "--addr", addr, "--buffers", format_buffers(buffers),
            "--src-pages", str(spec.prefill_pages), "--dst-pages", str(spec.decode_pages),
            "--page-size", str(spec.page_size), "--tokens", str(w.tokens), "--seed", str(spec.seed),
            "--first-room", str(spec.first_room), "--requests", str(spec.num_rooms),
            "--warmup", str(spec.warmup_rooms), "--concurrency", str(w.concurrency),
            "--progress-delay-us", str(delay_us)], env), (spec.num_rooms - spec.warmup_rooms) / spec.num_rooms)
        return _raw_row(w, res, mode="nixl", baseline="same-pages", pattern="prepped", transport=TRANSPORT,
                        ucx_tls=label, progress_delay_us=delay_us)
    finally:
        recv.finish(30)
