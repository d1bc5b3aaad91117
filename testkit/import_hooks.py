"""Run a function on a module right after it is imported, in processes the tests and
benchmarks launch (their ``sitecustomize`` hooks wrap Megatron's functions from outside the
tree). One finder for all of them, chained: each asks the finders after it for the module's
spec, so several hooks can wrap the same module (the dist audit and the fault hook both wrap
``megatron.training``) and each sees the others' wrapping."""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Callable

__all__ = ["after_import", "run_hook_file"]


def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` once module ``name`` has executed, the first time it is imported."""
    sys.meta_path.insert(0, _AfterImport(name, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        original, patch = spec.loader.exec_module, self.patch

        def exec_module(module: ModuleType) -> None:
            original(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_RAN: dict = {}  # hook file -> its module: each runs once per process, however chained


def run_hook_file(path: str, name: str = "_ttp_chained_hook") -> ModuleType:
    """Execute another hook's ``sitecustomize.py`` too (Python imports only the first one on
    ``sys.path``), e.g. the fault hook under the dist audit; once per process, so two hooks
    that both chain the fault hook (one of them chained by the other) install it once."""
    import importlib.util
    import os

    key = os.path.realpath(path)
    if key in _RAN:
        return _RAN[key]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the hook file {path}")
    module = importlib.util.module_from_spec(spec)
    _RAN[key] = module
    spec.loader.exec_module(module)
    return module
