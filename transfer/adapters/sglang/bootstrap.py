"""SGLang's bootstrap server slot, filled by kvferry's bootstrap server.

The prefill TokenizerManager starts it on ``--disaggregation-bootstrap-port``
(8998) and ``--host``; prefill ranks register with it, decode ranks look them
up (``bootstrap_host:bootstrap_port`` of each request)."""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from bootstrap.server import BootstrapServer
from transfer.config import Role, manager_config_from_env

log = logging.getLogger("kvferry.sglang")


def bind_host(host: str | None) -> str:
    """SGLang's ``--host`` as a ZMQ bind address."""
    if not host or host == "localhost":
        return "127.0.0.1"
    return host


class KvferryKVBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int) -> None:
        secret = manager_config_from_env(Role.PREFILL).secret or None
        self.server = BootstrapServer(bind_host(host), int(port), secret=secret).start()
        self.host, self.port = self.server.host, self.server.port
        log.info("kvferry bootstrap server listening on %s", self.server.address)

    def close(self) -> None:
        self.server.close()
