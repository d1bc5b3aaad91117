"""Folders of ``sitecustomize.py`` hooks that tests and benchmarks put on their workers'
PYTHONPATH, and the one way to build that PYTHONPATH (the repository root goes with it, so a
hook can import ``testkit`` in a worker started by ``ttprun``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAULT_HOOK_DIR = HERE / "fault_hook"
DIST_AUDIT_DIR = HERE / "dist_audit"
RSS_HOOK_DIR = HERE / "rss_hook"
FAKE_DEVICE_DIR = HERE / "fake_device"
HOSTNAME_HOOK_DIR = HERE / "hostname_hook"
PATCHER_HOOK_DIR = HERE / "patcher_hook"
OPTIM_MEMORY_DIR = HERE / "optim_memory"
NCCL_LIKE_DIR = HERE / "nccl_like"
STEP_PROFILE_DIR = HERE / "step_profile"


def pythonpath(*dirs: os.PathLike, env: Optional[Mapping[str, str]] = None) -> str:
    """``dirs`` first (Python runs only the first ``sitecustomize`` it finds), then the
    repository root, then whatever PYTHONPATH already held."""
    env = os.environ if env is None else env
    parts = [str(d) for d in dirs] + [str(REPO), env.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


# The process-group backends a test or bench job runs on: gloo (a dead peer's collective
# raises) or the NCCL-like backend (testkit/nccl_like: it spins until aborted, as NCCL's does),
# optionally as in torch "2.1" / "2.4" / "2.6" ("nccl-like@2.1"; plain: the newest).
GLOO, NCCL_LIKE = "gloo", "nccl-like"


def backend_setup(backend: str) -> Tuple[Dict[str, str], List[str]]:
    """(worker environment, extra Megatron arguments) that run a job on `backend`, the fault
    hook included either way."""
    name, _, release = backend.partition("@")
    if name == GLOO and not release:
        return {"PYTHONPATH": pythonpath(FAULT_HOOK_DIR)}, []
    if name != NCCL_LIKE:
        raise ValueError(f"backend {backend!r}: {GLOO!r} or {NCCL_LIKE!r}[@2.1|@2.4|@2.6]")
    env = {"PYTHONPATH": pythonpath(NCCL_LIKE_DIR), "NCCL_LIKE": "1"}
    if release:
        env["NCCL_LIKE_TORCH"] = release
    return env, ["--distributed-backend", "nccl"]
