"""Configuration: frozen, keyword-only dataclasses, validated with ValueError.

This is the only module of kvferry that reads its own settings from
``os.environ``; every variable has the prefix ``KVFERRY_`` (see
:func:`manager_config_from_env`).

Mooncake's own settings. The Mooncake engine reads its tuning from ``MC_*``
environment variables; kvferry fills in the ones an engine needs from
:class:`EngineConfig` (:meth:`EngineConfig.mooncake_env`) right before it
builds one, never changing a value the user set: see
:mod:`transfer.transport.mooncake.process`, which also keeps the engine's
start-up logs quiet with ``log_level="OFF"`` (the default).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field, fields, replace

from bootstrap.protect import check_protected

ENV_PREFIX = "KVFERRY_"


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def _positive(obj, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {getattr(obj, name)!r}")


#: EngineConfig.backend's values: the transports kvferry can move KV with.
BACKENDS = ("mooncake", "nixl")


def _options(value) -> tuple[tuple[str, str], ...]:
    """A mapping, pairs, or ``"key=value,key=value"`` text as sorted pairs of strings."""
    if isinstance(value, str):
        value = [item.partition("=")[::2] for item in value.split(",") if item.strip()]
    items = value.items() if hasattr(value, "items") else value
    pairs = tuple(sorted((str(k).strip(), str(v).strip()) for k, v in items))
    if any(not k for k, _ in pairs):
        raise ValueError(f"EngineConfig.nixl_options: every option needs a name, got {value!r}")
    return pairs


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The transfer engine of one rank: ``backend`` ``mooncake`` (the
    default) or ``nixl`` (see docs/transports.md). Both sides of a room must
    use the same one; the handshake refuses a mismatch by name.

    NIXL: ``nixl_backend`` is the NIXL plugin (``UCX``, the default;
    ``LIBFABRIC``, ...), ``nixl_options`` its initialization parameters,
    passed through unchanged (a mapping, or ``"key=value,..."`` text from
    ``KVFERRY_NIXL_OPTIONS``); ``nixl_progress_delay_us`` is how long the
    agent's progress thread sleeps between polls (NIXL's Python API leaves it
    at 0, a thread that spins on a whole core); ``progress_timeout_s`` and
    ``hostname`` apply to it too. UCX itself reads ``UCX_*`` variables (``UCX_TLS``,
    ``UCX_NET_DEVICES``), which kvferry leaves to the user.

    Mooncake: ``protocol`` is ``rdma`` on clusters, ``tcp`` where there is no RDMA NIC.
    ``max_inflight_per_peer`` caps the descriptors kvferry has outstanding to
    one peer: the TCP transport wedges a peer path when its own queue
    overflows, so we never let it. Longer descriptors are cut into pieces of
    ``max_descriptor_bytes``, which spreads them over the engine's lanes (NIXL
    cuts them too: UCX over TCP moved 16 MiB descriptors at about 0.6 of the
    rate of 4 MiB ones).
    ``progress_timeout_s`` bounds how long an
    outstanding descriptor can hang on a stalled peer.
    ``mooncake_metadata``: how an engine learns a peer's segment. ``relay``
    (the default): the segment descriptors travel in kvferry's own
    handshake, through a small metadata store process per kvferry process,
    so a fresh pair never waits on the peer engine's handshake listener
    (which serves one connection at a time: an idle connection on it held
    first rooms 5 s each); ``p2p``: Mooncake's ``P2PHANDSHAKE``, a handshake
    with that listener (keep health checks and port scanners off it). Both
    sides of a room must use the same one; the handshake refuses a
    mismatch by name (docs/transports.md).
    ``handshake_timeout_s`` bounds opening the way to a new peer (the
    segment lookup and a probe write, before any room's bytes go there):
    past it the peer's rooms fail with a HandshakeError naming it.
    ``max_inflight_bytes_per_peer`` caps the bytes kvferry has handed the
    Mooncake engine for one peer (0: 256 MiB over TCP, 1 GiB over RDMA,
    tens of milliseconds of either link); what waits beyond it goes oldest
    room first. The engine serves what it holds first come, so without
    the cap a link slower than the forward pass ends every streamed room
    of a batch at the batch's end.
    """

    protocol: str = "rdma"
    hostname: str = "127.0.0.1"
    device_name: str = ""
    max_inflight_per_peer: int = 1024
    max_descriptor_bytes: int = 4 << 20
    max_inflight_bytes_per_peer: int = 0
    progress_timeout_s: int = 10
    mooncake_metadata: str = "relay"
    handshake_timeout_s: float = 3.0
    log_level: str = "OFF"
    backend: str = "mooncake"
    nixl_backend: str = "UCX"
    nixl_options: tuple[tuple[str, str], ...] = ()
    nixl_progress_delay_us: int = 100

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"EngineConfig.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.nixl_backend:
            raise ValueError("EngineConfig.nixl_backend must name a NIXL plugin (UCX, LIBFABRIC, ...)")
        object.__setattr__(self, "nixl_options", _options(self.nixl_options))
        if self.nixl_progress_delay_us < 0:
            raise ValueError(f"EngineConfig.nixl_progress_delay_us must be >= 0, got {self.nixl_progress_delay_us}")
        if self.protocol not in ("rdma", "tcp"):
            raise ValueError(f"EngineConfig.protocol must be 'rdma' or 'tcp', got {self.protocol!r}")
        if self.log_level not in ("TRACE", "INFO", "WARNING", "ERROR", "OFF"):
            raise ValueError("EngineConfig.log_level must be TRACE, INFO, WARNING, ERROR or OFF, "
                             f"got {self.log_level!r}")
        _positive(self, "max_inflight_per_peer", "progress_timeout_s", "max_descriptor_bytes")
        if self.max_inflight_per_peer > 60000:
            raise ValueError("EngineConfig.max_inflight_per_peer must stay below the engine's cap of 65535")
        if self.max_inflight_bytes_per_peer < 0:
            raise ValueError("EngineConfig.max_inflight_bytes_per_peer must be >= 0 (0: by protocol)")
        if self.mooncake_metadata not in ("relay", "p2p"):
            raise ValueError(f"EngineConfig.mooncake_metadata must be 'relay' or 'p2p', got {self.mooncake_metadata!r}")
        _positive(self, "handshake_timeout_s")

    @property
    def inflight_bytes_per_peer(self) -> int:
        """``max_inflight_bytes_per_peer``, or its default for the protocol."""
        if self.max_inflight_bytes_per_peer:
            return self.max_inflight_bytes_per_peer
        return 256 << 20 if self.protocol == "tcp" else 1 << 30

    def mooncake_env(self) -> dict[str, str]:
        """The ``MC_*`` variables an engine of this config needs (read when a
        TransferEngine is constructed); see the module docstring."""
        env = {"MC_LOG_LEVEL": "ERROR" if self.log_level == "OFF" else self.log_level,
               "MC_TRANSFER_TIMEOUT": str(max(5, self.progress_timeout_s))}
        if self.mooncake_metadata == "relay":
            # With a metadata server the engine advertises this address for its RPC and data ports
            # (otherwise the host's first LAN address: none in a loopback-only namespace).
            env["MC_TCP_BIND_ADDRESS"] = self.hostname
        if self.protocol == "tcp":
            env.update({
                # The engine rejects (and may wedge on) more than queue+pending entries
                # per peer; we cap below both, and raise both to their maximum.
                "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
                "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
                "MC_TCP_ADMISSION_TIMEOUT_MS": "60000",
                "MC_TCP_PROGRESS_TIMEOUT_SEC": str(self.progress_timeout_s),
                # The wait for a write's acknowledgement after its body went out (default 30 s):
                # bounded like a stalled body, so no write is held longer than progress_timeout_s.
                "MC_TCP_STATUS_TIMEOUT_SEC": str(self.progress_timeout_s),
            })
        return env


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """One rank of one role.

    ``bootstrap_addr`` (``host:port``) is where a prefill rank registers;
    decode ranks name the bootstrap server per request. ``node_id`` names the
    prefill node (all its ranks and DP groups share it). ``host`` is the
    address peers reach this rank's control socket and engine on.

    Time bounds: a room may stay in Bootstrapping ``bootstrap_timeout_s``, a
    decode room waits at most ``transfer_timeout_s`` from ``init()`` to its
    last completion, one bootstrap request at most ``rpc_timeout_s``, and a
    prefill rank retries its registration for ``register_timeout_s``.

    Liveness: while a rank has live rooms with a peer it pings it every
    ``heartbeat_interval_s``; a peer silent for ``peer_timeout_s`` is taken
    for dead (or hung), its rooms fail (decode: after the drain below) and its
    links are forgotten, so it is looked up afresh when it comes back. A
    prefill rank re-registers with the bootstrap server every
    ``register_interval_s``, which re-populates a restarted server. A decode
    room that fails while prefill ranks may still be writing waits up to
    ``peer_timeout_s`` for each to confirm it stopped before it reports
    ``Failed`` (the scheduler may then reuse the pages).

    ``secret``: a shared secret that authenticates every control message
    (the bootstrap server and every rank must have the same one); empty:
    off. From the environment: ``KVFERRY_SECRET``. Protected mode: a ``host``
    that is not a loopback address (127.0.0.0/8, ::1, ``localhost``; names
    are not resolved) needs a secret, or ``insecure=True``
    (``KVFERRY_INSECURE=1``) to run unauthenticated on a trusted network.
    A prefill rank refuses a decode peer that declares its own transfer
    session, another prefill rank's of its node, or (``check_peer_host``) a
    session on another host than the one its messages come from; see
    :mod:`transfer.rooms.peer_check` (turn ``check_peer_host`` off where a
    host's control traffic leaves from another address than its engine's).

    Storage tier (off unless ``storage_url`` is set: ``file:///dir``,
    ``mooncake://host:port``, ...; see :mod:`transfer.storage`). Pages are
    keyed by a hash chain of the prompt's tokens (give ``token_ids`` to
    ``KVSender.init`` / ``KVReceiver.init``) and by ``model_name`` and the
    pool's layout. Prefill with ``storage_write_through`` writes each sent
    chunk's full pages (and the aux row) in the background. Decode, with
    ``storage_prefetch`` other than ``off``, loads the leading pages storage
    already has and asks prefill for the rest only: ``wait_complete`` waits
    for that prefetch, ``timeout`` at most ``storage_prefetch_timeout_s``,
    ``best_effort`` not at all (it keeps what landed by the time the request
    goes out). With ``storage_fallback``, a decode room whose transfer fails
    loads its pages from storage and succeeds if they were all there.

    Staging: each rank keeps a registered ``staging_bytes`` tensor on its
    pools' device (0: none; None, the default: :func:`default_staging_bytes`
    of that device, 256 MiB on the CPU, 64 MiB on a GPU). A chunk whose direct plan averages descriptors
    smaller than ``stage_below_bytes`` is gathered into it, sent in parts of
    at most ``stage_part_bytes``, and scattered on decode; both sides need
    staging for it to be used.

    Layer-wise sends (``KVSender.send(..., layers=...)``): a room of fewer
    than ``layerwise_min_tokens`` prompt tokens (its pages times the page
    size) sends its layer groups whole, once each chunk is complete. The
    default, 2048, is measured (``benchmarks.layerwise``, docs/performance.md):
    behind a busy scheduler 1k-token prompts streamed slower than whole on
    NIXL, 8k-token ones faster on every transport, fenced or not.

    Write fence (``write_fence``, ``KVFERRY_WRITE_FENCE``; on by default,
    effective on a decode rank with staging memory only): decode registers
    none of its pools with the transport; every byte of every room lands in
    its staging arenas and decode copies it into the pages, so once a room
    reported ``Failed`` no late write of a stopped, hung or partitioned
    prefill process reaches its pages (see :mod:`transfer.staging.arenas`).
    Prefill writes contiguous page runs straight from its pool into the
    granted region and gathers scattered ones first. Off, or without
    staging: prefill writes into decode's pages directly, and a prefill rank
    taken for dead that resumes can overwrite pages the scheduler reused
    (docs/reliability.md).

    Observability: ``metrics_port`` (0: off) serves Prometheus ``/metrics``
    on ``host`` (needs prometheus-client; see :mod:`transfer.rank.metrics`).
    ``log_level`` (empty: leave it) sets the ``kvferry`` logger hierarchy's
    level when the manager starts (``DEBUG`` shows each room's life; ``TRACE``
    counts as ``DEBUG``). From the environment: ``KVFERRY_METRICS_PORT``,
    ``KVFERRY_LOG_LEVEL`` (which also sets ``engine.log_level`` when it is a
    level the engine knows, as it always did).
    """

    role: Role
    bootstrap_addr: str = "127.0.0.1:8998"
    node_id: str = "prefill"
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    host: str = "127.0.0.1"
    engine: EngineConfig = field(default_factory=EngineConfig)
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 120.0
    rpc_timeout_s: float = 5.0
    register_timeout_s: float = 30.0
    allow_missing_draft: bool = False
    staging_bytes: int | None = None
    stage_below_bytes: int = 256 << 10
    stage_part_bytes: int = 64 << 20
    layerwise_min_tokens: int = 2048
    write_fence: bool = True
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 4.0
    register_interval_s: float = 2.0
    secret: str = field(default="", repr=False)
    insecure: bool = False
    check_peer_host: bool = True
    storage_url: str = ""
    model_name: str = ""
    storage_write_through: bool = True
    storage_prefetch: str = "wait_complete"
    storage_prefetch_timeout_s: float = 1.0
    storage_fallback: bool = True
    metrics_port: int = 0
    log_level: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ValueError(f"ManagerConfig.role must be a Role, got {self.role!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"ManagerConfig.tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"ManagerConfig.dp_rank {self.dp_rank} not in [0, {self.dp_size})")
        if ":" not in self.bootstrap_addr:
            raise ValueError(f"ManagerConfig.bootstrap_addr must be host:port, got {self.bootstrap_addr!r}")
        _positive(self, "bootstrap_timeout_s", "transfer_timeout_s", "rpc_timeout_s", "register_timeout_s",
                  "stage_part_bytes", "heartbeat_interval_s", "peer_timeout_s", "register_interval_s")
        if self.storage_prefetch not in ("off", "best_effort", "wait_complete", "timeout"):
            raise ValueError("ManagerConfig.storage_prefetch must be off, best_effort, wait_complete or timeout, "
                             f"got {self.storage_prefetch!r}")
        _positive(self, "storage_prefetch_timeout_s")
        if self.heartbeat_interval_s * 2 > self.peer_timeout_s:
            raise ValueError(f"ManagerConfig.peer_timeout_s ({self.peer_timeout_s}) must be at least twice "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")
        if self.layerwise_min_tokens < 0:
            raise ValueError("ManagerConfig.layerwise_min_tokens must be >= 0")
        if (self.staging_bytes is not None and self.staging_bytes < 0) or self.stage_below_bytes < 0:
            raise ValueError("ManagerConfig.staging_bytes and stage_below_bytes must be >= 0")
        if self.staging_bytes and self.stage_part_bytes > self.staging_bytes:
            raise ValueError("ManagerConfig.stage_part_bytes must not exceed staging_bytes")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"ManagerConfig.metrics_port must be in [0, 65536), got {self.metrics_port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"ManagerConfig.log_level must be one of {', '.join(l or repr(l) for l in LOG_LEVELS)}, "
                             f"got {self.log_level!r}")
        check_protected(self.host, has_secret=bool(self.secret), insecure=self.insecure,
                        what=f"a {self.role.value} rank (ManagerConfig.host)",
                        how_insecure="insecure=True (KVFERRY_INSECURE=1)")


