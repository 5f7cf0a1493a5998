"""Prometheus metrics of the bootstrap server (optional: ``prometheus-client``).

:class:`NoMetrics` is what a server without a metrics port records into
(nothing). :class:`PrometheusMetrics` keeps its own ``CollectorRegistry`` (no
global state: several servers in one process do not mix) and serves it with
prometheus-client's HTTP server on ``host:port``. The serving thread calls
the ``on_*`` methods; they never block and never raise.

Exported (units in names, labels of bounded cardinality)::

    kvferry_bootstrap_registrations_total              registrations served
    kvferry_bootstrap_unregistrations_total            entries removed by Unregister
    kvferry_bootstrap_lookups_total{result}            ready | not_ready | unknown_node | refused
    kvferry_bootstrap_requests_dropped_total{reason}   malformed | unauthenticated
    kvferry_bootstrap_registered_ranks                 ranks registered now (gauge)
    kvferry_bootstrap_request_seconds{kind}            time to serve one request (histogram)
"""

from __future__ import annotations

LOOKUP_RESULTS = ("ready", "not_ready", "unknown_node", "refused")
DROP_REASONS = ("malformed", "unauthenticated")
_BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0)


class NoMetrics:
    """Records nothing (no metrics port configured)."""

    port: int | None = None

    def on_registration(self) -> None:
        pass

    def on_unregistration(self) -> None:
        pass

    def on_lookup(self, result: str) -> None:
        pass

    def on_dropped(self, reason: str) -> None:
        pass

    def on_request(self, kind: str, seconds: float, num_ranks: int) -> None:
        pass

    def close(self) -> None:
        pass


def require_prometheus():
    """The ``prometheus_client`` module; ValueError saying how to install it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ValueError("a metrics port needs prometheus-client, which is not installed: "
                         "pip install 'kvferry[metrics]' (or 'prometheus-client>=0.20')") from exc
    return prometheus_client


class PrometheusMetrics(NoMetrics):
    """Serves ``/metrics`` on ``host:port`` (0: a free port, then ``port``
    says which) from a daemon thread until :meth:`close`. Raises ValueError
    without prometheus-client, OSError when the port cannot be bound."""

    def __init__(self, host: str, port: int) -> None:
        prom = require_prometheus()
        self.registry = prom.CollectorRegistry(auto_describe=True)
        r = self.registry
        self._registrations = prom.Counter("kvferry_bootstrap_registrations", "Registrations served", registry=r)
        self._unregistrations = prom.Counter("kvferry_bootstrap_unregistrations",
                                             "Rank entries removed by an Unregister request", registry=r)
        lookups = prom.Counter("kvferry_bootstrap_lookups", "Lookups by result", ["result"], registry=r)
        self._lookups = {name: lookups.labels(result=name) for name in LOOKUP_RESULTS}
        dropped = prom.Counter("kvferry_bootstrap_requests_dropped",
                               "Requests refused before they were served", ["reason"], registry=r)
        self._dropped = {name: dropped.labels(reason=name) for name in DROP_REASONS}
        self._ranks = prom.Gauge("kvferry_bootstrap_registered_ranks", "Prefill ranks registered now", registry=r)
        self._seconds = prom.Histogram("kvferry_bootstrap_request_seconds", "Time to serve one request",
                                       ["kind"], buckets=_BUCKETS_S, registry=r)
        self._by_kind: dict[str, object] = {}
        self._httpd, self._thread = prom.start_http_server(port, addr=host.strip("[]"), registry=r)
        self.port = self._httpd.server_address[1]

    def on_registration(self) -> None:
        self._registrations.inc()

    def on_unregistration(self) -> None:
        self._unregistrations.inc()

    def on_lookup(self, result: str) -> None:
        self._lookups[result].inc()

    def on_dropped(self, reason: str) -> None:
        self._dropped[reason].inc()

    def on_request(self, kind: str, seconds: float, num_ranks: int) -> None:
        child = self._by_kind.get(kind)
        if child is None:
            child = self._by_kind[kind] = self._seconds.labels(kind=kind)
        child.observe(seconds)
        self._ranks.set(num_ranks)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
