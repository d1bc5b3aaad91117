"""Undo log for every change the compatibility layer and the CPU adaptor make, so a failed
install leaves nothing behind.

Installing touches torch, numpy, ``sys.modules``, ``sys.meta_path`` and the environment.
Each change goes through a :class:`Journal` that remembers the previous value; if any step
raises, :meth:`Journal.undo` restores all earlier ones (no half-installed adaptor), and the
unit tests use the same undo to install and remove the adaptor inside one pytest process.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import ModuleType
from typing import Any, Callable, List

_MISSING = object()


class Journal:
    """Ordered list of reversible changes."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, restoring the old value (or its absence) on undo."""
        old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        setattr(obj, name, value)

        def restore() -> None:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        self._undo.append(restore)

    def wrap(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``obj.name`` with ``make(original)``."""
        self.setattr(obj, name, make(getattr(obj, name)))

    def add_module(self, module: ModuleType) -> None:
        """Register ``module`` in ``sys.modules`` under its ``__name__``."""
        name = module.__name__
        old = sys.modules.get(name, _MISSING)
        sys.modules[name] = module

        def restore() -> None:
            if old is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old

        self._undo.append(restore)

    def prepend_meta_path(self, finder: Any) -> None:
        sys.meta_path.insert(0, finder)
        self._undo.append(lambda: sys.meta_path.remove(finder))

    def atexit(self, fn: Callable[[], None]) -> None:
        """``atexit.register(fn)``, unregistered on undo."""
        atexit.register(fn)
        self._undo.append(lambda: atexit.unregister(fn))

    def setenv_default(self, key: str, value: str) -> None:
        """``os.environ.setdefault``; undo only removes it if this journal set it."""
        if key in os.environ:
            return
        os.environ[key] = value
        self._undo.append(lambda: os.environ.pop(key, None))

    def undo(self) -> None:
        """Revert every change, newest first."""
        while self._undo:
            self._undo.pop()()
