"""Device-independent compatibility of Megatron-LM 285068c with the installed torch and numpy.

``import mindio_ttp.compat`` applies the fixes of :mod:`.torch_drift` that this torch and numpy
need (feature checks in :mod:`.features`, the one place where versions differ) and nothing
else. ``ttp-patch apply`` puts that import in ``pretrain_gpt.py`` right after ``import torch``
for every ``--device`` (npu, cuda, cpu), before the device adaptor and before any Megatron
import: ``megatron_npu`` and ``mindio_ttp.cpu_adaptor`` import Megatron modules (clip_grads
among them) while they patch it. Importing it after Megatron raises :class:`CompatError`
without changing anything; importing it again is a no-op. ``python -m mindio_ttp.compat``
prints what this machine's torch needs.
"""

from __future__ import annotations

import sys
import threading
from typing import List, Optional

from .journal import Journal

_lock = threading.Lock()
_journal: Optional[Journal] = None
_applied: List[str] = []


class CompatError(RuntimeError):
    """The compatibility layer cannot be installed; the message says what to do."""


def imported_megatron_modules() -> List[str]:
    """Megatron modules already in ``sys.modules`` (a patch applied after them half works)."""
    return sorted(n for n in sys.modules if n == "megatron" or n.startswith("megatron."))


def is_installed() -> bool:
    """Whether :func:`install` ran in this process (and was not undone)."""
    return _journal is not None


def applied() -> List[str]:
    """The fixes this process got (empty when the installed torch and numpy need none)."""
    return list(_applied)


def install() -> List[str]:
    """Apply the fixes this torch needs, once; return their names.

    Raises :class:`CompatError` (and changes nothing) when Megatron was imported first:
    ``from torch._six import inf`` has then already failed or bound something else.
    """
    global _journal, _applied
    with _lock:
        if _journal is not None:
            return list(_applied)
        early = imported_megatron_modules()
        if early:
            raise CompatError(
                "mindio_ttp.compat must be imported before any Megatron module, but "
                f"{', '.join(early[:3])}{' ...' if len(early) > 3 else ''} is already imported. "
                "Import it right after `import torch` at the top of the entry script "
                "(`ttp-patch apply` puts it there)."
            )
        from . import torch_drift

        journal = Journal()
        try:
            done = torch_drift.install(journal)
        except BaseException:
            journal.undo()
            raise
        _journal, _applied = journal, done
        return list(done)


def uninstall() -> None:
    """Revert every fix (for tests; a process running Megatron never needs it)."""
    global _journal, _applied
    with _lock:
        if _journal is None:
            return
        _journal.undo()
        _journal, _applied = None, []


__all__ = ["CompatError", "applied", "imported_megatron_modules", "install", "is_installed",
           "uninstall"]

install()
