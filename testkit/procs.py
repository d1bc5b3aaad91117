"""Processes a test starts together (ranks that rendezvous with each other) and waits for,
bounded, killing any still running at the end so none outlives the test."""

from __future__ import annotations

import subprocess
from typing import List, Sequence, Tuple


def run_together(cmds: Sequence[Sequence[str]], timeout: float,
                 **popen_kwargs) -> List[Tuple[int, str, str]]:
    """Start every command at once; (exit code, stdout, stderr) of each, in order."""
    procs = [subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, **popen_kwargs) for cmd in cmds]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
