"""The root of kvferry's exception tree, and the errors of the bootstrap layer.

`bootstrap` imports nothing from `transfer`, so the root lives here and
`transfer.errors` extends it. The whole tree::

    KVFerryError                     root: catch this to catch everything of ours
    ├── ProtocolError                a message that is not one of ours: not msgpack, too
    │                                large, unknown kind, wrong version, missing or
    │                                mistyped field (also a ValueError)
    │   └── AuthError                not authenticated with the shared secret
    ├── BootstrapError               the bootstrap server answered with an error
    │   └── UnknownNodeError         no such prefill node (after the server's node grace time)
    ├── InsecureBindError            a non-loopback bind without a shared secret or an
    │                                explicit insecure opt-out (also a ValueError)
    ├── KVTimeoutError               a bounded wait ran out (also a TimeoutError)
    │   └── BootstrapUnavailable     the bootstrap server did not answer in time
    │       └── BootstrapRefused     nothing listens at its address (connection refused)
    └── (transfer.errors)
        ├── IncompatibleLayoutError  the handshake found a field that differs
        │   └── IncompatibleTransportError  the two sides use different transfer engines
        ├── TransferError            the engine failed to move bytes
        │   └── HandshakeError       the way to a peer could not be opened (its handshake)
        ├── PeerError                the peer reported a failure or aborted the room
        ├── StateError               an API call that the room's state does not allow
        ├── ClosedError              the manager was closed
        │   └── MemoryReleasedError  the scheduler released the KV memory (release_memory)
        ├── RequestError             pages that do not fit what init() declared (also a ValueError)
        │   └── PageIndexError       a page id outside the pool (also an IndexError)
        └── StorageError             a storage backend failed (``backend``, ``code``)
            ├── StorageUnavailableError  the backend cannot be reached or used
            │   └── StorageTimeoutError  a storage call ran out of time (also a KVTimeoutError)
            ├── StorageClosedError   the backend was closed
            └── StorageMissError     a failed room could not be restored from storage

Foreign errors (zmq, msgpack, Mooncake return codes, OS errors) are translated
once, where they are raised, with ``raise ... from``.
"""

from __future__ import annotations


class KVFerryError(Exception):
    """Root of every exception kvferry raises on purpose."""


class ProtocolError(KVFerryError, ValueError):
    """Bytes that do not decode to a valid message of this protocol version.

    ``field`` names the offending field when there is one.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class AuthError(ProtocolError):
    """A message that is not authenticated with the configured shared secret
    (unsealed, wrong secret, altered, or outside the replay window)."""


class BootstrapError(KVFerryError):
    """The bootstrap server replied with an error (``code`` says which)."""

    def __init__(self, message: str, *, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class KVTimeoutError(KVFerryError, TimeoutError):
    """A bounded wait ran out; the message says what was awaited and where."""


class BootstrapUnavailable(KVTimeoutError):
    """The bootstrap server did not answer within the request timeout."""


class BootstrapRefused(BootstrapUnavailable):
    """Nothing listens at the bootstrap server's address: a TCP connect was
    refused, so waiting out the request timeout would not help (known in
    milliseconds). A server being restarted looks the same for a moment."""


class UnknownNodeError(BootstrapError):
    """The bootstrap server knows no rank of ``node_id`` although it has been
    up for its node grace time (every live rank re-registers within it): the
    name is wrong or the node is down. ``known_nodes``: (some of) the node ids
    it does know."""

    def __init__(self, message: str, *, node_id: str, known_nodes: tuple[str, ...] = ()) -> None:
        super().__init__(message, code="unknown_node")
        self.node_id = node_id
        self.known_nodes = known_nodes


class InsecureBindError(KVFerryError, ValueError):
    """A server or rank would bind a non-loopback address without a shared
    secret, and no explicit insecure opt-out was given (see
    :func:`bootstrap.protect.check_protected`)."""
