"""The one codec of kvferry's control plane: typed, versioned msgpack messages.

Every message is a frozen dataclass registered with :func:`message` under a
``kind`` tag. On the wire it is a msgpack map::

    {"v": PROTOCOL_VERSION, "kind": "<tag>", "body": {<field>: <value>, ...}}

Nested values are frozen dataclasses registered with :func:`struct` (sent as
maps), ``tuple[T, ...]`` (arrays), ``X | None``, ``str``-valued Enums, and the
scalars ``int``, ``float``, ``bool``, ``str`` and ``bytes``. Decoding checks
every field against its annotation: an unknown kind, another version, a missing,
extra or mistyped field, or a value the dataclass rejects in ``__post_init__``
raises :class:`~bootstrap.errors.ProtocolError` naming the problem. Nothing
indexes frames by position.

Authentication: with a shared secret, :func:`encode` seals the msgpack bytes
in a frame ``MAGIC | timestamp (8 bytes, ms) | HMAC-SHA256 tag (32 bytes) |
payload``, the tag covering everything before and after it, and
:func:`decode` refuses any frame whose tag does not verify, that is not
sealed, or whose timestamp is more than ``MAX_CLOCK_SKEW_S`` away from this
host's clock (a replayed frame is accepted only within that window). Without
a secret, frames are the bare msgpack bytes and a sealed frame is refused.

Version rules: ``PROTOCOL_VERSION`` is bumped whenever a field is added,
removed, renamed or changes meaning, in any message. Peers with different
versions refuse each other's messages, with an error that names both versions.
One exception: a field added with a default that keeps the old meaning and
the metadata ``omit_default`` (``bootstrap.descriptors.OMIT_DEFAULT``) is
left out of the encoding while it holds that default, so a peer that
predates it decodes every message that does not use it, and refuses one
that does (``unexpected field``, naming it) instead of misreading it.
``RankInfo.transport`` and ``PeerHello.transport_meta`` were added this way
(in version 4), and ``Lookup.partial`` with ``LookupReply.departed`` (in 5).
Version 5: ``PeerPong.acks`` (a pong now acknowledges the requests taken
since the last one; a version-4 peer would seem to lose every request); the
status reply's rank and pool views carry every descriptor field but the
withheld ones (:mod:`bootstrap.status`). Version 6: ``RoomStatus.exposed_s``
(prefill's last ``send()`` to its success, for decode's exposed transfer time);
then, omitted while unused, ``RankInfo.states``, ``TransferRequest.dst_states`` and
``ChunkStaged.state`` (per-request state pools), and ``ChunkStaged.layers``
(a layer group's share of a staged part). Version 7: a Mooncake rank's
``PeerHello.transport_meta`` carries its metadata mode, relayed segment and
probe region, and a prefill rank answers a hello only once its transport
opened the way to the decode rank (``PeerHelloReply.field`` ``handshake``
when it could not): a version-6 prefill rank would ignore the relayed
segment and never reach a relaying decode rank. Version 8: a staged
part's landing is one message kind per part kind (``pages_staged``,
``share_staged``, ``state_staged``, each with only its own fields) where
``chunk_staged`` told a state part or a layer share by placeholder fields.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import hmac
import threading
import time
import types
import typing
from typing import Any, TypeVar
from collections.abc import Callable

import msgpack

from bootstrap.errors import AuthError, ProtocolError

PROTOCOL_VERSION = 8

#: Largest encoded message accepted, in bytes. Control messages carry page
#: lists and buffer descriptors, never KV bytes.
MAX_MESSAGE_BYTES = 8 << 20

#: Sealed frames start with this (a msgpack map never does).
MAGIC = b"KVFa"
_TAG = 32
_SEALED_HEAD = len(MAGIC) + 8 + _TAG
#: How far a sealed frame's timestamp may be from this host's clock.
MAX_CLOCK_SKEW_S = 60.0

_MESSAGES: dict[str, type] = {}
_STRUCTS: set[type] = set()

T = TypeVar("T")


def message(kind: str) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a top-level message with tag ``kind``."""

    def register(cls: type[T]) -> type[T]:
        _require_frozen(cls)
        if kind in _MESSAGES and _MESSAGES[kind] is not cls:
            raise ValueError(f"message kind {kind!r} registered twice")
        _MESSAGES[kind] = cls
        cls.KIND = kind  # type: ignore[attr-defined]
        return cls

    return register


def struct(cls: type[T]) -> type[T]:
    """Register a frozen dataclass that may be nested inside messages."""
    _require_frozen(cls)
    _STRUCTS.add(cls)
    return cls


