"""``make demo``: the two-node speculative-decoding example on this host, over TCP loopback.

Starts, as separate processes, the bootstrap server, the prefill node's two
TP ranks (``examples.prefill_node``, one process each) and the decode node
(``examples.decode_node``). The prefill ranks prefill a tiny MLA target and
GQA draft and send their KV; the decode node receives it and generates with
speculative decoding. The demo then runs the same models in this single
process (target prefill and plain greedy decoding, no transfer) and prints,
per prompt, the tokens generated after the transfer beside the single-process
tokens, the KV bytes moved and the transfer time. Exits 1 unless every
process succeeded and every token matches.
"""

from __future__ import annotations

import argparse
import json
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from examples.node_common import RESULT_PREFIX, make_requests, model_pair, parse_lengths, parse_node_args
from examples.speculative import reference_tokens
from examples.tiny_models import build_models
from transfer.launch import child_env

TP_SIZE = 2


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
    try:
        proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    out.seek(0)
    log = out.read()
    out.close()
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in log.splitlines() if line.startswith(RESULT_PREFIX)]
    return NodeRun(name, proc.returncode, results[-1] if results else None, log)


class _Bootstrap:
    """``examples.bootstrap_server`` on a free port; ``address`` once it listens."""

    def __init__(self, prefix: tuple[str, ...], host: str, timeout_s: float) -> None:
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "examples.bootstrap_server", "--host", host,
                                      "--port", "0", "--log-level", "WARNING"],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=child_env())
        line = ""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout_s):
                line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.close()
            raise RuntimeError(f"the bootstrap server did not start within {timeout_s:g} s: {line!r}")
        self.address = line.split()[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()
        self._log.close()


def run_two_nodes(node_args: list[str], decode_args: list[str], *, placement: Placement = Placement(),
                  timeout_s: float = 120.0) -> list[NodeRun]:
    """Run the bootstrap server, prefill ranks 0..1 and the decode node to the
    end (killing what outlives ``timeout_s``). ``node_args`` go to both
    nodes, ``decode_args`` to the decode node only."""
    bootstrap = _Bootstrap(placement.prefill_prefix, placement.prefill_host, timeout_s=30)
    try:
        shared = ["--bootstrap", bootstrap.address, *node_args]
        procs = [_start(f"prefill rank {rank}",
                        [*placement.prefill_prefix, sys.executable, "-m", "examples.prefill_node",
                         "--tp-rank", str(rank), "--tp-size", str(TP_SIZE), "--host", placement.prefill_host,
                         *shared])
                 for rank in range(TP_SIZE)]
        procs.append(_start("decode", [*placement.decode_prefix, sys.executable, "-m", "examples.decode_node",
                                       "--host", placement.decode_host, *shared, *decode_args]))
        deadline = time.monotonic() + timeout_s
        return [_finish(name, proc, out, deadline) for name, proc, out in procs]
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
        print(f"room {room['room']}: prompt of {room['prompt_tokens']} tokens, {room['pages']} pages, "
              f"{room['kv_bytes']:,} KV bytes landed {room['transfer_ms']:.1f} ms after the request; "
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.two_node_demo", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lengths", type=parse_lengths, default="20,77,128,200,300", metavar="N,N,...",
                    help="one request per length, in tokens (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="tokens per request (default %(default)s)")
    ap.add_argument("--num-draft", type=int, default=3, help="draft tokens per speculative step (default %(default)s)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default %(default)s)")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"], help="engine transport (default %(default)s)")
    ap.add_argument("--timeout-s", type=float, default=120.0,
                    help="longest the whole run may take (default %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write every node's result and the reference tokens here")
    args = ap.parse_args(argv)
    lengths = ",".join(map(str, args.prompt_lengths))
    node_argv = ["--protocol", args.protocol, "--page-size", str(args.page_size), "--prompt-lengths", lengths,
                 "--timeout-s", str(min(60.0, args.timeout_s / 2))]
    print(f"kvferry two-node demo: prefill node (TP {TP_SIZE}, two processes) -> decode node (TP 1), "
          f"{args.protocol.upper()} loopback; tiny DeepSeek-style MLA target + Llama-style GQA draft; "
          f"prompts of {lengths} tokens, page size {args.page_size}", flush=True)
    started = time.monotonic()
    decode_argv = ["--max-new-tokens", str(args.max_new_tokens), "--num-draft", str(args.num_draft)]
    runs = run_two_nodes(node_argv, decode_argv, timeout_s=args.timeout_s)
    wall_s = time.monotonic() - started
    # The single-process run, of the models and requests the nodes derived from the same flags.
    node = parse_node_args(node_argv)
    pair = model_pair(node)
    target, _ = build_models(pair)
    reference = reference_tokens(target, [r.prompt for r in make_requests(node, pair)], args.max_new_tokens,
                                 node.page_size)
    ok = _print_report(node.first_room, runs, reference, wall_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": ok, "reference": reference,
                       "nodes": [{"name": r.name, "returncode": r.returncode, "result": r.result} for r in runs]}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
