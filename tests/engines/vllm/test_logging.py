"""kvferry's log lines inside vLLM: vLLM's handler and format (time, pid,
file and line), unless the host configured the ``kvferry`` logger itself."""

from __future__ import annotations

import logging
import re

import pytest

pytest.importorskip("vllm")

from transfer.adapters.vllm import log_as_vllm  # noqa: E402


@pytest.fixture
def kvferry_logger():
    ours = logging.getLogger("kvferry")
    saved = (list(ours.handlers), ours.propagate)
    ours.handlers.clear()
    yield ours
    ours.handlers[:] = saved[0]
    ours.propagate = saved[1]


def test_kvferry_lines_carry_vllms_time_and_place(kvferry_logger):
    if not logging.getLogger("vllm").handlers:  # a server process configures it at start-up
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig())
    theirs = logging.getLogger("vllm").handlers
    assert theirs, "vLLM's logging configured no handler"
    log_as_vllm()
    log_as_vllm()  # idempotent: one copy of each handler
    assert kvferry_logger.handlers == theirs and not kvferry_logger.propagate
    record = logging.getLogger("kvferry.rooms").makeRecord(
        "kvferry.rooms", logging.WARNING, "transfer/rooms/receiver.py", 42, "room failed: room=%d", (7,), None)
    line = kvferry_logger.handlers[0].format(record)
    assert re.search(r"pid=\d+\) WARNING \d\d-\d\d \d\d:\d\d:\d\d \[receiver\.py:42\] room failed: room=7$", line), line


def test_a_host_configured_kvferry_logger_is_left_alone(kvferry_logger):
    mine = logging.StreamHandler()
    kvferry_logger.addHandler(mine)
    log_as_vllm()
    assert kvferry_logger.handlers == [mine]
