"""vLLM's stats and Prometheus classes for kvferry's connector.

:class:`KvferryConnectorStats` carries :mod:`transfer.adapters.vllm.stats`'
payload from the worker to vLLM's loggers (``get_kv_connector_stats``, then
``build_kv_connector_stats`` in the logging process); :class:`KvferryPromMetrics`
(``build_prom_metrics``) turns it into metrics on vLLM's own ``/metrics``,
each with vLLM's labels (``model_name``, ``engine``)::

    vllm:kvferry_xfer_time_seconds           histogram: per successful room, request to done
    vllm:kvferry_bytes_transferred           histogram: per successful room, bytes
    vllm:kvferry_num_descriptors             histogram: per successful room, descriptors
    vllm:kvferry_exposed_transfer_seconds    histogram: decode, per successful room, prefill's last send to done
    vllm:kvferry_bytes_total{path}           bytes of ended rooms (failed ones too): direct|staged|storage
    vllm:kvferry_failed_transfers_total{reason}   failed rooms by reason (FailureReason, lease_expired)

A prefill server reports what it sent, a decode server what it received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from transfer.adapters.vllm import stats as vllm_stats

_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_BYTES = [2 ** (10 + i) for i in range(1, 25, 2)]  # 2 KiB .. 8 GiB
_DESCRIPTORS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536]


@dataclass
class KvferryConnectorStats(KVConnectorStats):
    """One interval's payload (see :mod:`transfer.adapters.vllm.stats`)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = vllm_stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        vllm_stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return vllm_stats.summary(self.data)

    def is_empty(self) -> bool:
        return vllm_stats.is_empty(self.data)


class KvferryPromMetrics(KVConnectorPromMetrics):
    """The metrics above, registered once per vLLM frontend process."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list) -> dict:
            return create_metric_per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                                                labelnames=labelnames), per_engine_labelvalues)

        self.xfer_seconds = histogram("vllm:kvferry_xfer_time_seconds",
                                      "kvferry: seconds from request to done of each successful room.", _SECONDS)
        self.xfer_bytes = histogram("vllm:kvferry_bytes_transferred",
                                    "kvferry: bytes of each successful room.", _BYTES)
        self.xfer_descriptors = histogram("vllm:kvferry_num_descriptors",
                                          "kvferry: descriptors of each successful room.", _DESCRIPTORS)
        self.exposed = histogram("vllm:kvferry_exposed_transfer_seconds",
                                 "kvferry: decode, seconds from prefill's last send (its forward's end) to done "
                                 "of each successful room.", _SECONDS)
        # Labelled beyond vLLM's labels: children made per observation.
        self.bytes_by_path = self._counter_cls(name="vllm:kvferry_bytes",
                                               documentation="kvferry: bytes of ended rooms by path "
                                                             "(direct, staged, storage), failed rooms too.",
                                               labelnames=[*labelnames, "path"])
        self.failures = self._counter_cls(name="vllm:kvferry_failed_transfers",
                                          documentation="kvferry: failed rooms by reason.",
                                          labelnames=[*labelnames, "reason"])
        self.layer_groups = self._counter_cls(name="vllm:kvferry_layer_groups",
                                              documentation="kvferry: prefill, layer groups of layer-wise rooms "
                                                            "sent during the forward pass and after it.",
                                              labelnames=[*labelnames, "when"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for metric, key in ((self.xfer_seconds, "transfer_duration"), (self.xfer_bytes, "bytes_transferred"),
                            (self.xfer_descriptors, "num_descriptors"), (self.exposed, "exposed_transfer")):
            for value in data.get(key, ()):
                metric[engine_idx].observe(value)
        labels = self.per_engine_labelvalues[engine_idx]
        for path, n in data.get("bytes_by_path", {}).items():
            self.bytes_by_path.labels(*labels, path).inc(n)
        for reason, n in data.get("failures", {}).items():
            self.failures.labels(*labels, reason).inc(n)
        for when, n in data.get("layer_groups", {}).items():
            self.layer_groups.labels(*labels, when).inc(n)
