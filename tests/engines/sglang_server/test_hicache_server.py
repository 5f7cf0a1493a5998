"""kvferry's store as SGLang's HiCache L3 backend in real servers (``make test-sglang-server``).

``python -m sglang.launch_server --enable-hierarchical-cache
--hicache-storage-backend dynamic`` with ``transfer.adapters.sglang.hicache``
over a kvferry file store, the tiny random Llama on this CPU, every token
compared with a single server's without HiCache (same page and chunk size):

- a server serves prompts and writes their pages through kvferry's backend; a
  restarted server (empty device and host pools) serves them again with the
  prefix loaded from the store, counted by SGLang itself;
- one store for PD: prefill and decode (``--disaggregation-decode-enable-radix-cache``)
  each with HiCache on the same store and kvferry as the transfer backend.
  Decode finds a prompt's prefix in the store, loads it, and tells prefill
  (``decode_prefix_len``), which sends only the rest;
- prefill killed (``kill -9``) mid-transfer, after its HiCache wrote the first
  chunks of a long prompt: SGLang's decode fails the request (500) and serves
  on; the request sent again through another prefill (on the same store) has
  decode load the pages the dead prefill wrote.
- kvferry's storage tier on a store as well (``KVFERRY_STORAGE_URL``):
  prefill writes each room's pages and aux row through, and a decode room
  whose prefill is killed mid-transfer, or before it sent anything, is
  restored from the store and answers, tokens equal.

The servers load test stand-ins (``hicache_site/sitecustomize.py``: host
pools unpinned, the device <-> host copies as torch index copies); SGLang's
HiCache needs CUDA for both; a third lowers the host memory SGLang keeps free
from 10 GiB to 1 GiB (this machine has 24). kvferry's code runs as it is.

Every server that prefills computes a prompt in chunks of one page
(``--chunked-prefill-size 16``), the reference included: this random model's
greedy tokens change with how a prompt is cut into forward passes (seen: a
2000-token prompt in chunks of 64 against one pass, on a single server), and
a prefix loaded from the store cuts a prompt at a page. With one-page chunks
every server computes each page in the same pass shape as the reference.
``--sleep-on-idle``: an idle SGLang scheduler otherwise polls at about a
third of a core, and this module runs five servers on two cores: all are
started at once (``fleet``), so the restarted server's start-up overlaps the
PD servers'.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import urllib.error
from dataclasses import dataclass

import pytest

pytest.importorskip("sglang")

from harness.sglang_server import (HICACHE_SITE, HiCacheStoreProbe, SGLangServer, SGLangSpec,  # noqa: E402
                                   decode_transfer_queue, flush_cache, generate, hicache_storage_args, metric, pd_generate,
                                   pd_generate_replies, storage_tokens, used_tokens)
from harness.vllm import VOCAB, build_tiny_model, free_port  # noqa: E402

MAX_NEW = 8
PAGE = 16  # tokens per page; SGLang's L3 holds full pages only
PAGE_BYTES = PAGE * 4 * 2 * 4 * 32 * 2  # the tiny Llama: 4 layers, K and V, 4 KV heads x 32, bf16
STORAGE_TOKENS = "sglang:cached_tokens_total"
SENT_MB = "sglang:kv_transfer_total_mb_sum"  # prefill: each room's bytes as kvferry's sender counts them


@dataclass(frozen=True)
class Role:
    """A server's PD mode ("" alone) and the arguments it adds to HiCache's."""

    mode: str = ""
    args: tuple = ()


#: what every server of this module runs with (see the module's docstring)
COMMON_ARGS = ("--page-size", str(PAGE), "--chunked-prefill-size", str(PAGE), "--sleep-on-idle")
SINGLE = Role()
# Prefill as in test_pd: no overlap scheduling (its early send of a cached prefix records a CUDA event)
PREFILL = Role("prefill", ("--disable-overlap-schedule",))
DECODE = Role("decode", ("--disaggregation-decode-enable-radix-cache",))
# SGLang loads a prefix from L3 only from 256 tokens on (its prefetch threshold); the kill comes once the store
# holds this many pages of the killed prompt, which has 75
KILL_AT_PAGES = 24
KILLED_PROMPT_TOKENS = 1200
# Killed mid-transfer with the tier on: a prompt of 150 pages, prefill killed once it holds 10 of them
MID_TRANSFER_TOKENS = 2400
KILL_AFTER_TOKENS = 10 * PAGE


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def hicache_args(store_url: str) -> tuple:
    """This module's server flags with HiCache on kvferry's store at ``store_url``."""
    return (*COMMON_ARGS, *hicache_storage_args(store_url))


def module_server(name: str, model: str, log_dir: str, role: Role = SINGLE, args: tuple = COMMON_ARGS,
                  env: dict | None = None) -> SGLangServer:
    """A server of this module with ``args`` and the role's own (started, not waited for)."""
    env = dict(env or {})
    bootstrap = 0
    if role.mode == "prefill":  # kvferry's own bootstrap port beside SGLang's
        bootstrap = free_port()
        env["KVFERRY_SGLANG_BOOTSTRAP_PORT"] = str(free_port())
    return SGLangServer(SGLangSpec(name, model, role.mode, bootstrap_port=bootstrap, env=env, args=args + role.args),
                        log_dir)


