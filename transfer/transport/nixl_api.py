"""How the NIXL transport reaches NIXL: the package import, and agents whose
progress thread does not spin."""

from __future__ import annotations

import threading

from transfer.errors import KVFerryError, TransferError

_AGENT_CTOR_LOCK = threading.Lock()


def new_agent(api, name: str, agent_config, progress_delay_us: int):
    """``api.nixl_agent(name, agent_config)`` whose progress thread sleeps
    ``progress_delay_us`` between polls. NIXL's Python API always passes 0
    (the thread then spins on a core: on 2 cores UCX over TCP moved 0.3 GB/s
    with 0 and 0.8-1.2 GB/s with 100 us), so its binding's constructor is
    wrapped for this one call, under a lock."""
    bindings = api.nixlBind
    with _AGENT_CTOR_LOCK:
        real = bindings.nixlAgent

        def with_delay(agent_name, config):
            config.pthrDelay = progress_delay_us
            return real(agent_name, config)

        bindings.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, agent_config)
        finally:
            bindings.nixlAgent = real


def import_api():
    from transfer.storage.nixl_probe import _import_nixl
    try:
        return _import_nixl()
    except KVFerryError as exc:
        raise TransferError(f"the NIXL transport needs NIXL: {exc}") from exc
