"""One side (prefill or decode) of the vLLM-layout transfer tests, as a
long-lived process: ``python -m tests.layouts.layout_rank --role prefill``.

Reads one case per stdin line (JSON, see :class:`Case`) and answers one JSON
line per case. A side hosts all its TP ranks (one KVManager each, its own
Mooncake engine) so one process pair serves the whole matrix. The pools are
vLLM's per-layer views ``[blocks, heads, block_size, 2 * head_dim]`` of one
raw buffer in the case's physical layout; the data, the rooms and their page
lists follow from the case's seed, so decode computes the expected bytes of
its whole buffer (every page it did not receive unchanged) without being
sent them.

``driver``: ``manager`` (KVSender / KVReceiver on KVManagers) or ``worker``
(the vLLM connector's worker half, ``KvferryWorker``, driven as vLLM drives
it: ``register_kv_caches``, ``start``, ``finished``; no vLLM imported).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass, replace

import numpy as np
import torch

from harness.lines import emit
from transfer import KVManager
from transfer.config import EngineConfig, ManagerConfig, Role
from transfer.pools import FusedKVPool
from transfer.rooms.receiver import KVReceiver
from transfer.rooms.sender import KVSender
from transfer.state import KVPoll


@dataclass(frozen=True)
class Case:
    name: str
    bootstrap: str
    node: str
    layout: str  # vLLM's name: LBHNC, LBNHC, BLHNC, BLNHC
    kv_layout: str  # fused_rows (vLLM CPU) or fused_cells (GPU backends)
    prefill_tp: int
    decode_tp: int
    seed: int
    staged: bool  # staging buffers and the write fence (kvferry's default), else direct writes
    driver: str = "manager"
    decode_layout: str = ""  # decode's vLLM layout when it differs (cross-layer -> per-layer, ...)
    decode_kv_layout: str = ""
    num_layers: int = 3
    total_heads: int = 4
    head_dim: int = 16
    block_size: int = 16
    prefill_blocks: int = 40
    decode_blocks: int = 48
    num_rooms: int = 4
    timeout_s: float = 30.0
    expect_moved: bool = True  # False: decode's buffer must come out unchanged (a refused layout)


def logical_kv(case: Case) -> torch.Tensor:
    """The model's KV on prefill, in vLLM's logical order: [L, B, H, N, 2D]."""
    g = torch.Generator().manual_seed(case.seed)
    shape = (case.num_layers, case.prefill_blocks, case.total_heads, case.block_size, 2 * case.head_dim)
    return torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)


def rooms(case: Case) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(room id, prefill blocks, decode blocks) of each room: random sizes,
    random blocks, never block 0 (vLLM's null block), disjoint on decode."""
    rng = np.random.default_rng(case.seed + 1)
    sizes = rng.integers(1, 8, case.num_rooms)
    src = rng.choice(np.arange(1, case.prefill_blocks), int(sizes.sum()), replace=False)
    dst = rng.choice(np.arange(1, case.decode_blocks), int(sizes.sum()), replace=False)
    cuts = np.cumsum(sizes)[:-1]
    return [(case.seed * 1000 + i, s, d) for i, (s, d) in enumerate(zip(np.split(src, cuts), np.split(dst, cuts)))]


def cache(layout: str, num_layers: int, blocks: int, heads: int, case: Case, fill_seed: int | None):
    """(raw buffer, per-layer logical views [B, H, N, 2D]) in ``layout``."""
    n, c = case.block_size, 2 * case.head_dim
    shape = {"LBHNC": (num_layers, blocks, heads, n, c), "LBNHC": (num_layers, blocks, n, heads, c),
             "BLHNC": (blocks, num_layers, heads, n, c), "BLNHC": (blocks, num_layers, n, heads, c)}[layout]
    if fill_seed is None:
        raw = torch.zeros(shape, dtype=torch.bfloat16)
    else:
        g = torch.Generator().manual_seed(fill_seed)
        raw = torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
    return raw, layer_views(raw, layout, num_layers)


def heads_of(rank: int, tp: int, total: int) -> slice:
    per = total // tp
    return slice(rank * per, (rank + 1) * per)


