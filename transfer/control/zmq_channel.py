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

Handing over to a draining scheduler: a message the channel's thread
handles while a busy scheduler thread holds the interpreter lock takes a
switch interval (5 ms) for every time its handling lets the lock go (a
staged part's scatter, a dozen numpy and torch calls: 90-170 ms measured
behind a busy 10 ms scheduler step, 4.5 ms of it running), and it holds the
receive lock all along, so the scheduler's own ``drain()`` finds nothing to
do and every later message waits too. So when another thread drained within
the last :data:`_DRAINER_ACTIVE_S` and the lock is contended now (a
``sleep(0)`` took longer than :data:`_CONTENDED_S` to get it back, or a
recent drain of the channel's thread waited for it: :data:`_CONVOY_S`;
either only while the process's other threads ran as long meanwhile: a
thread kept waiting by other processes on a loaded machine is not kept
waiting by the lock, and hands nothing over), the
channel's thread leaves the waiting messages to that thread while it keeps
draining (looking every :data:`_HANDOVER_S`, for at most
:data:`_HANDOVER_MAX_S`), and handles what is still there after that.

Connections: every DEALER sends ZMTP heartbeats (answered by libzmq's own
I/O thread, no Python involved) and is watched through a socket monitor, so
:meth:`ZmqChannel.link` tells a peer whose process is alive, however
busy its Python threads (up), from one that was stopped (down once its
heartbeats go unanswered) or killed (down at once, gone once its address
refused a reconnection: libzmq retries at once, then backs off).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from bootstrap import codec
from bootstrap.listen import refuse_unversioned
from transfer.control.base import ChannelOptions, Handler, Link
from transfer.errors import AuthError, ClosedError, ProtocolError, TransferError
from transfer.round_times import RoundTimes

log = logging.getLogger("kvferry.channel")

# How long messages queued to a peer whose socket is evicted (over max_peers) may still take to leave.
_EVICT_LINGER_MS = 2000
# Reconnection attempts to a peer back off up to this interval (each attempt wakes the receiving thread).
_RECONNECT_MAX_MS = 2000
# The receiving thread looks at its sockets at least this often (a safety net; it is woken by them).
_IDLE_WAKE_MS = 1000
_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
         | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# A reconnection scheduled: once after a connection is lost, then once after every attempt that failed.
_RETRY = zmq.EVENT_CONNECT_RETRIED
_CONNECTED = zmq.EVENT_CONNECTED  # TCP connected (a stopped process's kernel still accepts)
# A thread other than the channel's that drained within this long is taken to drain regularly (a scheduler).
_DRAINER_ACTIVE_S = 0.050
# The interpreter lock is contended when giving it up and getting it back takes this long.
_CONTENDED_S = 0.0005
# A drain by the channel's thread that waited this much longer than it ran (for the interpreter lock) marks
# the lock contended for the next _CONVOY_MEMORY_S (the sleep(0) probe misses a scheduler inside a C call).
_CONVOY_S = 0.002
_CONVOY_MEMORY_S = 10.0
# How often the channel's thread, leaving messages to such a drainer, looks whether they were taken, and for
# how long at most before it handles them itself.
_HANDOVER_S = 0.010
_HANDOVER_MAX_S = 0.100
# Plain ints: zmq's enum flags combine through Python code, on every drain.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def _others_ran(proc0: float, own0: float) -> float:
    """CPU seconds this process's other threads ran since ``time.process_time()``
    was ``proc0`` and this thread's ``time.thread_time()`` was ``own0``."""
    return (time.process_time() - proc0) - (time.thread_time() - own0)


