"""A stand-in ``torchvision`` for SGLang's test processes (tests only).

SGLang's server modules import ``torchvision`` and ``torchvision.transforms``
at import time (image processors of vision models), and every PyPI build of
torchvision pulls or needs a CUDA torch. Nothing on the KV transfer path uses
it. With this directory on PYTHONPATH, any ``torchvision[.x.y]`` imports as a
module whose attributes are inert placeholder classes (subclassable, callable,
hashable), so those imports succeed; using one for real would be a test bug.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(name: str):
    return _PlaceholderMeta(name, (), {"__init__": lambda self, *a, **k: None,
                                       "__call__": lambda self, *a, **k: None})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())