def hicache_server(name: str, model: str, store_url: str, log_dir: str, role: Role = SINGLE,
                   env: dict | None = None) -> SGLangServer:
    """A server with HiCache on kvferry's store and the stand-ins loaded (started, not waited for)."""
    return module_server(name, model, log_dir, role, hicache_args(store_url),
                         {"PYTHONPATH": HICACHE_SITE, **(env or {})})


def full_pages(prompt: list[int]) -> int:
    """The pages of ``prompt`` a store hit can cover: full ones, and never the
    last token (whose logits the server computes)."""
    return (len(prompt) - 1) // PAGE


class StoreProbe(HiCacheStoreProbe):
    """The servers' store as this module's pages cut it."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(url, model, PAGE)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("sglang-hicache") / "model"))


@dataclass
class Fleet:
    """The module's servers, started side by side, each waited for by the
    test that first uses it. ``single`` has HiCache alone on its own store;
    ``prefill``, ``spare_prefill`` and ``decode`` share ``pd_store``."""

    root: str
    single_url: str
    pd_url: str
    reference: SGLangServer  # no HiCache: the tokens every test compares with
    single: SGLangServer
    prefill: SGLangServer
    spare_prefill: SGLangServer  # where a request goes once ``prefill`` is dead
    decode: SGLangServer
    pd_store: StoreProbe


def close_all(servers: list[SGLangServer]) -> None:
    """Closes them side by side (each drains for a few seconds on SIGTERM)."""
    threads = [threading.Thread(target=server.close) for server in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@pytest.fixture(scope="module")
def fleet(model, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sglang-hicache-servers"))
    single_url, pd_url = (f"file://{os.path.join(root, name)}" for name in ("single-store", "pd-store"))
    started: list[SGLangServer] = []
    try:
        for start in (lambda: module_server("reference", model, root),
                      lambda: hicache_server("hicache-first", model, single_url, root),
                      lambda: hicache_server("prefill", model, pd_url, root, PREFILL),
                      lambda: hicache_server("decode", model, pd_url, root, DECODE),
                      lambda: hicache_server("prefill-spare", model, pd_url, root, PREFILL)):
            started.append(start())
        reference, single, prefill, decode, spare = started
        pd_store = StoreProbe(pd_url, model)
        try:
            yield Fleet(root=root, single_url=single_url, pd_url=pd_url, reference=reference, single=single,
                        prefill=prefill, spare_prefill=spare, decode=decode, pd_store=pd_store)
        finally:
            pd_store.close()
    finally:
        close_all(started)


def test_a_restarted_server_serves_prompts_from_kvferrys_store(fleet, model):
    reference, first = fleet.reference, fleet.single
    probe = StoreProbe(fleet.single_url, model)
    prompts = [prompt_of(300, 1), prompt_of(700, 2)]  # over SGLang's prefetch threshold (256 tokens)
    try:
        reference.wait_ready()
        wants = [generate(reference, p, MAX_NEW)["output_ids"] for p in prompts]
        first.wait_ready()
        for prompt, want in zip(prompts, wants):
            got = generate(first, prompt, MAX_NEW)
            assert got["output_ids"] == want, (len(prompt), got["output_ids"], want)
            assert storage_tokens(got) == 0, got["meta_info"]
        for prompt in prompts:
            probe.wait_for(prompt, len(prompt) // PAGE)
        first.close()
        with hicache_server("hicache-restarted", model, fleet.single_url, fleet.root) as second:
            second.wait_ready()
            for prompt, want in zip(prompts, wants):
                got = generate(second, prompt, MAX_NEW)
                assert got["output_ids"] == want, (len(prompt), got["output_ids"], want)
                # the prefix came from kvferry's store, not computed: SGLang's own count per request
                assert storage_tokens(got) == got["meta_info"]["cached_tokens"] == full_pages(prompt) * PAGE, \
                    got["meta_info"]
            assert metric(second, STORAGE_TOKENS, cache_source="storage") == \
                sum(full_pages(p) * PAGE for p in prompts)
            assert "failed" not in second.kvferry_lines(), second.kvferry_lines()
    finally:
        probe.close()


def sent_pages(prefill: SGLangServer, before_mb: float) -> int:
    """Whole pages prefill sent since its metric read ``before_mb``."""
    return int((metric(prefill, SENT_MB) - before_mb) * 2**20) // PAGE_BYTES


def test_decode_loads_a_prefix_from_the_store_and_prefill_sends_only_the_rest(fleet):
    reference, prefill, decode, probe = fleet.reference, fleet.prefill, fleet.decode, fleet.pd_store
    for server in (reference, prefill, decode):
        server.wait_ready()
    prompt = prompt_of(600, 11)
    want = generate(reference, prompt, MAX_NEW)["output_ids"]
    _, got = pd_generate(prefill, decode, prompt, MAX_NEW, room=9_000)
    assert got["output_ids"] == want and storage_tokens(got) == 0, (got["output_ids"], want, got["meta_info"])
    probe.wait_for(prompt, len(prompt) // PAGE)
    for server in (prefill, decode):  # a cold pair: nothing on either device or host
        flush_cache(server)
    before_mb, before_tokens = metric(prefill, SENT_MB), metric(decode, STORAGE_TOKENS, cache_source="storage")
    _, got = pd_generate(prefill, decode, prompt, MAX_NEW, room=9_001)
    assert got["output_ids"] == want, (got["output_ids"], want)
    hit = full_pages(prompt) * PAGE
    assert storage_tokens(got) == hit, got["meta_info"]  # decode's own count
    assert metric(decode, STORAGE_TOKENS, cache_source="storage") - before_tokens == hit
    assert sent_pages(prefill, before_mb) == math.ceil((len(prompt) - hit) / PAGE)
    for server in (prefill, decode):
        assert "failed" not in server.kvferry_lines(), server.kvferry_lines()


def test_prefill_killed_mid_transfer_decode_fails_the_request_and_a_retry_loads_what_it_wrote(fleet):
    """Prefill computes a 1200-token prompt chunk by chunk and sends each;
    its HiCache writes each chunk's page as the chunk is cached. Once the
    store holds 24 of its pages, prefill is killed (its whole process group,
    SIGKILL). SGLang's decode has no path from a failed transfer to another
    source: it answers 500 (``Decode transfer failed``) and frees the
    request's pages. Sent again through another prefill on the same store,
    decode's L3 prefetch finds the pages the dead prefill wrote (decode never
    held them) and that prefill sends only the rest; tokens equal a single
    server's."""
    reference, prefill, spare, decode, probe = (fleet.reference, fleet.prefill, fleet.spare_prefill, fleet.decode,
                                                fleet.pd_store)
    for server in (reference, prefill, decode, spare):
        server.wait_ready()
    prompt = prompt_of(KILLED_PROMPT_TOKENS, 12)
    want = generate(reference, prompt, MAX_NEW)["output_ids"]
    replies: dict = {}
    request = threading.Thread(target=lambda: replies.update(
        pd_generate_replies(prefill, decode, prompt, MAX_NEW, room=9_100, timeout_s=180)))
    request.start()
    deadline = time.monotonic() + 120
    while probe.pages(prompt) < KILL_AT_PAGES and request.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    prefill.kill()
    killed_at = time.monotonic()
    request.join(200)
    failed_after_s = time.monotonic() - killed_at
    written = probe.pages(prompt)  # the dead prefill's, final
    reply = replies.get("decode")
    assert isinstance(reply, urllib.error.HTTPError), f"not killed mid-transfer: decode answered {reply!r}"
    body = reply.read().decode(errors="replace")
    assert reply.code == 500 and "Decode transfer failed" in body and "room=9100" in body, (reply.code, body)
    # the last chunk is cached only after its transfer
    assert KILL_AT_PAGES <= written < len(prompt) // PAGE, written
    assert failed_after_s < 60, failed_after_s

    before_tokens = metric(decode, STORAGE_TOKENS, cache_source="storage")
    first, got = pd_generate(spare, decode, prompt, MAX_NEW, room=9_101)
    assert got["output_ids"] == want, (got["output_ids"], want)
    hit = min(written, full_pages(prompt)) * PAGE
    assert storage_tokens(got) == hit, (written, got["meta_info"])  # what the dead prefill wrote
    assert metric(decode, STORAGE_TOKENS, cache_source="storage") - before_tokens == hit
    assert storage_tokens(first) == hit, first["meta_info"]  # the other prefill loaded them too
    assert sent_pages(spare, 0.0) == math.ceil((len(prompt) - hit) / PAGE)
    print(f"prefill killed with {written} of {len(prompt) // PAGE} pages in the store; "
          f"decode answered 500 {failed_after_s:.2f} s later")


