"""The benchmark runs and writes its JSON. It times nothing that a test
asserts on: throughput belongs to the benchmark, not to the test suite."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.e2e


def _pages_copied(src_arena, src_layout, dst_layout, buffers, src_pages, dst_pages):
    """A zero destination arena with page src[i] of every buffer copied onto page dst[i]."""
    expected = np.zeros(dst_layout.arena_bytes, dtype=np.uint8)
    for i, page_bytes in enumerate(buffers):
        so, do = src_layout.region_offsets[i], dst_layout.region_offsets[i]
        for sp, dp in zip(src_pages, dst_pages):
            expected[do + dp * page_bytes:do + (dp + 1) * page_bytes] = \
                src_arena[so + sp * page_bytes:so + (sp + 1) * page_bytes]
    return expected


def test_bench_runs_all_three_modes_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    # --quick: one entry size for raw Mooncake (nothing here checks which is best); three rounds still.
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--rounds", "3", "--only", "mha-128",
                           "--requests", "4", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["transport"] == "tcp" and data["machine"]["cpus"] >= 1
    modes = sorted(r["mode"] for r in data["rows"])
    assert modes == ["kvferry", "limit", "limit", "mooncake"]
    for row in data["rows"]:
        for key in ("workload", "mode", "tokens", "concurrency", "bytes", "gbps", "p50_ms", "p99_ms",
                    "descriptors_per_request"):
            assert key in row, (key, row)
        assert row["workload"] == "mha-128" and row["tokens"] == 128 and row["bytes"] > 0
    kv = next(r for r in data["rows"] if r["mode"] == "kvferry")
    # 128 tokens of 32 layers x K/V: 64 contiguous-page descriptors (into decode's staging
    # arenas: the write fence is on by default); the aux row travels in RoomStatus.
    assert kv["descriptors_per_request"] == 64
    assert kv["bytes"] == 4 * 128 * 32 * 2 * 8 * 128 * 2
    # Raw Mooncake's CPU counts its receiving process too, as kvferry's counts both ranks.
    raw = next(r for r in data["rows"] if r["mode"] == "mooncake")
    assert 0 < raw["receiver_cpu_s_per_gb"] < raw["cpu_s_per_gb"]
    # Three alternating rounds: each mode keeps its median run, and the per-round ratios are paired.
    assert kv["rounds"] == raw["rounds"] == 3 and len(kv["gbps_all"]) == 3
    paired = sorted(k / r for k, r in zip(kv["gbps_all"], raw["gbps_all"]))
    assert kv["paired_ratio_merged"] == round(paired[1], 3)
    assert "kvferry" in proc.stdout and "of mooncake" in proc.stdout


def test_bench_storage_mode_writes_rows_for_each_backend(tmp_path):
    """``--storage``: write-through and prefetch rows for every backend that
    runs here (the others skipped with a reason), and the limit rows."""
    from benchmarks.storage import mooncake_missing_reason
    from transfer.storage.nixl.probe import nixl_missing_reason

    out = tmp_path / "storage.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--storage", "--storage-pages", "4",
                           "--json", str(out)], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    missing = {"mooncake": mooncake_missing_reason(), "nixl": nixl_missing_reason()}
    available = ["file"] + [name for name, why in missing.items() if not why]
    assert sorted(data["storage"]["skipped"]) == sorted(name for name, why in missing.items() if why)
    rows = {r["workload"]: r for r in data["rows"]}
    expected = {f"storage-{name}-{op}" for name in available for op in ("write", "prefetch")}
    expected |= {f"storage-{name}-fs-{op}" for name in available if name != "mooncake" for op in ("write", "read")}
    assert set(rows) == expected | {"storage-memcpy"}
    for row in rows.values():
        for key in ("mode", "backend", "bytes", "gbps", "pages_per_s", "p50_ms", "p99_ms", "tokens", "concurrency",
                    "descriptors_per_request"):
            assert key in row, (key, row)
        limit = row["workload"] == "storage-memcpy" or "-fs-" in row["workload"]
        assert row["mode"] == ("limit" if limit else "storage")
        # 4 pages of 32 layers x K/V x 16 tokens x 8 heads x 128 x bf16: 2 MiB a page.
        assert row["pages"] == 4 and row["bytes"] == 4 * (2 << 20)
    assert "storage-file-write" in proc.stdout
    assert not list(tmp_path.glob("kvferry-bench-storage-*")), "the run left its directory behind"


# --- the same-pages raw baseline ------------------------------------------------------------

def test_same_pages_mirror_the_pages_the_workload_writes():
    """bench_pages draws a room's source pages and the decode allocator's
    pages exactly as harness.workload does (pure, no processes)."""
    from harness import workload
    from benchmarks.pages import DecodeAllocator, PageDraw, room_source_pages
    from benchmarks.workloads import FULL

    w = next(w for w in FULL if w.name == "mha-2k-c8")
    spec = w.spec()
    draw = PageDraw(spec.seed, spec.min_tokens, spec.max_tokens, spec.page_size, spec.prefill_pages,
                    spec.decode_pages)
    free = [int(x) for x in workload._rng(spec.seed, "decode-alloc", 0).permutation(spec.decode_pages - 4)]
    alloc = DecodeAllocator(draw)
    for room in range(spec.first_room, spec.first_room + 5):
        src = room_source_pages(draw, room)
        assert list(src) == list(workload.room_plan(spec, room)[0])
        want = workload._allocate(free, len(src), contiguous=False)
        got = alloc.take(len(src))
        assert got == want
        if room % 2:  # give some back, as finished rooms do
            free.extend(want)
            alloc.give_back(got)


def test_same_pages_descriptors_copy_exactly_the_pages():
    """Applying the descriptors as copies between two arenas moves page
    src[i] of every buffer onto page dst[i], touches nothing else, and
    merges runs adjacent on both sides."""
    from benchmarks.pages import ArenaLayout, page_descriptors

    buffers = (6, 6, 6, 10)  # page bytes per buffer
    src_layout, dst_layout = ArenaLayout(buffers, 9), ArenaLayout(buffers, 12)
    rng = np.random.default_rng(7)
    src_arena = rng.integers(0, 256, src_layout.arena_bytes, dtype=np.uint8)
    dst_arena = np.zeros(dst_layout.arena_bytes, dtype=np.uint8)
    src_pages, dst_pages = [3, 4, 5, 0, 8, 1], [7, 8, 9, 2, 0, 1]  # runs: [3,4,5]->[7,8,9], 0->2, 8->0, 1->1
    s, d, n = page_descriptors(src_layout, dst_layout, 0, 0, src_pages, dst_pages)
    assert len(n) == 4 * len(buffers) and n.sum() == len(src_pages) * sum(buffers)
    for a, b, k in zip(s, d, n):
        dst_arena[b:b + k] = src_arena[a:a + k]
    assert np.array_equal(dst_arena, _pages_copied(src_arena, src_layout, dst_layout, buffers, src_pages, dst_pages))


def test_bench_same_pages_baseline_row(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "mha-128-c64",
                           "--requests", "2", "--modes", "mooncake-pages", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["mode"] == "mooncake" and row["baseline"] == "same-pages" and row["pattern"] == "submit"
    # 2 measured requests of 128 tokens = 8 scattered pages x 32 layers x K/V, 32 KiB a page.
    assert row["bytes"] == 2 * 8 * 64 * 32768
    # One descriptor per page and buffer, but for runs adjacent on both sides (rare on random pages).
    assert 8 * 64 * 0.75 <= row["descriptors_per_request"] <= 8 * 64
    assert "same pages" in proc.stdout


# --- raw NIXL ---------------------------------------------------------------------------------

def test_nixl_same_pages_indices_copy_exactly_the_pages():
    """The raw NIXL same-pages sender's prepared lists and per-request
    indices, applied as copies between two arenas, move page src[i] of every
    buffer onto page dst[i] and touch nothing else."""
    from benchmarks.pages import ArenaLayout
    from benchmarks.raw_nixl import page_descs, page_indices

    buffers = (6, 6, 10)
    src_layout, dst_layout = ArenaLayout(buffers, 9), ArenaLayout(buffers, 12)
    rng = np.random.default_rng(11)
    src_arena = rng.integers(0, 256, src_layout.arena_bytes, dtype=np.uint8)
    dst_arena = np.zeros(dst_layout.arena_bytes, dtype=np.uint8)
    src_pages, dst_pages = [3, 4, 0, 8], [7, 8, 2, 0]
    local, remote = page_descs(src_layout, 0), page_descs(dst_layout, 0)
    li, ri = page_indices(src_layout, dst_layout, src_pages, dst_pages)
    assert len(li) == len(ri) == len(buffers) * len(src_pages)
    for (a, n, dev), (b, m, _) in zip(local[li], remote[ri]):
        assert n == m and dev == 0
        dst_arena[b:b + n] = src_arena[a:a + n]
    assert np.array_equal(dst_arena, _pages_copied(src_arena, src_layout, dst_layout, buffers, src_pages, dst_pages))


def test_bench_raw_nixl_row_names_its_transport(tmp_path):
    """Raw NIXL over UCX restricted to TCP: one row naming the transport and
    UCX_TLS, the receiving process's CPU counted, and the targets evaluated
    over what ran (no kvferry row here: not met, not failed)."""
    from transfer.storage.nixl.probe import nixl_missing_reason

    if why := nixl_missing_reason():
        pytest.skip(why)
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "mha-128", "--requests", "2",
                           "--modes", "nixl-merged", "--ucx-tls", "tcp", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    [row] = data["rows"]
    assert (row["mode"], row["baseline"], row["transport"], row["ucx_tls"]) == ("nixl", "merged", "nixl-ucx", "tcp")
    assert row["bytes"] == 2 * 128 * 32 * 2 * 8 * 128 * 2
    assert 0 < row["receiver_cpu_s_per_gb"] < row["cpu_s_per_gb"]
    [target] = data["targets"]
    assert target["workload"] == "mha-128" and target["kvferry"] is None and target["met"] is None
    assert target["raw"] == "nixl (nixl-ucx UCX_TLS=tcp)"
    assert "nixl-ucx tls=tcp" in proc.stdout and len(data["load_average"]) == 3


# --- two hosts: the decode side through an agent ---------------------------------------------

# Loopback as two hosts: the kernel sends from 127.0.0.1 whatever address a rank declares, so
# prefill's check that a decode peer's session is on the host its messages come from
# (check_peer_host) would refuse the 127.0.0.2 side; two real hosts pass it.
_TWO_HOSTS_ENV = dict(os.environ, KVFERRY_CHECK_PEER_HOST="0")


def _start_agent(*args: str) -> tuple[subprocess.Popen, str]:
    agent = subprocess.Popen([sys.executable, "-m", "benchmarks", "agent", "--host", "127.0.0.1", "--port", "0",
                              *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=_TWO_HOSTS_ENV)
    line = agent.stdout.readline()  # the agent prints it once listening, or exits
    if "listening on" not in line:
        agent.kill()
        agent.wait(10)
        pytest.fail(f"agent did not start: {line!r}")
    return agent, line.split()[-1]


def _stop(agent: subprocess.Popen) -> None:
    agent.terminate()
    try:
        agent.wait(10)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait(10)


def test_bench_two_hosts_through_an_agent(tmp_path):
    """Loopback as the other host: the agent is a separate process, the
    decode side answers on 127.0.0.2 and the prefill side on 127.0.0.1."""
    agent, address = _start_agent()
    try:
        out = tmp_path / "bench.json"
        proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "mha-128-c64",
                               "--requests", "2", "--peer", address, "--protocol", "tcp",
                               "--hostname", "127.0.0.1", "--peer-hostname", "127.0.0.2", "--json", str(out)],
                              capture_output=True, text=True, timeout=180, env=_TWO_HOSTS_ENV)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    finally:
        _stop(agent)
    data = json.loads(out.read_text())
    assert data["transport"] == "tcp"
    assert data["machine"]["address"] == "127.0.0.1" and data["machine"]["peer"]["address"] == "127.0.0.2"
    assert data["machine"]["peer"]["cpus"] >= 1
    kinds = sorted((r["mode"], r.get("baseline", "")) for r in data["rows"])
    assert kinds == [("kvferry", ""), ("limit", "memcpy"), ("limit", "tcp-stream"), ("mooncake", "merged"),
                     ("mooncake", "same-pages")]
    assert all(r["bytes"] > 0 for r in data["rows"]), data["rows"]
    assert "of mooncake merged" in proc.stdout and "of mooncake same-pages" in proc.stdout


def test_agent_kills_its_children_when_the_prefill_side_goes_away():
    """A session's children die with it: when the connection drops, and when
    the prefill side falls silent past the idle timeout. Bounded waits only."""
    from benchmarks.agent import AgentError, AgentHost, PROTOCOL_VERSION

    def gone(pid: int, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False

    agent, address = _start_agent("--idle-timeout-s", "2")
    try:
        # The connection drops (the prefill process died): the child is killed at once.
        host = AgentHost(address, heartbeat_s=0.5)
        with pytest.raises(AgentError, match="not one of"):
            host.spawn("mc-send", [])
        with pytest.raises(AgentError, match="KVFERRY"):
            host.spawn("sock-recv", [], env={"PATH": "/"})
        child = host.spawn("sock-recv", ["--bytes", "1"])  # waits for a sender that never comes
        assert child.wait_line("SOCK_READY ", 30)
        host._sock.shutdown(socket.SHUT_RDWR)
        host._sock.close()
        assert gone(child.pid, 15), "the agent left a child of a closed session running"
        # Silence (the prefill host vanished without closing): killed after the idle timeout.
        agent_host, agent_port = address.rsplit(":", 1)
        with socket.create_connection((agent_host, int(agent_port)), timeout=10) as sock:
            request = {"v": PROTOCOL_VERSION, "op": "spawn", "command": "sock-recv", "args": ["--bytes", "1"]}
            sock.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(sock.makefile("rb").readline())
            assert reply["ok"], reply
            assert gone(reply["pid"], 20), "the agent left a child of a silent session running"
    finally:
        _stop(agent)


@pytest.mark.parametrize("mode,handover", [("whole", "due"), ("layerwise", "due"), ("layerwise", "launch")])
def test_the_layerwise_benchmark_runs_a_cell_and_measures_the_exposed_transfer(mode, handover):
    """benchmarks.layerwise: a modelled forward, real processes and engine;
    every room ends and decode reports an exposed transfer time per room
    (how long is the benchmark's business, not this test's); ``launch``:
    the groups handed over at the forward's start with events."""
    from benchmarks.layerwise import run_cell

    row = run_cell("llama8b", 1024, 1, mode, "mooncake", False, 1, handover=handover)
    assert row["rooms"] == 1 and row["exposed_p50_ms"] >= 0 and row["forward_ms"] > 0, row
    assert row["handover"] == handover


