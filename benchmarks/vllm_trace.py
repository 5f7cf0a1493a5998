"""``python -m benchmarks.vllm_trace``: where kvferry's TTFT goes with real vLLM servers.

Runs ``benchmarks.vllm``'s requests for one kvferry protocol through
:class:`TracingKvferryConnector` (a subclass that logs a wall-clock line per
connector call: ``KVTRACE {json}`` in the server's log) and prints, per request
and as medians, the time from the client's start to each step on the way:

- prefill: first scheduled (compute starts), ``request_finished`` (compute
  done), the step whose ``start`` opened the room, the room's first byte and
  done (kvferry's ``RoomStats``), the step whose ``get_finished`` reported it;
- decode: ``update_state_after_alloc`` (the request is admitted), the step
  that opened the room, its done, the ``get_finished`` that reported it, the
  step that scheduled the request again (computes its last prompt token);
- the client's first token.

Each server also logs, every few seconds, the CPU seconds of each of its
threads (``/proc/self/task``), named by Python's thread names where known.
Not part of the benchmark's numbers; a diagnostic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from transfer.adapters.vllm import KvferryConnector

_T0 = time.monotonic() - time.time()  # wall = monotonic - _T0


def trace(event: str, **kw) -> None:
    print("KVTRACE " + json.dumps({"t": time.time(), "ev": event, **kw}), file=sys.stderr, flush=True)


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, by name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class _Tracing:
    """Connector-agnostic events: admitted with external tokens, finished
    with delayed free, first scheduled, reported by get_finished."""

    def _trace_init(self, side: str) -> None:
        self._side = side
        self._sched_seen: set = set()
        self._ext: set[str] = set()

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            self._ext.add(request.request_id)
            trace("alloc", side=self._side, req=request.request_id)

    def request_finished(self, request, block_ids):
        out = super().request_finished(request, block_ids)
        if out[0]:
            self._ext.add(request.request_id)
            trace("finished", side=self._side, req=request.request_id)
        return out

    def build_connector_meta(self, scheduler_output):
        for req_id, n in (getattr(scheduler_output, "num_scheduled_tokens", {}) or {}).items():
            key = (req_id, req_id in self._ext)
            if key not in self._sched_seen:
                self._sched_seen.add(key)
                trace("sched", side=self._side, req=req_id, tokens=n)
        return super().build_connector_meta(scheduler_output)

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        for req_id in (sending or set()) | (recving or set()):
            trace("reported", side=self._side, req=req_id)
        return sending, recving


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnector

    class TracingMooncakeConnector(_Tracing, MooncakeConnector):
        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            self._trace_init("prefill" if vllm_config.kv_transfer_config.kv_role == "kv_producer" else "decode")
except ImportError:  # no Mooncake connector in this vLLM
    pass


class TracingKvferryConnector(_Tracing, KvferryConnector):
    """Also: each room's kvferry RoomStats (requested, first byte, done) and
    when the worker's driver saw it end, at the get_finished that reports it;
    and the CPU seconds of each thread every 5 s."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._trace_init("prefill" if self.is_producer else "decode")
        self._ended: dict[str, tuple[float, object]] = {}
        self._calls: list[float] = []  # the last get_finished calls
        if self.worker is not None:
            threading.Thread(target=self._cpu_loop, name="kvtrace-cpu", daemon=True).start()
            poll = self.worker._poll

            def traced_poll(rooms):  # when the worker (driver or start) saw a room end
                with self.worker._lock:
                    listed = dict(self.worker._rooms)
                poll(rooms)
                now = time.time()
                with self.worker._lock:
                    gone = set(listed) - set(self.worker._rooms)
                for req_id in gone:
                    self._ended.setdefault(req_id, (now, listed[req_id].handle.stats()))

            self.worker._poll = traced_poll

    def _cpu_loop(self) -> None:
        while True:
            time.sleep(5)
            trace("cpu", side=self._side, threads=thread_cpu())

    def get_finished(self, finished_req_ids):
        sending, recving = KvferryConnector.get_finished(self, finished_req_ids)
        now = time.time()
        for req_id in (sending or set()) | (recving or set()):
            seen, st = self._ended.pop(req_id, (None, None))
            trace("reported", side=self._side, req=req_id, worker_done=seen,
                  prev_call=self._calls[-1] if self._calls else None,
                  requested=st and st.requested_wall, first_byte=st and st.first_byte_wall, done=st and st.done_wall)
        self._calls = self._calls[-1:] + [now]
        return sending, recving


