"""tests/engines/vllm/pd_servers.nixl_complete: the NixlConnector reference
pair's request is sent again once only where vLLM's NIXL handshake bound
failed it (its decode logged ``handshake_failed`` meanwhile); any other
failure is raised. Pure: the pair and the proxy protocol are stand-ins."""

from __future__ import annotations

import urllib.error
import warnings

import pytest

from tests.engines.vllm import pd_servers
from tests.engines.vllm.pd_servers import NIXL_HANDSHAKE_FAILED, nixl_complete


class _Server:
    def __init__(self) -> None:
        self.log = "started\n"

    def log_tail(self, n: int = 4000) -> str:
        return self.log[-n:]


def _pair(monkeypatch, outcomes: list):
    """A pair whose successive requests end as ``outcomes`` say: "ok", "handshake" (an HTTP 500 after
    decode logged vLLM's handshake failure) or "other" (an HTTP 500 alone); the requests made."""
    servers = {"nixl-prefill": _Server(), "nixl-decode": _Server()}
    made = []

    def pd_complete(prefill, decode, model, prompt, max_tokens):
        made.append(prompt)
        outcome = outcomes[len(made) - 1]
        if outcome == "ok":
            return "completion"
        if outcome == "handshake":
            decode.log += f"ERROR NIXL transfer failure: handshake_failed | Context: {{{NIXL_HANDSHAKE_FAILED}}}\n"
        raise urllib.error.HTTPError("http://decode", 500, "Internal Server Error", None, None)

    monkeypatch.setattr(pd_servers, "pd_complete", pd_complete)
    return servers, made


def test_a_request_its_handshake_failed_is_sent_again_once_with_a_warning(monkeypatch):
    servers, made = _pair(monkeypatch, ["handshake", "ok"])
    with pytest.warns(UserWarning, match="failed its handshake"):
        assert nixl_complete(servers, "m", [1, 2], 4) == "completion"
    assert made == [[1, 2], [1, 2]]


def test_another_failure_is_raised_at_once(monkeypatch):
    servers, made = _pair(monkeypatch, ["other"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no retry, no warning
        with pytest.raises(urllib.error.HTTPError):
            nixl_complete(servers, "m", [1], 4)
    assert len(made) == 1


def test_a_second_handshake_failure_is_raised(monkeypatch):
    servers, made = _pair(monkeypatch, ["handshake", "handshake"])
    with pytest.raises(urllib.error.HTTPError), pytest.warns(UserWarning):
        nixl_complete(servers, "m", [1], 4)
    assert len(made) == 2
