"""A prefill "model" that writes each chunk's KV late, on a side stream: the
producer-stream race of the GPU suite (tests/gpu).

:class:`SideStreamProducer` keeps the true content of a rank's CUDA pools,
zeroes the pools, and for each chunk queues on a side stream a
``torch.cuda._sleep`` (a busy kernel) and then the copy of the chunk's pages;
it returns an event recorded after the copy. A sender that reads the pages
before the event completed sends zeros; one that honours the event
(``KVSender.send(..., ready=event)``) sends the true bytes.
"""

from __future__ import annotations

import torch


class SideStreamProducer:
    def __init__(self, tensors: dict, sleep_cycles: int) -> None:
        """``tensors``: role -> component -> [per-layer CUDA tensor], as
        :func:`harness.workload.build_pools` returns them."""
        self._pairs, self._layers = [], []  # (pool tensor, its true content); its layer in the room's numbering
        first = 0  # the room's layers: the target pool's, then the draft pool's (transfer.rooms.layer_groups)
        for bufs in tensors.values():
            for ts in bufs.values():
                for layer, t in enumerate(ts):
                    self._pairs.append((t, t.clone()))
                    self._layers.append(first + layer)
                    t.zero_()
            first += max((len(ts) for ts in bufs.values()), default=0)
        device = self._pairs[0][0].device
        torch.cuda.synchronize(device)  # the zeros are in place before any transfer
        self._stream = torch.cuda.Stream(device=device)
        self._device = device
        self._cycles = sleep_cycles

    def write(self, pages) -> torch.cuda.Event:
        """Queue the late write of ``pages`` (prefill page ids); returns the
        event that completes after it."""
        idx = torch.as_tensor(pages, dtype=torch.int64).to(self._device)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # idx is ready
        idx.record_stream(self._stream)  # not reused by the allocator before the side stream is done with it
        with torch.cuda.stream(self._stream):
            torch.cuda._sleep(self._cycles)
            for t, truth in self._pairs:
                t.index_copy_(0, idx, truth.index_select(0, idx))
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def write_groups(self, pages, groups) -> list:
        """Queue the late write of ``pages`` layer group by layer group (a
        forward pass finishing its layers in order): per group, a busy
        kernel and then the copy of its layers; returns one event per group,
        recorded after its copy."""
        idx = torch.as_tensor(pages, dtype=torch.int64).to(self._device)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        idx.record_stream(self._stream)
        events = []
        with torch.cuda.stream(self._stream):
            for group in groups:
                wanted = set(group)
                torch.cuda._sleep(self._cycles // max(1, len(groups)))
                for (t, truth), layer in zip(self._pairs, self._layers):
                    if layer in wanted:
                        t.index_copy_(0, idx, truth.index_select(0, idx))
                event = torch.cuda.Event()
                event.record(self._stream)
                events.append(event)
        return events
