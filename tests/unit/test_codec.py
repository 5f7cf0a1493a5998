"""The control-plane codec: round trips of every message kind, and every
rejection raising ProtocolError that names the problem."""

from __future__ import annotations

import copy
import struct as pystruct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bootstrap.messages as bm
import bootstrap.status as bs
import transfer.messages as tm
from bootstrap import codec
from bootstrap.errors import AuthError, KVFerryError, ProtocolError

from ._fixtures import make_aux, make_pool, make_rank


def _rank(**kw):
    pools = (
        make_pool(num_layers=3, num_kv_heads=2, total_kv_heads=8, head_dim=128, page_size=64, num_pages=1000),
        make_pool(role=bm.PoolRole.DRAFT, num_layers=1, num_kv_heads=2, total_kv_heads=8,
                  base=0x6000_0000_0000, num_pages=1000),
    )
    kw.setdefault("pools", pools)
    return make_rank(tp_rank=1, tp_size=4, dp_rank=1, dp_size=2, **kw)


def _mla_rank():
    return make_rank(pools=(make_pool(attention=bm.AttentionKind.MLA, head_dim=576, num_layers=4,
                                      dtype="float8_e4m3fn", itemsize=1),), aux=None)


def samples() -> list:
    """At least one realistic instance of every registered kind."""
    rank = _rank()
    pages = pystruct.pack("<5i", 7, 8, 9, 100, 2**31 - 1)
    return [
        bm.Register(rank=rank),
        bm.Register(rank=_mla_rank()),
        bm.Registered(node_id="prefill-0", dp_rank=1, num_registered=3, tp_size=4),
        bm.Lookup(node_id="prefill-0", dp_rank=1),
        bm.LookupReply(node_id="prefill-0", dp_rank=0, ready=True, dp_size=1, tp_size=2,
                       num_registered=2, ranks=(make_rank(tp_rank=0, tp_size=2), make_rank(tp_rank=1, tp_size=2))),
        bm.LookupReply(node_id="nowhere", dp_rank=0, ready=False, dp_size=0, tp_size=0,
                       num_registered=0, ranks=()),
        bm.Ping(),
        bm.Pong(num_nodes=3, num_errors=0),
        bm.ErrorReply(code="conflict", message="node 'p': dp_size 2 differs from 1 — ünïcödé"),
        tm.PeerHello(rank=rank, allow_missing_draft=True),
        tm.PeerHelloReply(session="10.0.0.2:17001", ok=False, field="target.page_size", reason="16 vs 32"),
        tm.PeerHelloReply(session="10.0.0.2:17001", ok=True, field="", reason=""),
        tm.TransferRequest(
            room=2**63 - 1, request_id=0xDEADBEEFCAFEBABE, decode_session="10.0.1.1:17000",
            decode_endpoint="tcp://10.0.1.1:5600", decode_tp_rank=3, dst_pages=pages, dst_aux_index=-1,
            assignments=(
                tm.PoolAssignment(role=bm.PoolRole.TARGET, send=True, src_head_offset=1,
                                  dst_head_offset=0, num_heads=1),
                tm.PoolAssignment(role=bm.PoolRole.DRAFT, send=False, src_head_offset=0,
                                  dst_head_offset=0, num_heads=0),
            ),
            num_requests=2,
        ),
        tm.TransferRequest(room=0, request_id=1, decode_session="s", decode_endpoint="e", decode_tp_rank=0,
                           dst_pages=b"", dst_aux_index=5, assignments=(), num_requests=1),
        tm.RoomStatus(room=12, request_id=34, prefill_tp_rank=1, status=tm.Status.SUCCESS,
                      sent=(bm.PoolRole.TARGET, bm.PoolRole.DRAFT), reason=""),
        tm.RoomStatus(room=12, request_id=34, prefill_tp_rank=0, status=tm.Status.FAILED, sent=(),
                      reason="transfer engine returned -1"),
        tm.RoomAbort(room=12, request_id=77, reason="decode scheduler aborted", session="10.0.0.2:15001"),
        tm.RoomHold(room=12, session="10.0.0.2:15001", hold_s=20.0),
        tm.PeerPing(session="10.0.0.2:15001", endpoint="tcp://10.0.0.2:5557", seq=9),
        tm.PeerPong(session="10.0.0.1:15002", seq=9),
        tm.PeerBye(session="10.0.0.1:15002"),
        tm.StageRequest(room=12, request_id=5, prefill_tp_rank=1, prefill_endpoint="tcp://10.0.0.1:5557", part=3,
                        nbytes=16 << 20),
        tm.StageGrant(room=12, request_id=5, part=3, offset=32 << 20),
        tm.PagesStaged(room=12, request_id=5, prefill_tp_rank=1, part=3, offset=32 << 20, nbytes=16 << 20,
                       page_start=24, num_pages=8),
        tm.ShareStaged(room=12, request_id=5, prefill_tp_rank=1, part=3, offset=32 << 20, nbytes=16 << 20,
                       page_start=24, num_pages=8, layers=(4, 5, 6, 32)),
        tm.StateStaged(room=12, request_id=5, prefill_tp_rank=1, part=4, offset=48 << 20, nbytes=4096,
                       state_pool=1, item_start=0, num_items=2),
        bm.LookupReply(node_id="prefil-0", dp_rank=0, ready=False, dp_size=0, tp_size=0, num_registered=0,
                       ranks=(), unknown_node=True, known_nodes=("prefill-0", "prefill-1")),
        bm.Unregister(node_id="prefill-0", dp_rank=1, tp_rank=3, session="10.0.0.1:17001"),
        bm.Unregistered(node_id="prefill-0", dp_rank=1, tp_rank=3, removed=True, num_registered=3),
        bs.Status(),
        bs.StatusReply(uptime_s=12.5, rank_ttl_s=15.0, node_grace_s=4.0, num_requests=99, num_errors=1,
                       num_unauthenticated=0, num_expired=2, num_omitted=0,
                       ranks=(bs.RankStatus(node_id="prefill-0", dp_rank=1, dp_size=2, tp_rank=1, tp_size=4,
                                            session="10.0.0.1:17001", control_endpoint="tcp://10.0.0.1:5557",
                                            age_s=0.7, pools=tuple(bs.PoolSummary.of(p) for p in rank.pools)),)),
    ]


