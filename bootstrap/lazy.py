"""Lazy package exports (PEP 562), so that importing one light module of a
package does not import every heavy one through its ``__init__``."""

from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, exports: dict[str, str]):
    """``__getattr__`` and ``__dir__`` for a package whose name ``X`` lives in
    module ``exports[X]``; each is imported on first use and cached."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(exports)

    return __getattr__, __dir__
