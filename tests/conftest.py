"""Engine conformance tests (tests/engines/<engine>) run only where the engine is
installed: `make test-engines` builds each engine's own virtual environment
(mk/*.mk); `make test` stays free of them."""

import importlib.util

collect_ignore = [f"engines/{engine}" for engine in ("sglang", "vllm") if importlib.util.find_spec(engine) is None]

# The quick scale test (tests/scale) runs under `make test-scale` (CI runs it after
# `make test`), not in the default run: about a minute of two busy cores.
collect_ignore.append("scale")

# Rank processes fork from a warm interpreter that imported torch once
# (harness/forkserver.py): about 3 CPU-s less per process on this 2-core VM.
# KVFERRY_FORKSERVER=0 starts each with exec instead.
import os  # noqa: E402

os.environ.setdefault("KVFERRY_FORKSERVER", "1")
