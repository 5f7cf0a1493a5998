"""The decode node: receive the KV of every request, then generate with speculative decoding.

``python -m examples.decode_node [flags]`` (TP 1, one process). For each
request it allocates randomly chosen free pages of its target (MLA) and draft
(GQA) pools, enough for the prompt and the tokens to come, and asks the
prefill node (found through the bootstrap server) for the room's KV with
``KVReceiver.init(prompt_pages, aux_slot, token_ids=prompt)``. Once every
room reached Success it generates ``--max-new-tokens`` tokens per request
from the received KV: the first token comes from the aux row, then each step
the draft proposes ``--num-draft`` tokens and the target verifies them
(greedy), both attending over their paged caches gathered by the request's
page ids. The prompt's tokens are never used for that; ``--check`` runs the
single-process reference from them, target prefill and plain greedy decoding
without any transfer, and compares.

With ``--storage URL`` the prompt's tokens given to ``KVReceiver.init`` name
the prompt's pages in the store (without, they are ignored): the leading
full pages the store has are loaded from it (``--storage-prefetch``) and the
prefill node sends only the rest (the last, partly filled page and the aux
row always come from prefill); a room whose transfer fails (the prefill node
died...) is restored from the store when every page of it and its aux row are
there. Per request it reports how many pages came from the store, and the KV
bytes that came over the network.

Prints one line per request and one ``RESULT`` JSON line; exits 0 when every
room succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field

import torch

from examples.node_common import (AUX_FIRST_TOKEN, AUX_PROMPT_TOKENS, Deadline, Request, add_node_args,
                                  check_node_args, dump_stacks_on_sigusr1, exit_now, make_requests, manager_config,
                                  model_pair, new_aux, print_result, storage_url, wait_until_registered, why_failed)
from examples.paged_kv import PageAllocator, RankPools, pages_for
from examples.speculative import Prefilled, reference_tokens, speculative, tokens_needed
from examples.tiny_models import build_models
from transfer import KVManager, KVPoll, KVReceiver, Role


@dataclass
class _Room:
    request: Request
    receiver: KVReceiver
    pages: list[int]  # the request's page table: the prompt's pages first
    created_at: float
    transferring_at: float = 0.0  # bootstrapping (lookup, handshake) done, requests sent
    done_at: float = 0.0
    ended_at: float = 0.0  # done_at as wall-clock time (time.time()), to compare with other processes' events
    prefetched: int = 0  # pages loaded from storage before the requests went out


@dataclass
class _Summary:
    rooms: list = field(default_factory=list)  # one dict per request that succeeded
    failed: list = field(default_factory=list)  # [room, reason]
    kv_bytes: int = 0  # KV bytes received into the pools, aux rows left out
    network_kv_bytes: int = 0  # of them, sent by the prefill node
    storage_kv_bytes: int = 0  # of them, loaded from the storage tier
    aux_bytes: int = 0
    # With the write fence (decode's default with staging) prefill's engine writes only into staging
    # arenas, and the aux rows travel in the final RoomStatus, not through the engine.
    fenced: bool = False
    transfer_s: float = 0.0  # first receiver created -> last Success (lookup and handshake included)


def _receive(args, requests: list[Request], pools: RankPools, aux: torch.Tensor) -> tuple[list[_Room], _Summary]:
    """Every room's KV into the pools; returns the rooms that succeeded."""
    alloc = PageAllocator(args.num_pages, seed=args.first_room)
    summary, done = _Summary(), []
    prefetch = {} if args.storage_prefetch is None else {"storage_prefetch": args.storage_prefetch}
    config = manager_config(args, Role.DECODE, 0, 1, **prefetch)
    with KVManager(config, pools.kvferry_pools(), aux=aux) as mgr:
        summary.fenced = mgr.fenced
        wait_until_registered(mgr, args.bootstrap, args.node_id, args.timeout_s)
        start = time.monotonic()
        live = {}
        for r in requests:
            pages = alloc.take(pages_for(tokens_needed(r.prompt_tokens, args.max_new_tokens, args.num_draft),
                                         args.page_size))
            receiver = KVReceiver(mgr, args.bootstrap, r.room, prefill_node=args.node_id)
            # The prompt's tokens name its pages in the store (with --storage); generation never reads them.
            receiver.init(pages[:pages_for(r.prompt_tokens, args.page_size)], aux_index=r.aux_slot,
                          token_ids=r.prompt)
            live[r.room] = _Room(r, receiver, pages, time.monotonic())
        # Each room is bounded by bootstrap_timeout_s and transfer_timeout_s; this is a backstop.
        deadline = Deadline(2 * args.timeout_s + 10)
        mark, todo = mgr.progress, list(live)
        while live and not deadline.passed:
            for room in todo:  # the rooms that changed: one poll() each, not every live room
                r = live.get(room)
                if r is None:
                    continue
                state = r.receiver.poll()
                if not r.transferring_at and state in (KVPoll.Transferring, KVPoll.Success):
                    r.transferring_at = time.monotonic()
                    # What the prefetch loaded; a restore from storage after a failed
                    # transfer (which takes peer_timeout_s at least) comes later.
                    r.prefetched = r.receiver.pages_from_storage
                if state is KVPoll.Success:
                    r.done_at, r.ended_at = time.monotonic(), time.time()
                    done.append(r)
                elif state is KVPoll.Failed:
                    summary.failed.append([room, why_failed(r.receiver)])
                if state in (KVPoll.Success, KVPoll.Failed):
                    del live[room]
            if live:
                mgr.wait_for_progress(mark, 0.05)
            mark, changed = mgr.changed_rooms(mark)  # None: fell behind, poll them all
            todo = list(live) if changed is None else {c.room for c, _ in changed}
        for room, r in live.items():
            r.receiver.abort(f"no Success within {deadline.seconds:g} s")
            summary.failed.append([room, f"no Success within {deadline.seconds:g} s"])
        if done:
            summary.transfer_s = max(r.done_at for r in done) - start
    return done, summary


