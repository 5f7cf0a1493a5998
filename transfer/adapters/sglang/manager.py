"""KvferryKVManager: SGLang's KV manager slot, one kvferry KVManager per rank."""

from __future__ import annotations

import dataclasses
import logging

from sglang.srt.disaggregation.base.conn import BaseKVManager

from transfer.adapters.hosts import outgoing_address
from transfer.adapters.sglang.bootstrap import (RoomRegistrar, bind_host, front_info, kvferry_address, post,
                                               wait_kvferry_address)
from transfer.adapters.sglang.kvargs import (aux_regions_from_kv_args, check_supported, device_of, kv_heads_of_model,
                                             pools_from_kv_args, states_from_kv_args)
from transfer.adapters.sglang.recompute import Recomputer
from transfer.config import Role, manager_config_from_env
from transfer.errors import KVFerryError
from transfer.manager import KVManager

log = logging.getLogger("kvferry.sglang")

#: the node id every SGLang prefill server registers under: each has its own
#: bootstrap server, so the bootstrap address alone names the node.
PREFILL_NODE = "sglang-prefill"
_LOOKUP_TIMEOUT_S = 1.0  # try_ensure_parallel_info runs on the scheduler loop


def parallel_ranks(args, server_args) -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, dp_rank, dp_size) of this rank's attention group."""
    tp_size, dp_size = int(server_args.tp_size), int(getattr(server_args, "dp_size", 1) or 1)
    rank = int(args.engine_rank)
    if getattr(server_args, "enable_dp_attention", False) and dp_size > 1:
        attn_tp = tp_size // dp_size
        return rank % attn_tp, attn_tp, rank // attn_tp, dp_size
    dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
    return rank % tp_size, tp_size, dp_rank if dp_rank < dp_size else 0, dp_size


def _follows_bootstrap_room(server_args) -> bool:
    """Whether a prefill puts room r on DP rank r % dp_size (SGLang's
    ``follow_bootstrap_room``, what ``auto`` means for a PD prefill)."""
    method = str(getattr(server_args, "load_balance_method", "auto") or "auto")
    return method in ("auto", "follow_bootstrap_room")


def _http_port(server_args) -> int | None:
    """The server's HTTP API port (``--port``), where SGLang's decode posts a
    PD retract rebootstrap's ``/generate``."""
    port = getattr(server_args, "port", None)
    return None if port is None else int(port)


