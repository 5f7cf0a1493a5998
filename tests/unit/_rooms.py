"""Prefill and decode managers in one process, joined by the loopback pair
(:class:`~transfer.transport.loopback.LoopbackFabric`) and a real bootstrap
server bound to 127.0.0.1 on a random port. CPU tensors filled with random
bytes; every check compares bytes exactly."""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from bootstrap.messages import PoolRole
from bootstrap.server import BootstrapServer
from transfer import KVManager, KVPoll, KVReceiver, KVSender, ManagerConfig, MHAPool, Role
from transfer.state_pools import StatePool
from transfer.transport.loopback import LoopbackFabric

NUM_PAGES = 64
PAGE_SIZE = 4
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 16
AUX_SLOTS, AUX_BYTES = 8, 32

# Short bounds: a test that goes wrong fails in seconds, not minutes. Peers
# are taken for lost only after 3 s of silence: a busy machine must not fail
# rooms by accident (the lost-peer test shortens it).
FAST = dict(heartbeat_interval_s=0.1, peer_timeout_s=3.0, bootstrap_timeout_s=5.0, transfer_timeout_s=10.0,
            rpc_timeout_s=1.0, register_interval_s=0.5, register_timeout_s=5.0, staging_bytes=0,
            layerwise_min_tokens=0)  # these rooms are short: layer groups stream however short


@dataclass
class Rank:
    mgr: KVManager
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    aux: torch.Tensor | list[torch.Tensor]  # a list: several aux regions
    states: tuple = ()  # StatePools
    draft: tuple = ()  # a draft pool's K and V tensors (layer by layer), when the rank has one

    def state_bytes(self, index: int, items) -> list[bytes]:
        """Every buffer's bytes of ``items`` of state pool ``index`` (in order)."""
        idx = torch.as_tensor(np.asarray(items, dtype=np.int64))
        return [t.index_select(0, idx).view(torch.uint8).numpy().tobytes() for t in self.states[index].buffers]

    def page_bytes(self, pages) -> list[bytes]:
        """Every buffer's bytes of ``pages`` (in order), K and V of each layer (the draft pool's after)."""
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        return [t.index_select(0, idx).view(torch.uint8).numpy().tobytes() for t in (*self.k, *self.v, *self.draft)]

    def aux_bytes(self, slot: int) -> bytes:
        regions = self.aux if isinstance(self.aux, list) else [self.aux]
        return b"".join(r[slot].numpy().tobytes() for r in regions)


def _random(shape, gen: torch.Generator) -> torch.Tensor:
    n = int(np.prod(shape)) * 2
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(torch.bfloat16).view(*shape)


