"""NIXL behind the :class:`~transfer.transport.base.Transport` interface
(docs/transports.md says when to use it):

- :mod:`~transfer.transport.nixl.transport`: :class:`NixlTransport`, one agent
  per transport, its own peer-metadata exchange; its writes in flight in
  :mod:`~transfer.transport.nixl.writes`;
- :mod:`~transfer.transport.nixl.peers`: the metadata blob peers exchange and
  the regions it announces (pure);
- :mod:`~transfer.transport.nixl.api`: finding NIXL (also for the ``nixl://``
  store) and agents whose progress thread does not spin.

Importing this package imports no NIXL.
"""
