"""kvferry transfer: the Python API for prefill/decode schedulers.

One :class:`KVManager` per rank and role; one :class:`KVSender` (prefill) or
:class:`KVReceiver` (decode) per request, driven by ``poll()``, which returns
a :class:`KVPoll`. See the README for a scheduler-side example.
"""

from bootstrap.messages import PoolRole
from transfer.config import EngineConfig, ManagerConfig, Role, manager_config_from_env
from transfer.errors import (BootstrapError, BootstrapUnavailable, ClosedError, IncompatibleLayoutError,
                             KVFerryError, KVTimeoutError, PeerError, ProtocolError, StateError, TransferError)
from transfer.manager import KVManager
from transfer.pools import MHAPool, MLAPool
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.state import KVPoll

__all__ = [
    "BootstrapError", "BootstrapUnavailable", "ClosedError", "EngineConfig", "IncompatibleLayoutError",
    "KVFerryError", "KVManager", "KVPoll", "KVReceiver", "KVSender", "KVTimeoutError", "MHAPool", "MLAPool",
    "ManagerConfig", "PeerError", "PoolRole", "ProtocolError", "Role", "StateError", "TransferError",
    "manager_config_from_env",
]
