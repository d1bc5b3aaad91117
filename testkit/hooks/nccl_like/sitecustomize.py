"""Test-only: every process group of the worker on the NCCL-like backend (testkit/nccl_like):
collectives with a dead or stopped peer spin until aborted, as on NCCL, instead of raising as on
gloo; work completes on a fake device's streams after the host call returns.

Put this folder first on PYTHONPATH (``testkit.hooks.pythonpath(NCCL_LIKE_DIR)``) and set
``NCCL_LIKE=1``; run Megatron with ``--distributed-backend nccl``. ``NCCL_LIKE_TORCH=2.1|2.4|2.6``
(default 2.6) picks the emulated torch release, ``NCCL_LIKE_ONE_QUEUE=1`` puts every stream on
one work queue, ``NCCL_LIKE_ASYNC_ERROR_S`` makes a dead peer an asynchronous NCCL error after
that many seconds (docs/rehearsal.md, "Collectives that spin"). The fault injector of
``../fault_hook`` still runs (this file executes it first); another hook chains this one by
executing this file (``testkit.import_hooks.run_hook_file``).
"""

from __future__ import annotations

from pathlib import Path

from testkit import nccl_like
from testkit.import_hooks import after_import, run_hook_file

run_hook_file(str(Path(__file__).resolve().parent.parent / "fault_hook" / "sitecustomize.py"))
if nccl_like.enabled():
    after_import("torch", lambda torch: nccl_like.install())
