"""Put on PYTHONPATH for the HiCache servers of ``test_hicache_server.py`` only
(tests; never for other servers, never in the library): three stand-ins that
let SGLang 0.5.23's hierarchical cache run on this small CPU-only machine.
Each patches one attribute of SGLang's host-pool modules right after they
load; kvferry's code is not touched (its HiCache backend,
``transfer.adapters.sglang.hicache``, runs as on a GPU server).

- **Host pool unpinned** (``mem_cache/pool_host/common.py``,
  ``ALLOC_MEMORY_FUNCS``). On a GPU SGLang allocates the host (L2) pool and
  pins it with ``cudaHostRegister`` so the GPU's copy engines read and write it
  asynchronously; its table has entries for npu, musa and xpu, and every other
  device (cpu included) gets ``alloc_with_host_register``, which pins. Without
  CUDA the pin raises at start-up ("Torch not compiled with CUDA enabled", in
  ``_cuda_host_register``). Here the "device" pool is host memory too: nothing
  to pin, so a ``cpu`` entry allocates the same buffer unpinned.
- **Device <-> host copies** (``mem_cache/pool_host/mha.py``,
  ``transfer_kv_direct``). On a GPU ``sgl_kernel.kvcacheio.transfer_kv_direct``
  copies a batch of tokens between the device pool's and the host pool's
  per-layer K and V tensors (``--hicache-io-backend direct``, layout
  ``layer_first``); ``mha.py`` imports it only on CUDA/ROCm (XPU from its own
  table), so on a CPU the name is unbound and the first backup raises
  ``NameError``. The stand-in is the same copy as a torch index copy,
  ``dst[dst_indices] = src[src_indices]`` per tensor. The ``kernel`` io backend
  would need pointer-table kernels (``transfer_kv_per_layer``,
  ``transfer_kv_all_layer``): the servers run ``direct``.
- **Host-memory reserve** (``mem_cache/pool_host/base.py``,
  ``HICACHE_HOST_MEMORY_RESERVE_BYTES``). SGLang sizes and checks a host pool
  against the host's available memory less 10 GiB kept for the OS, sensible on
  a GPU server with hundreds of GiB. This 24 GiB test machine runs five servers
  at once beside other work: with less than 10 GiB available SGLang refuses
  even the tests' 32 MiB pools ("No host memory is left for HiCache after the
  10 GiB reserve"). The stand-in keeps 1 GiB; the pools stay as small.

Nothing else needs standing in: the cache controller's streams and events come
from ``get_device_module()``, which is ``torch.cpu`` without an accelerator
(no-op ``Stream``/``Event``). Also runs the torchvision stand-in every SGLang
process here needs (``tests/engines/sglang/stubs``: one ``sitecustomize`` is
loaded per interpreter).
"""

import os
import runpy

_HERE = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(_HERE, "..", "..", "sglang", "stubs", "sitecustomize.py"))


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """SGLang's own allocation (its allocator, its sizes), without the CUDA pin."""
    from sglang.srt.mem_cache.pool_host.common import alloc_with_host_register

    return alloc_with_host_register(dims, dtype, device, False, allocator, registration_granularity_bytes)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` on the CPU: each tensor's
    rows ``src_indices`` into the paired tensor's rows ``dst_indices``."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)]


def _unpin_host_pools(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned


def _copy_with_torch(module) -> None:
    module.transfer_kv_direct = transfer_kv_direct


def _reserve_less_host_memory(module) -> None:
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1024**3


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": _unpin_host_pools,
    "sglang.srt.mem_cache.pool_host.mha": _copy_with_torch,
    "sglang.srt.mem_cache.pool_host.base": _reserve_less_host_memory,
}


runpy.run_path(os.path.join(_HERE, "..", "..", "..", "..", "harness", "after_import.py"))["install"](_PATCHES)
