"""Preloaded into a fork server by tests/unit/test_forkserver.py: a module
that reads the temp directory at import, as engine modules do."""

import tempfile

TEMPDIR = tempfile.gettempdir()
