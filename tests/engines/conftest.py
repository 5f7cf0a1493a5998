"""Engine tests: a failed test's report carries what the servers it ran
said (``harness.vllm.failure_report``): a crashed server's log tail (the
test itself sees only a refused connection), else kvferry's last lines.
Every process a suite starts keeps its temporary files in the suite's own
directory, removed when the suite ends (``engine_tempdir``)."""

import getpass
import os
import shutil
import tempfile

import pytest

from harness.vllm import failure_report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, text in failure_report():
            report.sections.append((title, text))


@pytest.fixture(scope="session", autouse=True)
def engine_tempdir(tmp_path_factory):
    """``TMPDIR`` for the whole session: a directory of the suite's own,
    removed at its end. The engines name sockets and directories in the temp
    directory (SGLang's ZMQ ipc paths, both engines' Prometheus multiprocess
    directories) and a killed or crashed server unlinks none of them: they
    piled up in the machine's temp directory by the dozen each run. pytest's
    own ``tmp_path`` root is fixed before, so a failed test's files are
    kept as usual, and torch's compile cache stays where torch keeps it by
    default (warm from one run to the next)."""
    tmp_path_factory.getbasetemp()
    scratch = tempfile.mkdtemp(prefix="kvferry-engine-tmp-")
    with pytest.MonkeyPatch.context() as env:
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            env.setenv("TORCHINDUCTOR_CACHE_DIR",
                       os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
        env.setenv("TMPDIR", scratch)
        env.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
        yield scratch
    shutil.rmtree(scratch, ignore_errors=True)