@dataclass
class Cluster:
    """One bootstrap server, one fabric, and the managers the test made."""

    fabric: LoopbackFabric
    server: BootstrapServer
    stack: ExitStack
    seed: int = 0
    ranks: list[Rank] = field(default_factory=list)

    def rank(self, role: Role, *, heads: int = NUM_HEADS, total_heads: int | None = None,
             page_size: int = PAGE_SIZE, aux_row_bytes: tuple[int, ...] | None = None, states=(),
             draft_layers: int = 0, handshake_timeout_s: float = 5.0, **overrides) -> Rank:
        """A manager with one MHA pool of ``heads`` KV heads (of ``total_heads``
        in the model) and an aux tensor (``aux_row_bytes``: one aux region of
        each row size instead); prefill's are random, decode's zero.
        ``states``: (kind, sharding, exact, buffer shapes[, slicing]) of state
        pools to add (each shape ``[num_items, ...]``, bfloat16), random or zero
        likewise. ``draft_layers``: a draft pool of that many layers (same heads)."""
        gen = torch.Generator().manual_seed(self.seed + len(self.ranks))
        shape = (NUM_PAGES, page_size, heads, HEAD_DIM)
        fill = role is Role.PREFILL
        k = [_random(shape, gen) if fill else torch.zeros(shape, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
        v = [_random(shape, gen) if fill else torch.zeros(shape, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
        aux = [torch.randint(0, 256, (AUX_SLOTS, n), dtype=torch.uint8, generator=gen) if fill
               else torch.zeros((AUX_SLOTS, n), dtype=torch.uint8) for n in aux_row_bytes or (AUX_BYTES,)]
        if aux_row_bytes is None:
            aux = aux[0]
        cfg = ManagerConfig(role=role, bootstrap_addr=self.server.address, node_id="prefill",
                            **{**FAST, **overrides})
        pools = tuple(StatePool(kind, [_random(sh, gen) if fill else torch.zeros(sh, dtype=torch.bfloat16)
                                       for sh in shapes], sharding, exact, *rest)
                      for kind, sharding, exact, shapes, *rest in states)
        dk, dv = ([_random(shape, gen) if fill else torch.zeros(shape, dtype=torch.bfloat16)
                   for _ in range(draft_layers)] for _ in range(2))
        kv = [MHAPool(k=k, v=v, total_kv_heads=total_heads)]
        if draft_layers:
            kv.append(MHAPool(k=dk, v=dv, total_kv_heads=total_heads, role=PoolRole.DRAFT))
        mgr = KVManager(cfg, kv, aux=aux, transport=self.fabric.transport(handshake_timeout_s=handshake_timeout_s),
                        channel_factory=self.fabric.channel,
                        states=pools)
        self.stack.callback(mgr.close)
        rank = Rank(mgr, k, v, aux, pools, (*dk, *dv))
        self.ranks.append(rank)
        return rank


@pytest.fixture
def cluster():
    with ExitStack() as stack:
        server = BootstrapServer("127.0.0.1", 0).start()
        stack.callback(server.close)
        yield Cluster(LoopbackFabric(), server, stack)


def random_pages(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` distinct pages in random order (scattered)."""
    return rng.permutation(NUM_PAGES)[:n].astype(np.int64)


def wait_until(mgr: KVManager, pred, timeout_s: float = 10.0, *, what: str = "condition") -> float:
    """Wait (on the manager's progress counter) until ``pred()``; returns the
    seconds it took, or fails the test after ``timeout_s``."""
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        seen = mgr.progress
        if pred():
            return time.monotonic() - start
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} not reached within {timeout_s:g} s")
        mgr.wait_for_progress(seen, 0.01)


def terminal(*rooms) -> bool:
    return all(r.poll() in (KVPoll.Success, KVPoll.Failed) for r in rooms)


def opened(prefill: Rank, decode: Rank, room: int, src: np.ndarray, dst: np.ndarray):
    """(sender, receiver) of a room decode asked for (into ``dst``, aux slot
    2) and prefill took up (``src``'s length, aux slot 1): nothing sent yet."""
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
    receiver.init(dst, 2)
    sender = KVSender(prefill.mgr, None, room)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(len(src), 1)
    return sender, receiver


def transferring(prefill: Rank, decode: Rank, room: int, src: np.ndarray, dst: np.ndarray):
    """(sender, receiver) of a room whose first chunk (half of ``src``) was
    sent and whose decode side is Transferring (a test holding the writes
    keeps that chunk in flight)."""
    sender, receiver = opened(prefill, decode, room, src, dst)
    sender.send(src[:len(src) // 2])
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Transferring)
    return sender, receiver


def run_room(prefill: Rank, decode: Rank, room: int, src: np.ndarray, dst: np.ndarray, *, chunks: int = 3,
             src_aux: int = 1, dst_aux: int = 2, token_ids=None) -> tuple[KVSender, KVReceiver]:
    """One room, decode first, prefill sending in ``chunks`` chunks; returns
    both ends once terminal."""
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
    receiver.init(dst, dst_aux, token_ids=token_ids)
    sender = KVSender(prefill.mgr, None, room)
    wait_until(prefill.mgr, lambda: sender.poll() is not KVPoll.Bootstrapping, what="sender out of Bootstrapping")
    sender.init(len(src), src_aux, token_ids=token_ids)
    for i, part in enumerate(np.array_split(src, chunks)):
        sender.send(part, last=i == chunks - 1)
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    return sender, receiver


def assert_landed(prefill: Rank, decode: Rank, src, dst, src_aux: int = 1, dst_aux: int = 2) -> None:
    assert decode.page_bytes(dst) == prefill.page_bytes(src)
    assert decode.aux_bytes(dst_aux) == prefill.aux_bytes(src_aux)