def config(case: Case, role: Role, rank: int, tp: int) -> ManagerConfig:
    extra = {} if case.staged else {"staging_bytes": 0, "write_fence": False}
    return ManagerConfig(role=role, bootstrap_addr=case.bootstrap, node_id=case.node, host="127.0.0.1",
                         tp_rank=rank, tp_size=tp, engine=replace(EngineConfig(), protocol="tcp", hostname="127.0.0.1"),
                         peer_timeout_s=10.0, transfer_timeout_s=case.timeout_s, bootstrap_timeout_s=case.timeout_s,
                         **({"staging_bytes": 4 << 20, "stage_part_bytes": 1 << 20} if case.staged else extra))


def wait_all(handles: list, timeout_s: float, step=None) -> list[str]:
    """Poll until every handle is terminal; the failures, as text."""
    deadline = time.monotonic() + timeout_s
    pending = list(handles)
    failed = []
    while pending:
        if time.monotonic() > deadline:
            return failed + [f"timed out: {len(pending)} rooms not done"]
        for h in list(pending):
            state = h.poll()
            if step is not None:
                step(h, state)
            if state in (KVPoll.Success, KVPoll.Failed):
                pending.remove(h)
                if state is KVPoll.Failed:
                    try:
                        h.failure_exception()
                    except Exception as exc:  # noqa: BLE001 - reported as text
                        failed.append(f"room {h.room}: {exc}")
        time.sleep(0.005)
    return failed


def run_prefill(case: Case) -> dict:
    kv = logical_kv(case)
    caches = []
    for rank in range(case.prefill_tp):
        h = heads_of(rank, case.prefill_tp, case.total_heads)
        raw, views = cache(case.layout, case.num_layers, case.prefill_blocks, h.stop - h.start, case, fill_seed=None)
        for layer, v in enumerate(views):
            v.copy_(kv[layer][:, h])
        caches.append((raw, views))
    if case.driver == "worker":
        return _worker_side(case, Role.PREFILL, case.prefill_tp, caches)
    mgrs = [KVManager(config(case, Role.PREFILL, r, case.prefill_tp),
                      [FusedKVPool(kv=caches[r][1], total_kv_heads=case.total_heads, kv_layout=case.kv_layout,
                                   vllm_layout=case.layout)]) for r in range(case.prefill_tp)]
    print(f"REGISTERED {case.name}", flush=True)  # decode looks the node up only now
    try:
        senders, pages, sent = [], {}, set()
        for room, src, _ in rooms(case):
            for mgr in mgrs:
                s = KVSender(mgr, None, room)
                s.init(len(src))
                pages[id(s)] = src
                senders.append(s)

        def push(s, state):
            if state is KVPoll.WaitingForInput and id(s) not in sent:
                sent.add(id(s))
                s.send(pages[id(s)], last=True)
        failed = wait_all(senders, case.timeout_s, push)
        return {"failed": failed, "rooms": len(senders)}
    finally:
        for mgr in mgrs:
            mgr.close()


def run_decode(case: Case) -> dict:
    layout = case.decode_layout or case.layout
    kv_layout = case.decode_kv_layout or case.kv_layout
    caches, expected = [], []
    for rank in range(case.decode_tp):
        h = heads_of(rank, case.decode_tp, case.total_heads)
        raw, views = cache(layout, case.num_layers, case.decode_blocks, h.stop - h.start, case,
                           fill_seed=case.seed + 7 + rank)
        want = raw.clone()
        want_views = layer_views(want, layout, case.num_layers)
        caches.append((raw, views))
        expected.append((want, want_views, h))
    kv = logical_kv(case)
    for _, src, dst in rooms(case) if case.expect_moved else ():
        for _want, want_views, h in expected:
            for layer, v in enumerate(want_views):
                v[torch.as_tensor(dst)] = kv[layer][torch.as_tensor(src)][:, h]
    if case.driver == "worker":
        result = _worker_side(case, Role.DECODE, case.decode_tp, caches, layout=layout, kv_layout=kv_layout)
    else:
        mgrs = [KVManager(config(case, Role.DECODE, r, case.decode_tp),
                          [FusedKVPool(kv=caches[r][1], total_kv_heads=case.total_heads, kv_layout=kv_layout,
                                       vllm_layout=layout)]) for r in range(case.decode_tp)]
        try:
            receivers = []
            for room, _, dst in rooms(case):
                for mgr in mgrs:
                    r = KVReceiver(mgr, case.bootstrap, room, prefill_node=case.node)
                    r.init(dst)
                    receivers.append(r)
            result = {"failed": wait_all(receivers, case.timeout_s), "rooms": len(receivers)}
        finally:
            for mgr in mgrs:
                mgr.close()
    mismatches = []
    for rank, ((raw, _), (want, _, _)) in enumerate(zip(caches, expected)):
        got, exp = raw.view(torch.int16), want.view(torch.int16)
        if not torch.equal(got, exp):
            diff = (got != exp).nonzero()
            mismatches.append(f"decode rank {rank}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}")
    result.update(mismatches=mismatches, bytes=sum(raw.numel() * raw.element_size() for raw, _ in caches))
    return result


