"""The vLLM connector's configuration and ``kv_transfer_params`` protocol. Pure.

Imports neither vLLM, torch, zmq nor Mooncake: the scheduler half of the
connector runs on it alone.

Protocol (push from prefill; what a router or client sends):

- sequential (NIXL-style): POST prefill with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": true}``; prefill answers with
  ``kv_transfer_params`` = :func:`decode_params` (room, bootstrap address,
  prefill node); POST decode with those. Prefill keeps the request's blocks
  until decode's pages landed, or until no decode asked for them within
  the lease (``kvferry_lease_s``), or the transfer failed.
- concurrent (Mooncake-style): the router picks a ``transfer_id`` and POSTs
  prefill ``{"do_remote_decode": true, "transfer_id": T}`` and decode
  ``{"do_remote_prefill": true, "transfer_id": T, "kvferry_bootstrap_addr":
  B, "kvferry_node": N}`` at once; decode's request waits at prefill until
  prefill's pages are ready. The room is :func:`room_of` ``(T)``.
- vLLM's MooncakeConnector router, unchanged: a prefill that serves the
  bootstrap answers ``GET http://<host>:<bootstrap port>/query`` on that
  port (8998, the port those routers ask), as vLLM's Mooncake bootstrap
  server does (``{dp_rank: {"engine_id": E, "worker_addr": {...}}}``);
  kvferry's own ZMQ bootstrap server listens on the next port
  (:attr:`ConnectorConfig.kvferry_addr`). ``kvferry_query_port`` answers
  ``/query`` on another port besides. The router then POSTs decode
  ``{"do_remote_prefill": true, "transfer_id": T, "remote_engine_id": E,
  "remote_bootstrap_addr": ...}``. ``E`` is :func:`engine_id_of`: the
  prefill node and kvferry's bootstrap address, which decode reads back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from transfer.adapters.hosts import outgoing_address

#: Bumped when a field of the params below changes meaning.
PARAMS_VERSION = 1

_MANAGER_KEYS = frozenset({
    "bootstrap_timeout_s", "transfer_timeout_s", "rpc_timeout_s", "register_timeout_s", "staging_bytes",
    "stage_below_bytes", "stage_part_bytes", "heartbeat_interval_s", "peer_timeout_s", "register_interval_s",
    "storage_url", "model_name", "storage_write_through", "storage_prefetch", "storage_prefetch_timeout_s",
    "storage_fallback", "write_fence", "layerwise_min_tokens",
})

#: The lease when ``kvferry_lease_s`` is not given (seconds; vLLM NixlConnector's ``kv_lease_duration`` default).
DEFAULT_LEASE_S = 30.0
#: How long a step that computes nothing waits for a room to end when ``kvferry_idle_wait_ms`` is not given.
DEFAULT_IDLE_WAIT_S = 0.01


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    """From ``kv_connector_extra_config``:

    - ``kvferry_bootstrap_addr`` (``host:port``, default ``127.0.0.1:`` and
      ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` or 8998): the bootstrap server prefill
      registers with and names to decode;
    - ``kvferry_serve_bootstrap`` (bool, default false): the prefill worker
      runs that server itself (else run ``python -m bootstrap``): that port
      then speaks HTTP, as vLLM's Mooncake bootstrap port does (``GET
      /query`` for vLLM's Mooncake routers, ``GET /kvferry``: ``{"port":
      <kvferry's port>}``, ``GET /health``), and kvferry's ZMQ bootstrap
      server listens beside it, on ``kvferry_bootstrap_zmq_port`` (default:
      the next port);
    - ``kvferry_host``: this rank's address for peers (decode's transfers
      to prefill's, prefill's writes to decode's). Default
      (:func:`default_host`): a prefill that serves the bootstrap, its
      host (the address decode and the routers already reach it at); else
      this machine's address on the route to the bootstrap server's host
      (``127.0.0.1`` where that is loopback);
    - ``kvferry_node`` (default: vLLM's ``engine_id``): the prefill node's name;
    - ``kvferry_protocol`` (``tcp`` or ``rdma``, default ``tcp``);
    - ``kvferry_query_port`` (prefill, default 0: none besides the served
      bootstrap port): answer vLLM's Mooncake routers' ``GET /query`` on
      ``kvferry_host`` at this port too (a prefill with a separate
      ``python -m bootstrap`` server has no port of its own otherwise);
    - ``kvferry_router_discovery`` (``host:port``, default off): register
      this server with vllm-router's ``--vllm-discovery-address`` there
      (:mod:`~transfer.control.router_discovery`), with
      ``kvferry_http_address`` (``host:port``, required with it): the
      address the router sends this server's requests to;
    - ``kvferry_lease_s`` (seconds, default 30, as vLLM's NixlConnector's
      ``kv_lease_duration``): prefill keeps a finished request's blocks this
      long for a decode request; then the worker ends the room (reason
      ``lease_expired``) and vLLM frees them. Counted from when the prefill
      worker opened the room (the step after the request finished). It does
      not follow ``kvferry.bootstrap_timeout_s`` (how long a lookup may
      take): a short lookup bound must not lose a request whose decode
      request lags behind prefill's answer;
    - ``kvferry_idle_wait_ms`` (default 10; 0: off): vLLM steps without
      pause while a room is open (prefill: a finished request's blocks kept
      for its decode; decode: a request waiting for its KV), each step a
      round trip to the workers and a stats message to the API server. Once
      the engine has stepped with nothing to compute for 50 ms, such a
      step's worker waits up to this long for a room to end (and returns
      as soon as one does); a step that computes is never held, a request
      arriving at an idle engine may wait up to twice this long;
    - ``kvferry_layer_groups`` (prefill, default 0: off): stream a request's
      KV in this many groups of layers during the forward pass that
      completes its prefill (:mod:`transfer.adapters.vllm.layerwise`);
      ``kvferry.layerwise_min_tokens`` keeps shorter prompts whole;
    - ``kvferry`` (dict): :class:`~transfer.config.ManagerConfig` fields
      (timeouts, staging, the write fence, storage tier), validated by
      ManagerConfig. The connector's defaults: prefill ``staging_bytes`` 0;
      decode ManagerConfig's (staging on, so ``write_fence`` is effective;
      ``{"write_fence": false}`` or ``{"staging_bytes": 0}`` turns it off).
    """

    bootstrap_addr: str = "127.0.0.1:8998"
    serve_bootstrap: bool = False
    host: str = "127.0.0.1"
    node_id: str = "prefill"
    protocol: str = "tcp"
    lease_s: float = DEFAULT_LEASE_S
    idle_wait_s: float = DEFAULT_IDLE_WAIT_S  # a step that computes nothing waits this long for a room to end
    query_port: int = 0  # prefill: answer vLLM Mooncake routers' GET /query here too (0: no other port)
    bootstrap_zmq_port: int = 0  # serve_bootstrap: kvferry's ZMQ bootstrap server's port (0: the next port)
    layer_groups: int = 0  # prefill: stream in this many layer groups during the forward pass (0: off)
    router_discovery: str = ""  # vllm-router's --vllm-discovery-address to register with ("": off)
    http_address: str = ""  # this server's HTTP host:port, as the router reaches it (with router_discovery)
    manager: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        host, _, port = self.bootstrap_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kvferry_bootstrap_addr must be host:port, got {self.bootstrap_addr!r}")
        if not 0 <= self.idle_wait_s <= 1:
            raise ValueError(f"kvferry_idle_wait_ms must be 0-1000, got {self.idle_wait_s * 1e3:g}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"kvferry_protocol must be tcp or rdma, got {self.protocol!r}")
        if not self.lease_s > 0:
            raise ValueError(f"kvferry_lease_s must be > 0, got {self.lease_s!r}")
        if not 0 <= self.query_port < 1 << 16:
            raise ValueError(f"kvferry_query_port must be a TCP port or 0, got {self.query_port!r}")
        if not 0 <= self.bootstrap_zmq_port < 1 << 16 or (self.serve_bootstrap and int(port) + 1 >= 1 << 16
                                                           and not self.bootstrap_zmq_port):
            raise ValueError(f"kvferry_bootstrap_zmq_port must be a TCP port or 0 (the port after "
                             f"kvferry_bootstrap_addr's), got {self.bootstrap_zmq_port!r}")
        zmq_port = int(self.kvferry_addr.rpartition(":")[2])
        if self.serve_bootstrap and zmq_port in self.http_ports:
            raise ValueError(f"kvferry's ZMQ bootstrap port {zmq_port} (kvferry_bootstrap_zmq_port) is also an "
                             "HTTP port of this prefill (kvferry_bootstrap_addr's or kvferry_query_port)")
        for name, addr in (("kvferry_router_discovery", self.router_discovery),
                           ("kvferry_http_address", self.http_address)):
            if addr and not (addr.rpartition(":")[0] and addr.rpartition(":")[2].isdigit()):
                raise ValueError(f"{name} must be host:port, got {addr!r}")
        if self.router_discovery and not self.http_address:
            raise ValueError("kvferry_router_discovery needs kvferry_http_address: the host:port vllm-router "
                             "sends this server's requests to (its --host and --port)")
        if not isinstance(self.layer_groups, int) or self.layer_groups < 0:
            raise ValueError(f"kvferry_layer_groups must be an int >= 0, got {self.layer_groups!r}")
        if ENGINE_SEP in self.node_id:
            raise ValueError(f"kvferry_node must not contain {ENGINE_SEP!r}, got {self.node_id!r}")
        unknown = set(self.manager) - _MANAGER_KEYS
        if unknown:
            raise ValueError(f"kvferry: unknown or unsupported ManagerConfig fields {sorted(unknown)}")

    @property
    def kvferry_addr(self) -> str:
        """kvferry's ZMQ bootstrap server, where this side's ranks register
        and decode looks them up: ``bootstrap_addr`` itself, or, where this
        prefill serves the bootstrap (its port answers HTTP), the port beside it."""
        if not self.serve_bootstrap:
            return self.bootstrap_addr
        host, _, port = self.bootstrap_addr.rpartition(":")
        return f"{host}:{self.bootstrap_zmq_port or int(port) + 1}"

    @property
    def public_kvferry_addr(self) -> str:
        """:attr:`kvferry_addr` as peers on other nodes reach it: a server
        bound on every interface (``0.0.0.0``, ``::``) is named by this
        rank's host (``kvferry_host``, or the address its default route
        leaves from), never by the wildcard, which names the peer's own
        machine there. What the routers and decode are given."""
        host, _, port = self.kvferry_addr.rpartition(":")
        return f"{self.host}:{port}" if host.strip("[]") in ("", "0.0.0.0", "::") else self.kvferry_addr

    @property
    def http_ports(self) -> tuple[int, ...]:
        """The ports this prefill answers ``GET /query`` on (with ``/kvferry``
        and ``/health``): the served bootstrap port and ``query_port``."""
        served = (int(self.bootstrap_addr.rpartition(":")[2]),) if self.serve_bootstrap else ()
        return tuple(dict.fromkeys(served + ((self.query_port,) if self.query_port else ())))

    @staticmethod
    def from_extra(extra: dict | None, engine_id: str | None, env: dict | None = None) -> ConnectorConfig:
        """``env`` (default: none): the environment, for
        ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (the default bootstrap port)."""
        extra = dict(extra or {})
        manager = dict(extra.get("kvferry", {}))
        lease = extra.get("kvferry_lease_s", DEFAULT_LEASE_S)
        port = str((env or {}).get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "")).strip() or "8998"
        bootstrap = str(extra.get("kvferry_bootstrap_addr", f"127.0.0.1:{port}"))
        serve = bool(extra.get("kvferry_serve_bootstrap", False))
        return ConnectorConfig(
            bootstrap_addr=bootstrap,
            serve_bootstrap=serve,
            host=str(extra.get("kvferry_host") or default_host(bootstrap, serve)),
            node_id=str(extra.get("kvferry_node") or engine_id or "prefill"),
            protocol=str(extra.get("kvferry_protocol", "tcp")),
            lease_s=float(lease),
            idle_wait_s=float(extra.get("kvferry_idle_wait_ms", DEFAULT_IDLE_WAIT_S * 1e3)) / 1e3,
            query_port=int(extra.get("kvferry_query_port", 0)),
            bootstrap_zmq_port=int(extra.get("kvferry_bootstrap_zmq_port", 0)),
            layer_groups=extra.get("kvferry_layer_groups", 0),
            router_discovery=str(extra.get("kvferry_router_discovery", "")),
            http_address=str(extra.get("kvferry_http_address", "")),
            manager=manager,
        )

    def manager_fields(self, *, prefill: bool) -> dict:
        """The ManagerConfig fields of this side: ``manager`` over the
        connector's defaults. Prefill's ``bootstrap_timeout_s`` (how long a
        sender waits for its decode request) is at least the lease plus a
        second, so the lease, not that bound, ends an unasked room."""
        if not prefill:
            return dict(self.manager)
        fields = {"staging_bytes": 0, **self.manager}
        fields["bootstrap_timeout_s"] = max(float(fields.get("bootstrap_timeout_s", 30.0)), self.lease_s + 1.0)
        return fields


def check_parallel(*, pipeline_parallel_size: int, data_parallel_size: int,
                   decode_context_parallel_size: int = 1) -> None:
    """Refuse, at start-up, the vLLM parallel layouts the connector does not
    move correctly (raises ValueError saying which and what to run instead):

    - pipeline parallelism: each PP stage's worker holds its own layers, and
      kvferry's rank layout (TP ranks of one pool of every layer) has no
      stage; a stage would register as a whole model;
    - data parallelism: vLLM's DP engines would share one ``kvferry_node``
      and one room space; run independent vLLM servers instead (DP size 1),
      each with its own ``kvferry_node`` (they may share a bootstrap server);
    - decode context parallelism: the KV of a request is spread over ranks by
      token, which kvferry's plan (by pages and heads) does not cover."""
    refused = [(name, size, what) for name, size, what in (
        ("pipeline_parallel_size", pipeline_parallel_size,
         "each pipeline stage holds its own layers; run prefill and decode with --pipeline-parallel-size 1"),
        ("data_parallel_size", data_parallel_size,
         "run independent vLLM servers (--data-parallel-size 1), each with its own kvferry_node"),
        ("decode_context_parallel_size", decode_context_parallel_size,
         "a request's KV is spread over ranks by token; run with --decode-context-parallel-size 1"),
    ) if size > 1]
    if refused:
        name, size, what = refused[0]
        raise ValueError(f"KvferryConnector: {name} {size} is not supported: {what}")


def room_of(key: str) -> int:
    """The kvferry room of a transfer id or request id: 63 bits of its hash."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def num_pages(num_tokens: int, block_size: int) -> int:
    """The blocks that hold ``num_tokens`` prompt tokens."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class SendSpec:
    """Prefill: push ``pages`` (the prompt's blocks, in order) as ``room``."""

    req_id: str
    room: int
    pages: tuple[int, ...]
    token_ids: tuple[int, ...] = ()  # the prompt: keys the storage tier's pages
    states: tuple[tuple[int, ...], ...] = ()  # per state pool (HMA's other groups): block ids, -1: freed


@dataclass(frozen=True)
class RecvSpec:
    """Decode: receive ``room`` from ``node_id`` (found at ``bootstrap_addr``) into ``pages``."""

    req_id: str
    room: int
    bootstrap_addr: str
    node_id: str
    pages: tuple[int, ...]
    token_ids: tuple[int, ...] = ()
    skip_pages: int = 0  # leading pages decode's prefix cache holds: listed, never written
    states: tuple[tuple[int, ...], ...] = ()  # per state pool (HMA's other groups): block ids, -1: not wanted


@dataclass(frozen=True)
class Source:
    """Where decode finds a request's KV (parsed from its ``kv_transfer_params``)."""

    room: int
    bootstrap_addr: str
    node_id: str


#: Joins the prefill node and kvferry's bootstrap address in a Mooncake-style engine id.
ENGINE_SEP = "@kvferry@"


def engine_id_of(config: ConnectorConfig) -> str:
    """The engine id prefill's ``/query`` gives vLLM's Mooncake routers."""
    return f"{config.node_id}{ENGINE_SEP}{config.public_kvferry_addr}"


def query_reply(config: ConnectorConfig, tp_size: int) -> dict:
    """``GET /query``'s body, shaped as vLLM's Mooncake bootstrap server
    shapes it: ``{dp_rank: {"engine_id", "worker_addr": {tp: {pp: addr}}}}``
    (the workers' addresses are kvferry's bootstrap: decode finds the ranks there)."""
    return {"0": {"engine_id": engine_id_of(config),
                  "worker_addr": {str(tp): {"0": config.public_kvferry_addr} for tp in range(tp_size)}}}


def decode_params(room: int, config: ConnectorConfig) -> dict:
    """What prefill returns in its response, for the router to send to decode."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "kvferry_version": PARAMS_VERSION,
            "kvferry_room": room, "kvferry_bootstrap_addr": config.public_kvferry_addr,
            "kvferry_node": config.node_id}


def default_host(bootstrap_addr: str, serve_bootstrap: bool) -> str:
    """This rank's address for peers where ``kvferry_host`` is not set. A
    prefill serving the bootstrap at a host of its own: that host (decode
    and the routers reach this server there). Otherwise the address this
    machine sends from towards the bootstrap server's host
    (:func:`~transfer.adapters.hosts.outgoing_address`), so a rank on
    another node than its bootstrap registers a reachable address, not
    loopback; a bootstrap on every interface (``0.0.0.0``): the default
    route's; ``127.0.0.1`` for a loopback bootstrap or when no route is found."""
    host = bootstrap_addr.rpartition(":")[0].strip("[]")
    anywhere = host in ("", "0.0.0.0", "::")
    if serve_bootstrap and not anywhere and host != "localhost":
        return host
    if host == "localhost" or host.startswith("127."):
        return "127.0.0.1"
    return outgoing_address() if anywhere else outgoing_address(host)  # everywhere: the default route's


def source_of(params: dict) -> Source:
    """Decode's view of ``kv_transfer_params``; raises ValueError naming the
    missing or bad field."""
    version = params.get("kvferry_version", PARAMS_VERSION)
    if version != PARAMS_VERSION:
        raise ValueError(f"kv_transfer_params.kvferry_version {version!r}, this connector speaks {PARAMS_VERSION}")
    if "kvferry_room" in params:
        room = params["kvferry_room"]
        if not isinstance(room, int) or not 0 <= room < 1 << 63:
            raise ValueError(f"kv_transfer_params.kvferry_room must be an int in [0, 2**63), got {room!r}")
    elif params.get("transfer_id"):
        room = room_of(str(params["transfer_id"]))
    else:
        raise ValueError("kv_transfer_params: neither kvferry_room nor transfer_id")
    if "kvferry_node" not in params and isinstance(params.get("remote_engine_id"), str):
        node, sep, addr = params["remote_engine_id"].partition(ENGINE_SEP)
        if not sep or not node or not addr:  # a Mooncake router: the engine id prefill's /query gave
            raise ValueError(f"kv_transfer_params.remote_engine_id {params['remote_engine_id']!r} is not a kvferry "
                             f"prefill's (from its /query: node{ENGINE_SEP}bootstrap address)")
        host, _, port = addr.rpartition(":")
        router = str(params.get("remote_bootstrap_addr") or "").partition("://")[2].rpartition(":")[0]
        if host.strip("[]") in ("", "0.0.0.0", "::") and router:  # a wildcard names no node: the router's host
            addr = f"{router}:{port}"
        return Source(room=room, bootstrap_addr=addr, node_id=node)
    for name in ("kvferry_bootstrap_addr", "kvferry_node"):
        if not isinstance(params.get(name), str) or not params[name]:
            raise ValueError(f"kv_transfer_params.{name} missing")
    return Source(room=room, bootstrap_addr=params["kvferry_bootstrap_addr"], node_id=params["kvferry_node"])
