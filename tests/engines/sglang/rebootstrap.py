"""The PD retract rebootstrap scenario (``--scenario rebootstrap``, see rank.py).

Decode: every room lands as usual (generation 1); then, as SGLang's decode
after ``pause_generation(mode="retract")`` and ``continue_generation``, each
request comes back as a new receiver for the same room, with new pages and
one page more (:func:`~tests.engines.sglang.scenarios.rebootstrap_of`):
``init``, ``send_metadata``, then ``submit_prefill_recompute(receiver,
payload)`` with SGLang's own ``Req.build_rebootstrap_payload`` (what
``_pre_alloc`` does under the ``early`` allocation policy), and the poll loop
(generation 2). Each submit's duration is printed (``SUBMIT``).

Prefill: :class:`GenerateStandIn` is the prefill server's HTTP front on its
``--http-port`` (what its manager registered as ``prefill_http_port``):
``POST /generate`` of the ``rebootstrap`` room makes the rank's loop open a
new sender for the room (its recomputed KV: the other draw), and is answered
once that room ended; the others are answered 503, or never (the connection
held until the client gives up), by the room's action. Every POST is printed
(``GENERATE``). Each decode rank posts ``/done`` (the test's own) once its
rooms ended; the prefill exits only then, so that no room fails as "gone".
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np

from tests.engines.sglang.rank import (_decode_dp_of, _error_of, _fill, _send, _verify, emit, gloo_group,
                                      prefill_info)
from tests.engines.sglang.scenarios import rebootstrap_of, requests_of
from tests.engines.sglang.sglang_rank import NUM_SLOTS, Clock, Rank, pick_pages


class GenerateStandIn:
    """The prefill server's ``POST /generate`` on 127.0.0.1:``port``, by room action
    (see the module docstring); ``asked`` holds the rooms to recompute, for
    the rank's loop, which reports each one's end with :meth:`ended`."""

    def __init__(self, port: int, actions: dict[int, str], timeout_s: float) -> None:
        self.actions, self.timeout_s = actions, timeout_s
        self.asked: queue.Queue[int] = queue.Queue()
        self._ends: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self.num_posts = self.num_open = 0
        self.done_ranks: dict[int, int] = {}  # decode rank -> its TP size, once it ended its rooms
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/done":  # the test's own: a decode rank ended its rooms
                    self.reply(200, {})  # first: the rank's loop may exit as soon as it is counted
                    with stand_in._lock:
                        stand_in.done_ranks[int(body["rank"])] = int(body["of"])
                    return
                room = int(body.get("bootstrap_room", -1))
                emit("GENERATE", path=self.path, room=room, body=body)
                with stand_in._lock:
                    stand_in.num_posts += 1
                    stand_in.num_open += 1
                try:
                    stand_in.serve(self, room)
                finally:
                    with stand_in._lock:
                        stand_in.num_open -= 1

            def reply(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def serve(self, handler, room: int) -> None:
        action = self.actions.get(room, "")
        if action == "rebootstrap_http_error":
            handler.reply(503, {"error": {"message": "the stand-in prefill refuses this room"}})
        elif action == "rebootstrap_silent":  # no answer: hold the connection until the client closes it
            handler.connection.settimeout(self.timeout_s)
            with contextlib.suppress(OSError):
                handler.rfile.read(1)
        else:
            done = threading.Event()
            with self._lock:
                self._ends[room] = (done, [])
            self.asked.put(room)
            ended = done.wait(self.timeout_s)
            state = self._ends[room][1][0] if ended else "never ended"
            handler.reply(200 if state == "Success" else 500, {"output_ids": [1], "meta_info": {"state": state}})

    def decode_done(self) -> bool:
        with self._lock:
            return bool(self.done_ranks) and len(self.done_ranks) == max(self.done_ranks.values())

    def ended(self, room: int, state: str) -> None:
        with self._lock:
            done, outcome = self._ends[room]
        outcome.append(state)
        done.set()

    def take(self) -> list[int]:
        out = []
        while not self.asked.empty():
            out.append(self.asked.get_nowait())
        return out


def run_prefill(a) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    rank = Rank(a)
    group = gloo_group(rank)
    first = requests_of(a.scenario)
    stand_in = GenerateStandIn(a.http_port, {r.room: r.action for r in first}, a.timeout)
    num_posts = sum(r.action != "rebootstrap_unresolved" for r in first)  # decode's leader posts once a room
    addr = f"127.0.0.1:{a.port}"
    taken: set = set()
    reqs, pages, senders, phase, generation = {}, {}, {}, {}, {}
    clock = Clock(rank)

    def start(r, gen: int) -> None:  # as SGLang's prefill: a request arrives, its sender is made
        reqs[r.room], generation[r.room], phase[r.room] = r, gen, "boot"
        pages[r.room] = pick_pages(a, "prefill", r.room, r.num_pages, taken)
        _fill(rank, r, pages[r.room], [])
        senders[r.room] = rank.sender_cls(mgr=rank.mgr, bootstrap_addr=addr, bootstrap_room=r.room)

    for r in first:
        start(r, 1)
    emit("READY", role="prefill", tp_rank=a.tp_rank, dp_rank=rank.dp_rank, rooms=[r.room for r in first])
    asked: list[int] = []
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        asked += stand_in.take()
        for room in [x for x in asked if phase[x] == "done"]:  # its first sender ended: a new one may take the room
            asked.remove(room)
            start(rebootstrap_of(reqs[room]), 2)
        live = [room for room in phase if phase[room] != "done"]
        # done once every POST was answered or given up, and every decode rank said it is done: a prefill that
        # exits earlier fails decode's rooms still live as "gone"
        if not live and not asked and stand_in.num_posts >= num_posts and stand_in.num_open == 0 and \
                stand_in.decode_done():
            break
        polls = poll_and_all_reduce([senders[x] for x in live], group) if live else []
        for room, poll in zip(live, polls):
            s, r = senders[room], reqs[room]
            if poll in (KVPoll.Success, KVPoll.Failed):
                state = "Success" if poll == KVPoll.Success else "Failed"
                emit("RESULT", room=room, generation=generation[room], state=state,
                     error=_error_of(s) if state == "Failed" else "")
                phase[room] = "done"
                if generation[room] == 2:
                    stand_in.ended(room, state)
            elif phase[room] == "boot" and poll == KVPoll.WaitingForInput:
                prefix_pages = s.pop_decode_prefix_len() // a.page_size
                s.init(r.num_pages - prefix_pages, room % NUM_SLOTS)
                phase[room] = "wait"
                _send(rank, r, s, pages[room], prefix_pages, clock, [])
        time.sleep(a.poll_interval_s)
    emit("DONE", role="prefill", timed_out=time.monotonic() >= deadline, posts=stand_in.num_posts)


def _build_rebootstrap_payload():
    """SGLang's ``Req.build_rebootstrap_payload``, compiled from its own source:
    importing ``sglang.srt.managers.schedule_batch`` needs the ``openai``
    package, which this environment lacks (the method reads only ``self``)."""
    import ast
    import importlib.util

    path = importlib.util.find_spec("sglang.srt.managers").submodule_search_locations[0] + "/schedule_batch.py"
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Req"]
    (fn,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "build_rebootstrap_payload"]
    fn.returns = None
    namespace: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), namespace)
    return namespace["build_rebootstrap_payload"]


def payload_of(a, req) -> dict:
    """SGLang's own ``Req.build_rebootstrap_payload`` of a retracted request
    of this room (prompt of 20 tokens, 3 output tokens, greedy)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = SimpleNamespace(sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0),
                          origin_input_ids=list(range(100, 120)), output_ids=[7, 8, 9], rid=f"rid-{req.room}",
                          bootstrap_host="127.0.0.1", bootstrap_port=a.port, bootstrap_room=req.room, priority=None,
                          extra_key=None, cache_salt=None, routing_key=None, disagg_prefill_dp_rank=None)
    return _build_rebootstrap_payload()(req)


