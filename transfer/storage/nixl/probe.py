"""Finding NIXL and choosing its storage backend for the ``nixl://`` store:
importing NIXL (the ``nixl`` meta package's API, else a wheel's), probing
whether GPUDirect Storage can run here (driver, device, CUDA runtime, cuFile,
the plugin) and saying why not, and the fallback to POSIX when it is allowed
(:func:`choose_backend`, which :class:`~transfer.storage.nixl.agent.NixlAgent`
calls). Importing this module does not import NIXL."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os

from transfer.errors import StorageUnavailableError
from transfer.storage.nixl.config import NixlStoreConfig
from transfer.transport.nixl.api import find_nixl

__all__ = ["choose_backend", "gds_unavailable_reason", "import_nixl", "new_storage_agent", "nixl_missing_reason"]

log = logging.getLogger("kvferry.storage.nixl")

def import_nixl():
    """NIXL's Python API module (:func:`transfer.transport.nixl.api.find_nixl`);
    StorageUnavailableError saying why when it does not import."""
    try:
        return find_nixl()
    except ImportError as exc:
        raise StorageUnavailableError(str(exc)) from exc


def nixl_missing_reason() -> str:
    """Why NIXL cannot be imported here, or ``""`` when it can."""
    try:
        import_nixl()
    except StorageUnavailableError as exc:
        return str(exc)
    return ""


def _cuda_missing_reason() -> str:
    """What of GPUDirect Storage's stack this machine lacks, as far as its
    libraries tell (``""``: nothing found missing)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 not found), so no GPU"
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "no CUDA device"
    for names, what in ((("libcudart.so.12", "libcudart.so.13"), "the CUDA runtime"),
                        (("libcufile.so.0",), "cuFile (GPUDirect Storage)")):
        if not any(_loads(name) for name in names):
            return f"{what} is not installed ({' or '.join(names)} not found)"
    return ""


def _loads(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


_agent_names = itertools.count()


def new_storage_agent(api):
    """A fresh NIXL agent of ``api`` (:func:`import_nixl`) for storage: no
    backends yet, no progress or listener thread, a name unique in this
    process. Raises whatever NIXL raises."""
    config = api.nixl_agent_config(backends=[], enable_prog_thread=False, enable_listen_thread=False)
    return api.nixl_agent(f"kvferry-storage-{os.getpid()}-{next(_agent_names)}", config)


def _start_backend(agent, backend: str, memory: str) -> str:
    """Create ``backend`` in ``agent``; ``""``, or why it cannot serve here."""
    if backend not in agent.get_plugin_list():
        return f"this NIXL build has no {backend} plugin"
    try:
        agent.create_backend(backend, {})
    except Exception as exc:  # NIXL raises its own exception types
        why = _cuda_missing_reason() if backend.startswith("GDS") else ""
        return why or f"NIXL could not start it ({type(exc).__name__}: {exc})"
    mem_types = agent.get_backend_mem_types(backend)
    if f"{memory}_SEG" not in mem_types or "FILE_SEG" not in mem_types:
        return f"it moves {', '.join(mem_types)}, not {memory} to FILE"
    return ""


def gds_unavailable_reason(backend: str = "GDS", memory: str = "DRAM") -> str:
    """Why NIXL's ``backend`` (GDS or GDS_MT) cannot run here, or ``""``."""
    try:
        api = import_nixl()
    except StorageUnavailableError as exc:
        return str(exc)
    return _start_backend(new_storage_agent(api), backend, memory)


def choose_backend(agent, config: NixlStoreConfig, url: str) -> str:
    """Start ``config.backend`` in ``agent``, or POSIX when GDS cannot run and
    ``allow_fallback`` is set (logging why); returns the name of the backend
    started. StorageUnavailableError naming why when neither can serve."""
    why = _start_backend(agent, config.backend, config.memory)
    if not why:
        return config.backend
    if config.backend == "POSIX":
        raise StorageUnavailableError(f"{url}: NIXL's POSIX backend cannot run: {why}", backend=url)
    if not config.allow_fallback:
        raise StorageUnavailableError(f"{url}: NIXL's {config.backend} backend is not available here: {why} "
                                      "(allow_fallback=1 uses POSIX instead)", backend=url)
    if config.memory == "VRAM":
        raise StorageUnavailableError(f"{url}: NIXL's {config.backend} backend is not available here: {why}; "
                                      "no fallback for GPU memory (POSIX reaches host memory only)", backend=url)
    fallback_why = _start_backend(agent, "POSIX", "DRAM")
    if fallback_why:
        raise StorageUnavailableError(f"{url}: NIXL's {config.backend} backend is not available here ({why}), "
                                      f"nor POSIX ({fallback_why})", backend=url)
    log.warning("%s: NIXL's %s backend is not available here: %s; using POSIX instead", url, config.backend, why)
    return "POSIX"
