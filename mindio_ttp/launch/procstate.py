"""A process's scheduler state from ``/proc/PID/stat`` (Linux), and a signal to a worker with
its children, for the launcher.

torch has the state helper only in recent releases (2.13 has it, 2.1.2 does not:
``torch.distributed.elastic.utils.process_state``, private), and ttprun must run on every torch
``setup.cfg`` admits.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional


def signal_worker(pid: int, sig: int) -> None:
    """Signal a worker and its children: its process group where it leads one (torch 2.13 starts
    each worker in a session of its own, as ttprun starts its replacements and spares); the
    worker alone where it does not (torch 2.1 starts them in the launcher's group, where a
    `killpg(pid)` reaches nobody). Quiet when it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def read_proc_state(pid: int) -> Optional[str]:
    """The state letter (``R``, ``S``, ``D``, ``T``, ``Z`` ...), or None when unreadable (not
    Linux, process gone). ``comm`` may hold spaces and parentheses: parse after the last ``)``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(")") + 1 :].split() if ")" in data else []
    return rest[0] if rest else None
