"""Prefill side: what reads a room's pages: its writes, from their submission
to their end, and what they landed. Pure.

A room's chunks go out as direct jobs (a transport plan each, submitted
here) and staged parts (which the room hands to the staged flow,
:mod:`transfer.rooms.staged_prefill`), and, with a storage tier and the
prompt, to the write-through (:mod:`transfer.rooms.write_through`).
:class:`RoomWrites` counts the jobs and parts in flight (the room tells
decode how it ended only once none is) and the write-through's jobs (the
room is not done, and its pages not free, before those ended either); it
keeps the transport's handles, which :meth:`RoomWrites.cancel` stops when the
room fails (the room has the staged flow release its parts; a write-through
goes on: its pages are valid KV whatever the transfer did);
it counts what landed in the room's stats
(:class:`~transfer.rooms.room_stats.RoomCounts`), and says what is not done,
for a failure's message.

Its room (the :class:`~transfer.rooms.sender.KVSender`) calls it under the
rank's lock: :meth:`RoomWrites.submit` on the scheduler's thread
(``send()``), :meth:`RoomWrites.ended` from the transport's or the staged
flow's threads or ``pump()``, :meth:`RoomWrites.settle` from the storage
tier's. Nothing blocks. The transport calls ``on_done`` at once, inside
``submit``, for an empty plan, so the room counts a chunk's writes
(:meth:`RoomWrites.expect`) before it submits them; what ``Transport.submit``
raises (ClosedError) goes to the caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Callable, Iterable

from transfer.rooms.room_stats import RoomCounts

if TYPE_CHECKING:
    from transfer.ready import ReadyGate
    from transfer.rooms.chunk_plan import DirectJob
    from transfer.rooms.write_through import WriteThrough
    from transfer.transport.base import Transport


class RoomWrites:
    """The writes of one room, created at ``created`` (monotonic: its jobs'
    priority, so that a saturated link serves the oldest room first), on
    ``transport``. Not thread-safe: its room locks.

    It keeps no reference back to its room: the room's callback goes with
    each job (:meth:`submit`), and the handles and parts it keeps (which
    reach the room) are let go of whenever none is in flight, so an ended
    room is freed by its last reference, not by a garbage collection."""

    def __init__(self, transport: Transport, counts: RoomCounts, created: float) -> None:
        self.transport, self.counts, self.created = transport, counts, created
        #: jobs and parts submitted and not ended yet
        self.num_inflight = 0
        #: the write-through (None: none; set by the room's ``init()``, with a storage tier and the prompt)
        self.write_through: WriteThrough | None = None
        self._jobs: list = []  # transport handles, cancelled if the room fails
        self._parts: list = []  # staged parts (transfer.rooms.staged_prefill.StagedPart), for describe()

    @property
    def writing_through(self) -> bool:
        """Whether write-through jobs still read the room's pages."""
        return self.write_through is not None and self.write_through.num_pending > 0

    @property
    def idle(self) -> bool:
        """Whether nothing reads the room's pages: no job or part in flight, no write-through job."""
        return self.num_inflight == 0 and not self.writing_through

    def expect(self, num_writes: int) -> None:
        """A chunk's ``num_writes`` jobs and parts are about to be submitted."""
        self.num_inflight += num_writes

    def store(self, pages, first: int, aux_index: int | None, done: Callable, gate: ReadyGate | None) -> None:
        """A complete chunk's pages, from request position ``first`` (and
        ``aux_index``, the last chunk's aux slot): to the write-through, if
        any (see :meth:`WriteThrough.write`; ``done(job)`` on the tier's thread)."""
        if self.write_through is not None:
            self.write_through.write(pages, first, aux_index, done, ready=gate)

    def settle(self, job) -> None:
        """A write-through job ended."""
        self.write_through.settle(job)

    def submit(self, jobs: Iterable[DirectJob], gate: ReadyGate | None, on_done: Callable[..., None]) -> None:
        """Hand ``jobs`` to the transport, each read once ``gate`` is done;
        ``on_done(error, moved)`` ends each (``moved``: what it writes,
        counted by :meth:`ended` when it landed)."""
        for job in jobs:
            handle = self.transport.submit(job.session, job.plan,
                                           lambda error, m=job.moved: on_done(error, m), ready=gate,
                                           priority=self.created)  # a saturated link: oldest room first
            if handle is not None:
                self._jobs.append(handle)

    def staged(self, parts: Iterable) -> None:
        """The staged flow took these parts of the room (those that ended
        already are not kept)."""
        self._parts.extend(part for part in parts if not part.ended)

    def ended(self, error: BaseException | None, moved=()) -> None:
        """A job or part ended (``error`` None: it landed, and ``moved``,
        its (pool, path, bytes, descriptors), is counted)."""
        self.num_inflight -= 1
        if error is None:
            for entry in moved:
                self.counts.land(*entry)
        if self.num_inflight == 0:  # every handle and part ended: nothing to cancel or describe
            self._jobs.clear()
            self._parts.clear()

    def part_landed(self, spec) -> None:
        """A staged part's write landed (before it ends): count what it moved."""
        self.counts.part_landed(spec)

    def cancel(self) -> None:
        """The room failed: submit no more of its jobs' descriptors."""
        for job in self._jobs:
            job.cancel()
        self._jobs.clear()

    def describe(self, staging) -> str:
        """What is in flight and what landed, in words, each write not done
        yet named (``staging``: the staged flow, which describes its parts)."""
        return (f"{self.num_inflight} write(s) in flight, {self.counts.counter.total_bytes} bytes landed"
                + (", write-through pending" if self.writing_through else "")
                + "".join(f"; {self.transport.describe_job(job)}" for job in self._jobs if not job.done)
                + "".join(f"; {staging.describe(part)}" for part in self._parts if not part.ended))
