"""The Mooncake transfer engine behind the :class:`~transfer.transport.base.Transport`
interface:

- :mod:`~transfer.transport.mooncake.transport`: :class:`MooncakeTransport`,
  the only module of ``transfer`` that builds the transfer engine; the
  writes it moves with it, per peer, in
  :mod:`~transfer.transport.mooncake.writes`;
- :mod:`~transfer.transport.mooncake.process`: what the engine needs of its
  process and does to it (``MC_*`` settings, start-up logs, the slow
  destructor, which wheel moves device memory, RDMA devices); the Mooncake
  Store's client uses it too.

Importing this package imports no Mooncake: the engine is imported when a
transport is built.
"""
