"""``python -m benchmarks.vllm``: kvferry vs vLLM's own PD connectors, real servers.

One run, the same prompts for every connector (``make bench-vllm``):

- ``single``: one vLLM server, no disaggregation (the reference tokens);
- ``kvferry`` (sequential proxy protocol: prefill ``max_tokens=1``, then decode
  with prefill's ``kv_transfer_params``) and ``kvferry-concurrent`` (the router
  gives both a ``transfer_id`` at once);
- ``nixl``: NixlConnector, ``kv_buffer_device: cpu``, sequential protocol,
  as vLLM configures it; ``nixl-tuned``: the same corrected for one core per
  server: its agents' progress thread sleeps between polls instead of
  spinning and UCX runs one worker thread (``num_threads: 1``, vLLM's
  default 4): :func:`harness.nixl_agents.connector`, as the tests'
  reference pair;
- ``mooncake``: MooncakeConnector, ``mooncake_protocol: tcp``, concurrent
  protocol (``transfer_id``), with ``benchmarks/vllm_site`` on its servers'
  PYTHONPATH (no accelerator);
- ``kvferry-router``: kvferry driven exactly as a router written for
  MooncakeConnector drives it: ``GET /query`` on prefill's bootstrap port
  (HTTP; kvferry's ZMQ bootstrap is the next port) for its engine id, then
  prefill and decode posted at once with Mooncake's params.

- ``CONNECTOR@vllm-router-MODE``: the same servers behind vllm-router
  (the package users deploy, unchanged, ``--vllm-pd-disaggregation
  --kv-connector MODE``), the client's requests sent to the router, which
  runs the PD flow itself: ``kvferry@vllm-router-nixl`` beside
  ``nixl@vllm-router-nixl``, ``kvferry@vllm-router-mooncake`` beside
  ``mooncake@vllm-router-mooncake`` (issue 41: TTFT behind the router,
  beside the in-tree connector it was written for); ``make bench-vllm``
  writes them into the ``bench-vllm-router`` block (``--block``).

``--model mla`` serves a tiny DeepSeek-style MLA model instead of the Llama
(the MLA row of issue 28; its table goes between ``<!-- bench-vllm-mla -->``
markers).

Prefill on core 0, decode on core 1, one server pair at a time. TTFT is
measured by the client from the first byte of the proxy flow to decode's first
streamed token; total time to its last. Mooncake's bootstrap binds 0.0.0.0:
run this inside a loopback-only network namespace (the Makefile does).
Writes JSON (``--out``) and the markdown table into ``--doc`` between the
markers ``<!-- bench-vllm -->`` and ``<!-- /bench-vllm -->``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid

from benchmarks.server_runs import percentile, rewrite_block, run_rounds
from harness.nixl_agents import connector as nixl_connector
from harness.vllm import (VOCAB, ServerSpec, VLLMServer, VllmRouter, _body, build_tiny_mla_model, build_tiny_model,
                          free_port, free_ports, post)

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_site")
KVFERRY = ("kvferry", "kvferry-concurrent", "kvferry-router")
#: behind vllm-router: CONNECTOR@vllm-router-MODE rows, kvferry's beside the in-tree connector of each mode
ROUTED = ("kvferry@vllm-router-nixl", "nixl@vllm-router-nixl", "kvferry@vllm-router-mooncake",
          "mooncake@vllm-router-mooncake")
#: MooncakeConnector's bootstrap port (VLLM_MOONCAKE_BOOTSTRAP_PORT's default), in the bench's own namespace
MOONCAKE_BOOTSTRAP = 8998
#: issue 28: on the Mooncake router's harness, kvferry's TTFT p50 at most this times MooncakeConnector's
ROUTER_TARGET = 1.05
VLLM_OWN = ("nixl", "nixl-tuned", "mooncake")
#: connectors driven by the sequential proxy protocol (the others: concurrent)
SEQUENTIAL = ("kvferry", "nixl", "nixl-tuned")


def stream(url: str, body: dict, t0: float, timeout_s: float = 120.0) -> tuple[list[int], float, float]:
    """POST with ``stream: true``; (tokens, first token time, last token time) after ``t0``."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    tokens, first, last = [], None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        ids = (chunk.get("choices") or [{}])[0].get("token_ids") or []
        if ids:
            now = time.monotonic() - t0
            first = now if first is None else first
            last = now
            tokens.extend(ids)
    conn.close()
    return tokens, first or 0.0, last or 0.0


