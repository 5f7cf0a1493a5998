"""The vLLM connector's worker half (transfer.adapters.vllm.prefill_worker, .decode_worker) without
vLLM: two KvferryWorkers on the loopback pair, driven the way vLLM's steps
drive them (start, finished, take_stats). The driver polls only the rooms
that changed; a room that never changes still ends at its time bound; the
prefill lease gives an unasked room's blocks back; the step stats count
exactly what moved."""

import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from transfer.adapters.vllm import stats as vllm_stats
from transfer.adapters.vllm.groups import Group, GroupPlan
from transfer.adapters.vllm.params import DEFAULT_IDLE_WAIT_S, ConnectorConfig, RecvSpec, SendSpec
from transfer.adapters.vllm.decode_worker import DecodeWorker
from transfer.adapters.vllm.prefill_worker import PrefillWorker
from transfer.adapters.vllm.worker import KvferryWorker
from transfer.config import Role
from transfer.state import KVPoll

from ._rooms import HEAD_DIM, NUM_HEADS, NUM_LAYERS, PAGE_SIZE, random_pages, wait_until

PAGE_BYTES = PAGE_SIZE * NUM_HEADS * HEAD_DIM * 2 * NUM_LAYERS * 2  # bf16, K and V of every layer
FENCED = dict(staging_bytes=1 << 20, stage_part_bytes=64 << 10)


def worker(cluster, role: Role, lease_s: float = 30.0, groups: GroupPlan | None = None, layer_groups: int = 0,
           idle_wait_s: float = 0.01, **overrides) -> tuple[KvferryWorker, object]:
    rank = cluster.rank(role, **overrides)
    config = ConnectorConfig(bootstrap_addr=cluster.server.address, lease_s=lease_s, layer_groups=layer_groups,
                             idle_wait_s=idle_wait_s)
    w = (PrefillWorker if role is Role.PREFILL else DecodeWorker)(config, tp_rank=0, tp_size=1, groups=groups)
    w.index_layers([f"layers.{i}.attn" for i in range(NUM_LAYERS)])
    w.attach(rank.mgr)
    cluster.stack.callback(w.close)
    return w, rank


def wait_finished(w: KvferryWorker, req_ids: set[str], timeout_s: float) -> float:
    """Call finished() as vLLM's steps do until every id came back; returns the seconds it took."""
    start, got = time.monotonic(), set()
    while got != req_ids:
        sending, recving = w.finished(req_ids)
        got |= sending | recving
        assert time.monotonic() - start < timeout_s, f"{req_ids - got} not finished within {timeout_s} s"
        time.sleep(0.005)
    return time.monotonic() - start


def test_rooms_move_byte_exact_and_the_step_stats_count_them(cluster):
    """Fenced decode (the connector's default): every byte staged; both
    sides report bytes = pages x page bytes, exactly, per room."""
    p, prefill = worker(cluster, Role.PREFILL)
    d, decode = worker(cluster, Role.DECODE, **FENCED)
    rng = np.random.default_rng(7)
    sizes = (3, 9, 1)
    srcs, dsts = [random_pages(rng, n) for n in sizes], []
    free = list(rng.permutation(64))
    for i, n in enumerate(sizes):
        dsts.append(np.array([free.pop() for _ in range(n)]))
        d.start([RecvSpec(req_id=f"d{i}", room=100 + i, bootstrap_addr=cluster.server.address,
                              node_id="prefill", pages=tuple(int(x) for x in dsts[i]))])
    p.start([SendSpec(req_id=f"p{i}", room=100 + i, pages=tuple(int(x) for x in srcs[i])) for i in range(3)])
    wait_finished(d, {"d0", "d1", "d2"}, 10)
    wait_finished(p, {"p0", "p1", "p2"}, 10)
    assert d.load_errors() == set()
    for src, dst in zip(srcs, dsts):
        assert decode.page_bytes(dst) == prefill.page_bytes(src)
    for w in (p, d):
        data = w.take_stats()
        assert sorted(data["bytes_transferred"]) == sorted(n * PAGE_BYTES for n in sizes)
        assert data["bytes_by_path"] == {"staged": sum(sizes) * PAGE_BYTES}
        assert len(data["transfer_duration"]) == 3 and all(s > 0 for s in data["transfer_duration"])
        assert all(n >= 1 for n in data["num_descriptors"]) and data["failures"] == {}
        assert w.take_stats() is None  # taken: the next step reports nothing