@contextlib.contextmanager
def _no_http_port(info):
    """Decode's table entry as for a prefill that registered no HTTP port."""
    port, info.prefill_http_port = info.prefill_http_port, None
    try:
        yield
    finally:
        info.prefill_http_port = port


def run_decode(a) -> None:
    rank = Rank(a)
    group = gloo_group(rank)
    if a.recompute_timeout:
        rank.mgr.recomputer.timeout_s = a.recompute_timeout
    addr = f"127.0.0.1:{a.port}"
    deadline = time.monotonic() + a.timeout
    info = prefill_info(rank, addr, deadline)
    if info is None:
        return
    emit("READY", role="decode", prefill_http_port=info.prefill_http_port, prefill_url=rank.mgr.prefill_url(addr))
    first = requests_of(a.scenario)
    taken: set = set()
    ok = _receive(rank, group, a, info, first, taken, deadline, generation=1)
    # pause_generation(mode="retract") freed the pages; continue_generation enqueues each request again
    ok = ok and _receive(rank, group, a, info, [rebootstrap_of(r) for r in first], taken, deadline, generation=2)
    req = urllib.request.Request(rank.mgr.prefill_url(addr) + "/done", method="POST",
                                 data=json.dumps({"rank": rank.attn_tp_rank, "of": rank.attn_tp}).encode())
    with urllib.request.urlopen(req, timeout=10) as reply:  # the prefill may exit now
        reply.read()
    emit("DONE", role="decode", timed_out=not ok)


