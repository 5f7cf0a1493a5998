"""transfer.config: validation and KVFERRY_* environment variables."""

from __future__ import annotations

import dataclasses
import os

import pytest

from bootstrap.errors import InsecureBindError
from transfer.config import ENV_PREFIX, EngineConfig, ManagerConfig, Role, manager_config_from_env
from transfer.transport.mooncake.process import apply_mooncake_env


def test_engine_defaults_valid():
    e = EngineConfig()
    assert e.protocol == "rdma" and e.max_inflight_per_peer == 1024
    EngineConfig(protocol="tcp", log_level="TRACE", max_inflight_per_peer=60000, progress_timeout_s=1)


@pytest.mark.parametrize("kw, words", [
    (dict(protocol="udp"), "protocol"),
    (dict(protocol="RDMA"), "protocol"),
    (dict(log_level="DEBUG"), "log_level"),
    (dict(max_inflight_per_peer=0), "max_inflight_per_peer"),
    (dict(max_inflight_per_peer=-3), "max_inflight_per_peer"),
    (dict(max_inflight_per_peer=60001), "max_inflight_per_peer"),
    (dict(progress_timeout_s=0), "progress_timeout_s"),
])
def test_engine_config_rejects(kw, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kw)


def test_configs_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().protocol = "tcp"  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineConfig("tcp")  # type: ignore[misc]
    with pytest.raises(TypeError):
        ManagerConfig(Role.PREFILL)  # type: ignore[misc]


def test_mooncake_env():
    env = EngineConfig(protocol="tcp", log_level="INFO", progress_timeout_s=3).mooncake_env()
    assert env["MC_LOG_LEVEL"] == "INFO"
    assert env["MC_TCP_PROGRESS_TIMEOUT_SEC"] == env["MC_TCP_STATUS_TIMEOUT_SEC"] == "3"
    assert env["MC_TRANSFER_TIMEOUT"] == "5"
    assert EngineConfig(progress_timeout_s=30).mooncake_env()["MC_TRANSFER_TIMEOUT"] == "30"
    assert all(isinstance(v, str) for v in env.values())


