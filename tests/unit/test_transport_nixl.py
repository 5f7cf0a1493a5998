"""The NIXL transport in one process (two agents, UCX on loopback): a
scattered plan lands byte-exact in one request, a write outside the peer's
announced regions (or into memory it deregistered since) is refused before
anything is posted, and close fails what is queued."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from transfer.config import EngineConfig
from transfer.errors import ClosedError, TransferError
from transfer.plan import TransferPlan
from transfer.storage.nixl.probe import nixl_missing_reason

pytestmark = pytest.mark.skipif(bool(nixl_missing_reason()), reason=nixl_missing_reason())

PAGE = 4096


@pytest.fixture(scope="module")
def pair():
    mp = pytest.MonkeyPatch()
    mp.setenv("UCX_NET_DEVICES", "lo")  # UCX listens on loopback only
    from transfer.transport.nixl.transport import NixlTransport
    a, b = NixlTransport(EngineConfig(backend="nixl")), NixlTransport(EngineConfig(backend="nixl"))
    rng = np.random.default_rng(18)
    src = rng.integers(0, 256, 256 * PAGE, dtype=np.uint8)
    dst = np.zeros(256 * PAGE, dtype=np.uint8)
    a.register([(src.ctypes.data, src.nbytes)])
    b.register([(dst.ctypes.data, dst.nbytes)])
    _open(a, b)
    yield a, b, src, dst
    a.close()
    b.close()
    mp.undo()


def _open(a, b) -> None:
    """``a`` opens its way to ``b`` from ``b``'s metadata now (kvferry's handshake carries it)."""
    done, result = threading.Event(), []
    a.open_peer(b.session, b.metadata(), lambda error: (result.append(error), done.set()))
    assert done.wait(20) and result == [None], result


def _run(transport, peer, plan) -> TransferError | None:
    done, result = threading.Event(), []
    transport.submit(peer, plan, lambda error: (result.append(error), done.set()), None)
    assert done.wait(20), "no callback within 20 s"
    assert len(result) == 1
    return result[0]


def _plan(src_base, src_pages, dst_base, dst_pages) -> TransferPlan:
    s = (src_base + np.asarray(src_pages) * PAGE).astype(np.uint64)
    d = (dst_base + np.asarray(dst_pages) * PAGE).astype(np.uint64)
    return TransferPlan(s, d, np.full(len(s), PAGE, dtype=np.uint64))


def test_scattered_pages_land_byte_exact_in_one_request(pair):
    a, b, src, dst = pair
    rng = np.random.default_rng(7)
    src_pages, dst_pages = rng.permutation(256)[:100], rng.permutation(200)[:100]
    before = (a.num_requests, a.num_bytes)
    assert _run(a, b.session, _plan(src.ctypes.data, src_pages, dst.ctypes.data, dst_pages)) is None
    for s, d in zip(src_pages, dst_pages):
        assert np.array_equal(dst[d * PAGE:(d + 1) * PAGE], src[s * PAGE:(s + 1) * PAGE])
    assert (a.num_requests - before[0], a.num_bytes - before[1]) == (1, 100 * PAGE)


def test_a_write_outside_the_peers_regions_is_refused(pair):
    a, b, src, dst = pair
    plan = _plan(src.ctypes.data, [0, 1], dst.ctypes.data, [3, 256])  # page 256: one past the end
    error = _run(a, b.session, plan)
    assert isinstance(error, TransferError) and "descriptor 1" in str(error) and error.peer == b.session


def test_an_unknown_peer_fails_the_plan(pair):
    a, _, src, dst = pair
    error = _run(a, "127.0.0.1:nobody", _plan(src.ctypes.data, [0], dst.ctypes.data, [0]))
    assert isinstance(error, TransferError) and "no NIXL metadata" in str(error)


def test_memory_the_peer_deregistered_is_refused_once_it_announced_it(pair):
    a, b, src, dst = pair
    b.unregister([(dst.ctypes.data, dst.nbytes)])
    _open(a, b)
    try:
        dst[:PAGE] = 0
        error = _run(a, b.session, _plan(src.ctypes.data, [5], dst.ctypes.data, [0]))
        assert isinstance(error, TransferError) and "outside the memory" in str(error)
        assert not dst[:PAGE].any()  # nothing landed
    finally:
        b.register([(dst.ctypes.data, dst.nbytes)])
        _open(a, b)


def test_submit_after_close_raises_and_close_is_idempotent():
    from transfer.transport.nixl.transport import NixlTransport
    t = NixlTransport(EngineConfig(backend="nixl"))
    t.close()
    t.close()
    with pytest.raises(ClosedError):
        t.submit("127.0.0.1:x", TransferPlan.empty(), lambda e: None, None)


_EXIT_SCRIPT = """
import numpy as np
from transfer.config import EngineConfig
from transfer.transport.nixl.transport import NixlTransport
a, b = NixlTransport(EngineConfig(backend="nixl")), NixlTransport(EngineConfig(backend="nixl"))
buf = np.zeros(1 << 16, dtype=np.uint8)
a.register([(buf.ctypes.data, buf.nbytes)])
import threading
opened = threading.Event()
a.open_peer(b.session, b.metadata(), lambda error: opened.set())
assert opened.wait(20)
{close}
print("ok", flush=True)
"""


@pytest.mark.parametrize("close", ["a.close(); b.close()", "pass"], ids=["closed", "left-open"])
def test_a_process_that_used_nixl_exits_0(close):
    """Exit after NIXL agents ran (closed, or left for the interpreter's exit):
    status 0, not signal 11 in the destructors of the libraries UCX loaded."""
    import os
    import subprocess
    import sys

    from harness.launch import child_env

    env = {k: v for k, v in child_env().items() if k != "UCX_MODULES"}
    env["UCX_NET_DEVICES"] = "lo"
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT.format(close=close)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=os.getcwd())
    # "ok" among the lines, not necessarily the last: UCX logs to standard output, and on a loaded
    # machine its wire-up to the other agent may still be retrying (and saying so) as the process exits.
    assert proc.returncode == 0 and "ok" in proc.stdout.splitlines(), (proc.returncode, proc.stdout[-1000:],
                                                                        proc.stderr[-2000:])


def test_ucx_efa_module_is_left_out_only_without_an_efa_device(tmp_path):
    from transfer.transport.nixl.api import skip_idle_efa

    env: dict = {}
    assert skip_idle_efa(env, str(tmp_path / "none")) and env == {"UCX_MODULES": "^efa"}
    env = {"UCX_MODULES": "ib"}
    assert not skip_idle_efa(env, str(tmp_path / "none")) and env == {"UCX_MODULES": "ib"}  # the user's own
    sysfs = tmp_path / "infiniband"
    for dev, driver in (("mlx5_0", "mlx5_core"), ("rdmap0", "efa")):
        (tmp_path / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (sysfs / dev / "device").mkdir(parents=True)
        (sysfs / dev / "device" / "driver").symlink_to(tmp_path / "drivers" / driver)
    env = {}
    assert not skip_idle_efa(env, str(sysfs)) and env == {}  # an EFA host keeps the module
    (sysfs / "rdmap0" / "device" / "driver").unlink()
    assert skip_idle_efa(env, str(sysfs)) and env == {"UCX_MODULES": "^efa"}


def test_long_descriptors_are_cut_into_max_descriptor_bytes_pieces(monkeypatch):
    """A descriptor longer than ``max_descriptor_bytes`` goes as pieces of at
    most that size (UCX over TCP moves 4 MiB pieces faster than 16 MiB
    ones), landing byte-exact."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    from transfer.transport.nixl.transport import NixlTransport
    config = EngineConfig(backend="nixl", max_descriptor_bytes=64 << 10)
    a, b = NixlTransport(config), NixlTransport(config)
    try:
        src = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        a.register([(src.ctypes.data, src.nbytes)])
        b.register([(dst.ctypes.data, dst.nbytes)])
        _open(a, b)
        plan = TransferPlan(np.array([src.ctypes.data], dtype=np.uint64), np.array([dst.ctypes.data], dtype=np.uint64),
                            np.array([src.nbytes - 4096], dtype=np.uint64))
        assert _run(a, b.session, plan) is None
        assert a.num_descriptors == 16  # 1 MiB - 4 KiB in pieces of 64 KiB
        assert np.array_equal(dst[:-4096], src[:-4096]) and not dst[-4096:].any()
    finally:
        a.close()
        b.close()


def test_a_ucx_backend_gets_a_mutex_for_its_worker_lock_unless_the_host_chose():
    """UCX guards a worker that NIXL's progress thread shares with ours by a
    spin lock: kvferry asks for a mutex, in the UCX plugin's
    ``engine_config``, unless the host set it (either way); other backends
    and other options pass unchanged."""
    from transfer.transport.nixl.api import backend_params

    assert backend_params("UCX", {}, environ={}) == {"engine_config": "USE_MT_MUTEX=y"}
    assert backend_params("UCX", {"num_workers": 2}, environ={}) == {"num_workers": "2",
                                                                    "engine_config": "USE_MT_MUTEX=y"}
    assert backend_params("UCX", {"engine_config": "TLS=tcp"}, environ={}) == {
        "engine_config": "TLS=tcp,USE_MT_MUTEX=y"}
    assert backend_params("UCX", {"engine_config": "use_mt_mutex=n"}, environ={}) == {
        "engine_config": "use_mt_mutex=n"}
    assert backend_params("UCX", {}, environ={"UCX_USE_MT_MUTEX": "n"}) == {}
    assert backend_params("LIBFABRIC", {"x": "1"}, environ={}) == {"x": "1"}


def test_the_ucx_settings_reach_ucx(monkeypatch, capfd):
    """What kvferry passes in ``engine_config`` is UCX's own configuration:
    UCX's parser reads the key (a value it cannot parse, it says so and
    keeps its default); a setting UCX cannot work with fails the agent's
    start naming what was passed; the default starts."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.delenv("UCX_USE_MT_MUTEX", raising=False)
    from transfer.transport.nixl.transport import NixlTransport
    NixlTransport(EngineConfig(backend="nixl", nixl_options={"engine_config": "USE_MT_MUTEX=sometimes"})).close()
    said = capfd.readouterr()
    assert "Invalid value for USE_MT_MUTEX: 'sometimes'" in said.out + said.err  # UCX logs to stdout
    with pytest.raises(TransferError, match="engine_config.*TLS=no_such_transport,USE_MT_MUTEX=y"):
        NixlTransport(EngineConfig(backend="nixl", nixl_options={"engine_config": "TLS=no_such_transport"}))
    transport = NixlTransport(EngineConfig(backend="nixl"))
    try:
        assert transport.params == {"engine_config": "USE_MT_MUTEX=y"}
        assert "engine_config=USE_MT_MUTEX=y" in transport.describe()
        said = capfd.readouterr()
        assert "Invalid value" not in said.out + said.err
    finally:
        transport.close()
