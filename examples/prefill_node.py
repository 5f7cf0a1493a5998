"""One TP rank of the prefill node: prefill the tiny target and draft, send their KV.

``python -m examples.prefill_node --tp-rank R --tp-size 2 [flags]`` (one
process per rank). The rank registers with the bootstrap server, then, for
each request: runs the target (MLA) and draft (GQA) prefill over the whole
prompt (every rank computes the whole tiny forward pass and keeps its share:
the same latent cache on every rank, half of the draft's KV heads each),
writes the KV into randomly chosen free pages of its pools, fills the
request's aux row (first generated token, prompt length), and sends the pages
(the last, partly filled page whole) once the decode node asked for the room.
With ``--storage URL`` it passes the prompt's tokens to ``KVSender.init``:
the sent full pages of both pools and the aux row are written through to the
store, and pages the decode node loaded from the store are not sent.
Exits 0 when every room reached Success, 1 otherwise; prints one ``RESULT``
JSON line.

``--send-delay-s S`` is a demo and test aid: the rank waits ``S`` seconds
after the decode node's requests for a room arrived before it sends, and
says so (``room N: the decode node asked for it; sending in S s``), which
gives a deterministic moment to kill it before it sent anything.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field

import torch

from examples.node_common import (AUX_FIRST_TOKEN, AUX_PROMPT_TOKENS, Deadline, Request, add_node_args,
                                  check_node_args, dump_stacks_on_sigusr1, exit_now, make_requests, manager_config,
                                  model_pair, new_aux, print_result, why_failed)
from examples.paged_kv import PageAllocator, RankPools, pages_for
from examples.speculative import first_token
from examples.tiny_models import build_models
from transfer import KVManager, KVPoll, KVSender, Role


@dataclass
class _Room:
    request: Request
    sender: KVSender
    pages: list[int]
    asked_at: float | None = None  # the decode node's requests arrived (WaitingForInput)
    sent_at: float | None = None


@dataclass
class _Summary:
    tp_rank: int
    rooms: int = 0
    success: int = 0
    failed: list = field(default_factory=list)  # [room, reason]
    bytes_sent: int = 0
    descriptors: int = 0
    prefill_ms: float = 0.0
    storage_pages_written: int = 0  # pages (of every pool) this rank wrote to the store; 0 without --storage


class _PrefillRank:
    """The rank's models, pools and manager; starts and drives its rooms."""

    def __init__(self, args: argparse.Namespace, mgr: KVManager, pools: RankPools, aux: torch.Tensor) -> None:
        self.args, self.mgr, self.pools, self.aux = args, mgr, pools, aux
        self.models = build_models(model_pair(args))
        self.alloc = PageAllocator(args.num_pages, seed=args.tp_rank)
        self.where = f"prefill rank {args.tp_rank}/{args.tp_size}"

    def start(self, request: Request) -> _Room:
        """Prefill the prompt into free pages, fill the aux row, open the room."""
        target, draft = self.models
        pages = self.alloc.take(pages_for(request.prompt_tokens, self.pools.page_size))
        pre_target, pre_draft = target.prefill(request.prompt), draft.prefill(request.prompt)
        self.pools.store_prefill(pre_target, pre_draft, pages)
        self.aux[request.aux_slot] = 0
        self.aux[request.aux_slot, AUX_FIRST_TOKEN] = first_token(pre_target.logits)
        self.aux[request.aux_slot, AUX_PROMPT_TOKENS] = request.prompt_tokens
        return _Room(request, KVSender(self.mgr, self.args.bootstrap, request.room), pages)

    def drive(self, live: dict[int, _Room], summary: _Summary) -> None:
        """Send each room's pages once the decode node asked for it; until
        every room ended or the backstop deadline passed."""
        # Each room is bounded by the engine (bootstrap_timeout_s while waiting
        # for the decode node, then the transfer); this is a backstop.
        deadline = Deadline(2 * self.args.timeout_s + 10)
        mark, todo = self.mgr.progress, set(live)
        while live and not deadline.passed:
            delayed = set()  # rooms held back by --send-delay-s: visited again without a change
            for room in todo:  # the rooms that changed: one poll() each, not every live room
                r = live.get(room)
                if r is None:
                    continue
                state = r.sender.poll()
                if state is KVPoll.WaitingForInput and r.asked_at is None:
                    r.asked_at = time.monotonic()
                    if self.args.send_delay_s:
                        print(f"{self.where}: room {room}: the decode node asked for it; sending in "
                              f"{self.args.send_delay_s:g} s (--send-delay-s)", flush=True)
                if state is KVPoll.WaitingForInput and r.sent_at is None and \
                        time.monotonic() - r.asked_at >= self.args.send_delay_s:
                    # The prompt's tokens key its pages in the store (with --storage).
                    r.sender.init(len(r.pages), r.request.aux_slot, token_ids=r.request.prompt)
                    r.sender.send(r.pages, last=True)
                    r.sent_at = time.monotonic()
                elif state is KVPoll.WaitingForInput and r.sent_at is None:
                    delayed.add(room)
                elif state is KVPoll.Success:
                    print(f"{self.where}: room {room} sent: {r.request.prompt_tokens} tokens in {len(r.pages)} "
                          f"pages, {(time.monotonic() - r.sent_at) * 1e3:.1f} ms from send to Success", flush=True)
                    summary.success += 1
                elif state is KVPoll.Failed:
                    summary.failed.append([room, why_failed(r.sender)])
                if state in (KVPoll.Success, KVPoll.Failed):
                    self.alloc.free(r.pages)
                    del live[room]
            if live:
                self.mgr.wait_for_progress(mark, 0.05)  # also wakes for --send-delay-s
            mark, changed = self.mgr.changed_rooms(mark)  # None: fell behind, poll them all
            todo = set(live) if changed is None else {c.room for c, _ in changed} | delayed
        for room, r in live.items():
            r.sender.abort(f"no Success within {deadline.seconds:g} s")
            summary.failed.append([room, f"no Success within {deadline.seconds:g} s"])