def test_apply_mooncake_env_keeps_operator_values(monkeypatch):
    fake = {"MC_LOG_LEVEL": "TRACE", "PATH": "/bin"}
    monkeypatch.setattr(os, "environ", fake)  # no leak into the real environment
    apply_mooncake_env(EngineConfig(protocol="tcp", log_level="ERROR", progress_timeout_s=7))
    assert fake["MC_LOG_LEVEL"] == "TRACE"  # the operator's value wins
    assert fake["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "7"
    assert fake["MC_TRANSFER_TIMEOUT"] == "7"
    assert set(EngineConfig().mooncake_env()) <= set(fake)


def test_mooncake_env_sets_tcp_variables_for_tcp_engines_only():
    tcp = EngineConfig(protocol="tcp").mooncake_env()
    rdma = EngineConfig(protocol="rdma").mooncake_env()
    assert set(rdma) == {"MC_LOG_LEVEL", "MC_TRANSFER_TIMEOUT", "MC_TCP_BIND_ADDRESS"}
    assert set(tcp) - set(rdma) == {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
                                    "MC_TCP_ADMISSION_TIMEOUT_MS", "MC_TCP_PROGRESS_TIMEOUT_SEC",
                                    "MC_TCP_STATUS_TIMEOUT_SEC"}


def test_the_relay_advertises_the_engine_s_own_host_and_p2p_leaves_it_alone():
    # With a metadata server Mooncake advertises MC_TCP_BIND_ADDRESS, else the host's first LAN address
    # (none in a loopback-only namespace: initialize fails).
    assert EngineConfig(hostname="10.1.2.3").mooncake_env()["MC_TCP_BIND_ADDRESS"] == "10.1.2.3"
    assert "MC_TCP_BIND_ADDRESS" not in EngineConfig(mooncake_metadata="p2p").mooncake_env()
    with pytest.raises(ValueError, match="mooncake_metadata"):
        EngineConfig(mooncake_metadata="etcd")
    with pytest.raises(ValueError, match="handshake_timeout_s"):
        EngineConfig(handshake_timeout_s=0)


def test_a_user_set_mooncake_variable_survives(monkeypatch):
    config = EngineConfig(protocol="tcp", log_level="ERROR", progress_timeout_s=9)
    for key in config.mooncake_env():
        monkeypatch.delenv(key, raising=False)  # restored (or removed again) after the test
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "2048")
    monkeypatch.setenv("MC_LOG_LEVEL", "INFO")
    added = apply_mooncake_env(config)
    assert os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "2048"
    assert os.environ["MC_LOG_LEVEL"] == "INFO"
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "9"
    assert set(added) == set(config.mooncake_env()) - {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_LOG_LEVEL"}
    assert apply_mooncake_env(dataclasses.replace(config, progress_timeout_s=20)) == {}  # the first engine's values stay
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "9"


def test_manager_defaults_valid():
    m = ManagerConfig(role=Role.DECODE)
    assert m.tp_size == 1 and m.engine == EngineConfig() and m.allow_missing_draft is False


@pytest.mark.parametrize("kw, words", [
    (dict(role="prefill"), "role"),
    (dict(role=Role.PREFILL, tp_rank=2, tp_size=2), "tp_rank 2"),
    (dict(role=Role.PREFILL, tp_rank=-1), "tp_rank"),
    (dict(role=Role.PREFILL, tp_size=0), "tp_rank"),
    (dict(role=Role.PREFILL, dp_rank=1, dp_size=1), "dp_rank 1"),
    (dict(role=Role.PREFILL, dp_rank=-1, dp_size=1), "dp_rank"),
    (dict(role=Role.PREFILL, bootstrap_addr="localhost"), "bootstrap_addr"),
    (dict(role=Role.PREFILL, bootstrap_timeout_s=0), "bootstrap_timeout_s"),
    (dict(role=Role.PREFILL, transfer_timeout_s=-1.0), "transfer_timeout_s"),
    (dict(role=Role.PREFILL, rpc_timeout_s=0.0), "rpc_timeout_s"),
    (dict(role=Role.PREFILL, register_timeout_s=0), "register_timeout_s"),
])
def test_manager_config_rejects(kw, words):
    with pytest.raises(ValueError, match=words):
        ManagerConfig(**kw)


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    return monkeypatch


def test_from_env_defaults(clean_env):
    assert manager_config_from_env(Role.PREFILL) == ManagerConfig(role=Role.PREFILL)


def test_from_env_reads_variables(clean_env):
    env = {
        "KVFERRY_BOOTSTRAP_ADDR": "10.1.2.3:9000",
        "KVFERRY_NODE_ID": "prefill-7",
        "KVFERRY_TP_RANK": "3",
        "KVFERRY_TP_SIZE": "4",
        "KVFERRY_DP_RANK": "1",
        "KVFERRY_DP_SIZE": "2",
        "KVFERRY_HOST": "10.1.2.4",
        "KVFERRY_INSECURE": "1",  # a non-loopback host needs a secret or this
        "KVFERRY_TRANSFER_TIMEOUT_S": "2.5",
        "KVFERRY_RPC_TIMEOUT_S": "1",
        "KVFERRY_ALLOW_MISSING_DRAFT": "yes",
        "KVFERRY_PROTOCOL": "tcp",
        "KVFERRY_MAX_INFLIGHT_PER_PEER": "64",
        "KVFERRY_PROGRESS_TIMEOUT_S": "3",
        "KVFERRY_LOG_LEVEL": "INFO",
        "KVFERRY_DEVICE_NAME": "mlx5_0",
    }
    for k, v in env.items():
        clean_env.setenv(k, v)
    c = manager_config_from_env(Role.DECODE)
    assert c.role is Role.DECODE
    assert c.bootstrap_addr == "10.1.2.3:9000" and c.node_id == "prefill-7" and c.host == "10.1.2.4"
    assert (c.tp_rank, c.tp_size, c.dp_rank, c.dp_size) == (3, 4, 1, 2)
    assert c.transfer_timeout_s == 2.5 and isinstance(c.transfer_timeout_s, float)
    assert c.rpc_timeout_s == 1.0 and isinstance(c.rpc_timeout_s, float)
    assert c.allow_missing_draft is True and c.insecure is True
    assert c.engine == EngineConfig(protocol="tcp", max_inflight_per_peer=64, progress_timeout_s=3,
                                    log_level="INFO", device_name="mlx5_0")
    # untouched fields keep their defaults
    assert c.bootstrap_timeout_s == 30.0 and c.register_timeout_s == 30.0


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("TRUE", True), ("on", True),
                                         ("0", False), ("false", False), ("no", False), ("", False)])
