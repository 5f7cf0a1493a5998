"""What the prefill and decode node scripts share: their command-line flags,
the requests both derive from the same flags, the aux row, the manager
config, and the result line.

Both nodes take the same ``--prompt-seed``, ``--prompt-lengths`` and
``--first-room``: request ``i`` is room ``first_room + i`` with a seeded
random prompt of ``lengths[i]`` tokens (``--only-requests`` serves some of
them, the same prompts and rooms). The prefill node computes its KV; the
decode node knows each room's prompt length (to allocate pages) and, with a
storage tier (``--storage``), its tokens, which name its pages in storage;
generation never reads them: it continues from the KV it receives and the
first generated token in the aux row.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, replace

import torch

from examples.tiny_models import ModelPair
from transfer import EngineConfig, ManagerConfig, Role, manager_config_from_env

#: Aux row per request slot, int64: the first generated token and the prompt length.
AUX_FIRST_TOKEN, AUX_PROMPT_TOKENS, AUX_COLUMNS = 0, 1, 4
AUX_SLOTS = 64
RESULT_PREFIX = "RESULT "
#: The models' name in storage keys (ManagerConfig.model_name); the weights' seed is appended.
MODEL_NAME = "tiny-mla+gqa"


@dataclass(frozen=True)
class Request:
    room: int
    prompt: torch.Tensor  # [num_tokens] token ids

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.numel()

    @property
    def aux_slot(self) -> int:
        return self.room % AUX_SLOTS


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return lengths


def parse_indices(text: str) -> list[int]:
    try:
        indices = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated request indices, got {text!r}") from None
    if not indices or min(indices) < 0:
        raise argparse.ArgumentTypeError(f"expected request indices >= 0, got {text!r}")
    return indices


def add_node_args(ap: argparse.ArgumentParser) -> None:
    """The flags both nodes take (give both the same values where marked)."""
    net = ap.add_argument_group("network")
    net.add_argument("--bootstrap", default="127.0.0.1:8998", metavar="HOST:PORT",
                     help="the bootstrap server (default %(default)s)")
    net.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                     help="this node's address as the other node reaches it: its control socket binds it "
                          "(default %(default)s)")
    net.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"],
                     help="Mooncake transport: rdma between hosts with RDMA NICs, tcp elsewhere (default %(default)s)")
    net.add_argument("--hostname", default=None, metavar="ADDR",
                     help="address the transfer engine advertises (default: --host)")
    net.add_argument("--device", default="", metavar="NIC",
                     help="RDMA NIC(s) for --protocol rdma, e.g. mlx5_0 (default: the engine picks)")
    net.add_argument("--node-id", default="prefill",
                     help="the prefill node's name at the bootstrap server (same on both nodes)")
    net.add_argument("--timeout-s", type=float, default=60.0,
                     help="longest wait for the other node, and for each transfer (default %(default)s)")
    kv = ap.add_argument_group("model, KV pools and requests (the same on both nodes, --num-pages aside)")
    kv.add_argument("--model-seed", type=int, default=0, help="seed of the tiny models' weights")
    kv.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default %(default)s)")
    kv.add_argument("--num-pages", type=int, default=256,
                    help="pages per pool on this node (may differ between nodes; default %(default)s)")
    kv.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompts' tokens")
    kv.add_argument("--prompt-lengths", type=parse_lengths, default="20,77,128,200,300", metavar="N,N,...",
                    help="one request per length, in tokens (default %(default)s)")
    kv.add_argument("--first-room", type=int, default=1000,
                    help="bootstrap room of the first request; request i is room first_room + i")
    kv.add_argument("--only-requests", type=parse_indices, default=None, metavar="I,J,...",
                    help="serve only these requests, by index into --prompt-lengths (the others' prompts are "
                         "still drawn, so prompts and rooms stay those of a run of all; default: all)")
    st = ap.add_argument_group("storage tier")
    st.add_argument("--storage", default="", metavar="URL",
                    help="the KV storage tier both nodes share, e.g. file:///shared/dir: prefill writes the full "
                         "pages it sends through to it, decode loads from it what it has (default: none)")


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's Python stack to stderr: a
    node that seems stuck says where it is (the demo's and the tests' runner
    sends it before it kills a node that outlived its time)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def check_node_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse shared flags that do not fit together (``ap.error`` exits 2)."""
    if args.only_requests is not None and max(args.only_requests) >= len(args.prompt_lengths):
        ap.error(f"--only-requests {max(args.only_requests)}: there are {len(args.prompt_lengths)} prompt lengths")


