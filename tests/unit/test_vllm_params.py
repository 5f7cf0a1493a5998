"""transfer.adapters.vllm.params: the vLLM connector's config and router params (pure);
the prefill's HTTP bootstrap port and decode's map to kvferry's ZMQ bootstrap behind it."""

from __future__ import annotations

import sys
import time

import pytest

from harness.ports import refusing_address
from transfer.adapters.vllm.params import (PARAMS_VERSION, ConnectorConfig, decode_params, num_pages, room_of,
                                           source_of)


def test_prefill_params_lead_decode_to_the_same_room():
    config = ConnectorConfig.from_extra({"kvferry_bootstrap_addr": "10.0.0.5:9000", "kvferry_node": "p0"}, "eng")
    params = decode_params(room_of("cmpl-abc-0"), config)
    src = source_of(params)
    assert (src.room, src.bootstrap_addr, src.node_id) == (room_of("cmpl-abc-0"), "10.0.0.5:9000", "p0")
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False


def test_a_transfer_id_names_the_room_on_both_sides():
    src = source_of({"transfer_id": "t-1", "kvferry_bootstrap_addr": "h:1", "kvferry_node": "n"})
    assert src.room == room_of("t-1") != room_of("t-2")
    assert 0 <= src.room < 1 << 63


@pytest.mark.parametrize("params, field", [
    ({"kvferry_bootstrap_addr": "h:1", "kvferry_node": "n"}, "neither kvferry_room nor transfer_id"),
    ({"kvferry_room": 5, "kvferry_node": "n"}, "kvferry_bootstrap_addr"),
    ({"kvferry_room": 5, "kvferry_bootstrap_addr": "h:1"}, "kvferry_node"),
    ({"kvferry_room": -1, "kvferry_bootstrap_addr": "h:1", "kvferry_node": "n"}, "kvferry_room"),
    ({"kvferry_room": 5, "kvferry_bootstrap_addr": "h:1", "kvferry_node": "n", "kvferry_version": PARAMS_VERSION + 1},
     "kvferry_version"),
])
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        source_of(params)


def test_config_defaults_and_validation():
    c = ConnectorConfig.from_extra({}, "engine-7")
    assert (c.bootstrap_addr, c.node_id, c.protocol, c.serve_bootstrap) == ("127.0.0.1:8998", "engine-7", "tcp", False)
    with pytest.raises(ValueError, match="host:port"):
        ConnectorConfig.from_extra({"kvferry_bootstrap_addr": "nohost"}, None)
    with pytest.raises(ValueError, match="tcp or rdma"):
        ConnectorConfig.from_extra({"kvferry_protocol": "udp"}, None)
    with pytest.raises(ValueError, match="role"):
        ConnectorConfig.from_extra({"kvferry": {"role": "x"}}, None)
    assert c.layer_groups == 0 and ConnectorConfig.from_extra({"kvferry_layer_groups": 4}, None).layer_groups == 4
    for bad in (-1, 2.5, "4"):
        with pytest.raises(ValueError, match="kvferry_layer_groups"):
            ConnectorConfig.from_extra({"kvferry_layer_groups": bad}, None)
    # the threshold that keeps short prompts' groups whole is the connector's to set, on prefill's manager
    streamed = ConnectorConfig.from_extra({"kvferry_layer_groups": 4, "kvferry": {"layerwise_min_tokens": 0}}, None)
    assert streamed.manager_fields(prefill=True)["layerwise_min_tokens"] == 0


def test_pages_of_a_prompt():
    assert [num_pages(n, 128) for n in (1, 127, 128, 129, 1000)] == [1, 1, 1, 2, 8]


def test_the_scheduler_half_imports_no_engine():
    """In a fresh interpreter (this one may have loaded them for other tests)."""
    import subprocess
    code = ("import sys, transfer.adapters.vllm.params, transfer.adapters.vllm.stats; "
            "bad = [m for m in ('torch', 'zmq', 'mooncake', 'vllm') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("sizes, named", [
    (dict(pipeline_parallel_size=2, data_parallel_size=1), "pipeline_parallel_size 2 is not supported"),
    (dict(pipeline_parallel_size=1, data_parallel_size=4), "data_parallel_size 4 is not supported"),
    (dict(pipeline_parallel_size=1, data_parallel_size=1, decode_context_parallel_size=2),
     "decode_context_parallel_size 2 is not supported"),
])
def test_parallel_layouts_the_connector_cannot_move_are_refused_by_name(sizes, named):
    from transfer.adapters.vllm.params import check_parallel

    with pytest.raises(ValueError, match=named):
        check_parallel(**sizes)
    check_parallel(pipeline_parallel_size=1, data_parallel_size=1)


