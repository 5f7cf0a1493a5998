"""bootstrap.protect: what counts as loopback, and the refusal that says how to fix it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bootstrap.errors import InsecureBindError, KVFerryError
from bootstrap.protect import check_protected, is_loopback_host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "127.255.255.254", "::1", "[::1]", "localhost",
                                  "LOCALHOST", "localhost.", "::ffff:127.0.0.1", " 127.0.0.1 "])
def test_loopback(host):
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*", "", "10.77.0.1", "192.168.1.2", "128.0.0.1",
                                  "fe80::1", "::ffff:10.0.0.1", "my-host", "localhost.example.com",
                                  "127.0.0.1.nip.io", "eth0"])
def test_not_loopback(host):
    assert not is_loopback_host(host)


def test_refusal_names_the_ways_out():
    with pytest.raises(InsecureBindError) as info:
        check_protected("0.0.0.0", has_secret=False, insecure=False, what="the bootstrap server",
                        how_insecure="--insecure")
    text = str(info.value)
    assert "'0.0.0.0'" in text and "KVFERRY_SECRET" in text and "--secret-file" in text and "--insecure" in text
    assert isinstance(info.value, KVFerryError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("host, secret, insecure", [("127.0.0.1", False, False), ("0.0.0.0", True, False),
                                                     ("0.0.0.0", False, True), ("10.1.2.3", True, True)])
def test_allowed(host, secret, insecure):
    check_protected(host, has_secret=secret, insecure=insecure, what="x", how_insecure="y")


def test_protect_is_pure():
    out = subprocess.run([sys.executable, "-c", "import bootstrap.protect, bootstrap.status, sys; "
                          "print(' '.join(sys.modules))"], capture_output=True, text=True, check=True, timeout=60)
    assert not {m for m in out.stdout.split() if m.split(".")[0] in ("zmq", "mooncake", "torch", "transfer")}