# --- the driver -------------------------------------------------------------------------

def read_traces(path: str) -> list[dict]:
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            i = line.find("KVTRACE ")
            if i >= 0:
                try:
                    out.append(json.loads(line[i + 8:]))
                except ValueError:
                    pass
    return out


def breakdown(windows: list[tuple[float, float, float]], events: list[dict]) -> list[dict]:
    """Per request window (t0 wall, ttft, next t0): offsets of its events from t0, in ms."""
    rows = []
    for t0, ttft, t_next in windows:
        row = {"ttft": ttft * 1e3}
        for e in events:
            if not t0 <= e["t"] < t_next:
                continue
            side, ev = e["side"], e["ev"]
            if ev == "sched":
                key = f"{side}.sched" if f"{side}.sched" not in row else f"{side}.sched2"
                row.setdefault(key, (e["t"] - t0) * 1e3)
            elif ev == "reported":
                row.setdefault(f"{side}.reported", (e["t"] - t0) * 1e3)
                for k in ("requested", "first_byte", "done", "worker_done", "prev_call"):
                    if e.get(k):
                        row.setdefault(f"{side}.room_{k}", (e[k] - t0) * 1e3)
            elif ev in ("alloc", "finished", "start"):
                row.setdefault(f"{side}.{ev}", (e["t"] - t0) * 1e3)
        rows.append(row)
    return rows


ORDER = ["decode.alloc", "decode.room_requested", "prefill.sched", "prefill.finished",
         "prefill.room_requested", "prefill.room_first_byte", "prefill.room_done",
         "prefill.reported", "decode.room_first_byte", "decode.room_done", "decode.room_worker_done", "decode.room_prev_call", "decode.reported", "decode.sched",
         "decode.sched2", "ttft"]


def main(argv=None) -> int:
    import random
    import benchmarks.vllm as bv
    from harness.vllm import VOCAB, build_tiny_model

    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_trace")
    ap.add_argument("--connectors", default="kvferry-concurrent,mooncake")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randrange(100, 1001))] for _ in range(args.requests)]
    model = build_tiny_model(os.path.join(args.dir, "model"))
    configs = bv.kv_configs

    def traced(name, ports):
        pc, dc, penv, denv = configs(name, ports)
        cls = "TracingMooncakeConnector" if name == "mooncake" else "TracingKvferryConnector"
        for c in (pc, dc):
            c.update(kv_connector=cls, kv_connector_module_path="benchmarks.vllm_trace")
        return pc, dc, penv, denv

    bv.kv_configs = traced
    starts: list[float] = []
    one = bv.one_request

    def timed(*a, **kw):
        starts.append(time.time())
        return one(*a, **kw)

    bv.one_request = timed
    for name in args.connectors.split(","):
        starts.clear()
        run = bv.run_connector(name, model, prompts, args.max_tokens, args.dir)
        report(name, run, starts[1:], args.dir)
    return 0


def report(name: str, run: dict, starts: list[float], log_dir: str) -> None:
    events = []
    for side in ("prefill", "decode"):
        events += read_traces(os.path.join(log_dir, f"{name}-{side}.log"))
    windows = [(t0, r["ttft_s"], starts[i + 1] if i + 1 < len(starts) else t0 + 60)
               for i, (t0, r) in enumerate(zip(starts, run["results"]))]
    rows = breakdown(windows, events)
    print(f"{name}: ms from the client's start (median over requests; n = requests that have the event):")
    for key in ORDER:
        vals = [r[key] for r in rows if key in r]
        if vals:
            print(f"  {key:26s} {statistics.median(vals):8.1f}  p90 {sorted(vals)[int(0.9 * (len(vals) - 1))]:8.1f}"
                  f"  n={len(vals)}")
    cpu = [e for e in events if e["ev"] == "cpu"]
    for side in ("prefill", "decode"):
        last = [e for e in cpu if e["side"] == side]
        if last:
            top = sorted(last[-1]["threads"].items(), key=lambda kv: -kv[1])[:12]
            print(f"  {side} thread CPU s: " + ", ".join(f"{k}={v:.1f}" for k, v in top))
    with open(os.path.join(log_dir, f"trace-{name}.json"), "w") as f:
        json.dump({"rows": rows, "events": events}, f)


if __name__ == "__main__":
    raise SystemExit(main())
