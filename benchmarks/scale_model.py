"""``python -m benchmarks.scale_model``: the model of docs/scale.md, a
96-prefill / 96-decode cluster of 8-GPU nodes, printed as Markdown.

Inputs are of three kinds, each named where it is defined: model shapes
(the published configurations of DeepSeek-V3 and Llama-3-70B), published
RDMA figures (Mooncake's 190 GB/s on 8x400 Gbps and 87 GB/s on 4x200 Gbps),
and costs measured on this machine (docs/scale.md says by which command;
override them with ``--measured JSON``). kvferry's own rules (who contacts
whom per room, staged parts, descriptor sizes) come from its code:
:mod:`transfer.tp` and the defaults of :class:`transfer.config.ManagerConfig`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace

from transfer import tp
from transfer.config import EngineConfig, ManagerConfig, Role

NODES, GPUS = 96, 8
NIC_GBPS = {"8x400 Gbps": 190e9, "4x200 Gbps": 87e9}  # published by the Mooncake project, per node
PROMPTS = (128, 1024, 4096, 32768)
PAGE_TOKENS = 16


@dataclass(frozen=True)
class Model:
    name: str
    is_mla: bool
    num_layers: int
    kv_heads: int  # 1 for MLA
    head_dim: int  # MLA: kv_lora_rank + rope dim
    dtype_bytes: int = 2

    def bytes_per_token_per_rank(self, tp_size: int) -> int:
        """KV bytes one rank holds per token (MLA: all of it on every rank)."""
        heads = 1 if self.is_mla else max(1, self.kv_heads // tp_size)
        return self.num_layers * (1 if self.is_mla else 2) * heads * self.head_dim * self.dtype_bytes


MODELS = (
    Model("DeepSeek-like MLA", True, 61, 1, 512 + 64),  # DeepSeek-V3: 61 layers, kv_lora_rank 512, rope 64
    Model("Llama-70B-like GQA", False, 80, 8, 128),  # Llama-3-70B: 80 layers, 8 KV heads of 128
)


@dataclass(frozen=True)
class Measured:
    """Costs measured on the 2-vCPU VM (docs/scale.md names the commands)."""

    prefill_cpu_ms_per_room: float = 0.93  # make scale, one-to-one (whole process, 4,096 rooms in flight)
    decode_cpu_ms_per_room: float = 0.98  # same run, byte checks included
    submit_us: float = 10.25  # transfer_submit_write, one 4 KiB call over TCP
    check_us: float = 0.47  # transfer_check_status, one call


def room_messages(model: Model, prefill_tp: int, decode_tp: int) -> tuple[int, int]:
    """(requests a prefill rank gets per room, prefill ranks a decode rank
    contacts per room): each is answered by one RoomStatus."""
    shapes = (tp.PoolShape(role="target", is_mla=model.is_mla, total_heads=model.kv_heads),)
    worst_prefill = max(tp.num_requests(p, prefill_tp, decode_tp, shapes) for p in range(prefill_tp))
    worst_decode = max(len(tp.room_routes(d, prefill_tp, decode_tp, shapes)) for d in range(decode_tp))
    return worst_prefill, worst_decode


def rows(measured: Measured, nic: str, prefill_tp: int, decode_tp: int) -> list[dict]:
    cfg, engine = ManagerConfig(role=Role.PREFILL), EngineConfig()
    node_bps = NIC_GBPS[nic]
    out = []
    for model in MODELS:
        per_rank = model.bytes_per_token_per_rank(decode_tp)  # what one decode rank receives per token
        req_p, req_d = room_messages(model, prefill_tp, decode_tp)
        for tokens in PROMPTS:
            wire = per_rank * decode_tp * tokens  # bytes a request puts on the network
            rps_node = node_bps / wire  # line rate: requests/s one prefill node can ship
            part = min(per_rank * tokens, cfg.stage_part_bytes)
            parts = math.ceil(per_rank * tokens / cfg.stage_part_bytes)
            # Per room on one decode rank: requests out + statuses in, and 3 messages per staged part.
            msgs_decode = 2 * req_d + 3 * parts
            msgs_prefill = 2 * req_p + 3 * parts * req_p
            rooms_per_rank = rps_node  # every TP rank of the node takes part in every request
            desc_per_s_nic = node_bps / GPUS / min(part, engine.max_descriptor_bytes)
            direct_desc_per_s_nic = node_bps / GPUS / (PAGE_TOKENS * per_rank / model.num_layers /
                                                       (1 if model.is_mla else 2))
            out.append(dict(
                model=model.name, tokens=tokens, wire_mb=round(wire / 1e6, 2), requests_per_s_node=round(rps_node, 1),
                rooms_per_s_rank=round(rooms_per_rank, 1),
                msgs_per_s_prefill_rank=round(rooms_per_rank * msgs_prefill),
                msgs_per_s_decode_rank=round(rooms_per_rank * msgs_decode),
                staged_parts=parts, desc_per_s_nic_staged=round(desc_per_s_nic),
                desc_per_s_nic_direct_scattered=round(direct_desc_per_s_nic),
                prefill_core=round(rooms_per_rank * measured.prefill_cpu_ms_per_room / 1e3, 2),
                decode_core=round(rooms_per_rank * measured.decode_cpu_ms_per_room / 1e3, 2),
                submit_core_staged=round(desc_per_s_nic * (measured.submit_us + measured.check_us) / 1e6, 3),
                submit_core_direct=round(direct_desc_per_s_nic * (measured.submit_us + measured.check_us) / 1e6, 2)))
    return out


def markdown(table: list[dict]) -> str:
    keys = list(table[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in table]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", help="JSON object overriding fields of Measured")
    ap.add_argument("--nic", choices=sorted(NIC_GBPS), default="8x400 Gbps")
    ap.add_argument("--prefill-tp", type=int, default=8)
    ap.add_argument("--decode-tp", type=int, default=8)
    args = ap.parse_args(argv)
    measured = replace(Measured(), **json.loads(args.measured)) if args.measured else Measured()
    print(f"inputs: {json.dumps(asdict(measured))}; {NODES}+{NODES} nodes of {GPUS} GPUs, {args.nic} per node, "
          f"prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, pages of {PAGE_TOKENS} tokens\n")
    print(markdown(rows(measured, args.nic, args.prefill_tp, args.decode_tp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