def serve(args: argparse.Namespace) -> _Summary:
    pair = model_pair(args)
    requests = make_requests(args, pair)
    pools = RankPools.allocate(pair, num_pages=args.num_pages, page_size=args.page_size, tp_rank=args.tp_rank,
                               tp_size=args.tp_size)
    aux = new_aux()
    summary = _Summary(args.tp_rank, rooms=len(requests))
    with KVManager(manager_config(args, Role.PREFILL, args.tp_rank, args.tp_size), pools.kvferry_pools(),
                   aux=aux) as mgr:
        rank = _PrefillRank(args, mgr, pools, aux)
        print(f"{rank.where}: registered with {args.bootstrap} as node {args.node_id!r}", flush=True)
        started = time.monotonic()
        live = {r.room: rank.start(r) for r in requests}
        summary.prefill_ms = (time.monotonic() - started) * 1e3
        rank.drive(live, summary)
        summary.bytes_sent = mgr.transport.num_bytes
        summary.descriptors = mgr.transport.num_descriptors
        summary.storage_pages_written = mgr.storage.num_pages_written if mgr.storage is not None else 0
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.prefill_node", description=__doc__.split("\n")[0])
    ap.add_argument("--tp-rank", type=int, required=True, help="this process's TP rank, 0..tp-size-1")
    ap.add_argument("--tp-size", type=int, default=2, help="TP ranks of the prefill node (default %(default)s)")
    ap.add_argument("--send-delay-s", type=float, default=0.0, metavar="S",
                    help="demo/test aid: wait S seconds after the decode node asked for a room before sending it "
                         "(default %(default)s)")
    add_node_args(ap)
    args = ap.parse_args(argv)
    check_node_args(ap, args)
    dump_stacks_on_sigusr1()
    if args.send_delay_s < 0:
        ap.error("--send-delay-s must be >= 0")
    logging.basicConfig(level=logging.WARNING, format=f"[prefill {args.tp_rank}] %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # bit-identical float32 results in every process
    try:
        summary = serve(args)
    except Exception as exc:  # reported in the result line, and the exit code
        logging.getLogger("examples.prefill_node").exception("prefill rank %d failed", args.tp_rank)
        summary = _Summary(args.tp_rank, failed=[[-1, f"{type(exc).__name__}: {exc}"]])
    for room, why in summary.failed:
        print(f"prefill rank {args.tp_rank}: room {room} FAILED: {why}", flush=True)
    print_result(vars(summary))
    return 0 if summary.rooms and summary.success == summary.rooms and not summary.failed else 1


if __name__ == "__main__":
    exit_now(main())