def test_the_driver_polls_changed_rooms_and_the_lease_ends_unasked_ones(cluster):
    """100 prefill rooms no decode asks for: after start() polled each once,
    the driver does not poll them again while other rooms run; the lease
    (0.6 s) then ends them all and reports their blocks free."""
    p, _ = worker(cluster, Role.PREFILL, lease_s=0.6)
    d, _ = worker(cluster, Role.DECODE)
    idle = {f"idle{i}" for i in range(100)}
    p.start([SendSpec(req_id=r, room=1000 + i, pages=(i % 64,)) for i, r in enumerate(sorted(idle))])
    opened_at, base = time.monotonic(), p.num_polled
    assert base == 100
    for i in range(4):  # other rooms come and go meanwhile
        d.start([RecvSpec(req_id=f"d{i}", room=i, bootstrap_addr=cluster.server.address, node_id="prefill",
                              pages=(i,))])
        p.start([SendSpec(req_id=f"p{i}", room=i, pages=(i,))])
        wait_finished(d, {f"d{i}"}, 10)
        wait_finished(p, {f"p{i}"}, 10)
    # Each live room polled a handful of times, none of the idle ones (old loop: 100 per wake-up).
    assert p.num_polled - base < 40, p.num_polled - base
    assert p.finished(idle) == (set(), set())  # not before the lease
    waited = wait_finished(p, idle, 10)
    assert time.monotonic() - opened_at >= 0.6
    assert waited < 5
    data = p.take_stats()
    assert data["failures"] == {vllm_stats.LEASE_EXPIRED: 100}, data["failures"]
    assert p.num_pending() == 0


def timed(call) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


def test_an_idle_step_waits_for_a_room_to_end_and_is_woken_when_one_does(cluster):
    """vLLM steps without pause while a room is open; settle(idle=True)
    slows those steps once the engine was idle for IDLE_GRACE_S: it waits
    up to idle_wait_s while rooms are open and none ended, and returns as
    soon as one ends (the room is then reported by the same step). A step
    that computes, a step inside the grace, a worker with no room open or
    with a room already ended: no wait."""
    from transfer.adapters.vllm.worker import IDLE_GRACE_S
    p, _ = worker(cluster, Role.PREFILL, idle_wait_s=0.25)
    d, _ = worker(cluster, Role.DECODE)
    pair = lambda i: (SendSpec(req_id=f"p{i}", room=i, pages=(i,)),  # noqa: E731
                      RecvSpec(req_id=f"d{i}", room=i, bootstrap_addr=cluster.server.address, node_id="prefill",
                               pages=(i,)))
    send, recv = pair(0)  # the pair's first room: its connections open
    p.start([send])
    d.start([recv])
    wait_finished(p, {"p0"}, 10)
    assert timed(lambda: p.settle(True)) < 0.2  # no room open
    send, recv = pair(1)
    p.start([send])
    p.settle(False)
    assert timed(lambda: p.settle(True)) < 0.2  # the first idle step: inside the grace
    time.sleep(IDLE_GRACE_S)
    assert timed(lambda: p.settle(True)) >= 0.24  # idle past the grace, no room ended: the whole wait
    assert timed(lambda: p.settle(False)) < 0.2  # a step that computes
    assert timed(lambda: p.settle(True)) < 0.2  # idle again: the grace starts over
    time.sleep(IDLE_GRACE_S)
    p.config = replace(p.config, idle_wait_s=1.0)
    threading.Timer(0.05, lambda: d.start([recv])).start()
    assert timed(lambda: p.settle(True)) < 0.9  # woken when the room ended, not at the 1 s bound
    assert p.finished({"p1"}) == ({"p1"}, set())
    wait_finished(d, {"d0", "d1"}, 10)
    for i in (2, 3):
        p.start([pair(i)[0]])
    p._abort(["p3"])  # an ended room not yet reported: the step reports it at once
    deadline = time.monotonic() + 10
    while p.num_pending() > 1:
        assert time.monotonic() < deadline, "the aborted room did not end"
        time.sleep(0.01)
    assert timed(lambda: p.settle(True)) < 0.9
    p.config = replace(p.config, idle_wait_s=0.0)  # kvferry_idle_wait_ms 0: off
    assert timed(lambda: p.settle(True)) < 0.2