SAMPLES = samples()
REGISTER = SAMPLES[0]
TRANSFER_REQUEST = SAMPLES[12]
ROOM_STATUS = SAMPLES[14]
assert type(REGISTER) is bm.Register and type(TRANSFER_REQUEST) is tm.TransferRequest
assert type(ROOM_STATUS) is tm.RoomStatus


def test_samples_cover_every_registered_kind():
    covered = {type(m).KIND for m in SAMPLES}
    assert covered == set(codec.known_kinds())
    # both modules' kinds are registered
    for kind in ("register", "lookup_reply", "ping", "peer_hello", "transfer_request", "room_status", "room_abort"):
        assert kind in codec.known_kinds()


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).KIND)
def test_round_trip(msg):
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    out = codec.decode(data)
    assert type(out) is type(msg)
    assert out == msg
    # enums come back as enum members, tuples as tuples, bytes as bytes
    assert codec.encode(out) == data


def test_after_prepare_no_message_evaluates_type_hints(monkeypatch):
    """``prepare()`` (a rank calls it as it is built) makes every kind's
    plan: afterwards no encode or decode evaluates a class's type hints,
    which costs the first message of a kind up to a millisecond on whichever
    thread sends it (a background round's hold of the interpreter lock)."""
    for cache in (codec._plan, codec._fields, codec._args, codec._origin):
        cache.cache_clear()  # as in a fresh process
    assert codec.prepare() >= len(codec.known_kinds())

    def evaluated(*a, **kw):
        raise AssertionError("type hints evaluated after prepare()")

    monkeypatch.setattr(codec.typing, "get_type_hints", evaluated)
    for msg in SAMPLES:
        assert codec.decode(codec.encode(msg)) == msg


