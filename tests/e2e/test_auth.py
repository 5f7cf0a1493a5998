"""With a shared secret on the bootstrap server and every rank, outsiders can
neither register a fake rank, read the registry, nor ask for KV pages."""

from __future__ import annotations

import subprocess
import sys

import pytest
import zmq

from bootstrap import codec
from bootstrap.client import BootstrapClient
from bootstrap.errors import AuthError
from harness.launch import BootstrapProcess, child_env
from transfer.messages import PeerHello, TransferRequest

from .ranks import FAST, Rank, assert_all_success, fault_spec
from tests.unit.test_codec import REGISTER, SAMPLES

pytestmark = pytest.mark.e2e

SECRET = "correct horse battery staple"


def _send_raw(endpoint: str, payload: bytes) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send(payload)
    sock.close()


def test_secret_refuses_outsiders_and_serves_members():
    with BootstrapProcess(secret=SECRET) as server:
        spec = fault_spec(server.address, min_tokens=512, max_tokens=1024, chunk_pages=0)
        cfg = {**FAST, "secret": SECRET}
        prefill, decode = Rank("prefill", spec, cfg), Rank("decode", spec, cfg)
        try:
            # Members work.
            prefill.send(op="rooms", rooms=[1, 2], timeout_s=60)
            decode.send(op="rooms", rooms=[1, 2], timeout_s=60)
            assert_all_success(prefill.reply(), [1, 2])
            assert_all_success(decode.reply(), [1, 2])

            # Registration, lookup and ping without the secret, or with a wrong one: refused.
            fake = REGISTER.rank
            for secret in (None, "wrong secret"):
                with BootstrapClient(server.address, timeout_s=5, secret=secret) as outsider:
                    with pytest.raises(AuthError, match="unauthenticated|authentication failed"):
                        outsider.register(fake)
                    with pytest.raises(AuthError):
                        outsider.lookup("prefill", 0)
                    with pytest.raises(AuthError):
                        outsider.ping()
            with BootstrapClient(server.address, timeout_s=5, secret=SECRET) as member:
                reply = member.lookup("prefill", 0)
                assert reply.ready and [r.session for r in reply.ranks] == [prefill.ready["session"]]
                assert member.lookup(fake.node_id, fake.dp_rank).num_registered == 0  # the fake never landed

            # Page requests from an outsider: a handshake and a request for the very room the
            # prefill is about to serve. Unsealed, and sealed with a wrong secret: both dropped,
            # so the room sees exactly the one request of the real decode rank and succeeds.
            hello = next(m for m in SAMPLES if isinstance(m, PeerHello))
            req = next(m for m in SAMPLES if isinstance(m, TransferRequest))
            req = TransferRequest(**{**vars(req), "room": 5, "num_requests": 1, "dst_pages": b"\0" * 4 * 64,
                                     "decode_session": hello.rank.session,
                                     "decode_endpoint": hello.rank.control_endpoint})
            for key in (None, codec.secret_key("wrong secret")):
                for msg in (hello, req):
                    _send_raw(prefill.ready["endpoint"], codec.encode(msg, key))
                    _send_raw(decode.ready["endpoint"], codec.encode(msg, key))
            prefill.send(op="rooms", rooms=[5, 6], timeout_s=60)
            decode.send(op="rooms", rooms=[5, 6], timeout_s=60)
            assert_all_success(prefill.reply(), [5, 6])
            assert_all_success(decode.reply(), [5, 6])
            assert prefill.stats()["unauthenticated"] >= 4
            assert decode.stats()["unauthenticated"] >= 4
        finally:
            prefill.close()
            decode.close()


def test_rank_without_the_secret_is_refused_with_a_clear_error():
    with BootstrapProcess(secret=SECRET) as server:
        spec = fault_spec(server.address, min_tokens=512, max_tokens=1024)
        # A prefill rank without the secret cannot register.
        proc = subprocess.run([sys.executable, "-m", "harness.rankctl", "--role", "prefill", "--spec", spec.to_json(),
                               "--config", '{"register_timeout_s": 5}'],
                              input="", capture_output=True, text=True, timeout=120, env=child_env())
        assert proc.returncode != 0
        assert "AuthError" in proc.stderr and "unauthenticated" in proc.stderr
        # A decode rank with the wrong secret: its rooms fail, naming the refusal.
        prefill = Rank("prefill", spec, {**FAST, "secret": SECRET})
        decode = Rank("decode", spec, {**FAST, "secret": "wrong"})
        try:
            decode.send(op="rooms", rooms=[1], timeout_s=30)
            res = decode.reply()["results"]["1"]
            assert res["state"] == "Failed" and res["error_type"] == "AuthError", res
            assert "authentication failed" in res["error"]
        finally:
            prefill.close()
            decode.close()
