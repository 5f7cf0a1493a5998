"""``make demo``: one prefill and one decode process on this host, over TCP loopback.

Starts a bootstrap server, a prefill rank and a decode rank as separate
processes; moves 64 requests of a Llama-8B-like KV layout (32 layers, 8 KV
heads, head dim 128, bf16, page size 16, prompts of 1k-8k tokens, random page
indices, random data) through the real Mooncake engine; the decode rank checks
every byte. Prints a summary and exits non-zero on any failure or mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from harness.launch import run_pd
from harness.workload import PoolSpec, Spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args(argv)

    llama = PoolSpec(role="target", attention="mha", num_layers=args.layers, total_heads=8, head_dim=128,
                     dtype="bfloat16")
    page_size = 16
    max_pages = -(-args.max_tokens // page_size)
    spec = Spec(bootstrap="", prefill_pools=(llama,), decode_pools=(llama,), page_size=page_size,
                prefill_pages=2 * max_pages, decode_pages=args.concurrency * max_pages + 8,
                aux_slots=128, num_rooms=args.requests, concurrency=args.concurrency,
                min_tokens=args.min_tokens, max_tokens=args.max_tokens, page_placement="scattered",
                protocol=args.protocol, seed=args.seed, timeout_s=300)
    kv_per_token = 2 * args.layers * 8 * 128 * 2
    print(f"kvferry demo: {args.requests} requests of {args.min_tokens}-{args.max_tokens} tokens, "
          f"Llama-8B-like KV ({args.layers} layers x K/V x 8 heads x 128 x bf16 = "
          f"{kv_per_token // 1024} KiB/token), random pages, {args.protocol.upper()} loopback", flush=True)
    t0 = time.monotonic()
    runs = run_pd(spec, timeout_s=900)
    wall = time.monotonic() - t0

    ok = True
    for run in runs:
        r = run.result
        if r is None or run.returncode != 0 or r["failed"] or r["mismatches"] or r["success"] != args.requests:
            ok = False
            print(f"FAILED: {run.role} rank {run.tp_rank} (exit {run.returncode})", file=sys.stderr)
            if r is not None:
                for room, why in r["failed"][:5]:
                    print(f"  room {room}: {why}", file=sys.stderr)
                for m in r["mismatches"][:5]:
                    print(f"  mismatch: {m}", file=sys.stderr)
            else:
                print(run.log[-3000:], file=sys.stderr)
    if not ok:
        return 1
    prefill = next(r.result for r in runs if r.role == "prefill")
    decode = next(r.result for r in runs if r.role == "decode")
    lat = np.asarray(decode["latencies_ms"])
    gib = decode["bytes"] / 2**30
    print(f"requests          {decode['success']} of {args.requests} succeeded, every byte verified on decode")
    print(f"KV moved          {gib:.2f} GiB ({decode['bytes']:,} bytes) + {args.requests} aux rows")
    print(f"throughput        {decode['bytes'] / decode['elapsed_s'] / 1e9:.2f} GB/s over the decode run "
          f"({decode['elapsed_s']:.1f} s, {args.concurrency} requests in flight)")
    print(f"request time      p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms "
          "(receiver created -> Success)")
    print(f"descriptors       {prefill['descriptors'] / args.requests:.0f} per request "
          "(scattered pages are gathered into a staging buffer and sent in large parts)")
    print(f"wall time         {wall:.1f} s including start-up and pool set-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
