"""The benchmark's workloads: pool shapes, prompt lengths, concurrency and
page placement, and the pool geometry the raw baselines need."""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.pages import DTYPE_BYTES
from harness.workload import PoolSpec, Spec

PAGE_SIZE = 16
MODELS = {
    # Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16: 128 KiB per token.
    "llama8b": PoolSpec(role="target", attention="mha", num_layers=32, total_heads=8, head_dim=128),
    # DeepSeek-V3-like MLA: 61 layers of a 576-element latent (512 + 64 rope), bf16.
    "deepseek": PoolSpec(role="target", attention="mla", num_layers=61, total_heads=1, head_dim=576),
}
DRAFT = PoolSpec(role="draft", attention="mha", num_layers=1, total_heads=8, head_dim=128)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    tokens: int
    concurrency: int
    requests: int
    placement: str = "contiguous"
    prefill_tp: int = 1
    decode_tp: int = 1
    draft: bool = False
    layout: str = "nhd"
    device: str = "cpu"  # the pools' device (--pool-device): cpu, cuda, cuda:N

    def spec(self) -> Spec:
        target = replace(MODELS[self.model], page_layout=self.layout if self.model == "llama8b" else "nhd")
        pools = (target, replace(DRAFT, page_layout=self.layout)) if self.draft else (target,)
        pages = -(-self.tokens // PAGE_SIZE)
        return Spec(bootstrap="", prefill_pools=pools, decode_pools=pools, prefill_tp=self.prefill_tp,
                    decode_tp=self.decode_tp, page_size=PAGE_SIZE, prefill_pages=max(2 * pages, 64),
                    decode_pages=(self.concurrency + 1) * pages + 8, aux_slots=128,
                    num_rooms=self.requests + 1, warmup_rooms=1, concurrency=self.concurrency,
                    min_tokens=self.tokens, max_tokens=self.tokens, page_placement=self.placement,
                    fill="constant", touch_staging=True, verify=False, timeout_s=600, device=self.device)

    def request_bytes(self) -> int:
        pools = self.spec().decode_pools
        per_token = sum(p.num_layers * (2 * p.total_heads if p.attention == "mha" else 1) * p.head_dim * 2
                        for p in pools)
        return -(-self.tokens // PAGE_SIZE) * PAGE_SIZE * per_token

    @property
    def has_same_pages_baseline(self) -> bool:
        """Scattered pages between one prefill and one decode rank: the raw
        same-pages baseline applies (head slices of hetero TP do not)."""
        return self.placement == "scattered" and self.prefill_tp == self.decode_tp == 1

    def page_buffers(self) -> tuple[int, ...]:
        """Bytes of one page of each pool buffer, in kvferry's order (pool,
        layer, K then V or the latent), for one TP rank holding every head."""
        out: list[int] = []
        for p in self.spec().decode_pools:
            heads, components = (p.total_heads, 2) if p.attention == "mha" else (1, 1)
            out += [PAGE_SIZE * heads * p.head_dim * DTYPE_BYTES[p.dtype]] * (p.num_layers * components)
        return tuple(out)


QUICK = [
    Workload("mha-128", "llama8b", 128, 1, 60),
    Workload("mha-8k-contig", "llama8b", 8192, 1, 3),
    Workload("mha-8k-scatter", "llama8b", 8192, 1, 3, placement="scattered"),
]
FULL = QUICK + [
    Workload("mha-128-c64", "llama8b", 128, 64, 256, placement="scattered"),
    Workload("mha-2k-c8", "llama8b", 2048, 8, 32, placement="scattered"),
    Workload("mha-32k-contig", "llama8b", 32768, 1, 2),
    Workload("mha-32k-scatter", "llama8b", 32768, 1, 2, placement="scattered"),
    Workload("mla-8k-contig", "deepseek", 8192, 1, 3),
    Workload("mla-8k-scatter", "deepseek", 8192, 1, 3, placement="scattered"),
    Workload("mha-8k-tp2to1-hnd", "llama8b", 8192, 1, 3, prefill_tp=2, layout="hnd"),
    Workload("mha+draft-8k", "llama8b", 8192, 1, 3, draft=True),
]
