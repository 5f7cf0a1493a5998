"""The SGLang plugin: the ``kvferry`` backend choice and the class lookup.

SGLang's backend choice is a fixed Enum (``TransferBackend``) read with
``TransferBackend(name)`` in the scheduler, the tokenizer manager and the
disaggregation service, and classes come from ``get_kv_class(backend, kind)``.
The plugin (1) extends the CLI choices with SGLang's own
``add_disagg_transfer_backend_choices``, (2) adds a ``KVFERRY`` member to the
Enum, and (3) wraps ``get_kv_class`` through SGLang's ``HookRegistry``
(AROUND), which also patches the modules that imported it by name, and (4)
hooks the two places SGLang makes a room's sender and receiver, to hand them
the request's prompt (:mod:`.prompts`).
"""

from __future__ import annotations

import logging

from transfer.adapters.sglang import BACKEND
from transfer.adapters.sglang.prompts import RECEIVER_TARGET, SENDER_TARGET, wants_its_own_row

log = logging.getLogger("kvferry.sglang")

_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def _extend_enum(enum_cls, name: str, value: str):
    """Add member ``name = value`` to an existing Enum (no-op if present)."""
    if value in enum_cls._value2member_map_:
        return enum_cls(value)
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    type.__setattr__(enum_cls, name, member)
    return member


def kv_class(class_type):
    """kvferry's class for one of SGLang's ``KVClassType`` kinds."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return KVArgs
    from transfer.adapters.sglang.bootstrap import KvferryKVBootstrapServer
    from transfer.adapters.sglang.manager import KvferryKVManager
    from transfer.adapters.sglang.receiver import KvferryKVReceiver
    from transfer.adapters.sglang.sender import KvferryKVSender

    return {KVClassType.MANAGER: KvferryKVManager, KVClassType.SENDER: KvferryKVSender,
            KVClassType.RECEIVER: KvferryKVReceiver,
            KVClassType.BOOTSTRAP_SERVER: KvferryKVBootstrapServer}[class_type]


def _get_kv_class(original, transfer_backend, class_type):
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND:
        return kv_class(class_type)
    return original(transfer_backend, class_type)


def after_create_sender(created, queue, req, *args, **kwargs):
    """AFTER SGLang's ``create_sender``: the request's kvferry sender learns
    its prompt (:mod:`.prompts`)."""
    from transfer.adapters.sglang.sender import KvferryKVSender

    sender = getattr(req, "disagg_kv_sender", None)
    if created and isinstance(sender, KvferryKVSender):
        sender.learn_prompt(req.origin_input_ids)
    return None  # SGLang keeps the original result


def after_create_receiver(decode_req, queue, req, is_rebootstrap: bool = False, *args, **kwargs):
    """AFTER SGLang's ``_create_receiver_and_enqueue``: the room's kvferry
    receiver learns its prompt and the queue's ``bootstrap_room`` rows, but
    not a rebootstrap's nor one that reads its own aux row (:mod:`.prompts`)."""
    from transfer.adapters.sglang.receiver import KvferryKVReceiver

    receiver = getattr(decode_req, "kv_receiver", None)
    if not is_rebootstrap and isinstance(receiver, KvferryKVReceiver) and not wants_its_own_row(req):
        buffers = getattr(queue, "metadata_buffers", None)
        receiver.learn_prompt(req.origin_input_ids, room_rows=getattr(buffers, "bootstrap_room", None))
    return None


_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _extend_enum(TransferBackend, BACKEND.upper(), BACKEND)
    HookRegistry.register(_GET_KV_CLASS, _get_kv_class, HookType.AROUND)
    HookRegistry.register(SENDER_TARGET, after_create_sender, HookType.AFTER)
    HookRegistry.register(RECEIVER_TARGET, after_create_receiver, HookType.AFTER)
    _registered = True
    log.info("kvferry registered as SGLang transfer backend %r", BACKEND)
