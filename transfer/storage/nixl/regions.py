"""Registration planning for the ``nixl://`` store (pure).

NIXL refuses a descriptor that is not inside one registered region and
mis-resolves overlapping registrations, so the store keeps its registrations
disjoint: :func:`plan_registration` says which registered regions to lift
and which union to register instead."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from transfer.storage.base import Segment

__all__ = ["RegionSet", "merge_regions", "plan_registration"]


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
        """Add ``region``; ValueError when it overlaps one already held."""
        if self.overlapping(*region):
            raise ValueError(f"region {region} overlaps a registered one")
        bisect.insort(self._regions, region)

    def remove(self, region: Segment) -> None:
        """Remove ``region`` (exactly as added); ValueError when not held."""
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
