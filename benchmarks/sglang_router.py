"""``python -m benchmarks.sglang_router``: real SGLang servers behind sglang-router, kvferry beside SGLang's Mooncake.

The same prompts, in one run (``make bench-sglang``, the servers' environment):

- ``single``: one ``sglang.launch_server``, no disaggregation (the reference
  tokens, and the floor a transfer adds to);
- ``kvferry@sglang-router``: a prefill + decode pair with
  ``--disaggregation-transfer-backend kvferry`` behind sglang-router (the
  package users deploy, unchanged, ``--pd-disaggregation``);
- ``mooncake@sglang-router``: the same with SGLang's own ``mooncake``
  backend, with ``benchmarks/sglang_site`` on its servers' PYTHONPATH (it
  corrects the one thing this CPU-only machine does to that backend: see
  there).

No prompt starts with another's first token: SGLang 0.5.23's prefill, on a
hit in its radix cache under overlap scheduling (its defaults), records a
``torch.cuda.Event`` for its early send of the cached prefix, which kills
its scheduler on a machine without CUDA, whatever the transfer backend
(``prefill.py``, ``maybe_send_cached_prefix_chunk``).

The client streams ``/generate`` through the router; TTFT is from the
request's first byte to the first streamed chunk that carries a token,
total to the last. Each pair's first request (two tokens) is not timed,
and its tokens are checked like the others'. One pair at a time; the
servers, the router and the client share the machine's cores. Mooncake's
bootstrap binds 0.0.0.0:
run this inside a loopback-only network namespace (the Makefile does).
Writes JSON (``--out``) and the markdown table into ``--doc`` between
``<!-- bench-sglang-router -->`` and ``<!-- /bench-sglang-router -->``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import tempfile
import time

from benchmarks.server_runs import percentile, rewrite_block, run_rounds
from harness.sglang_server import SGLangRouter, SGLangServer, SGLangSpec
from harness.vllm import VOCAB, build_tiny_model, free_port

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_site")
ROWS = ("single", "kvferry@sglang-router", "mooncake@sglang-router")
BLOCK = "bench-sglang-router"  # the --doc block it rewrites


def stream(url: str, prompt: list[int], max_new: int, timeout_s: float = 180.0) -> dict:
    """``/generate`` with ``stream: true``, greedy: the tokens (SGLang's
    chunks carry every token so far), first token and last token times."""
    host, port = url.removeprefix("http://").split(":")
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    tokens, first, last, seen = [], None, None, []
    for raw in resp:
        line = raw.decode().strip()
        seen.append(line[:3000])
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ids = json.loads(line[5:]).get("output_ids") or []
        if ids:
            now = time.monotonic() - t0
            first = now if first is None else first
            last = now
            tokens = list(ids)
    conn.close()
    if first is None:
        raise RuntimeError(f"{url}: the stream ended without a token: {seen[:6]}")
    return {"tokens": tokens, "ttft_s": first, "total_s": last}


def run_row(name: str, model: str, prompts: list[list[int]], warm_up_prompt: list[int], max_new: int,
            log_dir: str) -> dict:
    backend = name.partition("@")[0]
    if name == "single":
        specs = [SGLangSpec("single", model)]
    else:
        env = {"PYTHONPATH": SITE, "SGLANG_HOST_IP": "127.0.0.1"} if backend == "mooncake" else {}
        if backend == "kvferry":  # kvferry's own bootstrap beside SGLang's HTTP one: a free port
            env = {"KVFERRY_SGLANG_BOOTSTRAP_PORT": str(free_port())}
        specs = [SGLangSpec(f"{backend}-prefill", model, "prefill", backend=backend, bootstrap_port=free_port(),
                            env=env),
                 SGLangSpec(f"{backend}-decode", model, "decode", backend=backend,
                            env={k: v for k, v in env.items() if k != "KVFERRY_SGLANG_BOOTSTRAP_PORT"})]
    servers: list = []
    try:
        for spec in specs:
            servers.append(SGLangServer(spec, log_dir))
        t0 = time.monotonic()
        for server in servers:
            server.wait_ready()
        front = servers[0]
        if name != "single":
            front = SGLangRouter(servers[0], servers[1], log_dir)
            servers.append(front)
            front.wait_ready(90)
        ready_s = time.monotonic() - t0
        warm_up = stream(front.url, warm_up_prompt, 2)["tokens"]  # not timed; checked in summarize
        results = [stream(front.url, p, max_new) for p in prompts]
    finally:
        for server in reversed(servers):
            server.close()
    return {"row": name, "ready_s": ready_s, "warm_up_tokens": warm_up, "results": results}


def _warm_up_equal(run: dict, reference: dict | None) -> bool:
    return reference is not None and run["warm_up_tokens"] == reference["warm_up_tokens"][:2]


def summarize(run: dict, reference: dict | None) -> dict:
    """``reference``: the single server's run."""
    ttft = [r["ttft_s"] for r in run["results"]]
    want = [r["tokens"] for r in reference["results"]] if reference else []
    equal = sum(r["tokens"] == ref for r, ref in zip(run["results"], want))
    return {"row": run["row"], "round": run["round"], "load_1m": run["load_1m"], "requests": len(ttft),
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": percentile(ttft, 0.99),
            "total_s": sum(r["total_s"] for r in run["results"]), "tokens_equal": equal,
            "warm_up_equal": _warm_up_equal(run, reference)}


