"""A room's prompt for kvferry's storage tier, from SGLang's request.

SGLang's transfer interface carries no tokens (``BaseKVSender.init(num_pages,
aux_index)``, ``BaseKVReceiver.send_metadata(kv_indices, aux_index, ...)``),
yet kvferry's storage tier keys pages by the prompt's hash chain: prefill's
write-through, decode's prefetch, and decode's restore of a room whose prefill
died all need it. The two places where SGLang makes a room's sender and
receiver still hold the request, and kvferry hooks them with SGLang's own
plugin hooks (``HookRegistry``, AFTER; registered by :mod:`.plugin`): the hook
hands the new kvferry sender or receiver ``req.origin_input_ids``. This module
holds the targets and the rules; the sender and receiver apply
:func:`prompt_of_room`.

- prefill: ``PrefillBootstrapQueue.create_sender(req, num_kv_heads)``;
- decode: ``DecodePreallocQueue._create_receiver_and_enqueue(req, is_rebootstrap)``.
  A PD retract rebootstrap's room gets none: prefill recomputes it under new
  weights, which the store's values are not. Nor does a request that asks
  for logprobs or hidden states (:func:`wants_its_own_row`). The receiver also gets the
  queue's ``metadata_buffers.bootstrap_room``, to stamp a restored aux row
  with its room (see :mod:`.receiver`).

A target missing from an SGLang release is logged once by SGLang's hook
registry ("Failed to apply hooks"); its rooms then simply have no prompt, and
the storage tier is not used for them (as before these hooks).
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvferry.sglang")

SENDER_TARGET = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.create_sender"
RECEIVER_TARGET = "sglang.srt.disaggregation.decode.DecodePreallocQueue._create_receiver_and_enqueue"


def wants_its_own_row(req) -> bool:
    """Whether the request reads what only its own prefill writes into its aux
    row: the first token's logprobs, or hidden states. A restored row is the
    one some earlier request's prefill wrote (its first token is the
    prompt's; its logprobs, hidden states and ``cached_tokens`` are that
    request's, or none), so such a room is kept away from the store."""
    return bool(getattr(req, "return_logprob", False) or getattr(req, "return_hidden_states", False))


def prompt_of_room(token_ids, num_pages: int, page_size: int, where: str):
    """``token_ids`` if they take exactly the room's ``num_pages`` pages,
    else None (logged): a room whose pages are not its prompt's (a request
    SGLang extends past its prompt) is kept away from the store, never failed."""
    if token_ids is None:
        return None
    need = -(-len(token_ids) // page_size)
    if need != num_pages:
        log.info("%s: its %d prompt tokens take %d pages, not the room's %d: the storage tier is not used for it",
                 where, len(token_ids), need, num_pages)
        return None
    return token_ids