def test_the_busy_benchmark_runs_both_one_process_systems(tmp_path):
    """benchmarks.busy's one-process cells, kvferry's and raw Mooncake's
    (whose last room's bytes its rank checks), a few requests each."""
    out = tmp_path / "busy.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.busy", "--systems", "kvferry-one,mooncake-one",
                           "--workloads", "short", "--modes", "busy", "--requests", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["system"] for r in rows) == ["kvferry-one", "mooncake-one"]
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["requests"] == 4 and 0 < r["p50_ms"] <= r["max_ms"], r
        assert r["steal_ms"] >= 0 and all(t["steal_ms"] >= 0 for t in r["slowest"]), r  # the host's, beside each
    slowest = next(r for r in rows if r["system"] == "kvferry-one")["loop_slowest"]["prefill"]  # one process
    assert slowest and slowest[0]["step"] >= 9.0, slowest  # a busy step is 10 ms of Python
    for it in slowest:  # the API calls it timed lie inside its poll part (kvferry-one: both sides')
        calls = [it[k] for k in ("prefill_kv_poll", "prefill_kv_init", "prefill_kv_send", "decode_kv_poll")]
        assert all(c >= 0 for c in calls) and sum(calls) <= it["poll"] + 0.05, it
        # where its time went, by the thread's own clock: on a CPU, waiting for one, neither
        assert it["cpu"] > 0 and it["runq"] >= 0 and it["voluntary"] >= 0 and it["involuntary"] >= 0, it
        assert abs(it["cpu"] + it["runq"] + it["unseen"] - it["ms"]) < 0.05, it
