"""Run by tests/unit/test_forkserver.py as ``python -m tests.unit._forkchild``."""

import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    line = sys.stdin.readline().strip()
    sys.stdout.write(json.dumps({"argv": sys.argv[1:], "argv0": sys.argv[0], "pid": os.getpid(), "cwd": os.getcwd(),
                                 "path0": sys.path[0], "var": os.environ.get("FORKCHILD_VAR"), "stdin": line,
                                 "torch_loaded": "torch" in sys.modules, "main": __name__,
                                 "tmpdir": tempfile.gettempdir(),
                                 "preloaded_tempdir": getattr(sys.modules.get("tests.unit._forkpreload"), "TEMPDIR", None),
                                 "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else 0}) + "\n")
    sys.stdout.flush()
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[2]))
