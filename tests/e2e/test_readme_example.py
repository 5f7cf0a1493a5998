"""The README's scheduler example: it is ``examples/one_host.py`` word for word,
and it runs: a prefill and a decode KVManager move one request's random KV
through the real Mooncake engine over TCP loopback in two chunks, and the
example exits 0 only when every byte arrived."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "one_host.py"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.S | re.M)


def test_the_readme_shows_examples_one_host_verbatim():
    blocks = python_blocks((REPO / "README.md").read_text())
    example = EXAMPLE.read_text()
    assert example in blocks, ("README.md has no ```python block identical to examples/one_host.py; "
                               "paste the file into the README again")


def test_python_blocks_are_found_whole():
    text = "a\n```python\nx = 1\n\ny = 2\n```\nb\n```python\nz\n```\n"
    assert python_blocks(text) == ["x = 1\n\ny = 2\n", "z\n"]


def test_examples_one_host_moves_the_pages_byte_for_byte():
    env = {"OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR", **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "examples.one_host"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "arrived byte for byte" in proc.stdout, proc.stdout
