"""``python -m bootstrap --host H --port P``: run the bootstrap server."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from bootstrap.server import DEFAULT_PORT, BootstrapServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bootstrap", description="kvferry bootstrap server")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks one)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--secret-file", help="file holding the shared secret that authenticates every message "
                        "(default: the KVFERRY_SECRET environment variable; neither: no authentication)")
    parser.add_argument("--rank-ttl", type=float, default=15.0,
                        help="drop a prefill rank not re-registered for this many seconds (ranks re-register "
                             "every 2 s by default; 0 keeps ranks forever; default 15)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    secret = os.environ.get("KVFERRY_SECRET") or None
    if args.secret_file:
        try:
            with open(args.secret_file, "rb") as f:
                secret = f.read().strip() or None
        except OSError as exc:
            print(f"error: cannot read --secret-file: {exc}", file=sys.stderr)
            return 1
        if secret is None:
            print(f"error: --secret-file {args.secret_file} is empty", file=sys.stderr)
            return 1
    try:
        server = BootstrapServer(args.host, args.port, secret=secret, rank_ttl_s=args.rank_ttl)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.close(0))
    # The line tests and launch scripts wait for; it names the bound port.
    auth = " (authenticated)" if secret else ""
    print(f"kvferry bootstrap{auth} listening on {server.address}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
