"""Room and rank stats over the loopback pair (what moved, by pool and path,
checked against the pages sent), failure reasons, the one-line failure log,
the log level setting, and a rank's /metrics scraped over HTTP."""

import logging
import time
import re
import urllib.request

import numpy as np
import pytest

from harness.ports import free_port
from transfer import KVPoll, KVReceiver
from transfer.config import ManagerConfig, Role, apply_log_level, manager_config_from_env
from transfer.errors import (AuthError, ClosedError, IncompatibleLayoutError, KVTimeoutError, PeerError,
                             ProtocolError, StorageMissError, StorageTimeoutError, TransferError)
from transfer.stats import FailureReason, RankTotals, failure_reason, tag_reason

from ._rooms import (AUX_BYTES, HEAD_DIM, NUM_HEADS, NUM_LAYERS, PAGE_SIZE, opened, random_pages, run_room,
                     wait_until)

PAGE_BYTES = PAGE_SIZE * NUM_HEADS * HEAD_DIM * 2 * NUM_LAYERS * 2  # bf16, K and V of every layer
# Unfenced: the aux row is a direct write, counted as such (a fenced decode
# rank gets it in the room's final control message; see test_rooms_fence.py).
STAGED = dict(staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20, write_fence=False)
FAILURE = re.compile(r"^room failed: side=(prefill|decode) node=\S+ dp=\d+ tp=\d+/\d+ room=(\d+) peer=(\S+) "
                     r"reason=([a-z_]+) age=(\d+\.\d\ds) error=(\w+): .+$")


@pytest.mark.parametrize("error, reason", [
    (ClosedError("x"), "closed"), (AuthError("x"), "auth"), (IncompatibleLayoutError("f", 1, 2), "incompatible"),
    (StorageMissError("x"), "storage_miss"), (KVTimeoutError("x"), "timeout"), (StorageTimeoutError("x"), "timeout"),
    (TransferError("x"), "transfer_error"), (IndexError("x"), "bounds"), (ValueError("x"), "bounds"),
    (PeerError("x"), "refused"), (ProtocolError("x"), "other"), (RuntimeError("x"), "other"),
    (tag_reason(PeerError("x"), FailureReason.PEER_LOST), "peer_lost"),
    (tag_reason(PeerError("x"), FailureReason.ABORTED), "aborted"),
])
def test_failure_reasons_by_tag_then_type(error, reason):
    assert failure_reason(error).value == reason


def test_a_room_is_counted_once_and_its_histograms_hold_it():
    totals = RankTotals("decode")
    c = totals.room(3)
    c.add("target", "direct", 1000, 4)
    c.done(None)
    c.done(PeerError("late"))  # already ended: ignored
    s = totals.snapshot()
    assert s.rooms == {("Success", ""): 1}
    assert s.bytes == {("target", "direct"): 1000} and s.descriptors == {("target", "direct"): 4}
    assert s.room_seconds.num == s.first_byte_seconds.num == 1
    assert c.snapshot("Success").total_bytes == 1000


def _expected(pages: int) -> dict:
    return {("target", "direct"): pages * PAGE_BYTES, ("aux", "direct"): AUX_BYTES}


