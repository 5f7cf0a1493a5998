"""The connector's stats through vLLM's own classes, without servers: two
workers' payloads serialised the way vLLM sends them between processes,
aggregated, logged by ``KVConnectorLogging`` and exported by
``KVConnectorProm`` (both resolve kvferry's classes through vLLM's connector
factory). The servers' /metrics are checked in test_pd.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from transfer.adapters.vllm import stats as vllm_stats  # noqa: E402
from transfer.adapters.vllm import KvferryConnector  # noqa: E402
from transfer.stats import RoomStats  # noqa: E402


def room(state: str, staged: int, reason: str | None = None, seconds: float = 0.25) -> RoomStats:
    return RoomStats(side="decode", room=1, state=state, reason=reason, bytes={("target", "staged"): staged},
                     descriptors={("target", "staged"): 2}, num_parts=2, pages_from_storage=0, requested_at=10.0,
                     requested_wall=0.0, done_at=10.0 + seconds,
                     exposed_transfer_s=seconds / 5 if state == "Success" else None)


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def test_two_workers_payloads_reach_vllms_log_line_and_metrics():
    config = KVTransferConfig(kv_connector="KvferryConnector", kv_connector_module_path="transfer.adapters.vllm",
                              kv_role="kv_consumer")
    vllm_config = VllmConfig(kv_transfer_config=config)
    assert KvferryConnector(vllm_config, KVConnectorRole.SCHEDULER).get_kv_connector_stats() is None
    a, b = vllm_stats.empty(), vllm_stats.empty()
    vllm_stats.record_room(a, room("Success", 3 << 18))
    vllm_stats.record_room(b, room("Success", 5 << 18, seconds=0.75))
    vllm_stats.record_room(b, room("Failed", 1 << 18, reason="peer_lost"))
    vllm_stats.record_failure(b, vllm_stats.LEASE_EXPIRED)
    # Worker -> scheduler -> frontend: the payload crosses vLLM's msgpack serialisation.
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    a, b = (decoder.decode(encoder.encode(d)) for d in (a, b))
    stats = KvferryConnector.build_kv_connector_stats(a).aggregate(KvferryConnector.build_kv_connector_stats(b))
    assert not stats.is_empty() and KvferryConnector.build_kv_connector_stats().is_empty()

    logging = KVConnectorLogging(config)
    logging.observe(stats.to_dict())
    lines = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1, lines
    for part in ("Num successful transfers=2", "Avg MB per transfer=1.0", "MB staged=2.25", "Avg exposed transfer (ms)=100.0",
                 "Num failed transfers=2", "Failed (peer_lost)=1", "Failed (lease_expired)=1"):
        assert part in lines[0], lines[0]

    prom = KVConnectorProm(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(stats.to_dict(), 0)
    text = generate_latest(REGISTRY).decode()
    assert sample(text, "vllm:kvferry_bytes_total", path="staged", model_name="tiny") == 9 << 18
    assert sample(text, "vllm:kvferry_bytes_transferred_sum", engine="0") == 8 << 18
    assert sample(text, "vllm:kvferry_xfer_time_seconds_count", engine="0") == 2
    assert sample(text, "vllm:kvferry_xfer_time_seconds_sum", engine="0") == pytest.approx(1.0)
    assert sample(text, "vllm:kvferry_num_descriptors_sum", engine="0") == 4
    assert sample(text, "vllm:kvferry_exposed_transfer_seconds_count", engine="0") == 2
    assert sample(text, "vllm:kvferry_exposed_transfer_seconds_sum", engine="0") == pytest.approx(0.2)
    assert sample(text, "vllm:kvferry_failed_transfers_total", reason="peer_lost") == 1
    assert sample(text, "vllm:kvferry_failed_transfers_total", reason="lease_expired") == 1