def kv_configs(name: str, ports: dict) -> tuple[dict, dict, dict, dict]:
    """(prefill config, decode config, prefill env, decode env) of a connector."""
    if name.startswith("kvferry"):
        extra = {"kvferry_bootstrap_addr": f"127.0.0.1:{ports['bootstrap']}", "kvferry_node": "prefill0"}
        base = {"kv_connector": "KvferryConnector", "kv_connector_module_path": "transfer.adapters.vllm"}
        prefill = {**extra, "kvferry_serve_bootstrap": True}
        return ({**base, "kv_role": "kv_producer", "kv_connector_extra_config": prefill},
                {**base, "kv_role": "kv_consumer", "kv_connector_extra_config": extra}, {}, {})
    if name in ("nixl", "nixl-tuned"):  # tuned: corrected for a core per server (see the module's docstring)
        (prefill, prefill_env), (decode, decode_env) = (nixl_connector(ports[k], tuned=name == "nixl-tuned")
                                                        for k in ("nixl_p", "nixl_d"))
        return prefill, decode, prefill_env, decode_env
    if name == "mooncake":
        extra = {"mooncake_protocol": "tcp"}
        env = {"PYTHONPATH": SITE}
        return ({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "prefill0",
                 "kv_connector_extra_config": extra},
                {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": extra},
                env, env)
    raise ValueError(name)


def one_request(name: str, servers: dict, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.monotonic()
    front = servers.get("router", servers.get("single"))
    if front is not None:  # one URL: a single server, or a router that runs the PD flow itself
        tokens, ttft, last = stream(front.url, _body(model, prompt, max_tokens, None), t0)
        return {"tokens": tokens, "ttft_s": ttft, "total_s": last}
    p, d = servers["prefill"], servers["decode"]
    if name in SEQUENTIAL:  # prefill answers with decode's params
        first = post(p.url, _body(model, prompt, 1, {"do_remote_decode": True}))
        params = first["kv_transfer_params"]
    else:  # concurrent: the router's transfer_id, sent to both at once
        tid = str(uuid.uuid4())
        if name == "mooncake":
            params = {"do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "prefill0",
                      "remote_bootstrap_addr": f"http://127.0.0.1:{MOONCAKE_BOOTSTRAP}"}
        elif name == "kvferry-router":  # as for MooncakeConnector: the engine id from prefill's /query
            query = p.spec.kv_config["kv_connector_extra_config"]["kvferry_bootstrap_addr"].rpartition(":")[2]
            with urllib.request.urlopen(f"http://127.0.0.1:{query}/query", timeout=10) as r:
                engine_id = json.loads(r.read())["0"]["engine_id"]
            params = {"do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": engine_id,
                      "remote_bootstrap_addr": f"http://127.0.0.1:{query}"}
        else:
            params = {"do_remote_prefill": True, "transfer_id": tid, "kvferry_node": "prefill0",
                      "kvferry_bootstrap_addr": d.spec.kv_config["kv_connector_extra_config"]["kvferry_bootstrap_addr"]}
        threading.Thread(target=post, args=(p.url, _body(model, prompt, 1, {"do_remote_decode": True,
                                                                             "transfer_id": tid})),
                         daemon=True).start()
    tokens, ttft, last = stream(d.url, _body(model, prompt, max_tokens, params), t0)
    return {"tokens": tokens, "ttft_s": ttft, "total_s": last}


def run_connector(name: str, model: str, prompts: list[list[int]], max_tokens: int, log_dir: str) -> dict:
    ports = {"bootstrap": free_ports(2), "nixl_p": free_port(), "nixl_d": free_port()}
    base, _, via = name.partition("@")
    if name == "single":
        specs = {"single": ServerSpec("single", model, 0)}
    else:
        pc, dc, penv, denv = kv_configs(base, ports)
        tag = name.replace("@", "-")
        specs = {"prefill": ServerSpec(f"{tag}-prefill", model, 0, pc, env=penv),
                 "decode": ServerSpec(f"{tag}-decode", model, 1, dc, env=denv)}
    servers = {}
    try:
        for key, spec in specs.items():
            servers[key] = VLLMServer(spec, log_dir)
        t0 = time.monotonic()
        for server in servers.values():
            server.wait_ready()
        if via:  # vllm-router-MODE: in mooncake mode it asks prefill's bootstrap port GET /query at start-up
            mode = via.removeprefix("vllm-router-")
            port = (MOONCAKE_BOOTSTRAP if base == "mooncake" else ports["bootstrap"]) if mode == "mooncake" else None
            servers["router"] = VllmRouter(mode, servers["prefill"], servers["decode"], log_dir, bootstrap_port=port)
            servers["router"].wait_ready(90)
        ready_s = time.monotonic() - t0
        metric_server = servers.get("decode", servers.get("single"))
        # warm-up, not timed; its tokens are checked against the reference's first two (summarize)
        warm_up = one_request(name, servers, model, prompts[0], 2)["tokens"]
        before = metric_server.metrics()
        results = [one_request(name, servers, model, p, max_tokens) for p in prompts]
        after = metric_server.metrics()
    finally:
        for server in servers.values():
            server.close()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"connector": name, "ready_s": ready_s, "results": results, "warm_up_tokens": warm_up,
            "external_tokens": int(delta.get("external_kv_transfer", 0)),
            "local_tokens": int(delta.get("local_compute", 0))}


def summarize(run: dict, reference: list[list[int]], prompts: list[list[int]]) -> dict:
    ttft = [r["ttft_s"] for r in run["results"]]
    equal = sum(r["tokens"] == ref for r, ref in zip(run["results"], reference))
    warm_up_equal = reference[0] is not None and run["warm_up_tokens"] == reference[0][:2]
    return {"connector": run["connector"], "round": run.get("round", 1), "load_1m": run.get("load_1m", []),
            "requests": len(ttft), "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": percentile(ttft, 0.99), "total_s": sum(r["total_s"] for r in run["results"]),
            "tokens_equal": equal, "warm_up_equal": warm_up_equal, "prompt_tokens": sum(map(len, prompts)),
            "prompt_tokens_received": run["external_tokens"], "prompt_tokens_computed": run["local_tokens"]}


def medians(rows: list[dict]) -> list[dict]:
    """Per connector, in first-run order: the median over its rounds of the
    rounds' TTFT p50 and p99, and whether every round's tokens were equal."""
    out: dict[str, dict] = {}
    for r in rows:
        m = out.setdefault(r["connector"], {"connector": r["connector"], "p50": [], "p99": [], "all_equal": True})
        m["p50"].append(r["ttft_p50_s"])
        m["p99"].append(r["ttft_p99_s"])
        m["all_equal"] &= r["tokens_equal"] == r["requests"] and r["warm_up_equal"]
    return [{"connector": m["connector"], "rounds": len(m["p50"]), "ttft_p50_s": statistics.median(m["p50"]),
             "ttft_p99_s": statistics.median(m["p99"]), "tokens_equal_every_round": m["all_equal"]}
            for m in out.values()]


def router_target(summary: list[dict]) -> dict | None:
    """Issue 28's target: on the Mooncake router's harness, kvferry's TTFT p50
    at most ROUTER_TARGET x MooncakeConnector's (medians over rounds)."""
    ours = next((m for m in summary if m["connector"] == "kvferry-router"), None)
    theirs = next((m for m in summary if m["connector"] == "mooncake"), None)
    if ours is None or theirs is None:
        return None
    ratio = ours["ttft_p50_s"] / theirs["ttft_p50_s"]
    return {"kvferry_router_p50_s": ours["ttft_p50_s"], "mooncake_p50_s": theirs["ttft_p50_s"],
            "ratio": ratio, "met": ratio <= ROUTER_TARGET}


def behind_router(summary: list[dict]) -> list[dict]:
    """Per vllm-router mode: kvferry's TTFT p50 behind it beside the in-tree
    connector's behind the same router (medians over rounds)."""
    by = {m["connector"]: m for m in summary}
    out = []
    for mode in ("nixl", "mooncake"):  # each mode beside the in-tree connector of its name
        a, b = by.get(f"kvferry@vllm-router-{mode}"), by.get(f"{mode}@vllm-router-{mode}")
        if a and b:
            out.append({"mode": mode, "kvferry_p50_s": a["ttft_p50_s"], "theirs": mode,
                        "theirs_p50_s": b["ttft_p50_s"], "ratio": a["ttft_p50_s"] / b["ttft_p50_s"]})
    return out


def target(summary: list[dict]) -> dict | None:
    """Issue 15's target: kvferry's TTFT p50 (its faster protocol) at or below
    the best of vLLM's own connectors (median over rounds); None when either
    side did not run."""
    ours = [m for m in summary if m["connector"] in KVFERRY]
    theirs = [m for m in summary if m["connector"] in VLLM_OWN]
    if not ours or not theirs:
        return None
    a, b = min(ours, key=lambda m: m["ttft_p50_s"]), min(theirs, key=lambda m: m["ttft_p50_s"])
    return {"kvferry": a["connector"], "kvferry_p50_s": a["ttft_p50_s"], "best_vllm": b["connector"],
            "best_vllm_p50_s": b["ttft_p50_s"], "met": a["ttft_p50_s"] <= b["ttft_p50_s"]}


def table(rows: list[dict]) -> str:
    head = ("| connector | round | load (1 min) | requests | TTFT p50 (s) | TTFT p99 (s) | total (s) | tokens equal | "
            "warm-up equal | prompt tokens received / computed on decode |\n|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['connector']} | {r.get('round', 1)} | {'-'.join(f'{x:.1f}' for x in r.get('load_1m', []))} "
        f"| {r['requests']} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['total_s']:.2f} "
        f"| {r['tokens_equal']}/{r['requests']} | {'yes' if r['warm_up_equal'] else 'NO'} | {r['prompt_tokens_received']} / {r['prompt_tokens_computed']} "
        f"of {r['prompt_tokens']} |\n" for r in rows)


def summary_table(summary: list[dict], verdict: dict | None, router: dict | None = None,
                  routed: list[dict] = ()) -> str:
    text = ("| connector | rounds | TTFT p50 (s), median of rounds | TTFT p99 (s), median of rounds "
            "| tokens equal every round |\n|---|---|---|---|---|\n")
    text += "".join(f"| {m['connector']} | {m['rounds']} | {m['ttft_p50_s']:.3f} | {m['ttft_p99_s']:.3f} "
                    f"| {'yes' if m['tokens_equal_every_round'] else 'NO'} |\n" for m in summary)
    if verdict:
        text += (f"\nTarget (kvferry's TTFT p50 at or below the best of vLLM's own connectors): "
                 f"{verdict['kvferry']} {verdict['kvferry_p50_s']:.3f} s against {verdict['best_vllm']} "
                 f"{verdict['best_vllm_p50_s']:.3f} s: {'met' if verdict['met'] else 'NOT MET'}.\n")
    if router:
        text += (f"\nTarget (a Mooncake router against kvferry: TTFT p50 at most {ROUTER_TARGET}x "
                 f"MooncakeConnector's): {router['kvferry_router_p50_s']:.3f} s against "
                 f"{router['mooncake_p50_s']:.3f} s, {router['ratio']:.2f}x: {'met' if router['met'] else 'NOT MET'}.\n")
    for r in routed:
        text += (f"\nBehind vllm-router `--kv-connector {r['mode']}`: kvferry's TTFT p50 {r['kvferry_p50_s']:.3f} s, "
                 f"the in-tree {r['theirs']} connector's {r['theirs_p50_s']:.3f} s ({r['ratio']:.2f}x).\n")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm")
    ap.add_argument("--connectors", default=",".join(("single", *KVFERRY, *VLLM_OWN)),
                    help=f"comma-separated; behind vllm-router: {','.join(ROUTED)}")
    ap.add_argument("--rounds", type=int, default=1, help="run the connector list this many times, in turn")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-vllm.json")
    ap.add_argument("--doc", default="")
    ap.add_argument("--model", choices=("llama", "mla"), default="llama")
    ap.add_argument("--block", default="", help="the --doc block to rewrite, between <!-- BLOCK --> and "
                    "<!-- /BLOCK --> (default bench-vllm, or bench-vllm-mla with --model mla)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randrange(100, 1001))] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-") as tmp:
        build = build_tiny_mla_model if args.model == "mla" else build_tiny_model
        model = build(os.path.join(tmp, "model"))
        runs = run_rounds("bench-vllm", "connector", args.connectors.split(","), args.rounds,
                          lambda name: run_connector(name, model, prompts, args.max_tokens, tmp))
    ref = next((r for r in runs if r["connector"] == "single" and "error" not in r), None)
    reference = [r["tokens"] for r in ref["results"]] if ref else [None] * len(prompts)
    rows = [summarize(r, reference, prompts) for r in runs if "error" not in r]
    summary = medians(rows)
    verdict, router, routed = target(summary), router_target(summary), behind_router(summary)
    with open(args.out, "w") as f:
        json.dump({"prompts": [len(p) for p in prompts], "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "cores": os.cpu_count(), "model": args.model, "summary": summary, "target": verdict,
                   "router_target": router, "behind_router": routed, "rows": rows,
                   "errors": [{"connector": r["connector"], "round": r["round"], "error": r["error"]}
                              for r in runs if "error" in r], "runs": runs}, f, indent=1)
    text = table(rows) + "\n" + summary_table(summary, verdict, router, routed)
    print(text)
    if args.doc:
        rewrite_block(args.doc, args.block or ("bench-vllm" if args.model == "llama" else "bench-vllm-mla"), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
