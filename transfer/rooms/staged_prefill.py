"""The staged path's message flow on prefill (decode's is
:mod:`transfer.rooms.staged_decode`; the parts are planned by
:mod:`transfer.rooms.chunk_plan`, the copies are :mod:`transfer.staging.copies`).

Prefill, per part (a run of a chunk's pages for one decode rank)::

    StageRequest to decode
    StageGrant, a local staging region free  ->  gather into it, write it to decode's region
    write landed               ->  the part's *Staged message to decode; the part counts as done

A part whose request came with a region of decode's staging for the whole
room (``TransferRequest.staging_offset``, a fenced decode rank's, when its
staging had room) skips the StageRequest and StageGrant: it is written to
its place in that region as soon as it is queued.

A *direct* part (its source pages in long runs, or no local staging; see
:mod:`transfer.rooms.parts`) needs no local region: on its grant its runs are
written from the pool straight into decode's region, in the packed layout.

A layer group's share of a part (:class:`~transfer.rooms.parts.LayerShare`)
runs as a part of its own, gathered into a local region of its size first
unless direct: written to its layers' places in the part's slot of the
room's region, or packed in a region of its own that it asks for. Its
message (``ShareStaged``) names the group's layers, and decode scatters
those while the forward pass goes on. The flow runs every kind of part
alike: each knows its bytes, its gather, its descriptors and its message.

Parts wait in the order of their room's age (the sender's creation time),
then of their arrival: when staging is short the oldest room asks, and
takes a local region, first, as decode grants its regions oldest room
first, so a batch's rooms finish one after another.

A part takes a local region only once it holds decode's (its grant, or the
room's region granted with the request), and parts holding decode's region
take local ones first, in order: every local region then belongs to a part
that can finish, so the two staging buffers never wait on each other. (Taken
the other way round, parts holding every local region waited for grants
while decode's staging was all granted with requests to rooms whose parts
waited for a local region: 64 concurrent rooms of 16 MiB each hung so.)
Parts waiting for a grant hold nothing here; the bytes they asked for are
capped at the local staging's size, so decode's regions do not sit granted
for parts that have no local region in sight.

A part's local region is freed when its write ended (or, for a room that
failed, when no write reads it); a part of a failed room counts as done.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Mapping


from bootstrap.messages import RankInfo
from transfer.errors import KVFerryError, StateError, TransferError
from transfer.messages import StageGrant, StageRequest
from transfer.plan import TransferPlan
from transfer.ready import ReadyWaiter
from transfer.rooms.context import RoomContext
from transfer.rooms.parts import StagedSpec, gathered_plan, source_plan

log = logging.getLogger("kvferry.staging")


class StagedSender(Protocol):
    """What the flow needs of a part's sender (a :class:`~transfer.rooms.sender.KVSender`)."""

    room: int

    @property
    def created(self) -> float:
        """When the sender was made (``time.monotonic()``): its room's age."""

    @property
    def terminal(self) -> bool: ...

    @property
    def where(self) -> str: ...

    def on_chunk_done(self, error) -> None:
        """One of the sender's submitted jobs or parts ended (``error`` None: landed)."""

    def on_part_landed(self, spec: StagedSpec) -> None:
        """A part's write landed (for the room's stats; before ``on_chunk_done``)."""


class PartStage(enum.Enum):
    """Where a staged part stands (for a failure's message too)."""

    QUEUED = "queued"  # waiting for its ready gate or its turn to ask decode
    ASKED = "asked"  # StageRequest sent, no grant yet
    GRANTED = "granted"  # holds decode's region, waiting for a local one
    WRITING = "writing"  # its write is with the transport
    ENDED = "ended"  # landed, failed, or dropped with its room


#: the moves a part may make; any other is a bug in this module (StagedPart.move raises)
_NEXT_STAGES = {
    PartStage.QUEUED: {PartStage.ASKED, PartStage.GRANTED, PartStage.WRITING, PartStage.ENDED},  # granted: the room's
    PartStage.ASKED: {PartStage.GRANTED, PartStage.WRITING, PartStage.ENDED},  # writing: a direct part's grant
    PartStage.GRANTED: {PartStage.WRITING, PartStage.ENDED},
    PartStage.WRITING: {PartStage.ENDED},
    PartStage.ENDED: set(),
}


@dataclass(eq=False)  # compared by identity: parts are found in lists
class StagedPart:
    """A planned part (``spec``) of ``sender``'s room on its way: its local
    region once it has one, decode's once granted, and the producer's
    ``ready`` gate (a :class:`~transfer.ready.ReadyGate`: gather only once it
    is done)."""

    sender: StagedSender
    spec: StagedSpec
    ready: object = None
    local_offset: int | None = None  # its region of this rank's staging, while it holds one
    stage: PartStage = PartStage.QUEUED  # since ``since``
    remote_offset: int | None = None  # decode's region, once granted
    since: float = field(default_factory=time.monotonic)
    handle: object = None  # the transport's handle of its write
    seq: int = field(default_factory=itertools.count().__next__)  # its arrival, among parts of rooms as old

    @property
    def ended(self) -> bool:
        return self.stage is PartStage.ENDED

    def move(self, stage: PartStage) -> None:
        if stage not in _NEXT_STAGES[self.stage]:
            raise StateError(f"staged part {self.spec.part}: {self.stage.value} -> {stage.value} is not a move a "
                             "part makes")
        self.stage, self.since = stage, time.monotonic()


