"""Patch a module right after it loads: the import hook the ``sitecustomize``
files of test and benchmark servers use to correct an engine for this CPU
(``benchmarks/sglang_site``, ``tests/engines/sglang_server/hicache_site``),
never the library. A ``sitecustomize`` loads this file by path
(``runpy.run_path``): the server's ``sys.path`` need not hold the repository.
"""

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module named in ``patches`` it wraps the
    module's loader so that ``patches[name](module)`` runs once the module
    has executed."""

    def __init__(self, patches: dict[str, Callable]) -> None:
        self.patches = dict(patches)

    def find_spec(self, fullname, path=None, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install(patches: dict[str, Callable]) -> PatchAfterImport:
    """Patch each module named in ``patches`` when it is first imported."""
    finder = PatchAfterImport(patches)
    sys.meta_path.insert(0, finder)
    return finder
