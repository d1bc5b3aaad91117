"""Edits 3.1-3.3: megatron/optimizer/__init__.py builds the replicated optimizer."""

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


class CheckOptimizerArgs(InsertAfterAnchor):
    """Not in the guide: without --use-distributed-optimizer, 3.2 never builds ours, and the
    guide's tree fails only at train(), inside the fault flow; this stops it here, plainly."""

    id = "optimizer/check-args"
    number = "3.3"
    file = FILE
    scope = "get_megatron_optimizer"
    anchor = "args = get_args()"
    inserted = (
        "# mindio_ttp needs --use-distributed-optimizer: say so now, not at train()\n"
        "from mindio_ttp.megatron_ttp import check_args\n"
        "check_args(args)\n"
    )
    summary = "refuse a run without --use-distributed-optimizer (ttp-patch's, not the guide's)"


EDITS = [ImportReplicatedOptimizer(), UseReplicatedOptimizer(), CheckOptimizerArgs()]
