"""A test-only KvferryConnector that corrupts one landed page of a chosen request.

The decode server of ``test_pd.py`` runs this subclass. It behaves exactly as
:class:`transfer.adapters.vllm.KvferryConnector` except for a request whose
``kv_transfer_params`` carry ``kvferry_test_corrupt`` = ``{"block": i,
"layer": j, "seed": s}``: when kvferry reports that request's KV landed
(``get_finished``, on the model-runner thread, before the step that reads
those blocks), the request's ``i``-th block of layer ``j`` (one kvferry page,
64 KiB for the test model) is overwritten with random values of the page's own
mean and spread, and the decode log says so (``kvferry-test: corrupted``).
So the test's token comparison can be shown to catch a page that came wrong.

With ``KVFERRY_TEST_DIGEST=1`` in its environment it also logs, for every
room that ended on this side (prefill: sent; decode: landed, before the step
that reads it), one digest per block over all layers: ``kvferry-test: digest
side=<prefill|decode> room=<room> blocks=<n> skip=<k> sha=<d0>,<d1>,...``
(decode's blocks before ``skip`` are its own prefix cache's), on prefill
``kvferry-test: finished request=<id> room=<room>`` when the engine finished
a request it sends (the scheduler's clock, for a failure's timeline), and with vLLM's
hybrid KV-cache manager one line per other KV-cache group (a kvferry state
pool), logged before the room's digest line: ``kvferry-test: group-digest
side=... room=... group=<g> sha=...``, a block by position, ``-`` where this
side does not hold or want it (a sliding window's freed blocks), and every
100th engine step that computed nothing (``kvferry-test: idle-steps=<n>``,
the worker's count). The test compares
prefill's and decode's digests of the same room: the bytes that moved, page by
page, in real servers.

Nothing of this is installed: vLLM loads it with ``kv_connector_module_path``
``tests.engines.vllm.corrupting`` (the repository root is on the servers'
PYTHONPATH).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

from transfer.adapters.vllm import KvferryConnector
from transfer.adapters.vllm.groups import layer_order as _layer_order

log = logging.getLogger("kvferry.vllm.test")

KEY = "kvferry_test_corrupt"

# Armed corruptions by request id, seen by the worker half of this process
# (the scheduler half may open the room on the in-process worker at once, see
# transfer.adapters.vllm.scheduler.local_worker); the step's metadata carries them too,
# for a worker in another process.
_ARMED: dict[str, Corruption] = {}


@dataclass(frozen=True)
class Corruption:
    block: int  # a vLLM block id of decode
    layer: int
    seed: int


#: the attribute of a step's metadata (either role's) that carries what to overwrite, by request id
META_KEY = "kvferry_test_corrupt"


class CorruptingKvferryConnector(KvferryConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._planned: dict[str, Corruption] = {}  # scheduler: until the next build_connector_meta
        self._armed: dict[str, Corruption] = {}  # worker: until the request's KV landed
        self._layers: list = []
        self._idle_steps = 0  # worker: steps that computed nothing

    # --- scheduler side ---------------------------------------------------------

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        spec = params.get(KEY)
        if spec and params.get("do_remote_prefill") and num_external_tokens > 0 and not self.is_producer:
            # Armed before the room opens (super() may open it at once).
            c = Corruption(block=blocks.get_block_ids()[0][int(spec["block"])], layer=int(spec.get("layer", 0)),
                           seed=int(spec.get("seed", 0)))
            self._planned[request.request_id] = _ARMED[request.request_id] = c
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished_all_groups(self, request, block_ids):
        delay, params = super().request_finished_all_groups(request, block_ids)
        if params is not None and os.environ.get("KVFERRY_TEST_DIGEST") == "1":
            # When the engine finished it, for a failure's note (harness.vllm.pd_complete):
            # the rest of the answer's way (vLLM's API server, the client) has no kvferry in it.
            log.warning("kvferry-test: finished request=%s room=%s", request.request_id, params.get("kvferry_room"))
        return delay, params

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)  # the connector's own, whatever it carries
        setattr(meta, META_KEY, self._planned)
        self._planned = {}
        return meta

    # --- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        super().register_kv_caches(kv_caches)
        self._layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_order)]
        self._group_layers = [] if self.groups is None else \
            [(g.index, [kv_caches[n] for n in sorted(g.layers, key=_layer_order)]) for g in self.groups.states]
        if os.environ.get("KVFERRY_TEST_DIGEST") == "1":
            self._specs: dict = {}  # request id -> its SendSpec or RecvSpec, until it ends
            take = self.worker.take

            def recording_take(meta):
                for spec in [*getattr(meta, "sends", ()), *getattr(meta, "recvs", ())]:
                    self._specs[spec.req_id] = spec
                return take(meta)

            self.worker.take = recording_take  # the in-process path calls the same worker object

    def start_load_kv(self, forward_context, **kwargs) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        self._armed.update(getattr(meta, META_KEY, None) or {})

    def get_finished(self, finished_req_ids: set[str]):
        if getattr(self._connector_metadata, "idle", False) and os.environ.get("KVFERRY_TEST_DIGEST") == "1":
            self._idle_steps += 1
            if self._idle_steps % 100 == 0:
                log.warning("kvferry-test: idle-steps=%d", self._idle_steps)
        sending, recving = super().get_finished(finished_req_ids)
        specs = getattr(self, "_specs", None)
        if specs is not None:
            for req_id in (sending or set()) | (recving or set()):
                spec = specs.pop(req_id, None)
                if spec is not None:
                    self._digest(spec)
        for req_id in recving or set():
            c = self._armed.pop(req_id, None)
            c = _ARMED.pop(req_id, None) or c
            if c is not None:
                self._corrupt(req_id, c)
        return sending, recving

    def _corrupt(self, req_id: str, c: Corruption) -> None:
        import torch

        page = self._layers[c.layer][c.block]
        before = page.clone()
        values = page.float()
        noise = torch.randn(page.shape, generator=torch.Generator().manual_seed(c.seed))
        page.copy_((noise * values.std() + values.mean()).to(page.dtype))
        changed = int((page != before).sum())
        log.warning("kvferry-test: corrupted block %d of layer %d for request %s (%d of %d values changed)",
                    c.block, c.layer, req_id, changed, page.numel())

    def _digest(self, spec) -> None:
        import torch

        def digest(layers, block) -> str:
            h = hashlib.sha256()
            for layer in layers:
                h.update(layer[block].contiguous().view(torch.uint8).numpy().tobytes())
            return h.hexdigest()[:16]

        side = "prefill" if self.is_producer else "decode"
        # the group lines first: a reader that waits for a room's digest line
        # (pd_servers.logged) then finds its group lines too (CI once read
        # prefill's log between the two)
        for (index, layers), items in zip(self._group_layers, spec.states):
            log.warning("kvferry-test: group-digest side=%s room=%d group=%d sha=%s", side, spec.room, index,
                        ",".join(digest(layers, b) if b >= 0 else "-" for b in items))
        log.warning("kvferry-test: digest side=%s room=%d blocks=%d skip=%d sha=%s", side, spec.room,
                    len(spec.pages), getattr(spec, "skip_pages", 0),
                    ",".join(digest(self._layers, b) for b in spec.pages))
