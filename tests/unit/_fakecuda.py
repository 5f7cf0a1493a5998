"""A duck-typed "CUDA" tensor backed by host memory, and fake events: what
the GPU path's CPU tests use to check that code refuses or handles device
memory before it touches a byte, and that it honours a producer's event."""

from __future__ import annotations

import threading

import torch


class FakeCudaTensor:
    """A CPU tensor that says it lives on ``cuda:index``. Host-only calls a
    real CUDA tensor refuses (``numpy()``, ``np.asarray``) raise TypeError as
    theirs do; ``cpu()`` is counted."""

    is_cuda = True

    def __init__(self, t: torch.Tensor, index: int = 0) -> None:
        self._t = t
        self.device = torch.device("cuda", index)
        self.cpu_calls = 0

    def cpu(self) -> torch.Tensor:
        self.cpu_calls += 1
        return self._t

    def numpy(self):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy")

    def __array__(self, *args, **kwargs):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy")

    def __getitem__(self, index) -> FakeCudaTensor:
        return FakeCudaTensor(self._t[index], self.device.index)

    def __len__(self) -> int:
        return len(self._t)

    def __getattr__(self, name):
        return getattr(self._t, name)


def fake_cuda(tensors, index: int = 0) -> list[FakeCudaTensor]:
    return [FakeCudaTensor(t, index) for t in tensors]


class FakeEvent:
    """A producer's event: incomplete until ``complete()``; counts queries."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.num_queries = 0
        self.query_threads: set[str] = set()

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        self.num_queries += 1
        self.query_threads.add(threading.current_thread().name)
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class SyncOnlyEvent:
    """An event that can only block (no ``query``); records the threads that did."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.threads: list[str] = []

    def complete(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self.threads.append(threading.current_thread().name)
        assert self._done.wait(10), "the event was never completed"
