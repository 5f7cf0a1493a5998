"""How a room's failure reaches SGLang, for the sender and the receiver alike.

An adapter (``KvferryKVSender`` / ``KvferryKVReceiver``) keeps the first
error of its own (``_error``), its kvferry room (``_core``: None until built)
and ``conclude_state``, SGLang's settled poll. :func:`fail_room` records an
error and ends the room; :func:`raise_failure` is ``failure_exception()``.
"""

from __future__ import annotations

import logging
from typing import NoReturn

from transfer.errors import TransferError
from transfer.state import KVPoll

log = logging.getLogger("kvferry.sglang")


class FailedOnAnotherRank(TransferError):
    """SGLang's MIN all-reduce failed the room because another rank failed."""

    is_from_another_rank = True


def fail_room(adapter, error: BaseException, side: str) -> None:
    """``adapter``'s room failed with ``error`` (the first one is kept): a live
    kvferry room is aborted (its peers are told), else SGLang's poll settles
    on Failed. ``side``: "sender" or "receiver", for the log line."""
    log.warning("kvferry %s room %s failed: %s", side, adapter.bootstrap_room, error)
    if adapter._error is None:
        adapter._error = error
    core = adapter._core
    if core is not None and core.poll() not in (KVPoll.Success, KVPoll.Failed):
        core.abort(str(error))
    else:
        adapter.conclude_state = KVPoll.Failed


def raise_failure(error: BaseException | None, core, room: int, side: str) -> NoReturn:
    """Raise why a room failed: the adapter's own ``error``, else its kvferry
    room's (``core``: a KVSender or KVReceiver, None if never built), else
    :class:`FailedOnAnotherRank`. SGLang asks once its poll, a MIN over the
    TP ranks, said Failed: when this rank's own room is still live (another
    rank failed it), it is aborted here, so that its peers stop and its
    drain starts at once (``is_abort_release_safe`` turns true as soon as no
    write may land), not at a timeout."""
    if error is not None:
        raise error
    if core is not None:
        state = core.poll()
        if state is KVPoll.Failed:
            core.failure_exception()
        if state is not KVPoll.Success:
            core.abort(f"failed on another rank of this SGLang {side} server (SGLang fails a room on all its "
                       "TP ranks)")
    raise FailedOnAnotherRank(f"room {room}: failed on another rank")