@dataclass
class TierPair:
    """Servers with kvferry's storage tier (``KVFERRY_STORAGE_URL``) on one
    store: two prefills (``hicache_prefill`` with HiCache on the same store),
    and a plain decode whose prefetch is off, so that a room it restores
    loads every page from the store, not only what prefill skipped."""

    prefill: SGLangServer
    hicache_prefill: SGLangServer
    decode: SGLangServer
    probe: StoreProbe


@pytest.fixture(scope="module")
def tier_pair(fleet, model):
    url = f"file://{os.path.join(fleet.root, 'tier-store')}"
    tier = {"KVFERRY_STORAGE_URL": url}
    servers = [module_server("prefill-tier", model, fleet.root, PREFILL, env=tier),
               hicache_server("prefill-tier-hicache", model, url, fleet.root, PREFILL, env=tier),
               module_server("decode-tier", model, fleet.root, Role("decode"),
                             env={**tier, "KVFERRY_STORAGE_PREFETCH": "off"})]
    probe = StoreProbe(url, model)
    try:
        yield TierPair(*servers, probe=probe)
    finally:
        probe.close()
        close_all(servers)


def restored_lines(decode: SGLangServer, room: int) -> list[str]:
    """kvferry's lines in decode's log that say the room was restored from storage, and why."""
    return decode.lines_naming([f"room {room}: restored from storage after"])


