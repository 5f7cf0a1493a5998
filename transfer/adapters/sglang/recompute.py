"""PD retract rebootstrap: a decode rank asks the prefill server to recompute a room.

SGLang's decode, after ``pause_generation(mode="retract")`` (before a weight
update) and ``continue_generation``, enqueues every retracted request again
with ``is_rebootstrap``: a new receiver for the same bootstrap room, and, once
its pages are published (``send_metadata``; under the ``prefill_complete``
allocation policy right after ``init``), ``kv_manager.submit_prefill_recompute(
receiver, req.build_rebootstrap_payload())``. The payload is a ``/generate``
body for the prefill server (prompt and outputs so far as ``input_ids``,
``max_new_tokens`` 1, the same bootstrap address and room): the prefill
recomputes the KV under the current weights and sends it to the waiting
receiver as for any request.

The rule, SGLang's own (``CommonKVManager.submit_prefill_recompute``): only
the attention TP leader posts (the prefill server sends every decode rank its
share); the scheduler never waits on HTTP (:class:`Recomputer`'s threads post);
the URL is ``http://<bootstrap host>:<the HTTP port the prefill registered>``;
any failure fails the room through its Failed poll. Here a :class:`RecomputeCall`
carries the outcome from the posting thread to the receiver, whose ``poll()``
(the scheduler's thread) fails the room with a :class:`PrefillRecomputeError`
naming the request id, the room and the URL, or with a
:class:`PrefillRecomputeTimeout` once ``timeout_s`` passed without an answer
(counted from the submit, whatever the socket does).
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request

from transfer.errors import KVFerryError, KVTimeoutError

log = logging.getLogger("kvferry.sglang")

#: reply bytes quoted in an error
_QUOTED_BYTES = 300


class PrefillRecomputeError(KVFerryError):
    """The prefill server was not asked, or did not agree, to recompute a
    retracted request: ``rid`` and ``room`` name it, ``url`` the prefill's
    ``/generate`` ("" when it could not be derived), ``status`` the HTTP
    status of a refusal (None: no reply)."""

    def __init__(self, message: str, *, rid, room: int, url: str, status: int | None = None) -> None:
        super().__init__(message)
        self.rid, self.room, self.url, self.status = rid, room, url, status


class PrefillRecomputeTimeout(PrefillRecomputeError, KVTimeoutError):
    """The prefill's ``/generate`` did not answer within the call's bound."""


class RecomputeCall:
    """One request to recompute a room: settled once by the posting thread
    (:meth:`answered` or :meth:`failed`), read by the receiver's ``poll()``
    (:meth:`error`). Thread-safe; nothing blocks."""

    def __init__(self, *, rid, room: int, url: str, timeout_s: float) -> None:
        self.rid, self.room, self.url, self.timeout_s = rid, int(room), url, float(timeout_s)
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._error: PrefillRecomputeError | None = None
        self._answered = False

    @property
    def where(self) -> str:
        return f"PD retract rebootstrap of rid {self.rid} (room {self.room})"

    @property
    def generate_url(self) -> str:
        return self.url.rstrip("/") + "/generate"

    @property
    def is_answered(self) -> bool:
        """Whether the prefill answered 2xx (the call then never fails)."""
        with self._lock:
            return self._answered

    def answered(self) -> None:
        with self._lock:
            if self._error is None:
                self._answered = True

    def failed(self, message: str, *, status: int | None = None, cause: BaseException | None = None,
               kind: type[PrefillRecomputeError] = PrefillRecomputeError) -> None:
        """The call failed (the first outcome counts)."""
        error = kind(f"{self.where}: {message}", rid=self.rid, room=self.room, url=self.url, status=status)
        error.__cause__ = cause
        with self._lock:
            if self._error is None and not self._answered:
                self._error = error

    def error(self, now: float) -> PrefillRecomputeError | None:
        """Why the room must fail now: the call failed, or ran past its bound
        unanswered; None while it may still answer, and once it answered."""
        with self._lock:
            if self._error is None and not self._answered and now - self.started > self.timeout_s:
                self._error = PrefillRecomputeTimeout(
                    f"{self.where}: POST {self.generate_url} not answered within {self.timeout_s:g} s",
                    rid=self.rid, room=self.room, url=self.url)
            return self._error


class Recomputer:
    """Posts the calls of one decode rank from up to ``max_workers`` daemon
    threads of its own, started as calls wait (never on the scheduler's
    thread: :meth:`submit` only queues). Each POST is bounded by the call's
    ``timeout_s`` per socket operation; the call's own bound is total."""

    def __init__(self, *, timeout_s: float, max_workers: int = 16) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        #: the bound of each call (SGLang's waiting timeout, as its own manager uses)
        self.timeout_s = float(timeout_s)
        self.max_workers = max_workers
        self._queue: queue.Queue[tuple[RecomputeCall, dict] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._num_workers = self._num_idle = 0
        self._closed = False

    def call(self, *, rid, room: int, url: str) -> RecomputeCall:
        """A call with this recomputer's bound, started now."""
        return RecomputeCall(rid=rid, room=room, url=url, timeout_s=self.timeout_s)

    def submit(self, call: RecomputeCall, payload: dict) -> None:
        """Post ``payload`` to ``call.url + "/generate"`` from a worker thread."""
        with self._lock:
            if self._closed:
                call.failed("the KV manager is closed")
                return
            self._queue.put((call, payload))
            if self._num_idle < self._queue.qsize() and self._num_workers < self.max_workers:
                self._num_workers += 1  # every worker busy: one more (else the call waits for one)
                threading.Thread(target=self._run, name=f"kvferry-sglang-recompute-{self._num_workers}",
                                 daemon=True).start()

    def close(self) -> None:
        """Calls not yet posted fail; calls being posted end at their bound."""
        with self._lock:
            self._closed = True
            for _ in range(self._num_workers):
                self._queue.put(None)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].failed("the KV manager closed before it was posted")

    def _run(self) -> None:
        while True:
            with self._lock:
                self._num_idle += 1
            item = self._queue.get()
            with self._lock:
                self._num_idle -= 1
            if item is None:
                return
            post_generate(*item)


def post_generate(call: RecomputeCall, payload: dict) -> None:
    """``POST <call.url>/generate`` with ``payload`` as JSON; settles ``call``
    (a 2xx reply: answered; anything else: failed). Never raises."""
    url = call.generate_url
    try:
        body = json.dumps(payload).encode()
        req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=call.timeout_s) as reply:
            reply.read()
            status = reply.status
    except urllib.error.HTTPError as exc:
        call.failed(f"POST {url} answered HTTP {exc.code}: {_quoted(exc)}", status=exc.code, cause=exc)
        return
    except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
        if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            # a socket operation (the connect, a read) ran past the bound
            call.failed(f"POST {url} not answered within {call.timeout_s:g} s", cause=exc,
                        kind=PrefillRecomputeTimeout)
        else:
            call.failed(f"POST {url} failed: {getattr(exc, 'reason', exc)}", cause=exc)
        return
    except Exception as exc:  # the room must fail, whatever went wrong
        call.failed(f"POST {url} not sent: {type(exc).__name__}: {exc}", cause=exc)
        return
    if 200 <= status < 300:
        log.info("kvferry %s: %s answered %d after %.2f s", call.where, url, status, time.monotonic() - call.started)
        call.answered()
    else:
        call.failed(f"POST {url} answered HTTP {status}", status=status)


def _quoted(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(_QUOTED_BYTES).decode(errors="replace").strip() or exc.reason
    except (OSError, http.client.HTTPException):
        return str(exc.reason)
