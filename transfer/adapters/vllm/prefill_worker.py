"""Prefill's worker half (``kv_producer``): a kvferry room per request whose
KV a decode takes, pushed as soon as decode asks; the blocks are freed when
the room ends (landed, failed, or no decode asked within the lease,
``kvferry_lease_s``, unless decode holds it). Layer-wise
(``kvferry_layer_groups``) a room opens before the forward pass that
completes its prompt and each layer group goes as it is written
(:mod:`~transfer.adapters.vllm.layerwise`). TP rank 0 serves kvferry's
bootstrap and the HTTP ports vLLM's Mooncake routers ask
(:mod:`~transfer.adapters.vllm.query`)."""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass

from transfer.adapters.vllm import stats as vllm_stats
from transfer.adapters.vllm.caches import written_event
from transfer.adapters.vllm.layerwise import LayerStream, layer_groups
from transfer.adapters.vllm.params import SendSpec, query_reply
from transfer.adapters.vllm.query import QueryServer
from transfer.adapters.vllm.worker import WAKE_S, KvferryWorker, Room
from transfer.config import Role
from transfer.errors import KVFerryError
from transfer.state import KVPoll

log = logging.getLogger("kvferry.vllm")


@dataclass
class SendRoom(Room):
    states: tuple[tuple[int, ...], ...] = ()  # per state pool (HMA's other groups), its items
    pushed: bool = False
    expired: bool = False  # its lease ran out before a decode asked
    stream: LayerStream | None = None  # layer-wise: its layer groups
    ready: object = None  # layer-wise on CUDA: the event of the latest layer the forward wrote

    @property
    def reason(self) -> str | None:
        return vllm_stats.LEASE_EXPIRED if self.expired else None


