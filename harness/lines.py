"""The tagged lines a rank process prints for its driver (``READY``,
``REPLY``, ``RESULT``)."""

from __future__ import annotations

import json
import os
import sys


def emit(tag: str, payload: object = None) -> None:
    """Print ``TAG JSON`` as one line in one write.

    The engines' C++ threads log to stderr, which the drivers merge into the
    same pipe or file; ``print`` writes a line and its newline separately
    where stdout is unbuffered (``PYTHONUNBUFFERED``), so a log line could
    land inside a tagged line. One ``write`` of the whole line cannot be
    split (a pipe keeps writes of up to ``PIPE_BUF`` whole; a file, any)."""
    line = tag if payload is None else f"{tag} {json.dumps(payload)}"
    sys.stdout.flush()
    data = (line + "\n").encode()
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]