class PrefillStaging:
    """Runs staged parts for a prefill rank's senders."""

    def __init__(self, ctx: RoomContext, peers: Mapping[str, RankInfo]) -> None:
        """``peers``: the handshaken decode ranks by session (the room
        table's, read under ``ctx.lock``)."""
        self.ctx = ctx
        self.peers = peers
        self._waiting: list[StagedPart] = []  # in _age order
        self._waiter = ReadyWaiter("kvferry-ready")
        self._granting: dict[tuple[int, int, int], StagedPart] = {}
        self._asked_bytes = 0  # local staging that the parts in _granting will need
        #: parts holding decode's region, waiting for a local one (served before anything else)
        self._local: list[StagedPart] = []  # in _age order
        self._gated: set[StagedPart] = set()  # waiting for their ready gate

    def submit(self, sender: StagedSender, specs, ready=None) -> list[StagedPart]:
        """Queue the planned parts of one of ``sender``'s chunks; with
        ``ready`` (a :class:`~transfer.ready.ReadyGate` not done yet) only
        once it is done, never blocking this thread (a part of a gate past
        its deadline ends with the error). Each part ends with one
        ``sender.on_chunk_done``. Returns the parts (for :meth:`describe`)."""
        parts = [StagedPart(sender, spec, ready) for spec in specs]
        if ready is not None and not ready.done():
            with self.ctx.lock:
                self._gated.update(parts)
            self._waiter.when_ready(ready, lambda error: self._ready(parts, error))
            return parts
        self._queue(parts)
        return parts

    def describe(self, part: StagedPart) -> str:
        """Where a part :meth:`submit` returned stands (for a failure's message; never blocks)."""
        age = f"{time.monotonic() - part.since:.1f} s"
        what = part.spec.describe()
        if part.stage is PartStage.QUEUED:
            return f"{what}: waiting {age} for its ready event or its turn to ask decode for a staging region"
        if part.stage is PartStage.ASKED:
            return f"{what}: asked decode for a staging region {age} ago, no grant yet"
        if part.stage is PartStage.GRANTED:
            return f"{what}: granted decode's region {age} ago, waiting for a local staging region"
        if part.stage is PartStage.WRITING and part.handle is not None:
            return f"{what}: {self.ctx.transport.describe_job(part.handle)}"
        return f"{what}: {part.stage.value} {age} ago"

    def _queue(self, parts: list[StagedPart]) -> None:
        self._waiting.extend(parts)
        self._waiting.sort(key=_age)
        self.pump()

    def _ready(self, parts: list[StagedPart], error) -> None:
        """The parts' gate passed (``error`` None: queue them) or failed (end
        them), but for those whose sender failed meanwhile (:meth:`release`)."""
        with self.ctx.lock:
            parts = [part for part in parts if part in self._gated]
            self._gated.difference_update(parts)
            if error is None:
                self._queue(parts)
                return
        for part in parts:
            self._finish(part, TransferError(f"{part.sender.where}: staging part {part.spec.part}: {error}"),
                         pump=False)

    def pump(self) -> None:
        """Start the waiting parts: a part with decode's region already
        (granted with the request) is ready to write, whatever waits before
        it; the others ask decode for one oldest room first, holding nothing
        here, while the bytes asked for fit the local staging. Then give free
        local staging to the parts that hold decode's region, oldest room
        first; write those ready."""
        ready = []
        with self.ctx.lock:
            # what on_chunk_done queues meanwhile (a re-entrant call) waits behind these
            pending, self._waiting = self._waiting, []
            still: list[StagedPart] = []
            for part in pending:
                if part.sender.terminal:
                    self._finish(part, None, pump=False)  # counts as done for a failed room
                    continue
                spec, req = part.spec, part.spec.req
                if spec.granted is not None:  # past any part that must wait to ask: its region may be what they wait for
                    self._has_region(part, spec.granted, ready)
                    continue
                need = _local_bytes(spec)
                if still or (need and self._asked_bytes and
                             self._asked_bytes + need > self.ctx.staging.area.nbytes):
                    still.append(part)  # asks go in order
                    continue
                key = (part.sender.room, req.request_id, spec.part)
                self._asked_bytes += need
                self._granting[key] = part  # before the request goes: its grant finds the part
                part.move(PartStage.ASKED)
                try:
                    self.ctx.channel.send(req.decode_endpoint, StageRequest(
                        room=part.sender.room, request_id=req.request_id, prefill_tp_rank=self.ctx.rank.tp_rank,
                        prefill_endpoint=self.ctx.rank.control_endpoint, part=spec.part, nbytes=spec.region_bytes))
                except KVFerryError as exc:
                    del self._granting[key]
                    self._asked_bytes -= need
                    self._finish(part, exc, pump=False)
            still.extend(self._waiting)
            still.sort(key=_age)
            self._waiting = still
            while self._local:
                part = self._local[0]
                if part.sender.terminal:
                    del self._local[0]
                    self._finish(part, None, pump=False)
                    continue
                offset = self.ctx.staging.area.alloc(part.spec.write_bytes)
                if offset is None:
                    break
                del self._local[0]
                part.local_offset = offset
                ready.append(part)
        for part in ready:
            self._write(part)

    def _has_region(self, part: StagedPart, remote_offset: int, ready: list) -> None:
        """``part`` holds decode's region at ``remote_offset``: ready to write
        when direct, else in line for a local region (under ``ctx.lock``)."""
        part.remote_offset = remote_offset
        if part.spec.direct:
            ready.append(part)
        else:
            part.move(PartStage.GRANTED)
            bisect.insort(self._local, part, key=_age)

    def on_grant(self, grant: StageGrant) -> None:
        ready = []
        with self.ctx.lock:
            part = self._granting.pop((grant.room, grant.request_id, grant.part), None)
            if part is None:
                return
            self._asked_bytes -= _local_bytes(part.spec)
            self._has_region(part, grant.offset, ready)
        for p in ready:
            self._write(p)
        self.pump()

    def _write(self, part: StagedPart) -> None:
        """Gather the part (unless direct) and write it to its region of its
        decode rank's staging (``part.remote_offset``)."""
        if part.sender.terminal:
            self._finish(part, None)
            return
        spec, remote_offset = part.spec, part.remote_offset
        try:
            peer = self.peers[spec.req.decode_session]
            arena = peer.staging.arena_size
            nbytes = spec.region_bytes
            if not 0 <= remote_offset <= peer.staging.nbytes - nbytes or \
                    remote_offset // arena != (remote_offset + nbytes - 1) // arena:
                raise IndexError(f"decode granted [{remote_offset}, +{nbytes}) outside its staging buffer "
                                 f"of {peer.staging.nbytes} bytes or across one of its {arena}-byte arenas")
            if part.ready is not None:
                part.ready.wait()  # done already: submit() queued the part only then
            if spec.direct:
                plan = source_plan(spec, peer.staging.addr + remote_offset)
            else:
                plan = self._gathered(part, peer.staging.addr + remote_offset)
        except Exception as exc:
            self._finish(part, TransferError(f"{part.sender.where}: staging part {spec.part}: {exc}"))
            return
        part.move(PartStage.WRITING)
        # priority 0, ahead of every room's direct writes: the part holds a region of both sides' staging
        part.handle = self.ctx.transport.submit(spec.req.decode_session, plan,
                                                lambda err, p=part: self._landed(p, err),
                                                ready=None, priority=0.0)

    def _gathered(self, part: StagedPart, dst_addr: int) -> TransferPlan:
        """Gather a part into its local region; the descriptors that write it
        (the region holds a share's layers one after the other; in place they
        go to their places)."""
        part.spec.gather_into(self.ctx.staging, part.local_offset, self.ctx.states)
        return gathered_plan(part.spec, self.ctx.rank.staging.addr + part.local_offset, dst_addr)

    def release(self, sender) -> None:
        """A sender failed: free the local regions of its parts still waiting
        for a grant (no write reads them yet; parts being written free
        theirs when the write ends), and drop its parts not started, those
        still waiting for their ready gate too (so decode learns at once
        that nothing more is written, not when the event completes)."""
        with self.ctx.lock:
            for part in [p for p in self._gated if p.sender is sender]:  # never read now: done
                self._gated.remove(part)
                self._finish(part, None, pump=False)
            stale = [k for k, p in self._granting.items() if p.sender is sender]
            for key in stale:
                part = self._granting.pop(key)
                self._asked_bytes -= _local_bytes(part.spec)
                self._finish(part, None, pump=False)
            for queue in (self._waiting, self._local):
                for part in [p for p in queue if p.sender is sender]:
                    queue.remove(part)
                    self._finish(part, None, pump=False)
        self.pump()

    def _landed(self, part: StagedPart, error) -> None:
        spec = part.spec
        if error is None:
            part.sender.on_part_landed(spec)
            try:
                self.ctx.channel.send(spec.req.decode_endpoint, spec.landed(
                    part.sender.room, self.ctx.rank.tp_rank, part.remote_offset, self.ctx.rank.pools))
            except KVFerryError as exc:
                error = exc
        self._finish(part, error)

    def _finish(self, part: StagedPart, error, *, notify: bool = True, pump: bool = True) -> None:
        part.move(PartStage.ENDED)
        if part.local_offset is not None:
            self.ctx.staging.area.free(part.local_offset, part.spec.write_bytes)
            part.local_offset = None
        if notify:
            part.sender.on_chunk_done(error)
        if pump:
            self.pump()


def _age(part: StagedPart) -> tuple[float, int]:
    """The order parts wait in: their room's age, then their arrival."""
    return part.sender.created, part.seq


def _local_bytes(spec: StagedSpec) -> int:
    """The local staging a part is gathered into before its write (0: written from the pools)."""
    return 0 if spec.direct else spec.write_bytes
