"""NIXL plumbing for the ``nixl://`` store (:mod:`transfer.storage.nixl`):
finding and importing NIXL, choosing its storage backend (GDS where it can
run, else a clear reason), the agent's registration and bounded transfers,
and the disjoint-registration planning NIXL needs. Importing this module
does not import NIXL."""

from __future__ import annotations

import bisect
import ctypes
import importlib
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from transfer.errors import StorageError, StorageTimeoutError, StorageUnavailableError
from transfer.storage.base import Segment

if TYPE_CHECKING:
    from transfer.storage.nixl import NixlStoreConfig

log = logging.getLogger("kvferry.storage.nixl")

_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
_INSTALL_HINT = "pip install 'kvferry[nixl]' (torch first)"


def merge_regions(regions: Iterable[Segment]) -> list[Segment]:
    """The sorted union of ``regions``: overlapping or touching ones become one."""
    merged: list[Segment] = []
    for addr, nbytes in sorted(regions):
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            start, length = merged[-1]
            merged[-1] = (start, max(length, addr + nbytes - start))
        else:
            merged.append((addr, nbytes))
    return merged


class RegionSet:
    """Disjoint ``(address, nbytes)`` regions, sorted, with bisect lookups."""

    def __init__(self, regions: Iterable[Segment] = ()) -> None:
        self._regions: list[Segment] = []
        for region in regions:
            self.add(region)

    def __iter__(self):
        return iter(list(self._regions))

    def __len__(self) -> int:
        return len(self._regions)

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether one region holds all of ``[addr, addr + nbytes)``."""
        i = bisect.bisect_right(self._regions, (addr, float("inf"))) - 1
        return i >= 0 and addr + nbytes <= self._regions[i][0] + self._regions[i][1]

    def overlapping(self, addr: int, nbytes: int) -> list[Segment]:
        """The regions sharing a byte with ``[addr, addr + nbytes)``."""
        i = max(bisect.bisect_right(self._regions, (addr, float("inf"))) - 1, 0)
        found = []
        for start, length in itertools.islice(self._regions, i, None):
            if start >= addr + nbytes:
                break
            if start + length > addr:
                found.append((start, length))
        return found

    def add(self, region: Segment) -> None:
        if self.overlapping(*region):
            raise ValueError(f"region {region} overlaps a registered one")
        bisect.insort(self._regions, region)

    def remove(self, region: Segment) -> None:
        self._regions.remove(region)


def plan_registration(registered: RegionSet, wanted: Iterable[Segment]) -> tuple[list[Segment], list[Segment]]:
    """``(lift, add)``: deregister the registered regions ``lift`` and register
    ``add``, and every wanted region lies inside one registered region while
    no two overlap. Both empty when ``registered`` already covers ``wanted``."""
    missing = [region for region in wanted if not registered.covers(*region)]
    if not missing:
        return [], []
    lift = sorted({found for region in missing for found in registered.overlapping(*region)})
    return lift, merge_regions(missing + lift)


# -- NIXL --------------------------------------------------------------------


def _import_nixl():
    """NIXL's Python API module (the ``nixl`` meta package's, else a wheel's);
    StorageUnavailableError naming the install when none imports."""
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
        raise StorageUnavailableError(f"NIXL does not import ({'; '.join(broken)})")
    raise StorageUnavailableError(f"NIXL is not installed; {_INSTALL_HINT}")


def nixl_missing_reason() -> str:
    """Why NIXL cannot be imported here, or ``""`` when it can."""
    try:
        _import_nixl()
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


def _new_agent(api):
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
        api = _import_nixl()
    except StorageUnavailableError as exc:
        return str(exc)
    return _start_backend(_new_agent(api), backend, memory)


def _choose_backend(agent, config: NixlStoreConfig, url: str) -> str:
    """Start the configured backend, or POSIX when allowed; returns its name."""
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


class _TransferStuck(StorageTimeoutError):
    """A transfer ran past its deadline and NIXL could not cancel it: it may
    still touch its memory and files, so the store stops."""


class _Agent:
    """The store's NIXL agent and its one backend: every NIXL call of the store
    goes through here, and NIXL's exceptions become kvferry's."""

    def __init__(self, api, config: NixlStoreConfig, url: str) -> None:
        self._url = url
        try:
            self._agent = _new_agent(api)
        except Exception as exc:
            raise StorageUnavailableError(f"{url}: cannot create a NIXL agent: {exc}", backend=url) from exc
        self.backend = _choose_backend(self._agent, config, url)
        self.memory = config.memory
        self.device_id = config.device_id if config.memory == "VRAM" else 0  # NIXL's DRAM descriptors say 0

    def _reg_descs(self, regions: Sequence[Segment], files: Sequence[int]):
        if files:
            return self._agent.get_reg_descs([(0, 0, fd, "") for fd in files], "FILE")
        return self._agent.get_reg_descs([(addr, n, self.device_id, "") for addr, n in regions], self.memory)

    def register(self, regions: Sequence[Segment] = (), files: Sequence[int] = ()) -> None:
        """Register memory regions, or whole files by fd (one kind per call)."""
        if regions or files:
            try:
                self._agent.register_memory(self._reg_descs(regions, files), backends=[self.backend])
            except Exception as exc:
                what = "files" if files else f"{len(regions)} {self.memory} regions"
                raise StorageError(f"{self._url}: NIXL could not register {what}: {exc}", backend=self._url) from exc

    def deregister(self, regions: Sequence[Segment] = (), files: Sequence[int] = ()) -> None:
        if regions or files:
            try:
                self._agent.deregister_memory(self._reg_descs(regions, files), backends=[self.backend])
            except Exception as exc:
                raise StorageError(f"{self._url}: NIXL could not deregister: {exc}", backend=self._url) from exc

    def move(self, op: str, memory: list, files: list, deadline: float) -> bool:
        """One NIXL transfer (``WRITE``: memory to files; ``READ``: back),
        polled until ``deadline``. True when done, False when NIXL failed it.
        StorageTimeoutError past the deadline: the transfer was cancelled, or,
        when ``stuck`` is set on the exception, could not be."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(np.array(memory, dtype=np.uint64), self.memory),
                                           agent.get_xfer_descs(np.array(files, dtype=np.uint64), "FILE"),
                                           agent.name, backends=[self.backend])
        except Exception as exc:
            log.warning("%s: NIXL refused a %s of %d descriptors: %s", self._url, op, len(files), exc)
            return False
        state, pause = self._poll(agent.transfer, handle), 20e-6
        while state == "PROC":  # checked at least once after the post, which may itself take a while
            state = self._poll(agent.check_xfer_state, handle)
            if state != "PROC" or time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:
            if state == "PROC":
                raise _TransferStuck(f"{self._url}: a NIXL {op} ran past its deadline and could not be cancelled "
                                     f"({exc}); the store stops", backend=self._url) from exc
            log.warning("%s: NIXL could not release a finished %s: %s", self._url, op, exc)
        if state == "PROC":
            raise StorageTimeoutError(f"{self._url}: a NIXL {op} of {len(files)} descriptors did not finish in time; "
                                      "cancelled", backend=self._url)
        return state == "DONE"

    @staticmethod
    def _poll(call, handle) -> str:
        try:
            return call(handle)
        except Exception as exc:  # a failed I/O surfaces as a raised NIXL status
            log.debug("NIXL transfer failed: %s", exc)
            return "ERR"


# -- the store ---------------------------------------------------------------