def test_decoded_nested_types():
    msg = tm.PeerHello(rank=_rank(), allow_missing_draft=False)
    out = codec.decode(codec.encode(msg))
    pool = out.rank.pools[0]
    assert isinstance(out.rank.pools, tuple)
    assert pool.role is bm.PoolRole.TARGET and pool.attention is bm.AttentionKind.MHA
    assert isinstance(pool.buffers[0], bm.BufferRef)
    assert pool.buffers[0].component in (bm.Component.K, bm.Component.V)
    assert out.rank.aux == (make_aux(),)  # a tuple of regions since protocol 4
    req = codec.decode(codec.encode(TRANSFER_REQUEST))
    assert isinstance(req.dst_pages, bytes)
    assert pystruct.unpack("<5i", req.dst_pages)[-1] == 2**31 - 1
    assert req.assignments[1].role is bm.PoolRole.DRAFT


def test_wire_format_is_a_versioned_map():
    env = msgpack.unpackb(codec.encode(bm.Lookup(node_id="n", dp_rank=2)), raw=False)
    assert env == {"v": codec.PROTOCOL_VERSION, "kind": "lookup", "body": {"node_id": "n", "dp_rank": 2}}


def test_protocol_error_is_a_kvferry_value_error():
    with pytest.raises(ProtocolError) as ei:
        codec.decode(b"\xc1")
    assert isinstance(ei.value, KVFerryError) and isinstance(ei.value, ValueError)


# --- rejections -----------------------------------------------------------------


def _envelope(msg) -> dict:
    return msgpack.unpackb(codec.encode(msg), raw=False)


def _pack(env) -> bytes:
    return msgpack.packb(env, use_bin_type=True)


def _reject(data) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        codec.decode(data)
    return ei.value


def test_not_msgpack():
    err = _reject(b"\xc1\xc1\xc1")  # 0xc1 is never used in msgpack
    assert "not a msgpack message" in str(err)
    err = _reject(b"\x92\x01")  # truncated array
    assert "msgpack" in str(err)


def test_trailing_garbage_rejected():
    err = _reject(codec.encode(bm.Ping()) + b"\x00")
    assert "msgpack" in str(err)


@pytest.mark.parametrize("obj", [[1, "ping", {}], 1, "ping", None, b"ping"])
def test_envelope_not_a_map(obj):
    err = _reject(_pack(obj))
    assert "envelope must be a map" in str(err)
    assert type(obj).__name__ in str(err)


def test_not_bytes():
    err = _reject("a string")  # type: ignore[arg-type]
    assert "expected bytes" in str(err)


def test_wrong_version_names_both_versions():
    env = _envelope(bm.Ping())
    env["v"] = codec.PROTOCOL_VERSION + 41
    err = _reject(_pack(env))
    assert str(codec.PROTOCOL_VERSION + 41) in str(err)
    assert str(codec.PROTOCOL_VERSION) in str(err)
    assert "version" in str(err)
    assert err.field == "v"


def test_a_version_7_chunk_staged_is_refused_by_version_and_the_old_kind_is_gone():
    """Version 8 split ``chunk_staged`` (a state part or a layer share told
    by placeholder fields) into one kind per part kind: a version-7 peer's
    landing names both versions, and the old kind is unknown here."""
    body = {"room": 1, "request_id": 2, "prefill_tp_rank": 0, "part": 0, "offset": 0, "nbytes": 64,
            "page_start": 0, "num_pages": 1, "state": 0}
    err = _reject(_pack({"v": 7, "kind": "chunk_staged", "body": body}))
    assert "protocol version 7" in str(err) and f"speaks {codec.PROTOCOL_VERSION}" in str(err)
    err = _reject(_pack({"v": codec.PROTOCOL_VERSION, "kind": "chunk_staged", "body": body}))
    assert "unknown message kind 'chunk_staged'" in str(err)
    assert {"pages_staged", "share_staged", "state_staged"} <= set(codec.known_kinds())
    share = {k: v for k, v in body.items() if k != "state"} | {"layers": []}
    err = _reject(_pack({"v": codec.PROTOCOL_VERSION, "kind": "share_staged", "body": share}))
    assert "a layer share names its layers" in str(err)
    state = {k: v for k, v in body.items() if k not in ("state", "page_start")}
    err = _reject(_pack({"v": codec.PROTOCOL_VERSION, "kind": "state_staged", "body": state}))
    assert "unexpected field 'num_pages'" in str(err)


