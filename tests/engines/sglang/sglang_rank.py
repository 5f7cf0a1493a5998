"""SGLang's side of one rank, built as its prefill.py / decode.py build it (see rank.py).

:class:`Rank`: SGLang's ``ServerArgs``, its real KV pools on the CPU (a draft
pool appended with ``num_draft_entries``), ``KVArgs`` from
``get_kv_transfer_buf_infos``, ``MetadataBuffers`` and ``setup_state_kv_args``,
and the manager from ``get_kv_class``. The request data: every request's KV
is a "logical" array per buffer over all heads, drawn from a seed
(:func:`logical_kv`), so decode checks each byte against the same draw.
:class:`Clock`: per-room latency and the phase's wall and CPU time.
"""

from __future__ import annotations

import time
import zlib
from types import SimpleNamespace

import numpy as np
import torch

from tests.engines.sglang.scenarios import Request

SENTINEL = 0xAB
NUM_SLOTS = 16


def logical_kv(seed: int, room: int, key: str, shape: tuple) -> torch.Tensor:
    """The bytes of one request's buffer over all heads: [pages, page_size, heads, row_bytes]."""
    rng = np.random.default_rng([seed, room, zlib.crc32(key.encode())])
    return torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8))


def aux_row(seed: int, room: int, region: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, room, 1000 + region]).integers(0, 256, size=nbytes, dtype=np.uint8)


def pick_pages(a, side: str, room: int, count: int, taken: set) -> list[int]:
    """Distinct pages of the pool (never page 0), none of ``taken``: random,
    or for ``contig`` scenarios the next run of consecutive pages."""
    if "contig" in a.scenario:
        start = max(taken, default=0) + 1
        chosen = list(range(start, start + count))
    else:
        rng = np.random.default_rng([a.seed, room, 7 if side == "prefill" else 11])
        chosen = [p for p in rng.permutation(np.arange(1, a.pool_pages)).tolist() if p not in taken][:count]
    if len(chosen) < count or max(chosen, default=0) >= a.pool_pages:
        raise ValueError(f"pool of {a.pool_pages} pages too small for the scenario")
    taken.update(chosen)
    return chosen