def test_direct_room_stats_count_what_moved(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(30)
    src, dst = random_pages(rng, 12), random_pages(rng, 12)
    sender, receiver = run_room(prefill, decode, 50, src, dst, chunks=3)
    p, d = sender.stats(), receiver.stats()
    assert (p.state, d.state, p.reason, d.reason) == ("Success", "Success", None, None)
    assert p.bytes == d.bytes == _expected(12)
    assert p.bytes_of(pool="target") == 12 * PAGE_BYTES
    # direct descriptors: at most one per page and buffer (runs merge), plus the aux row
    assert 1 < p.descriptors[("target", "direct")] <= 12 * 2 * NUM_LAYERS and p.descriptors[("aux", "direct")] == 1
    assert prefill.mgr.transport.num_descriptors == p.total_descriptors
    assert prefill.mgr.transport.num_bytes == p.total_bytes
    for s in (p, d):
        assert s.requested_at <= s.first_byte_at <= s.done_at and s.requested_wall <= s.done_wall
        assert s.seconds >= s.first_byte_seconds >= 0
    for mgr, s in ((prefill.mgr, p), (decode.mgr, d)):
        totals = mgr.stats()
        assert totals.rooms == {("Success", ""): 1} and totals.live_rooms == 0
        assert totals.bytes == s.bytes and totals.room_seconds.num == 1
        assert totals.control_received > 0 and totals.control_malformed == 0


def test_staged_room_stats_count_parts(cluster):
    prefill, decode = cluster.rank(Role.PREFILL, **STAGED), cluster.rank(Role.DECODE, **STAGED)
    rng = np.random.default_rng(31)
    src, dst = random_pages(rng, 30), random_pages(rng, 30)
    sender, receiver = run_room(prefill, decode, 51, src, dst, chunks=2)
    p, d = sender.stats(), receiver.stats()
    assert p.state == d.state == "Success"
    want = {("target", "staged"): 30 * PAGE_BYTES, ("aux", "direct"): AUX_BYTES}
    assert p.bytes == d.bytes == want
    assert p.num_parts == d.num_parts == 8  # 1 KiB pages in parts of 4 KiB, per chunk of 15 pages
    assert p.descriptors == {("target", "staged"): 8, ("aux", "direct"): 1}
    assert d.descriptors == {("target", "staged"): 8}
    assert prefill.mgr.stats().staging_capacity_bytes == 1 << 20


def test_an_abort_is_one_warning_line_per_side_with_its_reason(cluster, caplog):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(32)
    src, dst = random_pages(rng, 16), random_pages(rng, 16)
    cluster.fabric.hold_writes()
    sender, receiver = opened(prefill, decode, 52, src, dst)
    sender.send(src[:8])
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        receiver.abort()
        wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, what="prefill failed")
        cluster.fabric.release_writes()
        wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="decode failed")
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "room=52" in r.getMessage()]
    assert len(lines) == 2, lines
    sides = {}
    for line in lines:
        m = FAILURE.match(line)
        assert m, line
        sides[m.group(1)] = m.groups()
    assert set(sides) == {"prefill", "decode"}
    assert sides["prefill"][3] == sides["decode"][3] == "aborted"
    assert all(0 <= float(side[4].rstrip("s")) < 30 for side in sides.values()), sides  # the room's age
    assert sides["prefill"][2] == decode.mgr.rank.session and sides["decode"][2] == prefill.mgr.rank.session
    assert sender.stats().reason == receiver.stats().reason == "aborted"
    assert decode.mgr.stats().rooms == {("Failed", "aborted"): 1}
    assert prefill.mgr.stats().rooms == {("Failed", "aborted"): 1}


def test_an_incompatible_handshake_is_counted_as_incompatible(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE, page_size=8)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 53)
    receiver.init(random_pages(np.random.default_rng(33), 3), 2)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="handshake refused")
    assert receiver.stats().reason == "incompatible" and receiver.stats().total_bytes == 0
    assert decode.mgr.stats().rooms == {("Failed", "incompatible"): 1}


