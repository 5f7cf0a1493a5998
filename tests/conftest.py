"""Engine conformance tests (tests/engines/<engine>) run only where the engine is
installed: `make test-sglang` builds SGLang's own virtual environment; `make test`
stays free of it."""

import importlib.util

collect_ignore = [f"engines/{engine}" for engine in ("sglang",) if importlib.util.find_spec(engine) is None]