def test_a_room_that_never_changes_still_ends_at_its_bound(cluster):
    """Decode asks for a room prefill never opens: nothing changes until the
    manager's sweep fails it (bootstrap and transfer bounds 1 s); the driver, which
    polls only changed rooms, still reports it with its blocks as load errors."""
    worker(cluster, Role.PREFILL)
    d, _ = worker(cluster, Role.DECODE, bootstrap_timeout_s=1.0, transfer_timeout_s=1.0)
    d.start([RecvSpec(req_id="lost", room=77, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=(5, 6))])
    waited = wait_finished(d, {"lost"}, 10)
    assert 0.9 <= waited < 5
    assert d.load_errors() == {5, 6}
    assert d.failed_receives() == set()
    assert d.take_stats()["failures"] == {"timeout": 1}


def test_with_several_kv_cache_groups_a_failed_receive_is_reported_by_request_not_by_block(cluster):
    """vLLM's hybrid manager (several KV-cache groups) raises on block-level
    load errors, its block ids being unique only within a group: there a
    failed receive comes back by request id, finished and failed, and no
    block is a load error."""
    hybrid = GroupPlan(main=Group(1, ("a1",), "full", PAGE_SIZE), states=(Group(0, ("g0",), "mamba", PAGE_SIZE),),
                       num_groups=2)
    worker(cluster, Role.PREFILL)
    d, _ = worker(cluster, Role.DECODE, groups=hybrid, bootstrap_timeout_s=1.0, transfer_timeout_s=1.0)
    d.start([RecvSpec(req_id="lost", room=78, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=(5, 6))])
    wait_finished(d, {"lost"}, 10)
    assert d.failed_receives() == {"lost"}
    assert d.failed_receives() == set()  # taken
    assert d.load_errors() == set()


def test_step_payloads_merge_and_summarise():
    a, b = vllm_stats.empty(), vllm_stats.empty()
    assert vllm_stats.is_empty(a)
    vllm_stats.record_failure(a, "timeout")
    b["transfer_duration"] += [0.5, 1.5]
    b["bytes_transferred"] += [2 << 20, 4 << 20]
    b["num_descriptors"] += [4, 8]
    b["bytes_by_path"]["direct"] = 6 << 20
    b["failures"]["timeout"] = 2
    merged = vllm_stats.merge(a, b)
    assert merged["failures"] == {"timeout": 3} and merged["bytes_transferred"] == [2 << 20, 4 << 20]
    s = vllm_stats.summary(merged)
    assert s["Num successful transfers"] == 2 and s["Avg MB per transfer"] == 3.0
    assert s["Throughput (MB/s)"] == 3.0 and s["Failed (timeout)"] == 3 and s["MB direct"] == 6.0


@pytest.mark.parametrize("extra, lease", [({}, 30.0), ({"kvferry": {"bootstrap_timeout_s": 12}}, 30.0),
                                          ({"kvferry_lease_s": 5, "kvferry": {"bootstrap_timeout_s": 12}}, 5.0)])
def test_the_lease_option_and_prefill_bootstrap_bound(extra, lease):
    c = ConnectorConfig.from_extra(extra, None)
    assert c.lease_s == lease
    assert c.manager_fields(prefill=True)["bootstrap_timeout_s"] >= lease + 1
    assert c.manager_fields(prefill=True)["staging_bytes"] == 0
    assert "staging_bytes" not in c.manager_fields(prefill=False)  # decode: staging, so the write fence
    with pytest.raises(ValueError, match="kvferry_lease_s"):
        ConnectorConfig.from_extra({"kvferry_lease_s": 0}, None)