def prepare() -> int:
    """Make every registered class's field plan now; returns how many
    classes. A plan is otherwise made by the first encode or decode of its
    kind (the class's type hints evaluated: 0.1-1 ms each, milliseconds for
    a process's first messages), on whichever thread that is: a rank's
    background rounds included, where it holds the interpreter lock that
    long. A rank calls it once, as it is built."""
    classes = [*_MESSAGES.values(), *_STRUCTS]
    for cls in classes:
        for _, tp, *_ in _plan(cls):
            _args(tp), _origin(tp)
        _fields(cls)
    return len(classes)


def secret_key(secret: str | bytes | None) -> bytes | None:
    """The HMAC key for a configured shared secret (None or empty: off)."""
    if not secret:
        return None
    return hashlib.sha256(b"kvferry-control-v1:" + (secret.encode() if isinstance(secret, str) else secret)).digest()


def _tag(key: bytes, head: bytes, payload: bytes) -> bytes:
    return hmac.new(key, head + payload, hashlib.sha256).digest()


def encode(msg: Any, key: bytes | None = None) -> bytes:
    """Encode a registered message to bytes, sealed with ``key`` (see
    :func:`secret_key`) when given. Raises ``ProtocolError`` for an
    unregistered type or a field value of the wrong type."""
    return seal(pack(msg), key)


def pack(msg: Any) -> bytes:
    """A registered message's encoding, unsealed: what :func:`seal` frames
    (a sender that sends one message often packs it once)."""
    kind = getattr(type(msg), "KIND", None)
    if kind is None or _MESSAGES.get(kind) is not type(msg):
        raise ProtocolError(f"{type(msg).__name__} is not a registered message")
    body = _dump_struct(msg, kind)
    return msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, "body": body}, use_bin_type=True)


def seal(payload: bytes, key: bytes | None) -> bytes:
    """The frame for an encoded (unsealed) message: sealed now with ``key``,
    or the payload itself without one. Lets a sender encode a message once
    and seal it afresh for each send (the timestamp is per frame)."""
    if key is None:
        return payload
    head = MAGIC + int(time.time() * 1000).to_bytes(8, "big")
    return head + _tag(key, head, payload) + payload


def unseal(data: bytes, key: bytes | None) -> bytes:
    """The payload of a frame; raises :class:`AuthError` unless the frame's
    sealing matches ``key`` (sealed and verified with a key, bare without)."""
    sealed = bytes(data[:len(MAGIC)]) == MAGIC
    if key is None:
        if sealed:
            raise AuthError("the message is authenticated but this endpoint has no shared secret configured")
        return data
    if not sealed or len(data) < _SEALED_HEAD:
        raise AuthError("unauthenticated message refused (a shared secret is configured)")
    head, tag = bytes(data[:len(MAGIC) + 8]), bytes(data[len(MAGIC) + 8:_SEALED_HEAD])
    payload = bytes(data[_SEALED_HEAD:])
    if not hmac.compare_digest(tag, _tag(key, head, payload)):
        raise AuthError("message authentication failed (wrong shared secret or altered message)")
    skew = abs(time.time() - int.from_bytes(head[len(MAGIC):], "big") / 1000)
    if skew > MAX_CLOCK_SKEW_S:
        raise AuthError(f"authenticated message is {skew:.0f} s off this host's clock (replayed or clock skew; "
                        f"the limit is {MAX_CLOCK_SKEW_S:g} s)")
    return payload


def decode(data: bytes, key: bytes | None = None, *, pace: Callable[[], None] | None = None) -> Any:
    """Decode bytes to a message instance, checking the sealing (see
    :func:`unseal`), version, kind and fields. ``pace()``, when given, is
    called before each nested struct is built: a caller on a background
    thread gives the interpreter lock up there (a lookup reply holds every
    rank's descriptors, milliseconds of Python in one message)."""
    if pace is None:
        return _decode(data, key)
    _pacer.fn = pace
    try:
        return _decode(data, key)
    finally:
        _pacer.fn = None


#: the ``pace`` of the :func:`decode` running on this thread, if any
_pacer = threading.local()


def _decode(data: bytes, key: bytes | None) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    data = unseal(data, key)
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"not a msgpack message: {exc}") from exc
    if not isinstance(envelope, dict):
        raise ProtocolError(f"envelope must be a map, got {type(envelope).__name__}")
    extra = set(envelope) - {"v", "kind", "body"}
    if extra:
        raise ProtocolError(f"unexpected envelope keys {sorted(map(str, extra))}")
    version = envelope.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})",
            field="v",
        )
    kind = envelope.get("kind")
    if not isinstance(kind, str):
        raise ProtocolError("envelope has no string 'kind'", field="kind")
    cls = _MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}", field="kind")
    return _load_struct(cls, envelope.get("body"), kind)


