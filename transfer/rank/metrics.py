"""Prometheus ``/metrics`` of a rank (optional: ``prometheus-client``).

Nothing is counted here: a custom collector reads :meth:`KVManager.stats()
<transfer.manager.KVManager.stats>` when the page is scraped, so the only
cost on the data path is the integer additions of :mod:`transfer.stats`.
Each server keeps its own ``CollectorRegistry`` (no global state; the
bootstrap server's is separate, see :mod:`bootstrap.metrics`).

Several managers of one process with the same ``metrics_port`` share one
HTTP server (bound on the first one's ``host``); their numbers are summed
per ``role`` label (prefill, decode). Give ranks of separate processes
separate ports (e.g. a base port plus the local rank).

Exported (units in names, labels of bounded cardinality, no room ids)::

    kvferry_bytes_total{role,pool,path}          bytes landed: pool target|draft|aux, path direct|staged|storage
    kvferry_descriptors_total{role,pool,path}    descriptors completed (decode: staged parts only)
    kvferry_staged_parts_total{role}             staged parts written (prefill) / scattered (decode)
    kvferry_rooms_total{role,state,reason}       ended rooms: Success (reason "") or Failed and why
    kvferry_room_seconds{role}                   histogram: request to Success
    kvferry_room_first_byte_seconds{role}        histogram: request to the first data landed
    kvferry_live_rooms{role}                     rooms not ended
    kvferry_peers{role,state="live"}             peers under liveness watch now
    kvferry_peers_lost_total{role}               peers given up for silence
    kvferry_rooms_relinked_total{role}           decode rooms re-asked of a restarted prefill node
    kvferry_control_messages_received_total{role}
    kvferry_control_messages_dropped_total{role,reason}   malformed|unauthenticated|unhandshaken
    kvferry_staging_bytes_in_use{role}, kvferry_staging_capacity_bytes{role}
    kvferry_storage_pages_total{role,op,result}  read hit|miss, write written|present|failed
    kvferry_storage_bytes_total{role,op}         read|write
    kvferry_prefetch_wait_seconds{role}          histogram: decode init to prefetch settled
    kvferry_exposed_transfer_seconds{role}       histogram: prefill's forward end (last send() or event) to Success
    kvferry_handshakes_total{role,result}        opened|failed (prefill: its transport's opens of the way to
                                                 decode ranks; decode: its handshakes answered or refused)
    kvferry_handshake_timeouts_total{role}       handshakes given up at their bound (counted in failed too)
    kvferry_handshake_seconds_total{role}        seconds the finished handshakes took
    kvferry_handshakes_in_progress{role}         handshakes running now
    kvferry_periodic_round_max_seconds{role,task}  the longest round of a periodic task, CPU seconds:
                                                 task liveness|sweep|register|resolver|control|metrics|gc
    kvferry_periodic_round_max_by_kind_seconds{role,task,kind}  the same by what the thread's context switches
                                                 say of each hold: kind whole (none: the figure is exact),
                                                 preempted|waited (upper bounds); no gc
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from bootstrap.metrics import require_prometheus
from transfer.round_times import HOLD_KINDS, PERIODIC_TASKS, RoundTimes
from transfer.stats import PATHS, POOLS, REASONS, Histogram, ManagerStats

_ROOM_KEYS = [("Success", "")] + [("Failed", r) for r in REASONS]
_DROPS = (("malformed", "control_malformed"), ("unauthenticated", "control_unauthenticated"),
          ("unhandshaken", "control_unhandshaken"))
_STORAGE_PAGES = (("read", "hit"), ("read", "miss"), ("write", "written"), ("write", "present"), ("write", "failed"))

_lock = threading.Lock()
_endpoints: dict[int, _Endpoint] = {}


class _Source(NamedTuple):
    """A manager on a metrics port: its ``stats`` and the round times its periodic work is measured in."""

    stats: Callable[[], ManagerStats]
    round_times: RoundTimes


class _Collector:
    def __init__(self, endpoint: _Endpoint) -> None:
        self.endpoint = endpoint

    def collect(self):
        """Every family, built while prometheus_client formats the one
        before (a scrape, about 1.5 ms of CPU on this VM, would hold the
        interpreter lock that long): the interpreter lock is given up
        between two, as a periodic round's, measured as the task
        ``metrics`` of the first manager on the port."""
        sources = self.endpoint.sources()
        times = sources[0].round_times if sources else RoundTimes()
        with times.round("metrics") as round_:
            by_role: dict[str, list[ManagerStats]] = {}
            for source in sources:
                round_.tick()
                s = source.stats()
                by_role.setdefault(s.side, []).append(s)
            for family in _families(by_role):
                round_.tick()
                yield family


def _families(by_role: dict[str, list[ManagerStats]]):
    """The metric families of the managers' stats, by role."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def total(stats, get) -> float:
        return sum(get(s) for s in stats)

    def counter(name, doc, labels, rows):
        fam = CounterMetricFamily(name, doc, labels=["role", *labels])
        for role, stats in by_role.items():
            for values, get in rows:
                fam.add_metric([role, *values], total(stats, get))
        return fam

    def gauge(name, doc, get, labels=(), values=()):
        fam = GaugeMetricFamily(name, doc, labels=["role", *labels])
        for role, stats in by_role.items():
            fam.add_metric([role, *values], total(stats, get))
        return fam

    def histogram(name, doc, get: Callable[[ManagerStats], Histogram]):
        fam = HistogramMetricFamily(name, doc, labels=["role"])
        for role, stats in by_role.items():
            hists = [get(s) for s in stats]
            counts = [sum(h.counts[i] for h in hists) for i in range(len(hists[0].counts))]
            buckets, running = [], 0
            for bound, n in zip((*hists[0].bounds, float("inf")), counts, strict=True):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            fam.add_metric([role], buckets, sum_value=sum(h.total for h in hists))
        return fam

    keys = [(pool, path) for pool in POOLS for path in PATHS]
    yield counter("kvferry_bytes", "Bytes landed, by pool and path", ["pool", "path"],
                  [(k, lambda s, k=k: s.bytes.get(k, 0)) for k in keys])
    yield counter("kvferry_descriptors", "Transfer descriptors completed (decode: staged parts only)",
                  ["pool", "path"], [(k, lambda s, k=k: s.descriptors.get(k, 0)) for k in keys])
    yield counter("kvferry_staged_parts", "Staged parts written (prefill) or scattered (decode)", [],
                  [((), lambda s: s.num_parts)])
    yield counter("kvferry_rooms", "Rooms ended, by final state and failure reason", ["state", "reason"],
                  [(k, lambda s, k=k: s.rooms.get(k, 0)) for k in _ROOM_KEYS])
    yield histogram("kvferry_room_seconds", "Rooms from request to Success", lambda s: s.room_seconds)
    yield histogram("kvferry_room_first_byte_seconds", "Rooms from request to their first data",
                    lambda s: s.first_byte_seconds)
    yield gauge("kvferry_live_rooms", "Rooms not ended", lambda s: s.live_rooms)
    yield gauge("kvferry_peers", "Peers under liveness watch", lambda s: s.peers_live, ["state"], ["live"])
    yield counter("kvferry_peers_lost", "Peers given up after peer_timeout_s of silence", [],
                  [((), lambda s: s.peers_lost)])
    yield counter("kvferry_rooms_relinked", "Decode rooms that asked their prefill node afresh, its rank "
                  "found gone before it took their request (a restarted node)", [],
                  [((), lambda s: s.rooms_relinked)])
    yield counter("kvferry_control_messages_received", "Control messages received", [],
                  [((), lambda s: s.control_received)])
    yield counter("kvferry_control_messages_dropped", "Control messages dropped, by reason", ["reason"],
                  [((reason,), lambda s, f=f: getattr(s, f)) for reason, f in _DROPS])
    yield gauge("kvferry_staging_bytes_in_use", "Staging buffer bytes allocated", lambda s: s.staging_bytes_in_use)
    yield gauge("kvferry_staging_capacity_bytes", "Staging buffer size", lambda s: s.staging_capacity_bytes)
    yield counter("kvferry_storage_pages", "Storage tier pages, by operation and result", ["op", "result"],
                  [(k, lambda s, k=k: s.storage_pages.get(k, 0)) for k in _STORAGE_PAGES])
    yield counter("kvferry_storage_bytes", "Storage tier bytes read and written", ["op"],
                  [((op,), lambda s, op=op: s.storage_bytes.get(op, 0)) for op in ("read", "write")])
    yield histogram("kvferry_prefetch_wait_seconds", "Decode rooms' wait for their storage prefetch",
                    lambda s: s.prefetch_wait_seconds)
    yield histogram("kvferry_exposed_transfer_seconds",
                    "Decode rooms from the end of prefill's forward (its last send(), or that send's event) "
                    "to Success",
                    lambda s: s.exposed_transfer_seconds)
    yield counter("kvferry_handshakes", "Handshakes with peers (prefill: its transport opening its way to a "
                  "decode rank; decode: its handshakes answered), by result", ["result"],
                  [(("opened",), lambda s: s.handshakes), (("failed",), lambda s: s.handshake_failures)])
    yield counter("kvferry_handshake_timeouts", "Handshakes given up at their time bound", [],
                  [((), lambda s: s.handshake_timeouts)])
    yield counter("kvferry_handshake_seconds", "Seconds the finished handshakes took", [],
                  [((), lambda s: s.handshake_seconds)])
    yield gauge("kvferry_handshakes_in_progress", "Handshakes running now", lambda s: s.handshakes_in_progress)
    longest = GaugeMetricFamily("kvferry_periodic_round_max_seconds",
                                "The longest round of each periodic task in CPU seconds (a bound on how long "
                                "it kept the interpreter lock from the scheduler)", labels=["role", "task"])
    for role, stats in by_role.items():
        for task in PERIODIC_TASKS:
            longest.add_metric([role, task], max(st.periodic_max_cpu_s.get(task, 0.0) for st in stats))
    yield longest
    by_kind = GaugeMetricFamily("kvferry_periodic_round_max_by_kind_seconds",
                                "The longest round of each periodic task in CPU seconds, by what the thread's "
                                "context switches say of it: whole (none, exact), preempted (the OS took the CPU) "
                                "or waited (a wait inside; both upper bounds)", labels=["role", "task", "kind"])
    for role, stats in by_role.items():
        for kind in HOLD_KINDS:
            for task in (t for t in PERIODIC_TASKS if t != "gc"):  # a collection is counted apart, with no kind
                by_kind.add_metric([role, task, kind],
                                   max(st.periodic_max_by_kind_s.get(kind, {}).get(task, 0.0) for st in stats))
    yield by_kind


