"""Scripted ranks and process launchers shared by the tests, the benchmark and
the demo: :mod:`~harness.workload` (a batch of rooms between scripted ranks),
:mod:`~harness.rankctl` (long-lived ranks driven over stdin),
:mod:`~harness.launch` (bootstrap server and rank processes, bounded waits)
and :mod:`~harness.local_mooncake` (a Mooncake master and holder on loopback).

Not part of the installed library: nothing in ``transfer`` or ``bootstrap``
imports it.
"""
