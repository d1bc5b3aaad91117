"""Install / uninstall of the whole adaptor, all or nothing."""

from __future__ import annotations

import sys
import threading
from typing import List, Optional

from .journal import Journal

#: Megatron raises at arguments.py:337-345 without it when async TP all-reduce is on.
CUDA_MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"

_lock = threading.Lock()
_journal: Optional[Journal] = None


class CPUAdaptorError(RuntimeError):
    """The adaptor cannot be installed; the message says what to do."""


def _imported_megatron_modules() -> List[str]:
    return sorted(n for n in sys.modules if n == "megatron" or n.startswith("megatron."))


def is_installed() -> bool:
    """Whether the adaptor's patches are in place in this process."""
    return _journal is not None


def install() -> None:
    """Install every patch; a no-op when already installed.

    Raises :class:`CPUAdaptorError` (and changes nothing) when Megatron was imported first:
    patches applied after ``from megatron... import x`` bound the originals would only half
    work, which is worse than a clear refusal.
    """
    global _journal
    with _lock:
        if _journal is not None:
            return
        early = _imported_megatron_modules()
        if early:
            raise CPUAdaptorError(
                "mindio_ttp.cpu_adaptor must be imported before any Megatron module, but "
                f"{', '.join(early[:3])}{' ...' if len(early) > 3 else ''} is already imported. "
                "Import it right after `import torch` at the top of the entry script "
                "(`ttp-patch apply --device cpu` puts it there)."
            )
        from . import apex_standins, cuda_on_cpu, layer_norm, megatron_hooks, torch_drift

        journal = Journal()
        try:
            torch_drift.install(journal)
            cuda_on_cpu.install(journal)
            apex_standins.install(journal)
            layer_norm.install(journal)
            megatron_hooks.install(journal)
            journal.setenv_default(CUDA_MAX_CONNECTIONS_ENV, "1")
        except BaseException:
            journal.undo()
            raise
        _journal = journal


def uninstall() -> None:
    """Revert every patch (used by tests; a process running Megatron should never need it)."""
    global _journal
    with _lock:
        if _journal is None:
            return
        _journal.undo()
        _journal = None


__all__ = ["CPUAdaptorError", "install", "uninstall", "is_installed"]
