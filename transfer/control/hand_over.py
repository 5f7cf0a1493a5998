"""Handing a channel's waiting messages over to a draining scheduler, for
:class:`~transfer.control.zmq_channel.ZmqChannel`. Pure: no zmq, no socket;
the channel says whether messages wait.

A message the channel's thread handles while a busy scheduler thread holds
the interpreter lock takes a switch interval (5 ms) for every time its
handling lets the lock go (a staged part's scatter, a dozen numpy and torch
calls: 90-170 ms measured behind a busy 10 ms scheduler step, 4.5 ms of it
running), and it holds the receive lock all along, so the scheduler's own
``drain()`` finds nothing to do and every later message waits too. So when
another thread drained within the last :data:`DRAINER_ACTIVE_S` and the lock
is contended now (a ``sleep(0)`` took longer than :data:`CONTENDED_S` to get
it back, or a recent drain of the channel's thread waited for it:
:data:`CONVOY_S`; either only while the process's other threads ran as long
meanwhile: a thread kept waiting by other processes on a loaded machine is
not kept waiting by the lock, and hands nothing over), the channel's thread
leaves the waiting messages to that thread while it keeps draining (looking
every :data:`HANDOVER_S`, for at most :data:`HANDOVER_MAX_S`), and handles
what is still there after that.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable

# A thread other than the channel's that drained within this long is taken to drain regularly (a scheduler).
DRAINER_ACTIVE_S = 0.050
# The interpreter lock is contended when giving it up and getting it back takes this long.
CONTENDED_S = 0.0005
# A drain by the channel's thread that waited this much longer than it ran (for the interpreter lock) marks
# the lock contended for the next CONVOY_MEMORY_S (the sleep(0) probe misses a scheduler inside a C call).
CONVOY_S = 0.002
CONVOY_MEMORY_S = 10.0
# How often the channel's thread, leaving messages to such a drainer, looks whether they were taken, and for
# how long at most before it handles them itself.
HANDOVER_S = 0.010
HANDOVER_MAX_S = 0.100


def _others_ran(proc0: float, own0: float) -> float:
    """CPU seconds this process's other threads ran since ``time.process_time()``
    was ``proc0`` and this thread's ``time.thread_time()`` was ``own0``."""
    return (time.process_time() - proc0) - (time.thread_time() - own0)


@dataclass(frozen=True)
class DrainStart:
    """The clocks when a drain of the channel's thread began."""

    wall: float  # time.monotonic()
    cpu: float  # time.thread_time()
    proc: float  # time.process_time()


class HandOver:
    """One channel's hand-over (see the module docstring). ``pending()``:
    whether messages wait (never blocks); ``closed``: set once the channel
    closes.

    Threads: :meth:`drained` from any thread but the channel's, each time it
    drains; the others from the channel's thread only. The clocks are plain
    floats written by one side and read by the other without a lock (a
    stale read delays a hand-over by one look). :meth:`wait` blocks, with
    the interpreter lock released, for at most :data:`HANDOVER_MAX_S` plus
    one look; nothing else blocks. Nothing raises."""

    def __init__(self, pending: Callable[[], bool], closed: threading.Event) -> None:
        self._pending, self._closed = pending, closed
        self._drained_at = float("-inf")  # when a thread other than the channel's last drained
        self._convoy_until = float("-inf")  # the lock taken for contended until then (see CONVOY_S)
        #: times the channel's thread left waiting messages to a draining scheduler
        self.num_handed_over = 0

    def drained(self) -> None:
        """A thread other than the channel's drains now."""
        self._drained_at = time.monotonic()

    def leaves_rest(self) -> bool:
        """Whether the channel's thread, having handled a message, leaves the
        rest to the active drainer (the lock is known contended)."""
        return time.monotonic() < self._convoy_until and time.monotonic() - self._drained_at < DRAINER_ACTIVE_S

    @staticmethod
    def start_drain() -> DrainStart:
        """The clocks before the channel's thread takes the receive lock to drain."""
        return DrainStart(wall=time.monotonic(), cpu=time.thread_time(), proc=time.process_time())

    def drain_ended(self, start: DrainStart) -> None:
        """A drain of the channel's thread that began at ``start`` handled
        messages: one that waited for the interpreter lock meanwhile marks it
        contended for :data:`CONVOY_MEMORY_S`."""
        if (time.monotonic() - start.wall) - (time.thread_time() - start.cpu) > CONVOY_S \
                and _others_ran(start.proc, start.cpu) > CONVOY_S:
            self._convoy_until = time.monotonic() + CONVOY_MEMORY_S  # it waited for the lock meanwhile

    def wait(self, waiting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        """Leave the waiting messages to a regular drainer while the
        interpreter lock is contended, for up to :data:`HANDOVER_MAX_S`;
        returns at once otherwise. Each wait runs inside ``waiting()`` (the
        caller's measure of how long it holds the interpreter lock at a
        time, which a wait ends)."""
        if time.monotonic() - self._drained_at > DRAINER_ACTIVE_S or not self._pending():
            return
        if time.monotonic() > self._convoy_until:
            t, proc, own = time.perf_counter(), time.process_time(), time.thread_time()
            with waiting():
                time.sleep(0)  # gives the lock up: back at once unless another thread wanted it
            if time.perf_counter() - t < CONTENDED_S or _others_ran(proc, own) < CONTENDED_S:
                return
        self.num_handed_over += 1
        since = time.monotonic()
        # Waits with the lock released; the drainer's next drain takes the messages. Handled here once
        # it has stopped draining (nothing for DRAINER_ACTIVE_S), or after HANDOVER_MAX_S.
        while True:
            t = time.monotonic()
            with waiting():
                closed = self._closed.wait(HANDOVER_S)
            if closed:
                return
            now = time.monotonic()
            if now - t > HANDOVER_S + CONVOY_S:  # it waited for the lock on waking: contended still
                self._convoy_until = now + CONVOY_MEMORY_S
            if not self._pending() or now - self._drained_at > DRAINER_ACTIVE_S or now - since > HANDOVER_MAX_S:
                return