def _model_name(server_args) -> str:
    """What the storage tier binds its keys to: SGLang's served model name
    (the model path unless ``--served-model-name``), as its HiCache does."""
    return str(getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", "") or "")


def _engine_host(server_args) -> str:
    host = bind_host(getattr(server_args, "host", None))
    return outgoing_address() if host in ("0.0.0.0", "::") else host


class KvferryKVManager(BaseKVManager):
    """Builds kvferry pools from ``KVArgs`` and owns the rank's kvferry manager.

    Refuses set-ups it cannot serve (:func:`.kvargs.check_supported`) before
    it registers anything. On prefill the rank registers with the bootstrap
    server at ``--host:--disaggregation-bootstrap-port``.

    Deferred decode KV release: a kvferry decode room reports Failed only once
    every prefill rank that may write into its pages confirmed it stopped (or
    was found dead), so ``is_abort_release_safe`` is true exactly when this
    rank's room is terminal.
    """

    enable_deferred_decode_kv_release = True
    supports_deferred_decode_kv_release = True
    supports_host_destination = False

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: bool | None = False) -> None:
        check_supported(args, server_args)
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.disaggregation_mode = disaggregation_mode
        mode = str(getattr(disaggregation_mode, "value", disaggregation_mode))
        self.role = Role.PREFILL if mode == "prefill" else Role.DECODE
        self.page_size = int(args.page_size)
        tp_rank, tp_size, dp_rank, dp_size = parallel_ranks(args, server_args)
        self.attn_tp_rank = tp_rank
        host = bind_host(getattr(server_args, "host", None))
        #: SGLang's bootstrap address (HTTP, see .bootstrap), and the routing of this prefill's DP ranks
        self.sglang_bootstrap = f"{host}:{int(server_args.disaggregation_bootstrap_port)}"
        self.follow_bootstrap_room = _follows_bootstrap_room(server_args)
        config = manager_config_from_env(
            self.role, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size,
            node_id=PREFILL_NODE if self.role is Role.PREFILL else "sglang-decode",
            bootstrap_addr=self.sglang_bootstrap,
            **({} if _env_sets("host") else {"host": _engine_host(server_args)}),
            **({} if _env_sets("model_name") else {"model_name": _model_name(server_args)}), **_sglang_timeouts())
        self.rooms_registrar = None
        if self.role is Role.PREFILL:  # kvferry's bootstrap server sits behind SGLang's HTTP port
            config = dataclasses.replace(config, bootstrap_addr=wait_kvferry_address(
                self.sglang_bootstrap, config.register_timeout_s))
            post(self.sglang_bootstrap, "/kvferry", {"follow_bootstrap_room": self.follow_bootstrap_room,
                                                     "dp_size": dp_size, "prefill_http_port": _http_port(server_args)})
            if dp_size > 1 and not self.follow_bootstrap_room:  # decode asks the registry where a room is
                self.rooms_registrar = RoomRegistrar(self.sglang_bootstrap, dp_rank)
        ib_device = getattr(args, "ib_device", None)
        if ib_device and not config.engine.device_name:  # --disaggregation-ib-device, unless KVFERRY_DEVICE_NAME
            config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, device_name=str(ib_device)))
        kv_heads = None
        if not self.is_mla_backend and not getattr(args, "kv_head_num", None):  # SGLang's decode: not set yet
            kv_heads = kv_heads_of_model(server_args, tp_size)
        pools = pools_from_kv_args(args, is_mla=self.is_mla_backend, device=device_of(server_args, args),
                                   kv_heads=kv_heads)
        local_heads = int(getattr(args, "kv_head_num", 0) or (kv_heads[0] if kv_heads else 0))
        states = states_from_kv_args(args, is_mla=self.is_mla_backend, device=device_of(server_args, args),
                                     kv_heads=0 if self.is_mla_backend else local_heads, attn_tp=tp_size)
        self.core = KVManager(config, pools, aux=aux_regions_from_kv_args(args), states=states)
        #: decode: bootstrap address -> SGLang's PrefillServerInfo (DP/TP sizes)
        self.prefill_info_table: dict = {}
        #: decode: room -> the live KvferryKVReceiver (deferred release)
        self.receivers: dict = {}
        #: decode: posts PD retract rebootstrap requests (submit_prefill_recompute), bounded by SGLang's
        #: waiting timeout as its own manager bounds them
        self.recomputer = Recomputer(timeout_s=config.transfer_timeout_s, max_workers=_recompute_workers())
        log.info("kvferry %s rank tp %d/%d dp %d/%d ready", self.role.value, tp_rank, tp_size, dp_rank, dp_size)

    # --- BaseKVManager --------------------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """kvferry's prefill ranks register when their manager starts and keep
        re-registering; nothing to do here."""

    # --- decode scheduler members outside the ABC -------------------------------------------
    def kvferry_address(self, bootstrap_addr: str) -> str | None:
        """kvferry's bootstrap server behind SGLang's bootstrap address (None:
        it does not answer yet). Blocks at most 1 s, once per address."""
        return kvferry_address(bootstrap_addr, _LOOKUP_TIMEOUT_S)

    def prefill_topology(self, bootstrap_addr: str) -> tuple[int, int] | None:
        """(dp_size, tp_size) of the prefill node at (SGLang's) ``bootstrap_addr``,
        once its DP group 0 registered; None if unknown yet. Blocks at most 1 s."""
        addr = self.kvferry_address(bootstrap_addr)
        if addr is None:
            return None
        try:
            topology = self.core.prefill_topology(addr, PREFILL_NODE, timeout_s=_LOOKUP_TIMEOUT_S)
        except KVFerryError as exc:
            log.debug("prefill topology of %s not known yet: %s", bootstrap_addr, exc)
            return None
        return None if topology is None else (topology.dp_size, topology.tp_size)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        if bootstrap_addr in self.prefill_info_table:
            return True
        topology = self.prefill_topology(bootstrap_addr)
        if topology is None:
            return False
        from sglang.srt.disaggregation.common.conn import PrefillServerInfo

        dp_size, tp_size = topology
        info = front_info(bootstrap_addr, _LOOKUP_TIMEOUT_S) or {}
        if "follow_bootstrap_room" not in info:
            return False  # the prefill has not said how it routes rooms to its DP ranks yet
        # follow_bootstrap_room: a room sits on prefill DP rank room % dp_size; otherwise SGLang's decode asks
        # the bootstrap port's registry (/query_dp_ranks), where the prefill's senders registered their rooms
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=tp_size, attn_cp_size=1, dp_size=dp_size, pp_size=1, page_size=self.page_size,
            kv_cache_dtype=getattr(self.kv_args, "kv_cache_dtype_str", None),
            follow_bootstrap_room=bool(info["follow_bootstrap_room"]),
            prefill_http_port=info.get("prefill_http_port"))
        return True

    # --- PD retract rebootstrap (pause_generation(mode="retract"), continue_generation) ----
    def submit_prefill_recompute(self, kv_receiver, payload: dict) -> None:
        """Ask the prefill server of ``kv_receiver``'s room to recompute it:
        ``POST http://<bootstrap host>:<its HTTP port>/generate`` with
        ``payload`` (SGLang's ``Req.build_rebootstrap_payload()``: the same
        room, ``max_new_tokens`` 1); the prefill then sends the KV to the
        receiver as for any request. Called by SGLang's decode scheduler once
        per retracted request on every rank of the attention TP group; only
        the leader (attention TP rank 0) posts, the prefill server sends every
        rank its share. Returns at once: a thread of :class:`.recompute.Recomputer`
        posts. Any failure (no HTTP port registered by the prefill, an HTTP
        error, no answer within ``recomputer.timeout_s``) fails the room
        through the receiver's Failed poll, with a
        :class:`.recompute.PrefillRecomputeError` naming the request id, the
        room and the URL; a reply after the KV landed changes nothing."""
        if self.attn_tp_rank != 0:
            return
        url = self.prefill_url(kv_receiver.bootstrap_addr)
        call = self.recomputer.call(rid=payload.get("rid"), room=kv_receiver.bootstrap_room, url=url or "")
        kv_receiver.watch_recompute(call)
        if url is None:
            why = "registered no HTTP port (GET /kvferry)" if kv_receiver.bootstrap_addr in self.prefill_info_table \
                else "was never looked up (try_ensure_parallel_info)"
            call.failed(f"no prefill /generate URL: the prefill server at {kv_receiver.bootstrap_addr} {why}")
            return
        log.info("kvferry %s: asking the prefill server to recompute the room's %d tokens (POST %s)", call.where,
                 len(payload.get("input_ids") or ()), call.generate_url)
        self.recomputer.submit(call, payload)

    def prefill_url(self, bootstrap_addr: str) -> str | None:
        """``http://<host>:<port>`` of the prefill server behind SGLang's
        bootstrap address (its host, the HTTP port the prefill registered);
        None when the prefill is not looked up yet or registered none."""
        from sglang.srt.utils.network import NetworkAddress

        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None or getattr(info, "prefill_http_port", None) is None:
            return None
        try:
            host = NetworkAddress.parse(bootstrap_addr).host
        except ValueError:
            return None
        return NetworkAddress(host, int(info.prefill_http_port)).to_url()

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        receiver = self.receivers.get(room)
        return receiver is None or receiver.is_abort_release_safe()

    def clear_deferred_abort_state(self, room: int) -> None:
        self.receivers.pop(room, None)

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is None or info.attn_tp_size == self.core.config.tp_size

    # --- memory release and resume (release_memory_occupation, RL weight updates) -----------
    def deregister_buffer_to_engine(self) -> None:
        """SGLang's ``release_memory_occupation`` (after it cleared its queue):
        every live room fails, kvferry waits until no write reads or lands in
        the pools and unregisters them (``KVManager.release_memory``); raises
        KVTimeoutError instead of returning while a write may still land."""
        self.core.release_memory()

    def register_buffer_to_engine(self) -> None:
        """SGLang's ``resume_memory_occupation``: the pools are back at the same
        addresses; register them again and take rooms again."""
        self.core.resume_memory()

    def close(self) -> None:
        self.recomputer.close()
        self.core.close()


def _sglang_timeouts() -> dict:
    """SGLang's bootstrap and waiting timeouts (``SGLANG_DISAGGREGATION_*``),
    unless the ``KVFERRY_*`` ones are set."""
    from sglang.srt.environ import envs

    out = {}
    for field, name in (("bootstrap_timeout_s", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
                        ("transfer_timeout_s", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")):
        var = getattr(envs, name, None)
        if var is not None and not _env_sets(field):
            out[field] = float(var.get())
    return out


def _recompute_workers() -> int:
    """SGLang's ``SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`` (default 16), the
    size of its own manager's pool for these requests."""
    from sglang.srt.environ import envs

    var = getattr(envs, "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", None)
    value = var.get() if var is not None else None
    return max(1, int(value)) if value is not None else 16


def _env_sets(field: str) -> bool:
    """Whether the user set ``KVFERRY_<FIELD>`` (their value then wins)."""
    from transfer.config import ManagerConfig

    return getattr(manager_config_from_env(Role.DECODE), field) != getattr(ManagerConfig(role=Role.DECODE), field)
