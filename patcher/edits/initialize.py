"""Edits 6.1-6.2 (ttp-patch's, not the guide's): megatron/initialize.py takes its process-group
timeout from the runtime.

Megatron-LM 285068c hard-codes 10 minutes (`_initialize_distributed`, lines 174-177) and has no
`--distributed-timeout-minutes` yet, so with TTP_OT of 10 minutes or more the NCCL watchdog
aborted the survivors' communicators in the middle of the dying save, and no flag could say
otherwise. The patched call keeps Megatron's 10 minutes unless TTP_OT needs more
(`mindio_ttp.megatron_ttp.process_group_timeout`).
"""

from __future__ import annotations

import libcst as cst

from .base import InsertAfterAnchor, ReplaceAnchor

FILE = "megatron/initialize.py"


class ImportGlue(InsertAfterAnchor):
    """After `from datetime import timedelta`; the glue module imports nothing eagerly, so
    megatron/__init__.py (which imports this file) is not re-entered."""

    id = "initialize/import-ttp"
    number = "6.1"
    file = FILE
    scope = None
    anchor = "from datetime import timedelta"
    inserted = "import mindio_ttp.megatron_ttp as mega\n"
    summary = "import mindio_ttp.megatron_ttp as mega (ttp-patch's, not the guide's)"


class TimeoutFromRuntime(ReplaceAnchor):
    id = "initialize/pg-timeout"
    number = "6.2"
    file = FILE
    scope = "_initialize_distributed"
    anchor = (
        "torch.distributed.init_process_group(\n"
        "    backend=args.distributed_backend,\n"
        "    world_size=args.world_size, rank=args.rank,\n"
        "    timeout=timedelta(minutes=10))"
    )
    replacement = anchor.replace(
        "timeout=timedelta(minutes=10)", "timeout=mega.process_group_timeout(timedelta(minutes=10))"
    )
    summary = "process-group timeout at least TTP_OT + margin (ttp-patch's, not the guide's)"

    def anchor_text(self) -> str:
        return "timeout=timedelta(minutes=10))"

    def rewrite(self, stmt: cst.BaseStatement) -> cst.BaseStatement:
        from .rewrites import TimeoutFromRuntime as Wrap

        return stmt.visit(Wrap())


EDITS = [ImportGlue(), TimeoutFromRuntime()]
