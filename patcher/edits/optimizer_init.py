"""Edits 3.1-3.2: megatron/optimizer/__init__.py builds the replicated optimizer."""

from __future__ import annotations

import libcst as cst

from .base import InsertAfterAnchor, ReplaceAnchor

FILE = "megatron/optimizer/__init__.py"


class ImportReplicatedOptimizer(InsertAfterAnchor):
    """After the package's last import: `.distrib_optimizer` is loaded before ours subclasses it."""

    id = "optimizer/import-replicated"
    number = "3.1"
    file = FILE
    scope = None
    anchor = "from .optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer"
    inserted = "from mindio_ttp.megatron_ttp import ReplicatedOptimizer\n"
    summary = "import ReplicatedOptimizer"


class UseReplicatedOptimizer(ReplaceAnchor):
    """`opt_ty = DistributedOptimizer \\` becomes `ReplicatedOptimizer`, continuation kept."""

    id = "optimizer/replicated-opt-ty"
    number = "3.2"
    file = FILE
    scope = "get_megatron_optimizer"
    anchor = (
        "opt_ty = DistributedOptimizer \\\n"
        "    if args.use_distributed_optimizer else \\\n"
        "    Float16OptimizerWithFloat16Params"
    )
    replacement = anchor.replace("DistributedOptimizer", "ReplicatedOptimizer")
    summary = "opt_ty = ReplicatedOptimizer when --use-distributed-optimizer"

    def anchor_text(self) -> str:
        return "opt_ty = DistributedOptimizer \\"

    def rewrite(self, stmt: cst.BaseStatement) -> cst.BaseStatement:
        from .rewrites import SwapOptimizerClass

        return stmt.visit(SwapOptimizerClass())


EDITS = [ImportReplicatedOptimizer(), UseReplicatedOptimizer()]