def _receive(rank: Rank, group, a, info, reqs, taken: set, deadline: float, *, generation: int) -> bool:
    """One receiver per request, as SGLang's decode makes them; generation 2
    asks prefill to recompute each room right after ``send_metadata``.
    Prints a RESULT per room; False if some room was still live at the deadline."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    addr = f"127.0.0.1:{a.port}"
    receivers, pages, slots, since = {}, {}, {}, {}
    for r in reqs:
        recv = rank.receiver_cls(mgr=rank.mgr, bootstrap_addr=addr, bootstrap_room=r.room)
        since[r.room] = time.monotonic()
        recv.init(_decode_dp_of(rank, addr, info, r.room, deadline))
        pages[r.room] = pick_pages(a, "decode", r.room, r.num_pages, taken)
        slots[r.room] = (r.room * 3 + 1) % NUM_SLOTS
        rank.meta.clear_slot(slots[r.room])
        recv.send_metadata(np.asarray(pages[r.room], dtype=np.int32), slots[r.room], None, decode_prefix_len=0)
        if generation == 2:
            payload = payload_of(a, r)
            unresolved = r.action == "rebootstrap_unresolved"
            since[r.room] = time.monotonic()  # the failures' time from here: before the call's clock starts
            with _no_http_port(info) if unresolved else contextlib.nullcontext():
                rank.mgr.submit_prefill_recompute(recv, payload)
            emit("SUBMIT", room=r.room, seconds=time.monotonic() - since[r.room], attn_tp_rank=rank.attn_tp_rank,
                 payload=payload)
        receivers[r.room] = recv
    live = list(reqs)
    while live and time.monotonic() < deadline:
        gate = [SimpleNamespace(req=SimpleNamespace(bootstrap_host="127.0.0.1"), metadata_buffer_index=slots[r.room])
                for r in live]
        polls = poll_and_all_reduce([receivers[r.room] for r in live], group, gate, rank.meta)
        still = []
        for r, poll in zip(live, polls):
            after_s = time.monotonic() - since[r.room]
            if poll == KVPoll.Success:
                emit("RESULT", room=r.room, generation=generation, state="Success", after_s=after_s,
                     **_verify(rank, r, pages[r.room], slots[r.room], []))
            elif poll == KVPoll.Failed:
                emit("RESULT", room=r.room, generation=generation, state="Failed", after_s=after_s,
                     error=_error_of(receivers[r.room]))
            else:
                still.append(r)
        live = still
        time.sleep(a.poll_interval_s)
    return not live