def parse_node_args(argv: list[str]) -> argparse.Namespace:
    """The shared flags alone, as both nodes would read ``argv`` (for the
    demo and tests, which derive the same requests and models)."""
    ap = argparse.ArgumentParser()
    add_node_args(ap)
    return ap.parse_args(argv)


def make_requests(args: argparse.Namespace, pair: ModelPair) -> list[Request]:
    """The requests this node serves: every prompt is drawn, in order, so
    ``--only-requests`` picks prompts and rooms exactly as in a run of all."""
    gen = torch.Generator().manual_seed(args.prompt_seed)
    requests = [Request(room=args.first_room + i, prompt=torch.randint(0, pair.vocab_size, (n,), generator=gen))
                for i, n in enumerate(args.prompt_lengths)]
    only = getattr(args, "only_requests", None)
    if only is None:
        return requests
    if max(only) >= len(requests):
        raise ValueError(f"--only-requests {max(only)}: there are {len(requests)} prompt lengths")
    return [requests[i] for i in sorted(set(only))]


def model_pair(args: argparse.Namespace) -> ModelPair:
    return ModelPair(seed=args.model_seed)


def new_aux() -> torch.Tensor:
    return torch.zeros(AUX_SLOTS, AUX_COLUMNS, dtype=torch.int64)


def storage_url(args: argparse.Namespace, role: Role = Role.DECODE) -> str:
    """The storage tier the node uses: ``--storage``, else ``KVFERRY_STORAGE_URL``; empty: none."""
    return args.storage or manager_config_from_env(role).storage_url


def model_name(args: argparse.Namespace) -> str:
    """What names the models' KV in storage: the architecture and the weights."""
    return f"{MODEL_NAME}/seed-{args.model_seed}"


def manager_config(args: argparse.Namespace, role: Role, tp_rank: int, tp_size: int, **overrides) -> ManagerConfig:
    """The flags' settings (and ``overrides``, ManagerConfig fields) over
    ``KVFERRY_*`` variables, which set the rest, e.g. ``KVFERRY_STAGING_BYTES``
    (and the storage tier's ``KVFERRY_STORAGE_*`` fields where a node has no
    flag for them)."""
    base = manager_config_from_env(role)
    engine: EngineConfig = replace(base.engine, protocol=args.protocol, hostname=args.hostname or args.host,
                                   device_name=args.device)
    return replace(base, bootstrap_addr=args.bootstrap, node_id=args.node_id, tp_rank=tp_rank, tp_size=tp_size,
                   host=args.host, engine=engine, bootstrap_timeout_s=args.timeout_s,
                   transfer_timeout_s=args.timeout_s, storage_url=storage_url(args, role),
                   model_name=model_name(args), **overrides)


def wait_until_registered(mgr, bootstrap: str, node_id: str, timeout_s: float) -> None:
    """Wait until the prefill node's first DP group is registered (a router
    sends requests only to a node that is up; a room for a node the
    bootstrap server does not know fails at once, once the server is past
    its grace time). Gives up quietly after ``timeout_s``: the rooms then
    report why."""
    from transfer.errors import BootstrapUnavailable

    deadline = time.monotonic() + timeout_s
    with mgr.bootstrap_client(bootstrap) as client:
        while time.monotonic() < deadline:
            try:
                if client.lookup(node_id, 0).ready:
                    return
            except BootstrapUnavailable:
                pass
            time.sleep(0.05)


def why_failed(room_obj) -> str:
    """The reason a KVSender or KVReceiver failed."""
    try:
        room_obj.failure_exception()
    except Exception as exc:  # the room's KVFerryError, to report
        return f"{type(exc).__name__}: {exc}"
    return "unknown"


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self._end


def print_result(result: dict) -> None:
    """The one machine-readable line a node prints (the demo and tests parse
    it), in one write: the engine's C++ threads log to stderr, which the demo
    merges into the same file, and an unbuffered ``print`` writes the line
    and its newline separately."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def exit_now(code: int) -> None:
    """Exit without interpreter teardown: every manager is closed by now, and
    each Mooncake engine's destructor holds the GIL for about a second."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
