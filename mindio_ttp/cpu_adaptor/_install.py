"""Install / uninstall of the whole adaptor, all or nothing."""

from __future__ import annotations

import threading
from typing import Optional

from mindio_ttp.compat import imported_megatron_modules
from mindio_ttp.compat.journal import Journal

#: Megatron raises at arguments.py:337-345 without it when async TP all-reduce is on.
CUDA_MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"

_lock = threading.Lock()
_journal: Optional[Journal] = None


class CPUAdaptorError(RuntimeError):
    """The adaptor cannot be installed; the message says what to do."""


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
        early = imported_megatron_modules()
        if early:
            raise CPUAdaptorError(
                "mindio_ttp.cpu_adaptor must be imported before any Megatron module, but "
                f"{', '.join(early[:3])}{' ...' if len(early) > 3 else ''} is already imported. "
                "Import it right after `import torch` at the top of the entry script "
                "(`ttp-patch apply --device cpu` puts it there)."
            )
        import mindio_ttp.compat as compat

        compat_before = compat.is_installed()  # in a patched tree its own import line came first
        compat.install()
        from . import (
            apex_standins,
            cpu_torch,
            cuda_on_cpu,
            gloo_collectives,
            layer_norm,
            megatron_hooks,
        )

        journal = Journal()
        try:
            cpu_torch.install(journal)
            gloo_collectives.install(journal)
            cuda_on_cpu.install(journal)
            apex_standins.install(journal)
            layer_norm.install(journal)
            megatron_hooks.install(journal)
            journal.setenv_default(CUDA_MAX_CONNECTIONS_ENV, "1")
        except BaseException:
            journal.undo()
            if not compat_before:
                compat.uninstall()
            raise
        _journal = journal


def uninstall() -> None:
    """Revert every patch (used by tests; a process running Megatron should never need it).

    The compatibility layer :func:`install` put in place stays: it is not the adaptor's.
    """
    global _journal
    with _lock:
        if _journal is None:
            return
        _journal.undo()
        _journal = None


__all__ = ["CPUAdaptorError", "install", "uninstall", "is_installed"]