def test_the_idle_wait_option():
    assert ConnectorConfig.from_extra({}, None).idle_wait_s == DEFAULT_IDLE_WAIT_S == 0.01
    assert ConnectorConfig.from_extra({"kvferry_idle_wait_ms": 0}, None).idle_wait_s == 0.0
    assert ConnectorConfig.from_extra({"kvferry_idle_wait_ms": 25}, None).idle_wait_s == 0.025
    for bad in (-1, 1001):
        with pytest.raises(ValueError, match="kvferry_idle_wait_ms"):
            ConnectorConfig.from_extra({"kvferry_idle_wait_ms": bad}, None)


def test_a_decode_request_cancelled_before_its_room_frees_prefill_at_once(cluster):
    """vLLM finishes a decode request before it was scheduled (no receiver,
    no pages): the worker tells prefill, whose room ends (its blocks free)
    well within a second, not at its 30 s lease; an unrelated room moves on."""
    p, _ = worker(cluster, Role.PREFILL, lease_s=30.0)
    d, _ = worker(cluster, Role.DECODE)
    p.start([SendSpec(req_id="kept", room=500, pages=(1, 2)), SendSpec(req_id="other", room=501, pages=(3,))])
    cancelled_at = time.monotonic()
    d.start([], cancels=[RecvSpec(req_id="gone", room=500, bootstrap_addr=cluster.server.address,
                                      node_id="prefill", pages=())])
    waited = wait_finished(p, {"kept"}, 10)
    assert waited < 1.0, waited
    assert time.monotonic() - cancelled_at < 1.0
    assert p.take_stats()["failures"] == {"aborted": 1}
    assert d.num_cancelled == 1 and d.num_pending() == 0 and d.finished({"gone"}) == (set(), set())
    d.start([RecvSpec(req_id="d-other", room=501, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=(9,))])
    wait_finished(d, {"d-other"}, 10)
    wait_finished(p, {"other"}, 10)
    assert d.load_errors() == set()


def test_decode_prefix_pages_are_listed_never_written(cluster):
    """Decode's prefix cache holds the first pages (``skip_pages``): they stay
    as they were, byte for byte; the rest land; only the rest count as load
    errors had it failed."""
    p, prefill = worker(cluster, Role.PREFILL)
    d, decode = worker(cluster, Role.DECODE, **FENCED)
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 5), np.array([40, 41, 42, 43, 44])
    before = decode.page_bytes(dst[:2])
    d.start([RecvSpec(req_id="d", room=700, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=tuple(int(x) for x in dst), skip_pages=2)])
    p.start([SendSpec(req_id="p", room=700, pages=tuple(int(x) for x in src))])
    wait_finished(d, {"d"}, 10)
    wait_finished(p, {"p"}, 10)
    assert d.load_errors() == set()
    assert decode.page_bytes(dst[:2]) == before
    assert decode.page_bytes(dst[2:]) == prefill.page_bytes(src[2:])
    assert decode.page_bytes(dst[:2]) != prefill.page_bytes(src[:2])
    assert p.take_stats()["bytes_transferred"] == [3 * PAGE_BYTES]


def test_mla_caches_are_viewed_as_logical_blocks():
    """vLLM's MLA cache, [kernel blocks, 1, kernel block, latent] (CPU) or
    [kernel blocks, kernel block, latent]: logical block b is kernel blocks
    b * ratio ... of the same memory; no copy."""
    torch = pytest.importorskip("torch")
    from transfer.adapters.vllm.caches import check_block_size, mla_layers

    kernel = torch.arange(8 * 16 * 4, dtype=torch.float32).view(8, 1, 16, 4)
    (same,) = mla_layers([kernel], 16)
    assert same.shape == (8, 16, 4) and same.data_ptr() == kernel.data_ptr()
    (logical,) = mla_layers([kernel.view(8, 16, 4)], 64)
    assert logical.shape == (2, 64, 4) and logical.data_ptr() == kernel.data_ptr()
    assert torch.equal(logical[1], torch.cat([kernel[i, 0] for i in range(4, 8)]))
    with pytest.raises(ValueError, match="logical block size 24 is not a whole number of kernel blocks of 16"):
        mla_layers([kernel], 24)
    with pytest.raises(ValueError, match="contiguous"):
        mla_layers([kernel.view(8, 16, 4).transpose(1, 2)], 16)
    check_block_size(128, 128)
    with pytest.raises(ValueError, match="kernel block holds 16 tokens and vLLM's logical block 128"):
        check_block_size(16, 128)


