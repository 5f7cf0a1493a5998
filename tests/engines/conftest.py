"""Engine tests: a failed test's report carries what the servers it ran
said (``harness.vllm.failure_report``): a crashed server's log tail (the
test itself sees only a refused connection), else kvferry's last lines."""

import pytest

from harness.vllm import failure_report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, text in failure_report():
            report.sections.append((title, text))
