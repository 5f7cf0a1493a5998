"""The NIXL store's pure parts: registration planning and file descriptors
(no NIXL needed). NIXL needs every descriptor inside one registered region
and mis-resolves overlapping registrations, so a plan must keep them disjoint."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.storage.nixl.files import file_descriptors
from transfer.storage.nixl.regions import RegionSet, merge_regions, plan_registration

regions = st.lists(st.tuples(st.integers(1, 2000), st.integers(1, 300)), max_size=12)


def disjoint(found) -> RegionSet:
    """A RegionSet of the disjoint regions among ``found`` (first come first kept)."""
    kept = RegionSet()
    for region in found:
        if not kept.overlapping(*region):
            kept.add(region)
    return kept


def test_merge_joins_overlapping_and_touching_regions_only():
    assert merge_regions([(10, 5), (0, 5), (5, 2), (20, 1), (12, 10)]) == [(0, 7), (10, 12)]
    assert merge_regions([]) == []


def test_region_set_lookups():
    regs = RegionSet([(100, 50), (10, 10), (200, 1)])
    assert list(regs) == [(10, 10), (100, 50), (200, 1)]
    assert regs.covers(100, 50) and regs.covers(120, 5) and not regs.covers(140, 20) and not regs.covers(5, 1)
    assert regs.overlapping(15, 100) == [(10, 10), (100, 50)]
    assert regs.overlapping(20, 80) == []  # touching is not overlapping
    with pytest.raises(ValueError, match="overlaps"):
        regs.add((149, 2))


@settings(max_examples=300, deadline=None)
@given(registered=regions, wanted=regions)
def test_a_plan_covers_every_wanted_region_with_one_region_and_keeps_them_disjoint(registered, wanted):
    regs = disjoint(registered)
    before = list(regs)
    lift, add = plan_registration(regs, wanted)
    assert set(lift) <= set(before)
    for region in lift:
        regs.remove(region)
    for region in add:
        regs.add(region)  # raises if the plan made two registrations overlap
    assert all(regs.covers(*region) for region in wanted)
    assert all(regs.covers(*region) for region in before), "what was registered stays covered"
    if all(disjoint(before).covers(*region) for region in wanted):
        assert (lift, add) == ([], [])


def test_file_descriptors_place_segments_one_after_another_after_the_header():
    assert file_descriptors(7, [(1000, 10), (5000, 4096), (64, 1)]) == [
        (4096, 10, 7), (4106, 4096, 7), (8202, 1, 7)]