def test_a_mooncake_router_finds_the_room_from_the_engine_id_query_gives():
    """vLLM's Mooncake routers pass on the engine id prefill's /query gave,
    with their transfer_id: decode reads kvferry's bootstrap and node from it."""
    from transfer.adapters.vllm.params import engine_id_of, query_reply

    config = ConnectorConfig.from_extra({"kvferry_bootstrap_addr": "10.0.0.5:9000", "kvferry_node": "p0",
                                         "kvferry_query_port": 8998}, "eng")  # a separate bootstrap server at 9000
    reply = query_reply(config, tp_size=2)
    assert reply["0"]["engine_id"] == engine_id_of(config) and sorted(reply["0"]["worker_addr"]) == ["0", "1"]
    src = source_of({"do_remote_prefill": True, "transfer_id": "t-9", "remote_engine_id": reply["0"]["engine_id"],
                     "remote_bootstrap_addr": "http://10.0.0.5:8998"})
    assert (src.room, src.bootstrap_addr, src.node_id) == (room_of("t-9"), "10.0.0.5:9000", "p0")
    with pytest.raises(ValueError, match="remote_engine_id 'prefill0' is not a kvferry prefill's"):
        source_of({"transfer_id": "t-9", "remote_engine_id": "prefill0", "remote_bootstrap_addr": "http://h:1"})
    with pytest.raises(ValueError, match="kvferry_query_port"):
        ConnectorConfig.from_extra({"kvferry_query_port": 70000}, None)