def test_log_level_setting(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("KVFERRY_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KVFERRY_LOG_LEVEL", "DEBUG")
    config = manager_config_from_env(Role.DECODE)
    assert config.log_level == "DEBUG" and config.engine.log_level == "OFF"  # the engine knows no DEBUG: its default stays
    monkeypatch.setenv("KVFERRY_METRICS_PORT", "9464")
    assert manager_config_from_env(Role.DECODE).metrics_port == 9464
    with pytest.raises(ValueError, match="log_level"):
        ManagerConfig(role=Role.DECODE, log_level="LOUD")
    with pytest.raises(ValueError, match="metrics_port"):
        ManagerConfig(role=Role.DECODE, metrics_port=70000)
    logger = logging.getLogger("kvferry")
    before = logger.level
    try:
        apply_log_level("TRACE")
        assert logging.getLogger("kvferry.receiver").getEffectiveLevel() == logging.DEBUG
        apply_log_level("")
        assert logger.level == logging.DEBUG  # empty: unchanged
    finally:
        logger.setLevel(before)


def test_metrics_of_two_managers_on_one_port_over_http(cluster, monkeypatch):
    """Both managers' numbers, summed by role; a scrape is a periodic round
    (``metrics``, the port's first manager's) that may give the interpreter
    lock up between any two families it builds and formats."""
    from transfer.round_times import HOLD_KINDS, PERIODIC_TASKS, _Round

    parser = pytest.importorskip("prometheus_client.parser")
    port = free_port()
    prefill, decode = cluster.rank(Role.PREFILL, metrics_port=port), cluster.rank(Role.DECODE, metrics_port=port)
    rng = np.random.default_rng(34)
    src, dst = random_pages(rng, 5), random_pages(rng, 5)
    run_room(prefill, decode, 54, src, dst, chunks=1)
    ticks, tick = [], _Round.tick

    def counted(round_):
        if round_.task == "metrics":
            ticks.append(1)
        tick(round_)

    monkeypatch.setattr(_Round, "tick", counted)
    kinds_before = {s.side: s.periodic_max_by_kind_s for s in (prefill.mgr.stats(), decode.mgr.stats())}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    kinds_after = {s.side: s.periodic_max_by_kind_s for s in (prefill.mgr.stats(), decode.mgr.stats())}
    families = list(parser.text_string_to_metric_families(text))
    assert len(ticks) >= 2 + len(families)  # before each manager's stats and each family
    assert prefill.mgr.stats().periodic_rounds.get("metrics", 0) >= 1
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families for s in fam.samples}
    for role in ("prefill", "decode"):
        key = ("kvferry_bytes_total", (("path", "direct"), ("pool", "target"), ("role", role)))
        assert got[key] == 5 * PAGE_BYTES
        assert got[("kvferry_rooms_total", (("reason", ""), ("role", role), ("state", "Success")))] == 1
        assert got[("kvferry_room_seconds_count", (("role", role),))] == 1
        assert got[("kvferry_live_rooms", (("role", role),))] == 0
    assert not any("room=" in k[0] or "room" in dict(k[1]) for k in got)  # no room ids as labels
    by_kind = {k: v for k, v in got.items() if k[0] == "kvferry_periodic_round_max_by_kind_seconds"}
    tasks = [t for t in PERIODIC_TASKS if t != "gc"]
    assert len(by_kind) == 2 * len(tasks) * len(HOLD_KINDS)  # every task and kind, as 0 until one is measured
    for (_, labels), value in by_kind.items():  # each a longest hold taken between the two snapshots
        labels = dict(labels)
        before, after = (k[labels["role"]].get(labels["kind"], {}).get(labels["task"], 0.0)
                         for k in (kinds_before, kinds_after))
        assert before <= value <= after, (labels, before, value, after)
    assert any(by_kind.values())  # decode's resolver round for the room above, at least
    prefill.mgr.close()
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).close()  # decode still serves
    decode.mgr.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_metrics_port_without_prometheus_client_is_a_clear_error(cluster, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ValueError, match="needs prometheus-client"):
        cluster.rank(Role.DECODE, metrics_port=free_port())