def test_prefill_killed_mid_transfer_decode_restores_the_room_from_the_store(fleet, tier_pair):
    """A 2400-token prompt (150 full pages) served once through the pair:
    kvferry's sender writes its pages and aux row through, keyed by the
    prompt (kvferry's plugin hands SGLang's tokens to its sender and
    receiver). Prefill's cache flushed, the same prompt goes through the pair
    again: prefill computes it in one-page chunks and sends each as it is
    computed. Once prefill holds 10 pages of it (SGLang's ``/v1/loads``),
    its process group is killed (SIGKILL). kvferry's decode room loses its
    prefill mid-transfer, loads the room's pages and aux row from the store,
    and SGLang's decode answers with tokens equal a single server's."""
    prefill, decode = tier_pair.prefill, tier_pair.decode
    prompt = prompt_of(MID_TRANSFER_TOKENS, 22)
    assert len(prompt) % PAGE == 0  # the tier keeps full pages only
    fleet.reference.wait_ready()
    want = generate(fleet.reference, prompt, MAX_NEW)["output_ids"]
    prefill.wait_ready()
    decode.wait_ready()
    _, got = pd_generate(prefill, decode, prompt, MAX_NEW, room=9_300)  # both answered: written through
    assert got["output_ids"] == want, (got["output_ids"], want)
    flush_cache(prefill)  # nothing of the prompt left on prefill: it computes every chunk again
    assert used_tokens(prefill) < KILL_AFTER_TOKENS

    replies: dict = {}
    request = threading.Thread(target=lambda: replies.update(
        pd_generate_replies(prefill, decode, prompt, MAX_NEW, room=9_301, timeout_s=180)))
    request.start()
    deadline, held = time.monotonic() + 60, 0
    while held < KILL_AFTER_TOKENS:
        assert request.is_alive() and time.monotonic() < deadline, f"prefill never computed the prompt: {replies}"
        time.sleep(0.02)
        held = used_tokens(prefill)
    prefill.kill()
    killed_at = time.monotonic()
    request.join(120)
    answered_after_s = time.monotonic() - killed_at
    assert not request.is_alive(), "decode hung after prefill died"
    reply = replies.get("decode")
    assert isinstance(reply, dict), f"decode: {reply!r}"
    assert reply["output_ids"] == want, (reply["output_ids"], want)
    restored = restored_lines(decode, 9_301)
    assert restored, decode.lines_naming(["room 9301"])
    assert "before it took the request" not in restored[-1], restored[-1]  # prefill had the room: mid-transfer
    assert answered_after_s < 30, answered_after_s
    print(f"prefill killed holding {held} of {len(prompt)} tokens; decode restored room 9301 from the store and "
          f"answered {answered_after_s:.2f} s later: {restored[-1]}")


