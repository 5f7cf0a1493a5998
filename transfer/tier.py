"""Deprecated path: the storage tier lives in :mod:`transfer.storage.tier`."""

from transfer.storage.tier import BATCH_PAGES, Job, StorageTier

__all__ = ["BATCH_PAGES", "Job", "StorageTier"]
