"""The bootstrap server's Prometheus /metrics, scraped over HTTP from a real
server process after real registrations, lookups and refused requests."""

import subprocess
import sys
import time
import urllib.request

import pytest

from bootstrap import codec
from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError
from bootstrap.messages import Ping
from harness.launch import BootstrapProcess

from .test_bootstrap_server import _rank, _raw

pytestmark = [pytest.mark.e2e, pytest.mark.transport_free]
parser = pytest.importorskip("prometheus_client.parser")


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_the_server_did():
    with BootstrapProcess(extra_args=("--metrics-port", "0", "--node-grace-s", "1")) as server:
        line = server.proc.stdout.readline()
        assert line.startswith("kvferry bootstrap metrics on http://127.0.0.1:"), line
        url = line.split()[-1]
        with BootstrapClient(server.address, timeout_s=5) as client:
            client.register(_rank(0, tp_size=2))            # p0: half registered
            client.register(_rank(0, tp_size=1, node="q"))   # q: ready
            client.register(_rank(0, tp_size=1, node="r"))
            assert client.unregister(_rank(0, tp_size=1, node="r")).removed
            assert client.lookup("q", 0).ready
            assert client.lookup("q", 0).ready
            assert not client.lookup("p0", 0).ready
            with pytest.raises(BootstrapError, match="no dp rank 3"):
                client.lookup("q", 3)                        # refused
            time.sleep(max(0.0, 1.1 - client.status().uptime_s))
            assert client.lookup("nobody", 0).unknown_node
        _raw(server.address, [b"\xc1 not msgpack"])          # malformed
        _raw(server.address, [codec.encode(Ping(), codec.secret_key("not-configured"))])  # unauthenticated
        got = _scrape(url)
    assert got[("kvferry_bootstrap_registrations_total", ())] == 3
    assert got[("kvferry_bootstrap_unregistrations_total", ())] == 1
    lookups = {dict(k[1])["result"]: v for k, v in got.items() if k[0] == "kvferry_bootstrap_lookups_total"}
    assert lookups == {"ready": 2, "not_ready": 1, "unknown_node": 1, "refused": 1}
    dropped = {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "kvferry_bootstrap_requests_dropped_total"}
    assert dropped == {"malformed": 1, "unauthenticated": 1}
    assert got[("kvferry_bootstrap_registered_ranks", ())] == 2  # p0 tp 0 and q
    counts = {dict(k[1])["kind"]: v for k, v in got.items() if k[0] == "kvferry_bootstrap_request_seconds_count"}
    assert counts == {"register": 3, "unregister": 1, "lookup": 5, "status": 1, "invalid": 2}
    total_s = sum(v for k, v in got.items() if k[0] == "kvferry_bootstrap_request_seconds_sum")
    assert 0 < total_s < 5


def test_a_metrics_port_without_prometheus_client_is_a_clear_error_at_start():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from bootstrap.__main__ import main\n"
            "sys.exit(main(['--port', '0', '--metrics-port', '0']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "listening" not in out.stdout
    assert "needs prometheus-client" in out.stderr and "kvferry[metrics]" in out.stderr, out.stderr


def test_no_metrics_port_no_http_server():
    with BootstrapProcess() as server:
        with BootstrapClient(server.address, timeout_s=5) as client:
            client.register(_rank(0, tp_size=1))
        server.proc.terminate()
        rest, _ = server.proc.communicate(timeout=10)
        assert "metrics" not in rest
