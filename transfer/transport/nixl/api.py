"""How kvferry reaches NIXL: the package import (the transport and the
``nixl://`` store both find NIXL through :func:`find_nixl`), and agents whose
progress thread does not spin, nor its UCX worker lock
(:func:`backend_params`). Importing this module does not import NIXL.

UCX's EFA module (AWS Elastic Fabric Adapter) is left out on hosts without
an EFA device (``UCX_MODULES=^efa``, unless ``UCX_MODULES`` is set): NIXL's
wheel bundles its own libibverbs and libnl, and that module pulls the
system's copies in beside them; at exit the two copies' destructors crash
the process (signal 11 in ``rtnl_tc_unregister``, after everything else
worked). See :func:`skip_idle_efa`.
"""

from __future__ import annotations

import importlib
import os
import threading

from transfer.errors import TransferError

_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_INSTALL_HINT = "pip install 'kvferry[nixl]' (torch first)"

_AGENT_CTOR_LOCK = threading.Lock()


def with_progress_delay(constructor, progress_delay_us: int):
    """NIXL's binding's agent ``constructor`` (``nixlAgent(name, config)``)
    made to set the config's progress-thread poll delay first; the result
    names the delay (``progress_delay_us``)."""

    def agent(agent_name, config):
        config.pthrDelay = progress_delay_us
        return constructor(agent_name, config)

    agent.progress_delay_us = progress_delay_us
    return agent


def new_agent(api, name: str, agent_config, progress_delay_us: int):
    """``api.nixl_agent(name, agent_config)`` whose progress thread sleeps
    ``progress_delay_us`` between polls. NIXL's Python API always passes 0
    (the thread then spins on a core: on 2 cores UCX over TCP moved 0.3 GB/s
    with 0 and 0.8-1.2 GB/s with 100 us), so its binding's constructor is
    wrapped for this one call, under a lock."""
    bindings = api.nixlBind
    with _AGENT_CTOR_LOCK:
        real = bindings.nixlAgent
        bindings.nixlAgent = with_progress_delay(real, progress_delay_us)
        try:
            return api.nixl_agent(name, agent_config)
        finally:
            bindings.nixlAgent = real


#: UCX settings (``ucp_config`` keys, without the ``UCX_`` prefix) that
#: kvferry's UCX agents start with unless the host set them (the variable
#: ``UCX_<KEY>``, or the key in ``nixl_options``' ``engine_config``).
#: ``USE_MT_MUTEX``: UCX guards a worker shared by threads (NIXL's progress
#: thread and the thread that posts and polls) with a spin lock; a thread that
#: waits for it spins on a core the other needs. Measured on 2 cores, UCX over
#: TCP (docs/transports.md): a fifth to a quarter of both processes' CPU in
#: ``pthread_spin_lock``, for kvferry and raw NIXL alike; with a mutex none.
#: Raw NIXL's 8k-token requests moved 20-40% faster; kvferry's within the
#: noise, with up to 12% less CPU per GB.
UCX_DEFAULTS: tuple[tuple[str, str], ...] = (("USE_MT_MUTEX", "y"),)


def backend_params(backend: str, options, environ=os.environ) -> dict[str, str]:
    """The initialization parameters of a NIXL ``backend``: ``options``
    unchanged, and for ``UCX`` :data:`UCX_DEFAULTS` appended to its
    ``engine_config`` (comma-separated ``KEY=VALUE``, read by NIXL's UCX
    plugin into the context's UCX configuration) where neither that nor the
    environment sets them."""
    params = {str(k): str(v) for k, v in dict(options).items()}
    if backend != "UCX":
        return params
    given = params.get("engine_config", "")
    keys = {item.partition("=")[0].strip().upper() for item in given.split(",") if item.strip()}
    extra = [f"{key}={value}" for key, value in UCX_DEFAULTS
             if key not in keys and f"UCX_{key}" not in environ]
    if extra:
        params["engine_config"] = ",".join([given, *extra] if given else extra)
    return params


def skip_idle_efa(environ=os.environ, sysfs: str = "/sys/class/infiniband") -> bool:
    """Set ``UCX_MODULES=^efa`` (see the module docstring) unless it is set
    or an RDMA device of this host is driven by ``efa``; whether it did.
    UCX reads it when NIXL's first UCX agent starts."""
    if "UCX_MODULES" in environ:
        return False
    try:
        devices = os.listdir(sysfs)
    except OSError:
        devices = []
    for dev in devices:
        driver = os.path.realpath(os.path.join(sysfs, dev, "device", "driver"))
        if os.path.basename(driver) == "efa":
            return False
    environ["UCX_MODULES"] = "^efa"
    return True


def find_nixl():
    """NIXL's Python API module (the ``nixl`` meta package's, else a wheel's),
    imported on the first call; ImportError saying why (not installed, naming
    the install, or what broke) when none imports."""
    skip_idle_efa()
    broken = []
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, name.partition(".")[0]):
                broken.append(f"{name}: {exc}")
        except ImportError as exc:
            broken.append(f"{name}: {exc}")
    if broken:
        raise ImportError(f"NIXL does not import ({'; '.join(broken)})")
    raise ImportError(f"NIXL is not installed; {_INSTALL_HINT}")


def import_api():
    """:func:`find_nixl` for the transport: TransferError when it fails."""
    try:
        return find_nixl()
    except ImportError as exc:
        raise TransferError(f"the NIXL transport needs NIXL: {exc}") from exc
