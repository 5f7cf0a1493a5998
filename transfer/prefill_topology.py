"""A prefill node's parallel sizes, as a decode rank learns them from the
bootstrap server before it sends the node any request (SGLang's
``try_ensure_parallel_info``): one bounded lookup of the node's DP group 0,
for :meth:`KVManager.prefill_topology <transfer.manager.KVManager.prefill_topology>`."""

from __future__ import annotations

from typing import NamedTuple

from bootstrap.client import BootstrapClient


class PrefillTopology(NamedTuple):
    """A prefill node's parallel sizes, as its ranks registered them."""

    dp_size: int
    tp_size: int


def lookup_topology(bootstrap_addr: str, node_id: str, *, timeout_s: float,
                    secret: str | None) -> PrefillTopology | None:
    """The DP and TP sizes of prefill node ``node_id`` at the bootstrap
    server ``bootstrap_addr``, once its DP group 0 fully registered; None
    until then (or while the server knows nothing of the node). One lookup
    (``secret`` seals it), from any thread, blocking at most ``timeout_s``;
    raises :class:`~transfer.errors.BootstrapUnavailable` when the server
    does not answer in time, :class:`~transfer.errors.BootstrapError` when
    it refuses."""
    with BootstrapClient(bootstrap_addr, timeout_s=timeout_s, secret=secret) as client:
        reply = client.lookup(node_id, 0)
    if not reply.ready or reply.dp_size < 1:
        return None
    return PrefillTopology(dp_size=reply.dp_size, tp_size=reply.tp_size)
