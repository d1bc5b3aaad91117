"""Folders of ``sitecustomize.py`` hooks that tests and benchmarks put on their workers'
PYTHONPATH, and the one way to build that PYTHONPATH (the repository root goes with it, so a
hook can import ``testkit`` in a worker started by ``ttprun``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAULT_HOOK_DIR = HERE / "fault_hook"
DIST_AUDIT_DIR = HERE / "dist_audit"
RSS_HOOK_DIR = HERE / "rss_hook"
FAKE_DEVICE_DIR = HERE / "fake_device"
HOSTNAME_HOOK_DIR = HERE / "hostname_hook"
PATCHER_HOOK_DIR = HERE / "patcher_hook"
OPTIM_MEMORY_DIR = HERE / "optim_memory"
STEP_PROFILE_DIR = HERE / "step_profile"


def pythonpath(*dirs: os.PathLike, env: Optional[Mapping[str, str]] = None) -> str:
    """``dirs`` first (Python runs only the first ``sitecustomize`` it finds), then the
    repository root, then whatever PYTHONPATH already held."""
    env = os.environ if env is None else env
    parts = [str(d) for d in dirs] + [str(REPO), env.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)