def test_exposed_transfer_time_runs_from_prefills_last_send_to_decodes_success(cluster):
    """Writes held for 0.4 s after the last send(): decode's exposed transfer
    time covers the hold, and not the time before that send (the room waited
    0.3 s between init and its one send, as a forward pass would)."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(31)
    src, dst = random_pages(rng, 8), random_pages(rng, 8)
    sender, receiver = opened(prefill, decode, 52, src, dst)
    time.sleep(0.3)  # "the forward pass"
    cluster.fabric.hold_writes()
    sender.send(src, last=True)
    time.sleep(0.4)
    cluster.fabric.release_writes()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Success, what="decode success")
    d = receiver.stats()
    assert d.exposed_transfer_s is not None and 0.4 <= d.exposed_transfer_s < d.seconds - 0.3, d
    assert sender.stats().exposed_transfer_s is None  # a decode-side number
    totals = decode.mgr.stats()
    assert totals.exposed_transfer_seconds.num == 1 and totals.exposed_transfer_seconds.total == pytest.approx(
        d.exposed_transfer_s)


def test_with_a_ready_event_the_exposed_transfer_time_runs_from_its_completion(cluster):
    """An engine on a GPU calls send() as it launches the forward and passes
    an event: the forward ends when the event completes (0.5 s after the
    call here), and the exposed transfer time counts from there, not from
    the call."""
    from ._fakecuda import FakeEvent

    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(32)
    src, dst = random_pages(rng, 8), random_pages(rng, 8)
    sender, receiver = opened(prefill, decode, 53, src, dst)
    event = FakeEvent()
    sender.send(src, last=True, ready=event)
    time.sleep(0.5)  # the forward runs on the device
    event.complete()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Success, what="decode success")
    d = receiver.stats()
    assert d.exposed_transfer_s is not None and 0 < d.exposed_transfer_s < 0.3, d


def test_a_sliced_round_gives_the_interpreter_lock_up_every_slice():
    """A sweep over many rooms (0.1 ms of CPU each here) is cut into slices
    of about SLICE_CPU_S: each slice is a round, none much longer."""
    from harness.busywork import python_work
    from transfer.round_times import SLICE_CPU_S, RoundTimes

    times = RoundTimes()
    with times.round("sweep") as sweep:
        for _ in range(50):
            until = time.thread_time() + 0.0001
            while time.thread_time() < until:
                python_work(0.00002)
            sweep.tick()
    assert times.rounds["sweep"] >= 5000 * 1e-6 / SLICE_CPU_S / 2, times.rounds
    assert times.max_cpu_s["sweep"] < SLICE_CPU_S + 0.0005, times.max_cpu_s  # a slice and an item, and margin
    with times.round("liveness"):
        pass
    rounds = times.snapshot()["periodic_rounds"]
    rounds.pop("gc", None)  # a collection that ran inside a round, counted apart (next test)
    assert rounds == {"sweep": times.rounds["sweep"], "liveness": 1}
    with times.round("control") as round_:  # the CPU before restart() is not the round's
        python_work(0.005)
        round_.restart()
    assert times.max_cpu_s["control"] < 0.002, times.max_cpu_s


def test_a_part_known_to_be_long_gets_a_slice_of_its_own(monkeypatch):
    """``tick(ahead_s)``: the round gives the lock up before a part that
    would take the slice past SLICE_CPU_S (a new peer's socket), so a hold is
    that part alone, not a slice and the part (a thread clock stands in)."""
    from transfer.round_times import SLICE_CPU_S, RoundTimes, _Round

    clock = [0.0]
    monkeypatch.setattr(_Round, "_own", lambda self: clock[0])
    monkeypatch.setattr(_Round, "_wall", lambda self: clock[0])
    times = RoundTimes()
    with times.round("resolver") as round_:
        clock[0] += 0.6 * SLICE_CPU_S
        round_.tick()  # under a slice: goes on
        assert times.rounds.get("resolver", 0) == 0
        round_.tick(ahead_s=0.5 * SLICE_CPU_S)  # with the part ahead it would pass: gives the lock up first
        assert times.rounds["resolver"] == 1
        clock[0] += 0.9 * SLICE_CPU_S  # the part
    assert times.rounds["resolver"] == 2
    assert times.max_cpu_s["resolver"] == pytest.approx(0.9 * SLICE_CPU_S)


def test_a_round_counts_its_cpu_time_but_never_more_than_the_wall_time_that_passed(monkeypatch):
    """A thread cannot run longer than the time that passed; on this VM its
    CPU clock was seen 4.6 ms ahead in 0.08 ms (docs/threads.md): a hold is
    the CPU time, capped at the wall time (fake clocks stand in for both)."""
    from transfer.round_times import RoundTimes, _Round

    cpu, wall = [0.0], [0.0]
    monkeypatch.setattr(_Round, "_own", lambda self: cpu[0])
    monkeypatch.setattr(_Round, "_wall", lambda self: wall[0])
    times = RoundTimes()
    with times.round("control"):  # the CPU clock jumps 4.6 ms in 0.08 ms of wall time
        cpu[0] += 0.0046
        wall[0] += 0.00008
    assert times.max_cpu_s["control"] == pytest.approx(0.00008)
    with times.round("liveness"):  # waits off the CPU inside the round: its CPU time counts
        cpu[0] += 0.0004
        wall[0] += 0.0100
    assert times.max_cpu_s["liveness"] == pytest.approx(0.0004)


def test_each_round_is_counted_by_what_the_threads_context_switches_say_of_it(monkeypatch):
    """A hold with no context switch inside is ``whole`` (its capped CPU
    time is exact); with only involuntary ones, ``preempted``; with a
    voluntary one, ``waited`` (a wait the round did not cut): the latter two
    are upper bounds, kept apart (fake switch counts and clocks)."""
    from transfer.round_times import RoundTimes, _Round

    clock, switches = [0.0], [(10, 20)]
    monkeypatch.setattr(_Round, "_own", lambda self: clock[0])
    monkeypatch.setattr(_Round, "_wall", lambda self: clock[0])
    monkeypatch.setattr(_Round, "_switches", staticmethod(lambda: switches[0]))
    times = RoundTimes()
    for held, after in ((0.0002, (10, 20)), (0.0009, (10, 22)), (0.0004, (11, 22)), (0.0003, (11, 22))):
        with times.round("control"):
            clock[0] += held
            switches[0] = after  # the next round starts from here
    assert times.max_cpu_s["control"] == pytest.approx(0.0009)
    snap = times.snapshot()["periodic_max_by_kind_s"]
    assert snap["whole"]["control"] == pytest.approx(0.0003)
    assert snap["preempted"]["control"] == pytest.approx(0.0009)
    assert snap["waited"]["control"] == pytest.approx(0.0004)


def test_a_sleep_the_round_did_not_cut_makes_it_a_waited_round():
    """The real count (``getrusage`` of the thread): a round that sleeps
    without ``waiting()`` switched voluntarily; one that cut the sleep out
    counts the holds on either side, which did not."""
    from transfer.round_times import RoundTimes

    times = RoundTimes()
    with times.round("resolver"):
        time.sleep(0.002)
    assert "resolver" in times.snapshot()["periodic_max_by_kind_s"]["waited"], times.snapshot()
    with times.round("sweep") as round_:
        with round_.waiting():
            time.sleep(0.002)
    assert "sweep" not in times.snapshot()["periodic_max_by_kind_s"]["waited"], times.snapshot()
    assert times.rounds["sweep"] == 1


def test_a_round_leaves_out_the_wall_time_of_a_collection_inside_it():
    """The cap leaves out a garbage collection's wall time as the CPU time
    leaves out its CPU: a round with a long collection inside counts its own
    work, not the collection's."""
    import gc

    from harness.busywork import python_work
    from transfer.round_times import RoundTimes

    times = RoundTimes()
    junk = []
    for i in range(300_000):
        node = [i]
        node.append(node)
        junk.append(node)
    del junk
    with times.round("liveness") as round_:
        python_work(0.0002)
        gc.collect()
        held = round_._held()
        wall = round_._wall() - round_.start_wall
    assert times.max_cpu_s["gc"] > 0.005, times.max_cpu_s  # a collection worth measuring
    assert wall < 0.003 and held <= wall, (held, wall)


def test_a_wait_inside_a_round_cuts_it_into_the_holds_on_either_side():
    """The channel's hand-over waits inside its round (the lock released
    for 10 ms at a time): each hold between two waits is measured alone,
    and what the thread's clock counts inside the wait is neither (this
    kernel charges a thread the interrupts it serves while it wakes: a
    thread busy inside ``waiting()`` stands in for them)."""
    from harness.busywork import python_work
    from transfer.round_times import RoundTimes

    def hold(cpu_s: float) -> None:
        until = time.thread_time() + cpu_s
        while time.thread_time() < until:
            python_work(0.00002)

    times = RoundTimes()
    with times.round("control") as round_:
        hold(0.0007)
        with round_.waiting():
            time.sleep(0.01)
            hold(0.003)
        hold(0.0007)
    assert times.rounds["control"] == 2, times.rounds
    assert 0.0007 <= times.max_cpu_s["control"] < 0.0012, times.max_cpu_s


def test_a_garbage_collection_inside_a_round_is_counted_apart_from_the_round():
    """A collection walks the whole process's objects and runs in whichever
    thread allocated past the threshold: a round's time leaves it out, and
    the longest such collection shows as ``gc``."""
    import gc

    from transfer.round_times import RoundTimes

    times = RoundTimes()
    junk = []
    for i in range(300_000):
        node = [i]
        node.append(node)  # a cycle: only the collector frees it
        junk.append(node)
    del junk  # the cycles stay until collected
    with times.round("liveness"):
        started = time.thread_time()
        gc.collect()
        pause = time.thread_time() - started
    assert pause > 0.005, pause  # a collection worth measuring
    assert times.max_cpu_s["liveness"] < min(0.002, pause / 2), (times.max_cpu_s, pause)
    assert 0.5 * pause <= times.max_cpu_s["gc"] <= pause + 0.001, (times.max_cpu_s, pause)


def test_a_ranks_periodic_work_is_measured_round_by_round(cluster):
    """The liveness thread's heartbeat rounds and sweeps, and decode's
    resolver, show in ManagerStats with each task's longest round."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(31)
    run_room(prefill, decode, 51, random_pages(rng, 4), random_pages(rng, 4))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "sweep" not in decode.mgr.stats().periodic_rounds:
        time.sleep(0.05)
    for mgr in (prefill.mgr, decode.mgr):
        s = mgr.stats()
        assert s.periodic_rounds.get("liveness", 0) >= 1 and s.periodic_rounds.get("sweep", 0) >= 1, s.periodic_rounds
        assert set(s.periodic_max_cpu_s) == set(s.periodic_rounds)
        assert all(0 <= v < 1.0 for v in s.periodic_max_cpu_s.values()), s.periodic_max_cpu_s
    assert decode.mgr.stats().periodic_rounds.get("resolver", 0) >= 1


class _HeldLock:
    """A ``RoundLock`` held by another thread until :meth:`release_soon`
    (then 20 ms on, the waiter waiting by then; ``jump_s`` added to the fake
    clock that stands in for a round's CPU and wall clocks as it lets go)."""

    def __init__(self, monkeypatch, jump_s: float = 0.0) -> None:
        import threading

        from transfer.round_times import RoundLock, _Round

        self.clock = [0.0]
        monkeypatch.setattr(_Round, "_own", lambda _: self.clock[0])
        monkeypatch.setattr(_Round, "_wall", lambda _: self.clock[0])
        self.lock, held, self._go = RoundLock(), threading.Event(), threading.Event()

        def holder():
            with self.lock:
                held.set()
                self._go.wait(5)
                time.sleep(0.02)  # the round is waiting for the lock by now
                self.clock[0] += jump_s

        self.thread = threading.Thread(target=holder)
        self.thread.start()
        held.wait(5)

    def release_soon(self) -> None:
        self._go.set()


def test_a_round_that_waits_for_the_ranks_lock_is_cut_at_the_wait(monkeypatch):
    """The rank's lock (``RoundLock``) held by another thread: a round that
    takes it waits inside ``waiting()``, so the holds on either side are
    measured apart, and what the clock counts during the wait is neither
    (the fake clock jumps 5 ms while the round waits)."""
    import threading

    from transfer.round_times import RoundTimes

    held, times = _HeldLock(monkeypatch, jump_s=0.005), RoundTimes()
    lock, clock = held.lock, held.clock
    with times.round("resolver"):
        clock[0] += 0.0004
        held.release_soon()
        with lock:  # contended: a wait
            clock[0] += 0.0002
            with lock:  # re-entrant, at once
                pass
    held.thread.join(5)
    assert times.rounds["resolver"] == 2, times.rounds
    assert times.max_cpu_s["resolver"] == pytest.approx(0.0004)
    with times.round("liveness"):  # uncontended: no cut
        with lock:
            clock[0] += 0.0003
    assert times.rounds["liveness"] == 1 and times.max_cpu_s["liveness"] == pytest.approx(0.0003)
    assert lock.acquire(blocking=False)  # free again
    lock.release()
    cond = threading.Condition(lock)  # the change feed's condition over the rank's lock
    with cond:
        assert not cond.wait(0.01)


def test_work_set_aside_in_a_round_is_not_cut_into_holds_at_a_lock_wait(monkeypatch):
    """The control thread handles the messages that arrived inside its
    round, ``aside()`` (no periodic work: the round restarts after it). A
    wait for the rank's lock in that handling must not count what ran
    before it as one of the round's holds (a drain of 40 ms was, once)."""
    from transfer import round_times
    from transfer.round_times import RoundTimes

    held, times = _HeldLock(monkeypatch), RoundTimes()
    lock, clock = held.lock, held.clock
    with times.round("control") as round_:
        clock[0] += 0.0001
        with round_.aside():
            clock[0] += 0.040  # handling messages
            held.release_soon()
            with lock:  # contended, but not the round's wait
                clock[0] += 0.002
        round_.restart()
        assert round_times._current.round is round_  # the round's own waits are cut again
        clock[0] += 0.0002
    held.thread.join(5)
    assert times.rounds["control"] == 1, times.rounds
    assert times.max_cpu_s["control"] == pytest.approx(0.0002)
    assert getattr(round_times._current, "round", None) is None
