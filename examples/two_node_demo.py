"""``make demo``: the two-node speculative-decoding example on this host, over TCP loopback.

Starts, as separate processes, the bootstrap server, the prefill node's two
TP ranks (``examples.prefill_node``, one process each) and the decode node
(``examples.decode_node``). The prefill ranks prefill a tiny MLA target and
GQA draft and send their KV; the decode node receives it and generates with
speculative decoding. The demo then runs the same models in this single
process (target prefill and plain greedy decoding, no transfer) and prints,
per prompt, the tokens generated after the transfer beside the single-process
tokens, the KV bytes moved and the transfer time.

Then the storage step, with a temporary file store (``file://DIR``) that
both nodes share, on the demo's prompts and one more of four full pages:

- write-through and prefetch: the nodes run the prompts once, the prefill
  node writing the full pages it sends (both pools) and the aux rows through
  to the store; then new prefill and decode processes run the same prompts
  again: the decode node loads the full pages from the store and the prefill
  node sends only the partly filled last pages and the aux rows;
- fallback: new processes again, for the prompts that fill their pages
  exactly; the prefill node waits (``--send-delay-s``) once the decode
  node's requests reached it, the demo kills it (SIGKILL), and the decode
  node, finding it dead, restores the rooms from the store.

Both steps' tokens are checked against the single-process run. Exits 1
unless every process succeeded (the killed one aside), every token matches
and the storage step showed both behaviours.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from examples.node_common import RESULT_PREFIX, make_requests, model_pair, parse_lengths, parse_node_args
from examples.speculative import reference_tokens
from examples.tiny_models import build_models
from transfer import Role, manager_config_from_env
from harness.launch import BootstrapProcess, child_env, collect

TP_SIZE = 2
# The storage step's prefill node runs TP 1, as the decode node: the storage
# keys of a GQA (MHA) pool name its TP head slice, so a decode node finds
# draft pages only where a prefill node of its own TP size wrote them.
STORAGE_TP_SIZE = 1
# How long the fallback's prefill node waits before sending: the demo kills it well before.
FALLBACK_SEND_DELAY_S = 30.0
ASKED = "the decode node asked for it"  # what prefill_node prints when a room's requests arrived (--send-delay-s)


@dataclass(frozen=True)
class Placement:
    """Where the nodes run: each node's address, and a command prefix that
    puts a node's processes on its host (e.g. ``ip netns exec NS``). The
    bootstrap server runs beside the prefill node."""

    prefill_host: str = "127.0.0.1"
    decode_host: str = "127.0.0.1"
    prefill_prefix: tuple[str, ...] = ()
    decode_prefix: tuple[str, ...] = ()


@dataclass
class NodeRun:
    name: str
    returncode: int | None
    result: dict | None  # the node's RESULT line
    log: str


def _start(name: str, command: list[str]) -> tuple[str, subprocess.Popen, tempfile.TemporaryFile]:
    out = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=child_env())
    return name, proc, out


def _finish(name: str, proc: subprocess.Popen, out, deadline: float) -> NodeRun:
    log = collect(proc, out, deadline, dump_first=True)
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in log.splitlines() if line.startswith(RESULT_PREFIX)]
    return NodeRun(name, proc.returncode, results[-1] if results else None, log)


def _log_so_far(out) -> str:
    out.seek(0)
    return out.read()


def _start_nodes(bootstrap: BootstrapProcess, node_args: list[str], decode_args: list[str], prefill_args: list[str],
                 placement: Placement, tp_size: int) -> list[tuple[str, subprocess.Popen, tempfile.TemporaryFile]]:
    """Prefill ranks 0..tp_size-1, then the decode node."""
    shared = ["--bootstrap", bootstrap.address, *node_args]
    procs = [_start(f"prefill rank {rank}",
                    [*placement.prefill_prefix, sys.executable, "-m", "examples.prefill_node",
                     "--tp-rank", str(rank), "--tp-size", str(tp_size), "--host", placement.prefill_host,
                     *shared, *prefill_args])
             for rank in range(tp_size)]
    procs.append(_start("decode", [*placement.decode_prefix, sys.executable, "-m", "examples.decode_node",
                                   "--host", placement.decode_host, *shared, *decode_args]))
    return procs


def run_two_nodes(node_args: list[str], decode_args: list[str], *, prefill_args: list[str] = (),
                  tp_size: int = TP_SIZE, placement: Placement = Placement(),
                  timeout_s: float = 120.0) -> list[NodeRun]:
    """Run the bootstrap server, prefill ranks 0..tp_size-1 and the decode
    node to the end (killing what outlives ``timeout_s``). ``node_args`` go
    to both nodes, ``decode_args`` to the decode node only, ``prefill_args``
    to the prefill ranks only."""
    bootstrap = BootstrapProcess(placement.prefill_host, 30, prefix=placement.prefill_prefix,
                                 module="examples.bootstrap_server")
    try:
        procs = _start_nodes(bootstrap, node_args, decode_args, list(prefill_args), placement, tp_size)
        deadline = time.monotonic() + timeout_s
        return [_finish(name, proc, out, deadline) for name, proc, out in procs]
    finally:
        bootstrap.close()


@dataclass
class KilledRun:
    runs: list[NodeRun]  # the prefill ranks (killed), then the decode node
    killed_at: float | None  # time.time() of the SIGKILL; None: the prefill node never got every request
    sent_before_kill: bool  # a prefill rank had sent a room before it was killed


def run_killing_prefill(node_args: list[str], decode_args: list[str], num_rooms: int, *,
                        tp_size: int = STORAGE_TP_SIZE, placement: Placement = Placement(),
                        timeout_s: float = 120.0) -> KilledRun:
    """Run the nodes with the prefill ranks holding each room back
    (``--send-delay-s``) once the decode node's requests for it arrived; as
    soon as every rank has all ``num_rooms`` requests, kill the ranks
    (SIGKILL), then let the decode node run to its end."""
    bootstrap = BootstrapProcess(placement.prefill_host, 30, prefix=placement.prefill_prefix,
                                 module="examples.bootstrap_server")
    try:
        procs = _start_nodes(bootstrap, node_args, decode_args, ["--send-delay-s", str(FALLBACK_SEND_DELAY_S)],
                             placement, tp_size)
        deadline = time.monotonic() + timeout_s
        prefill, killed_at, sent = procs[:-1], None, False
        while time.monotonic() < deadline and all(proc.poll() is None for _, proc, _ in procs):
            logs = [_log_so_far(out) for _, _, out in prefill]
            if all(log.count(ASKED) >= num_rooms for log in logs):
                for _, proc, _ in prefill:
                    os.kill(proc.pid, signal.SIGKILL)
                killed_at = time.time()
                sent = any(" sent: " in log for log in logs)
                break
            time.sleep(0.02)
        if killed_at is None:  # no moment to kill it came: stop it now rather than wait out its send delay
            for _, proc, _ in prefill:
                if proc.poll() is None:
                    proc.kill()
        runs = [_finish(name, proc, out, deadline) for name, proc, out in procs]
        return KilledRun(runs, killed_at, sent)
    finally:
        bootstrap.close()


def _print_report(first_room: int, runs: list[NodeRun], reference: list[list[int]], wall_s: float) -> bool:
    decode = runs[-1].result
    ok = all(r.returncode == 0 and r.result is not None for r in runs)
    for r in runs:
        if r.returncode != 0 or r.result is None:
            print(f"FAILED: {r.name} exited {r.returncode}; its output ends with:\n{r.log[-3000:]}", file=sys.stderr)
    if decode is None:
        return False
    rooms = {room["room"]: room for room in decode["rooms"]}
    matched = 0
    for i, want in enumerate(reference):
        room = rooms.get(first_room + i)
        if room is None:
            print(f"room {first_room + i}: no tokens from the decode node")
            continue
        same = room["tokens"] == want
        matched += same
        exposed = "" if room.get("exposed_ms") is None else \
            f" ({room['exposed_ms']:.1f} ms after prefill's last send: the exposed transfer)"
        print(f"room {room['room']}: prompt of {room['prompt_tokens']} tokens, {room['pages']} pages, "
              f"{room['kv_bytes']:,} KV bytes landed {room['transfer_ms']:.1f} ms after the request{exposed}; "
              f"{room['accepted']} of {room['proposed']} draft tokens accepted")
        print(f"  after transfer  {' '.join(map(str, room['tokens']))}")
        print(f"  single process  {' '.join(map(str, want))}  {'(same)' if same else '(DIFFERENT)'}")
    prefill_bytes = sum(r.result["bytes_sent"] for r in runs[:-1] if r.result is not None)
    total_kv = decode["kv_bytes"]
    proposed = sum(room["proposed"] for room in rooms.values())
    accepted = sum(room["accepted"] for room in rooms.values())
    print(f"tokens            {matched} of {len(reference)} prompts: the decode node's tokens equal the "
          "single-process run's")
    print(f"KV moved          {total_kv:,} bytes (+ {decode['aux_bytes']} aux bytes) into the decode pools; "
          f"the prefill ranks' engines wrote {prefill_bytes:,}")
    bootstrap_ms = min((room["bootstrap_ms"] for room in rooms.values()), default=0.0)
    print(f"transfer time     {decode['transfer_s'] * 1e3:.1f} ms from the first request to the last Success "
          f"({bootstrap_ms:.0f} ms of it waiting for, looking up and handshaking the prefill node)")
    print(f"speculative       {accepted} of {proposed} draft tokens accepted "
          f"({sum(room['target_steps'] + 1 for room in rooms.values())} target steps for "
          f"{sum(len(room['tokens']) for room in rooms.values())} tokens)")
    print(f"wall time         {wall_s:.1f} s including process start-up")
    return ok and matched == len(reference)


def _reference(node_argv: list[str], max_new_tokens: int) -> list[list[int]]:
    """The single-process run, of the models and requests the nodes derive from the same flags."""
    node = parse_node_args(node_argv)
    pair = model_pair(node)
    target, _ = build_models(pair)
    return reference_tokens(target, [r.prompt for r in make_requests(node, pair)], max_new_tokens, node.page_size)


def _nodes_json(runs: list[NodeRun]) -> list[dict]:
    return [{"name": r.name, "returncode": r.returncode, "result": r.result} for r in runs]


def _report_failures(runs: list[NodeRun], what: str) -> bool:
    ok = True
    for r in runs:
        if r.returncode != 0 or r.result is None:
            ok = False
            print(f"FAILED: {what}: {r.name} exited {r.returncode}; its output ends with:\n{r.log[-3000:]}",
                  file=sys.stderr)
    return ok


def _rooms(run: NodeRun) -> dict[int, dict]:
    return {room["room"]: room for room in (run.result or {}).get("rooms", [])}


def _same(room: dict | None, want: list[int]) -> str:
    if room is None:
        return "no tokens from the decode node"
    return "tokens same as the single-process run" if room["tokens"] == want else \
        "tokens DIFFERENT from the single-process run"


def _prefetch_report(runs: list[list[NodeRun]], lengths: list[int], page_size: int, first_room: int,
                     reference: list[list[int]]) -> tuple[bool, dict]:
    """Run 1 wrote through, run 2 loaded the full pages and got the rest sent."""
    ok = all([_report_failures(r, f"storage run {i + 1}") for i, r in enumerate(runs)])
    first, second = (_rooms(r[-1]) for r in runs)
    written = sum(r.result["storage_pages_written"] for r in runs[0][:-1] if r.result)
    full_pages = sum(n // page_size for n in lengths)
    ok &= written == 2 * full_pages
    print(f"write-through     run 1: the prefill node sent every page and wrote {written} full pages through to the "
          f"store ({full_pages} of the target's, {full_pages} of the draft's) and the aux rows"
          + ("" if written == 2 * full_pages else f" (EXPECTED {2 * full_pages} pages written)"), flush=True)
    rooms = []
    for i, (n, want) in enumerate(zip(lengths, reference)):
        a, b = first.get(first_room + i), second.get(first_room + i)
        if a is None or b is None:
            ok = False
            print(f"room {first_room + i}: {_same(None, want)} in run {1 if a is None else 2}")
            continue
        expect = n // page_size  # every full page; the partly filled last one is never stored
        ok &= b["pages_from_storage"] == expect and a["tokens"] == b["tokens"] == want
        print(f"room {b['room']}: {b['pages_from_storage']} of {b['pages']} pages from storage, "
              f"{b['network_kv_bytes']:,} KV bytes over the network (first run: {a['network_kv_bytes']:,}); "
              f"{_same(b, want)}" + ("" if a["tokens"] == want else f" (run 1: {_same(a, want)})")
              + ("" if b["pages_from_storage"] == expect else f" (EXPECTED {expect} pages from storage)"))
        rooms.append(dict(room=b["room"], prompt_tokens=n, pages=b["pages"], full_pages=expect,
                          pages_from_storage=b["pages_from_storage"], network_kv_bytes=b["network_kv_bytes"],
                          first_pages_from_storage=a["pages_from_storage"],
                          first_network_kv_bytes=a["network_kv_bytes"], same_tokens=a["tokens"] == b["tokens"] == want))
    engine = [sum(r.result["bytes_sent"] for r in run[:-1] if r.result) for run in runs]
    network = [sum(room["network_kv_bytes"] for room in _rooms(run[-1]).values()) for run in runs]
    # The aux rows go through the engine only to an unfenced decode node (else in RoomStatus).
    fenced = [bool((run[-1].result or {}).get("fenced")) for run in runs]
    aux = [0 if f else (run[-1].result or {}).get("aux_bytes", 0) for f, run in zip(fenced, runs)]
    from_storage = sum(room["pages_from_storage"] for room in rooms)
    # What the decode node counts as sent is what the prefill node's engine wrote, aux rows aside.
    ok &= all(e == n + x for e, n, x in zip(engine, network, aux))
    ok &= from_storage > 0 and network[1] < network[0]
    print(f"prefetch          run 2 (new processes, same prompts): {from_storage} of "
          f"{sum(room['pages'] for room in rooms)} pages from storage; the prefill node's engine wrote "
          f"{engine[1]:,} bytes, the partly filled last pages" + (" (the aux rows travelled in RoomStatus: the "
          "write fence)" if fenced[1] else f" and {len(rooms)} aux rows") + f" (first run: {engine[0]:,})",
          flush=True)
    return ok, {"runs": [_nodes_json(r) for r in runs], "rooms": rooms, "prefill_engine_bytes": engine,
                "network_kv_bytes": network}


def _fallback_report(killed: KilledRun, rooms_asked: list[int], reference: list[list[int]], first_room: int,
                     peer_timeout_s: float) -> tuple[bool, dict]:
    """The prefill node was killed holding the requests; the decode node restored the rooms."""
    decode = killed.runs[-1]
    ok = killed.killed_at is not None and not killed.sent_before_kill
    ok &= _report_failures([decode], "storage fallback")
    if killed.killed_at is None:
        print("FAILED: storage fallback: the prefill node did not get every request; its output ends with:\n"
              + "\n".join(r.log[-2000:] for r in killed.runs[:-1]), file=sys.stderr)
    else:
        print(f"fallback          the prefill node got the decode node's requests for rooms "
              f"{', '.join(str(first_room + i) for i in rooms_asked)} and was killed (SIGKILL) before sending "
              f"anything{' (it HAD sent some)' if killed.sent_before_kill else ''}; the decode node's prefetch is "
              "off, so it had asked for every page", flush=True)
    restored, got = [], _rooms(decode)
    for i in rooms_asked:
        want, room = reference[i], got.get(first_room + i)
        if room is None:
            ok = False
            why = dict(decode.result["failed"]).get(first_room + i, "?") if decode.result else "no result"
            print(f"room {first_room + i}: NOT restored: {why}")
            continue
        after = room["ended_at"] - killed.killed_at if killed.killed_at is not None else float("nan")
        ok &= room["restored_pages"] == room["pages"] and room["tokens"] == want
        print(f"room {room['room']}: prompt of {room['prompt_tokens']} tokens, {room['restored_pages']} of "
              f"{room['pages']} pages and the aux row restored from storage {after:.1f} s after the kill; "
              f"{_same(room, want)}")
        restored.append(dict(room=room["room"], prompt_tokens=room["prompt_tokens"], pages=room["pages"],
                             restored_pages=room["restored_pages"], pages_from_storage=room["pages_from_storage"],
                             after_kill_s=after, same_tokens=room["tokens"] == want))
    if restored:
        print(f"restore time      {max(r['after_kill_s'] for r in restored):.1f} s from the kill to the last room "
              f"restored: the decode node takes a prefill node silent for peer_timeout_s ({peer_timeout_s:g} s) for "
              "dead, then loads the rooms' pages from the store", flush=True)
    ok &= len(restored) == len(rooms_asked)
    return ok, {"ok": ok, "rooms_requested": [first_room + i for i in rooms_asked], "killed_at": killed.killed_at,
                "sent_before_kill": killed.sent_before_kill, "peer_timeout_s": peer_timeout_s, "rooms": restored,
                "nodes": _nodes_json(killed.runs)}


def storage_step(node_argv: list[str], decode_argv: list[str], *, lengths: list[int], page_size: int,
                 first_room: int, max_new_tokens: int, timeout_s: float) -> tuple[bool, dict]:
    """Write-through then prefetch, then the fallback, with a temporary file
    store both nodes share; prints a report, returns (ok, the data)."""
    aligned = [i for i, n in enumerate(lengths) if n % page_size == 0]  # the rooms the fallback can restore
    peer_timeout_s = manager_config_from_env(Role.DECODE).peer_timeout_s
    with tempfile.TemporaryDirectory(prefix="kvferry-demo-store-") as store:
        url = f"file://{store}"
        node_argv = [*node_argv, "--prompt-lengths", ",".join(map(str, lengths)), "--storage", url]
        print(f"\nstorage step: a file store both nodes share ({url}); prefill TP {STORAGE_TP_SIZE} -> decode TP 1 "
              f"(the draft's GQA pages are stored per TP head slice, so the decode node finds those a prefill node of "
              f"its TP size wrote); prompts of {','.join(map(str, lengths))} tokens", flush=True)
        reference = _reference(node_argv, max_new_tokens)
        runs = [run_two_nodes(node_argv, decode_argv, tp_size=STORAGE_TP_SIZE, timeout_s=timeout_s)
                for _ in range(2)]
        ok, data = _prefetch_report(runs, lengths, page_size, first_room, reference)
        killed = run_killing_prefill(node_argv, [*decode_argv, "--storage-prefetch", "off", "--only-requests",
                                                 ",".join(map(str, aligned))], len(aligned), timeout_s=timeout_s)
        fallback_ok, data["fallback"] = _fallback_report(killed, aligned, reference, first_room, peer_timeout_s)
    ok &= fallback_ok
    return ok, {"ok": ok, "url": url, "prompt_lengths": lengths, "reference": reference, **data}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.two_node_demo", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lengths", type=parse_lengths, default="20,77,128,200,300", metavar="N,N,...",
                    help="one request per length, in tokens (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="tokens per request (default %(default)s)")
    ap.add_argument("--num-draft", type=int, default=3, help="draft tokens per speculative step (default %(default)s)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default %(default)s)")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"], help="engine transport (default %(default)s)")
    ap.add_argument("--timeout-s", type=float, default=120.0,
                    help="longest each run of the nodes may take (default %(default)s)")
    ap.add_argument("--only", choices=["transfer", "storage"],
                    help="run one step alone: the transfer, or the storage step (default: both)")
    ap.add_argument("--json", metavar="PATH", help="also write every node's result and the reference tokens here")
    args = ap.parse_args(argv)
    lengths = ",".join(map(str, args.prompt_lengths))
    node_argv = ["--protocol", args.protocol, "--page-size", str(args.page_size), "--prompt-lengths", lengths,
                 "--timeout-s", str(min(60.0, args.timeout_s / 2))]
    decode_argv = ["--max-new-tokens", str(args.max_new_tokens), "--num-draft", str(args.num_draft)]
    out, ok = {}, True
    if args.only != "storage":
        print(f"kvferry two-node demo: prefill node (TP {TP_SIZE}, two processes) -> decode node (TP 1), "
              f"{args.protocol.upper()} loopback; tiny DeepSeek-style MLA target + Llama-style GQA draft; "
              f"prompts of {lengths} tokens, page size {args.page_size}", flush=True)
        started = time.monotonic()
        runs = run_two_nodes(node_argv, decode_argv, timeout_s=args.timeout_s)
        wall_s = time.monotonic() - started
        node = parse_node_args(node_argv)
        reference = _reference(node_argv, args.max_new_tokens)
        ok = _print_report(node.first_room, runs, reference, wall_s)
        out.update(ok=ok, reference=reference, nodes=_nodes_json(runs))
    if args.only != "transfer":
        started = time.monotonic()
        # The demo's prompts, and one more of four full pages: two that fill their pages (128 and 64 tokens by
        # default) for the fallback, which restores only such prompts (a partly filled page is never stored).
        storage_ok, out["storage"] = storage_step(
            node_argv, decode_argv, lengths=[*args.prompt_lengths, 4 * args.page_size], page_size=args.page_size,
            first_room=parse_node_args(node_argv).first_room, max_new_tokens=args.max_new_tokens,
            timeout_s=args.timeout_s)
        print(f"storage           {'both behaviours shown' if storage_ok else 'FAILED'}: pages the store has are "
              f"not sent again, and a room whose prefill node died is restored from the store; "
              f"{time.monotonic() - started:.1f} s", flush=True)
        ok &= storage_ok
        out["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
