"""Self-registration with vllm-router's worker discovery (the vLLM connector's ``kvferry_router_discovery``).

vllm-router started with ``--vllm-discovery-address HOST:PORT`` (instead of
``--prefill``/``--decode`` URLs) learns its PD workers from the workers
themselves: each instance sends, every few seconds, one msgpack map
``{"type": "P"|"D", "http_address": "host:port", "zmq_address": ...,
"dp_size": ..., "tp_size": ...}`` from a ZMQ DEALER socket to that address
(the protocol of vLLM's MoRI-IO connector, which registers so). The router
answers ``503 Waiting for discovered workers`` until it has a prefill and
a decode, and forgets a worker that stops registering.

kvferry's connector registers from TP rank 0's worker when
``kvferry_router_discovery`` is set (``kvferry_http_address``: the
address the router sends this server's requests to); a daemon thread,
never the engine's step. A router that is not there (yet) costs nothing:
nothing is queued for it (``ZMQ_IMMEDIATE``); the next round tries again.
"""

from __future__ import annotations

import logging
import threading

import msgpack
import zmq

log = logging.getLogger("kvferry.vllm")

#: Seconds between registrations (vLLM's MoRI-IO connector: 3).
INTERVAL_S = 2.0


class DiscoveryHeartbeat:
    """Sends ``payload`` to ``tcp://<router>`` every ``interval_s`` from a daemon thread."""

    def __init__(self, router: str, payload: dict, interval_s: float = INTERVAL_S) -> None:
        self.router, self.payload, self.interval_s = router, dict(payload), interval_s
        self.num_sent = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="kvferry-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        message = msgpack.packb(self.payload)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a router that is not connected
        try:
            sock.connect(f"tcp://{self.router}")
            while not self._stop.is_set():
                try:
                    sock.send(message, zmq.NOBLOCK)
                    self.num_sent += 1
                except zmq.Again:
                    pass  # not connected (yet): the next round tries again
                self._stop.wait(self.interval_s)
        except zmq.ZMQError as exc:
            log.warning("kvferry: registration with vllm-router at %s stopped: %s", self.router, exc)
        finally:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.interval_s + 1.0)