def _generate(args, rooms: list[_Room], pools: RankPools, aux: torch.Tensor, summary: _Summary) -> None:
    target, draft = build_models(model_pair(args))
    row_bytes = aux[0].numel() * aux.element_size()
    for r in rooms:
        req = r.request
        first, prompt_tokens = (int(x) for x in aux[req.aux_slot, [AUX_FIRST_TOKEN, AUX_PROMPT_TOKENS]])
        if prompt_tokens != req.prompt_tokens:
            summary.failed.append([req.room, f"aux row says {prompt_tokens} prompt tokens, "
                                             f"expected {req.prompt_tokens}"])
            continue
        prefilled = Prefilled(prompt_tokens, first, pools.target_cache(r.pages), pools.draft_cache(r.pages))
        gen = speculative(target, draft, prefilled, args.max_new_tokens, args.num_draft)
        num_pages = pages_for(prompt_tokens, args.page_size)
        kv_bytes = num_pages * pools.page_bytes
        from_storage = r.receiver.pages_from_storage
        storage_bytes = from_storage * pools.page_bytes
        summary.kv_bytes += kv_bytes
        summary.storage_kv_bytes += storage_bytes
        summary.network_kv_bytes += kv_bytes - storage_bytes
        summary.aux_bytes += row_bytes
        exposed = r.receiver.stats().exposed_transfer_s  # prefill's last send() to Success (None: nothing sent)
        summary.rooms.append(dict(exposed_ms=None if exposed is None else exposed * 1e3, room=req.room, prompt_tokens=prompt_tokens, pages=num_pages, kv_bytes=kv_bytes,
                                  pages_from_storage=from_storage, prefetched_pages=r.prefetched,
                                  restored_pages=from_storage - r.prefetched, storage_kv_bytes=storage_bytes,
                                  network_kv_bytes=kv_bytes - storage_bytes,
                                  bootstrap_ms=(r.transferring_at - r.created_at) * 1e3,
                                  transfer_ms=(r.done_at - r.transferring_at) * 1e3, ended_at=r.ended_at,
                                  tokens=gen.tokens, proposed=gen.num_proposed, accepted=gen.num_accepted,
                                  target_steps=gen.num_target_steps))
        if storage_url(args):
            restored = f", {from_storage - r.prefetched} restored after the transfer failed" \
                if from_storage > r.prefetched else ""
            moved = (f"{num_pages} pages ({from_storage} from storage{restored}), "
                     f"{kv_bytes - storage_bytes:,} KV bytes over the network")
        else:
            moved = f"{num_pages} pages, {kv_bytes:,} KV bytes"
        print(f"room {req.room}: {prompt_tokens} prompt tokens, {moved} in "
              f"{(r.done_at - r.transferring_at) * 1e3:.1f} ms; {len(gen.tokens)} tokens in "
              f"{gen.num_target_steps + 1} target steps, {gen.num_accepted} of {gen.num_proposed} draft tokens "
              f"accepted: {' '.join(map(str, gen.tokens))}", flush=True)


