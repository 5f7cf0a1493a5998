"""The Mooncake Store client behind
:class:`~transfer.storage.mooncake.store.MooncakeStore`, with every call
bounded in time.

The Store's calls are synchronous and have their own long timeouts: ``setup``
against an absent master retries for about 90 s (20 x 4.5 s); with the master
dead, ``batch_is_exist`` and gets usually fail (-900) at once, but puts,
upserts and any call that meets the client's reconnect attempt take about
4.3 s; a stalled transfer waits up to 60 s. Closing takes about 1 s, and the
client's destructor unmounts its memory at the master, retrying for about 12 s
when the master is gone. So every Store call, the destructor included, runs on
one worker thread that alone holds the client, and the caller waits until its
deadline, then raises :class:`~transfer.errors.StorageTimeoutError`; until the
stuck call returns, later calls raise
:class:`~transfer.errors.StorageUnavailableError` at once (and the stuck call
may still touch its segments). Opening first checks that the master's port
accepts a TCP connection. ``health_check()`` is not used: it reports healthy
after the master died; RPC failures (-900...) raise StorageUnavailableError.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from transfer.errors import StorageClosedError, StorageError, StorageTimeoutError, StorageUnavailableError

__all__ = ["StoreClient", "check_master", "code_name"]

log = logging.getLogger("kvferry.storage.mooncake")

# ErrorCode values of mooncake-store (types.h) that appear in results.
_CODE_NAMES = {
    -200: "NO_AVAILABLE_HANDLE (no space)", -600: "INVALID_PARAMS", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -800: "TRANSFER_FAIL", -900: "RPC_FAIL",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}


def code_name(code: int) -> str:
    """A Store result code with its name, where known."""
    return f"{code} ({_CODE_NAMES[code]})" if code in _CODE_NAMES else str(code)


def _is_unavailable(code: int) -> bool:
    """The master or the cluster cannot serve any key (RPC errors)."""
    return -999 <= code <= -900 or code in (-1010, -1011)


def check_master(addr: str, timeout_s: float, url: str) -> None:
    """StorageUnavailableError unless the master's ``host:port`` accepts a TCP connection."""
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise StorageUnavailableError(f"{url}: the Mooncake master at {addr} is unreachable: {exc}",
                                      backend=url) from exc


class _StoreThread:
    """One daemon thread that runs every Store call, so that callers can stop
    waiting for one (the Store's calls release the GIL but cannot be
    interrupted). Not thread-safe: the store serialises its callers."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: Future | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvferry-mooncake-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future, _keepalive = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

    def check_free(self, what: str) -> None:
        """StorageUnavailableError while a call that timed out is still running."""
        if self._stuck is not None and not self._stuck.done():
            raise StorageUnavailableError(f"{self._url}: {what}: an earlier Store call is still running past its "
                                          "timeout", backend=self._url)

    def call(self, what: str, deadline: float, fn: Callable, *args, must_run: bool = False,
             keepalive: Any = None):
        """``fn(*args)`` on the worker, waiting until ``deadline`` (monotonic).
        A call that is not ``must_run`` is refused while an earlier one is
        stuck, and dropped if its time ran out before it started.
        ``keepalive`` (memory the call uses) stays referenced until it returns."""
        if not must_run:
            self.check_free(what)
        future: Future = Future()
        self._jobs.put((fn, args, future, keepalive))
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if must_run or not future.cancel():
                self._stuck = future
            raise StorageTimeoutError(f"{self._url}: {what} did not finish in time", backend=self._url) from None

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every queued call finished within ``timeout_s``."""
        if self._stopped:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        done: Future = Future()
        self._jobs.put((lambda: None, (), done, None))
        try:
            done.result(timeout=timeout_s)
            return True
        except FutureTimeout:
            return False

    def post(self, fn: Callable) -> None:
        """Queue ``fn()`` without waiting for it."""
        self._jobs.put((fn, (), Future(), None))

    def stop(self) -> None:
        """The thread ends after the calls queued so far."""
        self._stopped = True
        self._jobs.put(None)


