"""The scheduler halves of kvferry's vLLM connector, one per role: what
vLLM's scheduler process asks (which prompt tokens come from outside,
which blocks a finished request keeps) and the step's metadata for the
workers (:mod:`~transfer.adapters.vllm.metadata`). No torch-side kvferry,
no zmq, no Mooncake here.

Prefill (:class:`PrefillScheduler`): a request with ``do_remote_decode``
finishes after its prompt; ``request_finished`` keeps its blocks
(``delay_free``) and returns decode's ``kv_transfer_params``. Decode
(:class:`DecodeScheduler`): a request with ``do_remote_prefill`` claims its
whole prompt as an asynchronous external load, held at prefill while it is
queued, cancelled there if it ends before it had a room.

With vLLM's in-process executor (one worker, TP and PP 1: scheduler and
worker share the EngineCore process) a half opens a room on its worker at
once (:func:`local_worker`), instead of in the next engine step's metadata:
the push starts one engine step earlier. Other executors (a worker in
another process) take the metadata path.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.request import RequestStatus

from transfer.adapters.vllm.groups import GroupPlan
from transfer.adapters.vllm.metadata import DecodeMetadata, PrefillMetadata
from transfer.adapters.vllm.params import ConnectorConfig, RecvSpec, SendSpec, decode_params, num_pages, room_of, source_of

log = logging.getLogger("kvferry.vllm")

# A request that generated its one token and stopped, or hit max_tokens: its prompt's KV is complete.
_SENDABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

# Decode: how many rooms it remembers as told to prefill (about 1 MiB; a pre-aborted copy of a
# request comes within seconds of the request's end).
_ROOMS_KEPT = 8192

# The workers of this process, by vLLM engine id (the in-process executor's only worker).
_LOCAL_WORKERS: dict[str, Any] = {}


def local_worker(engine_id: str):
    """This process's worker of engine ``engine_id`` (None: none here)."""
    return _LOCAL_WORKERS.get(engine_id)


def share_worker(engine_id: str, worker) -> None:
    """``worker`` is its engine's only one and lives in this process: rooms may open on it at once."""
    _LOCAL_WORKERS[engine_id] = worker


def unshare_worker(engine_id: str, worker) -> None:
    if _LOCAL_WORKERS.get(engine_id) is worker:
        del _LOCAL_WORKERS[engine_id]


def computes_nothing(scheduler_output) -> bool:
    """Whether vLLM's step schedules no tokens (it only reports KV
    transfers: vLLM steps so while a connector holds a finished request's
    blocks or a request waits for its KV)."""
    return not getattr(scheduler_output, "total_num_scheduled_tokens", 0)


def drop_last_prompt_token(request) -> None:
    """Prefill of a model with recurrent state computes the prompt but its
    last token (decode computes it, and its state continues from
    prefill's). vLLM has no API to shorten a prompt; its ``Request`` (checked
    against vLLM 0.32.0 and 0.33.0, ``vllm/v1/request.py``) keeps the prompt
    twice, in ``prompt_token_ids`` and in the private ``_all_token_ids``
    (prompt and output, what the scheduler schedules from, behind the public
    read-only ``all_token_ids`` view): both lose the token here, the only
    write of a private attribute of vLLM's in this connector."""
    request.prompt_token_ids.pop()
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1


class SchedulerHalf:
    """What both roles' scheduler halves share: the config, the KV-cache
    groups, the prompt tokens a room carries, the in-process start."""

    def __init__(self, config: ConnectorConfig, groups: GroupPlan | None, block_size: int, engine_id: str) -> None:
        self.config, self.groups, self.block_size, self.engine_id = config, groups, block_size, engine_id

    def on_new_request(self, request) -> None:
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def has_pending_push_work(self) -> bool:
        return False

    def _transferred(self, num_prompt_tokens: int) -> int:
        """The prompt tokens a room carries (a model with Mamba/GDN state: all but the last)."""
        return num_prompt_tokens if self.groups is None else self.groups.transferred_tokens(num_prompt_tokens)

    def _prompt(self, request) -> tuple[int, ...]:
        """The prompt's token ids when a storage tier needs them as keys."""
        if not self.config.manager.get("storage_url"):
            return ()
        return tuple(request.prompt_token_ids or ())

    def _start_here(self, meta) -> bool:
        """Act on ``meta`` on this process's worker now; False: there is
        none, send it in the step's metadata."""
        worker = local_worker(self.engine_id)
        if worker is None:
            return False
        try:
            worker.take(meta)
        except Exception:  # a bug, not a transfer failure (take reports those): the metadata path then
            log.exception("kvferry: opening rooms on the in-process worker failed")
            return False
        return True


@dataclass
class _Streamable:
    """Layer-wise: a request to stream once its prefill completes."""

    room: int
    tokens: int  # the prompt's
    token_ids: tuple[int, ...]
    blocks: list[int] = field(default_factory=list)  # the KV pool group's, as the steps allocated them