def _check(args, requests: list[Request], summary: _Summary) -> None:
    """Compare every room's tokens with the single-process run's."""
    target, _ = build_models(model_pair(args))
    want = reference_tokens(target, [r.prompt for r in requests], args.max_new_tokens, args.page_size)
    by_room = {r.room: tokens for r, tokens in zip(requests, want)}
    for room in summary.rooms:
        room["matches_reference"] = room["tokens"] == by_room[room["room"]]
        print(f"room {room['room']}: {'same tokens as' if room['matches_reference'] else 'DIFFERENT tokens from'} "
              f"the single-process run", flush=True)
        if not room["matches_reference"]:
            summary.failed.append([room["room"], f"tokens differ from the single-process run's "
                                                 f"{' '.join(map(str, by_room[room['room']]))}"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.decode_node", description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=24,
                    help="tokens to generate per request, the first (from prefill) included (default %(default)s)")
    ap.add_argument("--num-draft", type=int, default=3,
                    help="draft tokens proposed per speculative step (default %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="also run the single-process reference and exit 1 unless the tokens are the same")
    ap.add_argument("--storage-prefetch", default=None, choices=["wait_complete", "timeout", "best_effort", "off"],
                    help="with --storage: load the leading full pages the store has before asking the prefill node "
                         "for the rest, waiting for the load to complete, for at most "
                         "KVFERRY_STORAGE_PREFETCH_TIMEOUT_S (timeout), not at all (best_effort); off: ask for "
                         "every page (default: KVFERRY_STORAGE_PREFETCH, else wait_complete)")
    add_node_args(ap)
    args = ap.parse_args(argv)
    check_node_args(ap, args)
    dump_stacks_on_sigusr1()
    logging.basicConfig(level=logging.WARNING, format="[decode] %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # bit-identical float32 results in every process
    if args.max_new_tokens < 1 or args.num_draft < 1:
        ap.error("--max-new-tokens and --num-draft must be >= 1")
    pair = model_pair(args)
    requests = make_requests(args, pair)
    pools = RankPools.allocate(pair, num_pages=args.num_pages, page_size=args.page_size)
    aux = new_aux()
    try:
        rooms, summary = _receive(args, requests, pools, aux)
        _generate(args, rooms, pools, aux, summary)
        if args.check:
            _check(args, requests, summary)
    except Exception as exc:  # reported in the result line, and the exit code
        logging.getLogger("examples.decode_node").exception("decode node failed")
        summary = _Summary(failed=[[-1, f"{type(exc).__name__}: {exc}"]])
    for room, why in summary.failed:
        print(f"decode: room {room} FAILED: {why}", flush=True)
    from_storage = f" ({summary.storage_kv_bytes:,} from storage, {summary.network_kv_bytes:,} over the network)" \
        if storage_url(args) else ""
    print(f"decode: {len(summary.rooms)} of {len(requests)} requests served; {summary.kv_bytes:,} KV bytes"
          f"{from_storage} and {summary.aux_bytes} aux bytes received, {summary.transfer_s * 1e3:.1f} ms from the "
          "first request to the last Success", flush=True)
    print_result(vars(summary))
    return 0 if len(summary.rooms) == len(requests) and not summary.failed else 1


if __name__ == "__main__":
    exit_now(main())