class _LinkState:
    """One DEALER's connection as its monitor's events tell it."""

    __slots__ = ("link", "retries")

    def __init__(self) -> None:
        self.link, self.retries = Link.UNKNOWN, 0

    def on_event(self, event: int) -> None:
        if event & _UP:
            self.link, self.retries = Link.UP, 0
        elif event & _CONNECTED:
            self.retries = 0
        elif event & _RETRY:
            self.retries += 1
            # The first retry follows the loss itself; a second with no TCP connection between
            # means an attempt failed: once up, a refused address (the process there is gone).
            if self.retries >= 2 and self.link is not Link.UNKNOWN:
                self.link = Link.GONE
            elif self.link is Link.UP:
                self.link = Link.DOWN
        elif event & _DOWN and self.link is Link.UP:
            self.link = Link.DOWN


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
        self._drained_at = float("-inf")  # when a thread other than the channel's last drained
        self._convoy_until = float("-inf")  # the lock taken for contended until then (see _CONVOY_S)
        #: times the channel's thread left waiting messages to a draining scheduler (see the module docstring)
        self.num_handed_over = 0
        self._closed = threading.Event()
        # Monitors of new DEALERs, for the receiving thread (which owns every monitor and
        # closes it when its DEALER closed: the monitor then reports EVENT_MONITOR_STOPPED).
        self._monitors_new: list[tuple[str, zmq.Socket]] = []
        self._monitor_of: dict[str, zmq.Socket] = {}  # endpoint -> its current DEALER's monitor
        self._links: dict[str, _LinkState] = {}  # endpoint -> its connection (set by the receiving thread)
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
        payload = codec.encode(msg, self._key)
        with self._send_lock:
            if self._closed.is_set():
                raise ClosedError("control channel is closed")
            sock = self._dealers.get(endpoint)
            if sock is not None:
                self._dealers.move_to_end(endpoint)
            else:
                if len(self._dealers) >= self._max_peers:
                    # What is still queued to the evicted peer gets a while to leave (a live
                    # peer's messages are not dropped for being the least recently used).
                    self._drop(*self._dealers.popitem(last=False), linger_ms=_EVICT_LINGER_MS)
                sock = self._dealers[endpoint] = self._dealer(endpoint)
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                raise TransferError(f"control queue to {endpoint} is full ({self._send_queue_msgs} messages)",
                                    peer=endpoint) from None

    def _dealer(self, endpoint: str) -> zmq.Socket:
        """A DEALER to ``endpoint`` with heartbeats, its monitor handed to the receiving thread (under the send lock)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._send_queue_msgs)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_timeout_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, self._heartbeat_timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)  # a dead peer is retried ever less often
        mon = self._monitor_of[endpoint] = sock.get_monitor_socket(_UP | _DOWN | _RETRY | _CONNECTED)
        self._links[endpoint] = _LinkState()
        self._monitors_new.append((endpoint, mon))
        sock.connect(endpoint)
        self._wake()
        return sock

    def _drop(self, endpoint: str, sock: zmq.Socket, *, linger_ms: int = 0) -> None:
        """Close a DEALER (under the send lock); the receiving thread closes its monitor."""
        sock.close(linger_ms)
        self._monitor_of.pop(endpoint, None)
        self._links.pop(endpoint, None)

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
            self._drained_at = time.monotonic()
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
            if own and count and time.monotonic() < self._convoy_until \
                    and time.monotonic() - self._drained_at < _DRAINER_ACTIVE_S:
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
                self._hand_over()
                wall, cpu, proc = time.monotonic(), time.thread_time(), time.process_time()
                with self._recv_lock:
                    handled = self._drain_locked(own=True)
                if handled:
                    if (time.monotonic() - wall) - (time.thread_time() - cpu) > _CONVOY_S \
                            and _others_ran(proc, cpu) > _CONVOY_S:
                        self._convoy_until = time.monotonic() + _CONVOY_MEMORY_S  # it waited for the lock meanwhile
                    round_.restart()  # handling messages is not the channel's own periodic work
                with self._send_lock:
                    new, self._monitors_new = self._monitors_new, []
                for endpoint, mon in new:
                    fd = mon.getsockopt(zmq.FD)
                    monitors[fd] = (endpoint, mon)
                    poller.register(fd, select.POLLIN)
                    signalled.add(fd)
                for fd in signalled & monitors.keys():
                    round_.tick()  # many connections changing at once: the lock given up every half millisecond
                    endpoint, mon = monitors[fd]
                    if not self._read_monitor(endpoint, mon):
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

    def _hand_over(self) -> None:
        """Leave the waiting messages to a regular drainer while the
        interpreter lock is contended, for up to ``_HANDOVER_S`` (see the
        module docstring); returns at once otherwise."""
        if time.monotonic() - self._drained_at > _DRAINER_ACTIVE_S or not self._router.getsockopt(_EVENTS) & _POLLIN:
            return
        if time.monotonic() > self._convoy_until:
            t, proc, own = time.perf_counter(), time.process_time(), time.thread_time()
            time.sleep(0)  # gives the lock up: back at once unless another thread wanted it
            if time.perf_counter() - t < _CONTENDED_S or _others_ran(proc, own) < _CONTENDED_S:
                return
        self.num_handed_over += 1
        since = time.monotonic()
        # Waits with the lock released; the drainer's next drain takes the messages. Handled here once
        # it has stopped draining (nothing for _DRAINER_ACTIVE_S), or after _HANDOVER_MAX_S.
        while True:
            t = time.monotonic()
            if self._closed.wait(_HANDOVER_S):
                return
            now = time.monotonic()
            if now - t > _HANDOVER_S + _CONVOY_S:  # it waited for the lock on waking: contended still
                self._convoy_until = now + _CONVOY_MEMORY_S
            if not self._router.getsockopt(_EVENTS) & _POLLIN or now - self._drained_at > _DRAINER_ACTIVE_S \
                    or now - since > _HANDOVER_MAX_S:
                return

    def _read_monitor(self, endpoint: str, mon: zmq.Socket) -> bool:
        """Take a monitor's events (until EAGAIN: its ``ZMQ_FD`` is
        edge-triggered); False once its DEALER closed (the monitor stopped)."""
        while True:
            try:
                event = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return True
            except zmq.ZMQError:
                return False
            if event == zmq.EVENT_MONITOR_STOPPED:
                return False
            with self._send_lock:
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