class PrefillScheduler(SchedulerHalf):
    """``kv_producer``: keeps a finished request's blocks for its room."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._sends: list[SendSpec] = []
        self._aborts: list[str] = []
        self._pending_sends: set[str] = set()
        self._streamable: dict[str, _Streamable] = {}  # layer-wise: not yet in a step's streams
        self._streamed: set[str] = set()  # layer-wise: in a step's streams, not yet finished
        # layer groups stream (kvferry_layer_groups); not a model whose other KV-cache groups move as
        # state pools (those go whole, with the room's last send)
        self._streams_layers = self.config.layer_groups > 0 and (self.groups is None or not self.groups.states)

    def on_new_request(self, request) -> None:
        """Layer-wise: track the request's blocks. A model with recurrent
        state: compute the prompt but its last token (:func:`drop_last_prompt_token`)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return
        if self._streams_layers:
            self._streamable[request.request_id] = _Streamable(
                room=room_of(str(params.get("transfer_id") or request.request_id)),
                tokens=request.num_prompt_tokens, token_ids=self._prompt(request))
        if self.groups is None or not self.groups.replay_last or params.get("_kvferry_replay_last") \
                or request.num_prompt_tokens < 2:
            return
        if request.prompt_token_ids is None or request.get_skip_reading_prefix_cache():
            return  # prompt embeddings, or a request decode recomputes whole (prompt logprobs)
        drop_last_prompt_token(request)
        params["_kvferry_replay_last"] = True

    def build_connector_meta(self, scheduler_output) -> PrefillMetadata:
        meta = PrefillMetadata(sends=self._sends, aborts=self._aborts, streams=self._streams(scheduler_output),
                               idle=computes_nothing(scheduler_output))
        self._sends, self._aborts = [], []
        return meta

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

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """A finished request with ``do_remote_decode``: keep its blocks
        for its room, and decode's ``kv_transfer_params``."""
        params = request.kv_transfer_params
        self._streamable.pop(request.request_id, None)
        streamed = request.request_id in self._streamed
        self._streamed.discard(request.request_id)
        if not params or not params.get("do_remote_decode"):
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
        if not self._start_here(PrefillMetadata(sends=[spec])):
            self._sends.append(spec)
        return True, decode_params(room, self.config)

    def update_connector_output(self, connector_output) -> None:
        self._pending_sends -= set(connector_output.finished_sending or ())

    def has_pending_push_work(self) -> bool:
        return bool(self._pending_sends)


def _room_spec(request, params: dict) -> RecvSpec | None:
    """The prefill room a decode request names, without pages (to cancel or
    hold it); None: its params name none (get_num_new_matched_tokens says
    why, and the prompt is computed here)."""
    try:
        source = source_of(params)
    except ValueError:
        return None
    return RecvSpec(req_id=request.request_id, room=source.room, bootstrap_addr=source.bootstrap_addr,
                    node_id=source.node_id, pages=())


class DecodeScheduler(SchedulerHalf):
    """``kv_consumer``: a request's prompt comes from its prefill's room."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._recvs: list[RecvSpec] = []
        self._aborts: list[str] = []
        self._cancels: list[RecvSpec] = []
        self._holds: list[RecvSpec] = []
        self._open_recvs: set[str] = set()
        # rooms a receive opened or a cancel told prefill of (the newest _ROOMS_KEPT): a later cancel
        # of one of them is vLLM's notice for a request it failed (_seen), never sent on
        self._rooms_seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._local_tokens: dict[str, int] = {}  # prompt tokens its prefix cache holds, by request

    def on_new_request(self, request) -> None:
        """Hold the request's room at prefill while it waits in the queue
        (prefill's lease then does not end it; the worker renews the hold
        until the room opens or the request is cancelled)."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            spec = _room_spec(request, params)
            if spec is not None and not self._start_here(DecodeMetadata(holds=[spec])):
                self._holds.append(spec)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
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

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
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
        if not self._start_here(DecodeMetadata(recvs=[spec])):
            self._recvs.append(spec)

    def build_connector_meta(self, scheduler_output) -> DecodeMetadata:
        meta = DecodeMetadata(recvs=self._recvs, aborts=self._aborts, cancels=self._cancels, holds=self._holds,
                              idle=computes_nothing(scheduler_output))
        self._recvs, self._aborts, self._cancels, self._holds = [], [], [], []
        return meta

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Finished while its KV is still coming: vLLM holds the blocks until
        the room reports; make it end now. Finished before it had a room:
        tell prefill."""
        if request.request_id in self._open_recvs:
            self._open_recvs.discard(request.request_id)
            self._aborts.append(request.request_id)
            return False, None
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            self._cancel(request, params)
        return False, None

    def _cancel(self, request, params: dict) -> None:
        """Decode will not ask for a request's KV (finished, aborted or
        rejected before it had a room, or its own prefix cache held the whole
        prompt): tell prefill now, which frees the request's blocks there at
        once instead of at its lease."""
        self._local_tokens.pop(request.request_id, None)
        spec = _room_spec(request, params)
        if spec is None or not self._seen(spec.room):
            return
        if not self._start_here(DecodeMetadata(cancels=[spec])):
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

    def update_connector_output(self, connector_output) -> None:
        self._open_recvs -= set(connector_output.finished_recving or ())