@pytest.mark.parametrize("v", [True, 1.0])
def test_version_must_be_an_int(v):
    env = _envelope(bm.Ping())
    env["v"] = v
    _reject(_pack(env))


def test_missing_version():
    env = _envelope(bm.Ping())
    del env["v"]
    err = _reject(_pack(env))
    assert "None" in str(err) and err.field == "v"


def test_unknown_kind():
    err = _reject(_pack({"v": codec.PROTOCOL_VERSION, "kind": "teleport", "body": {}}))
    assert "unknown message kind 'teleport'" in str(err)
    assert err.field == "kind"


def test_kind_not_a_string():
    err = _reject(_pack({"v": codec.PROTOCOL_VERSION, "kind": 7, "body": {}}))
    assert "kind" in str(err) and err.field == "kind"


def test_extra_envelope_key():
    env = _envelope(bm.Ping())
    env["trace"] = "x"
    err = _reject(_pack(env))
    assert "trace" in str(err)


def test_body_not_a_map():
    env = _envelope(bm.Ping())
    env["body"] = [1]
    err = _reject(_pack(env))
    assert "expected a map" in str(err) and "list" in str(err)


def test_missing_field():
    env = _envelope(bm.Registered(node_id="n", dp_rank=0, num_registered=1, tp_size=2))
    del env["body"]["tp_size"]
    err = _reject(_pack(env))
    assert "missing field 'tp_size'" in str(err)
    assert err.field == "registered.tp_size"


def test_missing_nested_field():
    env = _envelope(bm.Register(rank=_rank()))
    del env["body"]["rank"]["pools"][1]["buffers"][0]["nbytes"]
    err = _reject(_pack(env))
    assert "missing field 'nbytes'" in str(err)
    assert err.field == "register.rank.pools[1].buffers[0].nbytes"


def test_extra_field():
    env = _envelope(bm.Lookup(node_id="n", dp_rank=0))
    env["body"]["priority"] = 3
    err = _reject(_pack(env))
    assert "unexpected field 'priority'" in str(err)
    assert err.field == "lookup.priority"


def test_extra_nested_field():
    env = _envelope(bm.Register(rank=_rank()))
    env["body"]["rank"]["aux"][0]["stride"] = 64
    err = _reject(_pack(env))
    assert "unexpected field 'stride'" in str(err)
    assert err.field == "register.rank.aux[0].stride"


@pytest.mark.parametrize(
    "msg, field, bad, expected, got",
    [
        (bm.Lookup(node_id="n", dp_rank=0), "dp_rank", "0", "int", "str"),  # str where int
        (bm.Lookup(node_id="n", dp_rank=0), "dp_rank", True, "int", "bool"),  # bool where int
        (bm.Lookup(node_id="n", dp_rank=0), "dp_rank", 1.0, "int", "float"),  # float where int
        (bm.Lookup(node_id="n", dp_rank=0), "node_id", 5, "str", "int"),  # int where str
        (bm.Lookup(node_id="n", dp_rank=0), "node_id", None, "str", "NoneType"),  # null where str
        (tm.PeerHello(rank=make_rank(), allow_missing_draft=False), "allow_missing_draft", 1, "bool", "int"),
        (tm.PeerHelloReply(session="s", ok=True, field="", reason=""), "ok", "true", "bool", "str"),
        (tm.TransferRequest(room=1, request_id=1, decode_session="s", decode_endpoint="e", decode_tp_rank=0,
                            dst_pages=b"\0\0\0\0", dst_aux_index=0, assignments=(), num_requests=1),
         "dst_pages", "\0\0\0\0", "bytes", "str"),
    ],
)
def test_mistyped_scalar(msg, field, bad, expected, got):
    env = _envelope(msg)
    env["body"][field] = bad
    err = _reject(_pack(env))
    assert f"expected {expected}, got {got}" in str(err)
    assert err.field == f"{msg.KIND}.{field}"