def table(rows: list[dict]) -> str:
    head = ("| row | round | load (1 min) | requests | TTFT p50 (s) | TTFT p99 (s) | total (s) | tokens equal "
            "| warm-up equal |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['row']} | {r['round']} | {'-'.join(f'{x:.1f}' for x in r['load_1m'])} | {r['requests']} "
        f"| {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['total_s']:.2f} | {_equal(r)} |\n" for r in rows)


def _equal(row: dict) -> str:
    if row["row"] == "single":  # the first single run is the reference (a later one is compared with it)
        return f"{row['tokens_equal']}/{row['requests']} (reference: round 1) | -" if row["round"] == 1 else \
            f"{row['tokens_equal']}/{row['requests']} | {'yes' if row['warm_up_equal'] else 'NO'}"
    return f"{row['tokens_equal']}/{row['requests']} | {'yes' if row['warm_up_equal'] else 'NO'}"


def verdict(rows: list[dict]) -> str:
    p50 = {name: statistics.median(r["ttft_p50_s"] for r in rows if r["row"] == name)
           for name in ROWS if any(r["row"] == name for r in rows)}
    ours, theirs = p50.get("kvferry@sglang-router"), p50.get("mooncake@sglang-router")
    if ours is None or theirs is None:
        return "\nOne of the two pairs did not run (see the errors in the JSON).\n"
    return (f"\nBehind sglang-router, TTFT p50 (median of rounds): kvferry {ours:.3f} s, SGLang's mooncake backend "
            f"{theirs:.3f} s ({ours / theirs:.2f}x); a single server {p50.get('single', float('nan')):.3f} s.\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sglang_router")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=2, help="run the row list this many times, in turn")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-sglang-router.json")
    ap.add_argument("--doc", default="")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    # each prompt (and the warm-up's, the last) starts with a token no other starts with: no prompt hits
    # another's prefix in prefill's radix cache (see the module's docstring)
    firsts = rng.sample(range(4, VOCAB), args.requests + 1)
    prompts = [[first] + [rng.randrange(4, VOCAB) for _ in range(rng.randrange(99, 1000))] for first in firsts]
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-sglang-router-") as tmp:
        model = build_tiny_model(os.path.join(tmp, "model"))
        runs = run_rounds("bench-sglang-router", "row", args.rows.split(","), args.rounds,
                          lambda name: run_row(name, model, prompts[:-1], prompts[-1], args.max_new, tmp))
    ref = next((r for r in runs if r["row"] == "single" and "error" not in r), None)
    rows = [summarize(r, ref) for r in runs if "error" not in r]
    text = table(rows) + verdict(rows)
    with open(args.out, "w") as f:
        json.dump({"prompts": [len(p) for p in prompts], "max_new": args.max_new, "rows": rows,
                   "errors": [{"row": r["row"], "round": r["round"], "error": r["error"]} for r in runs if "error" in r],
                   "runs": runs}, f, indent=1)
    print(text)
    if args.doc:
        rewrite_block(args.doc, BLOCK, text)
    ok = all(r["tokens_equal"] == r["requests"] and r["warm_up_equal"] for r in rows)
    return 0 if rows and ok and not any("error" in r for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
