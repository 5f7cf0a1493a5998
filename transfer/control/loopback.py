"""An in-process control channel for unit tests; keeps the contract of
:mod:`transfer.control.base`.

Messages go through the codec both ways (encoded, sealed with the secret,
decoded by the destination), so codec and authentication errors happen as
they would on zmq. Delivery is one thread per channel, in send order; the
:class:`~transfer.transport.loopback.LoopbackFabric` routes payloads between
channels and applies the tests' faults (held, dropped or delayed messages).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from bootstrap import codec
from transfer.control.base import Handler, Link, Packed, frame
from transfer.errors import AuthError, ClosedError, ProtocolError
from transfer.round_times import RoundTimes

log = logging.getLogger("kvferry.channel")


class Router(Protocol):
    def route(self, src: str, dst: str, payload: bytes, msg=None) -> None:
        """Deliver ``payload`` (``msg`` encoded) from ``src`` to the channel
        bound at ``dst`` (or not), with the origin :func:`origin_of` ``src``."""

    def link(self, src: str, dst: str) -> Link:
        """The connection from ``src`` to ``dst`` as a network would show it."""

    def unbind(self, endpoint: str) -> None: ...


def origin_of(endpoint: str) -> str:
    """The synthetic origin of messages sent from a loopback endpoint
    (``loopback://HOST/N``): its HOST, as zmq would give the sender's address."""
    return endpoint.removeprefix("loopback://").split("/", 1)[0]


class LoopbackChannel:
    """Bound at ``endpoint`` on ``router`` (the fabric that built it)."""

    def __init__(self, router: Router, endpoint: str, handler: Handler, secret: str | bytes | None = None) -> None:
        """``secret`` seals every message (None: off)."""
        self.endpoint = endpoint
        self._router = router
        self._handler = handler
        self._key = codec.secret_key(secret)
        self._inbox: collections.deque[tuple[float, bytes, str]] = collections.deque()
        self._cond = threading.Condition()
        self._handling = threading.Lock()  # one thread at a time takes messages off the inbox and handles them
        self._closed = False
        self.num_received = 0
        self.round_times = RoundTimes()  # see ControlChannel.round_times
        self.num_malformed = 0
        self.num_unauthenticated = 0
        self._thread = threading.Thread(target=self._run, name="kvferry-control", daemon=True)
        self._thread.start()

    def send(self, endpoint: str, msg) -> None:
        payload = frame(msg, self._key)
        if isinstance(msg, Packed):
            msg = msg.msg
        if self._closed:
            raise ClosedError("control channel is closed")
        self._router.route(self.endpoint, endpoint, payload, msg)

    def connect(self, endpoint: str, between: Callable[[], None] | None = None) -> None:
        """Nothing to open in process (the fabric routes each payload)."""
        if self._closed:
            raise ClosedError("control channel is closed")

    def link(self, endpoint: str) -> Link:
        return self._router.link(self.endpoint, endpoint)

    def drain(self) -> int:
        """Handle every due message now, on this thread (0 when the delivery thread is handling)."""
        return self._handle_due(self._handling.acquire(blocking=False))

    def settle(self, timeout_s: float) -> int:
        """Handle every due message, waiting up to ``timeout_s`` for a drain in progress."""
        return self._handle_due(self._handling.acquire(timeout=timeout_s))

    def _handle_due(self, acquired: bool) -> int:
        """Handle the due messages, ``_handling`` held (``acquired``; released here); 0 if not."""
        if not acquired:
            return 0
        try:
            count = 0
            while (item := self._take_due()) is not None:
                self._handle(*item[1:])
                count += 1
            return count
        finally:
            self._handling.release()

    def _take_due(self) -> tuple[float, bytes, str] | None:
        with self._cond:
            if self._inbox and self._inbox[0][0] <= time.monotonic() and not self._closed:
                return self._inbox.popleft()
            return None

    def deliver(self, payload: bytes, due: float = 0.0, origin: str = "") -> None:
        """Called by the fabric: queue ``payload`` (from ``origin``) for the
        handler, not before ``due``."""
        with self._cond:
            if not self._closed:
                self._inbox.append((due, payload, origin))
                self._cond.notify()

    def _wait_due(self) -> bool:
        """Wait until a message is due; False once closed."""
        with self._cond:
            while not self._closed:
                if self._inbox:
                    wait = self._inbox[0][0] - time.monotonic()
                    if wait <= 0:
                        return True
                    self._cond.wait(min(wait, 0.05))
                else:
                    self._cond.wait(0.05)
            return False

    def _run(self) -> None:
        while self._wait_due():
            with self._handling:
                if (item := self._take_due()) is not None:
                    self._handle(*item[1:])

    def _handle(self, payload: bytes, origin: str) -> None:
        self.num_received += 1
        try:
            msg = codec.decode(payload, self._key)
        except AuthError as exc:
            self.num_unauthenticated += 1
            log.warning("control %s: dropped a message: %s", self.endpoint, exc)
            return
        except ProtocolError as exc:
            self.num_malformed += 1
            log.warning("control %s: dropped a malformed message: %s", self.endpoint, exc)
            return
        try:
            self._handler(msg, origin)
        except Exception:
            log.exception("control %s: handling %s failed; the channel goes on", self.endpoint, msg.KIND)

    def close(self, timeout_s: float = 2.0) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._router.unbind(self.endpoint)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