def test_list_where_map():
    env = _envelope(bm.Register(rank=_rank()))
    env["body"]["rank"] = list(env["body"]["rank"].values())
    err = _reject(_pack(env))
    assert "expected a map, got list" in str(err)
    assert err.field == "register.rank"


def test_map_where_array():
    env = _envelope(bm.Register(rank=_rank()))
    env["body"]["rank"]["pools"] = env["body"]["rank"]["pools"][0]
    err = _reject(_pack(env))
    assert "expected an array, got dict" in str(err)
    assert err.field == "register.rank.pools"


def test_nested_struct_field_mistyped():
    env = _envelope(bm.Register(rank=_rank()))
    buf = env["body"]["rank"]["pools"][0]["buffers"][2]
    buf["addr"] = hex(buf["addr"])
    err = _reject(_pack(env))
    assert "expected int, got str" in str(err)
    assert err.field == "register.rank.pools[0].buffers[2].addr"
    assert err.field in str(err)


def test_null_for_optional_struct_is_accepted_and_null_for_required_rejected():
    env = _envelope(bm.Register(rank=_rank()))
    env["body"]["rank"]["staging"] = None
    out = codec.decode(_pack(env))
    assert out.rank.staging is None
    env["body"]["rank"]["aux"] = None  # the aux regions are a tuple (empty: none), never null
    err = _reject(_pack(env))
    assert err.field == "register.rank.aux"
    env["body"]["rank"]["aux"] = []
    assert codec.decode(_pack(env)).rank.aux == ()
    env["body"]["rank"]["pools"][0] = None
    err = _reject(_pack(env))
    assert err.field == "register.rank.pools[0]"


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda b: b["rank"].update(tp_rank=4), "register.rank", ["tp_rank 4", "[0, 4)"]),
        (lambda b: b["rank"].update(dp_rank=-1), "register.rank", ["dp_rank -1"]),
        (lambda b: b["rank"].update(node_id=""), "register.rank", ["node_id"]),
        (lambda b: b["rank"]["pools"][0]["buffers"][0].update(addr=0), "register.rank.pools[0].buffers[0]",
         ["addr"]),
        (lambda b: b["rank"]["pools"][0]["buffers"][0].update(addr=(1 << 64) - 1, nbytes=-5),
         "register.rank.pools[0].buffers[0]", ["nbytes"]),
        (lambda b: b["rank"]["pools"][0].update(num_pages=10**9), "register.rank.pools[0]", ["less than"]),
        (lambda b: b["rank"]["pools"][0]["buffers"].pop(), "register.rank.pools[0]", ["buffers"]),
        (lambda b: b["rank"]["pools"].pop(0), "register.rank", ["target pool"]),
        (lambda b: b["rank"]["pools"].append(copy.deepcopy(b["rank"]["pools"][0])), "register.rank",
         ["one pool per role"]),
        (lambda b: b["rank"]["aux"][0].update(num_slots=0), "register.rank.aux[0]", ["num_slots"]),
    ],
)
def test_value_rejected_by_post_init(mutate, field, words):
    env = _envelope(bm.Register(rank=_rank()))
    mutate(env["body"])
    err = _reject(_pack(env))
    assert err.field == field
    for w in words:
        assert w in str(err)


def test_post_init_of_message_itself():
    env = _envelope(TRANSFER_REQUEST)
    env["body"]["dst_pages"] = b"\x01\x02\x03"
    err = _reject(_pack(env))
    assert "little-endian int32" in str(err) and err.field == "transfer_request"
    env["body"]["dst_pages"] = b""
    env["body"]["num_requests"] = 0
    err = _reject(_pack(env))
    assert "num_requests" in str(err)


def test_oversize_message():
    limit = codec.MAX_MESSAGE_BYTES
    err = _reject(b"\x00" * (limit + 1))
    assert str(limit + 1) in str(err) and str(limit) in str(err)


