"""``python -m bootstrap [serve] --host H --port P``: run the bootstrap server.
``python -m bootstrap status --addr H:P [--json]``: print what one has registered.

The secret comes from ``--secret-file`` or else the ``KVFERRY_SECRET``
environment variable; ``KVFERRY_INSECURE=1`` is ``--insecure``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from bootstrap.errors import InsecureBindError, KVFerryError
from bootstrap.server import DEFAULT_PORT, BootstrapServer, ServerConfig

_SECRET_HELP = ("file holding the shared secret that authenticates every message "
                "(default: the KVFERRY_SECRET environment variable; neither: no authentication)")


def _secret(path: str | None) -> bytes | str | None:
    """The configured secret; raises OSError/ValueError for a bad file."""
    if not path:
        return os.environ.get("KVFERRY_SECRET") or None
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read --secret-file: {exc}") from exc
    if not secret:
        raise ValueError(f"--secret-file {path} is empty")
    return secret


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _env_log_level() -> str:
    """KVFERRY_LOG_LEVEL, as the ranks read it (TRACE is DEBUG, CRITICAL is
    ERROR here); INFO when unset or unknown."""
    level = os.environ.get("KVFERRY_LOG_LEVEL", "").upper()
    level = {"TRACE": "DEBUG", "CRITICAL": "ERROR"}.get(level, level)
    return level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO"


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bootstrap", description="kvferry bootstrap server "
                                     "(`python -m bootstrap status --help`: the status view)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks one)")
    parser.add_argument("--log-level", default=_env_log_level(), choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="default INFO, or KVFERRY_LOG_LEVEL (TRACE counts as DEBUG)")
    parser.add_argument("--secret-file", help=_SECRET_HELP)
    parser.add_argument("--insecure", action="store_true", default=_env_flag("KVFERRY_INSECURE"),
                        help="allow a non-loopback --host without a secret (default: refuse; "
                             "KVFERRY_INSECURE=1 sets this)")
    parser.add_argument("--rank-ttl", type=float, default=15.0,
                        help="drop a prefill rank not re-registered for this many seconds (ranks re-register "
                             "every 2 s by default; 0 keeps ranks forever; default 15)")
    parser.add_argument("--node-grace-s", type=float, default=4.0,
                        help="for this long after start a lookup of a node no rank registered is 'not ready' "
                             "(ranks re-register every 2 s); after it, 'unknown node' (default 4)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on this port, on --host (needs prometheus-client)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        secret = _secret(args.secret_file)
        config = ServerConfig(host=args.host, port=args.port, secret=secret, rank_ttl_s=args.rank_ttl,
                              node_grace_s=args.node_grace_s, insecure=args.insecure,
                              metrics_port=args.metrics_port)
        server = BootstrapServer(config)
    except (OSError, ValueError, KVFerryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InsecureBindError) else 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.close(0))
    # The line tests and launch scripts wait for; it names the bound port.
    auth = " (authenticated)" if secret else ""
    print(f"kvferry bootstrap{auth} listening on {server.address}", flush=True)
    if server.metrics.port is not None:
        print(f"kvferry bootstrap metrics on http://{server.host}:{server.metrics.port}/metrics", flush=True)
    server.serve_forever()
    return 0


def status(argv: list[str]) -> int:
    from bootstrap.client import BootstrapClient
    from bootstrap.status import status_json, status_table

    parser = argparse.ArgumentParser(prog="python -m bootstrap status",
                                     description="print the ranks a kvferry bootstrap server has registered")
    parser.add_argument("--addr", default=f"127.0.0.1:{DEFAULT_PORT}", help="the server, HOST:PORT")
    parser.add_argument("--secret-file", help=_SECRET_HELP)
    parser.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="give up after this long (default 5)")
    args = parser.parse_args(argv)
    try:
        with BootstrapClient(args.addr, timeout_s=args.timeout_s, secret=_secret(args.secret_file)) as client:
            reply = client.status()
    except (OSError, ValueError, KVFerryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(status_json(reply, args.addr) if args.json else status_table(reply, args.addr))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "status":
        return status(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
