"""The zmq control channel: the only module of ``transfer`` that uses zmq.
It keeps the contract of :mod:`transfer.control.base`.

Each rank binds one ROUTER socket (its *control endpoint*) and reaches peers
through one DEALER per peer endpoint. Messages are one-way and self-describing
(they say who sent them), so replies are just messages the other way. A
malformed or unauthenticated message is counted and dropped, and an
exception in the handler is logged: no thread dies of input. With a shared
secret every message is sealed and must verify (see :mod:`bootstrap.codec`).

Receiving: whoever holds the receive lock reads the ROUTER until it is empty
and hands each message to the handler, in order: the channel's own thread,
woken by the socket's file descriptor (``ZMQ_FD``, polled by the OS with the
interpreter lock released), or any caller of :meth:`ZmqChannel.drain` (a
busy scheduler thread, which then needs no other thread to get the
interpreter lock). Both read until ``EAGAIN``, as the edge-triggered
``ZMQ_FD`` requires.

Handing over to a draining scheduler: while a busy scheduler thread drains
regularly and the interpreter lock is contended, the channel's thread leaves
the waiting messages to it rather than handle them slowly behind it
(:mod:`transfer.control.hand_over`, which says when).

Connections: every DEALER sends ZMTP heartbeats (answered by libzmq's own
I/O thread, no Python involved) and is watched through a socket monitor, so
:meth:`ZmqChannel.link` tells a peer whose process is alive, however
busy its Python threads (up), from one that was stopped (down once its
heartbeats go unanswered) or killed (down at once, gone once its address
refused a reconnection: libzmq retries at once, then backs off).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

from bootstrap import codec
from bootstrap.listen import refuse_unversioned
from transfer.control.base import ChannelOptions, Handler, Link, frame
from transfer.control.hand_over import HandOver
from transfer.control.zmq_links import MONITORED, LinkState
from transfer.errors import AuthError, ClosedError, ProtocolError, TransferError
from transfer.round_times import RoundTimes

log = logging.getLogger("kvferry.channel")

# How long messages queued to a peer whose socket is evicted (over max_peers) may still take to leave.
_EVICT_LINGER_MS = 2000
# Reconnection attempts to a peer back off up to this interval (each attempt wakes the receiving thread).
_RECONNECT_MAX_MS = 2000
# The receiving thread looks at its sockets at least this often (a safety net; it is woken by them).
_IDLE_WAKE_MS = 1000
# Plain ints: zmq's enum flags combine through Python code, on every drain.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


@contextlib.contextmanager
def _taken(lock: threading.Lock, round_) -> Iterator[None]:
    """``lock`` held, for a round of the channel's thread: a wait for it
    (a scheduler draining, a sender sending) ends the round's hold there,
    since the interpreter lock is given up while it waits."""
    if not lock.acquire(blocking=False):
        with round_.waiting():
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _nothing() -> None:
    """No pause between the parts of a socket's opening (a send opens one under its lock)."""


