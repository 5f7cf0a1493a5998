"""Issue 14 at the bootstrap server, as a separate process: protected mode,
unknown node ids and closed ports known in well under a second, and ranks
that unregister when they close."""

import dataclasses
import os
import shutil
import subprocess
import sys
import time

import pytest

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapRefused, UnknownNodeError
from harness.launch import BootstrapProcess

from .test_bootstrap_server import _rank

pytestmark = [pytest.mark.e2e, pytest.mark.transport_free]


def _serve(args: list[str], env: dict[str, str], prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "bootstrap", "--port", "0", "--log-level", "WARNING",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.77.0.1"])
def test_server_refuses_a_non_loopback_address_without_a_secret(host):
    proc = _serve(["--host", host], {"KVFERRY_SECRET": "", "KVFERRY_INSECURE": ""})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "listening" not in out
    assert f"refuses to bind {host!r}" in err and "KVFERRY_SECRET" in err and "--insecure" in err, err


def _isolated_network() -> tuple[str, ...]:
    """A command prefix that runs in a fresh network namespace (only a
    loopback device, down): a server there may bind 0.0.0.0 safely."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private network namespace")
    if subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10).returncode != 0:
        pytest.skip("unshare --net does not work here")
    return ("unshare", "--net")


@pytest.mark.parametrize("args, env", [(["--insecure"], {"KVFERRY_SECRET": ""}),
                                       ([], {"KVFERRY_SECRET": "", "KVFERRY_INSECURE": "1"}),
                                       ([], {"KVFERRY_SECRET": "s3cret"})])
def test_server_binds_everywhere_with_a_secret_or_an_explicit_insecure(args, env):
    proc = _serve(["--host", "0.0.0.0", *args], env, prefix=_isolated_network())
    try:
        line = proc.stdout.readline()
        assert "listening on 0.0.0.0:" in line, proc.stderr.read() if proc.poll() is not None else line
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_loopback_needs_nothing():
    with BootstrapProcess(secret="") as server:
        with BootstrapClient(server.address, timeout_s=5) as client:
            assert client.ping().num_nodes == 0


def test_unknown_node_fails_fast_once_the_grace_time_is_over():
    with BootstrapProcess(extra_args=("--node-grace-s", "2")) as server:
        with BootstrapClient(server.address, timeout_s=5) as client:
            client.register(_rank(0, tp_size=1, node="prefill-0"))
            client.register(_rank(0, tp_size=1, node="prefill-1"))
            early = client.lookup("prefil-0", 0, strict=True)  # maybe not registered yet: not ready
            uptime_s = client.status().uptime_s
            if uptime_s < 2:  # (a loaded machine may have taken longer)
                assert early.ready is False and early.unknown_node is False
            time.sleep(max(0.0, 2.1 - uptime_s))
            start = time.monotonic()
            with pytest.raises(UnknownNodeError, match=r"knows no prefill node 'prefil-0' \(known nodes: "
                                                       r"'prefill-0', 'prefill-1'\)") as info:
                client.lookup("prefil-0", 0, strict=True)
            assert time.monotonic() - start < 1.0
            assert info.value.known_nodes == ("prefill-0", "prefill-1") and info.value.code == "unknown_node"
            relaxed = client.lookup("prefil-0", 0)  # not strict: the reply says so, nothing raised
            assert relaxed.unknown_node and not relaxed.ready and relaxed.known_nodes == ("prefill-0", "prefill-1")
            assert client.lookup("prefill-1", 0, strict=True).ready


def test_a_restarted_server_is_not_ready_not_unknown_during_its_grace_time():
    with BootstrapProcess() as server:  # default grace: 4 s
        with BootstrapClient(server.address, timeout_s=5) as client:
            reply = client.lookup("prefill-0", 0, strict=True)
            assert reply.ready is False and reply.unknown_node is False and reply.dp_size == 0


def test_unregister_removes_the_rank_at_once_but_not_a_newer_session():
    with BootstrapProcess() as server:
        with BootstrapClient(server.address, timeout_s=5) as client:
            old, new = _rank(0), _rank(1)
            client.register(old)
            client.register(new)
            assert client.lookup("p0", 0).ready
            restarted = dataclasses.replace(old, session="127.0.0.1:9999")
            client.register(restarted)  # tp 0 restarted: the old process's late close must not remove it
            late = client.unregister(old)
            assert late.removed is False and late.num_registered == 2
            assert client.lookup("p0", 0).ranks[0].session == "127.0.0.1:9999"
            start = time.monotonic()
            gone = client.unregister(restarted)
            assert time.monotonic() - start < 1.0
            assert gone.removed is True and gone.num_registered == 1
            reply = client.lookup("p0", 0)
            assert not reply.ready and reply.num_registered == 1
            assert [r.tp_rank for r in client.status().ranks] == [1]


def test_unregister_against_a_closed_port_is_refused_fast():
    server = BootstrapProcess()
    address = server.address
    server.close()
    with BootstrapClient(address, timeout_s=5) as client:
        start = time.monotonic()
        with pytest.raises(BootstrapRefused):
            client.unregister(_rank(0))
        assert time.monotonic() - start < 1.0
