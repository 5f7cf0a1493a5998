"""Layer-wise streaming against whole-request sends, with a modelled GPU
prefill (issue 30): ``python -m benchmarks.layerwise [--rooms N] [--repeat K] [--out F]``.

Each room's forward pass is modelled on prefill as a wait per layer (on a
GPU the forward costs the CPU nothing): the room's layers are computed one
after another from the moment its decode request arrived, and

- ``whole``: the room is sent once its last layer is done;
- ``layerwise``: each of :data:`GROUPS` layer groups is sent (``send(...,
  layers=...)``) as soon as its last layer is done.

``--handover launch`` hands every send over when the forward starts instead,
each with a ready event that completes when its layers are due, as an engine
on a GPU launches the layers and records an event per group (vLLM's
``save_kv_layer``); the exposed transfer then counts from the last event's
completion.

Schedulers idle (each side's loop waits for kvferry's progress) or busy
(``--sched busy``: every round of both loops is :data:`BUSY_STEP_S` of
pure-Python work, an engine step holding the interpreter lock, as in the
control-plane benchmark ``benchmarks.busy``; the modelled forward's groups
are then sent at the first round after they are due, up to a step late,
where an engine on a GPU would hand them over at launch with an event).

The figure is decode's **exposed transfer time** per room (from prefill's
last ``send()``, the end of the forward, to decode's ``Success``; the
``exposed_transfer_s`` of its room stats), and the modelled TTFT: forward
plus exposed transfer; the table adds each batch's exposed transfer and
the best cut the link allows (:func:`best_cut`). With ``--repeat K`` each
cell runs K times, whole and layer-wise alternating, and the table gives the
medians (:func:`merge_runs`; each run's p50 stays in the JSON). Real
processes, the real engines (Mooncake over TCP, NIXL over UCX), real KV
sizes of the stated models; bytes not verified (the suites do that).

Per-layer compute, stated: ``c * (2 * P_layer * n + 4 * n^2 * d_attn) / F``
for ``c`` requests of ``n`` prompt tokens batched together (attention is per
request), ``P_layer`` the
active parameters of one layer, ``d_attn`` the attention width and ``F`` the
effective FLOP/s (:data:`MODELS`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from harness.launch import run_pd
from harness.workload import PoolSpec, Spec

#: name -> (pool, active parameters per layer, attention width, effective FLOP/s, what)
MODELS = {
    "llama8b": (PoolSpec(num_layers=32, total_heads=8, head_dim=128, dtype="bfloat16"), 218e6, 4096, 5e14,
                "Llama-3-8B-like (32 layers, 8 KV heads x 128, bf16: 128 KiB of KV per token) on one H100 "
                "(500 TFLOP/s effective, about half of bf16 peak)"),
    "deepseek": (PoolSpec(attention="mla", num_layers=61, total_heads=1, head_dim=576, dtype="bfloat16"), 6.1e8,
                 16384, 4e15, "DeepSeek-V3-like MLA (61 layers, a 576-value latent, bf16: 70 KiB per token, "
                 "37 B active parameters) on 8 H100s (4 PFLOP/s effective)"),
}
#: layer groups per room in the layer-wise mode
GROUPS = 8
#: a busy scheduler's step of pure-Python work (seconds)
BUSY_STEP_S = 0.010
PAGE = 16


def layer_s(model: str, tokens: int, requests: int = 1) -> float:
    """Modelled seconds of one layer's forward over ``requests`` prompts of
    ``tokens`` tokens batched together."""
    _, params, width, flops, _ = MODELS[model]
    return requests * (2 * params * tokens + 4 * tokens * tokens * width) / flops


def run_cell(model: str, tokens: int, concurrency: int, mode: str, transport: str, fence: bool,
             rooms: int, sched: str = "idle", handover: str = "due") -> dict:
    pool = MODELS[model][0]
    pages = -(-tokens // PAGE)
    per_layer = layer_s(model, tokens, concurrency)  # a batch of `concurrency` prompts computes together
    spec = Spec(bootstrap="", prefill_pools=(pool,), decode_pools=(pool,), num_rooms=rooms + 1,
                concurrency=concurrency, min_tokens=tokens, max_tokens=tokens, page_size=PAGE,
                # prefill only reads its pages: every room draws a run of one room-sized pool (so 8 concurrent
                # 8k Llama rooms fit this machine); decode writes every concurrent room into pages of its own
                prefill_pages=pages + 8, decode_pages=pages * concurrency + 8,
                page_placement="contiguous", layer_groups=GROUPS if mode == "layerwise" else 0,
                forward_layer_s=per_layer, fill="constant", verify=False, warmup_rooms=1, timeout_s=120,
                busy_step_s=BUSY_STEP_S if sched == "busy" else 0.0, forward_handover=handover)
    # every prompt streams in layer-wise mode: the cells measure the mechanism, not layerwise_min_tokens' default
    env = {"KVFERRY_WRITE_FENCE": "1" if fence else "0", "KVFERRY_BACKEND": transport,
           "KVFERRY_LAYERWISE_MIN_TOKENS": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        runs = run_pd(spec, timeout_s=600)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    decode = next(r.result for r in runs if r.role == "decode")
    if decode is None or decode["success"] != rooms + 1:
        raise RuntimeError(f"{model} {tokens} x{concurrency} {mode} {transport}: {decode and decode['failed']}")
    exposed = decode["exposed_ms"]
    forward_ms = per_layer * pool.num_layers * 1e3
    return {"model": model, "tokens": tokens, "concurrency": concurrency, "mode": mode, "transport": transport,
            "fence": fence, "sched": sched, "handover": handover, "forward_ms": round(forward_ms, 1), "exposed_p50_ms": round(statistics.median(exposed), 1),
            "exposed_max_ms": round(max(exposed), 1), "ttft_ms": round(forward_ms + statistics.median(exposed), 1),
            "gib": round(tokens * pool_bytes_per_token(pool) / 2**30, 3), "rooms": len(exposed)}


def merge_runs(runs: list[dict]) -> dict:
    """One row of a cell measured ``len(runs)`` times (rows as
    :func:`run_cell` returns them, one mode): the median of the runs' p50
    and of their slowest rooms, each run's p50 kept in ``run_p50_ms``.
    Busy schedulers on two cores move a cell's p50 by tens of percent from
    run to run; the median of a few runs says more than any one."""
    row = dict(runs[0])
    p50s = [r["exposed_p50_ms"] for r in runs]
    row["exposed_p50_ms"] = round(statistics.median(p50s), 1)
    row["exposed_max_ms"] = round(statistics.median(r["exposed_max_ms"] for r in runs), 1)
    row["ttft_ms"] = round(row["forward_ms"] + row["exposed_p50_ms"], 1)
    row["run_p50_ms"] = p50s
    row["load"] = max(r.get("load", 0.0) for r in runs)
    return row


def best_cut(whole_ms: float, forward_ms: float, groups: int = GROUPS) -> float:
    """The largest cut of a batch's exposed transfer (:func:`batch_ms`)
    that streaming can reach at the rate the whole-request send moved the
    batch (``whole_ms`` for all its bytes): at best the last group still
    crosses after the forward (``whole_ms / groups``), and what the link
    cannot move during the forward (``whole_ms - forward_ms``) is exposed
    however the rooms are streamed."""
    if whole_ms <= 0:
        return 0.0
    return 1 - max(whole_ms / groups, whole_ms - forward_ms) / whole_ms


def batch_ms(row: dict) -> float:
    """The exposed transfer of a batch's last room: the p50 where each room
    is a batch of its own, the slowest room where ``concurrency`` rooms are
    computed and sent together (the time the link took for all of them)."""
    return row["exposed_p50_ms"] if row["concurrency"] == 1 else row["exposed_max_ms"]


def cut(whole_ms: float, layerwise_ms: float) -> float:
    return 1 - layerwise_ms / whole_ms if whole_ms else 0.0


def pool_bytes_per_token(pool: PoolSpec) -> int:
    per_layer = pool.head_dim * 2 if pool.attention == "mla" else 2 * pool.total_heads * pool.head_dim * 2
    return per_layer * pool.num_layers


def table(rows: list[dict]) -> list[str]:
    """The markdown table of whole / layer-wise pairs (rows as ``main``
    writes them: each whole row followed by its layer-wise row)."""
    lines = ["| model | tokens | concurrent | transport | fence | scheduler | handover | forward ms (modelled) | "
             "exposed p50 ms whole | layer-wise | cut | batch's exposed ms whole | layer-wise | cut | best cut | "
             "TTFT ms whole | layer-wise |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for whole, lw in zip(rows[::2], rows[1::2]):
        w_batch, l_batch = batch_ms(whole), batch_ms(lw)
        lines.append(
            f"| {whole['model']} | {whole['tokens']} | {whole['concurrency']} | {whole['transport']} | "
            f"{'on' if whole['fence'] else 'off'} | {whole['sched']} | {whole.get('handover', 'due')} | {whole['forward_ms']} | "
            f"{whole['exposed_p50_ms']} | {lw['exposed_p50_ms']} | {cut(whole['exposed_p50_ms'], lw['exposed_p50_ms']):.0%} | "
            f"{w_batch} | {l_batch} | {cut(w_batch, l_batch):.0%} | {best_cut(w_batch, whole['forward_ms']):.0%} | "
            f"{whole['ttft_ms']} | {lw['ttft_ms']} |")
    return lines


CELLS = [("llama8b", 1024, 1), ("llama8b", 8192, 1), ("llama8b", 1024, 8), ("deepseek", 1024, 1),
         ("deepseek", 8192, 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rooms", type=int, default=6, help="measured rooms per cell (after one warm-up room)")
    ap.add_argument("--transports", default="mooncake,nixl")
    ap.add_argument("--fence", default="off,on")
    ap.add_argument("--sched", default="idle", help="idle, busy, or both: idle,busy")
    ap.add_argument("--cells", default="", help="model:tokens:concurrent,... (default: all of CELLS)")
    ap.add_argument("--handover", default="due", help="due, launch, or both: due,launch (see the module docstring)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each cell (whole and layer-wise alternating); the table gives their medians")
    ap.add_argument("--out", default="")
    ap.add_argument("--table", default="", metavar="JSON", help="print the table of a run's --out file and exit")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.table:
        with open(args.table) as f:
            print("\n".join(table(json.load(f)["rows"])))
        return 0
    cells = CELLS if not args.cells else \
        [(m, int(t), int(c)) for m, t, c in (cell.split(":") for cell in args.cells.split(","))]
    rows = []
    for model, tokens, conc in cells:
        for transport in args.transports.split(","):
            for fence in args.fence.split(","):
                for sched in args.sched.split(","):
                    for handover in args.handover.split(","):
                        runs: dict[str, list[dict]] = {"whole": [], "layerwise": []}
                        for _ in range(args.repeat):
                            for mode in runs:  # alternating, same cell back to back
                                row = run_cell(model, tokens, conc, mode, transport, fence == "on", args.rooms,
                                               sched, handover)
                                row["load"] = round(os.getloadavg()[0], 1)
                                runs[mode].append(row)
                                print(json.dumps(row), flush=True)
                        rows += [merge_runs(runs["whole"]), merge_runs(runs["layerwise"])]
    print("\n" + "\n".join(table(rows)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M"), "groups": GROUPS, "busy_step_s": BUSY_STEP_S,
                       "models": {k: v[4] for k, v in MODELS.items()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