class _Endpoint:
    """One HTTP server and registry, shared by the managers of one port."""

    def __init__(self, host: str, port: int) -> None:
        prom = require_prometheus()
        self._sources: list[_Source] = []
        self.registry = prom.CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        try:
            self.httpd, _ = prom.start_http_server(port, addr=host.strip("[]"), registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self.port = self.httpd.server_address[1]

    def sources(self) -> list[_Source]:
        with _lock:
            return list(self._sources)


class RankMetrics:
    """A manager's place on its port's server; :meth:`close` leaves it (the
    last one stops the server)."""

    def __init__(self, endpoint: _Endpoint, port: int, source: _Source) -> None:
        self._endpoint, self._key, self._source = endpoint, port, source
        self.port = endpoint.port

    def close(self) -> None:
        with _lock:
            sources = self._endpoint._sources
            if self._source not in sources:
                return
            sources.remove(self._source)
            if sources:
                return
            _endpoints.pop(self._key, None)
        self._endpoint.httpd.shutdown()
        self._endpoint.httpd.server_close()


def serve_metrics(mgr, round_times: RoundTimes) -> RankMetrics:
    """Serve ``mgr.stats()`` on ``mgr.config.metrics_port`` (sharing the
    server of another manager of this process on the same port); a
    scrape's rounds are measured in ``round_times`` (the manager's) when
    ``mgr`` is the port's first. Raises ValueError without
    prometheus-client, OSError when the port is taken."""
    port = mgr.config.metrics_port
    with _lock:
        endpoint = _endpoints.get(port)
        if endpoint is None:
            endpoint = _endpoints[port] = _Endpoint(mgr.config.host, port)
        source = _Source(mgr.stats, round_times)
        endpoint._sources.append(source)
    return RankMetrics(endpoint, port, source)