def test_oversize_well_formed_message():
    big = tm.TransferRequest(room=1, request_id=1, decode_session="s", decode_endpoint="e", decode_tp_rank=0,
                             dst_pages=b"\0" * (codec.MAX_MESSAGE_BYTES + 4), dst_aux_index=0, assignments=(),
                             num_requests=1)
    err = _reject(codec.encode(big))
    assert "exceeds the limit" in str(err)


def test_message_at_the_limit_is_not_rejected_for_size():
    # A well-formed message just under the limit decodes.
    overhead = len(codec.encode(tm.TransferRequest(
        room=1, request_id=1, decode_session="s", decode_endpoint="e", decode_tp_rank=0, dst_pages=b"",
        dst_aux_index=0, assignments=(), num_requests=1)))
    n = (codec.MAX_MESSAGE_BYTES - overhead - 8) // 4 * 4
    msg = tm.TransferRequest(room=1, request_id=1, decode_session="s", decode_endpoint="e", decode_tp_rank=0,
                             dst_pages=b"\1" * n, dst_aux_index=0, assignments=(), num_requests=1)
    data = codec.encode(msg)
    assert len(data) <= codec.MAX_MESSAGE_BYTES
    assert codec.decode(data) == msg


@pytest.mark.parametrize(
    "msg, path, bad, field, allowed",
    [
        (ROOM_STATUS, ("status",), "done", "room_status.status", "'success', 'failed'"),
        (ROOM_STATUS, ("sent", 1), "main", "room_status.sent[1]", "'target', 'draft'"),
        (REGISTER, ("rank", "pools", 0, "attention"), "gqa", "register.rank.pools[0].attention", "'mha', 'mla'"),
        (REGISTER, ("rank", "pools", 0, "buffers", 1, "component"), "q", "register.rank.pools[0].buffers[1].component",
         "'k', 'v', 'latent'"),
        (ROOM_STATUS, ("status",), 1, "room_status.status", "'success'"),
    ],
)
def test_invalid_enum_value(msg, path, bad, field, allowed):
    env = _envelope(msg)
    node = env["body"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    err = _reject(_pack(env))
    assert repr(bad) in str(err)
    assert allowed in str(err)
    assert err.field == field


# --- encode-side checks -----------------------------------------------------------


def test_encode_rejects_unregistered_type():
    with pytest.raises(ProtocolError, match="not a registered message"):
        codec.encode(make_aux())  # a struct, not a message
    with pytest.raises(ProtocolError, match="not a registered message"):
        codec.encode({"kind": "ping"})


def test_encode_rejects_mistyped_field():
    with pytest.raises(ProtocolError) as ei:
        codec.encode(bm.Registered(node_id="n", dp_rank="0", num_registered=1, tp_size=1))  # type: ignore[arg-type]
    assert ei.value.field == "registered.dp_rank"
    with pytest.raises(ProtocolError) as ei:
        codec.encode(bm.Pong(num_nodes=True, num_errors=0))
    assert "expected int, got bool" in str(ei.value)
    with pytest.raises(ProtocolError):
        codec.encode(tm.RoomStatus(room=1, request_id=1, prefill_tp_rank=0, status="success",  # type: ignore
                                   sent=(), reason=""))
    with pytest.raises(ProtocolError):
        codec.encode(tm.RoomStatus(room=1, request_id=1, prefill_tp_rank=0, status=tm.Status.SUCCESS,
                                   sent=[bm.PoolRole.TARGET], reason=""))  # type: ignore[arg-type]


# --- fuzzing ----------------------------------------------------------------------

_leaf = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
         | st.text(max_size=12) | st.binary(max_size=12)
         | st.sampled_from(["target", "draft", "mha", "mla", "k", "v", "latent", "success", "failed"]))
_value = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _decode_is_safe(data: bytes) -> None:
    try:
        out = codec.decode(data)
    except ProtocolError:
        return
    assert type(out).KIND in codec.known_kinds()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(data):
    _decode_is_safe(data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(codec.known_kinds()), st.dictionaries(st.text(max_size=20), _value, max_size=6))
