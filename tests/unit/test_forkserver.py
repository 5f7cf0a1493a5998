"""harness.forkserver: a forked rank process looks to its driver like
``python -m MODULE`` started with exec (arguments, environment, working
directory, streams, exit status, signals)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import forkserver

REPO = str(Path(__file__).resolve().parents[2])


def _spawn(args, tmp_path, **env):
    full = {**os.environ, "KVFERRY_FORKSERVER": "1", "PYTHONPATH": REPO, **env}
    return forkserver.spawn_module("tests.unit._forkchild", args, env=full, cwd=str(tmp_path),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    monkeypatch.setenv("KVFERRY_FORKSERVER", "1")
    monkeypatch.setenv("PYTHONPATH", REPO)


def test_a_forked_child_runs_the_module_as_python_m_would(tmp_path):
    proc = _spawn(["exit", "3", "x y"], tmp_path, FORKCHILD_VAR="seen")
    assert isinstance(proc, forkserver.ForkedProcess)  # not the exec fallback
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    got = json.loads(proc.stdout.readline())
    assert proc.wait(30) == 3 and proc.returncode == 3
    assert got["argv"] == ["exit", "3", "x y"] and got["argv0"].endswith("_forkchild.py")
    assert got["pid"] == proc.pid != os.getpid()
    assert got["cwd"] == got["path0"] == str(tmp_path)
    assert got["var"] == "seen" and got["stdin"] == "hello" and got["main"] == "__main__"
    assert got["torch_loaded"]  # inherited from the warm server, not imported by the child


def test_a_killed_child_reports_the_signal_and_wait_is_bounded(tmp_path):
    proc = _spawn(["sleep", "0"], tmp_path)
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["pid"] == proc.pid
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_children_whose_startup_variables_differ_fork_from_a_server_started_with_them(tmp_path):
    got = {}
    for threads in ("1", "2", "1"):
        proc = _spawn(["exit", "0"], tmp_path, OMP_NUM_THREADS=threads)
        assert isinstance(proc, forkserver.ForkedProcess)
        proc.stdin.write("\n")
        proc.stdin.flush()
        got[threads] = json.loads(proc.stdout.readline())["torch_threads"]
        assert proc.wait(30) == 0
    assert got == {"1": 1, "2": 2}  # torch read OMP_NUM_THREADS when its server imported it


def test_without_the_variable_it_is_plain_exec(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_FORKSERVER", "0")
    proc = forkserver.spawn_module("tests.unit._forkchild", ["exit", "0"], env={**os.environ, "PYTHONPATH": REPO},
                                   cwd=str(tmp_path), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    assert sys.executable in proc.args


def test_stderr_pipe_is_refused_by_name():
    with pytest.raises(ValueError, match="stderr=PIPE"):
        forkserver.spawn_module("tests.unit._forkchild", [], env=dict(os.environ), stderr=subprocess.PIPE)


def test_a_child_finds_the_temp_directory_its_own_tmpdir_names(tmp_path):
    """The warm server read the temp directory (a preloaded module did, as
    engine modules do at import) under the first child's TMPDIR; a later
    child with another one (an engine suite's own) gets its own."""
    got = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        proc = _spawn(["exit", "0"], tmp_path, TMPDIR=str(tmp_path / name),
                      **{forkserver.PRELOAD_ENV: "tests.unit._forkpreload"})
        assert isinstance(proc, forkserver.ForkedProcess)
        proc.stdin.write("\n")
        proc.stdin.flush()
        got.append(json.loads(proc.stdout.readline()))
        assert proc.wait(30) == 0
    assert got[1]["preloaded_tempdir"] == str(tmp_path / "first")  # forked from the same warm server
    assert got[0]["tmpdir"] == str(tmp_path / "first") and got[1]["tmpdir"] == str(tmp_path / "second")
