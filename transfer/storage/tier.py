"""A rank's storage tier: its backend, one worker thread, and the jobs that
write pages through (prefill) and load them (decode: prefetch and fallback).

Keys come from :mod:`transfer.storage.keys`: a hash chain over the prompt's
tokens, page by page, bound to each pool's fingerprint (model name, role,
layout, dtype, page size, shape; the TP rank and size for MHA head slices),
so target and draft pages never share a key and a decode rank finds what a
prefill rank of the same layout wrote. The aux row (one row of every aux
region, stored as one value) is stored under a key of the whole prompt
(partial last page included) and of the regions' row sizes.

Every backend call runs on the ``kvferry-storage`` thread, never under the
manager's lock and never in ``poll()``; each is bounded by the backend. A
job's ``done`` callback runs on that thread once the job ended, whatever
happened; per-key misses are results, a failing backend is ``job.error``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
from collections.abc import Callable, Sequence

from bootstrap.messages import PoolRole
from transfer.errors import StorageError
from transfer.pools import MHAPool, MLAPool, aux_tensors, pool_tensors
from transfer.storage import open_storage
from transfer.storage.keys import chain_hashes, keys_from_chain
from transfer.storage.segments import pages_segments, pool_fingerprint, pool_regions

log = logging.getLogger("kvferry.storage")

# Pages per backend call: large enough to amortize a call, small enough that
# a cancelled prefetch stops soon.
BATCH_PAGES = 64


def _device_name(device) -> str:
    """``cpu``, ``cuda:0``: a device as :meth:`StorageBackend.check_memory` takes it."""
    return device.type if device.type == "cpu" or device.index is None else f"{device.type}:{device.index}"


def _devices(pools, aux) -> list[tuple[str, str]]:
    """(what, device) of every pool tensor's device and the aux tensor's."""
    out = {}
    for pool in pools:
        tensors = list(pool_tensors([pool]).values())
        for t in tensors:
            out.setdefault((f"{pool.role.value} pool", _device_name(t.device)), None)
    for i, t in enumerate(aux):
        out.setdefault((f"aux region {i}" if len(aux) > 1 else "aux tensor", _device_name(t.device)), None)
    return list(out)


class Job:
    """One unit of storage work. ``cancel()`` stops it between batches."""

    def __init__(self, what: str, run: Callable[[Job], None], done: Callable[[Job], None]) -> None:
        self.what, self._run, self._done = what, run, done
        self.cancelled = False
        self.finished = False
        self.error: BaseException | None = None
        #: per role: how many leading pages of the job are stored or loaded
        self.pages: dict[PoolRole, int] = {}
        self.aux_ok = False

    def cancel(self) -> None:
        self.cancelled = True


class StorageTier:
    """Opened by a KVManager whose config names a ``storage_url``."""

    def __init__(self, config, pools: Sequence[MHAPool | MLAPool], aux, where: str) -> None:
        """``aux``: None, an aux tensor ``[num_slots, ...]`` or a sequence of aux regions."""
        aux = aux_tensors(aux)
        self.config, self.where = config, where
        self.backend = open_storage(config.storage_url)
        try:
            for what, device in _devices(pools, aux):  # before any byte moves: a device pointer would crash it
                try:
                    self.backend.check_memory(device)
                except StorageError as exc:
                    raise StorageError(f"{where}: storage cannot serve the {what}: {exc}",
                                       backend=exc.backend) from exc
            regions = [r for p in pools for r in pool_regions(p)]
            regions.extend((t.data_ptr(), t.numel() * t.element_size()) for t in aux)
            self.backend.register_memory(regions)
        except BaseException:
            self.backend.close()
            raise
        self.pools = {p.role: p for p in pools}
        self.fingerprints = {p.role: pool_fingerprint(p, model=config.model_name, tp_rank=config.tp_rank,
                                                      tp_size=config.tp_size) for p in pools}
        self.page_size = next(iter(self.fingerprints.values())).page_size
        self._aux = tuple(aux)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # Counted on the storage thread only (read by KVManager.stats()): pages
        # read (hit) or not found (miss); written, already present, or failed.
        self.num_pages_written = self.num_pages_read = 0
        self.num_pages_missed = self.num_pages_present = self.num_pages_failed = 0
        self.num_bytes_written = self.num_bytes_read = 0
        self._thread = threading.Thread(target=self._work, name="kvferry-storage", daemon=True)
        self._thread.start()

    # --- keys ---------------------------------------------------------------------

    def chains(self, token_ids) -> list[bytes]:
        """The chain hash of every full page of a prompt."""
        return chain_hashes(token_ids, self.page_size)

    def keys(self, role: PoolRole, chains: Sequence[bytes]) -> list[str]:
        return keys_from_chain(self.fingerprints[role], chains)

    def aux_key(self, token_ids) -> str:
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        h = hashlib.blake2b(digest_size=16, person=b"kvferry-aux")
        h.update(self.config.model_name.encode() + b"\0" + struct.pack(f"<{len(tokens)}Q", *tokens))
        if len(self._aux) != 1:  # the regions' row sizes (one region: keys as before)
            h.update(b"\0" + struct.pack(f"<{len(self._aux)}Q", *(self._row_bytes(t) for t in self._aux)))
        return "aux-" + h.hexdigest()

    @property
    def has_aux(self) -> bool:
        """Whether the rank has aux regions (their rows can be stored)."""
        return bool(self._aux)

    def stats_fields(self) -> dict:
        """The tier's counters as :class:`~transfer.stats.ManagerStats` fields."""
        return dict(storage_pages={("read", "hit"): self.num_pages_read, ("read", "miss"): self.num_pages_missed,
                                   ("write", "written"): self.num_pages_written,
                                   ("write", "present"): self.num_pages_present,
                                   ("write", "failed"): self.num_pages_failed},
                    storage_bytes={"read": self.num_bytes_read, "write": self.num_bytes_written})

    @staticmethod
    def _row_bytes(t) -> int:
        return t[0].numel() * t.element_size()

    def _aux_segment(self, slot: int):
        """The slot's row of every aux region: the segments of one stored value."""
        return [(t[slot].data_ptr(), self._row_bytes(t)) for t in self._aux]

    # --- jobs ---------------------------------------------------------------------

    def write(self, items: dict[PoolRole, tuple[list[str], Sequence[int]]], aux: tuple[str, int] | None,
              done: Callable[[Job], None], ready=None) -> Job:
        """Store pages: per role (keys, page ids of this rank's pool), and
        optionally the aux row ``(key, slot)``. ``ready`` (a
        :class:`~transfer.ready.ReadyGate`): the job reads no page before it
        is done (waited for on the storage thread, bounded)."""

        def run(job: Job) -> None:
            if ready is not None:
                ready.wait()
            for role, (keys, pages) in items.items():
                stored = 0
                for b in range(0, len(keys), BATCH_PAGES):
                    if job.cancelled:
                        break
                    ks = keys[b:b + BATCH_PAGES]
                    present = self.backend.exists(ks)  # a prefix already there is not written again
                    segs = pages_segments(self.pools[role], pages[b + present:b + len(ks)])
                    ok = self.backend.put(ks[present:], segs) if segs else []
                    stored += present + sum(ok)
                    self.num_pages_written += sum(ok)
                    self.num_pages_present += present
                    self.num_pages_failed += len(ok) - sum(ok)
                    self.num_bytes_written += sum(n for seg, good in zip(segs, ok, strict=True) if good for _, n in seg)
                job.pages[role] = stored
            if aux is not None and not job.cancelled:
                key, slot = aux
                job.aux_ok = self.backend.put([key], [self._aux_segment(slot)])[0]

        return self._submit(Job("write-through", run, done))

    def read(self, items: dict[PoolRole, tuple[list[str], Sequence[int]]], aux: tuple[str, int] | None,
             done: Callable[[Job], None]) -> Job:
        """Load the leading pages storage has: per role (keys, destination
        page ids); ``job.pages[role]`` says how many loaded. Optionally the
        aux row ``(key, slot)`` (``job.aux_ok``)."""

        def run(job: Job) -> None:
            for role, (keys, pages) in items.items():
                job.pages[role] = 0
                run_len = self.backend.exists(keys) if keys else 0
                self.num_pages_missed += len(keys) - run_len  # counted as read hits or misses once
                for b in range(0, run_len, BATCH_PAGES):
                    if job.cancelled:
                        break
                    end = min(run_len, b + BATCH_PAGES)
                    segs = pages_segments(self.pools[role], pages[b:end])
                    ok = self.backend.get_into(keys[b:end], segs)
                    good = next((i for i, x in enumerate(ok) if not x), len(ok))
                    job.pages[role] = b + good
                    self.num_pages_read += good
                    self.num_bytes_read += sum(n for seg in segs[:good] for _, n in seg)
                    if good < len(ok):
                        self.num_pages_missed += run_len - b - good
                        break
            if aux is not None and not job.cancelled:
                key, slot = aux
                job.aux_ok = self.backend.get_into([key], [self._aux_segment(slot)])[0]

        return self._submit(Job("prefetch", run, done))

    def _submit(self, job: Job) -> Job:
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job._run(job)
            except Exception as exc:  # the backend as a whole failed; the worker goes on
                job.error = exc
                log.warning("%s: storage %s failed: %s", self.where, job.what, exc)
            job.finished = True
            try:
                job._done(job)
            except Exception:
                log.exception("%s: a storage completion callback raised", self.where)

    def close(self, timeout_s: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)
        self.backend.close()