class StoreClient:
    """One ``MooncakeDistributedStore`` object, touched only on its worker
    thread (so its slow destructor never runs on a caller's thread). Every
    method waits at most until the deadline it is given. Not thread-safe: the
    store serialises its callers."""

    def __init__(self, url: str, store_class: type, options: Mapping[str, Any], deadline: float) -> None:
        """Set up a client with ``options`` (``store.setup``'s dict) by
        ``deadline``; StorageUnavailableError when setup fails, and
        StorageTimeoutError past the deadline (a setup that returns later is
        closed on the worker)."""
        self.url = url
        self._store: Any = None  # touched only on the worker thread, see _invoke
        self._worker = _StoreThread(url)
        try:
            self._worker.call("setup", deadline, self._setup, store_class, dict(options))
        except BaseException:
            self._worker.post(lambda: self._close_store(lambda: []))  # a setup that returns late
            self._worker.stop()
            raise

    def _setup(self, store_class: type, options: dict) -> None:
        store = store_class()
        rc = store.setup(options)
        if rc != 0:
            raise StorageUnavailableError(f"{self.url}: MooncakeDistributedStore.setup returned {code_name(rc)}",
                                          backend=self.url, code=rc)
        self._store = store

    def _invoke(self, method: str, *args):
        if self._store is None:  # closed by another thread meanwhile
            raise StorageClosedError(f"{self.url}: {method} after close()", backend=self.url)
        return getattr(self._store, method)(*args)

    def call(self, method: str, deadline: float, *args, keepalive: Any = None):
        """``store.<method>(*args)`` on the worker thread, bounded by ``deadline``;
        ``keepalive`` stays referenced until the call returns."""
        return self._worker.call(method, deadline, self._invoke, method, *args, keepalive=keepalive)

    def check_free(self, what: str) -> None:
        """StorageUnavailableError while a call that timed out is still running."""
        self._worker.check_free(what)

    def fail_if_unavailable(self, what: str, codes: Sequence[int]) -> None:
        """StorageUnavailableError when a result code says the master or cluster is unreachable."""
        bad = next((c for c in codes if _is_unavailable(c)), None)
        if bad is not None:
            raise StorageUnavailableError(f"{self.url}: {what} failed with {code_name(bad)}: the master or "
                                          "cluster is unreachable", backend=self.url, code=bad)

    def present(self, keys: Sequence[str], deadline: float, *, max_keys_per_call: int,
                leading: bool) -> list[bool]:
        """batch_is_exist per key (``leading``: stop after the first absent one)."""
        present: list[bool] = []
        for start in range(0, len(keys), max_keys_per_call):
            codes = self.call("batch_is_exist", deadline, list(keys[start:start + max_keys_per_call]))
            self.fail_if_unavailable("batch_is_exist", codes)
            for code in codes:
                if code < 0:
                    raise StorageError(f"{self.url}: batch_is_exist returned {code_name(code)}",
                                       backend=self.url, code=code)
                present.append(code == 1)
            if leading and not all(present):
                break
        return present

    def close(self, timeout_s: float, buffers: Callable[[], list[int]]) -> None:
        """Unregister the addresses ``buffers()`` returns (evaluated on the
        worker) and close the client, waiting at most ``timeout_s``; never
        raises: past it the close goes on in the background."""
        try:
            self._worker.call("close", time.monotonic() + timeout_s, self._close_store, buffers, must_run=True)
        except StorageTimeoutError:
            log.warning("%s: close did not finish in %.1f s; it goes on in the background", self.url, timeout_s)
        except Exception:  # close never raises: the client is gone either way
            log.warning("%s: close failed", self.url, exc_info=True)
        finally:
            self._worker.stop()

    def _close_store(self, buffers: Callable[[], list[int]]) -> None:
        if self._store is None:
            return
        for addr in buffers():
            self._store.unregister_buffer(addr)
        rc = self._store.close()
        if rc != 0:
            log.warning("%s: MooncakeDistributedStore.close returned %s", self.url, code_name(rc))
        # The client's destructor unmounts its memory at the master and retries
        # for about 12 s when the master is gone: let it run here, not in the
        # thread that drops the last reference to this object.
        self._store = None

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every call started (a timed-out one, a background close) has
        returned within ``timeout_s``."""
        return self._worker.wait_idle(timeout_s)
