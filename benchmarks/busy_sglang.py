"""SGLang's own Mooncake backend in the busy-scheduler benchmark (see :mod:`benchmarks.busy`).

:func:`run_sglang_cell` (the driver's side, any environment) starts SGLang's
Mooncake bootstrap server and one prefill and one decode rank in
``.venv-sglang``; ``python -m benchmarks.busy_sglang prefill|decode --config
JSON --port P --model-dir D`` is one rank. A rank is built as SGLang builds
it (:class:`tests.engines.sglang.sglang_rank.Rank`: its real ``MHATokenToKVPool``
of the benchmark's geometry, ``KVArgs``, ``MetadataBuffers``, the manager of
``get_kv_class``) and driven as SGLang's schedulers drive it: every step,
``poll_and_all_reduce`` over the live rooms (a gloo group of one rank);
prefill answers ``WaitingForInput`` with ``init`` and one ``send`` of every
page (the aux row written first, as ``MetadataBuffers.set_buf`` does);
decode opens a room with ``init`` and ``send_metadata``. Pages and timing
are the other systems' (:mod:`benchmarks.busy_loop`), shifted by one page:
SGLang keeps page 0 as padding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from benchmarks.busy_loop import FIRST_ROOM, BusyConfig, DecodePages, Feed, Scheduler, ready, result_line, src_pages

TIMEOUT_S = 600.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".venv-sglang", "bin", "python")


# --- the driver's side ----------------------------------------------------------------


def run_sglang_cell(cfg: BusyConfig) -> list[dict]:
    """Both sides' ``BUSY_RESULT`` dicts of one cell."""
    from benchmarks.busy import Cell, _line
    from tests.engines.sglang.procs import MODEL_CONFIG, child_env, free_port

    port = free_port()
    # Mooncake's TCP per-peer queue caps, raised as kvferry and the raw-engine cells raise them: at
    # their defaults (1024 + 1024) an 8k request's one batch of 8,192 pieces is refused outright.
    env = child_env({"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
                     "MC_TCP_ADMISSION_TIMEOUT_MS": "60000"})
    with tempfile.TemporaryDirectory(prefix="busy-sglang-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**MODEL_CONFIG, "num_hidden_layers": cfg.layers, "num_key_value_heads": cfg.heads,
                       "num_attention_heads": cfg.heads, "head_dim": cfg.head_dim,
                       "hidden_size": cfg.heads * cfg.head_dim}, f)
        common = ["--port", str(port), "--model-dir", model_dir]
        server = subprocess.Popen([PYTHON, "-m", "tests.engines.sglang.rank", "--role", "bootstrap", "--backend",
                                   "mooncake", "--timeout", str(TIMEOUT_S), *common], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        cell, ranks = Cell(), []
        try:
            _line(server, "READY ", 120)
            ranks += [cell.spawn(role, cfg, *common, python=PYTHON, module="benchmarks.busy_sglang", base_env=env,
                                cwd=ROOT) for role in ("prefill", "decode")]
            for proc in ranks:
                cell.ready(proc)
            return cell.drive(cfg, ranks)
        finally:
            for proc in ranks:
                if proc.stdin and not proc.stdin.closed:
                    proc.stdin.close()
            cell.close()
            server.kill()
            server.wait(30)


# --- a rank (in .venv-sglang) ---------------------------------------------------------


def _rank(cfg: BusyConfig, role: str, port: int, model_dir: str):
    from tests.engines.sglang.sglang_rank import Rank

    pages = cfg.prefill_pages if role == "prefill" else cfg.decode_pages
    a = SimpleNamespace(role=role, backend="mooncake", port=port, tp_rank=0, tp_size=1, pool="mha", draft=False,
                        layers=cfg.layers, heads=cfg.heads, head_dim=cfg.head_dim, page_size=cfg.page_size,
                        pool_pages=pages + 1, model_dir=model_dir, seed=cfg.seed, scenario="bench", dp_size=1,
                        load_balance="auto", state="", kv_checksum=False)
    return Rank(a)


def _gloo_group(port: int):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    return dist.group.WORLD


def _error_of(obj) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:  # SGLang's exception types
        return f"{type(exc).__name__}: {exc}"[:500]
    return ""


def run_prefill(cfg: BusyConfig, rank, group, addr: str) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    live: dict[int, list] = {}
    created, sent, done, failed, errors = {}, {}, {}, [], {}
    ready()
    sched, feed = Scheduler(cfg), Feed()
    cpu0, deadline = time.process_time(), time.monotonic() + TIMEOUT_S
    while not (feed.closed and not live) and time.monotonic() < deadline:
        for room in feed.take():
            live[room] = [rank.sender_cls(mgr=rank.mgr, bootstrap_addr=addr, bootstrap_room=room), False]
            created[room] = time.time()
        sched.step()
        rooms = list(live)
        polls = poll_and_all_reduce([live[r][0] for r in rooms], group)
        for room, poll in zip(rooms, polls):
            sender, was_sent = live[room]
            if poll == KVPoll.WaitingForInput and not was_sent:
                pages = src_pages(cfg, room - FIRST_ROOM) + 1
                slot = room % len(rank.meta.bootstrap_room)
                sender.init(len(pages), slot)
                rank.meta.bootstrap_room[slot] = 0
                rank.meta.bootstrap_room[slot, 0] = room
                sent[room] = time.time()
                sender.send(pages.astype(np.int32))
                live[room][1] = True
            elif poll in (KVPoll.Success, KVPoll.Failed):
                done[room] = time.time()
                if poll == KVPoll.Failed:
                    failed.append(room)
                    errors.setdefault(_error_of(sender), room)
                del live[room]
                Feed.done("prefill", room)
    sched.stop()
    return dict(created=created, done=done, sent=sent, failed=failed + sorted(live),
                cpu_s=time.process_time() - cpu0, errors=list(errors)[:5])


def run_decode(cfg: BusyConfig, rank, group, addr: str) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    deadline = time.monotonic() + 120
    while not rank.mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            raise SystemExit("prefill's parallel info never arrived")
        time.sleep(0.05)
    alloc = DecodePages(cfg)
    live: dict[int, tuple] = {}
    created, done, failed, errors = {}, {}, [], {}
    ready()
    sched, feed = Scheduler(cfg), Feed()
    cpu0, deadline = time.process_time(), time.monotonic() + TIMEOUT_S
    slots = len(rank.meta.bootstrap_room)
    while not (feed.closed and not live) and time.monotonic() < deadline:
        for room in feed.take():
            created[room] = time.time()
            receiver = rank.receiver_cls(mgr=rank.mgr, bootstrap_addr=addr, bootstrap_room=room)
            receiver.init(0)
            dst, slot = alloc.take(), room % slots
            rank.meta.clear_slot(slot)
            receiver.send_metadata((dst + 1).astype(np.int32), slot, None)
            live[room] = (receiver, dst, slot)
        sched.step()
        rooms = list(live)
        gate = [SimpleNamespace(req=SimpleNamespace(bootstrap_host="127.0.0.1"), metadata_buffer_index=live[r][2])
                for r in rooms]
        polls = poll_and_all_reduce([live[r][0] for r in rooms], group, gate, rank.meta)
        for room, poll in zip(rooms, polls):
            if poll in (KVPoll.Success, KVPoll.Failed):
                done[room] = time.time()
                if poll == KVPoll.Failed:
                    failed.append(room)
                    errors.setdefault(_error_of(live[room][0]), room)
                alloc.give(live[room][1])
                del live[room]
                Feed.done("decode", room)
    sched.stop()
    return dict(created=created, done=done, failed=failed + sorted(live), cpu_s=time.process_time() - cpu0,
                errors=list(errors)[:5])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.busy_sglang")
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--port", type=int, required=True, help="SGLang's bootstrap server")
    ap.add_argument("--model-dir", required=True)
    a = ap.parse_args(argv)
    cfg = BusyConfig.from_json(a.config)
    from sglang.srt.plugins import load_plugins

    from tests.engines.sglang.procs import free_port

    load_plugins()
    rank = _rank(cfg, a.role, a.port, a.model_dir)
    group = _gloo_group(free_port())
    run = run_prefill if a.role == "prefill" else run_decode
    out = run(cfg, rank, group, f"127.0.0.1:{a.port}")
    print(result_line(a.role, out.pop("created"), out.pop("done"), **out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # SGLang's engine threads are not joined


if __name__ == "__main__":
    sys.exit(main())
