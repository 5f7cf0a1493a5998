"""harness.lines.emit: a tagged line is one write, whole even when threads
emit at once (the engine suites' rank processes emit from several)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

_CHILD = textwrap.dedent("""
    import sys, threading
    from harness import lines
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    def run(tag):
        for i in range(3000):
            lines.emit(tag, {"i": i})
    threads = [threading.Thread(target=run, args=(t,)) for t in ("A", "B", "C")]
    for t in threads: t.start()
    for t in threads: t.join()
""")


def test_lines_emitted_by_threads_at_once_arrive_whole():
    """(``print(line, flush=True)`` in their place left 145-259 of the 9000 lines
    broken in each of three runs: a line and its newline are two writes.)"""
    got = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout.splitlines()
    assert len(got) == 9000
    for tag in "ABC":
        assert sorted(json.loads(line[2:])["i"] for line in got if line.startswith(tag + " ")) == list(range(3000))
