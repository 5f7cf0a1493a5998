"""The connector's scheduler half on decode, driven through vLLM's own
``Request`` the way vLLM's scheduler calls it, without servers.

vLLM's API server submits a pre-aborted copy of a decode request
(``notify_kv_transfer_request_rejected``: ``abort_immediately``, the same
``kv_transfer_params``) whenever the request ended in an error or its
client left, in case it never reached the engine. A room this decode opened
was told of its end already; the copy must not cancel it again (it did: a
second "room failed" line and a second failed room counted, for each such
request). A copy for a room never opened here does tell prefill, once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from transfer.adapters.vllm import KvferryConnector  # noqa: E402


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def params(room: int) -> dict:
    return {"do_remote_prefill": True, "kvferry_room": room, "kvferry_bootstrap_addr": "127.0.0.1:9",
            "kvferry_node": "prefill0"}


def request(req_id: str, room: int, tokens: int = 1, *, abort_immediately: bool = False) -> Request:
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params(room)})
    return Request(req_id, list(range(4, 4 + tokens)), sampling, None, abort_immediately=abort_immediately)


@pytest.fixture
def decode() -> KvferryConnector:
    config = KVTransferConfig(kv_connector="KvferryConnector", kv_connector_module_path="transfer.adapters.vllm",
                              kv_role="kv_consumer")
    return KvferryConnector(VllmConfig(kv_transfer_config=config), KVConnectorRole.SCHEDULER)


def finish(connector: KvferryConnector, req: Request, status: RequestStatus, blocks: list[int]) -> None:
    req.status = status
    assert connector.request_finished_all_groups(req, (blocks,)) == (False, None)


def test_a_failed_requests_pre_aborted_copy_does_not_cancel_the_room_again(decode):
    tokens = 2 * decode.block_size + 3  # three blocks
    real = request("cmpl-7-0-ab", 7, tokens)
    decode.on_new_request(real)
    count, is_async = decode.get_num_new_matched_tokens(real, 0)
    assert (count, is_async) == (tokens, True)
    decode.update_state_after_alloc(real, Blocks([3, 5, 9]), count)
    meta = decode.build_connector_meta(None)
    assert [(r.req_id, r.room, r.pages) for r in meta.recvs] == [("cmpl-7-0-ab", 7, (3, 5, 9))]
    # The client left while the KV was coming: vLLM finishes the request, the room is aborted ...
    finish(decode, real, RequestStatus.FINISHED_ABORTED, [3, 5, 9])
    # ... and the API server submits its pre-aborted copy (the client-facing id, fresh params).
    finish(decode, request("cmpl-7", 7, abort_immediately=True), RequestStatus.FINISHED_ABORTED, [])
    meta = decode.build_connector_meta(None)
    assert meta.aborts == ["cmpl-7-0-ab"] and meta.cancels == [] and meta.recvs == [], meta


def test_a_request_rejected_before_the_engine_tells_prefill_once(decode):
    for _ in range(2):  # the second: a repeated notice for the same room
        finish(decode, request("cmpl-8", 8, abort_immediately=True), RequestStatus.FINISHED_ABORTED, [])
    meta = decode.build_connector_meta(None)
    assert [(c.req_id, c.room) for c in meta.cancels] == [("cmpl-8", 8)] and meta.aborts == [], meta


def step(tokens: int):
    """vLLM's own SchedulerOutput of a step that schedules ``tokens`` tokens (one request's, or none)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={"r": tokens} if tokens else {}, total_num_scheduled_tokens=tokens,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=set(), free_encoder_mm_hashes=[])


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_step_that_computes_nothing_is_marked_idle_for_the_worker(role):
    """The worker may wait for a room to end only in a step that computes
    nothing (KvferryWorker.settle): either role's metadata says which, from
    vLLM's own SchedulerOutput."""
    config = KVTransferConfig(kv_connector="KvferryConnector", kv_connector_module_path="transfer.adapters.vllm",
                              kv_role=role)
    connector = KvferryConnector(VllmConfig(kv_transfer_config=config), KVConnectorRole.SCHEDULER)
    assert connector.build_connector_meta(step(0)).idle is True
    assert connector.build_connector_meta(step(17)).idle is False
