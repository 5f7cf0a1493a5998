"""One SGLang rank (or its bootstrap server) driving a transfer backend with SGLang's own code.

``python -m tests.engines.sglang.rank --role prefill|decode|bootstrap ...``

Built as SGLang's ``prefill.py`` / ``decode.py`` build them: SGLang's
``ServerArgs``, its real KV pools (``MHATokenToKVPool`` / ``MLATokenToKVPool``
on the CPU, a draft pool appended with ``num_draft_entries``), ``KVArgs``
filled from ``get_kv_transfer_buf_infos`` and ``MetadataBuffers.get_buf_infos``,
classes from ``get_kv_class`` after ``load_plugins()``, and SGLang's call
sequence: ``poll_and_all_reduce`` (MIN over a gloo group of the TP ranks),
``pop_decode_prefix_len`` then ``init`` then chunked ``send`` with the last
chunk inferred from the page count; decode ``try_ensure_parallel_info``,
``init(prefill_dp_rank)``, ``send_metadata(..., decode_prefix_len)`` and the
metadata gate (Success only once the ``bootstrap_room`` row landed).

Data: every request's KV is a "logical" array per buffer over all heads,
drawn from a seed (:func:`.sglang_rank.logical_kv`); each prefill rank writes its heads into
randomly chosen pages, and decode checks every byte of its pages and of every
aux region against the same draw. Pages decode did not give for writing
(placeholders, its prefix) hold a sentinel that must survive. Results are
printed as ``RESULT {json}`` lines; ``KILLME`` asks the parent to SIGKILL it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

from harness import lines
from tests.engines.sglang.scenarios import PAGE_SIZE, Request, requests_of
from tests.engines.sglang.sglang_rank import (NUM_SLOTS, SENTINEL, Clock, Rank, aux_row, logical_state, pick_pages,
                                              server_args_of, state_items)


def emit(kind: str, **fields) -> None:
    """``KIND {json}`` as one line in one write (:func:`harness.lines.emit`):
    the prefill's HTTP stand-in emits from its own threads, and ``print``
    writes a line and its newline apart, so another thread's event could
    land after this one's object on the same line and be lost to the reader
    (a ``GENERATE`` once, behind a ``RESULT``)."""
    lines.emit(kind, fields)


def gloo_group(rank: Rank):
    """The attention TP group of this rank's DP rank (SGLang's attn_tp_cpu_group): one gloo world per DP rank."""
    import torch.distributed as dist

    a = rank.a
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.gloo_port + rank.dp_rank}",
                            rank=rank.attn_tp_rank, world_size=rank.attn_tp,
                            timeout=__import__("datetime").timedelta(seconds=60))
    return dist.group.WORLD


def run_prefill(a) -> None:
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    from sglang.srt.disaggregation.base.conn import KVPoll

    rank = Rank(a)
    group = gloo_group(rank)
    # SGLang's DP controller puts a room on prefill DP rank room % dp_size (follow_bootstrap_room)
    reqs = [r for i, r in enumerate(requests_of(a.scenario)) if _prefill_dp_of(a, i, r.room) == rank.dp_rank]
    taken: set = set()
    addr = f"127.0.0.1:{a.port}"
    pages = {r.room: pick_pages(a, "prefill", r.room, r.num_pages, taken) for r in reqs}
    items = _state_items(rank, "prefill", reqs)
    for r in reqs:
        _fill(rank, r, pages[r.room], items[r.room])
    senders = {r.room: rank.sender_cls(mgr=rank.mgr, bootstrap_addr=addr, bootstrap_room=r.room) for r in reqs}
    phase = {r.room: "boot" for r in reqs}
    clock = Clock(rank)
    emit("READY", role="prefill", tp_rank=a.tp_rank, dp_rank=rank.dp_rank, rooms=[r.room for r in reqs])
    deadline = time.monotonic() + a.timeout
    while any(p != "done" for p in phase.values()) and time.monotonic() < deadline:
        live = [r for r in reqs if phase[r.room] != "done"]
        polls = poll_and_all_reduce([senders[r.room] for r in live], group)
        for r, poll in zip(live, polls):
            s = senders[r.room]
            if poll == KVPoll.Failed:
                err = _error_of(s)  # as SGLang's prefill: a room failed on another rank is aborted on this one
                core = getattr(s, "_core", None)  # kvferry's own room on this rank (None: another backend)
                emit("RESULT", room=r.room, state="Failed", error=err, phase=phase[r.room],
                     core_state=core.poll().name if core is not None else None)
                phase[r.room] = "done"
            elif poll == KVPoll.Success:
                m = s.get_transfer_metric()
                emit("RESULT", room=r.room, state="Success", bytes=m.transfer_total_bytes,
                     latency_s=m.transfer_latency_s, e2e_s=clock.done(r.room), **_extra_stats(s))
                phase[r.room] = "done"
            elif phase[r.room] == "boot" and poll == KVPoll.WaitingForInput:
                prefix_tokens = s.pop_decode_prefix_len()
                prefix_pages = prefix_tokens // a.page_size
                s.init(r.num_pages - prefix_pages, r.room % NUM_SLOTS)
                phase[r.room] = "send"
                emit("PREFIX", room=r.room, tokens=prefix_tokens)
                _send(rank, r, s, pages[r.room], prefix_pages, clock, items[r.room])
                phase[r.room] = "wait" if r.action != "kill" else "killme"
            elif phase[r.room] == "killme":
                emit("KILLME", room=r.room)
                time.sleep(a.timeout)
        time.sleep(a.poll_interval_s)
    emit("DONE", role="prefill", timed_out=any(p != "done" for p in phase.values()), **clock.totals())


def _state_items(rank: Rank, side: str, reqs) -> dict:
    """room -> per state type (KVArgs order) the items the room names on this side."""
    kinds = [str(getattr(st, "value", st)) for st in rank.kv_args.state_types]
    sizes = [min(n // i for n, i in zip(lens, its))
             for lens, its in zip(rank.kv_args.state_data_lens, rank.kv_args.state_item_lens)]
    taken = {k: set() for k in kinds}
    return {r.room: [state_items(rank.a, side, r.room, k, n, r.num_pages, taken[k]) for k, n in zip(kinds, sizes)]
            for r in reqs}


def _state_keys(rank: Rank):
    """(state type index, key, buffer, axis) for each state buffer; ``axis``:
    how the buffer's items split over the attention TP ranks as SGLang lays
    them out, (rows, units on this rank, sub-blocks over all ranks), or None
    for an item the same on every rank (DSA's indexer, any state of an MLA
    model but Mamba's, a Mamba tensor SGLang marks replicated)."""
    args = rank.kv_args
    kinds = [str(getattr(st, "value", st)) for st in args.state_types]
    out, seen = [], {}
    for key, t in rank.states:
        kind = key.split(".")[1]
        k = kinds.index(kind)
        j = seen[k] = seen.get(k, -1) + 1
        axis = None
        if kind == "mamba" and args.state_dim_per_tensor[k][j]:
            dim = args.state_dim_per_tensor[k][j]
            groups = (args.state_conv_shard_groups[k] or [None] * (j + 1))[j] or [dim * rank.attn_tp]
            axis = (args.state_slice_outer_counts[k][j], dim, tuple(groups))
        elif kind == "swa" and not rank.is_mla:  # nhd pages: token rows of this rank's KV heads
            heads = rank.pool.swa_kv_pool.k_buffer[0].shape[1]
            axis = (rank.a.page_size, heads, (heads * rank.attn_tp,))
        elif kind == "block_scale":  # per page: token rows of this rank's KV heads' scales
            heads = rank.pool.k_buffer[0].shape[1]
            axis = (rank.a.page_size, heads, (heads * rank.attn_tp,))
        out.append((k, key, t, axis))
    return out


def _state_share(rank: Rank, room: int, key: str, t, axis, count: int) -> torch.Tensor:
    """This rank's share of ``count`` items of a room's state buffer: the
    items are drawn whole (over all ranks' shares), and a rank holds, of each
    sub-block of the slice axis, its own part (SGLang's layout)."""
    if axis is None:
        return logical_state(rank.a.seed, room, key, 0, (count, t.shape[1]))
    rows, dim, groups = axis
    unit = t.shape[1] // (rows * dim)
    whole = logical_state(rank.a.seed, room, key, 0, (count, rows, sum(groups), unit))
    parts, off = [], 0
    for g in groups:
        n = g // rank.attn_tp
        parts.append(whole[:, :, off + rank.attn_tp_rank * n:off + (rank.attn_tp_rank + 1) * n])
        off += g
    return torch.cat(parts, dim=2).reshape(count, -1)


def _prefill_dp_of(a, i: int, room: int) -> int:
    """The prefill DP rank SGLang's DP controller gives the ``i``-th room:
    room % dp_size under follow_bootstrap_room (the PD prefill default);
    under another method (round_robin) a rank of its own choosing, here
    never room % dp_size, so that a decode that guessed would ask the wrong rank."""
    if a.load_balance in ("auto", "follow_bootstrap_room"):
        return room % a.dp_size
    return (room + 1) % a.dp_size


def _decode_dp_of(rank: Rank, addr: str, info, room: int, deadline: float) -> int | None:
    """The prefill DP rank of a room as SGLang's decode resolves it
    (``_resolve_prefill_dp_rank``): room % dp_size when the prefill follows
    the bootstrap room, else SGLang's own HTTP query of the bootstrap port's
    registry (``CommonKVReceiver.query_prefill_dp_ranks``), until it knows."""
    if info.dp_size == 1:
        return 0
    if info.follow_bootstrap_room:
        return room % info.dp_size
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    while time.monotonic() < deadline:
        found = CommonKVReceiver.query_prefill_dp_ranks(addr, [room])
        if str(room) in found:
            return int(found[str(room)])
        time.sleep(0.1)
    return None


def _fill(rank: Rank, r: Request, pages: list[int], items: list) -> None:
    """Write this rank's heads of the request's KV into its pages, and its
    share of the request's state into its state items (before any transfer:
    filling is not part of what is measured)."""
    _write_pages(rank, r, pages, 0)
    for k, key, t, axis in _state_keys(rank):
        t[torch.as_tensor(items[k], dtype=torch.long)] = _state_share(rank, r.room, key, t, axis, len(items[k]))


def _write_pages(rank: Rank, r: Request, pages: list[int], first_page: int, stale: bool = False) -> None:
    """This rank's heads of the request's pages ``first_page...`` into ``pages``
    (``stale``: zeros instead, what a forward pass still running left there)."""
    for key, t in rank.buffers:
        view = t.view(-1, rank.a.page_size, t.shape[1], t.shape[2])
        idx = torch.as_tensor(pages, dtype=torch.long)
        view[idx] = 0 if stale else rank.expected(r, key, t, first_page, len(pages))


class LateWrite:
    """A forward pass still writing a chunk's pages, as SGLang's early send of
    a cached prefix meets it under overlap scheduling (the previous step's
    forward on its stream): ``write`` runs ``delay_s`` later, on a thread of
    its own; ``query()`` and ``synchronize()`` as a ``torch.cuda.Event``
    recorded after it."""

    def __init__(self, write, delay_s: float) -> None:
        self._done = threading.Event()
        threading.Timer(delay_s, self._run, (write,)).start()

    def _run(self, write) -> None:
        write()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


def _send(rank: Rank, r: Request, s, pages: list[int], prefix_pages: int, clock, items: list) -> None:
    """SGLang's chunked sends of the pages after decode's prefix."""
    suffix = pages[prefix_pages:]
    clock.start(r.room)
    if r.action.startswith("decode_abort"):
        return  # decode aborts this room before any chunk: wait for the Failed poll
    offset = 0
    for i, size in enumerate(r.chunks):
        if not s.should_send_kv_chunk(size, False):
            continue
        chunk = suffix[offset:offset + size]
        if r.action == "early_event" and i == 0:  # SGLang sets the event on the sender, then calls send()
            _write_pages(rank, r, chunk, prefix_pages + offset, stale=True)
            s._early_send_wait_event = LateWrite(
                lambda c=chunk, first=prefix_pages + offset: _write_pages(rank, r, c, first), 0.5)
        s.send(np.asarray(chunk, dtype=np.int32))
        offset += size
        if r.action == "prefill_abort" and i == 0:
            s.abort()
            return
        if r.action in ("kill", "release") and i == 0:
            return  # the rest is never sent: the room stays in flight
    slot = r.room % NUM_SLOTS
    for i, region in enumerate(rank.regions):  # what MetadataBuffers.set_buf does before the last send
        if i not in (rank.room_region, rank.checksum_region):
            region[slot] = torch.from_numpy(aux_row(rank.a.seed, r.room, i, region.shape[1]))
    if rank.checksum_region >= 0:  # SGLang's send_kv_chunk: the digest of the pages this prefill sends
        from sglang.srt.disaggregation.utils import kv_layout_signature

        rank.meta.set_kv_checksum(SimpleNamespace(metadata_buffer_index=slot), rank.digest(suffix),
                                  kv_layout_signature(rank.kv_args))
    rank.meta.bootstrap_room[slot] = 0
    rank.meta.bootstrap_room[slot, 0] = r.room
    last = suffix[offset:]
    if s.should_send_kv_chunk(len(last), True):  # SGLang names the room's state items with its last chunk
        s.send(np.asarray(last, dtype=np.int32),
               state_indices=[np.asarray(i, dtype=np.int32) for i in items] if items else None)


def _error_of(obj) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:  # any backend's exception type
        return f"{type(exc).__name__}: {exc}"
    return ""


def _wait_release_safe(receiver, timeout_s: float) -> float | None:
    """Seconds until ``is_abort_release_safe()`` (None: not within
    ``timeout_s``, or a backend without deferred-release support)."""
    start = time.monotonic()
    while True:
        try:
            if receiver.is_abort_release_safe():
                return time.monotonic() - start
        except NotImplementedError:
            return None
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(0.01)


def _extra_stats(sender) -> dict:
    stats = getattr(sender, "transfer_stats", None)
    if stats is None:
        return {}
    st = stats()
    return {"descriptors": st.descriptors, "plan_bytes": st.bytes}


def prefill_info(rank: Rank, addr: str, deadline: float):
    """Decode's ``prefill_info_table`` entry of ``addr`` once SGLang's
    ``try_ensure_parallel_info`` got it; None (and a DONE line saying so)
    when it did not by ``deadline``."""
    while not rank.mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            emit("DONE", role="decode", timed_out=True, error="prefill parallel info never arrived")
            return None
        time.sleep(0.2)
    return rank.mgr.prefill_info_table[addr]


def run_decode(a) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    rank = Rank(a)
    group = gloo_group(rank)
    # decode's DP controller spreads requests over its DP ranks (round robin here)
    reqs = [r for i, r in enumerate(requests_of(a.scenario)) if i % a.dp_size == rank.dp_rank]
    addr = f"127.0.0.1:{a.port}"
    deadline = time.monotonic() + a.timeout
    info = prefill_info(rank, addr, deadline)
    if info is None:
        return
    emit("READY", role="decode", prefill_tp=info.attn_tp_size, prefill_dp=info.dp_size,
         follow_bootstrap_room=info.follow_bootstrap_room)
    taken: set = set()
    pages = {r.room: pick_pages(a, "decode", r.room, r.num_pages, taken) for r in reqs}
    items = _state_items(rank, "decode", reqs)
    receivers, slots = {}, {}
    clock = Clock(rank)

    def ask(r: Request):
        clock.start(r.room)
        recv = rank.receiver_cls(mgr=rank.mgr, bootstrap_addr=addr, bootstrap_room=r.room)
        recv.init(_decode_dp_of(rank, addr, info, r.room, deadline))
        slots[r.room] = (r.room * 3 + 1) % NUM_SLOTS
        rank.meta.clear_slot(slots[r.room])
        suffix = pages[r.room][r.prefix_pages:]
        states = [np.asarray(i, dtype=np.int32) for i in items[r.room]] or None
        recv.send_metadata(np.asarray(suffix, dtype=np.int32), slots[r.room], states,
                           decode_prefix_len=r.prefix_pages * a.page_size)
        receivers[r.room] = recv
        return recv

    for r in reqs:
        if not r.after_release:
            ask(r)
    # decode_abort_one: only the first TP rank aborts; SGLang fails the room on the others (MIN over the ranks)
    to_abort = {r.room for r in reqs if r.action == "decode_abort" or
                (r.action == "decode_abort_one" and rank.attn_tp_rank == 0)}
    to_release = {r.room: None for r in reqs if r.action == "release"}  # room -> when it was seen in flight
    live = [r for r in reqs if not r.after_release]
    while live and time.monotonic() < deadline:
        for room, seen in list(to_release.items()):
            if receivers[room].poll() >= KVPoll.Transferring and seen is None:
                to_release[room] = time.monotonic()
            elif seen is not None and time.monotonic() - seen > 1.0:  # prefill's first chunk had time to land
                del to_release[room]
                live += _release_and_resume(rank, receivers[room], [r for r in reqs if r.after_release], ask)
        gate = [SimpleNamespace(req=SimpleNamespace(bootstrap_host="127.0.0.1"), metadata_buffer_index=slots[r.room])
                for r in live]
        for room in list(to_abort):  # once its request went out (prefill holds the room until then)
            if receivers[room].poll() >= KVPoll.Transferring:
                receivers[room].abort()
                to_abort.discard(room)
        polls = poll_and_all_reduce([receivers[r.room] for r in live], group, gate, rank.meta)
        still = []
        for r, poll in zip(live, polls):
            if poll == KVPoll.Success:
                done_s = clock.done(r.room)
                checks = _verify(rank, r, pages[r.room], slots[r.room], items[r.room]) \
                    if not a.scenario.startswith("bench") else {}
                emit("RESULT", room=r.room, state="Success", e2e_s=done_s, **checks)
            elif poll == KVPoll.Failed:
                # As SGLang's decode: failure_exception() first (a room that failed on another rank is
                # aborted on this one), then, with the deferred release, the pages are reused only once
                # is_abort_release_safe(): from then on nothing may write them.
                error = _error_of(receivers[r.room])
                waited = _wait_release_safe(receivers[r.room], 10.0)
                before = [rank.pages_view(t, pages[r.room]).clone() for _, t in rank.buffers]
                time.sleep(0.5)
                after = [rank.pages_view(t, pages[r.room]) for _, t in rank.buffers]
                emit("RESULT", room=r.room, state="Failed", error=error,
                     written_after_failure=sum(int((x != y).sum()) for x, y in zip(before, after)),
                     pages_untouched=all(bool((x == SENTINEL).all()) for x in after),
                     release_safe=waited is not None, release_wait_s=waited)
            else:
                still.append(r)
        live = still
        time.sleep(a.poll_interval_s)
    emit("DONE", role="decode", timed_out=bool(live), **clock.totals())


def _release_and_resume(rank: Rank, in_flight, later: list[Request], ask) -> list[Request]:
    """SGLang's release_memory_occupation and resume_memory_occupation on
    decode (its queue cleared first), with a room in flight; a room asked for
    while released fails at once; the ``later`` rooms are asked for after the
    resume. Returns the requests to poll from now on."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    start = time.monotonic()
    rank.mgr.deregister_buffer_to_engine()
    released_s = time.monotonic() - start
    probe = rank.receiver_cls(mgr=rank.mgr, bootstrap_addr=in_flight.bootstrap_addr, bootstrap_room=1)
    probe.init(0)
    emit("RELEASED", seconds=released_s, in_flight_state=int(in_flight.poll()),
         probe_failed=probe.poll() == KVPoll.Failed, probe_error=_error_of(probe))
    rank.mgr.register_buffer_to_engine()
    for r in later:
        ask(r)
    return later


def _verify(rank: Rank, r: Request, pages: list[int], slot: int, items: list) -> dict:
    """Count differing bytes: suffix pages vs the logical draw, prefix pages
    and page 0 vs the sentinel, every aux region row vs its draw, the state
    items vs this rank's share of the draw (prefill named as many items, or
    a page more)."""
    bad_pages = bad_prefix = 0
    for key, t in rank.buffers:
        got = rank.pages_view(t, pages[r.prefix_pages:])
        want = rank.expected(r, key, t, r.prefix_pages, r.num_pages - r.prefix_pages)
        bad_pages += int((got != want).sum())
        bad_prefix += int((rank.pages_view(t, pages[:r.prefix_pages] + [0]) != SENTINEL).sum())
    bad_aux = 0
    for i, region in enumerate(rank.regions):
        if i == rank.checksum_region:
            continue  # checked below, as SGLang's decode checks it
        want = aux_row(rank.a.seed, r.room, i, region.shape[1])
        if i == rank.room_region:  # bootstrap_room, written by prefill as the room id
            want = np.frombuffer(np.asarray([r.room] + [0] * (region.shape[1] // 8 - 1), dtype="<u8").tobytes(),
                                 dtype=np.uint8)
        bad_aux += int((region[slot].numpy() != want).sum())
    bad_state = state_checked = 0
    for k, key, t, axis in _state_keys(rank):
        got = t[torch.as_tensor(items[k], dtype=torch.long)]
        sent = len(items[k]) + (0 if key.split(".")[1] == "mamba" else 1)
        want = _state_share(rank, r.room, key, t, axis, sent)[:len(items[k])]
        bad_state += int((got != want).sum())
        state_checked += got.numel()
    out = {"bad_page_bytes": bad_pages, "bad_prefix_bytes": bad_prefix, "bad_aux_bytes": bad_aux,
           "bad_state_bytes": bad_state, "state_bytes_checked": state_checked,
           "aux_regions": len(rank.regions), "page_bytes_checked": int(sum(
               rank.pages_view(t, pages[r.prefix_pages:]).numel() for _, t in rank.buffers))}
    if rank.checksum_region >= 0:
        out.update(_check_checksum(rank, r, pages, slot))
    return out


def _check_checksum(rank: Rank, r: Request, pages: list[int], slot: int) -> dict:
    """SGLang's decode side of the KV checksum (``_verify_kv_checksums``): the
    digest and signature prefill wrote, as they landed in the metadata row,
    against this rank's digest of its pages after the prefix (one byte of a
    landed page flipped first for a ``corrupt`` request)."""
    from sglang.srt.disaggregation.utils import kv_layout_signature

    suffix = pages[r.prefix_pages:]
    if r.corrupt:
        _, t = rank.buffers[0]
        t.view(-1, rank.a.page_size, t.shape[1], t.shape[2])[suffix[0], 0, 0, 0] ^= 0x5A
    expected, signature = rank.meta.get_kv_checksum(slot)
    return {"checksum_sent": expected != 0, "checksum_comparable": signature == kv_layout_signature(rank.kv_args),
            "checksum_matches": rank.digest(suffix) == expected,
            "verify_checksum": bool(rank.mgr.should_verify_kv_checksum(f"127.0.0.1:{rank.a.port}"))}


def run_bootstrap(a) -> None:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server_args_of(a)
    server = get_kv_class(TransferBackend(a.backend), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=a.port)
    emit("READY", role="bootstrap", cls=type(server).__name__)
    time.sleep(a.timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode", "bootstrap"], required=True)
    p.add_argument("--backend", default="kvferry")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--gloo-port", type=int, default=0)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1, help="attention DP groups among the TP ranks")
    p.add_argument("--load-balance", default="auto", help="the prefill's --load-balance-method")
    p.add_argument("--pool", choices=["mha", "mla"], default="mha")
    p.add_argument("--draft", action="store_true")
    p.add_argument("--state", choices=["", "swa", "mamba", "dsa", "mxfp8"], default="",
                   help="SGLang state beside the KV: a sliding-window or a Mamba hybrid's pool (MHA), "
                        "DeepSeek's sparse attention (MLA, --page-size 64), MXFP8 block scales (--head-dim 32)")
    p.add_argument("--scenario", default="main")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--poll-interval-s", type=float, default=0.005, help="scheduler loop sleep")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4, help="the model's KV heads (MHA)")
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--page-size", type=int, default=PAGE_SIZE)
    p.add_argument("--pool-pages", type=int, default=64, help="pages per pool (page 0 is SGLang's padding)")
    p.add_argument("--model-dir", default="", help="a config.json-only model (SGLang's own backends)")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--kv-checksum", action="store_true", help="MetadataBuffers with the KV checksum row")
    p.add_argument("--http-port", type=int, default=0, help="the server's HTTP port (ServerArgs.port); the "
                   "rebootstrap scenario's prefill serves its stand-in /generate there")
    p.add_argument("--recompute-timeout", type=float, default=0.0, help="decode: the bound of a rebootstrap's "
                   "POST /generate (0: the manager's, SGLang's waiting timeout)")
    a = p.parse_args(argv)
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as every SGLang process does: registers the kvferry backend
    runs = {"prefill": run_prefill, "decode": run_decode, "bootstrap": run_bootstrap}
    if a.scenario == "rebootstrap" and a.role != "bootstrap":
        from tests.engines.sglang import rebootstrap

        runs = {"prefill": rebootstrap.run_prefill, "decode": rebootstrap.run_decode}
    runs[a.role](a)
    sys.stdout.flush()
    os._exit(0)  # do not wait for engine threads


if __name__ == "__main__":
    sys.exit(main())
