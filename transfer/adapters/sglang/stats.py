"""Per-room transfer statistics, from which ``get_transfer_metric()`` is filled.

kvferry's senders do not count their bytes yet (see the report: the core
should keep a ``KVSender.stats``). Until then :class:`CountingTransport`
wraps the manager's transport and attributes each submitted plan to the
sender that submitted it: a direct plan's callback is the sender's bound
method, a staged part's callback carries the part, which names its sender.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass


@dataclass
class RoomStats:
    bytes: int = 0
    descriptors: int = 0
    submits: int = 0
    first_submit_s: float | None = None


def _owner(callback):
    owner = getattr(callback, "__self__", None)
    if owner is not None:
        return owner
    for value in getattr(callback, "__defaults__", None) or ():
        sender = getattr(value, "sender", None)
        if sender is not None:
            return sender
    return None


class CountingTransport:
    """Delegates everything to ``inner``; counts what ``submit`` is given."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._rooms: "weakref.WeakKeyDictionary[object, RoomStats]" = weakref.WeakKeyDictionary()

    def submit(self, peer, plan, callback):
        owner = _owner(callback)
        if owner is not None:
            with self._lock:
                st = self._rooms.setdefault(owner, RoomStats())
                st.bytes += plan.total_bytes
                st.descriptors += plan.num_descriptors
                st.submits += 1
                if st.first_submit_s is None:
                    st.first_submit_s = time.perf_counter()
        return self._inner.submit(peer, plan, callback)

    def stats(self, sender) -> RoomStats:
        with self._lock:
            st = self._rooms.get(sender)
            return RoomStats(**vars(st)) if st is not None else RoomStats()

    def __getattr__(self, name):
        return getattr(self._inner, name)
