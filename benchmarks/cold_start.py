"""``python -m benchmarks.cold_start``: the first rooms of fresh prefill ->
decode pairs, with and without neighbours on decode's Mooncake handshake port.

For each pair a NEW prefill process and a NEW decode process
(:mod:`harness.rankctl`: TP 1, the default ``ManagerConfig``, Mooncake over
TCP on loopback) meet at one bootstrap server; decode then runs one 4 MiB
room (random bytes, every byte checked), then a second. A room is timed from
decode's ``KVReceiver(...)`` to the ``poll()`` that returns Success (its
bootstrap lookup and the pair's handshake included: the first room forms
the link). Prefill reports the longest single scheduler call of each room
(``poll``, ``send``, ``init``): what its scheduler loop was held up by.

Neighbours (``--variants``), started on decode's handshake port (the port of
its Mooncake engine's handshake listener, ``handshake_port`` in rankctl's
READY) after both ranks are up and before the first room:

- ``none``: nothing;
- ``probe``: a connect-and-close every 100 ms, as a TCP health check does;
- ``idle1`` / ``idle2``: one or two connections opened and left idle, as a
  port scanner or a probe that never closes does.

``--pairs`` pairs per variant; every room must succeed with exact bytes (a
failure is reported with its message and counted, not hidden). ``--json F``
writes every measurement.

``--streaming``: one prefill rank P streams 4 MiB rooms to decode rank D1,
one after another, while other decode ranks join P ``--events`` times each:
a new process, a restarted one (the previous joiner killed), one with two
idle connections on its handshake port. The table gives D1's latency over
its rooms that overlapped no join and over those that overlapped each kind
of join's window (from the joiner being up to its first room done: its
lookup, hello, P's open of its segment and its first room), and the
joiners' first rooms (:func:`harness.cold_pairs.run_streaming`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from harness.cold_pairs import VARIANTS, run_pair, run_streaming, streaming_summary, summarize
from harness.launch import BootstrapProcess

def table(rows: list[dict]) -> str:
    out = ["| neighbour on decode's handshake port | room | n | failed | min / median / p99 / max s | "
           "prefill's longest poll/send/init |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['variant']} | {r['room']} | {r['num']} | {r['failed']} | {r['min_s']:.3f} / "
                   f"{r['median_s']:.3f} / {r['p99_s']:.3f} / {r['max_s']:.3f} | {r['prefill_max_call_s'] * 1e3:.1f} ms |")
    for r in rows:
        for e in r["errors"]:
            out.append(f"- {r['variant']} {r['room']}: {e}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=15, help="fresh pairs per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--config", default="{}", help="ManagerConfig fields for both ranks, as JSON")
    ap.add_argument("--json", default="")
    ap.add_argument("--streaming", action="store_true",
                    help="instead: one pair streams rooms while other decode ranks join its prefill rank")
    ap.add_argument("--events", type=int, default=8, help="--streaming: joins of each kind")
    args = ap.parse_args(argv)
    os.environ.setdefault("KVFERRY_FORKSERVER", "1")
    config = json.loads(args.config)
    if args.streaming:
        return _streaming(args, config)
    server = BootstrapProcess()
    pairs = []
    started = time.monotonic()
    try:
        for variant in args.variants.split(","):
            for i in range(args.pairs):
                pairs.append(run_pair(server.address, i, variant, config))
                r = pairs[-1]["rooms"]
                print(f"{variant} pair {i}: " + ", ".join(
                    f"{x['state']} {x['latency_s']:.3f} s (prefill's longest call {x['prefill_max_call_s'] * 1e3:.1f} ms)"
                    for x in r), flush=True)
    finally:
        server.close()
    rows = summarize(pairs)
    print(table(rows))
    print(f"{len(pairs)} pairs in {time.monotonic() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pairs": pairs, "summary": rows}, f, indent=1)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _streaming(args, config: dict) -> int:
    with BootstrapProcess() as server:
        run = run_streaming(server.address, events=args.events, config=config)
    rows = streaming_summary(run)
    print("| D1's rooms while | n | failed | p50 / p99 / max ms | joins (failed) | joiner's first room max ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['while']} | {r['num']} | {r['failed']} | {r['p50_s'] * 1e3:.1f} / {r['p99_s'] * 1e3:.1f} / "
              f"{r['max_s'] * 1e3:.1f} | {r['joins']} ({r['joins_failed']}) | {r['join_first_room_max_s'] * 1e3:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run, "summary": rows}, f, indent=1)
    return 0 if all(r["failed"] == 0 and r["joins_failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
