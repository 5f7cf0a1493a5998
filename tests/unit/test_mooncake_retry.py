"""A Mooncake write the engine gave up as stalled (no progress on its
connection for ``progress_timeout_s``, the connection dropped) is submitted
once more, each stalled descriptor once, with the same source, destination
and length; a failure that came sooner (a refusal, a dead peer), a second
stall of the same descriptor and a cancelled job fail the job as before.
A scripted engine: which submit fails, and when, is set by each test."""

import pytest

from transfer.config import EngineConfig
from transfer.errors import TransferError
from transfer.transport.mooncake import writes
from transfer.transport.mooncake.writes import MooncakeJob, MooncakeWrites

TIMEOUT_S = 10


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedEngine:
    """Submits get ids 1, 2, ...; ``fail`` names the submits (1-based, in
    submit order) that fail: pending (0) until ``after_s`` passed since their
    submit, then -1; the others land at once."""

    def __init__(self, clock: Clock, fail: set[int], after_s: float = TIMEOUT_S) -> None:
        self.clock, self.fail, self.after_s = clock, fail, after_s
        self.submits: list[tuple[str, int, int, int]] = []
        self.submitted_at: list[float] = []

    def transfer_submit_write(self, peer, src, dst, n):
        self.submits.append((peer, src, dst, n))
        self.submitted_at.append(self.clock())
        return len(self.submits)

    def transfer_check_status(self, tid):
        if tid not in self.fail:
            return 1
        return -1 if self.clock() - self.submitted_at[tid - 1] >= self.after_s else 0


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(writes.time, "monotonic", c)
    return c


def _run(engine, clock, job, *, stall_s: float) -> MooncakeWrites:
    w = MooncakeWrites(engine, EngineConfig(protocol="tcp", progress_timeout_s=TIMEOUT_S))
    w.admit(job)
    w.step(may_submit=True)  # submits every descriptor; none checked before the clock moves
    clock.now += stall_s
    for _ in range(4):
        w.step(may_submit=True)
    return w


def _job(results: list, n: int = 4) -> MooncakeJob:
    return MooncakeJob("peer", [0x1000 * (i + 1) for i in range(n)], [0x9000 * (i + 1) for i in range(n)],
                       [4096 + i for i in range(n)], results.append)


def test_stalled_descriptors_are_submitted_once_more_and_the_job_succeeds(clock):
    results: list = []
    engine = ScriptedEngine(clock, fail={2, 4})  # descriptors 1 and 3 stall: the engine drops their connections
    w = _run(engine, clock, _job(results), stall_s=TIMEOUT_S)
    assert results == [None]
    assert w.num_retried == 2
    assert engine.submits[4:] == [engine.submits[1], engine.submits[3]]  # the same src, dst and length
    assert w.num_descriptors == 4 and w.num_bytes == sum(4096 + i for i in range(4))


def test_a_failure_before_the_progress_deadline_is_not_retried(clock):
    results: list = []
    engine = ScriptedEngine(clock, fail={1}, after_s=1.0)  # a dead peer's connection: no stall
    w = _run(engine, clock, _job(results), stall_s=1.0)
    assert len(results) == 1 and isinstance(results[0], TransferError)
    assert "Mooncake status -1" in str(results[0]) and w.num_retried == 0
    assert len(engine.submits) == 4


def test_a_descriptor_that_stalls_again_fails_the_job(clock):
    results: list = []
    engine = ScriptedEngine(clock, fail={3, 5})  # descriptor 2 stalls, and its retry (submit 5) stalls too
    w = MooncakeWrites(engine, EngineConfig(protocol="tcp", progress_timeout_s=TIMEOUT_S))
    w.admit(_job(results))
    w.step(may_submit=True)
    clock.now += TIMEOUT_S
    w.step(may_submit=True)
    assert w.num_retried == 1 and results == []
    clock.now += TIMEOUT_S
    w.step(may_submit=True)
    assert len(results) == 1 and isinstance(results[0], TransferError)
    assert len(engine.submits) == 5


def test_a_cancelled_job_is_not_retried(clock):
    results: list = []
    engine = ScriptedEngine(clock, fail={1})
    job = _job(results, n=1)
    w = MooncakeWrites(engine, EngineConfig(protocol="tcp", progress_timeout_s=TIMEOUT_S))
    w.admit(job)
    w.step(may_submit=True)
    job.cancel()
    clock.now += TIMEOUT_S
    w.step(may_submit=True)
    assert len(results) == 1 and isinstance(results[0], TransferError) and w.num_retried == 0