class ZmqChannel:
    """``send`` is thread-safe and never blocks; ``drain`` never blocks;
    ``close`` stops the receiver."""

    def __init__(self, options: ChannelOptions, handler: Handler, *, port: int = 0, send_queue_msgs: int = 10000,
                 max_peers: int = 1024) -> None:
        host = options.host
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        refuse_unversioned(self._router)
        try:
            if port:
                self._router.bind(f"tcp://{host}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._router.close()
            self._ctx.term()
            raise OSError(f"control channel cannot bind tcp://{host}:{port}: {exc}") from exc
        self.endpoint = f"tcp://{host}:{port}"
        self._handler = handler
        self._key = codec.secret_key(options.secret)
        self._send_queue_msgs = send_queue_msgs
        self._heartbeat_ms = max(1, int(options.heartbeat_interval_s * 1000))
        self._heartbeat_timeout_ms = max(self._heartbeat_ms + 1, int(options.peer_timeout_s * 500))
        # Least recently used first; beyond ``max_peers`` the oldest socket is
        # closed (a flood of introductions cannot exhaust file descriptors).
        self._dealers: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()
        self._max_peers = max_peers
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = threading.Event()
        self._hand_over = HandOver(self._pending, self._closed)
        # Monitors of new DEALERs, for the receiving thread (which owns every monitor and
        # closes it when its DEALER closed: the monitor then reports EVENT_MONITOR_STOPPED).
        self._monitors_new: list[tuple[str, zmq.Socket]] = []
        self._monitor_of: dict[str, zmq.Socket] = {}  # endpoint -> its current DEALER's monitor
        self._links: dict[str, LinkState] = {}  # endpoint -> its connection (set by the receiving thread)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.num_received = 0
        self.round_times = RoundTimes()  # see ControlChannel.round_times
        self.num_malformed = 0
        self.num_unauthenticated = 0
        self._thread = threading.Thread(target=self._run, name="kvferry-control", daemon=True)
        self._thread.start()

    # --- sending -----------------------------------------------------------------------

    def send(self, endpoint: str, msg) -> None:
        """Queue ``msg`` for ``endpoint``. Raises ClosedError after close, and
        TransferError when the peer's queue is full."""
        payload = frame(msg, self._key)
        with self._send_lock:
            if self._closed.is_set():
                raise ClosedError("control channel is closed")
            sock = self._dealers.get(endpoint)
            if sock is not None:
                self._dealers.move_to_end(endpoint)
            else:
                sock = self._adopt(endpoint, *self._open(endpoint))
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                raise TransferError(f"control queue to {endpoint} is full ({self._send_queue_msgs} messages)",
                                    peer=endpoint) from None

    def connect(self, endpoint: str, between: Callable[[], None] | None = None) -> None:
        """Open the DEALER to ``endpoint`` unless there is one: made without
        the send lock (a socket and its monitor take a few hundred
        microseconds), then adopted under it, unless another thread's was
        adopted meanwhile (this one is closed). ``between()`` runs between
        the parts (the socket, its monitor, its connect): pyzmq keeps the
        interpreter lock in each, up to 0.5 ms on a loaded host."""
        with self._send_lock:
            if self._closed.is_set():
                raise ClosedError("control channel is closed")
            if endpoint in self._dealers:
                return
        sock, mon = self._open(endpoint, between or _nothing)
        with self._send_lock:
            if not self._closed.is_set() and endpoint not in self._dealers:
                self._adopt(endpoint, sock, mon)
                return
        sock.close(0)
        mon.close(0)
        if self._closed.is_set():
            raise ClosedError("control channel is closed")

    def _open(self, endpoint: str, between: Callable[[], None] = _nothing) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER connecting to ``endpoint``, with heartbeats, and its
        monitor, both owned by no one yet (:meth:`_adopt`); ``between()``
        after the socket and after the monitor."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._send_queue_msgs)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_timeout_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, self._heartbeat_timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)  # a dead peer is retried ever less often
        between()
        mon = sock.get_monitor_socket(MONITORED)
        between()
        sock.connect(endpoint)
        return sock, mon

    def _adopt(self, endpoint: str, sock: zmq.Socket, mon: zmq.Socket) -> zmq.Socket:
        """``endpoint``'s DEALER from now on, its monitor handed to the
        receiving thread (under the send lock); the least recently used one
        is closed first when there are ``max_peers``."""
        if len(self._dealers) >= self._max_peers:
            # What is still queued to the evicted peer gets a while to leave (a live
            # peer's messages are not dropped for being the least recently used).
            self._drop(*self._dealers.popitem(last=False), linger_ms=_EVICT_LINGER_MS)
        self._dealers[endpoint] = sock
        self._monitor_of[endpoint] = mon
        self._links[endpoint] = LinkState()
        self._monitors_new.append((endpoint, mon))
        self._wake()
        return sock

    def _drop(self, endpoint: str, sock: zmq.Socket, *, linger_ms: int = 0) -> None:
        """Close a DEALER (under the send lock); the receiving thread closes its monitor."""
        sock.close(linger_ms)
        self._monitor_of.pop(endpoint, None)
        self._links.pop(endpoint, None)

    @property
    def num_handed_over(self) -> int:
        """Times the channel's thread left waiting messages to a draining scheduler (see the module docstring)."""
        return self._hand_over.num_handed_over

    def link(self, endpoint: str) -> Link:
        """The connection to ``endpoint`` (see the module docstring)."""
        state = self._links.get(endpoint)
        return Link.UNKNOWN if state is None else state.link

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already, or the channel is closing

    # --- receiving ---------------------------------------------------------------------

    def drain(self) -> int:
        """Hand every message that arrived to the handler now, on this thread;
        0 at once when another thread is doing so."""
        if threading.get_ident() != self._thread.ident:
            self._hand_over.drained()
        return self._drain_if(self._recv_lock.acquire(blocking=False))

    def settle(self, timeout_s: float) -> int:
        """Handle every message that has arrived (see the contract), waiting
        up to ``timeout_s`` for a drain in progress; not a drainer's drain
        (it does not count for the hand-over)."""
        return self._drain_if(self._recv_lock.acquire(timeout=timeout_s))

    def _drain_if(self, acquired: bool) -> int:
        """Drain with the receive lock held (``acquired``; released here); 0 if not."""
        if not acquired:
            return 0
        try:
            return self._drain_locked()
        finally:
            self._recv_lock.release()

    def _drain_locked(self, own: bool = False) -> int:
        """Read and handle until the socket is empty; ``own`` (the channel's
        thread): stop after a message once the lock is known contended and a
        drainer is active, leaving the rest to it."""
        count = 0
        router = self._router
        while not self._closed.is_set():
            if own and count and self._hand_over.leaves_rest():
                return count
            try:
                # Asked first: a receive that finds nothing raises, and most drains find nothing.
                if not router.getsockopt(_EVENTS) & _POLLIN:
                    return count
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return count
            except zmq.ZMQError as exc:
                if not self._closed.is_set():
                    log.error("control: receive failed: %s", exc)
                return count
            count += 1
            self._handle(frames)
        return count

    def _handle(self, frames) -> None:
        self.num_received += 1
        try:
            if len(frames) != 2:
                raise ProtocolError(f"expected 1 payload frame, got {len(frames) - 1}")
            origin = _origin(frames[1])
            msg = codec.decode(frames[1].bytes, self._key)
        except AuthError as exc:
            self.num_unauthenticated += 1
            _log_drop(self.num_unauthenticated, "control %s: dropped an unauthenticated message (%d so far): %s",
                      self.endpoint, self.num_unauthenticated, exc)
            return
        except ProtocolError as exc:
            self.num_malformed += 1
            _log_drop(self.num_malformed, "control %s: dropped a malformed message (%d so far): %s",
                      self.endpoint, self.num_malformed, exc)
            return
        try:
            self._handler(msg, origin)
        except Exception:
            log.exception("control %s: handling %s failed; the channel goes on", self.endpoint, msg.KIND)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._router.getsockopt(zmq.FD), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        monitors: dict[int, tuple[str, zmq.Socket]] = {}  # fd -> (endpoint, monitor)
        signalled: set[int] = set()  # monitor fds to read (ZMQ_FD is edge-triggered: read until EAGAIN)
        while not self._closed.is_set():
            with self.round_times.round("control") as round_:  # an idle wake-up, or connection events
                self._hand_over.wait(round_.waiting)
                # The clocks only where messages wait: an idle wake-up reads no process clock.
                start = self._hand_over.start_drain() if self._pending() else None
                with _taken(self._recv_lock, round_), round_.aside():  # handling messages is no periodic work
                    handled = self._drain_locked(own=True)
                if handled:
                    if start is not None:  # else they came just after the look: no measure of this drain
                        self._hand_over.drain_ended(start)
                    round_.restart()  # handling messages is not the channel's own periodic work
                with _taken(self._send_lock, round_):
                    new, self._monitors_new = self._monitors_new, []
                for endpoint, mon in new:
                    fd = mon.getsockopt(zmq.FD)
                    monitors[fd] = (endpoint, mon)
                    poller.register(fd, select.POLLIN)
                    signalled.add(fd)
                for fd in signalled & monitors.keys():
                    round_.tick()  # many connections changing at once: the lock given up every SLICE_CPU_S
                    endpoint, mon = monitors[fd]
                    if not self._read_monitor(endpoint, mon, round_):
                        poller.unregister(fd)
                        del monitors[fd]
                        mon.close(0)
            try:
                # The interpreter lock is released while it waits.
                signalled = {fd for fd, _ in poller.poll(_IDLE_WAKE_MS)}
                while os.read(self._wake_r, 4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
        for _, mon in monitors.values():
            mon.close(0)
        self._router.close(0)

    def _pending(self) -> bool:
        """Whether messages wait on the ROUTER (for the hand-over; the channel's thread)."""
        return bool(self._router.getsockopt(_EVENTS) & _POLLIN)

    def _read_monitor(self, endpoint: str, mon: zmq.Socket, round_) -> bool:
        """Take a monitor's events (until EAGAIN: its ``ZMQ_FD`` is
        edge-triggered); False once its DEALER closed (the monitor stopped).
        Each receive lets the interpreter lock go (pyzmq releases it around
        ``zmq_msg_recv``), so it ends ``round_``'s hold, as a wait does."""
        while True:
            try:
                with round_.waiting():
                    frames = mon.recv_multipart(zmq.NOBLOCK)
                event = parse_monitor_message(frames)["event"]
            except zmq.Again:
                return True
            except zmq.ZMQError:
                return False
            if event == zmq.EVENT_MONITOR_STOPPED:
                return False
            with _taken(self._send_lock, round_):
                if self._monitor_of.get(endpoint) is mon:  # not a closed DEALER's late event
                    self._links[endpoint].on_event(event)

    def close(self, timeout_s: float = 2.0, linger_s: float = 0.1) -> None:
        """Stop receiving; messages still queued to peers get ``linger_s`` to
        leave (a failure notice sent just before close reaches its peer)."""
        with self._send_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            for sock in self._dealers.values():
                sock.close(int(linger_s * 1000))
            self._dealers.clear()
        self._wake()
        self._thread.join(timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.term()


def _origin(frame: zmq.Frame) -> str:
    """The TCP peer address of the connection ``frame`` came in on ("" if
    zmq cannot tell)."""
    try:
        return frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return ""


def _log_drop(count: int, fmt: str, *args) -> None:
    """A dropped message: WARNING for the 1st, 2nd, 4th, 8th... of its kind,
    DEBUG otherwise (a flood must not flood the log)."""
    log.log(logging.WARNING if count & (count - 1) == 0 else logging.DEBUG, fmt, *args)


def zmq_channel(options: ChannelOptions, handler: Handler) -> ZmqChannel:
    """The :data:`~transfer.control.base.ChannelFactory` of zmq channels."""
    return ZmqChannel(options, handler)