def layer_views(raw: torch.Tensor, layout: str, num_layers: int) -> list:
    """vLLM's per-layer logical views [B, H, N, 2D] of a raw buffer in ``layout``."""
    views = []
    for layer in range(num_layers):
        v = raw[layer] if layout.startswith("LB") else raw[:, layer]
        views.append(v if layout.endswith("HNC") else v.permute(0, 2, 1, 3))
    return views


def _worker_side(case: Case, role: Role, tp: int, caches: list, *, layout: str = "", kv_layout: str = "") -> dict:
    """The connector's worker half, one per TP rank, driven as vLLM does."""
    from transfer.adapters.vllm.params import ConnectorConfig, RecvSpec, SendSpec
    from transfer.adapters.vllm.caches import CacheLayout
    from transfer.adapters.vllm.decode_worker import DecodeWorker
    from transfer.adapters.vllm.prefill_worker import PrefillWorker

    manager = {"peer_timeout_s": 10.0, "transfer_timeout_s": case.timeout_s, "bootstrap_timeout_s": case.timeout_s}
    manager.update({"staging_bytes": 4 << 20, "stage_part_bytes": 1 << 20} if case.staged else {"staging_bytes": 0})
    cc = ConnectorConfig(bootstrap_addr=case.bootstrap, node_id=case.node, manager=manager)
    lay = CacheLayout(total_kv_heads=case.total_heads, kv_layout=kv_layout or case.kv_layout,
                      vllm_layout=layout or case.layout)
    workers = []
    try:
        for rank in range(tp):
            w = (PrefillWorker if role is Role.PREFILL else DecodeWorker)(cc, tp_rank=rank, tp_size=tp, layout=lay)
            w.register_kv_caches({f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(caches[rank][1])})
            workers.append(w)
        if role is Role.PREFILL:
            print(f"REGISTERED {case.name}", flush=True)
        specs = rooms(case)
        ids = {f"req-{room}" for room, _, _ in specs}
        for w in workers:
            if role is Role.PREFILL:
                w.start([SendSpec(req_id=f"req-{room}", room=room, pages=tuple(map(int, src)))
                         for room, src, _ in specs])
            else:
                w.start([RecvSpec(req_id=f"req-{room}", room=room, bootstrap_addr=case.bootstrap,
                                      node_id=case.node, pages=tuple(map(int, dst))) for room, _, dst in specs])
        deadline = time.monotonic() + case.timeout_s
        done = [set() for _ in workers]
        errors = set()
        while any(d != ids for d in done) and time.monotonic() < deadline:
            for w, d in zip(workers, done):
                sending, recving = w.finished(ids)  # vLLM says every request finished
                d |= sending | recving
                errors |= w.load_errors() if role is Role.DECODE else set()
            time.sleep(0.01)
        failed = [f"rank {i}: {len(ids - d)} requests not done" for i, d in enumerate(done) if d != ids]
        failed += [f"{sum(w.num_failed for w in workers)} rooms failed"] if any(w.num_failed for w in workers) else []
        failed += [f"load errors on blocks {sorted(errors)[:5]}"] if errors else []
        return {"failed": failed, "rooms": len(specs) * tp}
    finally:
        for w in workers:
            w.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    args = parser.parse_args()
    run = run_prefill if args.role == "prefill" else run_decode
    emit("READY")
    for line in sys.stdin:
        if not line.strip():
            continue
        case = Case(**json.loads(line))
        start = time.monotonic()
        try:
            result = run(case)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = {"failed": [f"{type(exc).__name__}: {exc}"], "trace": traceback.format_exc()[-3000:]}
        result.update(name=case.name, seconds=round(time.monotonic() - start, 3))
        emit("RESULT", result)


if __name__ == "__main__":
    main()