def test_a_prefill_serving_the_bootstrap_answers_http_on_its_port_and_zmq_beside_it():
    """The README's prefill (serve_bootstrap, 8998): HTTP on 8998, the port
    vLLM's Mooncake routers ask; kvferry's ZMQ bootstrap on 8999, which the
    engine id, the /query workers and decode's params name."""
    from transfer.adapters.vllm.params import decode_params, engine_id_of, query_reply

    served = ConnectorConfig.from_extra({"kvferry_bootstrap_addr": "10.0.0.5:8998", "kvferry_serve_bootstrap": True,
                                         "kvferry_node": "p0"}, None)
    assert served.kvferry_addr == "10.0.0.5:8999" and served.http_ports == (8998,)
    assert engine_id_of(served) == "p0@kvferry@10.0.0.5:8999"
    assert query_reply(served, 2)["0"]["worker_addr"] == {"0": {"0": "10.0.0.5:8999"}, "1": {"0": "10.0.0.5:8999"}}
    assert decode_params(5, served)["kvferry_bootstrap_addr"] == "10.0.0.5:8999"
    own = ConnectorConfig.from_extra({"kvferry_serve_bootstrap": True, "kvferry_bootstrap_zmq_port": 7000,
                                      "kvferry_query_port": 9100}, None)
    assert own.kvferry_addr == "127.0.0.1:7000" and own.http_ports == (8998, 9100)
    # a separate `python -m bootstrap` server: its port is kvferry's; /query only where kvferry_query_port says
    apart = ConnectorConfig.from_extra({"kvferry_bootstrap_addr": "10.0.0.9:8998"}, None)
    assert apart.kvferry_addr == "10.0.0.9:8998" and apart.http_ports == ()
    assert ConnectorConfig.from_extra({"kvferry_query_port": 9100}, None).http_ports == (9100,)
    # vLLM's Mooncake bootstrap port variable moves the default, as it moves MooncakeConnector's
    assert ConnectorConfig.from_extra({}, None, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9300"}).bootstrap_addr == \
        "127.0.0.1:9300"
    for clash in ({"kvferry_bootstrap_zmq_port": 8998}, {"kvferry_query_port": 8999}):
        with pytest.raises(ValueError, match="is also an HTTP port"):
            ConnectorConfig.from_extra({"kvferry_serve_bootstrap": True, **clash}, None)
    with pytest.raises(ValueError, match="kvferry_bootstrap_zmq_port"):
        ConnectorConfig.from_extra({"kvferry_serve_bootstrap": True, "kvferry_bootstrap_addr": "h:65535"}, None)


def test_a_prefill_bound_on_every_interface_is_named_by_a_reachable_host_never_the_wildcard():
    """A multi-node prefill serves its bootstrap on ``0.0.0.0``: the engine
    id, the /query workers, decode's params and the discovery registration
    name this rank's host instead (on decode's machine ``0.0.0.0`` is decode
    itself). A wildcard in an engine id (an older prefill) is read as the
    host the router forwards in ``remote_bootstrap_addr``."""
    from transfer.adapters.vllm.params import decode_params, engine_id_of, query_reply

    wild = ConnectorConfig.from_extra({"kvferry_bootstrap_addr": "0.0.0.0:8998", "kvferry_serve_bootstrap": True,
                                       "kvferry_node": "p0", "kvferry_host": "10.1.2.3"}, None)
    assert wild.kvferry_addr == "0.0.0.0:8999" and wild.public_kvferry_addr == "10.1.2.3:8999"
    assert engine_id_of(wild) == "p0@kvferry@10.1.2.3:8999"
    assert query_reply(wild, 1)["0"]["worker_addr"] == {"0": {"0": "10.1.2.3:8999"}}
    assert decode_params(3, wild)["kvferry_bootstrap_addr"] == "10.1.2.3:8999"
    routed = source_of({"transfer_id": "t-1", "remote_engine_id": engine_id_of(wild),
                        "remote_bootstrap_addr": "http://10.1.2.3:8998"})
    assert routed.bootstrap_addr == "10.1.2.3:8999" and routed.node_id == "p0"
    old = source_of({"transfer_id": "t-1", "remote_engine_id": "p0@kvferry@0.0.0.0:8999",
                     "remote_bootstrap_addr": "http://10.0.0.7:8998"})
    assert old.bootstrap_addr == "10.0.0.7:8999"
    named = ConnectorConfig.from_extra({"kvferry_bootstrap_addr": "10.0.0.5:8998", "kvferry_host": "10.9.9.9"}, None)
    assert named.public_kvferry_addr == "10.0.0.5:8998"  # a named host is what peers reach


def test_the_query_server_answers_get_query_as_vllms_mooncake_bootstrap_does():
    import json
    import urllib.error
    import urllib.request

    from transfer.adapters.vllm.params import query_reply
    from transfer.adapters.vllm.query import QueryServer

    config = ConnectorConfig.from_extra({"kvferry_node": "p0"}, None)
    server = QueryServer("127.0.0.1", 0, query_reply(config, 1), kvferry_port=4321)
    try:
        with urllib.request.urlopen(f"http://{server.address}/query", timeout=5) as r:
            assert json.loads(r.read()) == query_reply(config, 1)
        with urllib.request.urlopen(f"http://{server.address}/kvferry", timeout=5) as r:
            assert json.loads(r.read()) == {"port": 4321}
        with urllib.request.urlopen(f"http://{server.address}/health", timeout=5) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://{server.address}/register", timeout=5)
    finally:
        server.close()


def test_decode_finds_kvferrys_bootstrap_behind_a_front_door_and_takes_a_zmq_port_as_it_is():
    """A request naming a prefill's HTTP bootstrap port (the concurrent
    protocol's kvferry_bootstrap_addr, as configured) maps to kvferry's ZMQ
    server there; a ZMQ port (a separate bootstrap server, or the address
    prefill's params name) is itself, told at once by its greeting; a port
    nobody listens on is taken as it is, not remembered."""
    from bootstrap.server import BootstrapServer
    from transfer.adapters.vllm.params import query_reply
    from transfer.adapters.vllm.query import KvferryAddresses, QueryServer

    zmq_server = BootstrapServer("127.0.0.1", 0).start()
    door = QueryServer("127.0.0.1", 0, query_reply(ConnectorConfig(), 1), kvferry_port=zmq_server.port)
    try:
        addresses = KvferryAddresses(timeout_s=5.0)
        assert addresses(door.address) == zmq_server.address
        t0 = time.monotonic()
        assert addresses(zmq_server.address) == zmq_server.address
        assert time.monotonic() - t0 < 1.0, "a ZMQ port must be told by its greeting, not by a timeout"
        with refusing_address() as nobody:
            assert addresses(nobody) == nobody and nobody not in addresses._known
    finally:
        door.close()
        zmq_server.close()


@pytest.mark.parametrize("extra, host", [
    ({"kvferry_bootstrap_addr": "10.0.0.5:8998", "kvferry_serve_bootstrap": True}, "10.0.0.5"),
    ({"kvferry_bootstrap_addr": "127.0.0.2:8998", "kvferry_serve_bootstrap": True}, "127.0.0.2"),
    ({"kvferry_bootstrap_addr": "127.0.0.2:8998"}, "127.0.0.1"),  # decode, its bootstrap on this machine
    ({"kvferry_bootstrap_addr": "localhost:8998", "kvferry_serve_bootstrap": True}, "127.0.0.1"),
    ({}, "127.0.0.1"),
    ({"kvferry_bootstrap_addr": "10.0.0.5:8998", "kvferry_serve_bootstrap": True, "kvferry_host": "10.0.0.9"},
     "10.0.0.9"),
])
def test_a_ranks_address_defaults_to_where_its_peers_reach_it(extra, host):
    """A prefill that serves its bootstrap at a host of its own registers its
    rank there (the routers forward that host to decode; loopback would send
    decode's transfers to decode's own machine); an explicit kvferry_host wins."""
    assert ConnectorConfig.from_extra(extra, "eng").host == host


def test_a_rank_on_another_node_than_its_bootstrap_registers_its_outgoing_address():
    """Towards a bootstrap elsewhere, the rank's address is the one this
    machine sends from on that route (here: towards this machine's own
    outgoing address, which is that address: a packet would leave by lo,
    from it), never loopback's."""
    from transfer.adapters.vllm.params import default_host

    mine = default_host("0.0.0.0:8998", True)  # the default route's interface
    if mine.startswith("127."):
        pytest.skip("this machine has no interface besides loopback")
    assert ConnectorConfig.from_extra({"kvferry_bootstrap_addr": f"{mine}:8998"}, "eng").host == mine
