"""What kvferry's vLLM connector reports to vLLM each engine step. Pure.

Imports neither vLLM, torch, zmq nor Mooncake (the vLLM classes that carry
it are in :mod:`transfer.adapters.vllm.metrics`).

The rule: the worker records a room once, when it ends (the same
:class:`~transfer.stats.RoomStats` that ``KVSender.stats()`` /
``KVReceiver.stats()`` return), and a room that could not open as one
failure; vLLM takes what was recorded since its last call every step
(``get_kv_connector_stats``), adds the steps and workers up
(:func:`merge`), logs a summary (:func:`summary`) and feeds its Prometheus
metrics. Per successful room: seconds from request to done, bytes and
descriptors (what the transfer numbers mean on each side:
docs/observability.md), and on decode the exposed transfer time (prefill's
last send to Success: ``RoomStats.exposed_transfer_s``); per ended room, successful or not, bytes by path
(``direct``, ``staged``, ``storage``); per failed room, one count under its
reason (:class:`~transfer.stats.FailureReason`'s values, plus
``lease_expired``: a prefill room no decode asked for within the lease,
whose blocks vLLM got back); per layer-wise prefill room, its layer groups
sent during the forward pass and after it.

The payload is a dict of lists and dicts of numbers with string keys: vLLM
serialises it between its processes.
"""

from __future__ import annotations

import statistics

from transfer.stats import PATHS, RoomStats

#: The reason of a prefill room the connector ended because its lease ran out.
LEASE_EXPIRED = "lease_expired"
#: When a layer-wise prefill room's groups were sent: during the forward pass, or after it.
FORWARD, AFTER = "forward", "after"

_LISTS = ("transfer_duration", "bytes_transferred", "num_descriptors", "exposed_transfer")


def empty() -> dict:
    """A payload with nothing recorded."""
    return {"transfer_duration": [], "bytes_transferred": [], "num_descriptors": [], "exposed_transfer": [],
            "bytes_by_path": {}, "failures": {}, "layer_groups": {}}


def record_room(data: dict, room: RoomStats, *, reason: str | None = None) -> None:
    """Add one ended room (``reason``: overrides ``room.reason`` of a failed room)."""
    for (_, path), num_bytes in room.bytes.items():
        data["bytes_by_path"][path] = data["bytes_by_path"].get(path, 0) + num_bytes
    if room.state == "Success":
        data["transfer_duration"].append(room.seconds or 0.0)
        data["bytes_transferred"].append(room.total_bytes)
        data["num_descriptors"].append(room.total_descriptors)
        if room.exposed_transfer_s is not None:
            data["exposed_transfer"].append(room.exposed_transfer_s)
    else:
        record_failure(data, reason or room.reason or "other")


def record_failure(data: dict, reason: str) -> None:
    data["failures"][reason] = data["failures"].get(reason, 0) + 1


def record_layer_groups(data: dict, in_forward: int, after: int) -> None:
    """A layer-wise prefill room's groups: sent while the forward pass went
    on (``forward``) and once it was over (``after``)."""
    for when, n in ((FORWARD, in_forward), (AFTER, after)):
        if n:
            data["layer_groups"][when] = data["layer_groups"].get(when, 0) + n


def is_empty(data: dict) -> bool:
    return not (data["transfer_duration"] or data["failures"] or any(data["bytes_by_path"].values())
                or data.get("layer_groups"))


def merge(into: dict, other: dict) -> dict:
    """Add ``other`` to ``into`` (changed in place; returned)."""
    for key in _LISTS:
        into[key].extend(other.get(key, ()))
    for key in ("bytes_by_path", "failures", "layer_groups"):
        into.setdefault(key, {})
        for name, n in other.get(key, {}).items():
            into[key][name] = into[key].get(name, 0) + n
    return into


def summary(data: dict) -> dict[str, int | float]:
    """The interval in a few numbers, for vLLM's periodic log line."""
    seconds, num_bytes = data["transfer_duration"], data["bytes_transferred"]
    n = len(seconds)
    out: dict[str, int | float] = {"Num successful transfers": n}
    if n:
        total_s = sum(seconds)
        out.update({
            "Avg xfer time (ms)": round(statistics.fmean(seconds) * 1e3, 3),
            "P90 xfer time (ms)": round(sorted(seconds)[min(n - 1, int(0.9 * n))] * 1e3, 3),
            "Avg MB per transfer": round(sum(num_bytes) / n / 2**20, 3),
            "Throughput (MB/s)": round(sum(num_bytes) / 2**20 / total_s, 3) if total_s > 0 else 0.0,
            "Avg number of descriptors": round(statistics.fmean(data["num_descriptors"]), 1),
        })
    exposed = data.get("exposed_transfer", [])
    if exposed:
        out["Avg exposed transfer (ms)"] = round(statistics.fmean(exposed) * 1e3, 3)
    for path in PATHS:
        if data["bytes_by_path"].get(path):
            out[f"MB {path}"] = round(data["bytes_by_path"][path] / 2**20, 3)
    out["Num failed transfers"] = sum(data["failures"].values())
    for reason, count in sorted(data["failures"].items()):
        out[f"Failed ({reason})"] = count
    return out
