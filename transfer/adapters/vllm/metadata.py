"""What the scheduler half tells its worker, once per engine step: one
metadata type per role (vLLM builds it in the scheduler process and hands
it to every worker of the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from transfer.adapters.vllm.params import RecvSpec, SendSpec


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """Either role's: the requests vLLM finished while their room is open,
    and whether the step computes nothing (its worker may then wait a
    little for a room to end: :meth:`~transfer.adapters.vllm.worker.KvferryWorker.settle`)."""

    aborts: list[str] = field(default_factory=list)
    idle: bool = False


@dataclass
class PrefillMetadata(KvferryConnectorMetadata):
    sends: list[SendSpec] = field(default_factory=list)  # requests whose prompt's KV is complete
    streams: list[SendSpec] = field(default_factory=list)  # layer-wise: requests whose prefill completes this step
    streams_opened: bool = False  # the worker opened ``streams`` (at the step's first of start/save_kv_layer)


@dataclass
class DecodeMetadata(KvferryConnectorMetadata):
    recvs: list[RecvSpec] = field(default_factory=list)  # requests whose blocks were allocated
    cancels: list[RecvSpec] = field(default_factory=list)  # requests finished before they had a room
    holds: list[RecvSpec] = field(default_factory=list)  # requests queued: hold their rooms at prefill