#: ManagerConfig.log_level's values ("": leave the level as it is).
LOG_LEVELS = ("", "TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ENGINE_LOG_LEVELS = ("TRACE", "INFO", "WARNING", "ERROR")


def apply_log_level(level: str) -> None:
    """Set the ``kvferry`` logger hierarchy to ``level`` (one of
    :data:`LOG_LEVELS`; empty: no change)."""
    if level:
        logging.getLogger("kvferry").setLevel("DEBUG" if level == "TRACE" else level)


_ENGINE_KEYS = {f.name for f in fields(EngineConfig)}
_MANAGER_KEYS = {f.name for f in fields(ManagerConfig)} - {"engine", "role"}


# Staging per rank when ManagerConfig.staging_bytes is None, by the pools'
# device type. CPU: measured on 2-core TCP hosts (docs/performance.md). CUDA:
# NOT measured yet (no GPU run; docs/gpu.md): a quarter of the CPU figure,
# because HBM staging is taken from the KV pool's budget and a device gather
# runs at HBM speed, so a smaller buffer (two 32 MiB parts) should keep the
# link busy.
DEFAULT_STAGING_BYTES = {"cpu": 256 << 20, "cuda": 64 << 20}


def default_staging_bytes(device_type: str) -> int:
    """Staging bytes for pools on ``device_type`` (``cpu``, ``cuda``; another
    device type gets the CUDA figure: device memory is scarce)."""
    return DEFAULT_STAGING_BYTES.get(device_type, DEFAULT_STAGING_BYTES["cuda"])


def staging_bytes_for(config: ManagerConfig, device_type: str) -> int:
    """The staging a rank allocates: ``config.staging_bytes``, or the
    device's default when it is None."""
    return default_staging_bytes(device_type) if config.staging_bytes is None else config.staging_bytes


def _convert(text: str, like):
    if isinstance(like, tuple):  # nixl_options: "key=value,key=value"
        return _options(text)
    if like is None:  # an optional int (staging_bytes)
        return None if text.strip().lower() in ("", "none") else int(text)
    if isinstance(like, bool):
        return text.lower() in ("1", "true", "yes", "on")
    if isinstance(like, int):
        return int(text)
    if isinstance(like, float):
        return float(text)
    return text


def manager_config_from_env(role: Role, **overrides) -> ManagerConfig:
    """A ManagerConfig from ``KVFERRY_<FIELD>`` variables (``KVFERRY_TP_RANK``,
    ``KVFERRY_PROTOCOL``, ``KVFERRY_METRICS_PORT``, ...), then ``overrides``.
    ``KVFERRY_LOG_LEVEL`` sets ``log_level``, and ``engine.log_level`` when
    the engine knows the level (TRACE, INFO, WARNING, ERROR)."""
    base = ManagerConfig(role=role)
    engine_kw, manager_kw = {}, {}
    for key in _ENGINE_KEYS:
        if (text := os.environ.get(ENV_PREFIX + key.upper())) is not None:
            if key == "log_level" and text not in _ENGINE_LOG_LEVELS:
                continue  # KVFERRY_LOG_LEVEL=DEBUG is for kvferry's loggers only
            engine_kw[key] = _convert(text, getattr(base.engine, key))
    for key in _MANAGER_KEYS:
        if (text := os.environ.get(ENV_PREFIX + key.upper())) is not None:
            manager_kw[key] = _convert(text, getattr(base, key))
    engine = replace(base.engine, **engine_kw)
    manager_kw.update(overrides)
    return replace(base, engine=manager_kw.pop("engine", engine), **manager_kw)
