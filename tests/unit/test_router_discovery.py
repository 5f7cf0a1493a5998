"""transfer.control.router_discovery: the registration vllm-router's
``--vllm-discovery-address`` waits for, against a real ZMQ ROUTER socket."""

import socket
import time

import msgpack
import pytest
import zmq

from transfer.control.router_discovery import DiscoveryHeartbeat
from transfer.adapters.vllm.params import ConnectorConfig


def test_a_worker_registers_every_interval_once_the_router_is_there():
    ctx = zmq.Context.instance()
    # The router is not there yet: the heartbeat starts first, as a worker may before its router. The
    # port is held meanwhile by a socket bound without SO_REUSEADDR and not listening (connections are
    # refused, and no other process's listener can take the port, as one did once a closed router freed it).
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    payload = {"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:8999", "dp_size": 1,
               "tp_size": 2}
    beat, router = DiscoveryHeartbeat(f"127.0.0.1:{port}", payload, interval_s=0.2), None
    try:
        time.sleep(0.5)
        sent_before = beat.num_sent  # none: nothing is queued for a router that is not there
        holder.close()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://127.0.0.1:{port}")
        got, t0 = [], time.monotonic()
        while len(got) < 3 and time.monotonic() - t0 < 5:
            if router.poll(500):
                got.append(router.recv_multipart())
        assert len(got) == 3, got
        assert all(len(frames) == 2 and msgpack.unpackb(frames[1]) == payload for frames in got), got
        assert sent_before == 0
    finally:
        beat.close()
        holder.close()
        if router is not None:
            router.close()
    assert not beat._thread.is_alive()


def test_discovery_needs_the_servers_http_address():
    with pytest.raises(ValueError, match="needs kvferry_http_address"):
        ConnectorConfig.from_extra({"kvferry_router_discovery": "10.0.0.9:30001"}, None)
    with pytest.raises(ValueError, match="kvferry_router_discovery must be host:port"):
        ConnectorConfig.from_extra({"kvferry_router_discovery": "tcp://10.0.0.9", "kvferry_http_address": "h:1"}, None)
    c = ConnectorConfig.from_extra({"kvferry_router_discovery": "10.0.0.9:30001",
                                    "kvferry_http_address": "10.0.0.1:8100"}, None)
    assert (c.router_discovery, c.http_address) == ("10.0.0.9:30001", "10.0.0.1:8100")