def _stream(cluster, *, decode_first: bool):
    """A prefill request streamed layer-wise (two groups of one layer: the
    test pool's two layers) to an unfenced decode."""
    p, prefill = worker(cluster, Role.PREFILL, layer_groups=NUM_LAYERS)
    d, decode = worker(cluster, Role.DECODE, write_fence=False)
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    spec = SendSpec(req_id="p", room=300, pages=tuple(int(x) for x in src))
    recv = RecvSpec(req_id="d", room=300, bootstrap_addr=cluster.server.address, node_id="prefill",
                    pages=tuple(int(x) for x in dst))
    p.open_streams([spec])  # the step that completes the prompt, before its forward pass
    if decode_first:  # the concurrent protocol: decode's request waits at prefill
        d.start([recv])
        wait_until(prefill.mgr, lambda: p._rooms["p"].handle.poll() is KVPoll.WaitingForInput,
                   what="decode's request at prefill")
    for i in range(NUM_LAYERS):  # the forward pass: each layer's save_kv_layer
        if decode_first and i == NUM_LAYERS - 1:  # every layer but the last sent: decode has not landed
            time.sleep(0.2)
            assert d.finished(set()) == (set(), set())
        p.layer_saved(f"layers.{i}.attn", None)
    p.start([spec])  # request_finished, at the step's end
    if not decode_first:  # the sequential protocol: decode asks once prefill answered
        d.start([recv])
    wait_finished(d, {"d"}, 10)
    wait_finished(p, {"p"}, 10)
    assert d.load_errors() == set()
    assert decode.page_bytes(dst) == prefill.page_bytes(src)
    return p.take_stats()["layer_groups"]


def test_layer_groups_go_during_the_forward_pass_when_decode_asked_first(cluster):
    assert _stream(cluster, decode_first=True) == {vllm_stats.FORWARD: NUM_LAYERS}


def test_layer_groups_go_after_the_forward_pass_when_decode_asks_later(cluster):
    assert _stream(cluster, decode_first=False) == {vllm_stats.AFTER: NUM_LAYERS}


def test_a_request_aborted_on_prefill_while_streaming_ends_its_room_and_reports_it_once_finished(cluster):
    """vLLM aborts a request whose layer-wise room is open (the connector
    keeps its blocks and sends the abort): the room fails on both sides,
    decode's blocks are load errors, and prefill reports the request done
    only once vLLM called it finished (then it frees the blocks)."""
    p, _ = worker(cluster, Role.PREFILL, layer_groups=NUM_LAYERS)
    d, _ = worker(cluster, Role.DECODE, write_fence=False)
    p.open_streams([SendSpec(req_id="p", room=301, pages=(1, 2, 3))])
    d.start([RecvSpec(req_id="d", room=301, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=(4, 5, 6))])
    wait_until(p.mgr,
               lambda: p._rooms["p"].handle.poll() is KVPoll.WaitingForInput, what="decode's request at prefill")
    p.layer_saved("layers.0.attn", None)  # one group sent, then the abort
    p.start([], aborts=["p"])
    wait_finished(d, {"d"}, 10)
    assert d.load_errors() == {4, 5, 6}
    time.sleep(0.2)
    assert p.finished(set()) == (set(), set())  # not before vLLM finished it
    wait_finished(p, {"p"}, 10)
    assert p.take_stats()["layer_groups"] == {vllm_stats.FORWARD: 1}