def test_a_decode_room_whose_prefill_never_sends_is_restored_from_the_one_store(fleet, tier_pair):
    """A prompt served once through a prefill with HiCache and the tier on
    one store: HiCache writes its pages, and kvferry's sender the room's
    pages and aux row, side by side in that store. The same prompt then goes
    to decode alone, as if prefill's scheduler never got it: once decode's
    room sent its pages to prefill (SGLang's transfer queue), prefill is
    killed (SIGKILL). kvferry's decode room loses its prefill, loads the
    room's 75 pages and its aux row from the store, and SGLang's decode
    answers with tokens equal a single server's."""
    prefill, decode, probe = tier_pair.hicache_prefill, tier_pair.decode, tier_pair.probe
    prompt = prompt_of(KILLED_PROMPT_TOKENS, 21)  # 75 full pages: the tier keeps full pages only
    assert len(prompt) % PAGE == 0
    fleet.reference.wait_ready()
    want = generate(fleet.reference, prompt, MAX_NEW)["output_ids"]
    prefill.wait_ready()
    decode.wait_ready()
    _, got = pd_generate(prefill, decode, prompt, MAX_NEW, room=9_200)  # returns once both answered
    assert got["output_ids"] == want, (got["output_ids"], want)
    probe.wait_for(prompt, len(prompt) // PAGE - 1)  # prefill's HiCache: its pages are in the same store

    replies: dict = {}
    extra = {"bootstrap_host": prefill.spec.host, "bootstrap_port": prefill.spec.bootstrap_port,
             "bootstrap_room": 9_201}

    def run():
        try:
            replies["decode"] = generate(decode, prompt, MAX_NEW, 180, **extra)
        except Exception as exc:  # reported below
            replies["decode"] = exc

    request = threading.Thread(target=run)
    request.start()
    deadline = time.monotonic() + 60
    while decode_transfer_queue(decode) < 1:
        assert request.is_alive() and time.monotonic() < deadline, f"decode never waited for prefill: {replies}"
        time.sleep(0.05)
    prefill.kill()
    killed_at = time.monotonic()
    request.join(120)
    answered_after_s = time.monotonic() - killed_at
    assert not request.is_alive(), "decode hung after prefill died"
    reply = replies["decode"]
    assert isinstance(reply, dict), f"decode: {reply!r}"
    assert reply["output_ids"] == want, (reply["output_ids"], want)
    restored = restored_lines(decode, 9_201)
    assert restored, decode.lines_naming(["room 9201"])
    assert answered_after_s < 30, answered_after_s
    print(f"prefill killed; decode restored room 9201 from the store and answered {answered_after_s:.2f} s later: "
          f"{restored[-1]}")
