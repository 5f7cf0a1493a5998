"""``KvferryConnector``, vLLM's ``KVConnectorBase_V1`` over kvferry rooms
(push from prefill): a facade. vLLM builds it twice, as SCHEDULER and as
WORKER; it picks the role's half once (:mod:`~transfer.adapters.vllm.scheduler`'s
``PrefillScheduler`` / ``DecodeScheduler``, or
:mod:`~transfer.adapters.vllm.prefill_worker` /
:mod:`~transfer.adapters.vllm.decode_worker`) and hands every call to it.

Prefill (``kv_producer``): a request with ``do_remote_decode`` finishes
after its prompt; ``request_finished`` keeps its blocks (``delay_free``) and
returns decode's ``kv_transfer_params``; the worker opens a kvferry room and
pushes the blocks when decode asks; the blocks are freed when the room ends
(landed, failed, or no decode asked within the lease, ``kvferry_lease_s``).
Decode (``kv_consumer``): a request with ``do_remote_prefill`` claims its
whole prompt as an asynchronous external load; the worker receives the room
into the allocated blocks and reports it finished; a failed room reports its
blocks in ``get_block_ids_with_load_errors`` (one KV-cache group) or its
request in ``get_transfer_results``' ``failed_recving`` (several, with vLLM's
hybrid manager: block ids are unique only within a group), and vLLM
recomputes or fails the request (``kv_load_failure_policy``). Every wait is
bounded by kvferry's timeouts (``transfer_timeout_s``, ``peer_timeout_s``).

Stats: each worker reports the rooms that ended in a step
(``get_kv_connector_stats``); vLLM logs them and exports them on its own
``/metrics`` as ``vllm:kvferry_*`` (:mod:`~transfer.adapters.vllm.metrics`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from transfer.adapters.vllm.groups import GroupPlan, plan_groups
from transfer.adapters.vllm.metadata import KvferryConnectorMetadata, PrefillMetadata
from transfer.adapters.vllm.metrics import KvferryConnectorStats, KvferryPromMetrics
from transfer.adapters.vllm.params import ConnectorConfig, check_parallel
from transfer.adapters.vllm.scheduler import DecodeScheduler, PrefillScheduler, share_worker, unshare_worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvferry.vllm")


def log_as_vllm() -> None:
    """kvferry's log lines go where vLLM's go, in vLLM's format (process,
    pid, level, time, file and line), unless the host gave the ``kvferry``
    logger handlers of its own: at 3 a.m. a room's failure needs its time
    beside vLLM's lines. Idempotent."""
    ours, theirs = logging.getLogger("kvferry"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.propagate = False


def cache_layout(vllm_config, block_size: int | None = None):
    """The model's KV heads and vLLM's cache layout, for the worker's pool
    (the layout name is vLLM's resolved one where it is known already)."""
    from vllm.platforms import current_platform

    from transfer.adapters.vllm.caches import CacheLayout
    mc = vllm_config.model_config
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    target_layers = draft_heads = None
    if draft is not None:  # a draft with KV of its own (draft_model, EAGLE, MTP): kvferry's draft pool
        target_layers = mc.hf_text_config.num_hidden_layers
        draft_heads = draft.get_total_num_kv_heads()
    return CacheLayout(total_kv_heads=mc.get_total_num_kv_heads(), target_layers=target_layers,
                       draft_kv_heads=draft_heads,
                       kv_layout="fused_rows" if current_platform.is_cpu() else "fused_cells",
                       vllm_layout=getattr(vllm_config.cache_config, "kv_cache_layout", None),
                       mla=bool(getattr(mc, "use_mla", False)),
                       block_size=block_size or vllm_config.cache_config.block_size)


def group_plan(vllm_config, kv_cache_config) -> GroupPlan | None:
    """How vLLM's KV-cache groups map onto kvferry's pools
    (:mod:`~transfer.adapters.vllm.groups`; None: vLLM gave no cache config,
    every layer is one group). Raises ValueError for what is not moved."""
    if kv_cache_config is None:
        return None
    hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    groups = kv_cache_config.kv_cache_groups
    ids = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    return plan_groups([(i, groups[i].layer_names, groups[i].kv_cache_spec) for i in ids], hma, len(groups))


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's ``KVConnectorBase_V1`` over kvferry rooms. With vLLM's hybrid
    KV-cache manager each KV-cache group moves as a pool of its own
    (:mod:`~transfer.adapters.vllm.groups`)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_as_vllm()
        tc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config, tc.engine_id, env=os.environ)
        if tc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"KvferryConnector: kv_role must be kv_producer or kv_consumer, got {tc.kv_role!r}")
        self.is_producer = tc.kv_role == "kv_producer"
        pc = vllm_config.parallel_config
        check_parallel(pipeline_parallel_size=pc.pipeline_parallel_size, data_parallel_size=pc.data_parallel_size,
                       decode_context_parallel_size=getattr(pc, "decode_context_parallel_size", 1))
        self.groups = group_plan(vllm_config, kv_cache_config)
        # the block ids' tokens (the KV pool's group: vLLM may raise it to unify a hybrid model's pages)
        self.block_size = vllm_config.cache_config.block_size if self.groups is None else self.groups.main.block_size
        self._engine_id = str(tc.engine_id)
        self.scheduler = self.worker = None
        if role is KVConnectorRole.WORKER:
            from transfer.adapters.vllm.decode_worker import DecodeWorker
            from transfer.adapters.vllm.prefill_worker import PrefillWorker
            self.worker = (PrefillWorker if self.is_producer else DecodeWorker)(
                self.config, tp_rank=pc.rank % pc.tensor_parallel_size, tp_size=pc.tensor_parallel_size,
                layout=cache_layout(vllm_config, self.block_size), groups=self.groups)
        else:
            self.scheduler = (PrefillScheduler if self.is_producer else DecodeScheduler)(
                self.config, self.groups, self.block_size, self._engine_id)

    # --- scheduler side: the role's scheduler half ------------------------------

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvferryConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A room restores every transferred group (not only the prefix-cacheable ones)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM (with ``SupportsHMA``) calls this one, with every group's blocks."""
        return self.scheduler.request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    # --- worker side: the role's worker -------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.worker.layout = cache_layout(self._vllm_config, self.block_size)  # the layout is resolved by now
        self.worker.register_kv_caches(kv_caches)
        if self._vllm_config.parallel_config.world_size == 1:
            share_worker(self._engine_id, self.worker)  # the engine's only worker: rooms may open on it at once

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvferryConnectorMetadata):
            self._open_streams(meta)
            self.worker.take(meta)

    def _open_streams(self, meta: KvferryConnectorMetadata) -> None:
        """Prefill's layer-wise rooms of the step, opened once, at whichever
        comes first: ``start_load_kv`` (vLLM calls it after launching the
        forward pass unless a load is synchronous) or the first ``save_kv_layer``."""
        if isinstance(meta, PrefillMetadata) and meta.streams and not meta.streams_opened:
            meta.streams_opened = True
            self.worker.open_streams(meta.streams)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Layer-wise (``kvferry_layer_groups``): ``layer_name``'s KV is
        written for this step's streamed requests; a layer group it
        completes goes now if decode asked (:mod:`~transfer.adapters.vllm.layerwise`)."""
        meta = self._connector_metadata
        if isinstance(meta, PrefillMetadata) and meta.streams:
            self._open_streams(meta)
            self.worker.layer_saved(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Pushes run on kvferry's threads; the blocks stay held until they end."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        self.worker.settle(isinstance(meta, KvferryConnectorMetadata) and meta.idle)
        sending, recving = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        """``get_finished``'s sets and the failed receives by request id
        (several KV-cache groups: vLLM refuses block-level load errors there)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self.worker.failed_receives())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    # --- sleep mode (vLLM 0.33: KVConnectorBase_V1's three hooks; 0.32 calls none of them) -----------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        """Sleep mode keeps the KV cache's addresses (it frees or remaps the
        memory behind them): kvferry lets go of it before and takes it back
        after (the two hooks below)."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep frees or remaps the KV cache: live rooms fail, the
        writes end, the transport lets go of the memory (worker side)."""
        if self.worker is not None:
            self.worker.release_memory()

    def restore_kv_caches(self) -> None:
        """After wake-up: the KV cache registered again, rooms taken again."""
        if self.worker is not None:
            self.worker.resume_memory()

    def shutdown(self) -> None:
        if self.worker is not None:
            unshare_worker(self._engine_id, self.worker)
            self.worker.close()

    # --- stats (docs/observability.md) -------------------------------------------

    def get_kv_connector_stats(self):
        """The rooms that ended since the last call (worker side; the scheduler has none)."""
        data = self.worker.take_stats() if self.worker is not None else None
        return None if data is None else KvferryConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvferryConnectorStats(data=data) if data is not None else KvferryConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
