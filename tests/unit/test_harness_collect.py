"""harness.launch.collect: a process that outlives its deadline is killed,
and with ``dump_first`` it first prints where its threads are (the example
nodes register SIGUSR1 with faulthandler: examples.node_common)."""

import os
import subprocess
import sys
import tempfile
import time

from harness.launch import collect

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUCK = ("from examples.node_common import dump_stacks_on_sigusr1\n"
         "import time\n"
         "dump_stacks_on_sigusr1()\n"
         "print('started', flush=True)\n"
         "def stuck_here():\n"
         "    time.sleep(600)\n"
         "stuck_here()\n")


def _start(code: str):
    out = tempfile.TemporaryFile(mode="w+")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + 60
    while "started" not in (out.seek(0) or out.read()):
        assert proc.poll() is None and time.monotonic() < deadline, "the process did not start"
        time.sleep(0.05)
    return proc, out


def test_a_node_past_its_deadline_says_where_it_was_before_it_is_killed():
    proc, out = _start(STUCK)
    log = collect(proc, out, time.monotonic() + 0.2, dump_first=True)
    assert proc.returncode == -9
    assert "in stuck_here" in log, log


def test_without_dump_first_it_is_only_killed():
    proc, out = _start(STUCK)
    log = collect(proc, out, time.monotonic() + 0.2)
    assert proc.returncode == -9
    assert "stuck_here" not in log, log
