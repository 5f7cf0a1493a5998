"""Engine conformance tests (tests/engines/<engine>) run only where the engine is
installed: `make test-engines` builds each engine's own virtual environment
(mk/*.mk); `make test` stays free of them."""

import importlib.util

collect_ignore = [f"engines/{engine}" for engine in ("sglang", "vllm") if importlib.util.find_spec(engine) is None]