def known_kinds() -> list[str]:
    return sorted(_MESSAGES)


# --- field checking ---------------------------------------------------------------


def _require_frozen(cls: type) -> None:
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


@functools.cache
def _origin(tp: Any) -> Any:
    return typing.get_origin(tp)


@functools.cache
def _args(tp: Any) -> tuple:
    return typing.get_args(tp)


@functools.cache
def _plan(cls: type) -> tuple[tuple[str, Any, bool, Any, bool], ...]:
    """Per field of a message class: (name, type, omitted when default,
    default, optional): computed once, so coding a message walks a tuple."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], bool(f.metadata.get("omit_default")), f.default,
                  f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


def _dump_struct(obj: Any, path: str) -> dict[str, Any]:
    out = {}
    for name, tp, omit, default, _ in _plan(type(obj)):
        value = getattr(obj, name)
        if omit and value == default:
            continue
        # the common case inline: a scalar of exactly its type (bool is not an int here)
        out[name] = value if type(value) is tp and tp in _SCALARS else _dump(value, tp, f"{path}.{name}")
    return out


def _dump(value: Any, tp: Any, path: str) -> Any:
    if type(value) is tp and tp in _SCALARS:  # the common case, checked below otherwise
        return value
    _check(value, tp, path, decoding=False)
    if value is None:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return _dump_struct(value, path)
    if isinstance(value, tuple):
        (item_tp,) = _tuple_item(tp)
        if item_tp in _SCALARS and all(type(v) is item_tp for v in value):
            return list(value)
        return [_dump(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def _load_struct(cls: type, body: Any, path: str) -> Any:
    pace = getattr(_pacer, "fn", None)
    if pace is not None:
        pace()
    if not isinstance(body, dict):
        raise ProtocolError(f"{path}: expected a map, got {type(body).__name__}", field=path)
    plan = _plan(cls)
    if len(body) > len(plan) or not body.keys() <= _fields(cls).keys():
        name = sorted(map(str, body.keys() - _fields(cls).keys()))[0]
        raise ProtocolError(f"{path}: unexpected field {name!r}", field=f"{path}.{name}")
    kwargs = {}
    for name, tp, _, _, optional in plan:
        if name not in body:
            if optional:
                continue
            raise ProtocolError(f"{path}: missing field {name!r}", field=f"{path}.{name}")
        value = body[name]
        kwargs[name] = value if type(value) is tp and tp in _SCALARS else _load(value, tp, f"{path}.{name}")
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"{path}: {exc}", field=path) from exc


def _load(value: Any, tp: Any, path: str) -> Any:
    if type(value) is tp and tp in _SCALARS:  # the common case, checked below otherwise
        return value
    origin = _origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = _args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ProtocolError(f"{path}: must not be null", field=path)
        (inner,) = [a for a in args if a is not type(None)]
        return _load(value, inner, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise ProtocolError(f"{path}: expected an array, got {type(value).__name__}", field=path)
        (item_tp,) = _tuple_item(tp)
        if item_tp in _SCALARS and all(type(v) is item_tp for v in value):
            return tuple(value)
        return tuple(_load(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ProtocolError(f"{path}: {value!r} is not one of {allowed}", field=path) from None
    if tp in _STRUCTS:
        return _load_struct(tp, value, path)
    _check(value, tp, path, decoding=True)
    return value


def _tuple_item(tp: Any) -> tuple[Any]:
    args = _args(tp)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"only tuple[T, ...] is supported, not {tp}")
    return (args[0],)


_SCALARS = {int, float, str, bytes, bool}


def _check(value: Any, tp: Any, path: str, *, decoding: bool) -> None:
    origin = _origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = _args(tp)
        if value is None and type(None) in args:
            return
        (inner,) = [a for a in args if a is not type(None)]
        _check(value, inner, path, decoding=decoding)
        return
    if origin is tuple:
        if not isinstance(value, tuple):
            raise ProtocolError(f"{path}: expected a tuple, got {type(value).__name__}", field=path)
        return
    if tp in _SCALARS:
        ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if tp is bytes and isinstance(value, (bytearray, memoryview)):
            ok = True
        if not ok:
            raise ProtocolError(
                f"{path}: expected {tp.__name__}, got {type(value).__name__}", field=path
            )
        return
    if isinstance(tp, type) and (issubclass(tp, enum.Enum) or tp in _STRUCTS):
        if not isinstance(value, tp):
            raise ProtocolError(f"{path}: expected {tp.__name__}, got {type(value).__name__}", field=path)
        return
    raise TypeError(f"{path}: unsupported field type {tp}")
