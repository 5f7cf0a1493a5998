"""``python -m benchmarks.hicache_server`` (``make bench-hicache-server``, the servers' environment):
a repeated 8k-token prompt on a real SGLang server, served from kvferry's HiCache L3 store against computed.

Two ``sglang.launch_server`` processes on this CPU, the tiny random Llama of
the servers' suite (its context widened to 16k positions): ``recompute``,
without HiCache, and ``hicache``, with ``--enable-hierarchical-cache`` on
kvferry's backend over a file store (the stand-ins of
``tests/engines/sglang_server/hicache_site``; see docs/sglang.md). Both
with 16-token pages and chunks of 2048 tokens. The prompt has 8193 tokens:
512 full pages (8192 tokens) an L3 hit can cover, and the one token whose
logits every server computes, so a store hit and a computed prompt end in the
same one-token forward pass over the same KV (this random model's greedy
tokens change with how a prompt is cut into passes).

Each round, a new prompt (no prefix shared with another):

- ``recompute``: computed by the server without HiCache;
- ``computed``: by the HiCache server, its store cold for this prompt (it
  writes the pages through while it serves); then the run waits until the
  store holds all 512 pages;
- ``device hit``: the same prompt again, its KV still in the device pool
  (SGLang's radix cache): the floor, one forward pass and the request's path;
- ``from L3``: after ``/flush_cache`` (device and host pools emptied; the store
  keeps its pages): SGLang's prefetch loads the 512 pages from kvferry's
  store into the host pool, then the device pool, and computes one token.
  The reply's ``cached_tokens_details.storage`` and the server's
  ``sglang:cached_tokens_total{cache_source="storage"}`` must both count 8192.

After the rounds the HiCache server is restarted on the same store and serves
the first round's prompt once more (``from L3, restarted``). TTFT is the
client's, from sending the request to the first streamed chunk with a token;
every reply's tokens must equal the ``recompute`` server's (the run fails
otherwise). A short warm-up request after each start is not timed.

These are CPU figures of a tiny model on a small machine: the prompt's compute
is cheap here and the device pool is host memory, so they say what the L3
path costs in SGLang and kvferry (query, read, copies, scheduling) against
this compute, not what a GPU deployment gains. Writes JSON (``--json``) and a
markdown block into ``--doc`` between ``<!-- bench-hicache-server -->`` and
``<!-- /bench-hicache-server -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.server_runs import rewrite_block
from harness.sglang_server import (HICACHE_SITE, HiCacheStoreProbe, SGLangServer, SGLangSpec, flush_cache,
                                   generate_stream, hicache_storage_args, metric, storage_tokens)
from harness.vllm import VOCAB, build_tiny_model

DOC_BLOCK = "bench-hicache-server"
STORAGE_TOKENS = "sglang:cached_tokens_total"
ROWS = ("recompute", "computed", "device hit", "from L3")
KV_BYTES_PER_TOKEN = 4 * 2 * 4 * 32 * 2  # the tiny Llama: 4 layers, K and V, 4 KV heads of 32, bf16


@dataclass(frozen=True, kw_only=True)
class HiCacheServerBenchConfig:
    prompt_tokens: int = 8193
    rounds: int = 5
    max_new_tokens: int = 8
    page_tokens: int = 16
    chunk_tokens: int = 2048
    context_tokens: int = 16384  # the model's positions, widened
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 2 or self.rounds < 1 or self.max_new_tokens < 1:
            raise ValueError("prompt_tokens >= 2, rounds >= 1 and max_new_tokens >= 1")
        if self.chunk_tokens % self.page_tokens:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be whole pages of {self.page_tokens}")
        if self.prompt_tokens + self.max_new_tokens > self.context_tokens:
            raise ValueError(f"a prompt of {self.prompt_tokens} tokens does not fit {self.context_tokens} positions")

    @property
    def hit_pages(self) -> int:
        """The full pages of a prompt an L3 hit covers (never the last token)."""
        return (self.prompt_tokens - 1) // self.page_tokens


def widen_context(model: str, positions: int) -> str:
    """The tiny Llama with ``positions`` positions (its rotary embedding has no limit of its own)."""
    path = Path(model) / "config.json"
    config = json.loads(path.read_text())
    config["max_position_embeddings"] = positions
    path.write_text(json.dumps(config, indent=1))
    return model


def server_args(config: HiCacheServerBenchConfig) -> tuple:
    return ("--page-size", str(config.page_tokens), "--chunked-prefill-size", str(config.chunk_tokens),
            "--max-total-tokens", str(2 * (config.prompt_tokens + config.max_new_tokens)), "--sleep-on-idle")


def hicache_server(name: str, model: str, store_url: str, log_dir: str,
                   config: HiCacheServerBenchConfig) -> SGLangServer:
    return SGLangServer(SGLangSpec(name, model, env={"PYTHONPATH": HICACHE_SITE},
                                   args=server_args(config) + hicache_storage_args(store_url)), log_dir)


def prompts(config: HiCacheServerBenchConfig) -> tuple[list[list[int]], list[int]]:
    """One prompt per round and a short warm-up prompt, each starting with a token no other starts with."""
    rng = random.Random(config.seed)
    firsts = rng.sample(range(4, VOCAB), config.rounds + 1)
    rounds = [[f] + [rng.randrange(4, VOCAB) for _ in range(config.prompt_tokens - 1)] for f in firsts[:-1]]
    return rounds, [firsts[-1]] + [rng.randrange(4, VOCAB) for _ in range(31)]


def timed(server: SGLangServer, prompt: list[int], config: HiCacheServerBenchConfig) -> dict:
    reply = generate_stream(server, prompt, config.max_new_tokens, timeout_s=600)
    return {"ttft_s": reply["ttft_s"], "total_s": reply["total_s"], "tokens": reply["tokens"],
            "storage_tokens": storage_tokens(reply)}


def served_from_l3(server: SGLangServer, prompt: list[int], config: HiCacheServerBenchConfig) -> dict:
    """One request whose prefix must come from the store: the reply's and the server's counts checked."""
    before = metric(server, STORAGE_TOKENS, cache_source="storage")
    run = timed(server, prompt, config)
    run["metric_storage_tokens"] = metric(server, STORAGE_TOKENS, cache_source="storage") - before
    want = config.hit_pages * config.page_tokens
    if run["storage_tokens"] != want or run["metric_storage_tokens"] != want:
        raise RuntimeError(f"{server.spec.name}: not served from the store: the reply counts "
                           f"{run['storage_tokens']} tokens, the server {run['metric_storage_tokens']:g}, want {want}")
    return run


def close_all(servers: list[SGLangServer]) -> None:
    threads = [threading.Thread(target=s.close) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def run(config: HiCacheServerBenchConfig, tmp: str) -> dict:
    model = widen_context(build_tiny_model(os.path.join(tmp, "model")), config.context_tokens)
    store_url = f"file://{os.path.join(tmp, 'store')}"
    round_prompts, warm_up = prompts(config)
    recompute = SGLangServer(SGLangSpec("recompute", model, args=server_args(config)), tmp)
    servers = [recompute]
    probe = None
    try:
        hicache = hicache_server("hicache", model, store_url, tmp, config)
        servers.append(hicache)
        for server in servers:
            server.wait_ready(300)
        want_warm_up = timed(recompute, warm_up, config)["tokens"]
        if timed(hicache, warm_up, config)["tokens"] != want_warm_up:
            raise RuntimeError("the warm-up's tokens differ between the servers")
        probe = HiCacheStoreProbe(store_url, model, config.page_tokens)
        rounds = []
        for rnd, prompt in enumerate(round_prompts, 1):
            print(f"bench-hicache-server: round {rnd} ...", flush=True)
            load = os.getloadavg()[0]
            row = {"round": rnd, "recompute": timed(recompute, prompt, config)}
            row["computed"] = timed(hicache, prompt, config)
            if row["computed"]["storage_tokens"]:
                raise RuntimeError(f"round {rnd}: the store was not cold: {row['computed']['storage_tokens']} tokens")
            probe.wait_for(prompt, len(prompt) // config.page_tokens)  # every full page written through
            row["device hit"] = timed(hicache, prompt, config)
            flush_cache(hicache)
            row["from L3"] = served_from_l3(hicache, prompt, config)
            row["load_1m"] = [round(load, 1), round(os.getloadavg()[0], 1)]
            rounds.append(row)
        servers.remove(hicache)
        hicache.close()
        restarted = hicache_server("hicache-restarted", model, store_url, tmp, config)
        servers.append(restarted)
        restarted.wait_ready(300)
        if timed(restarted, warm_up, config)["tokens"] != want_warm_up:
            raise RuntimeError("the restarted server's warm-up tokens differ")
        after_restart = served_from_l3(restarted, round_prompts[0], config)
    finally:
        if probe is not None:
            probe.close()
        close_all(servers)
    check_tokens(rounds, after_restart)
    return {"config": asdict(config), "rounds": rounds, "after_restart": after_restart}


def check_tokens(rounds: list[dict], after_restart: dict) -> None:
    for row in rounds:
        want = row["recompute"]["tokens"]
        for name in ROWS[1:]:
            if row[name]["tokens"] != want:
                raise RuntimeError(f"round {row['round']}: {name}'s tokens {row[name]['tokens']} != {want}")
    if after_restart["tokens"] != rounds[0]["recompute"]["tokens"]:
        raise RuntimeError(f"after the restart: tokens {after_restart['tokens']} != {rounds[0]['recompute']['tokens']}")


def doc_text(result: dict) -> str:
    config, rounds, restart = HiCacheServerBenchConfig(**result["config"]), result["rounds"], result["after_restart"]
    lines = [f"Measured {time.strftime('%Y-%m-%d')}, `make bench-hicache-server` (CPU figures: the tiny random Llama, "
             f"4 layers, 2 KiB of KV a token, on this 2-core VM): a prompt of {config.prompt_tokens} tokens "
             f"({config.hit_pages} pages of {config.page_tokens} tokens, {config.hit_pages * config.page_tokens} "
             f"tokens an L3 hit covers: {config.hit_pages * config.page_tokens * KV_BYTES_PER_TOKEN / 2**20:g} MiB of KV), chunks of "
             f"{config.chunk_tokens}, {config.max_new_tokens} tokens out, a new prompt each round; TTFT in seconds, "
             "the client's (streamed).", "",
             "| round | load (1 min) | recompute (HiCache off) | computed (HiCache on, store cold) | device hit "
             "| from L3 (after `/flush_cache`) | L3 - device hit | L3 tokens (reply / metric) | tokens equal |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for row in rounds:
        l3 = row["from L3"]
        lines.append(f"| {row['round']} | {'-'.join(f'{x:.1f}' for x in row['load_1m'])} | "
                     + " | ".join(f"{row[name]['ttft_s']:.3f}" for name in ROWS)
                     + f" | {l3['ttft_s'] - row['device hit']['ttft_s']:+.3f}"
                     + f" | {l3['storage_tokens']} / {l3['metric_storage_tokens']:g} | yes |")
    median = {name: statistics.median(row[name]["ttft_s"] for row in rounds) for name in ROWS}
    extra = statistics.median(row["from L3"]["ttft_s"] - row["device hit"]["ttft_s"] for row in rounds)
    lines.append("| median | | " + " | ".join(f"{median[name]:.3f}" for name in ROWS) + f" | {extra:+.3f} | | |")
    lines += ["", f"- From L3 after a restart (a new server on the same store, round 1's prompt): TTFT "
              f"{restart['ttft_s']:.3f} s, {restart['storage_tokens']} tokens from the store (reply and metric).",
              f"- From L3 against recompute: {median['from L3'] / median['recompute']:.2f}x the TTFT "
              f"({median['from L3']:.3f} s against {median['recompute']:.3f} s); the L3 path over a device hit "
              f"(median of the rounds' differences): {extra:+.3f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.hicache_server", description=__doc__.split("\n\n")[0])
    defaults = HiCacheServerBenchConfig()
    ap.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    ap.add_argument("--rounds", type=int, default=defaults.rounds)
    ap.add_argument("--max-new", type=int, default=defaults.max_new_tokens)
    ap.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens)
    ap.add_argument("--json", default="")
    ap.add_argument("--doc", default="", help="a markdown file whose bench-hicache-server block gets the table")
    args = ap.parse_args(argv)
    config = HiCacheServerBenchConfig(prompt_tokens=args.prompt_tokens, rounds=args.rounds,
                                      max_new_tokens=args.max_new, chunk_tokens=args.chunk_tokens)
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-hicache-server-") as tmp:
        result = run(config, tmp)
    text = doc_text(result)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.doc:
        rewrite_block(args.doc, DOC_BLOCK, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
