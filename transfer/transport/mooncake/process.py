"""What the Mooncake engine needs of its process and does to it, and how
kvferry keeps it in check: its ``MC_*`` settings, its start-up lines on
standard error, its slow destructor, which wheel is installed, and whether
RDMA is really there (see :mod:`transfer.transport.mooncake.transport`; the
Mooncake Store's client uses the settings too).

Mooncake's own settings. The Mooncake engine reads its tuning from ``MC_*``
environment variables when an engine is built (the Store: when
``mooncake.store`` is imported); it has no per-engine API for them, so they
are process-wide, and shared with every other Mooncake user in the process
(a serving engine's own, for one). :func:`apply_mooncake_env` runs right
before kvferry builds an engine and only fills in variables that are not set:
a value the user exported always wins, also one set to the engine's default.
It fills in, from :class:`EngineConfig` (:meth:`EngineConfig.mooncake_env`):

- always: ``MC_LOG_LEVEL`` (``log_level``; ``OFF`` sets ``ERROR``, see
  below) and ``MC_TRANSFER_TIMEOUT``
  (``max(5, progress_timeout_s)``: how long a blocking transfer call waits);
- for ``protocol="tcp"`` only: ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and
  ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (65535, their maximum; kvferry
  caps its own in-flight descriptors per peer below them),
  ``MC_TCP_ADMISSION_TIMEOUT_MS`` (60000), and ``MC_TCP_PROGRESS_TIMEOUT_SEC``
  and ``MC_TCP_STATUS_TIMEOUT_SEC`` (both ``progress_timeout_s``: a stalled
  body, and the wait for a write's acknowledgement after its body went out,
  whose default of 30 s would outlast a decode room's own timeout).

A user who sets one of these lower than kvferry's value keeps it; kvferry
then still keeps at most ``max_inflight_per_peer`` descriptors outstanding per
peer, which must stay below the user's queue caps.

Engine logs. Even at ``ERROR`` the engine prints a few lines at start-up on
every process (``Local segment descriptor not found``, which is normal).
With ``log_level="OFF"`` (the default) kvferry discards the engine's
standard error while the engine initializes, unless ``MC_LOG_LEVEL`` was set
by someone else than kvferry (:func:`quiet_engine_start`); any other level
(``KVFERRY_LOG_LEVEL=ERROR``, ...) shows the engine's logs.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import resource
import sys

from transfer.config import EngineConfig
from transfer.errors import TransferError


def rdma_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """The RDMA devices of this host (empty without any)."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


#: Descriptors this process's file table holds room for once an engine starts (:func:`reserve_fd_table`).
FD_TABLE_RESERVE = 4096


def reserve_fd_table(count: int = FD_TABLE_RESERVE) -> int:
    """Grow this process's file-descriptor table to hold ``count`` (at
    most the soft ``RLIMIT_NOFILE``) now; returns the size asked for (0:
    nothing done).

    The kernel grows the table when a new descriptor passes its size, and in
    a process with more than one thread it first waits for an RCU grace
    period, inside the call that wanted the descriptor. In Mooncake's engine
    that call is an ``accept()`` or ``socket()`` of its one I/O thread, which
    runs every data connection of the engine: while it waits, no session
    moves (seen as a 10 s stall of a fresh pair's first writes in a vLLM
    worker whose accepted lanes reached descriptor 127, docs/reliability.md
    "A stalled first write"). A table never shrinks: grown once here, before
    the engine starts, the wait is off the data path for the process's
    life. One ``F_DUPFD`` at the size (it never replaces an open
    descriptor), closed at once."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(count, soft) - 1
    if target < 64:
        return 0
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.close(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, target))
    except OSError:  # no descriptor free at or above target: the table is that large already
        return 0
    finally:
        os.close(fd)
    return target + 1


def keep_forever(obj) -> None:
    """Take a reference that is never given back: ``obj`` is never destroyed."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


@contextlib.contextmanager
def stderr_discarded(discard: bool):
    """Discard what is written to file descriptor 2 (the engine's C++ logs)
    inside the block, when ``discard``; the whole process's standard error
    is affected for that time (about a millisecond)."""
    if not discard:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def apply_mooncake_env(engine: EngineConfig) -> dict[str, str]:
    """Fill in the ``MC_*`` variables ``engine`` needs that are not set yet
    (process-wide: Mooncake reads them from the environment when an engine is
    built). A variable already set, by the user or earlier, is never changed.
    Returns the variables this call set."""
    added = {}
    for key, value in engine.mooncake_env().items():
        if key not in os.environ:
            os.environ[key] = added[key] = value
    _SET_HERE.update(added)
    return added


# The MC_* variables kvferry set in this process (so not the user's).
_SET_HERE: dict[str, str] = {}


def quiet_engine_start(engine: EngineConfig) -> bool:
    """Whether to discard the engine's start-up logs: ``log_level`` is
    ``OFF`` and ``MC_LOG_LEVEL`` is unset or was set by kvferry."""
    value = os.environ.get("MC_LOG_LEVEL")
    return engine.log_level == "OFF" and (value is None or _SET_HERE.get("MC_LOG_LEVEL") == value)


# The wheels whose engine moves device memory (on TCP through a bounce
# buffer, on RDMA by GPUDirect); ``mooncake-transfer-engine-non-cuda`` hands
# device pointers to sockets and fails at the first transfer.
CUDA_BUILDS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine-efa",
               "mooncake-transfer-engine-efa-cuda13")


def installed_builds() -> list[str]:
    """The distributions that installed the ``mooncake`` module (empty for a
    build from source, or none)."""
    import importlib.metadata
    return sorted(importlib.metadata.packages_distributions().get("mooncake", []))


def check_engine_build(device_type: str, builds: list[str] | None = None) -> None:
    """Raise TransferError when the installed Mooncake wheel cannot move
    memory of ``device_type`` (``cuda``: a CUDA build is needed). A build
    from source (no wheel) is trusted. Imports no Mooncake."""
    if device_type == "cpu":
        return
    builds = installed_builds() if builds is None else builds
    if not builds or any(b in CUDA_BUILDS for b in builds):
        return
    raise TransferError(f"the pools are {device_type} memory, but the Mooncake engine installed is "
                        f"{', '.join(builds)}, which cannot read or write device memory: install "
                        f"mooncake-transfer-engine (CUDA 12) or mooncake-transfer-engine-cuda13 instead "
                        f"(`make test-gpu` sets one up)")
