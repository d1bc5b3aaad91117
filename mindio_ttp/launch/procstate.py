"""A process's scheduler state from ``/proc/PID/stat`` (Linux), for the launcher.

torch has the same helper only in recent releases (2.13 has it, 2.1.2 does not:
``torch.distributed.elastic.utils.process_state``, private), and ttprun must run on every torch
``setup.cfg`` admits.
"""

from __future__ import annotations

from typing import Optional


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
