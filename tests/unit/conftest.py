"""Fixtures of the unit suite: ``cluster``, prefill and decode managers in
one process over the loopback pair (:mod:`tests.unit._rooms`)."""

from ._rooms import cluster  # noqa: F401  (pytest finds fixtures by name here)
