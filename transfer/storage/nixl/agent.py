"""The ``nixl://`` store's NIXL agent: registration of memory and files and
bounded transfers, with NIXL's exceptions translated into kvferry's
(:mod:`~transfer.storage.nixl.store` is the store built on it; backend
selection is :func:`~transfer.storage.nixl.probe.choose_backend`).
Importing this module does not import NIXL."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from transfer.errors import StorageError, StorageTimeoutError, StorageUnavailableError
from transfer.storage.base import Segment
from transfer.storage.nixl.config import NixlStoreConfig
from transfer.storage.nixl.probe import choose_backend, new_storage_agent

__all__ = ["NixlAgent", "TransferStuckError"]

log = logging.getLogger("kvferry.storage.nixl")


class TransferStuckError(StorageTimeoutError):
    """A transfer ran past its deadline and NIXL could not cancel it: it may
    still touch its memory and files, so the store stops (it keeps the files
    open and the registrations in place, and refuses later calls). Raised by
    :meth:`NixlAgent.move`; the store's callers catch it as the
    StorageTimeoutError it is (kvferry's exception tree does not name it)."""


class NixlAgent:
    """The store's NIXL agent and its one backend: every NIXL call of the store
    goes through here, and NIXL's exceptions become kvferry's. ``backend``:
    the NIXL backend started (POSIX after a fallback); ``memory`` and
    ``device_id``: what its memory descriptors name. Not thread-safe: the
    store's lock serialises its callers.

    ``api`` is NIXL's module (:func:`~transfer.storage.nixl.probe.import_nixl`);
    StorageUnavailableError when no agent or backend can be started."""

    def __init__(self, api, config: NixlStoreConfig, url: str) -> None:
        self._url = url
        try:
            self._agent = new_storage_agent(api)
        except Exception as exc:
            raise StorageUnavailableError(f"{url}: cannot create a NIXL agent: {exc}", backend=url) from exc
        self.backend = choose_backend(self._agent, config, url)
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
        """Deregister memory regions, or files by fd (one kind per call)."""
        if regions or files:
            try:
                self._agent.deregister_memory(self._reg_descs(regions, files), backends=[self.backend])
            except Exception as exc:
                raise StorageError(f"{self._url}: NIXL could not deregister: {exc}", backend=self._url) from exc

    def move(self, op: str, memory: list, files: list, deadline: float) -> bool:
        """One NIXL transfer (``WRITE``: memory to files; ``READ``: back),
        polled until ``deadline``. True when done, False when NIXL failed it.
        StorageTimeoutError past the deadline when the transfer was cancelled;
        :class:`TransferStuckError` when it could not be."""
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
                raise TransferStuckError(f"{self._url}: a NIXL {op} ran past its deadline and could not be cancelled "
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