def test_fuzz_random_bodies(kind, body):
    _decode_is_safe(_pack({"v": codec.PROTOCOL_VERSION, "kind": kind, "body": body}))


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(SAMPLES))), st.data(), _value)
def test_fuzz_mutated_valid_messages(idx, data, replacement):
    env = _envelope(SAMPLES[idx])
    paths = [p for p in _paths(env["body"]) if p]
    if paths:
        path = data.draw(st.sampled_from(paths))
        node = env["body"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = replacement
    _decode_is_safe(_pack(env))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(range(len(SAMPLES))), st.data())
def test_fuzz_truncated_and_flipped(idx, data):
    raw = bytearray(codec.encode(SAMPLES[idx]))
    cut = data.draw(st.integers(0, len(raw)))
    _decode_is_safe(bytes(raw[:cut]))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    _decode_is_safe(bytes(raw))


# --- authentication ---------------------------------------------------------------

KEY = codec.secret_key("s3cret")


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).KIND)
def test_sealed_round_trip(msg):
    frame = codec.encode(msg, KEY)
    assert frame.startswith(codec.MAGIC)
    assert codec.decode(frame, KEY) == msg


def test_unsealed_frame_refused_when_a_secret_is_set():
    with pytest.raises(AuthError, match="unauthenticated"):
        codec.decode(codec.encode(REGISTER), KEY)


def test_sealed_frame_refused_without_a_secret():
    with pytest.raises(AuthError, match="no shared secret"):
        codec.decode(codec.encode(REGISTER, KEY))


def test_wrong_secret_refused():
    with pytest.raises(AuthError, match="authentication failed"):
        codec.decode(codec.encode(REGISTER, codec.secret_key("other")), KEY)


@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_any_altered_byte_is_refused(position, value):
    frame = bytearray(codec.encode(TRANSFER_REQUEST, KEY))
    i = position % len(frame)
    if frame[i] == value:
        value ^= 1
    frame[i] = value
    with pytest.raises(ProtocolError):  # AuthError, or a broken magic/length
        codec.decode(bytes(frame), KEY)


def test_stale_frame_refused(monkeypatch):
    frame = codec.encode(REGISTER, KEY)
    real = codec.time.time
    monkeypatch.setattr(codec.time, "time", lambda: real() + codec.MAX_CLOCK_SKEW_S + 5)
    with pytest.raises(AuthError, match="off this host's clock"):
        codec.decode(frame, KEY)


def test_empty_secret_means_off():
    assert codec.secret_key("") is None and codec.secret_key(None) is None
    assert codec.secret_key("a") != codec.secret_key("b")


def test_a_paced_decode_calls_pace_before_each_struct_and_decodes_the_same():
    """A lookup reply of several ranks, decoded with ``pace``: pace runs
    before every nested struct (a background thread gives the interpreter
    lock up there), the message equals the unpaced decode, and the next
    decode on the thread is not paced."""
    ranks = tuple(make_rank(tp_rank=i, tp_size=4) for i in range(4))
    data = codec.encode(bm.LookupReply(node_id="prefill-0", dp_rank=0, ready=True, dp_size=1, tp_size=4,
                                       num_registered=4, ranks=ranks))
    calls = []
    paced = codec.decode(data, pace=lambda: calls.append(1))
    assert paced == codec.decode(data)
    structs = 1 + len(ranks) * (1 + len(ranks[0].pools) + len(ranks[0].aux))  # at least: reply, ranks, pools, aux
    assert len(calls) >= structs, (len(calls), structs)
    before = len(calls)
    codec.decode(data)
    assert len(calls) == before


def test_a_pace_that_raises_ends_the_decode_and_the_next_is_not_paced():
    data = codec.encode(bm.LookupReply(node_id="prefill-0", dp_rank=0, ready=True, dp_size=1, tp_size=1,
                                       num_registered=1, ranks=(make_rank(),)))

    def stop():
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        codec.decode(data, pace=stop)
    assert codec.decode(data).ranks[0] == make_rank()
