"""kvferry's plugin hands SGLang's prompt to its sender and receiver
(``transfer/adapters/sglang/prompts.py`` and ``plugin.py``), through SGLang 0.5.23's own hook
registry and its own decode queue method; the whole path (write-through, a
room restored after its prefill was killed) runs on real servers in
``tests/engines/sglang_server/test_hicache_server.py``."""

from __future__ import annotations

import pkgutil
import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from transfer.adapters.sglang import plugin  # noqa: E402
from transfer.adapters.sglang.prompts import RECEIVER_TARGET, SENDER_TARGET, prompt_of_room  # noqa: E402


@pytest.fixture(scope="module")
def hooked():
    """SGLang's hook registry with kvferry's plugin registered and applied."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from transfer.adapters.sglang import register

    register()
    HookRegistry.apply_hooks()
    return HookRegistry


def test_both_targets_exist_in_this_sglang_and_are_hooked(hooked):
    for target in (SENDER_TARGET, RECEIVER_TARGET):
        owner, name = target.rsplit(".", 1)
        method = getattr(pkgutil.resolve_name(owner), name)
        assert hasattr(method, "__wrapped__"), f"{target} is not wrapped by kvferry's hook"


def _decode_queue(rows: torch.Tensor):
    from sglang.srt.disaggregation.utils import TransferBackend

    return SimpleNamespace(transfer_backend=TransferBackend("kvferry"), kv_manager=SimpleNamespace(), queue=[],
                           metadata_buffers=SimpleNamespace(bootstrap_room=rows))


def _request(tokens: list[int], room: int, **asks):
    return SimpleNamespace(bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=room,
                           origin_input_ids=tokens, **asks)


@pytest.mark.parametrize("rebootstrap, asks, handed", [
    (False, {}, True), (True, {}, False),
    (False, {"return_logprob": True}, False), (False, {"return_hidden_states": True}, False),
    (False, {"return_logprob": False, "return_hidden_states": False}, True)])
def test_sglangs_decode_queue_hands_its_receiver_the_prompt_and_room_rows(hooked, rebootstrap, asks, handed):
    """SGLang's own ``DecodePreallocQueue._create_receiver_and_enqueue``
    (hooked) makes kvferry's receiver; the hook hands it the request's
    prompt and the queue's ``bootstrap_room`` rows, but not for a
    rebootstrap (prefill recomputes it under new weights), nor for a request
    that reads logprobs or hidden states from its aux row (a restored row
    would carry another request's)."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    from transfer.adapters.sglang.receiver import KvferryKVReceiver

    tokens = [random.randrange(1000) for _ in range(37)]
    rows = torch.zeros((4, 8), dtype=torch.int64)
    queue = _decode_queue(rows)
    decode_req = DecodePreallocQueue._create_receiver_and_enqueue(queue, _request(tokens, 77, **asks),
                                                                 is_rebootstrap=rebootstrap)
    receiver = decode_req.kv_receiver
    assert type(receiver) is KvferryKVReceiver and queue.queue == [decode_req]
    assert receiver.bootstrap_room == 77 and receiver.bootstrap_addr == "127.0.0.1:8998"
    if handed:
        assert receiver._token_ids is tokens and receiver._room_rows is rows
    else:
        assert receiver._token_ids is None and receiver._room_rows is None


def test_the_sender_hook_hands_a_kvferry_sender_its_prompt_only_when_sglang_made_one(hooked):
    from transfer.adapters.sglang.sender import KvferryKVSender

    tokens = list(range(50))
    sender = KvferryKVSender.__new__(KvferryKVSender)  # the hook's dispatch alone: no manager here
    sender._token_ids = None
    req = SimpleNamespace(disagg_kv_sender=sender, origin_input_ids=tokens)
    assert plugin.after_create_sender(False, None, req, 8) is None  # over capacity: no sender was made
    assert sender._token_ids is None
    assert plugin.after_create_sender(True, None, req, 8) is None  # SGLang keeps its own result
    assert sender._token_ids is tokens
    other = SimpleNamespace(disagg_kv_sender=object(), origin_input_ids=tokens)  # another backend's sender
    assert plugin.after_create_sender(True, None, other, 8) is None


@pytest.mark.parametrize("num_tokens, num_pages, taken", [(64, 4, True), (65, 5, True), (63, 4, True),
                                                          (64, 5, False), (80, 4, False), (0, 0, True)])
def test_a_prompt_is_used_only_when_it_takes_exactly_the_rooms_pages(num_tokens, num_pages, taken):
    tokens = list(range(num_tokens))
    got = prompt_of_room(tokens, num_pages, 16, "room 1")
    assert (got is tokens) if taken else got is None
    assert prompt_of_room(None, num_pages, 16, "room 1") is None
