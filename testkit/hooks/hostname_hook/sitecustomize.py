"""Test-only: one machine plays several hosts. Each worker's ``socket.gethostname()`` answers
the name the test gives its global rank, so the runtime's partner-placement check sees a
multi-host job (the product reads no test switch: the test changes what the host says).

Put this folder first on PYTHONPATH and set ``TTP_FAKE_HOSTS=hostA,hostA,hostB,...`` (entry r
for global rank r, from torchrun's ``RANK``). The fault injector of ``../fault_hook`` still runs
(this file executes it first).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from testkit.import_hooks import run_hook_file

_HERE = Path(__file__).resolve().parent


def _install() -> None:
    hosts = os.environ.get("TTP_FAKE_HOSTS", "")
    rank = os.environ.get("RANK")
    if not hosts or rank is None:
        return  # the launcher itself, or not asked for
    name = hosts.split(",")[int(rank)]
    socket.gethostname = lambda: name


run_hook_file(str(_HERE.parent / "fault_hook" / "sitecustomize.py"))
_install()
