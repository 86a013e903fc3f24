"""A stand-in ``transformer_engine`` so Megatron-Bridge imports on a machine without CUDA.

Bridge and megatron-core import Transformer Engine at module level, and it installs only
with CUDA. Every ``transformer_engine.*`` module and attribute resolves to a placeholder
class; calling or instantiating one records the call in ``CALLS`` and raises, so a test can
assert the config path (ConfigContainer, validate()) never used it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

CALLS: list[str] = []
VERSION = "2.10.0"  # the oldest release Bridge 0.3.1 accepts (transformer-engine>=2.10.0a0)


class _Placeholder(type):
    """A class whose attributes are placeholders too and whose instantiation is recorded."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"__module__": f"{cls.__module__}.{cls.__qualname__}"})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        CALLS.append(f"{cls.__module__}.{cls.__qualname__}")
        raise RuntimeError(f"transformer_engine stub called: {CALLS[-1]}")


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {"__module__": self.__name__})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] != "transformer_engine":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Serve ``transformer_engine`` from the stub in this process (only where none is installed)."""
    if importlib.util.find_spec("transformer_engine") is None:
        sys.meta_path.insert(0, _Finder())
