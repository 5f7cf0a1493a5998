"""Start the bootstrap server that prefill ranks register with and decode ranks look up.

``python -m examples.bootstrap_server --host ADDR --port PORT``: the same
server as ``python -m bootstrap`` (it imports neither torch, Mooncake nor
``transfer``, so it also runs alone on any host). It prints
``kvferry bootstrap listening on HOST:PORT`` once it accepts requests and
runs until SIGINT or SIGTERM. Run it beside the prefill node, on an address
both nodes reach.
"""

from __future__ import annotations

import sys

from bootstrap.__main__ import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
