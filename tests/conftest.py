"""Root test configuration: engine tests (tests/engines) need their engine's
environment (``make test-vllm`` builds it); elsewhere they are not collected."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore.append("engines")
