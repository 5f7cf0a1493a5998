"""Fuzzing the control plane: many thousands of malformed and adversarial
messages (hypothesis) to the bootstrap server and to the control endpoints of
a live prefill and decode rank, while good requests keep being served."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bootstrap import codec
from bootstrap.client import BootstrapClient
from bootstrap.messages import PoolRole
from harness.workload import room_plan
from transfer.messages import PeerHello, PeerHelloReply, PoolAssignment, RoomStatus, TransferRequest
from tests.unit.test_codec import SAMPLES
from harness.launch import BootstrapProcess

from .ranks import FAST, Rank, assert_all_success, fault_spec

pytestmark = pytest.mark.e2e

EXAMPLES = 3000  # each sends a burst of 1-8 messages: about 4,500 per endpoint

# --- what we send -----------------------------------------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                     st.floats(allow_nan=True), st.text(max_size=64), st.binary(max_size=256))
_values = st.recursive(_scalars, lambda kids: st.one_of(st.lists(kids, max_size=6),
                                                        st.dictionaries(st.text(max_size=12), kids, max_size=6)),
                       max_leaves=24)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@st.composite
def _mutated(draw):
    """A real message of some kind with one part replaced, removed or added."""
    env = msgpack.unpackb(codec.encode(draw(st.sampled_from(SAMPLES))), raw=False)
    env = copy.deepcopy(env)
    paths = [p for p in _paths(env) if p]
    path = draw(st.sampled_from(paths))
    parent = env
    for k in path[:-1]:
        parent = parent[k]
    action = draw(st.sampled_from(["replace", "delete", "add", "kind"]))
    if action == "replace":
        parent[path[-1]] = draw(_values)
    elif action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(_values)
    else:
        env["kind"] = draw(st.sampled_from(codec.known_kinds() + ["", "x" * 40]))
    return msgpack.packb(env, use_bin_type=True)


@st.composite
def _valid_but_wrong(draw):
    """A well-formed message with hostile values: unknown rooms, huge or
    negative numbers, foreign sessions and endpoints."""
    msg = draw(st.sampled_from(SAMPLES))
    fields = {}
    for name, value in vars(msg).items():
        if type(value) is int and draw(st.booleans()):
            fields[name] = draw(st.integers(min_value=0, max_value=2**62))
        elif type(value) is str and draw(st.booleans()):
            fields[name] = draw(st.sampled_from(["", "tcp://10.255.255.1:1", "127.0.0.1:1", "x" * 300]))
    try:
        msg = type(msg)(**{**vars(msg), **fields})
    except (ValueError, TypeError):
        pass
    return codec.encode(msg)


_frames = st.one_of(
    st.builds(lambda b: [b], st.binary(max_size=512)),
    st.builds(lambda v: [msgpack.packb(v, use_bin_type=True)], _values),
    st.builds(lambda b: [b], _mutated()),
    st.builds(lambda b: [b], _valid_but_wrong()),
    st.builds(lambda b: [codec.MAGIC + b], st.binary(max_size=80)),  # a forged "sealed" frame
    st.lists(st.binary(max_size=32), min_size=2, max_size=4),  # extra frames
)


# --- the targets ------------------------------------------------------------------------


class _Target:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100000)
        self.sock.connect(endpoint)
        self.sent = 0

    def send(self, frames) -> None:
        self.sock.send_multipart(frames)
        self.sent += 1
        while self.sock.poll(0):  # the bootstrap server answers; nobody reads those
            self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture(scope="module")
def live():
    with BootstrapProcess() as server:
        spec = prefill_spec(server)
        prefill, decode = Rank("prefill", spec, FAST), Rank("decode", spec, FAST)
        targets = {"bootstrap": _Target(f"tcp://{server.address}"),
                   "prefill": _Target(prefill.ready["endpoint"]), "decode": _Target(decode.ready["endpoint"])}
        client = BootstrapClient(server.address, timeout_s=5)
        try:
            yield server, prefill, decode, targets, client
        finally:
            for t in targets.values():
                t.close()
            client.close()
            prefill.close()
            decode.close()


_rounds = {"n": 0, "room": 100}


def _good_requests_still_served(prefill, decode, client) -> None:
    reply = client.lookup("prefill", 0)
    assert reply.ready and reply.ranks[0].session == prefill.ready["session"]
    rooms = [_rounds["room"], _rounds["room"] + 1]
    _rounds["room"] += 2
    prefill.send(op="rooms", rooms=rooms, timeout_s=60)
    decode.send(op="rooms", rooms=rooms, timeout_s=60)
    assert_all_success(prefill.reply(90), rooms)
    assert_all_success(decode.reply(90), rooms)


def test_fuzz_control_plane_then_everything_still_works(live):
    """Hostile bursts at the bootstrap server and both ranks; good requests
    answered throughout; afterwards everything still works, and the bad input
    was counted, not fatal."""
    server, prefill, decode, targets, client = live

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(burst=st.lists(st.tuples(st.sampled_from(["bootstrap", "prefill", "decode"]), _frames),
                          min_size=1, max_size=8))
    def fuzz(burst):
        for name, frames in burst:
            targets[name].send(frames)
        _rounds["n"] += 1
        if _rounds["n"] % 250 == 0:  # throughout, good requests are answered and rooms move byte-exact
            _good_requests_still_served(prefill, decode, client)

    fuzz()
    assert sum(t.sent for t in targets.values()) >= 3 * 1000
    time.sleep(0.5)
    _good_requests_still_served(prefill, decode, client)
    p, d = prefill.stats(), decode.stats()
    assert p["malformed"] > 500 and d["malformed"] > 500, (p, d)
    assert p["refused_unhandshaken"] > 0, p  # well-formed requests from sessions that never handshook
    assert p["fds"] < prefill.ready["fds"] + 64, "a socket per hostile endpoint leaked"
    assert client.ping().num_errors > 500


def test_a_hostile_decode_cannot_aim_writes_at_prefill(live):
    """A peer that declares, in its handshake, the prefill rank's own
    session and pools (all public at the bootstrap server) is refused and
    counted; its request for a live room is dropped and counted; the room
    then goes through for its real decode rank, and not one byte of the
    prefill rank's pages changed."""
    server, prefill, decode, targets, client = live
    me = ZmqChannelForTest()
    try:
        victim = client.lookup("prefill", 0).ranks[0]
        prefill.send(op="digest")
        before, stats = prefill.reply()["digest"], prefill.stats()
        assert victim.session == prefill.ready["session"]
        hostile = replace(victim, control_endpoint=me.endpoint, staging=None)  # no staging: direct writes
        dealer = targets["prefill"]
        dealer.send([codec.encode(PeerHello(rank=hostile, allow_missing_draft=False))])
        reply = me.receive(PeerHelloReply)
        assert not reply.ok and reply.field == "session" and "own transfer session" in reply.reason, reply
        room = 9000
        src = room_plan(prefill_spec(server), room)[0]
        pool = victim.pools[0]
        dst = ((src + 1) % pool.num_pages).astype("<i4")  # other pages of its own pool: they would change
        dealer.send([codec.encode(TransferRequest(
            room=room, request_id=12345, decode_session=victim.session, decode_endpoint=me.endpoint,
            decode_tp_rank=0, dst_pages=dst.tobytes(), dst_aux_index=-1,
            assignments=(PoolAssignment(role=PoolRole.TARGET, send=True, src_head_offset=0, dst_head_offset=0,
                                        num_heads=pool.num_kv_heads),), num_requests=1))])
        time.sleep(0.5)
        prefill.send(op="rooms", rooms=[room], timeout_s=60)
        decode.send(op="rooms", rooms=[room], timeout_s=60)
        assert_all_success(prefill.reply(90), [room])
        assert_all_success(decode.reply(90), [room])
        prefill.send(op="digest")
        assert prefill.reply()["digest"] == before, "the prefill rank's own pages changed"
        after = prefill.stats()
        assert after["refused_hellos"] == stats["refused_hellos"] + 1, (stats, after)
        assert after["refused_unhandshaken"] >= stats["refused_unhandshaken"] + 1, (stats, after)
        assert not [m for m in me.got if isinstance(m, RoomStatus)], "the hostile peer was told about a room"
    finally:
        me.close()


class ZmqChannelForTest:
    """A ROUTER on loopback that keeps the decoded messages it receives."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.got = []

    def receive(self, kind, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = codec.decode(self.sock.recv_multipart()[-1])
                self.got.append(msg)
                if isinstance(msg, kind):
                    return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def close(self) -> None:
        self.sock.close(0)


def prefill_spec(server):
    return fault_spec(server.address, min_tokens=512, max_tokens=1024, chunk_pages=0)
