"""kvferry transfer: the Python API for prefill/decode schedulers.

One :class:`KVManager` per rank and role; one :class:`KVSender` (prefill) or
:class:`KVReceiver` (decode) per request, driven by ``poll()``, which returns
a :class:`KVPoll`. See the README for a scheduler-side example.

Names are imported lazily, so that importing a pure module
(``transfer.plan``, ``transfer.tp``, ...) pulls in neither zmq nor Mooncake.
"""

from bootstrap.lazy import lazy_exports

_EXPORTS = {
    "PoolRole": "bootstrap.messages",
    "EngineConfig": "transfer.config", "ManagerConfig": "transfer.config", "Role": "transfer.config",
    "manager_config_from_env": "transfer.config",
    **{name: "transfer.errors" for name in (
        "AuthError", "BootstrapError", "BootstrapRefused", "BootstrapUnavailable", "ClosedError", "HandshakeError",
        "IncompatibleLayoutError", "IncompatibleTransportError", "InsecureBindError", "KVFerryError", "KVTimeoutError",
        "MemoryReleasedError", "PageIndexError", "PeerError",
        "ProtocolError", "RequestError", "StateError", "StorageClosedError", "StorageError", "StorageMissError",
        "StorageTimeoutError", "StorageUnavailableError", "TransferError", "UnknownNodeError")},
    "KVManager": "transfer.manager",
    "MHAPool": "transfer.pools", "MLAPool": "transfer.pools",
    "KVReceiver": "transfer.rooms.receiver",
    "KVSender": "transfer.rooms.sender",
    "KVPoll": "transfer.state",
    "StatePool": "transfer.state_pools", "StateSharding": "bootstrap.messages",
    "FailureReason": "transfer.stats", "ManagerStats": "transfer.stats", "RoomStats": "transfer.stats",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
