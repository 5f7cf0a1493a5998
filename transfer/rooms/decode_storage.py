"""A decode room's steps through the storage tier, as its phases take them
(:mod:`transfer.rooms.room_storage` does the loading and counts it):

- ``init``: a room given its prompt, with no state, on a rank with a tier,
  opens its :class:`~transfer.rooms.room_storage.RoomStorage`, and starts
  prefetching its leading pages unless ``storage_prefetch`` is ``off``;
- PREFETCHING (:mod:`transfer.rooms.decode_phases`): the request waits until
  the prefetch settled; the wait is counted in the rank's
  ``prefetch_wait_seconds``;
- a failure: the prefetch is cancelled, and the room is to be restored from
  storage once drained when ``storage_fallback`` and the failure allow it
  (:meth:`~transfer.rooms.decode_ending.RoomEnding.fall_back_to`);
- the tier's callbacks, on its thread: a settled prefetch advances the room
  (``advance()``, which takes ``ctx.lock``), an ended restore ends it
  (:meth:`~transfer.rooms.decode_ending.RoomEnding.restored`, under
  ``ctx.lock``).

The room calls it under ``ctx.lock``, on whatever thread holds it; the
tier's callbacks come on its thread. Nothing here blocks (storage jobs run
on the tier's thread) or raises (a prompt that does not fit is returned).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Callable

from transfer.errors import RequestError
from transfer.rooms.room_storage import RoomStorage

if TYPE_CHECKING:
    from transfer.rooms.context import RoomContext
    from transfer.rooms.decode_ending import RoomEnding
    from transfer.rooms.decode_request import RoomRequest
    from transfer.rooms.room_stats import RoomCounts


class StorageSteps:
    """The storage steps of one room, whose loads are counted in ``counts``
    and whose failure ``ending`` ends."""

    def __init__(self, ctx: RoomContext, counts: RoomCounts, ending: RoomEnding, advance: Callable[[], object]) -> None:
        self._ctx, self._counts, self._ending, self._advance = ctx, counts, ending, advance
        self._storage: RoomStorage | None = None  # with a storage tier and the prompt

    def open(self, token_ids, request: RoomRequest) -> RequestError | None:
        """``init``: with the prompt ``token_ids`` (None: not given), use the
        tier for ``request``, if the rank has one and the room fills no
        state. Returns the room's error when the prompt does not take the
        request's pages (nothing opened)."""
        ctx = self._ctx
        if ctx.storage is not None and token_ids is not None and not request.has_state:
            try:
                self._storage = RoomStorage(ctx.storage, token_ids, request, self._counts)
            except ValueError as exc:
                return RequestError(f"{self._counts.where}: {exc}")
            if ctx.config.storage_prefetch != "off":
                self._storage.prefetch(self._prefetch_done)
        return None

    @property
    def prefetching(self) -> bool:
        """Whether a prefetch runs (started and not settled yet)."""
        return self._storage is not None and self._storage.prefetching

    def prefetched(self, waited_s: float) -> bool:
        """PREFETCHING, ``waited_s`` after ``init``: whether the prefetch
        settled (the request may go out), see :meth:`RoomStorage.prefetched`."""
        if not self._storage.prefetched(waited_s, self._ctx.config):
            return False
        self._ctx.stats.prefetch_wait_seconds.observe(waited_s)
        return True

    @property
    def loading(self) -> bool:
        """Whether a prefetch may still write into the room's pages."""
        return self._storage is not None and self._storage.loading

    def fail(self, fall_back: bool) -> None:
        """The room fails: it is restored from storage once drained if
        ``fall_back`` and ``storage_fallback`` (and it uses the tier); its
        prefetch is cancelled (a batch being loaded ends first)."""
        may = fall_back and self._ctx.config.storage_fallback
        self._ending.fall_back_to(self._storage if may else None, self._restore_done)
        if self._storage is not None:
            self._storage.cancel_prefetch()

    @property
    def pages_loaded(self) -> int:
        """Pages of the room loaded from storage (prefetch and restore)."""
        return self._storage.pages_loaded if self._storage is not None else 0

    @property
    def draft_ok(self) -> bool:
        """False when a restore went on without the draft pages."""
        return self._storage is None or self._storage.draft_ok

    def _prefetch_done(self, job) -> None:
        """The prefetch's job ended (on the tier's thread): a settled
        prefetch lets the request go out now."""
        self._advance()

    def _restore_done(self, job) -> None:
        """The restore's job ended (on the tier's thread; each job has its
        own callback: a restore that ends before ``tier.read`` returned is
        still a restore)."""
        with self._ctx.lock:
            self._ending.restored(job)