class Rank:
    """SGLang's pools, KVArgs and manager of one rank (see the module docstring)."""

    def __init__(self, a) -> None:
        from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType, MetadataBuffers,
                                                     TransferBackend, build_kv_layer_ids, get_kv_class,
                                                     get_kv_transfer_buf_infos, get_pd_kv_layout,
                                                     setup_state_kv_args)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

        self.a = a
        #: attention DP (SGLang's --enable-dp-attention): the TP ranks split into dp_size attention groups
        self.attn_tp = a.tp_size // a.dp_size
        self.attn_tp_rank, self.dp_rank = a.tp_rank % self.attn_tp, a.tp_rank // self.attn_tp
        self.backend = TransferBackend(a.backend)
        self.server_args = server_args_of(a)
        self.is_mla = a.pool == "mla"
        self.total_heads = 1 if self.is_mla else a.heads
        heads = self.total_heads // self.attn_tp if not self.is_mla else 1
        common = dict(size=a.pool_pages * a.page_size - a.page_size, page_size=a.page_size, dtype=torch.bfloat16,
                      device="cpu", enable_memory_saver=False)
        if a.state:
            self.pool = state_pool(a, heads, self.attn_tp, common)
        elif self.is_mla:
            self.pool = MLATokenToKVPool(kv_lora_rank=2 * a.head_dim, qk_rope_head_dim=a.head_dim,
                                         layer_num=a.layers, **common)
        else:
            self.pool = MHATokenToKVPool(head_num=heads, head_dim=a.head_dim, layer_num=a.layers, **common)
        self.draft = MHATokenToKVPool(head_num=max(1, 2 // self.attn_tp), head_dim=a.head_dim, layer_num=1, **common) \
            if a.draft else None
        kv_args = get_kv_class(self.backend, KVClassType.KVARGS)()
        kv_args.engine_rank, kv_args.pp_rank, kv_args.system_dp_rank = a.tp_rank, 0, 0
        kv_args.kv_cache_dtype_str = "fp8_e4m3" if a.state == "mxfp8" else "bfloat16"
        kv_args.kv_layout = get_pd_kv_layout(self.pool)
        kv_args.prefill_start_layer, kv_args.prefill_end_layer = 0, a.layers
        ptrs, lens, items = get_kv_transfer_buf_infos(self.pool)
        num_draft = 0
        if self.draft is not None:
            d_ptrs, d_lens, d_items = self.draft.get_contiguous_buf_infos()
            ptrs, lens, items, num_draft = ptrs + d_ptrs, lens + d_lens, items + d_items, len(d_ptrs)
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, items
        kv_args.num_draft_entries = num_draft
        if not a.state:
            kv_args.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=self.pool, draft_token_to_kv_pool=self.draft,
                                                      num_draft_entries=num_draft, num_hidden_layers=a.layers)
        if not self.is_mla and a.role == "prefill":  # SGLang's decode sets them after the manager is built
            kv_args.kv_head_num, kv_args.total_kv_head_num = heads, self.total_heads
        kv_args.page_size = a.page_size
        self.meta = MetadataBuffers(NUM_SLOTS, hidden_size=16, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=4, kv_checksum_enabled=a.kv_checksum)
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = self.meta.get_buf_infos()
        kv_args.ib_device, kv_args.gpu_id = None, 0
        setup_state_kv_args(kv_args, self.pool, self.draft, a.layers, req_to_token_pool=None)
        self.kv_args = kv_args
        # (key, buffer tensor as uint8 [tokens, heads, row_bytes]) in KVArgs order, checked against the pointers
        self.buffers = self._buffers()
        assert [t.data_ptr() for _, t in self.buffers] == list(ptrs), "buffer order differs from KVArgs"
        for _, t in self.buffers:
            t.fill_(SENTINEL)
        #: (key, state buffer as uint8 [items, item_bytes]) per buffer of each state type, in KVArgs order
        self.states = [(f"state.{getattr(st, 'value', st)}.{j}", _wrap(p, n // i * i).view(n // i, i))
                       for st, ptrs, lens, items in zip(kv_args.state_types, kv_args.state_data_ptrs,
                                                        kv_args.state_data_lens, kv_args.state_item_lens)
                       for j, (p, n, i) in enumerate(zip(ptrs, lens, items))]
        for _, t in self.states:
            t.fill_(SENTINEL)
        self.regions = [_wrap(p, n).view(n // i, i) for p, n, i in zip(*self.meta.get_buf_infos())]
        ptrs = [r.data_ptr() for r in self.regions]
        #: the aux regions SGLang writes itself: the room id, and the KV checksum row (-1: none)
        self.room_region = ptrs.index(self.meta.bootstrap_room.data_ptr())
        self.checksum_region = ptrs.index(self.meta.kv_checksum.data_ptr()) if a.kv_checksum else -1
        mode = DisaggregationMode.PREFILL if a.role == "prefill" else DisaggregationMode.DECODE
        self.mgr = get_kv_class(self.backend, KVClassType.MANAGER)(kv_args, mode, self.server_args, self.is_mla)
        self.sender_cls = get_kv_class(self.backend, KVClassType.SENDER)
        self.receiver_cls = get_kv_class(self.backend, KVClassType.RECEIVER)

    def _buffers(self):
        out = []
        for name, pool in (("target", getattr(self.pool, "full_kv_pool", self.pool)), ("draft", self.draft)):
            if pool is None:
                continue
            parts = [("latent", pool.kv_buffer)] if self.is_mla and name == "target" else \
                [("k", pool.k_buffer), ("v", pool.v_buffer)]
            for comp, bufs in parts:
                for layer, t in enumerate(bufs):
                    out.append((f"{name}.{comp}.{layer}", t.view(torch.uint8).view(t.shape[0], t.shape[1], -1)))
        return out

    def head_range(self, key: str, t) -> tuple[int, int, int]:
        """(first global head, local heads, total heads) of a buffer on this rank."""
        local = t.shape[1]
        if key.startswith("target.latent"):
            return 0, 1, 1  # MLA: the same latent on every rank
        total = self.total_heads if key.startswith("target") else 2
        return self.attn_tp_rank * local, local, total

    def digest(self, pages) -> int:
        """The KV checksum of ``pages``: Adler-32 over every buffer's items of
        those pages, as SGLang's ``KvChecksumComputer`` digests them (its
        kernel is CUDA only; this is the same digest on the CPU)."""
        value = 1
        for _, t in self.buffers:
            value = zlib.adler32(self.pages_view(t, pages).contiguous().numpy().tobytes(), value)
        return value

    def pages_view(self, t, pages) -> torch.Tensor:
        return t.view(-1, self.a.page_size, t.shape[1], t.shape[2])[torch.as_tensor(pages, dtype=torch.long)]

    def expected(self, req: Request, key: str, t, first_page: int, num_pages: int) -> torch.Tensor:
        h0, local, total = self.head_range(key, t)
        data = logical_kv(self.a.seed, req.room, key, (req.num_pages, self.a.page_size, total, t.shape[2]))
        return data[first_page:first_page + num_pages, :, h0:h0 + local]


def state_pool(a, heads: int, attn_tp: int, common: dict):
    """A pool with SGLang state, built as its model runner builds them: ``swa``
    a sliding-window model's SWAKVPool (layers 0 and 2 windowed, layer 1
    full), ``mamba`` a hybrid's HybridLinearKVPool over a MambaPool (layers 0
    and 2 Mamba2, sharded over the attention TP ranks; layer 1 attention),
    ``dsa`` DeepSeek's sparse-attention MLA pool with its indexer cache
    (DSATokenToKVPool: 64-token pages, the same on every TP rank), ``mxfp8``
    an MXFP8 KV pool with its per-block scales (MHATokenToKVPoolMXFP8: head
    dims of 32s; a scale per 32 elements of each token's head, by page)."""
    import torch

    if a.state == "dsa":
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(attn_dcp_size=1)  # what SGLang's process groups set
        return DSATokenToKVPool(size=common["size"], page_size=a.page_size, dtype=torch.bfloat16,
                                kv_lora_rank=2 * a.head_dim, qk_rope_head_dim=a.head_dim, layer_num=a.layers,
                                device="cpu", index_head_dim=128, enable_memory_saver=False,
                                kv_cache_dim=3 * a.head_dim)
    if a.state == "mxfp8":  # MXFP8 KV: fp8 K/V pages and their per-block scales (SGLang's BLOCK_SCALE state)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

        return MHATokenToKVPoolMXFP8(size=common["size"], page_size=a.page_size, dtype=torch.float8_e4m3fn,
                                     head_num=heads, head_dim=a.head_dim, layer_num=a.layers, device="cpu",
                                     enable_memory_saver=False)
    if a.state == "swa":
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        return SWAKVPool(size=common["size"], size_swa=common["size"] // 2, page_size=a.page_size,
                         dtype=torch.bfloat16, head_num=heads, head_dim=a.head_dim, swa_attention_layer_ids=[0, 2],
                         full_attention_layer_ids=[1], device="cpu")
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    shape = Mamba2StateShape.create(tp_world_size=attn_tp, intermediate_size=64, n_groups=2, num_heads=4,
                                    head_dim=16, state_size=8, conv_kernel=4)
    mamba = MambaPool(size=NUM_SLOTS, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                      mamba_layer_ids=[0, 2], device="cpu")
    return HybridLinearKVPool(size=common["size"], dtype=torch.bfloat16, page_size=a.page_size, head_num=heads,
                              head_dim=a.head_dim, full_attention_layer_ids=[1], device="cpu", mamba_pool=mamba)


def state_items(a, side: str, room: int, kind: str, num_items: int, num_pages: int, taken: set) -> list[int]:
    """The items a room names in a state pool on one side, none of ``taken``
    (rooms are in flight together): one Mamba slot; sliding-window or indexer
    pages (two; prefill names one page more than decode, which SGLang's
    backends allow for paged states: the first ones pair up)."""
    rng = np.random.default_rng([a.seed, room, 13 if side == "prefill" else 17])
    count = 1 if kind == "mamba" else min(2, num_pages) + (1 if side == "prefill" else 0)
    chosen = [i for i in rng.permutation(np.arange(1, num_items)).tolist() if i not in taken][:count]
    if len(chosen) < count:
        raise ValueError(f"state {kind}: {num_items} items too few for the scenario")
    taken.update(chosen)
    return chosen


def logical_state(seed: int, room: int, key: str, tp_rank: int, shape: tuple) -> torch.Tensor:
    """A room's state items, drawn whole (see ``rank._state_share``)."""
    rng = np.random.default_rng([seed, room, zlib.crc32(key.encode()), tp_rank])
    return torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8))


def server_args_of(a):
    """SGLang's ServerArgs of this rank; for SGLang's own backends also its
    published runtime context (they read it), with no pipeline group."""
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=a.model_dir or "unused", disaggregation_mode=a.role if a.role != "bootstrap" else
                    "prefill", tp_size=a.tp_size, dp_size=a.dp_size, enable_dp_attention=a.dp_size > 1,
                    load_balance_method=a.load_balance if a.role == "prefill" else "auto",
                    disaggregation_transfer_backend=a.backend, host="127.0.0.1",
                    disaggregation_bootstrap_port=a.port, device="cpu", skip_tokenizer_init=True,
                    **({"port": a.http_port} if getattr(a, "http_port", 0) else {}))
    if a.backend != "kvferry":
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import \
            maybe_init_shared_mooncake_transfer_engine

        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=a.tp_rank, dp_rank=None, gpu_id=0))
        get_parallel().override_permanently(pp_group=SimpleNamespace(world_size=1, rank_in_group=0,
                                                                     is_first_rank=True, is_last_rank=True))
        if a.role != "bootstrap":
            maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    return sa