class PrefillWorker(KvferryWorker):
    """Sends the rooms of one vLLM prefill worker rank."""

    role = Role.PREFILL
    discovery_type = "P"
    abort_why = "the request was aborted on prefill while its KV was streaming"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server = None  # kvferry's ZMQ bootstrap server (kvferry_serve_bootstrap)
        self.query: list = []  # the HTTP ports (GET /query for vLLM's Mooncake routers)
        self._leases: list[tuple[float, str]] = []  # (deadline, req_id), a heap
        self._stream_groups: tuple[range, ...] = ()  # layer-wise: the room layers of each group
        self._streaming: dict[str, SendRoom] = {}  # layer-wise rooms with groups not yet sent
        self._streamed: set[str] = set()  # requests opened layer-wise whose SendSpec has not come yet
        self._finished_seen: set[str] = set()  # request ids vLLM called finished (sends may be reported)

    def _manager_fields(self) -> dict:
        """Prefill's: no staging of its own by default, a bootstrap wait past the lease."""
        return self.config.manager_fields(prefill=True)

    def _open_servers(self) -> None:
        """TP rank 0: kvferry's ZMQ bootstrap server
        (``kvferry_serve_bootstrap``) and the HTTP ports vLLM's Mooncake
        routers ask: the served bootstrap port itself, and ``kvferry_query_port``."""
        c = self.config
        if self.tp_rank != 0:
            return
        try:
            if c.serve_bootstrap:
                from bootstrap.server import BootstrapServer
                host, _, port = c.kvferry_addr.rpartition(":")
                self.server = BootstrapServer(host, int(port)).start()
            served = int(c.bootstrap_addr.rpartition(":")[2]) if c.serve_bootstrap else None
            zmq_port = int(c.kvferry_addr.rpartition(":")[2])
            for port in c.http_ports:  # the served port on the bootstrap's host, kvferry_query_port on ours
                host = c.bootstrap_addr.rpartition(":")[0] if port == served else c.host
                self.query.append(QueryServer(host, port, query_reply(c, self.tp_size), zmq_port))
        except BaseException:
            self._close_servers()
            raise
        if c.serve_bootstrap:
            log.info("kvferry bootstrap: HTTP (GET /query, /kvferry) on %s, kvferry's ZMQ server on %s",
                     ", ".join(q.address for q in self.query), self.server.address)

    def _close_servers(self) -> None:
        super()._close_servers()
        for server in (self.server, *self.query):
            if server is not None:
                server.close()
        self.server, self.query = None, []

    def index_layers(self, names: list[str], draft_names: list[str] = ()) -> None:
        """The room's layers by name and, layer-wise, their groups."""
        super().index_layers(names, draft_names)
        if self.config.layer_groups:
            self._stream_groups = layer_groups(len(names), len(draft_names), self.config.layer_groups)

    # --- vLLM's calls ------------------------------------------------------------

    def take(self, meta) -> None:
        """A step's :class:`~transfer.adapters.vllm.metadata.PrefillMetadata`."""
        if meta.sends or meta.aborts:
            self.start(meta.sends, aborts=meta.aborts)

    def start(self, sends: list[SendSpec], aborts: list[str] = ()) -> None:
        """Open this step's rooms and end those of ``aborts`` (requests
        vLLM aborted while their layer-wise room was open). A room that
        cannot open is reported done at the next ``finished``."""
        from transfer.rooms.sender import KVSender

        self._abort(aborts)
        opened: list[SendRoom] = []
        for s in sends:
            with self._lock:
                streamed = s.req_id in self._streamed  # its room opened for the forward pass (open_streams)
                self._streamed.discard(s.req_id)
                room = self._rooms.get(s.req_id) if streamed else None
                if room is not None:
                    room.stream.finish_all()  # the request finished: all its KV is written (the step synced)
                    room.ready = None
                    heapq.heappush(self._leases, (time.monotonic() + self.config.lease_s, s.req_id))
            if streamed:
                if room is not None:  # (else it ended already, and finished() reports it)
                    opened.append(room)  # polled below: pushes what decode may take now
                continue
            try:
                sender = KVSender(self.mgr, None, s.room)
                sender.init(len(s.pages), token_ids=list(s.token_ids) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not sent: %s", s.req_id, s.room, exc)
                with self._lock:
                    self._not_opened(s.req_id, exc)
                continue
            opened.append(self._list(SendRoom(s.req_id, sender, s.pages, states=s.states)))
            with self._lock:
                heapq.heappush(self._leases, (time.monotonic() + self.config.lease_s, s.req_id))
        self._poll_opened(opened)

    def _poll_opened(self, opened: list[SendRoom]) -> None:
        if opened:  # a decode request may have come first (concurrent protocol): push now
            try:
                self._poll(opened)
            except Exception:  # never into vLLM's step; the manager's sweep and the driver go on
                log.exception("kvferry: poll after opening rooms failed")

    def open_streams(self, streams: list[SendSpec]) -> None:
        """Layer-wise: open the rooms of the requests whose prefill
        completes in this step, before its forward pass writes their last
        KV; ``layer_saved`` then sends each layer group as it completes (and
        decode asked). The request's ``SendSpec`` (from ``request_finished``)
        finishes every layer and starts the lease."""
        from transfer.rooms.sender import KVSender

        opened = []
        for s in streams:
            try:
                sender = KVSender(self.mgr, None, s.room)
                sender.init(len(s.pages), token_ids=list(s.token_ids) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not streamed: %s", s.req_id, s.room, exc)
                continue  # its SendSpec, at the step's end, opens it whole
            room = self._list(SendRoom(s.req_id, sender, s.pages, stream=LayerStream(self._stream_groups)))
            with self._lock:
                self._streamed.add(s.req_id)
                self._streaming[s.req_id] = room
            opened.append(room)
        if opened:
            self._poll(opened)

    def layer_saved(self, layer_name: str, kv_layer) -> None:
        """vLLM wrote ``layer_name``'s KV of this step (on CUDA: launched;
        an event recorded now on the current stream marks it written)."""
        if not self._streaming:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        ready = written_event(kv_layer)
        with self._lock:
            rooms = list(self._streaming.values())
            for room in rooms:
                room.stream.finish(layer)
                room.ready = ready if ready is not None else room.ready
        for room in rooms:
            self._push_layers(room, in_forward=True)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """The sends that ended since the last call, of requests vLLM finished."""
        with self._lock:
            self._finished_seen |= finished_req_ids
            done = self._done & self._finished_seen
            self._done -= done
            self._finished_seen -= done
            return done, set()

    # --- the driver's parts --------------------------------------------------------

    def _push_layers(self, room: SendRoom, *, in_forward: bool = False) -> None:
        """Send a layer-wise room's completed groups no one sent yet, once its
        decode asked (any thread: the groups are claimed under the lock)."""
        if room.handle.poll() not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            return
        with self._lock:
            groups, ready = room.stream.claim(in_forward=in_forward), room.ready
            if groups:
                room.pushed = True
            if room.stream.done:
                self._streaming.pop(room.req_id, None)
        for group in groups:
            room.handle.send(list(room.pages), last=True, layers=group, ready=ready)

    def _advance(self, room: SendRoom, state: KVPoll) -> KVPoll:
        """Push a room whose decode asked (layer-wise: its completed groups)."""
        if room.stream is not None:
            if state in (KVPoll.WaitingForInput, KVPoll.Transferring):
                self._push_layers(room)
                state = room.handle.poll()
        elif state is KVPoll.WaitingForInput:
            with self._lock:  # two pollers (the driver, and start()): one push
                push, room.pushed = not room.pushed, True
            if push:
                room.handle.send(list(room.pages), last=True, state_indices=list(room.states) or None)
                state = room.handle.poll()
        return state

    def _forget(self, room: SendRoom) -> None:
        self._streaming.pop(room.req_id, None)

    def _ended(self, room: SendRoom, state: KVPoll) -> None:
        self._streaming.pop(room.req_id, None)
        if room.stream is not None:
            vllm_stats.record_layer_groups(self._stats, room.stream.in_forward,
                                           len(room.stream.claimed) - room.stream.in_forward)

    def _due(self) -> float:
        """End the rooms no decode asked for within the lease (still
        Bootstrapping at their deadline); returns the seconds to wait for."""
        now, expired = time.monotonic(), []
        with self._lock:
            while self._leases and self._leases[0][0] <= now:
                _, req_id = heapq.heappop(self._leases)
                room = self._rooms.get(req_id)
                if room is not None and not room.pushed:
                    expired.append(room)
            wait = min(WAKE_S, self._leases[0][0] - now) if self._leases else WAKE_S
        for room in expired:
            held, state = room.handle.held_until, room.handle.poll()
            if state is KVPoll.Bootstrapping and held > now:
                with self._lock:  # decode holds it (its request queued there): look again then
                    heapq.heappush(self._leases, (held, room.req_id))
            elif state is KVPoll.Bootstrapping:
                room.expired = True
                room.handle.abort(f"lease expired: no decode asked for request {room.req_id} within "
                                  f"{self.config.lease_s:g} s (kvferry_lease_s)")
            else:  # a decode asked: push it now if no poll did (a change missed by a failed round)
                self._poll([room])
        return max(0.0, wait)