def test_from_env_bool(clean_env, text, value):
    clean_env.setenv("KVFERRY_ALLOW_MISSING_DRAFT", text)
    assert manager_config_from_env(Role.DECODE).allow_missing_draft is value


def test_from_env_overrides_win(clean_env):
    clean_env.setenv("KVFERRY_TP_SIZE", "8")
    clean_env.setenv("KVFERRY_TP_RANK", "5")
    clean_env.setenv("KVFERRY_PROTOCOL", "tcp")
    c = manager_config_from_env(Role.PREFILL, tp_rank=1, tp_size=2)
    assert (c.tp_rank, c.tp_size) == (1, 2)
    assert c.engine.protocol == "tcp"
    c = manager_config_from_env(Role.PREFILL, engine=EngineConfig(protocol="rdma"))
    assert c.engine.protocol == "rdma" and c.tp_rank == 5


def test_from_env_ignores_role_and_other_prefixes(clean_env):
    clean_env.setenv("KVFERRY_ROLE", "prefill")
    clean_env.setenv("TP_RANK", "3")
    c = manager_config_from_env(Role.DECODE)
    assert c.role is Role.DECODE and c.tp_rank == 0


@pytest.mark.parametrize("var, text", [
    ("KVFERRY_TP_RANK", "abc"),
    ("KVFERRY_TP_RANK", "1.5"),
    ("KVFERRY_TP_RANK", "1"),  # tp_size stays 1
    ("KVFERRY_PROTOCOL", "udp"),
    ("KVFERRY_RPC_TIMEOUT_S", "soon"),
    ("KVFERRY_RPC_TIMEOUT_S", "0"),
    ("KVFERRY_MAX_INFLIGHT_PER_PEER", "100000"),
    ("KVFERRY_BOOTSTRAP_ADDR", "no-port"),
])
def test_from_env_bad_values(clean_env, var, text):
    clean_env.setenv(var, text)
    with pytest.raises(ValueError):
        manager_config_from_env(Role.PREFILL)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.4", "prefill-7.cluster", ""])
def test_non_loopback_host_needs_a_secret_or_insecure(host):
    with pytest.raises(InsecureBindError, match="KVFERRY_SECRET") as info:
        ManagerConfig(role=Role.PREFILL, host=host)
    assert "KVFERRY_INSECURE=1" in str(info.value) and isinstance(info.value, ValueError)
    assert ManagerConfig(role=Role.PREFILL, host=host, secret="s").host == host
    assert ManagerConfig(role=Role.DECODE, host=host, insecure=True).insecure is True


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_host_stays_zero_config(host):
    assert ManagerConfig(role=Role.PREFILL, host=host).secret == ""


def test_insecure_and_secret_from_env(clean_env):
    clean_env.setenv("KVFERRY_HOST", "0.0.0.0")
    with pytest.raises(InsecureBindError):
        manager_config_from_env(Role.PREFILL)
    clean_env.setenv("KVFERRY_SECRET", "s")
    assert manager_config_from_env(Role.PREFILL).secret == "s"
    clean_env.delenv("KVFERRY_SECRET")
    clean_env.setenv("KVFERRY_INSECURE", "1")
    assert manager_config_from_env(Role.PREFILL).insecure is True
