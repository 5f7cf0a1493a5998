"""Errors of the transfer layer; the root and the rest of the tree are in
:mod:`bootstrap.errors`, whose docstring draws the whole tree."""

from __future__ import annotations

from bootstrap.errors import (  # re-exported: one tree for the whole package
    AuthError,
    BootstrapError,
    BootstrapRefused,
    BootstrapUnavailable,
    InsecureBindError,
    KVFerryError,
    KVTimeoutError,
    ProtocolError,
    UnknownNodeError,
)


class IncompatibleLayoutError(KVFerryError):
    """Prefill and decode disagree on a field that must match.

    ``field`` names it (``target.page_size``, ``draft.dtype``, ``tp_size``...);
    ``local`` and ``remote`` are the two values.
    """

    def __init__(self, field: str, local, remote, *, detail: str = "") -> None:
        msg = f"incompatible {field}: local {local!r}, remote {remote!r}"
        super().__init__(f"{msg} ({detail})" if detail else msg)
        self.field, self.local, self.remote = field, local, remote


class IncompatibleTransportError(IncompatibleLayoutError):
    """Prefill and decode use different transfer engines (``field`` is
    ``transport``; ``local`` and ``remote`` name the engines)."""


class TransferError(KVFerryError):
    """The transfer engine failed to move bytes (``peer`` and ``code`` say where)."""

    def __init__(self, message: str, *, peer: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.peer, self.code = peer, code


class HandshakeError(TransferError):
    """The way to a peer could not be opened before any of its rooms' bytes
    moved (the transfer engine's handshake with it failed or ran past
    ``EngineConfig.handshake_timeout_s``): ``peer`` names it, the message
    says what the engine was doing. The rooms through that peer fail with
    it; the next room tries the handshake afresh."""


class PeerError(KVFerryError):
    """The other side reported a failure of the room, or aborted it."""


class StateError(KVFerryError):
    """An API call that the room's current state does not allow."""


class ClosedError(KVFerryError):
    """The manager was closed; its rooms fail with this."""


class MemoryReleasedError(ClosedError):
    """The scheduler released the KV memory (``KVManager.release_memory``):
    the rooms live then fail with this, and no room starts until
    ``resume_memory()``."""


class RequestError(KVFerryError, ValueError):
    """A room's pages do not fit what was declared: more pages sent than
    ``init()`` said, page counts that differ between prefill and decode, a
    prompt that does not match the pages (also a ``ValueError``)."""


class PageIndexError(RequestError, IndexError):
    """A page id outside the pool (also an ``IndexError``)."""


# Storage tier (transfer.storage). A per-key miss is a result (False), never an
# exception; these are failures of a backend as a whole.


class StorageError(KVFerryError):
    """A storage backend failed as a whole, not one key (``backend`` names it,
    ``code`` is the foreign return code when there is one)."""

    def __init__(self, message: str, *, backend: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.backend, self.code = backend, code


class StorageUnavailableError(StorageError):
    """The backend cannot be reached (its Mooncake master is down, an earlier
    call is still stuck); retrying later, or another backend, may work."""


class StorageTimeoutError(StorageUnavailableError, KVTimeoutError):
    """A backend call ran past its time bound (also a ``KVTimeoutError``)."""


class StorageClosedError(StorageError):
    """The backend was called after ``close()``."""


class StorageMissError(StorageError):
    """A failed room could not be restored from storage: the message names
    the first failure and the missing page ranges."""


__all__ = [
    "AuthError", "BootstrapError", "BootstrapRefused", "BootstrapUnavailable", "ClosedError",
    "HandshakeError", "IncompatibleLayoutError", "IncompatibleTransportError", "InsecureBindError", "KVFerryError", "KVTimeoutError", "PageIndexError", "PeerError",
    "ProtocolError", "RequestError", "StateError", "StorageClosedError", "StorageError", "StorageMissError",
    "StorageTimeoutError", "StorageUnavailableError", "TransferError", "UnknownNodeError",
]
