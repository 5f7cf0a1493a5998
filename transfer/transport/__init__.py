"""Transports: the data path's interface (:mod:`~transfer.transport.base`,
:class:`Transport`), the polling worker every engine runs on
(:mod:`~transfer.transport.worker`), the engines behind it
(:mod:`~transfer.transport.mooncake`, :mod:`~transfer.transport.nixl`), the
one place that chooses between them (:mod:`~transfer.transport.factory`), and
an in-process memcpy for unit tests (:mod:`~transfer.transport.loopback`).
Importing this package imports no engine.
"""