def test_a_room_decode_holds_outlives_the_lease_and_lands_when_decode_asks(cluster):
    """Decode's request waits in its queue: the decode worker holds its room
    at prefill (RoomHold, renewed), so prefill's lease (0.6 s) does not end
    it; 2 s later decode asks and the pages land byte exact. A room nobody
    holds ends at the lease, as before."""
    p, prefill = worker(cluster, Role.PREFILL, lease_s=0.6)
    d, decode = worker(cluster, Role.DECODE)
    d.hold_s, d.hold_every_s = 1.0, 0.2
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 3), (40, 7, 22)
    addr = cluster.server.address
    d.start([], holds=[RecvSpec(req_id="d-held", room=300, bootstrap_addr=addr, node_id="prefill", pages=())])
    wait_until(decode.mgr, lambda: d.num_holds >= 1, 5, what="a first hold (before prefill's room: ignored)")
    p.start([SendSpec(req_id="held", room=300, pages=tuple(int(x) for x in src)),
             SendSpec(req_id="unheld", room=301, pages=(9,))], [])
    opened_at = time.monotonic()
    wait_finished(p, {"unheld"}, 5)
    assert p.take_stats()["failures"] == {vllm_stats.LEASE_EXPIRED: 1}
    time.sleep(max(0.0, opened_at + 2.0 - time.monotonic()))
    assert p.finished({"held"}) == (set(), set()), "the held room ended"
    assert d.num_holds >= 6, d.num_holds  # renewed every 0.2 s
    d.start([RecvSpec(req_id="d-held", room=300, bootstrap_addr=addr, node_id="prefill", pages=dst)])
    wait_finished(d, {"d-held"}, 10)
    wait_finished(p, {"held"}, 10)
    assert d.load_errors() == set()
    assert decode.page_bytes(dst) == prefill.page_bytes(src)
    assert p.take_stats()["failures"] == {}
    sent = d.num_holds
    time.sleep(0.5)
    assert d.num_holds == sent, "the hold was renewed after the room opened"


def test_sleep_fails_the_rooms_in_flight_and_after_wake_up_rooms_land_byte_exact(cluster):
    """vLLM 0.33's sleep hooks: unregister_kv_caches (release_memory) fails
    decode's room waiting for its KV (its blocks reported as load errors)
    and refuses a new one; restore_kv_caches (resume_memory) takes rooms
    again, and the next lands byte-exact. Both are idempotent."""
    p, prefill = worker(cluster, Role.PREFILL)
    d, decode = worker(cluster, Role.DECODE)
    rng = np.random.default_rng(41)
    d.start([RecvSpec(req_id="waiting", room=700, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=(4, 5))])
    d.release_memory()
    d.release_memory()
    wait_finished(d, {"waiting"}, 10)
    assert d.load_errors() == {4, 5}
    d.start([RecvSpec(req_id="asleep", room=701, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=(6,))])
    wait_finished(d, {"asleep"}, 10)
    assert d.load_errors() == {6}
    d.resume_memory()
    d.resume_memory()
    src, dst = random_pages(rng, 3), np.array([10, 20, 30])
    d.start([RecvSpec(req_id="awake", room=702, bootstrap_addr=cluster.server.address, node_id="prefill",
                          pages=tuple(int(x) for x in dst))])
    p.start([SendSpec(req_id="p-awake", room=702, pages=tuple(int(x) for x in src))])
    wait_finished(d, {"awake"}, 10)
    wait_finished(p, {"p-awake"}, 10)
    assert d.load_errors() == set()
    assert decode.page_bytes(dst) == prefill.page_bytes(src)


def test_a_request_naming_the_prefills_http_bootstrap_port_lands_through_kvferrys_beside_it(cluster):
    """The concurrent protocol's kvferry_bootstrap_addr as a router copies it
    from the configuration: the port a serving prefill answers HTTP on.
    Decode finds kvferry's ZMQ bootstrap behind it (GET /kvferry) and the
    room lands byte-exact."""
    from transfer.adapters.vllm.params import query_reply
    from transfer.adapters.vllm.query import QueryServer

    door = QueryServer("127.0.0.1", 0, query_reply(ConnectorConfig(), 1), kvferry_port=cluster.server.port)
    cluster.stack.callback(door.close)
    p, prefill = worker(cluster, Role.PREFILL)
    d, decode = worker(cluster, Role.DECODE)
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 5), np.array([40, 3, 17, 22, 9])
    d.start([RecvSpec(req_id="d", room=300, bootstrap_addr=door.address, node_id="prefill",
                          pages=tuple(int(x) for x in dst))])
    p.start([SendSpec(req_id="p", room=300, pages=tuple(int(x) for x in src))])
    wait_finished(d, {"d"}, 10)
    wait_finished(p, {"p"}, 10)
    assert d.load_errors() == set()
    assert decode.page_bytes(dst) == prefill.page_bytes(src)