def _wrap(addr: int, nbytes: int) -> torch.Tensor:
    from transfer.pools import wrap_pointer

    return wrap_pointer(addr, nbytes, "uint8")


class Clock:
    """Per-room latency (first send or send_metadata to Success), the wall
    and CPU time of the whole transfer phase, and, for SGLang's Mooncake
    backend, the descriptors it hands its engine."""

    def __init__(self, rank: Rank) -> None:
        self.started: dict[int, float] = {}
        self.first = self.last = None
        self.cpu0 = 0.0
        self.descriptors = 0
        engine = getattr(rank.mgr, "engine", None)
        if engine is not None and hasattr(engine, "batch_transfer_sync"):
            inner = engine.batch_transfer_sync

            def counting(session, srcs, dsts, lengths, *args, **kw):
                self.descriptors += len(lengths)
                return inner(session, srcs, dsts, lengths, *args, **kw)

            engine.batch_transfer_sync = counting

    def start(self, room: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first, self.cpu0 = now, time.process_time()
        self.started.setdefault(room, now)

    def done(self, room: int) -> float | None:
        self.last = time.perf_counter()
        start = self.started.get(room)
        return None if start is None else self.last - start

    def totals(self) -> dict:
        if self.first is None or self.last is None:
            return {}
        return {"wall_s": self.last - self.first, "cpu_s": time.process_time() - self.cpu0,
                "engine_descriptors": self.descriptors}
